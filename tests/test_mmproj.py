"""deltaserve.vision.mmproj: the vision tower from llama.cpp's projector GGUF (`convert_hf_to_gguf.py --mmproj`)
against the same tower read from the HF checkpoint (deltaserve.vision.model.load_vision).

The converter (taken once from the llama-cpp-python sdist, as tests/test_gguf_conformance.py does) runs on a copy
of the `vision` fixture that has a preprocessor_config.json (the converter needs the image mean and std from it):
the settings written there are the ones load_vision falls back to for the fixture itself, which has none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from deltaserve.errors import ModelFormatError
from deltaserve.vision.mmproj import load_mmproj
from deltaserve.vision.model import load_vision
from deltaserve.vision.preprocess import ProcessorConfig
from tests.fixtures import models as fx
from tests.test_gguf_conformance import llama_cpp_converter
from tests.test_vision import _picture

TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "q8_0": 2e-3}  # measured: 0, 1.6e-5, 5.4e-4 on features of 0.064


def _token_ids(directory: Path) -> tuple[int, int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tuple(tok.token_to_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert None not in ids
    return ids  # type: ignore[return-value]


@pytest.fixture(scope="module")
def hf_vision():
    return load_vision(fx.hf_dir("vision"), products="f32")  # the file's values compared: the exact route


def _with_preprocessor(src: Path, work: Path) -> Path:
    """`src`'s files linked into work/hf with a preprocessor_config.json (the converter reads the image mean and
    std from it): the settings load_vision falls back to for a fixture that has none."""
    hf = work / "hf"
    hf.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (hf / f.name).symlink_to(f)
    d = ProcessorConfig()
    (hf / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": list(d.mean), "image_std": list(d.std), "patch_size": d.patch_size,
        "temporal_patch_size": d.temporal_patch_size, "merge_size": d.merge_size,
        "size": {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}}))
    return hf


def _llama_convert(hf: Path, jobs: dict[Path, list[str]]) -> None:
    """llama.cpp's converter on `hf`, one run per output file and its arguments, side by side."""
    script = llama_cpp_converter()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, as shipped
    runs = {out: subprocess.Popen([sys.executable, str(script), str(hf), "--outfile", str(out), *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  cwd=script.parent)
            for out, args in jobs.items()}
    for out, proc in runs.items():
        said, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"convert_hf_to_gguf.py {' '.join(jobs[out])} failed (rc {proc.returncode}):\n"
                                 f"{said[-4000:]}")


@pytest.fixture(scope="module")
def projectors(tmp_path_factory) -> dict[str, Path]:
    """The fixture converted by llama.cpp's converter with --mmproj, f32 and f16 (the two runs side by side)."""
    work = tmp_path_factory.mktemp("mmproj")
    hf = _with_preprocessor(fx.hf_dir("vision"), work)
    out = {t: work / f"mmproj-{t}.gguf" for t in TOLERANCE}
    _llama_convert(hf, {path: ["--mmproj", "--outtype", t] for t, path in out.items()})
    return out


@pytest.mark.parametrize("out_type", list(TOLERANCE))
def test_the_projector_gguf_from_llama_cpps_converter_encodes_as_the_hf_tower(projectors, hf_vision, out_type):
    vision = load_mmproj(projectors[out_type], *_token_ids(fx.hf_dir("vision")), products="f32")
    images = [_picture(150, 90, 1), _picture(70, 200, 2)]
    want, want_grids = hf_vision.encode(images)
    got, grids = vision.encode(images)
    assert grids == want_grids == [(1, 6, 10), (1, 14, 4)]
    assert vision.encoder.config == hf_vision.encoder.config
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOLERANCE[out_type]
    # a q8_0 projector's products stay on its blocks (the trunk's kernels), the others are read as values
    assert {k for b in vision.encoder.blocks.values() for k in b.types} == ({"Q8_0"} if out_type == "q8_0" else set())
    if out_type == "q8_0":
        assert len(vision.encoder.blocks) == 4 * vision.encoder.config.depth + 2
        assert "Q8_0 weights on their own blocks" in vision.encoder.route()
        bf16 = load_mmproj(projectors[out_type], *_token_ids(fx.hf_dir("vision")), products="bf16")
        assert (bf16.encode(images)[0] - want).abs().max().item() <= 20 * TOLERANCE[out_type]
    assert (vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id) == \
        (hf_vision.image_token_id, hf_vision.vision_start_token_id, hf_vision.vision_end_token_id)


def test_every_f32_projector_tensor_is_the_checkpoints_with_the_patch_kernel_stacked_back_in_temporal_order(
        projectors, hf_vision):
    # a still image repeats itself over the temporal patch, so swapped temporal kernels would encode the same: the
    # weights themselves are compared
    vision = load_mmproj(projectors["f32"], *_token_ids(fx.hf_dir("vision")), products="f32")
    assert sorted(vision.encoder.w) == sorted(hf_vision.encoder.w)
    for name, want in hf_vision.encoder.w.items():
        assert torch.equal(vision.encoder.w[name], want), name


def test_the_projectors_processor_settings_are_the_checkpoints(projectors, hf_vision):
    got = asdict(load_mmproj(projectors["f16"], *_token_ids(fx.hf_dir("vision"))).processor)
    want = asdict(hf_vision.processor)
    for key in ("mean", "std"):  # the GGUF holds them as float32, which is how preprocess uses them
        assert np.array_equal(np.float32(got.pop(key)), np.float32(want.pop(key))), key
    # the file carries no pixel bounds: llama.cpp's for these projectors, 8 to 4096 merged tokens of 28 x 28 pixels
    assert (got.pop("min_pixels"), got.pop("max_pixels")) == (8 * 28 * 28, 4096 * 28 * 28)
    want.pop("min_pixels"), want.pop("max_pixels")
    assert got == want


def test_pixel_bounds_given_by_the_caller_override_the_defaults(projectors):
    vision = load_mmproj(projectors["f32"], 1, None, None, min_pixels=65536, max_pixels=16777216)
    assert (vision.processor.min_pixels, vision.processor.max_pixels) == (65536, 16777216)


def test_a_model_gguf_is_refused_as_no_projector():
    with pytest.raises(ModelFormatError, match=r"not a projector GGUF \(general.architecture is 'qwen35'"):
        load_mmproj(fx.gguf_path("hybrid", "f32"), 1, 2, 3)


@pytest.mark.parametrize("projector_type, deepstack, message", [
    ("qwen2.5vl_merger", [False, False], r"projector type 'qwen2.5vl_merger', not a Qwen3.5"),
    ("qwen3vl_merger", [False, True], r"deepstack mergers \(layers \[1\]\)"),
])
def test_a_projector_of_another_tower_is_refused(tmp_path, projector_type, deepstack, message):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_array("clip.vision.is_deepstack_layers", deepstack)
    w.add_tensor("v.post_ln.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match=message):
        load_mmproj(path, 1, 2, 3)


def test_a_gguf_model_with_llama_cpps_projector_answers_about_an_image_as_the_hf_directory_does(projectors):
    """The model as a GGUF file (deltaserve convert; llama.cpp's converter does not know the fixture's small
    tokenizer) and its projector as llama.cpp's converter writes it (`--mmproj`), loaded together: a chat turn with
    an image gives the HF directory's tokens."""
    import deltaserve

    pair = deltaserve.load(fx.gguf_path("vision", "f32"), mmproj=projectors["f32"], cache=False)
    hf = deltaserve.load(fx.hf_dir("vision"), cache=False)
    messages = [{"role": "user", "content": [{"type": "image", "image": _picture(150, 90, 3)},
                                             {"type": "text", "text": "Describe it."}]}]
    turns = [m.session(quiet=True).chat(messages, max_tokens=5, enable_thinking=False) for m in (pair, hf)]
    assert turns[0].tokens == turns[1].tokens and turns[0].prompt_tokens == turns[1].prompt_tokens
    assert pair.host.vision.encoder.config == hf.host.vision.encoder.config


def test_the_gguf_pair_both_from_llama_cpps_converter_answers_about_an_image_as_transformers_does(tmp_path):
    """Both files as llama.cpp's converter writes them for a checkpoint with the real vocabulary (the model with
    --no-mtp, its projector with --mmproj): an image turn's tokens are the HF directory's, and its first one is
    transformers' argmax over the same prompt."""
    import deltaserve
    from tests.test_vision import _reference

    src = fx.hf_dir("vision_real_vocab")
    hf = _with_preprocessor(src, tmp_path)
    model, mmproj = tmp_path / "model-f32.gguf", tmp_path / "mmproj-f32.gguf"
    _llama_convert(hf, {model: ["--outtype", "f32", "--no-mtp"], mmproj: ["--mmproj", "--outtype", "f32"]})
    pair = deltaserve.load(model, mmproj=mmproj, cache=False)
    ref = deltaserve.load(src, cache=False)
    image = _picture(150, 90, 4)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    turns = [m.session(quiet=True).chat(messages, max_tokens=4, enable_thinking=False) for m in (pair, ref)]
    assert turns[0].tokens == turns[1].tokens and turns[0].prompt_tokens == turns[1].prompt_tokens
    session = pair.session(quiet=True)
    ids, _ = session.render(messages, enable_thinking=False)
    vision = pair.host.vision
    real = [vision.image_token_id if t >= pair.config.vocab_size else t for t in ids]
    assert real.count(vision.image_token_id) == vision.tokens(image)
    want = _reference(fx.load_hf_model("vision_real_vocab"), vision, real, [image])[-1]
    assert int(want.argmax()) == turns[0].tokens[0]
