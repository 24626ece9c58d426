"""llama.cpp (llama-cpp-python) as a test oracle, always in a child process.

llama.cpp is native code: where it faults (on a CPU that reports AMX, a llama.cpp built with GGML_NATIVE=ON
runs AMX tile instructions that fault in these VMs) the process it runs in dies with a signal. Run in the
pytest process, that took the whole session down (rc 139, no summary). Here every request runs in a child
Python process (this file run as a script, with only the standard library, numpy and llama_cpp); when the
child dies, the test that asked fails with the signal named and the child's last stderr lines, and the
session goes on. The pytest process never loads libllama: whether llama_cpp is installed is checked with
`importlib.util.find_spec`, which does not import it.

    from tests import llama_oracle as oracle
    oracle.require()                                     # skip where llama-cpp-python is not installed
    scores = oracle.logits(path, ids)                    # float32 [len(ids), n_vocab], one child
    req = oracle.logits_request(path, ids, kv_type="q8_0")  # llama.cpp's KV cache in q8_0 (with flash attention)
    a, b = oracle.run([oracle.logits_request(p, ids), oracle.logits_request(q, ids)], "...")  # one child, two
    rc = oracle.quantize(src, dst, "Q8_0")               # llama_model_quantize's return code

A request is a plain dict; one child runs a list of them in order (one model per (path, n_ctx, n_batch),
loaded once per child) and writes the results to a file in a temporary directory. Models load as the tests
always loaded them: `Llama(path, n_ctx, n_batch, logits_all=True, verbose=False, n_threads=2, seed=0)`; a request
with a `kv_type` adds `type_k`, `type_v` (that GGML type) and `flash_attn` (by default on for q8_0 alone: llama.cpp
quantizes its V cache only with flash attention, and its flash attention casts an f32 cache to f16).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REASON = "llama-cpp-python is a test dependency (see README)"
TIMEOUT_S = 600  # for one child: a hung llama.cpp fails its test instead of hanging the session
MARK = "[llama-oracle] "  # the child's progress lines on stderr: what it was doing when it died
# llama.cpp's KV cache types (`-ctk`/`-ctv`) as GGML type ids (ggml.h's enum ggml_type)
GGML_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}


def available() -> bool:
    """Whether llama_cpp is installed (found, not imported: the pytest process never loads libllama)."""
    return importlib.util.find_spec("llama_cpp") is not None


def require() -> None:
    """Skip (the module at import, or the test) where llama-cpp-python is not installed, as
    `pytest.importorskip("llama_cpp")` did, without importing it here."""
    if not available():
        import pytest

        pytest.skip(REASON, allow_module_level=True)


# -- requests ------------------------------------------------------------------------------------------

def logits_request(path, tokens, n_ctx: int = 512, n_batch: int = 512, kv_type: str | None = None,
                   flash_attn: bool | None = None) -> dict:
    """All positions' logits (float32 [len(tokens), n_vocab]) of one eval of `tokens` from an empty context.
    n_batch=1 evaluates one token per batch (llama.cpp's decode products). `kv_type` (f32, f16, bf16, q8_0): llama.cpp's
    KV cache in that type (None: its default, f16); `flash_attn` (None: on for q8_0 alone, which needs it)."""
    req = {"op": "logits", "path": str(Path(path).resolve()), "tokens": [int(t) for t in tokens],
           "n_ctx": n_ctx, "n_batch": n_batch}
    if kv_type is not None:
        req["kv_type"] = kv_type
        req["flash_attn"] = kv_type == "q8_0" if flash_attn is None else bool(flash_attn)
    return req


def tokenize_request(path, text: str, add_bos: bool = False, special: bool = True, n_ctx: int = 512,
                     n_batch: int = 512) -> dict:
    """llama.cpp's tokenization of `text` with the file's own tokenizer metadata: a list of ids."""
    return {"op": "tokenize", "path": str(Path(path).resolve()), "text": text, "add_bos": add_bos,
            "special": special, "n_ctx": n_ctx, "n_batch": n_batch}


def quantize_request(src, dst, ftype: str) -> dict:
    """llama_model_quantize(src -> dst) with LLAMA_FTYPE_MOSTLY_<ftype>: its return code (0 = done)."""
    return {"op": "quantize", "src": str(Path(src).resolve()), "dst": str(Path(dst).resolve()), "ftype": ftype}


def crash_after_load_request(path, n_ctx: int = 64, n_batch: int = 64) -> dict:
    """TEST HOOK (tests/test_oracle_isolation.py only): load `path`, then make llama.cpp itself read through a
    null context (llama_n_ctx(NULL)): a real SIGSEGV inside libllama, as an AMX fault is."""
    return {"op": "crash_after_load", "path": str(Path(path).resolve()), "n_ctx": n_ctx, "n_batch": n_batch}


def _describe(req: dict) -> str:
    op = req["op"]
    if op == "logits":
        kv = f", KV cache {req['kv_type']}{', flash attention' * req['flash_attn']}" if req.get("kv_type") else ""
        return (f"evaluating {len(req['tokens'])} tokens of {req['path']} "
                f"(n_ctx {req['n_ctx']}, n_batch {req['n_batch']}{kv})")
    if op == "tokenize":
        return f"tokenizing with the metadata of {req['path']}"
    if op == "quantize":
        return f"quantizing {req['src']} to {req['ftype']}"
    return f"{op} on {req.get('path', '?')}"


# -- the parent side -----------------------------------------------------------------------------------

def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _cpu_reports_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def _tail(text: str, lines: int = 15, chars: int = 2500) -> str:
    body = "\n".join(line for line in text.strip().splitlines() if not line.startswith(MARK))
    body = "\n".join(body.splitlines()[-lines:])[-chars:]
    return body or "(nothing)"


def run(requests: list[dict], what: str | None = None, timeout: float = TIMEOUT_S) -> list:
    """Run `requests` in order in one child process and return their results. When the child dies (a signal,
    a nonzero exit, the timeout), the calling test fails (pytest.fail) with what happened; nothing else."""
    require()
    import pytest

    with tempfile.TemporaryDirectory(prefix="llama-oracle-") as tmp:
        job, out = Path(tmp) / "job.pkl", Path(tmp) / "out.pkl"
        job.write_bytes(pickle.dumps(requests))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(job), str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
        except subprocess.TimeoutExpired as e:  # the child is killed by now
            proc, err = None, e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        if proc is None:
            pytest.fail(f"llama.cpp's child process did not finish in {timeout:g} s while "
                        f"{_doing(err, requests, what)}; it was killed (the test session goes on). Last lines of its "
                        f"stderr:\n{_tail(err)}", pytrace=False)
        doing = _doing(proc.stderr, requests, what)
        if proc.returncode < 0:
            amx = "this one does" if _cpu_reports_amx() else "this one does not"
            pytest.fail(f"llama.cpp crashed in its child process ({_signal_name(proc.returncode)}, rc "
                        f"{proc.returncode}) while {doing}; on a CPU that reports AMX ({amx}) this is llama.cpp's "
                        f"AMX kernel faulting in a VM: build llama-cpp-python with GGML_NATIVE=OFF (see README). "
                        f"The test session goes on. Last lines of the child's stderr:\n{_tail(proc.stderr)}",
                        pytrace=False)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"llama.cpp's child process failed (rc {proc.returncode}) while {doing}. Last lines of its "
                        f"stderr:\n{_tail(proc.stderr)}", pytrace=False)
        return pickle.loads(out.read_bytes())


def _doing(stderr: str, requests: list[dict], what: str | None) -> str:
    """What the child was doing: its last progress line, else the caller's words, else the first request."""
    marks = [line[len(MARK):] for line in (stderr or "").splitlines() if line.startswith(MARK)]
    if marks:
        return marks[-1]
    return what or (_describe(requests[0]) if requests else "starting")


def logits(path, tokens, n_ctx: int = 512, n_batch: int = 512):
    """float32 numpy [len(tokens), n_vocab]: every position's logits, computed in a child process."""
    return run([logits_request(path, tokens, n_ctx, n_batch)])[0]


def tokenize(path, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
    return run([tokenize_request(path, text, add_bos, special)])[0]


def quantize(src, dst, ftype: str) -> int:
    return run([quantize_request(src, dst, ftype)])[0]


# -- the child side (this file run as a script: no pytest, no torch, no deltaserve) ---------------------

def _child(job: Path, out: Path) -> None:
    faulthandler.enable()  # a fault prints the Python stack to stderr before the signal ends the process
    import numpy as np

    import llama_cpp

    models: dict = {}

    def model(req):
        kv_type = req.get("kv_type")
        key = (req["path"], req["n_ctx"], req["n_batch"], kv_type, req.get("flash_attn"))
        if key not in models:
            kv = {} if kv_type is None else {"type_k": GGML_KV_TYPES[kv_type], "type_v": GGML_KV_TYPES[kv_type],
                                             "flash_attn": req["flash_attn"]}
            models[key] = llama_cpp.Llama(req["path"], n_ctx=req["n_ctx"], n_batch=req["n_batch"], logits_all=True,
                                          verbose=False, n_threads=2, seed=0, **kv)
        return models[key]

    results = []
    for req in pickle.loads(job.read_bytes()):
        print(MARK + _describe(req), file=sys.stderr, flush=True)
        op = req["op"]
        if op == "logits":
            m = model(req)
            m.reset()
            m.eval(req["tokens"])
            results.append(np.array(m.scores[: len(req["tokens"])], dtype=np.float32))
        elif op == "tokenize":
            results.append(list(model(req).tokenize(req["text"].encode(), add_bos=req["add_bos"],
                                                    special=req["special"])))
        elif op == "quantize":
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{req['ftype']}")
            results.append(int(llama_cpp.llama_model_quantize(req["src"].encode(), req["dst"].encode(), params)))
        elif op == "crash_after_load":  # the test hook: a fault inside libllama once a model is loaded
            model(req)
            print(MARK + f"reading through a null llama context after loading {req['path']} (test hook)",
                  file=sys.stderr, flush=True)
            llama_cpp.llama_n_ctx(None)
            os.kill(os.getpid(), signal.SIGSEGV)  # only if a llama.cpp ever checks for NULL there: the same signal
            results.append(None)
        else:
            raise ValueError(f"unknown llama oracle request {op!r}")
    tmp = out.with_suffix(".part")
    tmp.write_bytes(pickle.dumps(results))
    os.replace(tmp, out)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
