"""The same GGUF files through llama.cpp (llama-cpp-python): our logits agree with its logits.

llama.cpp runs in a child process (tests/llama_oracle.py): a crash in it fails the test, not the session."""

from __future__ import annotations

import pytest
import torch

import deltaserve
from tests import llama_oracle as oracle
from tests.fixtures import models as fx

oracle.require()  # skips the module where llama-cpp-python is not installed (without loading libllama here)

TOL = 2e-3


def llama_logits(*runs: tuple) -> list[torch.Tensor]:
    """llama.cpp's logits at every position for each (path, ids), all in one child process
    (n_ctx=512, n_batch=512, n_threads=2, seed=0, as before)."""
    out = oracle.run([oracle.logits_request(path, ids, n_ctx=512, n_batch=512) for path, ids in runs])
    return [torch.from_numpy(scores) for scores in out]


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("name", ["hybrid", "deep", "multimodal"])
def test_f32_logits_match_llama_cpp(name):
    path = fx.gguf_path(name, "f32")
    model = deltaserve.load(path)
    ids = prompt(model.tokenizer.vocab_size, 200, 7)
    ours = model.logits(ids)
    (theirs,) = llama_logits((path, ids))
    theirs = theirs[:, : ours.shape[1]]
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, f"max |ours - llama.cpp| = {diff:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name", ["hybrid", "deep"])
def test_our_q8_0_is_at_least_as_close_to_llama_cpp_q8_0_as_that_is_to_f32(name):
    f32, q8 = fx.gguf_path(name, "f32"), fx.gguf_path(name, "q8_0")
    model = deltaserve.load(q8, weights="exact")  # the file's own values, dequantized to f32
    ids = prompt(model.tokenizer.vocab_size, 200, 8)
    ours_q8 = model.logits(ids)
    llama_q8, llama_f32 = (t[:, : ours_q8.shape[1]] for t in llama_logits((q8, ids), (f32, ids)))
    ours_to_theirs = (ours_q8 - llama_q8).abs().max().item()
    quant_error = (llama_q8 - llama_f32).abs().max().item()
    assert quant_error > 0, "the Q8_0 file should differ from the f32 one"
    assert ours_to_theirs <= quant_error, (ours_to_theirs, quant_error)


def test_llama_cpp_reads_our_tokenizer_metadata_the_same_way():
    path = fx.gguf_path("hybrid", "f32")
    model = deltaserve.load(path)
    text = "Hello there! What is 12 + 30? <|im_start|>user\nhi<|im_end|>"
    theirs = oracle.tokenize(path, text, add_bos=False, special=True)
    assert model.tokenizer.encode(text) == theirs


@pytest.mark.parametrize("kind,tol", [("f16", 5e-3), ("bf16", 3e-2)])
def test_our_16_bit_conversions_load_in_llama_cpp_and_agree_with_us(kind, tol):
    """llama.cpp rounds activations to the weights' 16-bit type; we compute in f32: a mean bound."""
    path = fx.gguf_path("hybrid", kind)
    model = deltaserve.load(path, weights="exact")  # the file's 16-bit values, computed in f32
    ids = prompt(model.tokenizer.vocab_size, 120, 9)
    ours = model.logits(ids)
    (theirs,) = llama_logits((path, ids))
    theirs = theirs[:, : ours.shape[1]]
    assert (ours - theirs).abs().mean().item() < tol
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.9
