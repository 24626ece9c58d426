"""The int8-table weight path (weights="tables": int8 tables for quantized files, bf16 for 16-bit ones; the default
where tables_avx512.c's kernels run) stays within documented bounds. The file's-own-blocks path (weights="blocks",
the default elsewhere) has tests/test_file_blocks.py.

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
from deltaserve.engine.state import kv_torch_dtype
from deltaserve.demo import DEMO_FILE
from deltaserve.kernels import linear as linear_mod
from deltaserve.kernels import routes
from deltaserve.kernels import native
from deltaserve.kernels.linear import DenseLinear, Int8Linear
from tests import llama_oracle as oracle
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
    fast, exact = model(name, "q8_0", "tables"), model(name, "q8_0", "exact")
    ref = model(name, "f32", "exact")
    assert isinstance(fast.host.weights.layers[0].gate_up.fused, Int8Linear)
    ids = ids_for(ref)
    want = ref.logits(ids)
    own = (exact.logits(ids) - want).abs().mean().item()
    for got in (fast.logits(ids), decode_all(fast, ids)):
        assert (got - want).abs().mean().item() <= 2 * own


def test_the_fast_bf16_path_stays_close_to_f32():
    fast = model("hybrid", "bf16", "tables")
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
    m = model("hybrid", "q8_0", "tables")
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
    # both row counts on one many-row route (int8 x int8 where torch's int8 GEMM is exact, else the weight-only kernel)
    assert routes.table(14, 256) == routes.table(10, 256) and routes.table(14, 256).family != "tables"
    with routes.recording() as ran:
        y = lin(x)
    assert ran == [routes.table(14, 256)]
    want = x @ lin.dense().t()
    rel = ((y - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert rel < 0.02
    alone = lin(torch.cat([x[:1], x[5:]]))  # the same rows without the loud one
    assert torch.equal(alone[0], y[0]) and torch.equal(alone[1:], y[5:])


def test_the_down_projection_keeps_bf16_activations_and_the_others_take_int8():
    w = model("hybrid", "q8_0", "tables").host.weights
    assert all(not layer.down.int8_activations for layer in w.layers)
    assert all(layer.gate_up.fused.int8_activations for layer in w.layers)


@functools.lru_cache(maxsize=None)
def demo_by_llama_cpp(ftype: str, name: str):
    """The trained demo model quantized by llama.cpp itself (LLAMA_FTYPE_MOSTLY_<ftype>), cached; llama.cpp runs
    in a child process (tests/llama_oracle.py)."""
    oracle.require()
    out = fx.demo_quantized_path(name)
    if not out.exists():
        tmp = out.with_suffix(".part")
        assert oracle.quantize(DEMO_FILE, tmp, ftype) == 0
        tmp.replace(out)
    return out


def demo_q8_0_by_llama_cpp():
    return demo_by_llama_cpp("Q8_0", "q8_0")


def test_on_a_trained_model_the_int8_prefill_stays_within_1_5x_llama_cpps_own_q8_0_error():
    q8 = demo_q8_0_by_llama_cpp()
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)  # the F16 file in f32: the reference
    fast = deltaserve.load(q8, weights="tables", cache=False)
    turns = [("My locker code is 4821. What is 12 + 9?", "21."), ("Reverse these words: red fox blue", "blue fox red"),
             ("What is my locker code?", None)]
    text = "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n" + (f"{a}<|im_end|>\n" if a else "")
                   for u, a in turns)
    ids = ref.tokenizer.encode(text)
    assert len(ids) > 2 * routes.WEIGHT_ONLY_ROWS
    want = ref.logits(ids)
    theirs = torch.from_numpy(oracle.logits(q8, ids, n_ctx=256, n_batch=256))  # llama.cpp, in a child process
    ours = fast.logits(ids)
    d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
    assert d_ours <= 1.5 * d_theirs, (d_ours, d_theirs)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_on_a_trained_model_the_decode_steps_stay_within_1_5x_llama_cpps_own_q8_0_error():
    q8 = demo_q8_0_by_llama_cpp()
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    fast = deltaserve.load(q8, weights="tables", cache=False)
    ids = ref.tokenizer.encode("<|im_start|>user\nMy locker code is 4821. Reverse these words: red fox blue"
                               "<|im_end|>\n<|im_start|>assistant\nblue fox red<|im_end|>\n")
    want = ref.logits(ids)
    theirs = torch.from_numpy(oracle.logits(q8, ids, n_ctx=128, n_batch=1))  # one token per batch: its decode products
    ours = decode_all(fast, ids)  # one token per step: the decode route (the native kernel where it runs)
    d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
    assert d_ours <= 1.5 * d_theirs, (d_ours, d_theirs)
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


def test_the_native_kernel_matches_the_float_product_for_every_row_count_and_odd_sizes():
    if not native.has("ds_linear_i8"):  # tables_avx512.c (AVX512-VNNI) only
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
    if not native.has("ds_quantize_rows"):  # tables_avx512.c (AVX512-VNNI) only
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
    if not native.has("ds_linear_kq"):  # tables_avx512.c (AVX512-VNNI) only
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    from gguf import GGMLQuantizationType

    from deltaserve.formats import quant

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


@pytest.mark.parametrize("weights", ["tables", "blocks"])
def test_a_q4_k_m_file_decodes_from_its_own_blocks_within_1_5x_llama_cpps_own_error(weights):
    if weights == "tables" and not native.status()[0]:  # int8 tables decode from the blocks on tables_avx512.c
        pytest.skip(f"tables_avx512.c's kernels do not run here: {native.status()[1]}")
    path = demo_by_llama_cpp("Q4_K_M", "q4_k_m")
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    fast = deltaserve.load(path, weights=weights, cache=False)
    w = fast.host.weights
    assert w.lm_head.block_kind == "Q6_K" and w.layers[0].gate_up.fused.block_kind == "Q4_K"
    with routes.recording() as ran:
        w.lm_head(torch.randn(1, w.lm_head.in_features))
    want = routes.table(1, w.lm_head.in_features) if weights == "tables" else routes.blocks("Q6_K", 1)
    assert ran == [want] and want.family == ("tables" if weights == "tables" else
                                            "blocks" if native.portable()[0] else "chunks")
    ids = ref.tokenizer.encode("<|im_start|>user\nMy locker code is 4821. Reverse these words: red fox blue"
                               "<|im_end|>\n<|im_start|>assistant\nblue fox red<|im_end|>\n")
    want = ref.logits(ids)
    theirs = torch.from_numpy(oracle.logits(path, ids, n_ctx=128, n_batch=1))  # in a child process
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
    if not (native.has("ds_deltanet_step") and native.has("ds_causal_conv") and native.has("ds_delta_rule")):
        pytest.skip(f"the native DeltaNet kernels do not run here: {native.status()[1]}")

    m = deltaserve.load(fx.hf_dir("hybrid") if source == "hf" else fx.gguf_path("hybrid", "f32"), cache=False)
    assert m.config.linear_num_value_heads > m.config.linear_num_key_heads
    ids = ids_for(m, n=24)
    runs = {}
    for on in (True, False):
        f = Forward(m.config, m.host.weights, native=on)
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
            assert not ok and why.startswith("false failed on "), why
        lin = Int8Linear.from_float(torch.randn(8, 64))
        with routes.recording() as ran:
            lin(torch.randn(1, 64))
        assert ran == [routes.table(1, 64)] and ran[0].family == "weight-only"
        m = model("hybrid", "q8_0", "tables")
        assert "torch's weight-only kernel (native kernel not used: " in m.session().notices[-1]
        blocks = model("hybrid", "q8_0", "blocks")
        assert "dequantized in chunks for torch's f32 GEMM (native kernel not used: " in blocks.session().notices[-1]
        assert routes.blocks("Q8_0", 1).family == "chunks"
        monkeypatch.setenv("DELTASERVE_NATIVE", "off")
        native.reset()
        assert native.status() == (False, "turned off by DELTASERVE_NATIVE")
    finally:
        native.reset()
        monkeypatch.undo()
    if native.status()[0]:
        assert "on the native kernel (AVX512-VNNI" in model("hybrid", "q8_0", "tables").session().notices[-1]


def test_the_route_table_gives_an_int8_table_its_kernel_by_rows_and_its_products_take_the_route_it_gives():
    """The table: the int8 tables' kernel up to TABLE_ROWS rows (where it runs and the inner size is a multiple of
    32), then int8 x int8 (where torch's int8 GEMM is exact) after WEIGHT_ONLY_ROWS rows of the weight-only kernel,
    or the weight-only kernel up to BF16_GEMM_ROWS and a bf16 GEMM; on an accelerator, weight-only and bf16. Each
    product runs the route the table gives, and its result is the float product's within int8's rounding."""
    w = torch.randn(64, 32)
    lin = Int8Linear.from_float(w)
    n = routes.TABLE_ROWS
    if routes.capabilities().tables:
        assert [routes.table(r, 32).family for r in (1, n, n + 1, 512)] == ["tables", "tables", "int8", "int8"] \
            if routes.capabilities().int8_exact else ["tables", "tables", "weight-only", "bf16"]
        assert routes.table(1, 48).family == "weight-only"  # inner size not a multiple of 32
    for tables in (True, False):
        with routes.override(tables=tables and routes.capabilities().tables):
            for r in (1, routes.WEIGHT_ONLY_ROWS, routes.WEIGHT_ONLY_ROWS + 1, routes.BF16_GEMM_ROWS + 1):
                x = torch.randn(r, 32)
                with routes.recording() as ran:
                    y = lin(x)
                assert ran == [routes.table(r, 32)], r
                want = x @ lin.dense().t()
                assert ((y - want).norm() / want.norm()).item() < 0.02, (r, ran)
    with routes.override(tables=False, int8_exact=True):
        assert [routes.table(r, 32).family for r in (1, 4, 5, 512)] == ["weight-only"] * 2 + ["int8"] * 2
        assert [routes.table(r, 32, int8_activations=False).family for r in (1, 64, 65)] == \
            ["weight-only"] * 2 + ["bf16"]  # the down projection: bf16 activations
    with routes.override(tables=False, int8_exact=False):
        assert [routes.table(r, 32).family for r in (4, 64, 65)] == ["weight-only"] * 2 + ["bf16"]
    assert [routes.table(r, 32, device="cuda").family for r in (1, 16, 17)] == ["weight-only"] * 2 + ["bf16"]
    assert Int8Linear(lin.q.to("meta"), lin.scale.to("meta")).path(17) == "bf16"  # a copy off the CPU


def int8_everywhere(m):
    """A loaded float model's weights with every projection and the head as int8 tables (any head order)."""
    from deltaserve.kernels.linear import StackedLinear
    from deltaserve.engine.weights import AttentionWeights, LayerWeights, Weights

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


# How far the one-call native decode may be from the torch decode: derived, not tuned.
# Both routes quantize each product's activations to int8 per block of 32 (step d = absmax / 127, rounded to
# nearest) and then run the same integer products, on values that agree to float32 rounding noise (norms,
# softmax and SwiGLU round in another order). So an activation rounds differently only where it sits within that
# noise of a rounding tie, and then by exactly one step: that product's output moves by d * W[:, k]. The test
# compares the routes one step at a time from the same state (a move cannot compound over the sequence). In the
# torch step it finds every activation u = x * 127 / absmax within NEAR_TIE * (127 + |u|) of a tie (NEAR_TIE =
# 4e-6: ~8x the relative difference, ~5e-7 of their size, between the caches and states the routes write where
# nothing rounds differently), and measures what moving each one step does to the logits and states: a replay of
# the torch step with d * W[:, k] added to that product's output (the propagation measured, not guessed). A move
# shifts much of what follows it in the step, which can bring other values near a tie: those are found and
# measured the same way in the moved replay (a second level; a third would take three near-ties in one step).
# Any of them may round the other way, so each logit and state value may differ by the sum of their effects on
# it, plus float noise: FLOAT_NOISE of the logits' scale (~100x what is seen where nothing is near a tie; the
# states keep their earlier tolerances). A step with nothing near a tie must agree to float noise.
# The earlier tuned bound (1e-2 x the scale, 0.0208 for gguf) failed on an Intel Xeon at 0.0219: here that is the
# measured effect of input 61 of the second DeltaNet layer's output projection at step 15 moving one step, the
# activation nearest a tie in the gguf run (2.3e-5 of a step), and the step-by-step comparison sees it round the
# other way on an AMD EPYC too.
NEAR_TIE = 4e-6
FLOAT_NOISE = 1e-4
LEVELS = 2


class TorchProducts:
    """The torch decode's int8 products, instrumented: each call's input rows recorded, and `inject`ed moves
    ({call: [(row, k, +-1)]}) added to the outputs: what one activation rounded one int8 step the other way does."""

    def __init__(self, monkeypatch):
        self.calls: list | None = None
        self.inject: dict = {}
        original = Int8Linear.__call__

        def call(lin, x):
            y = original(lin, x)
            if self.calls is None:
                return y
            x2 = x.reshape(-1, lin.in_features).float()
            moves = self.inject.get(len(self.calls), ())
            self.calls.append(x2.clone())
            if moves:
                y = y.clone()
                for row, k, dq in moves:
                    d = x2[row, k // 32 * 32:k // 32 * 32 + 32].abs().amax() / 127  # the block's int8 step
                    y.view(-1, lin.out_features)[row] += dq * d * lin.dense()[:, k]
            return y

        monkeypatch.setattr(Int8Linear, "__call__", call)

    def near_ties(self, row: int, after: int = -1) -> list[tuple[int, int, int]]:
        """(call, k, the way it would move) of every activation of `row` near a rounding tie, in calls after
        `after`."""
        out = []
        for c, x in enumerate(self.calls[after + 1:], start=after + 1):
            blocks = x[row].view(-1, 32)
            u = (blocks * (127.0 / blocks.abs().amax(-1, keepdim=True))).view(-1)  # as tables_avx512.c quantizes
            r = torch.round(u)
            near = (0.5 - (u - r).abs()) <= NEAR_TIE * (127 + u.abs())
            out += [(c, k, 1 if u[k] > r[k] else -1) for k in near.nonzero().flatten().tolist()]
        return out

    def replay(self, f, state, token: int, rows: list[tuple]):
        """The torch step of `state`'s copies, a batch of <= 8 rows (the per-32 products of the step replayed),
        row r with the moves rows[r]: logits [R, vocab], the copies, and what each product read."""
        copies = [copy_state(f, state) for _ in rows]
        self.calls, self.inject = [], {}
        for r, moves in enumerate(rows):
            for c, k, dq in moves:
                self.inject.setdefault(c, []).append((r, k, dq))
        out = f.decode_batch(copies, [token] * len(rows))
        calls, self.calls, self.inject = self.calls, None, {}
        return out, copies, calls


STATE_TOLERANCE = {"kv": (1e-4, 1e-3), "ssm": (1e-4, 1e-3), "conv": (1e-5, 1e-4)}  # (atol, rtol), as before


def state_tensors(st) -> list[tuple[str, torch.Tensor]]:
    """What a step writes or carries (copies): the caches' positions so far, the conv and recurrent states."""
    return [("kv", t[:, :st.length].clone()) for pair in st.kv.values() for t in pair] + \
        [("conv", t.clone()) for t in st.conv.values()] + [("ssm", t.clone()) for t in st.ssm.values()]


def copy_state(f, st):
    out = f.new_state(st.capacity)
    out.restore(st.checkpoint())
    return out


def step_on_both_routes(f, products, states, tokens, monkeypatch):
    """One decode step of `states` on the native route (on copies) and on the torch route (the states advance
    on it), from the same state, with the envelope of what near-tie activations rounding the other way can do.
    Returns (ours, theirs, envelope) logits [B, vocab] and, per sequence, (ours, theirs, envelope) states."""
    before = [copy_state(f, s) for s in states]
    mine = [copy_state(f, s) for s in states]
    one = len(states) == 1
    monkeypatch.setattr(f, "one_call", True)
    ours = f.decode(mine[0], tokens[0])[None] if one else f.decode_batch(mine, tokens)
    monkeypatch.setattr(f, "one_call", False)
    products.calls = []
    theirs = f.decode(states[0], tokens[0])[None] if one else f.decode_batch(states, tokens)
    calls, products.calls = products.calls, None
    env = torch.zeros_like(theirs)
    env_states = [[torch.zeros_like(t) for _, t in state_tensors(s)] for s in states]
    for row in range(len(states)):
        # (moves so far, what that step's products read, its row there); level 0: the torch step itself
        level = [((), calls, row)]
        for depth in range(LEVELS):
            deeper = []
            for moves, read, r0 in level:
                products.calls = read
                near = products.near_ties(r0, after=moves[-1][0] if moves else -1)
                for i in range(0, len(near), 7):  # the step as it is and up to 7 moved: a batch of <= 8 rows
                    chunk = near[i:i + 7]
                    out, copies, read2 = products.replay(f, before[row], tokens[row],
                                                         [moves] + [moves + (m,) for m in chunk])
                    if not moves:  # the replay is the step compared
                        assert (out[0] - theirs[row]).abs().max().item() <= FLOAT_NOISE * theirs.abs().max().item()
                    env[row] += (out[1:] - out[0]).abs().sum(0)
                    base = state_tensors(copies[0])
                    for copy in copies[1:]:
                        for e, (_, a), (_, b) in zip(env_states[row], state_tensors(copy), base):
                            e += (a - b).abs()
                    deeper += [(moves + (m,), read2, r) for r, m in enumerate(chunk, start=1)]
            level = deeper
    products.calls = None
    return (ours, theirs, env), [(state_tensors(a), state_tensors(b), e) for a, b, e in zip(mine, states, env_states)]


@pytest.mark.parametrize("source", ["hf", "gguf"])  # value heads grouped (HF) and tiled (GGUF) over key heads
def test_the_one_call_native_decode_follows_the_torch_decode_on_either_head_order(source, monkeypatch):
    if not native.status()[0]:  # int8 tables: tables_avx512.c's; test_native_avx2.py compares the AVX2 one on blocks
        pytest.skip(f"the native kernel does not run here: {native.status()[1]}")
    m = deltaserve.load(fx.hf_dir("hybrid") if source == "hf" else fx.gguf_path("hybrid", "f32"), cache=False)
    weights = int8_everywhere(m)
    f = Forward(m.config, weights)
    program, route = f.token_program()
    assert program is not None and route.startswith("one native call per decoded token")
    ids = ids_for(m, n=40)
    products = TorchProducts(monkeypatch)
    st = f.new_state(48)
    steps = [step_on_both_routes(f, products, [st], [t], monkeypatch) for t in ids]
    # batches of 2 and 3 sequences at different positions (each weight read once for the batch)
    trio = [f.new_state(48) for _ in range(3)]
    steps.append(step_on_both_routes(f, products, trio[:1], ids[:1], monkeypatch))
    steps += [step_on_both_routes(f, products, trio[:2], [t, ids[-1 - i]], monkeypatch) for i, t in enumerate(ids[:12])]
    steps += [step_on_both_routes(f, products, trio, [t, t, ids[i]], monkeypatch) for i, t in enumerate(ids[12:24])]
    assert st.length == len(ids) and [s.length for s in trio] == [25, 24, 12]
    ours, theirs, env, scale = assert_within_the_envelope(steps)
    # the argmax the same wherever the envelope cannot reorder the top two
    top2 = theirs.topk(2, dim=-1).values
    reorderable = top2[:, 0] - top2[:, 1] <= 2 * (env.amax(-1) + FLOAT_NOISE * scale)
    assert ((ours.argmax(-1) == theirs.argmax(-1)) | reorderable).all()


def assert_within_the_envelope(steps):
    """The one-call decode's logits and states (`steps` from step_on_both_routes) against the torch decode's: within
    the near-tie envelope plus float noise everywhere, float noise on average where no activation was near a tie;
    returns (ours, theirs, envelope, logit scale)."""
    ours, theirs, env = (torch.cat(parts) for parts in zip(*(logits for logits, _ in steps)))
    scale = theirs.abs().max().item()
    off = (ours - theirs).abs()
    assert (off <= env + FLOAT_NOISE * scale).all(), (off - env).max().item()
    # where no activation was near a tie, the routes agree to float noise on average too (~5e-8 of the scale
    # measured; a bias of 1e-4 on every logit, within FLOAT_NOISE above, fails here)
    quiet = env.amax(-1) == 0
    if quiet.any():
        assert off[quiet].mean().item() <= 1e-5 * scale, off[quiet].mean().item()
    # the caches written, the conv and recurrent states carried the same way, at every step
    for _, rows in steps:
        for mine, torchs, envs in rows:
            for (kind, a), (_, b), e in zip(mine, torchs, envs):
                atol, rtol = STATE_TOLERANCE[kind]
                assert ((a - b).abs() <= e + atol + rtol * b.abs()).all(), kind
    return ours, theirs, env, scale


def test_the_native_token_decode_says_why_it_is_not_used_and_leaves_other_states_to_torch():
    f32 = model("hybrid", "f32", "exact")
    program, why = Forward(f32.config, f32.host.weights).token_program()
    assert program is None and why.startswith("decode through torch ops (native token decode not used: a float32")
    q8 = model("hybrid", "q8_0", "fast")  # the file's blocks
    f = Forward(q8.config, q8.host.weights)
    if not native.has("ds_decode_tokens"):
        assert f.token_program()[0] is None
        return
    assert "one native call per decoded token" in q8.session().notices[-1]
    ids = ids_for(q8, n=12)
    q8_0 = f.new_state(16, kv_dtype=kv_torch_dtype("q8_0"))  # a q8_0 KV cache: the torch decode, the same tokens
    assert not f.token_program()[0].takes(q8_0)
    f32_state = f.new_state(16)
    got = torch.stack([f.decode(q8_0, t) for t in ids])
    want = torch.stack([f.decode(f32_state, t) for t in ids])
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    with pytest.raises(ValueError, match="17 positions do not fit a decode state of 16"):
        for t in ids:
            f.decode(f32_state, t)


def test_the_native_delta_rule_over_a_span_follows_the_chunked_and_the_stepwise_torch_versions():
    if not native.has("ds_delta_rule"):  # deltanet_avx512.c's or deltanet_avx2.c's
        pytest.skip(f"the native delta rule does not run here: {native.status()[1]}")
    from deltaserve.engine import layers

    g = torch.Generator().manual_seed(11)
    dk = 16
    # one token, a short span, more than a chunk of 64 (torch's) and not a multiple of 4 (the kernel's); 3 x 2 groups
    # of 32 value columns (the kernel runs two at a time), and 3 (one left over)
    for t, h, dv in ((1, 3, 64), (2, 3, 64), (7, 3, 64), (70, 3, 64), (9, 1, 96)):
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
