"""llama.cpp runs in a child process in every test (tests/llama_oracle.py): when it crashes, its own test fails
with the signal named and the session goes on (issue 13: an AMX fault in llama.cpp used to end the whole run
with rc 139 and no summary)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from deltaserve.demo import DEMO_FILE
from tests import llama_oracle as oracle

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import sys

from tests import llama_oracle as oracle


def test_llama_cpp_segfaults_after_loading_the_model():
    oracle.require()
    oracle.run([oracle.crash_after_load_request({model!r})])


def test_the_next_test_still_runs_in_a_session_that_never_loaded_libllama():
    assert "llama_cpp" not in sys.modules
'''


def test_an_oracle_that_crashes_fails_its_own_test_and_the_suite_goes_on(tmp_path):
    oracle.require()
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER.format(model=str(DEMO_FILE))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"rc {proc.returncode} (139 or negative: the session itself died)\n{out[-3000:]}"
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert "llama.cpp crashed in its child process (SIGSEGV, rc -11)" in out, out[-3000:]
    assert "reading through a null llama context after loading" in out and "GGML_NATIVE=OFF" in out, out[-3000:]


def test_no_test_module_imports_llama_cpp_into_the_pytest_process():
    """Only the oracle's child side (`_child` in llama_oracle.py) imports llama_cpp; no test module imports it,
    importorskips it or imports it by name."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        child = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_child"
                 and path.name == "llama_oracle.py" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in child:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                    getattr(node.func, "attr", getattr(node.func, "id", "")) in ("importorskip", "import_module",
                                                                               "__import__"):
                names = [str(node.args[0].value)]
            else:
                continue
            assert not any(n.split(".")[0] == "llama_cpp" for n in names), f"{path.name}:{node.lineno} imports llama_cpp"
