"""The same GGUF files through llama.cpp (llama-cpp-python): our logits agree with its logits."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import deltaserve
from tests.fixtures import models as fx

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")

TOL = 2e-3


@functools.lru_cache(maxsize=None)
def llama(path: str):
    return llama_cpp.Llama(path, n_ctx=512, n_batch=512, logits_all=True, verbose=False, n_threads=2, seed=0)


def llama_logits(path, ids: list[int]) -> torch.Tensor:
    m = llama(str(path))
    m.reset()
    m.eval(ids)
    scores = np.array(m.scores[: len(ids)], dtype=np.float32)
    return torch.from_numpy(scores)


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("name", ["hybrid", "deep", "multimodal"])
def test_f32_logits_match_llama_cpp(name):
    path = fx.gguf_path(name, "f32")
    model = deltaserve.load(path)
    ids = prompt(model.tokenizer.vocab_size, 200, 7)
    ours = model.logits(ids)
    theirs = llama_logits(path, ids)[:, : ours.shape[1]]
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, f"max |ours - llama.cpp| = {diff:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name", ["hybrid", "deep"])
def test_our_q8_0_is_at_least_as_close_to_llama_cpp_q8_0_as_that_is_to_f32(name):
    f32, q8 = fx.gguf_path(name, "f32"), fx.gguf_path(name, "q8_0")
    model = deltaserve.load(q8, weights="exact")  # the file's own values, dequantized to f32
    ids = prompt(model.tokenizer.vocab_size, 200, 8)
    ours_q8 = model.logits(ids)
    llama_q8 = llama_logits(q8, ids)[:, : ours_q8.shape[1]]
    llama_f32 = llama_logits(f32, ids)[:, : ours_q8.shape[1]]
    ours_to_theirs = (ours_q8 - llama_q8).abs().max().item()
    quant_error = (llama_q8 - llama_f32).abs().max().item()
    assert quant_error > 0, "the Q8_0 file should differ from the f32 one"
    assert ours_to_theirs <= quant_error, (ours_to_theirs, quant_error)


def test_llama_cpp_reads_our_tokenizer_metadata_the_same_way():
    path = fx.gguf_path("hybrid", "f32")
    model = deltaserve.load(path)
    text = "Hello there! What is 12 + 30? <|im_start|>user\nhi<|im_end|>"
    theirs = llama(str(path)).tokenize(text.encode(), add_bos=False, special=True)
    assert model.tokenizer.encode(text) == theirs


@pytest.mark.parametrize("kind,tol", [("f16", 5e-3), ("bf16", 3e-2)])
def test_our_16_bit_conversions_load_in_llama_cpp_and_agree_with_us(kind, tol):
    """llama.cpp rounds activations to the weights' 16-bit type; we compute in f32: a mean bound."""
    path = fx.gguf_path("hybrid", kind)
    model = deltaserve.load(path, weights="exact")  # the file's 16-bit values, computed in f32
    ids = prompt(model.tokenizer.vocab_size, 120, 9)
    ours = model.logits(ids)
    theirs = llama_logits(path, ids)[:, : ours.shape[1]]
    assert (ours - theirs).abs().mean().item() < tol
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.9
