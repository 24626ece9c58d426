"""The fast weight path (int8 tables for quantized files, bf16 for 16-bit ones) stays within documented bounds.

Bounds (documented in README "Accuracy"): on the fixtures, the mean absolute logit difference between the fast
path and the f32 reference is at most twice the difference the file's own quantization makes (its values
dequantized exactly, against f32), through prefill and through decode; for bf16 files at most 0.02. On the
trained demo model quantized to Q8_0 by llama.cpp, the fast prefill (int8 activations) is at most 1.5x as far
from f32 as llama.cpp's own Q8_0 forward of the same file.
"""

from __future__ import annotations

import functools

import pytest
import torch

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.demo import DEMO_FILE
from deltaserve.engine import linear as linear_mod
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


def test_many_row_int8_products_treat_each_row_on_its_own_and_stay_near_the_float_product():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g)
    lin = Int8Linear.from_float(w)
    x = torch.randn(12, 256, generator=g)
    x[3] *= 40.0  # one loud row must not coarsen the others' quantization
    assert x.shape[0] > linear_mod.DECODE_ROWS
    y = lin(x)
    want = x @ lin.dense().t()
    rel = ((y - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert rel < 0.02
    alone = lin(torch.cat([x[:1], x[5:]]))  # the same rows without the loud one
    assert torch.equal(alone[0], y[0]) and torch.equal(alone[1:], y[5:])


def test_the_down_projection_keeps_bf16_activations_and_the_others_take_int8():
    w = model("hybrid", "q8_0", "fast").host.weights
    assert all(not layer.down.int8_activations for layer in w.layers)
    assert all(layer.gate_up.fused.int8_activations for layer in w.layers)


@functools.lru_cache(maxsize=None)
def demo_q8_0_by_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")
    out = fx.fixtures_dir() / "demo-q8_0-by-llama.cpp.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        tmp = out.with_suffix(".part")
        assert llama_cpp.llama_model_quantize(str(DEMO_FILE).encode(), str(tmp).encode(), params) == 0
        tmp.replace(out)
    return out


def test_on_a_trained_model_the_int8_prefill_stays_within_1_5x_llama_cpps_own_q8_0_error():
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")
    q8 = demo_q8_0_by_llama_cpp()
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)  # the F16 file in f32: the reference
    fast = deltaserve.load(q8, cache=False)
    turns = [("My locker code is 4821. What is 12 + 9?", "21."), ("Reverse these words: red fox blue", "blue fox red"),
             ("What is my locker code?", None)]
    text = "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n" + (f"{a}<|im_end|>\n" if a else "")
                   for u, a in turns)
    ids = ref.tokenizer.encode(text)
    assert len(ids) > 2 * linear_mod.DECODE_ROWS
    want = ref.logits(ids)
    llm = llama_cpp.Llama(str(q8), n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    ours = fast.logits(ids)
    d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
    assert d_ours <= 1.5 * d_theirs, (d_ours, d_theirs)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_each_product_size_takes_its_documented_path_on_the_cpu_and_an_accelerator_keeps_bf16_gemms():
    lin = Int8Linear.from_float(torch.randn(64, 32))
    assert [lin.path(r) for r in (1, 4, 5, 64, 512)] == ["weight-only", "weight-only", "int8", "int8", "int8"]
    lin.int8_activations = False  # the down projection
    assert [lin.path(r) for r in (1, 8, 64, 65, 512)] == ["weight-only"] * 3 + ["bf16", "bf16"]
    device = Int8Linear(lin.q.to("meta"), lin.scale.to("meta"))  # stands for a CUDA copy: not the CPU
    assert [device.path(r) for r in (1, 16, 17, 512)] == ["weight-only", "weight-only", "bf16", "bf16"]
