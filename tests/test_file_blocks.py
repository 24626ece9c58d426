"""A GGUF model held as its file's own blocks (weights="blocks", the default where tables_avx512.c's kernels do not
run): nothing converted at load, every product on the file's values, as close to f32 as llama.cpp on the same file.

Oracles: gguf.quants (dequantization bit for bit), llama.cpp on the same files (logits, in a child process), and
the arithmetic of llama.cpp's block products written out in float64 here.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import deltaserve
from deltaserve.demo import DEMO_FILE
from deltaserve.engine.forward import Forward
from deltaserve.kernels import linear as L
from deltaserve.kernels import routes
from deltaserve.kernels import native
from tests import llama_oracle as oracle
from tests.fixtures import models as fx
from tests.test_fast_weights import decode_all, demo_by_llama_cpp, ids_for

TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of `kind` with finite, modest scales: uint8 [rows, row bytes]."""
    rng = np.random.default_rng(seed)
    qt = T[kind]
    if kind in ("F16", "BF16"):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = x.astype(np.float16).view(np.uint8) if kind == "F16" else \
            (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return np.ascontiguousarray(raw).reshape(rows, -1)
    block, size = quants.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, (b.shape[0], 1)).astype(np.float16).view(np.uint8)

    if kind in ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS"):
        b[:, 0:2] = f16(0.002, 0.02)
    elif kind in ("Q4_K", "Q5_K"):
        b[:, 0:2], b[:, 2:4] = f16(0.002, 0.02), f16(0.001, 0.01)
    elif kind in ("Q4_1", "Q5_1"):
        b[:, 0:2], b[:, 2:4] = f16(0.002, 0.02), f16(-0.05, 0.05)
    elif kind == "MXFP4":  # an e8m0 exponent: 2^-9 .. 2^-2
        b[:, 0] = rng.integers(118, 126, b.shape[0], dtype=np.uint8)
    elif kind == "Q3_K":
        b[:, 108:110] = f16(0.001, 0.004)
    elif kind == "Q2_K":
        b[:, 80:82], b[:, 82:84] = f16(0.001, 0.004), f16(0.001, 0.004)
    else:
        b[:, 208:210] = f16(0.001, 0.004)
    return b.reshape(rows, -1)


def quantized_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as llama.cpp's block products see it, in float64: int8 per block of 32 with the block's f16-rounded scale
    (Q8_0, Q4_0) or per block of 256 with an f32 scale (K-quants), rounded to nearest, ties to even; F16/BF16
    weights multiply x as it is."""
    if kind in ("F16", "BF16"):
        return x.double()
    n = 256 if kind.endswith("_K") else 32
    b = x.double().reshape(x.shape[0], -1, n)
    amax = b.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b.float() * inv)  # the f32 product, rounded half to even
    d = amax / 127.0
    if n == 32:
        d = d.half().float()
    return (q.double() * d.double()).reshape(x.shape)


# the types llama.cpp multiplies with Q8_K activations (one f32 scale per 256; its ggml-cpu type_traits' vec_dot_type):
# the GEMM rounds them so; the others as Q8_0 (per 32, an f16 scale)
Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
              "IQ1_M", "TQ1_0", "TQ2_0"}


def gemm_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as the blocks' GEMM rounds it for a weight of `kind`: as llama.cpp does for that type."""
    return quantized_activations(x, "Q8_K" if kind in Q8_K_TYPES else "Q8_0")


@pytest.mark.parametrize("kind", TYPES)
def test_every_block_type_dequantizes_bit_for_bit_as_gguf_does(kind):
    rows, cols = 37, 512
    raw = random_blocks(kind, rows, cols, seed=len(kind))
    want = quants.dequantize(raw, T[kind]).reshape(rows, cols)
    lin = L.BlockLinear([(kind, torch.from_numpy(raw))], cols)
    got = lin.dense().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    ids = torch.tensor([0, 36, 5, 5])
    assert np.array_equal(lin.rows(ids).numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("shape", ["long", "short", "wide"])
def test_a_product_on_the_blocks_is_the_arithmetic_llama_cpp_does_and_each_row_is_its_own(kind, shape):
    # rows not a multiple of anything; three K-quant blocks a row, or one; the blocks of 32 in runs of 8 and a rest;
    # "wide": rows of 4096, where Q8_0 takes 16 rows at a time (tiles_avx512.c's tile16_q8_0, the last tile overlapping)
    rows, cols = {"long": (67, 768), "wide": (37, 4096)}.get(shape, (13, 416 if kind in ("Q8_0", "Q4_0") else 256))
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=3 + len(kind) + (shape == "short")))
    lin = L.BlockLinear([(kind, raw)], cols)
    w = lin.dense().double()
    g = torch.Generator().manual_seed(9)
    for m in (1, 2, 3, 8, 16):  # the decode's one and two rows a tile, more rows two at a time or four
        x = torch.randn(m, cols, generator=g)
        x[0, 7] = 25.0  # an outlier coarsens its own block only
        with routes.recording() as ran:
            y = lin(x)
        route = routes.blocks(kind, m)
        assert ran == [route] and route.family == ("blocks" if native.portable()[0] else "chunks")
        claimed = quantized_activations(x, kind) @ w.t() if route.family == "blocks" else x.double() @ w.t()
        assert ((y - claimed).norm(dim=1) / claimed.norm(dim=1)).max().item() < 1e-5, (kind, m)
        exact = x.double() @ w.t()  # (one K-quant block a row: the outlier coarsens all of it)
        assert ((y - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < (0.03 if shape == "long" else 0.1), (kind, m)
        if route.family == "blocks":  # torch's GEMM may take another kernel for one row; the products never do
            for i in range(m):
                assert torch.equal(lin(x[i:i + 1])[0], y[i]), (kind, m, i)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_each_of_1_to_16_rows_on_the_decode_products_gets_its_one_row_bits_and_gguf_values_times_its_rounded_row(kind):
    """The decode products of 1 to 16 rows (the one-row and pair tiles; from 3 rows Q6_K's many-row tiles on the
    512-bit build; rows_avx2.c's rows on AVX2): each row's sum is bit for bit the one it gets alone, and it is the
    weight as gguf.quants dequantizes it times the row as llama.cpp rounds it for the type, to f32 rounding."""
    if not native.portable()[0]:
        pytest.skip(f"no native decode products here: {native.portable()[1]}")
    # 37 output rows: tiles of four and a rest; Q8_0/Q4_0 rows of 13 blocks (a run of 8 and a rest), K-quants of 2
    rows, cols = 37, 416 if kind in ("Q8_0", "Q4_0") else 512
    raw = random_blocks(kind, rows, cols, seed=11 + len(kind))
    w = torch.from_numpy(quants.dequantize(raw, T[kind])).double().reshape(rows, cols)
    lin = L.BlockLinear([(kind, torch.from_numpy(raw))], cols)
    x = torch.randn(routes.GEMV_ROWS, cols, generator=torch.Generator().manual_seed(5)) * 3
    alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    claimed = quantized_activations(x, kind) @ w.t()
    assert ((alone - claimed).norm(dim=1) / claimed.norm(dim=1)).max().item() < 1e-5, kind
    for m in range(1, len(x) + 1):
        with routes.recording() as ran:
            y = lin(x[:m])
        assert ran == [routes.blocks(kind, m)] and ran[0].family == "blocks", (kind, m, ran)
        assert torch.equal(y, alone[:m]), (kind, m, [i for i in range(m) if not torch.equal(y[i], alone[i])])
    c = routes.capabilities()
    if c.vnni512 and c.multi and kind in routes.MULTI_512:
        assert routes.blocks(kind, 3).kernel == routes.blocks(kind, 16).kernel == "multi_tile (tiles_avx512.c)"


def test_many_rows_multiply_exact_chunks_of_the_weight_with_f32_activations(monkeypatch):
    monkeypatch.setenv("DELTASERVE_PREFILL", "f32")
    rows, cols = 300, 512
    raw = torch.from_numpy(random_blocks("Q8_0", rows, cols, seed=1))
    lin = L.BlockLinear([("Q8_0", raw)], cols)
    x = torch.randn(routes.GEMV_ROWS + 1, cols)
    assert routes.blocks("Q8_0", x.shape[0]) == routes.chunks(torch.float32)
    want = x.double() @ lin.dense().double().t()
    with routes.recording() as ran:
        y = lin(x)
    assert ran == [routes.chunks(torch.float32)]
    assert ((y - want).norm(dim=1) / want.norm(dim=1)).max().item() < 1e-6  # no activation rounding at all
    with routes.override(chunk_elements=7 * cols):  # chunks of 7 rows: the last one partial
        assert torch.allclose(lin(x), y, rtol=1e-5, atol=1e-4)


def test_with_bf16_chunks_many_rows_are_a_bf16_gemm_of_the_exact_weight(monkeypatch):
    """The AMX route (chunk_dtype bf16): the exact weights and the activations each rounded to bf16 once, products
    accumulated in f32 by the GEMM, the result rounded to bf16: nothing else (checked against that arithmetic in
    f64, chunk by chunk)."""
    monkeypatch.setenv("DELTASERVE_PREFILL", "bf16")
    rows, cols = 300, 512
    raw = torch.from_numpy(random_blocks("Q6_K", rows, cols, seed=3))
    lin = L.BlockLinear([("Q6_K", raw)], cols)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(4))
    xb, wb = x.bfloat16().double(), lin.dense().bfloat16().double()
    want = xb @ wb.t()
    y = lin(x)
    assert y.dtype == torch.float32
    # one bf16 rounding of the output (half an ulp: at most 2^-8 of it), and the GEMM's f32 accumulation
    bound = 2 ** -8 * want.abs() + 1e-6 * (xb.abs() @ wb.abs().t())
    assert ((y.double() - want).abs() <= bound * 1.0001).all()
    assert torch.equal(y.bfloat16().float(), y)  # the result is the bf16 GEMM's


def test_bf16_chunks_hold_four_times_an_f32_chunk_in_pieces_of_about_equal_size(monkeypatch):
    """oneDNN's bf16 GEMM wants wide chunks: the bf16 chunks are BF16_CHUNK_FACTOR x the f32 chunk's elements, split
    evenly (no thin last piece), and the product dequantizes each such chunk once."""
    monkeypatch.setenv("DELTASERVE_PREFILL", "bf16")
    rows, cols = 300, 256
    raw = torch.from_numpy(random_blocks("Q8_0", rows, cols, seed=6))
    lin = L.BlockLinear([("Q8_0", raw)], cols)
    calls = []
    real = L.native.dequant_bf16

    def counted(kind, data, k, out):
        calls.append(data.shape[0])
        return real(kind, data, k, out)

    monkeypatch.setattr(L.native, "dequant_bf16", counted)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(7))
    with routes.override(chunk_elements=64 * 256):  # f32 chunks of 64 rows of 256
        assert L.chunk_rows(1000, 256, torch.float32) == 64
        assert L.chunk_rows(200, 256, torch.bfloat16) == 200  # 4 x 64 rows hold it whole
        assert L.chunk_rows(300, 256, torch.bfloat16) == 160  # two pieces of 150 rows, rounded up to 16: 160 + 140
        y = lin(x)
    if native.has("ds_dequant_bf16"):
        assert calls == [160, 140]
    want = x.bfloat16().double() @ lin.dense().bfloat16().double().t()
    assert torch.allclose(y.double(), want, rtol=2 ** -7, atol=1e-4)


def test_the_prefill_chunks_are_bf16_exactly_where_torch_runs_bf16_gemms_on_amx_tiles(monkeypatch):
    monkeypatch.delenv("DELTASERVE_PREFILL", raising=False)
    monkeypatch.delenv("DELTASERVE_AMX", raising=False)
    amx = "amx_bf16" in native.cpu_flags() and torch._C._cpu._init_amx()
    vnni = native.status()[0]  # tables_avx512.c's AVX512-VNNI kernels: torch's int8 GEMM is fast there
    assert routes.capabilities().amx == bool(amx)
    for kind in ("Q8_0", "Q4_K", "Q6_K", "F16"):
        int8 = vnni and kind in ("Q4_K", "Q6_K")
        assert routes.chunk_dtype(kind) == (torch.bfloat16 if amx else torch.int8 if int8 else torch.float32), kind
    monkeypatch.setenv("DELTASERVE_PREFILL", "f32")
    assert routes.chunk_dtype("Q4_K") == torch.float32


def test_without_amx_every_quantized_type_takes_the_gemm_on_its_own_values_and_a_q8_0_down_projection_f32(monkeypatch):
    """A Zen 4/5's route (AVX512-VNNI, no AMX), taken here with DELTASERVE_AMX=off: in one stack of projections the
    Q4_K, Q8_0, Q2_K, IQ4_XS and Q6_K parts multiply the file's exact values on the blocks' GEMM, with the activations
    int8 as llama.cpp rounds them for each type (Q8_0's blocks of 32 or Q8_K's of 256, and nothing else); a Q8_0 down
    projection exact f32 chunks, a K-quant or IQ4_XS one the GEMM."""
    if not native.status()[0] or not native.has("ds_gemm_blocks"):
        pytest.skip(f"no AVX512-VNNI kernels here ({native.status()[1]}): neither the GEMM nor int8 chunks run")
    monkeypatch.delenv("DELTASERVE_PREFILL", raising=False)
    monkeypatch.setenv("DELTASERVE_AMX", "off")
    assert not routes.capabilities().amx and routes.int8_chunks_fast()
    cols = 512
    parts = [(kind, torch.from_numpy(random_blocks(kind, rows, cols, seed=40 + rows)))
             for kind, rows in (("Q4_K", 96), ("Q8_0", 64), ("Q2_K", 40), ("IQ4_XS", 48), ("Q6_K", 80))]
    lin = L.BlockLinear(parts, cols)
    x = torch.randn(routes.block_rows() + 20, cols, generator=torch.Generator().manual_seed(5))
    with routes.recording() as ran:
        got, off = lin(x), 0
    assert ran == [routes.blocks(kind, x.shape[0]) for kind, _ in parts] and {r.family for r in ran} == {"gemm"}
    for kind, raw in parts:
        w = L.BlockLinear([(kind, raw)], cols).dense()
        want = gemm_activations(x, kind) @ w.double().t()
        part = got[:, off:off + raw.shape[0]].double()
        assert ((part - want).norm(dim=1) / want.norm(dim=1)).max().item() < 1e-6, kind
        off += raw.shape[0]
    assert all(routes.block_gemm(k) for k in routes.GEMM_KINDS) and not routes.block_gemm("F16")
    assert set(routes.A256) == Q8_K_TYPES
    for kind, raw in parts[:2] + parts[3:4]:
        down = L.BlockLinear([(kind, raw)], cols)
        down.int8_activations = False  # the MLP's down projection (outliers in its inputs)
        want = (x.double() if kind == "Q8_0" else gemm_activations(x, kind)) @ down.dense().double().t()
        assert ((down(x).double() - want).norm(dim=1) / want.norm(dim=1)).max().item() < 1e-6, kind
    line = routes.describe_blocks()
    assert "the blocks of every quantized type on the native kernel's GEMM" in line
    assert "16-bit ones' exact f32 chunks" in line and "requantized" not in line


def test_a_prefill_takes_the_block_gemm_where_it_beats_torchs_f32_gemm_on_exact_chunks():
    """The blocks' GEMM takes every quantized type on both builds. On AVX512-VNNI the prefill's products take it for
    all of them; on AVX2 (vpmaddubsw, whose int16 pair sums saturate past 2 x 63 x 128) for the types whose packed
    values stay below 64, while Q8_0 and the types packed as v + 128, whose tiles multiply each value's two nibbles
    apart at about the f32 GEMM's speed, stay on exact chunks (an MoE expert's few rows take the GEMM there too)."""
    if not native.has("ds_gemm_blocks"):
        pytest.skip("the blocks' GEMM is not built here")
    assert all(native.gemm_takes(int(T[k])) for k in routes.GEMM_KINDS) and not native.gemm_takes(int(T["F16"]))
    fast = {k for k in routes.GEMM_KINDS if native.gemm_beats_f32(int(T[k]))}
    assert routes.capabilities().gemm_fast == fast
    if native.has("ds_blocks_vnni"):
        assert fast == set(routes.GEMM_KINDS)
    else:
        assert fast == {"Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_1", "Q2_K"}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                                  "MXFP4"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 40, 300])
@pytest.mark.parametrize("out", [32, 33, 100])
def test_the_block_gemm_is_the_files_values_times_activations_rounded_as_llama_cpp_rounds_them_whatever_the_shape(
        kind, rows, out):
    """The blocks' GEMM on the blocks (panels of 32 output rows, tiles of 6 tokens): any number of rows and tokens,
    the result written only where asked (a slice of a wider output), each token's row alone whatever is beside it.
    The oracle: gguf's values of the weight times the activations as llama.cpp rounds them for the type (Q8_0's
    blocks of 32, Q8_K's of 256 for the K-quants and IQ4_XS), in float64."""
    if not native.has("ds_gemm_blocks"):
        pytest.skip("the blocks' GEMM is not built here")
    cols = 512
    raw = torch.from_numpy(random_blocks(kind, out, cols, seed=out))
    w = torch.from_numpy(quants.dequantize(raw.numpy(), T[kind])).double().reshape(out, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 4
    y = torch.full((rows, out + 5), 7.0)
    assert native.gemm_blocks(x, int(T[kind]), raw, y, 2)
    xa = gemm_activations(x, kind)
    want = xa @ w.t()
    got = y[:, 2:2 + out].double()
    assert ((got - want).abs() <= 1e-6 * (xa.abs() @ w.abs().t()) + 1e-9).all()  # f32 sums of exact block sums
    assert (y[:, :2] == 7).all() and (y[:, 2 + out:] == 7).all()
    y1 = torch.empty(1, out)
    for i in {0, rows // 2, rows - 1}:
        assert native.gemm_blocks(x[i:i + 1], int(T[kind]), raw, y1, 0) and torch.equal(y1[0], y[i, 2:2 + out])


def test_a_long_prefills_tokens_pass_the_panels_in_blocks_and_each_row_comes_out_as_if_alone():
    """More tokens than GEMM_TOKENS (512: their activations stay in L2 while a panel passes over them): the rows of
    every block, the last one short, as the oracle has them and bit for bit as each row's product alone."""
    if not native.has("ds_gemm_blocks"):
        pytest.skip("the blocks' GEMM is not built here")
    rows, out, cols = 1100, 40, 256
    raw = torch.from_numpy(random_blocks("Q4_K", out, cols, seed=8))
    w = torch.from_numpy(quants.dequantize(raw.numpy(), T["Q4_K"])).double().reshape(out, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(8))
    y = torch.full((rows, out), 7.0)
    assert native.gemm_blocks(x, int(T["Q4_K"]), raw, y, 0)
    xa = gemm_activations(x, "Q4_K")
    want = xa @ w.t()
    assert ((y.double() - want).abs() <= 1e-6 * (xa.abs() @ w.abs().t()) + 1e-9).all()
    y1 = torch.empty(1, out)
    for i in (0, 511, 512, 1023, 1024, 1099):
        assert native.gemm_blocks(x[i:i + 1], int(T["Q4_K"]), raw, y1, 0) and torch.equal(y1[0], y[i]), i


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "NVFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                                  "IQ3_S", "IQ1_S", "IQ1_M"])
def test_the_block_gemm_takes_the_types_with_a_scale_every_16_from_their_expanded_rows(kind):
    """The grid, ternary, Q2_K, Q3_K and NVFP4 types on the blocks' GEMM: each row expanded exactly (int8 values, a
    scale and for Q2_K a min per 16; one scale per 32 where both halves share it) and multiplied on the tiles;
    gguf's values times the activations as llama.cpp rounds them (Q8_K's blocks of 256; NVFP4 Q8_0's of 32). A 16-bit
    tensor is not taken: its product says so and writes nothing."""
    if not native.has("ds_gemm_blocks"):
        pytest.skip("the blocks' GEMM is not built here")
    from tests.test_quant import random_raw

    out, cols = 40, 512
    raw = random_raw(T[kind], (out, cols), seed=11)
    if kind == "NVFP4":  # its UE4M3 scales: finite ones (0x7F / 0xFF are NaN)
        raw.reshape(-1, 36)[:, :4] = np.random.default_rng(1).integers(0x30, 0x48, (raw.size // 36, 4), dtype=np.uint8)
    raw = torch.from_numpy(raw)
    w = torch.from_numpy(quants.dequantize(raw.numpy(), T[kind])).double().reshape(out, cols)
    assert torch.isfinite(w).all()
    for rows in (1, 7, 40):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 4
        y = torch.full((rows, out), 7.0)
        assert native.gemm_blocks(x, int(T[kind]), raw, y, 0)
        xa = gemm_activations(x, kind)
        want = xa @ w.t()
        assert ((y.double() - want).abs() <= 1e-6 * (xa.abs() @ w.abs().t()) + 1e-9).all()
    f16 = torch.from_numpy(random_blocks("F16", out, cols, seed=2))
    y = torch.full((3, out), 7.0)
    assert not native.gemm_blocks(torch.randn(3, cols), int(T["F16"]), f16, y, 0) and (y == 7).all()


def test_a_stack_of_projections_is_one_product_over_their_segments_without_a_copy():
    a = torch.from_numpy(random_blocks("Q4_K", 20, 512, seed=1))
    b = torch.from_numpy(random_blocks("Q6_K", 12, 512, seed=2))
    stack = L.StackedLinear([L.BlockLinear([("Q4_K", a)], 512), L.BlockLinear([("Q6_K", b)], 512)])
    assert isinstance(stack.fused, L.BlockLinear) and stack.fused.block_kind == "Q4_K+Q6_K"
    assert [d.data_ptr() for _, d in stack.fused.segments] == [a.data_ptr(), b.data_ptr()]
    x = torch.randn(2, 512)
    ya, yb = stack.split(stack(x))
    assert torch.equal(ya, L.BlockLinear([("Q4_K", a)], 512)(x)) and torch.equal(yb, L.BlockLinear([("Q6_K", b)], 512)(x))


@functools.lru_cache(maxsize=None)
def blocks_model(path):
    return deltaserve.load(path, weights="blocks", cache=False)


def test_a_quantized_file_is_held_as_views_of_its_mapping_with_no_converted_copy():
    path = fx.gguf_path("hybrid", "q8_0")
    m = blocks_model(path)
    w = m.host.weights
    lins = [w.lm_head] + [p for lw in w.layers for p in (lw.gate_up.fused, lw.down)]
    assert all(isinstance(lin, L.BlockLinear) for lin in lins)
    assert w.embed.table is w.lm_head  # the tied head is the embedding's blocks
    from deltaserve.formats.gguf import read_gguf

    f = read_gguf(path)
    stored = sum(t.nbytes for t in f.tensors.values())
    quantized = sum(t.nbytes for t in f.tensors.values() if t.qtype.name == "Q8_0")
    # every quantized tensor counted once, as its stored bytes; the rest (norms, conv, f32 vectors) is small
    assert quantized <= w.nbytes <= stored * 1.01 + 65536, (w.nbytes, stored)
    mapping = np.frombuffer(f.buf, np.uint8)
    lo = mapping.__array_interface__["data"][0]
    for lin in lins:  # the blocks are the file's own pages (a view of a mapping of the file), not copies
        for _, d in lin.segments:
            assert d.untyped_storage().nbytes() < stored and d.dtype == torch.uint8
    del lo


@pytest.mark.parametrize("amx", ["on", "off"])
def test_the_default_weights_are_the_files_own_blocks_with_or_without_amx(amx, monkeypatch):
    """No CPU holds int8 tables by default (a Zen 4/5 did, for their prefill, at 1.5-3.3x the file's memory): a
    Q4_K_M file's products are all the file's blocks, and the route line says how the many-row ones run."""
    monkeypatch.delenv("DELTASERVE_WEIGHTS", raising=False)
    monkeypatch.delenv("DELTASERVE_PREFILL", raising=False)
    monkeypatch.setenv("DELTASERVE_AMX", amx)
    m = deltaserve.load(demo_by_llama_cpp("Q4_K_M", "q4_k_m"), cache=False)
    w = m.host.weights
    lins = [w.lm_head] + [p for lw in w.layers for p in (lw.gate_up.fused, lw.down)]
    assert all(isinstance(lin, L.BlockLinear) for lin in lins)
    line = next(n for n in m.session().notices if n.startswith("Backend:"))  # the route line (an MTP line may follow)
    if not native.portable()[0]:
        assert "dequantized in chunks for torch's f32 GEMM" in line, line
    elif routes.capabilities().amx:
        assert "more rows on bf16 chunks and torch's bf16 GEMM (AMX tiles)" in line, line
    elif native.status()[0] and native.has("ds_gemm_blocks"):
        assert "more rows on the blocks of every quantized type on the native kernel's GEMM" in line, line
    elif native.status()[0]:
        assert "4- to 6-bit blocks' chunks requantized to int8 per row and torch's int8 GEMM (AVX512-VNNI, no AMX)" \
            in line, line
    else:  # the AVX2 route: its GEMM takes the K-quants (not Q8_0: its pair sums would saturate)
        assert "more rows on the Q4_K, Q5_K, Q6_K, Q4_1, Q5_1, Q2_K blocks on the native kernel's GEMM" in line, line
        assert "the other types' exact f32 chunks and torch's f32 GEMM" in line, line


@pytest.mark.parametrize("amx", ["on", "off"])
def test_the_prefill_attention_multiplies_in_bf16_only_on_amx_tiles(amx, monkeypatch):
    """Without AMX (a Zen 4/5, or DELTASERVE_AMX=off) torch's bf16 matmuls lose to its f32 ones, so the prefill's
    attention stays f32 there, as the weight chunks do; on AMX tiles it runs in bf16."""
    monkeypatch.setenv("DELTASERVE_AMX", amx)
    m = blocks_model(fx.gguf_path("hybrid", "q8_0"))
    assert not m.host.weights.has_f32_linears()
    dtype = Forward(m.config, m.host.weights).attention_dtype
    assert dtype == (torch.bfloat16 if routes.capabilities().amx else torch.float32)
    assert amx == "on" or dtype == torch.float32


def test_the_route_line_says_the_products_run_on_the_files_own_blocks_and_on_which_instructions():
    m = blocks_model(fx.gguf_path("hybrid", "q8_0"))
    line = m.session().notices[-1]
    if native.portable()[0]:
        isa = "AVX512-VNNI" if native.has("ds_blocks_vnni") else "AVX2"
        rows = routes.block_rows()
        assert rows == (32 if routes.chunk_dtype() == torch.bfloat16 and routes.capabilities().amx and isa == "AVX512-VNNI"
                        else 16)
        assert f"products on the file's own blocks: up to {rows} rows on the native kernel ({isa}" in line, line
    else:
        assert "dequantized in chunks for torch's f32 GEMM" in line, line


@pytest.mark.parametrize("name", ["hybrid", "deep"])
def test_a_blocks_prefill_adds_nothing_to_the_files_own_error_and_decode_stays_near_it(name, monkeypatch):
    monkeypatch.setenv("DELTASERVE_PREFILL", "f32")  # the exact route (the bf16 one: the trained-model test below)
    m = blocks_model(fx.gguf_path(name, "q8_0"))
    exact = deltaserve.load(fx.gguf_path(name, "q8_0"), weights="exact", cache=False)
    ref = deltaserve.load(fx.gguf_path(name, "f32"), weights="exact", cache=False)
    ids = ids_for(ref)
    want = ref.logits(ids)
    own = (exact.logits(ids) - want).abs().mean().item()
    prefill = m.logits(ids)  # exact weights, f32 activations: the file's own error and nothing more (measured 1.000x)
    assert (prefill - exact.logits(ids)).abs().mean().item() <= 0.01 * own
    # one token at a time: int8 activations per block of 32, as llama.cpp's decode (measured 1.36x and 1.48x; the
    # int8 tables with bf16 activations: 1.32x and 1.42x; their prefill with int8 activations per row: 1.71x)
    assert (decode_all(m, ids) - want).abs().mean().item() <= 1.6 * own


@pytest.mark.parametrize("ftype,name", [("Q8_0", "q8_0"), ("Q4_K_M", "q4_k_m")])
def test_on_a_trained_model_blocks_are_no_farther_from_f32_than_llama_cpp_on_the_same_file(ftype, name):
    path = demo_by_llama_cpp(ftype, name)
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    m = blocks_model(path)
    turns = [("My locker code is 4821. What is 12 + 9?", "21."), ("Reverse these words: red fox blue", "blue fox red"),
             ("What is my locker code?", None)]
    text = "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n" + (f"{a}<|im_end|>\n" if a else "")
                   for u, a in turns)
    ids = ref.tokenizer.encode(text)
    want = ref.logits(ids)
    for n_batch, ours in ((256, m.logits(ids)), (1, decode_all(m, ids))):  # a prefill, then one token at a time
        theirs = torch.from_numpy(oracle.logits(path, ids, n_ctx=256, n_batch=n_batch))
        d_ours, d_theirs = (ours - want).abs().mean().item(), (theirs - want).abs().mean().item()
        assert d_ours <= 1.1 * d_theirs, (ftype, n_batch, d_ours, d_theirs)
        agree = lambda got: (got.argmax(-1) == want.argmax(-1)).float().mean().item()  # noqa: E731
        assert agree(ours) >= agree(theirs) - 0.03, (ftype, n_batch)


def test_a_batch_of_conversations_reads_the_same_blocks_as_one_conversation_alone():
    m = blocks_model(demo_by_llama_cpp("Q4_K_M", "q4_k_m"))
    ids = m.tokenizer.encode("<|im_start|>user\nWhat is 12 + 9?<|im_end|>\n<|im_start|>assistant\n")
    f = Forward(m.config, m.host.weights)
    alone = decode_all(m, ids)
    trio = [f.new_state(len(ids)) for _ in range(3)]
    batched = torch.stack([f.decode_batch(trio, [t, t, t]) for t in ids])
    for j in range(3):
        assert torch.allclose(batched[:, j], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", TYPES)
def test_bf16_chunks_come_out_of_the_blocks_rounded_as_torch_rounds_the_exact_values(kind):
    if not native.has("ds_dequant_bf16"):
        pytest.skip(f"products.c does not run here: {native.portable()[1]}")
    rows, cols = 37, 512
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=11 + len(kind)))
    exact = torch.from_numpy(quants.dequantize(raw.numpy(), T[kind]).reshape(rows, cols))
    got = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
    assert native.dequant_bf16(L.GGUF_TYPES[kind], raw, cols, got)
    assert torch.equal(got.view(torch.int16), exact.bfloat16().view(torch.int16))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_bf16_chunks_of_blocks_with_a_nan_or_infinite_scale_round_as_torch_rounds_them(kind):
    """A damaged file's scale (f16 NaN, +inf, -inf) gives a NaN where torch's rounding gives one (its bits differ
    between torch's own scalar and vector paths) and the same bits everywhere else, the infinities included."""
    if not native.has("ds_dequant_bf16"):
        pytest.skip(f"products.c does not run here: {native.portable()[1]}")
    rows, cols = 5, 512
    raw = random_blocks(kind, rows, cols, seed=3)
    size = quants.GGML_QUANT_SIZES[T[kind]][1]
    at = 208 if kind == "Q6_K" else 0  # the f16 scale d of the block
    blocks = raw.reshape(-1, size)
    for i, bits in enumerate((0x7E00, 0x7C00, 0xFC00, 0xFE00)):
        blocks[3 * i, at:at + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        exact = torch.from_numpy(quants.dequantize(raw, T[kind]).reshape(rows, cols))
    assert exact.isnan().any() and exact.isinf().any()
    got = torch.zeros((rows, cols), dtype=torch.bfloat16)
    assert native.dequant_bf16(L.GGUF_TYPES[kind], torch.from_numpy(raw), cols, got)
    want = exact.bfloat16()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])


def test_int8_chunks_multiply_each_chunk_requantized_per_row_and_leave_the_down_projection_exact(monkeypatch):
    """DELTASERVE_PREFILL=int8 (the int8 tables' prefill without the tables, for AVX512-VNNI CPUs without AMX): the
    weight's exact values requantized per row, the activations per row, an int8 GEMM, nothing kept."""
    if not routes.capabilities().int8_exact:
        pytest.skip("torch's int8 GEMM is not exact on this CPU: the next test covers what runs instead")
    monkeypatch.setenv("DELTASERVE_PREFILL", "int8")
    rows, cols = 300, 512
    for kind in ("Q8_0", "Q4_K", "Q6_K"):
        raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=21 + len(kind)))
        lin = L.BlockLinear([(kind, raw)], cols)
        x = torch.randn(routes.block_rows() + 40, cols, generator=torch.Generator().manual_seed(4))
        assert routes.blocks(kind, x.shape[0]) == routes.chunks(torch.int8)
        wq, ws = L.quantize_rows_int8(lin.dense())
        xq, xs = L.quantize_rows_int8(x)
        want = (xq.double() @ wq.double().t()) * ws.double() * xs.double()[:, None]
        got = lin(x)
        assert ((got - want).norm(dim=1) / want.norm(dim=1)).max().item() < 1e-6, kind
        lin.int8_activations = False  # the MLP's down projection: exact f32 chunks instead
        exact = x.double() @ lin.dense().double().t()
        assert ((lin(x) - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < 1e-6, kind
    assert "int8 GEMM" in routes.describe_blocks()


def test_torchs_int8_gemm_is_found_inexact_where_onednn_has_no_vnni_or_amx():
    """oneDNN held to AVX2 (a Zen 3's) multiplies u8 x s8 pairs into saturating int16: the route table's probe
    finds it, on any CPU (a process of its own: oneDNN reads the variable once)."""
    import os
    import subprocess
    import sys

    probe = "from deltaserve.kernels import routes; print(routes.capabilities().int8_exact)"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-500:]


def test_where_torchs_int8_gemm_is_not_exact_int8_prefills_run_exact_chunks_or_bf16_tables_and_say_so(monkeypatch):
    """DELTASERVE_PREFILL=int8 and the int8 tables' many-row products never reach an inexact int8 GEMM: the blocks'
    chunks run exact f32, the tables bf16, and the route lines say why."""
    monkeypatch.setattr(L.torch, "_int_mm", lambda *a: (_ for _ in ()).throw(AssertionError("int8 GEMM called")))
    monkeypatch.setenv("DELTASERVE_PREFILL", "int8")  # settings read again (conftest)
    rows, cols = 300, 512
    raw = torch.from_numpy(random_blocks("Q4_K", rows, cols, seed=23))
    lin = L.BlockLinear([("Q4_K", raw)], cols)
    table = L.Int8Linear.from_float(lin.dense())
    with routes.override(int8_exact=False):
        x = torch.randn(routes.block_rows() + 40, cols, generator=torch.Generator().manual_seed(5))
        exact = x.double() @ lin.dense().double().t()
        with routes.recording() as ran:
            assert ((lin(x) - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < 1e-6
            table(torch.randn(routes.BF16_GEMM_ROWS + 1, cols))
        assert ran == [routes.chunks(torch.float32), routes.table(routes.BF16_GEMM_ROWS + 1, cols)]
        assert ran[1].family == "bf16"
        assert "DELTASERVE_PREFILL=int8 not taken: torch's int8 GEMM does not sum exactly" in routes.describe_blocks()
        assert "prefills on bf16 tables, not int8 x int8" in routes.describe_tables()
