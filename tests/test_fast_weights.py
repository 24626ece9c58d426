"""The fast weight path (int8 tables for quantized files, bf16 for 16-bit ones) stays within documented bounds.

Bound (documented in README "Accuracy"): on the fixtures, the mean absolute logit difference between the fast
path and the f32 reference is at most twice the difference the file's own quantization makes (its values
dequantized exactly, against f32), through prefill and through decode; for bf16 files at most 0.02.
"""

from __future__ import annotations

import functools

import pytest
import torch

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.engine.linear import DenseLinear, Int8Linear
from tests.fixtures import models as fx


@functools.lru_cache(maxsize=None)
def model(name: str, kind: str, weights: str):
    return deltaserve.load(fx.gguf_path(name, kind), weights=weights, cache=False)


def ids_for(m, n=160, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.tokenizer.vocab_size, (n,), generator=g).tolist()


def decode_all(m, ids):
    f = Forward(m.config, m.host.weights)
    st = f.new_state(len(ids))
    return torch.stack([f.decode(st, t) for t in ids])


@pytest.mark.parametrize("name", ["hybrid", "deep"])
def test_the_fast_q8_0_path_stays_within_twice_the_files_own_quantization_error(name):
    fast, exact = model(name, "q8_0", "fast"), model(name, "q8_0", "exact")
    ref = model(name, "f32", "exact")
    assert isinstance(fast.host.weights.layers[0].gate_up.fused, Int8Linear)
    ids = ids_for(ref)
    want = ref.logits(ids)
    own = (exact.logits(ids) - want).abs().mean().item()
    for got in (fast.logits(ids), decode_all(fast, ids)):
        assert (got - want).abs().mean().item() <= 2 * own


def test_the_fast_bf16_path_stays_close_to_f32():
    fast = model("hybrid", "bf16", "fast")
    ref = model("hybrid", "f32", "exact")
    lw = fast.host.weights.layers[0].gate_up.fused
    assert isinstance(lw, DenseLinear) and lw.weight.dtype == torch.bfloat16
    ids = ids_for(ref)
    for got in (fast.logits(ids), decode_all(fast, ids)):
        assert (got - ref.logits(ids)).abs().mean().item() <= 0.02


def test_f32_files_stay_exact_on_the_fast_path():
    m = model("hybrid", "f32", "fast")
    assert m.host.weights.layers[0].gate_up.fused.weight.dtype == torch.float32


def test_an_int8_table_serves_both_the_embedding_and_the_tied_head():
    m = model("hybrid", "q8_0", "fast")
    w = m.host.weights
    assert isinstance(w.embed.table, Int8Linear) and w.lm_head is w.embed.table
    rows = w.embed.lookup(torch.tensor([3, 7]))
    assert torch.allclose(rows, w.lm_head.dense()[[3, 7]])
