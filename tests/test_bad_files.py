"""Bad model files get one clear line naming what was expected and what was found, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import deltaserve
from deltaserve.errors import ModelFormatError
from tests.gguf_edit import rewrite


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", *args], capture_output=True, text=True, timeout=300)


def assert_one_clear_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("deltaserve: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, hybrid_gguf):
    d = tmp_path_factory.mktemp("bad")
    size = hybrid_gguf.stat().st_size
    truncated = d / "truncated.gguf"
    truncated.write_bytes(hybrid_gguf.read_bytes()[: size // 2])
    header_cut = d / "header-cut.gguf"
    header_cut.write_bytes(hybrid_gguf.read_bytes()[:200])
    text = d / "notes.gguf"
    text.write_text("this is a text file, not a model\n")
    empty = d / "empty.gguf"
    empty.write_bytes(b"")
    return {
        "truncated": truncated,
        "header_cut": header_cut,
        "text": text,
        "empty": empty,
        "llama": rewrite(hybrid_gguf, d / "llama.gguf", arch="llama"),
        "moe": rewrite(hybrid_gguf, d / "moe.gguf", arch="qwen35moe"),
        "missing": rewrite(hybrid_gguf, d / "missing.gguf", drop="blk.1.ssm_a"),
        "shape": rewrite(hybrid_gguf, d / "shape.gguf", reshape=("blk.3.attn_q.weight", 64)),
    }


def test_a_truncated_gguf_names_the_byte_counts(bad):
    line = assert_one_clear_line(run_cli("inspect", str(bad["truncated"])), "truncated GGUF", "bytes")
    assert str(bad["truncated"].stat().st_size) in line


def test_a_gguf_cut_inside_its_header_is_called_truncated(bad):
    assert_one_clear_line(run_cli("run", str(bad["header_cut"]), "-p", "hi"), "truncated GGUF")


def test_a_file_that_is_not_gguf_says_what_it_starts_with(bad):
    assert_one_clear_line(run_cli("run", str(bad["text"]), "-p", "hi"), "not a GGUF", "b'GGUF'", "b'this'")
    assert_one_clear_line(run_cli("run", str(bad["empty"]), "-p", "hi"), "not a GGUF")


def test_another_architecture_is_named(bad):
    assert_one_clear_line(run_cli("run", str(bad["llama"]), "-p", "hi"), "'qwen35'", "'qwen35moe'", "'llama'")


def test_a_dense_file_labelled_as_the_moe_sibling_names_the_expert_count_it_lacks(bad):
    assert_one_clear_line(run_cli("inspect", str(bad["moe"])), "'qwen35moe.expert_count'", "qwen35moe file")


def test_a_missing_tensor_is_named_with_its_expected_shape(bad):
    assert_one_clear_line(run_cli("run", str(bad["missing"]), "-p", "hi"), "missing tensor blk.1.ssm_a", "(4,)")


def test_a_tensor_of_the_wrong_shape_names_both_shapes(bad):
    assert_one_clear_line(run_cli("run", str(bad["shape"]), "-p", "hi"),
                          "blk.3.attn_q.weight", "(64, 64)", "(256, 64)")


def test_a_path_that_does_not_exist_is_named(tmp_path):
    assert_one_clear_line(run_cli("run", str(tmp_path / "nope.gguf"), "-p", "hi"), "nope.gguf")


def test_an_hf_directory_of_another_model_is_refused(tmp_path, hybrid_hf_dir):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert_one_clear_line(run_cli("inspect", str(d)), "Qwen3.5", "'llama'")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_clear_line(run_cli("inspect", str(empty)), "config.json")


def test_an_hf_directory_with_a_missing_shard_is_refused(tmp_path, hybrid_hf_dir):
    d = tmp_path / "sharded"
    shutil.copytree(hybrid_hf_dir, d)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    assert_one_clear_line(run_cli("inspect", str(d)), "model-00002-of-00002.safetensors")


def test_the_library_raises_model_format_errors_not_crashes(bad):
    for key in ("truncated", "text", "llama", "missing", "shape"):
        with pytest.raises(ModelFormatError):
            deltaserve.load(bad[key], cache=False)
