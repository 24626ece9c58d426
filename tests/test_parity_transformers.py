"""The forward computes what transformers' Qwen3.5 computes (f32), from the HF directory and from the GGUF."""

from __future__ import annotations

import functools

import pytest
import torch

import deltaserve
from deltaserve.engine.forward import Forward
from tests.fixtures import models as fx

TOL = 2e-3
LENGTHS = (1, 63, 64, 65, 230)
FIXTURES = ("hybrid", "deep", "multimodal")


@functools.lru_cache(maxsize=None)
def oracle(name: str):
    return fx.load_hf_model(name)


@functools.lru_cache(maxsize=None)
def ours(name: str, source: str):
    path = fx.hf_dir(name) if source == "hf" else fx.gguf_path(name, "f32")
    return deltaserve.load(path)


def prompt(name: str, length: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + length)
    vocab = ours(name, "hf").tokenizer.vocab_size
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@functools.lru_cache(maxsize=None)
def reference_logits(name: str, length: int) -> torch.Tensor:
    ids = torch.tensor([prompt(name, length)])
    with torch.no_grad():
        return oracle(name)(input_ids=ids).logits[0].float()


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.2e} > {TOL}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "argmax differs"


def test_the_fixtures_have_logits_of_about_half_a_unit_of_spread():
    for name in FIXTURES:
        std = reference_logits(name, 230).std().item()
        assert 0.3 < std < 0.8, (name, std)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("length", LENGTHS)
def test_one_prefill_matches_transformers(name, source, length):
    assert_matches(ours(name, source).logits(prompt(name, length)), reference_logits(name, length))


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("length", [1, 65, 230])
def test_token_by_token_decode_matches_transformers(name, source, length):
    m = ours(name, source)
    f = Forward(m.config, m.host.weights)
    state = f.new_state(length)
    rows = torch.stack([f.decode(state, t) for t in prompt(name, length)])
    assert_matches(rows, reference_logits(name, length))


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("cuts", [(1,), (63,), (64,), (65,), (17, 80, 81, 200), (3, 4, 5, 130)])
def test_a_prefill_split_at_arbitrary_points_matches_transformers(name, source, cuts):
    m = ours(name, source)
    ids = prompt(name, 230)
    f = Forward(m.config, m.host.weights)
    state = f.new_state(230)
    pieces, last = [], 0
    for cut in (*cuts, 230):
        pieces.append(f.prefill(state, ids[last:cut], all_logits=True))
        last = cut
    assert state.length == 230
    assert_matches(torch.cat(pieces), reference_logits(name, 230))


def test_prefill_and_decode_agree_after_a_long_prefill_spanning_many_chunks():
    m = ours("hybrid", "gguf")
    ids = prompt("hybrid", 230) * 3  # 690 tokens: 11 chunks of 64, a partial last one
    f = Forward(m.config, m.host.weights)
    a = f.new_state(700)
    chunked = f.prefill(a, ids, all_logits=True)
    b = f.new_state(700)
    stepped = torch.stack([f.decode(b, t) for t in ids])
    assert (chunked - stepped).abs().max().item() <= TOL
    for i in a.ssm:
        assert torch.allclose(a.ssm[i], b.ssm[i], atol=1e-4)


def test_a_prefill_in_several_forward_calls_equals_one_call():
    m = ours("deep", "gguf")
    ids = prompt("deep", 230)
    f = Forward(m.config, m.host.weights)
    whole = f.prefill(f.new_state(230), ids, all_logits=True)
    pieces = f.prefill(f.new_state(230, prefill_rows=64, query_rows=16), ids, all_logits=True)
    assert (whole - pieces).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["hybrid", "deep", "multimodal"])
def test_a_batched_decode_of_several_sequences_equals_decoding_each_alone(name):
    m = ours(name, "gguf")
    f = Forward(m.config, m.host.weights)
    prompts = [prompt(name, n)[:n] for n in (5, 63, 64, 130)]
    alone, batch = [], []
    for p in prompts:
        s = f.new_state(200)
        f.prefill(s, p)
        alone.append([f.decode(s, t) for t in (7, 8, 9)])
        s2 = f.new_state(200)
        f.prefill(s2, p)
        batch.append(s2)
    for step, t in enumerate((7, 8, 9)):
        rows = f.decode_batch(batch, [t] * len(batch))
        for j in range(len(batch)):
            assert (rows[j] - alone[j][step]).abs().max().item() <= 1e-4
    assert [s.length for s in batch] == [len(p) + 3 for p in prompts]


def test_a_sharded_hf_directory_loads_like_the_single_file(tmp_path):
    import shutil

    src = fx.hf_dir("deep")
    model = oracle("deep")
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="100KB")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    ids = prompt("deep", 65)
    assert_matches(deltaserve.load(out, cache=False).logits(ids), reference_logits("deep", 65))
