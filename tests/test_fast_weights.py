"""The fast weight path (int8 tables for quantized files, bf16 for 16-bit ones) stays within documented bounds.

Bounds (documented in README "Accuracy"): on the fixtures, the mean absolute logit difference between the fast
path and the f32 reference is at most twice the difference the file's own quantization makes (its values
dequantized exactly, against f32), through prefill and through decode; for bf16 files at most 0.02. On the
trained demo model quantized to Q8_0 by llama.cpp, the fast prefill (int8 activations) is at most 1.5x as far
from f32 as llama.cpp's own Q8_0 forward of the same file.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.demo import DEMO_FILE
from deltaserve.engine import linear as linear_mod
from deltaserve.engine import native
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
    x = torch.randn(14, 256, generator=g)
    x[3] *= 40.0  # one loud row must not coarsen the others' quantization
    assert lin.path(14) == lin.path(10) == "int8"
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
def demo_by_llama_cpp(ftype: str, name: str):
    """The trained demo model quantized by llama.cpp itself (LLAMA_FTYPE_MOSTLY_<ftype>), cached."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")
    out = fx.fixtures_dir() / f"demo-{name}-by-llama.cpp.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        tmp = out.with_suffix(".part")
        assert llama_cpp.llama_model_quantize(str(DEMO_FILE).encode(), str(tmp).encode(), params) == 0
        tmp.replace(out)
    return out


def demo_q8_0_by_llama_cpp():
    return demo_by_llama_cpp("Q8_0", "q8_0")


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


def test_on_a_trained_model_the_decode_steps_stay_within_1_5x_llama_cpps_own_q8_0_error():
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")
    q8 = demo_q8_0_by_llama_cpp()
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    fast = deltaserve.load(q8, cache=False)
    ids = ref.tokenizer.encode("<|im_start|>user\nMy locker code is 4821. Reverse these words: red fox blue"
                               "<|im_end|>\n<|im_start|>assistant\nblue fox red<|im_end|>\n")
    want = ref.logits(ids)
    llm = llama_cpp.Llama(str(q8), n_ctx=128, n_batch=1, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)  # one token per batch: llama.cpp's decode products
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    ours = decode_all(fast, ids)  # one token per step: the decode route (the native kernel where it runs)
    d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
    assert d_ours <= 1.5 * d_theirs, (d_ours, d_theirs)
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


def test_the_native_kernel_matches_the_float_product_for_every_row_count_and_odd_sizes():
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    g = torch.Generator().manual_seed(11)
    for n, k in ((37, 96), (64, 160), (1031, 1024)):  # rows not a multiple of 4; inner sizes with a half chunk
        lin = Int8Linear.from_float(torch.randn(n, k, generator=g))
        for m in (1, 2, 3, 8):
            x = torch.randn(m, k, generator=g)
            x[0, 5] = 30.0  # an outlier only coarsens its own block of 32
            y = native.linear_i8(x, lin.q, lin.scale)
            blocks = x.double().view(m, k // 32, 32)
            d = blocks.abs().amax(-1, keepdim=True) / 127
            xq = (torch.round(blocks * (127 / blocks.abs().amax(-1, keepdim=True))) * d).view(m, k)
            claimed = xq @ lin.dense().double().t()  # the arithmetic it claims: int8 per block of 32
            assert y.shape == (m, n)
            assert ((y - claimed).norm(dim=1) / claimed.norm(dim=1)).max().item() < 1e-5
            want = x.double() @ lin.dense().double().t()
            assert ((y - want).norm(dim=1) / want.norm(dim=1)).max().item() < 0.02
            for i in range(m):  # each row on its own: the same as alone
                assert torch.equal(native.linear_i8(x[i:i + 1], lin.q, lin.scale)[0], y[i])
        strided = torch.randn(4, 2 * k, generator=g)[:, ::2]
        assert torch.equal(native.linear_i8(strided, lin.q, lin.scale), native.linear_i8(strided.contiguous(), lin.q,
                                                                                         lin.scale))
        bf16 = torch.randn(2, k, generator=g).bfloat16()
        assert torch.equal(native.linear_i8(bf16, lin.q, lin.scale), native.linear_i8(bf16.float(), lin.q, lin.scale))


def test_the_native_row_quantization_and_product_epilogue_are_bit_for_bit_torchs():
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    g = torch.Generator().manual_seed(8)
    for m, k in ((512, 1024), (7, 100), (3, 17)):  # row lengths with and without a partial vector
        x = torch.randn(m, 2 * k, generator=g)[:, :k] * 3  # rows with a stride
        x[0] = 0.0  # an all-zero row keeps the smallest scale, as in torch
        q, s = native.quantize_rows(x)
        q0, s0 = linear_mod.quantize_rows_int8(x)
        assert torch.equal(q, q0) and torch.equal(s, s0)
        acc = torch.randint(-(1 << 20), 1 << 20, (m, 33), dtype=torch.int32, generator=g)
        col, row = torch.rand(33, generator=g), torch.rand(m, generator=g)
        assert torch.equal(native.scale_product(acc, col, row), torch.mul(acc, col).mul_(row[:, None]))


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random Q4_K / Q6_K blocks with finite scales: uint8 [rows, cols / 256 * block bytes]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size = native.BLOCK_TYPES[kind][1]
    b = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":
        b[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # d
        b[:, 2:4] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)  # dmin
    else:
        b[:, 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # d
    return torch.from_numpy(b.reshape(rows, -1))


def test_the_native_kernel_reads_q4_k_and_q6_k_blocks_as_the_file_defines_them():
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    from gguf import GGMLQuantizationType

    from deltaserve.model import quant

    g = torch.Generator().manual_seed(4)
    for kind in ("Q4_K", "Q6_K"):
        n, k = 67, 512
        blocks = random_blocks(kind, n, k, seed=len(kind))
        w = quant.dequantize(blocks.numpy(), GGMLQuantizationType[kind], (n, k)).double()  # the oracle's reading
        for m in (1, 2, 8):
            x = torch.randn(m, k, generator=g)
            y = native.linear_blocks(x, kind, blocks, n)
            blocks_x = x.double().view(m, k // 256, 256)  # the claimed arithmetic: int8 per 256 values
            amax = blocks_x.abs().amax(-1, keepdim=True)
            xq = (torch.round(blocks_x * (127 / amax)) * (amax / 127)).view(m, k)
            claimed = xq @ w.t()
            assert y.shape == (m, n)
            assert ((y - claimed).norm(dim=1) / claimed.norm(dim=1)).max().item() < 1e-5, kind
            want = x.double() @ w.t()
            assert ((y - want).norm(dim=1) / want.norm(dim=1)).max().item() < 0.02, kind
            packed_kind, packed = native.for_products(kind, blocks)  # Q4_K: repacked once at load
            assert torch.allclose(native.linear_blocks(x, packed_kind, packed, n), y, rtol=1e-5, atol=1e-5), packed_kind
        assert native.linear_blocks(torch.randn(9, k), kind, blocks, n) is None  # more rows than it takes
        assert native.linear_blocks(torch.randn(1, 96), kind, blocks[:, :1], n) is None  # not whole blocks


def test_a_q4_k_m_file_decodes_from_its_own_blocks_within_1_5x_llama_cpps_own_error():
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is a test dependency (see README)")
    path = demo_by_llama_cpp("Q4_K_M", "q4_k_m")
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    fast = deltaserve.load(path, cache=False)
    w = fast.host.weights
    assert w.lm_head.block_kind == "Q6_K" and w.layers[0].gate_up.fused.block_kind == "Q4_K"
    if native.status()[0]:
        assert w.lm_head.path(1) == "native"
    ids = ref.tokenizer.encode("<|im_start|>user\nMy locker code is 4821. Reverse these words: red fox blue"
                               "<|im_end|>\n<|im_start|>assistant\nblue fox red<|im_end|>\n")
    want = ref.logits(ids)
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=1, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    ours = decode_all(fast, ids)
    d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
    assert d_ours <= 1.5 * d_theirs, (d_ours, d_theirs)
    agree = lambda got: (got.argmax(-1) == want.argmax(-1)).float().mean().item()  # noqa: E731
    assert agree(ours) >= agree(theirs) - 0.05
    f = Forward(fast.config, w)  # a batch of three conversations reads the same blocks, three rows at a time
    trio = [f.new_state(len(ids)) for _ in range(3)]
    batched = torch.stack([f.decode_batch(trio, [t, t, t]) for t in ids])
    for j in range(3):
        assert (batched[:, j] - ours).abs().mean().item() <= 1e-3 * (ours - want).abs().mean().item() + 1e-6


@pytest.mark.parametrize("source", ["hf", "gguf"])  # value heads grouped (HF) and tiled (GGUF) over key heads
def test_the_native_deltanet_step_and_conv_follow_the_torch_versions_on_either_head_order(source, monkeypatch):
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    from deltaserve.engine import layers

    m = deltaserve.load(fx.hf_dir("hybrid") if source == "hf" else fx.gguf_path("hybrid", "f32"), cache=False)
    assert m.config.linear_num_value_heads > m.config.linear_num_key_heads
    ids = ids_for(m, n=24)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(layers, "NATIVE_STEP", on)
        f = Forward(m.config, m.host.weights)
        one, pair = f.new_state(64), [f.new_state(64), f.new_state(64)]
        rows = [f.decode(one, t) for t in ids]
        batched = [f.decode_batch(pair, [t, ids[-1 - i]]) for i, t in enumerate(ids)]
        prefilled = f.new_state(64)
        f.prefill(prefilled, ids[:5])  # the prefill's conv (a span shorter than the conv's window, then longer)
        span = f.prefill(prefilled, ids[5:], all_logits=True)
        runs[on] = (torch.stack(rows), torch.stack(batched), one, pair, span, prefilled)
    (rows, batched, one, pair, span, prefilled), (rows0, batched0, one0, pair0, span0, prefilled0) = runs[True], \
        runs[False]
    assert torch.allclose(span, span0, atol=1e-4, rtol=1e-4)
    for i in prefilled.conv:
        assert torch.allclose(prefilled.conv[i], prefilled0.conv[i], atol=1e-5, rtol=1e-4)
    assert torch.allclose(rows, rows0, atol=1e-4, rtol=1e-4)
    assert torch.allclose(batched, batched0, atol=1e-4, rtol=1e-4)
    for i in one.ssm:
        for a, b in ((one, one0), (pair[1], pair0[1])):
            assert torch.allclose(a.ssm[i], b.ssm[i], atol=1e-5, rtol=1e-4)
            assert torch.allclose(a.conv[i], b.conv[i], atol=1e-5, rtol=1e-4)


def test_without_the_native_kernel_the_backend_says_why_and_decodes_on_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    native.reset()
    try:
        ok, why = native.status()
        if "lacks" not in why:
            assert not ok and why.startswith("false failed on native.c"), why
        lin = Int8Linear.from_float(torch.randn(8, 64))
        assert lin.path(1) == "weight-only"
        m = model("hybrid", "q8_0", "fast")
        assert "torch's weight-only kernel (native kernel not used: " in m.session().notices[-1]
        monkeypatch.setenv("DELTASERVE_NATIVE", "off")
        native.reset()
        assert native.status() == (False, "turned off by DELTASERVE_NATIVE")
    finally:
        native.reset()
        monkeypatch.undo()
    if native.status()[0]:
        assert "on the native kernel (AVX512-VNNI" in model("hybrid", "q8_0", "fast").session().notices[-1]


def test_each_product_size_takes_its_documented_path_on_the_cpu_and_an_accelerator_keeps_bf16_gemms(monkeypatch):
    lin = Int8Linear.from_float(torch.randn(64, 32))
    if native.status()[0]:
        assert [lin.path(r) for r in (1, 8, 9, 512)] == ["native", "native", "int8", "int8"]
        assert Int8Linear.from_float(torch.randn(64, 48)).path(1) == "weight-only"  # inner size not a multiple of 32
    monkeypatch.setattr(native, "takes", lambda k: False)  # where the native kernel does not run
    assert [lin.path(r) for r in (1, 4, 5, 64, 512)] == ["weight-only", "weight-only", "int8", "int8", "int8"]
    lin.int8_activations = False  # the down projection
    assert [lin.path(r) for r in (1, 8, 64, 65, 512)] == ["weight-only"] * 3 + ["bf16", "bf16"]
    device = Int8Linear(lin.q.to("meta"), lin.scale.to("meta"))  # stands for a CUDA copy: not the CPU
    assert [device.path(r) for r in (1, 16, 17, 512)] == ["weight-only", "weight-only", "bf16", "bf16"]


def int8_everywhere(m):
    """A loaded float model's weights with every projection and the head as int8 tables (any head order)."""
    from deltaserve.engine.linear import StackedLinear
    from deltaserve.model.weights import AttentionWeights, LayerWeights, Weights

    def q(lin):
        if isinstance(lin, StackedLinear):
            parts = torch.split(lin.dense().float(), list(lin.sizes))
            return StackedLinear([Int8Linear.from_float(p) for p in parts])
        return Int8Linear.from_float(lin.dense().float())

    w = m.host.weights
    layers = []
    for lw in w.layers:
        mx = lw.mixer
        if isinstance(mx, AttentionWeights):
            mixer = dataclasses.replace(mx, qkv=q(mx.qkv), o=q(mx.o))
        else:
            mixer = dataclasses.replace(mx, in_proj=q(mx.in_proj), out=q(mx.out))
        layers.append(LayerWeights(lw.attn_norm, lw.post_norm, mixer, q(lw.gate_up), q(lw.down)))
    return Weights(w.embed, layers, w.final_norm, q(w.lm_head))


@pytest.mark.parametrize("source", ["hf", "gguf"])  # value heads grouped (HF) and tiled (GGUF) over key heads
def test_the_one_call_native_decode_follows_the_torch_decode_on_either_head_order(source, monkeypatch):
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    from deltaserve.engine import forward as forward_mod

    m = deltaserve.load(fx.hf_dir("hybrid") if source == "hf" else fx.gguf_path("hybrid", "f32"), cache=False)
    weights = int8_everywhere(m)
    f = Forward(m.config, weights)
    program, route = f.token_program()
    assert program is not None and route == "one native call per decoded token"
    ids = ids_for(m, n=40)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(forward_mod, "NATIVE_DECODE", on)
        st = f.new_state(48)
        rows = torch.stack([f.decode(st, t) for t in ids])
        # batches of 2 and 3 sequences at different positions (each weight read once for the batch)
        trio = [f.new_state(48) for _ in range(3)]
        f.decode_batch(trio[:1], ids[:1])
        pairs = torch.stack([f.decode_batch(trio[:2], [t, ids[-1 - i]]) for i, t in enumerate(ids[:12])])
        threes = torch.stack([f.decode_batch(trio, [t, t, ids[i]]) for i, t in enumerate(ids[12:24])])
        runs[on] = (rows, st, pairs, threes, trio)
    (ours, st, pairs, threes, trio), (theirs, st0, pairs0, threes0, trio0) = runs[True], runs[False]
    assert st.length == st0.length == len(ids) and [s.length for s in trio] == [25, 24, 12]
    scale = theirs.abs().max().item()
    # the same products on the same values; the norms' last bits may differ, so now and then one activation
    # rounds to the next int8 step (a ~1% change of one row), never more
    for got, want in ((ours, theirs), (pairs, pairs0), (threes, threes0)):
        assert (got - want).abs().max().item() <= 1e-2 * scale
        assert (got - want).abs().mean().item() <= 1e-4 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert torch.allclose(trio[2].ssm[0], trio0[2].ssm[0], atol=1e-4, rtol=1e-3)
    for i in st.kv:  # the caches written at every position, the recurrent states carried the same way
        for a, b in zip(st.kv[i], st0.kv[i]):
            assert torch.allclose(a[:, :len(ids)], b[:, :len(ids)], atol=1e-4, rtol=1e-3)
    for i in st.ssm:
        assert torch.allclose(st.ssm[i], st0.ssm[i], atol=1e-4, rtol=1e-3)
        assert torch.allclose(st.conv[i], st0.conv[i], atol=1e-5, rtol=1e-4)


def test_the_native_token_decode_says_why_it_is_not_used_and_leaves_other_states_to_torch():
    f32 = model("hybrid", "f32", "exact")
    program, why = Forward(f32.config, f32.host.weights).token_program()
    assert program is None and why.startswith("decode through torch ops (native token decode not used: a float32")
    q8 = model("hybrid", "q8_0", "fast")
    f = Forward(q8.config, q8.host.weights)
    if not native.status()[0]:
        assert f.token_program()[0] is None
        return
    assert "one native call per decoded token" in q8.session().notices[-1]
    ids = ids_for(q8, n=12)
    bf16 = f.new_state(16, kv_dtype=torch.bfloat16)  # a bf16 KV cache: the torch decode, the same tokens
    assert not f.token_program()[0].takes(bf16)
    f32_state = f.new_state(16)
    got = torch.stack([f.decode(bf16, t) for t in ids])
    want = torch.stack([f.decode(f32_state, t) for t in ids])
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    with pytest.raises(ValueError, match="17 positions do not fit a decode state of 16"):
        for t in ids:
            f.decode(f32_state, t)


def test_the_native_delta_rule_over_a_span_follows_the_chunked_and_the_stepwise_torch_versions():
    if not native.status()[0]:
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    from deltaserve.engine import layers

    g = torch.Generator().manual_seed(11)
    h, dk, dv = 3, 16, 64
    for t in (1, 2, 7, 70):  # one token, a short span, more than a chunk of 64
        q = layers.l2_normalize(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
        k = layers.l2_normalize(torch.randn(t, h, dk, generator=g))
        v = torch.randn(t, h, dv, generator=g)
        decay = -torch.rand(t, h, generator=g) * 2   # log decays
        beta = torch.rand(t, h, generator=g)
        start = torch.randn(h, dk, dv, generator=g) * 0.3
        ours_state, chunked_state, step_state = start.clone(), start.clone(), start.clone()
        ours = native.delta_rule(q, k, v, decay, beta, ours_state)
        chunked = layers.delta_rule_chunked(q, k, v, decay, beta, chunked_state)
        stepped = torch.stack([layers.delta_rule_step(q[i], k[i], v[i], decay[i], beta[i], step_state)
                               for i in range(t)])
        for want, want_state in ((stepped, step_state), (chunked, chunked_state)):
            assert torch.allclose(ours, want, atol=1e-5, rtol=1e-4), t
            assert torch.allclose(ours_state, want_state, atol=1e-5, rtol=1e-4), t
    assert native.delta_rule(q, k, v[..., :48], decay, beta, torch.zeros(h, dk, 48)) is None  # dv not a multiple of 32
