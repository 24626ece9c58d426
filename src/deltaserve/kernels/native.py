"""The native CPU kernels' Python side: each kernel of the library (kernels/c/, loaded by kernels/library.py) bound
as a function on torch tensors, returning None (or False) where the library does not take its arguments, so that the
caller's torch path runs. Which kernel a product takes is kernels/routes.py's decision; these run what it chose.

The C files, one a job (docs/kernels.md draws the layout): quants (the GGUF block types), dequant (exact values),
expand (rows as int8 values and scales), activations (quantized as llama.cpp's), products with rows_avx2 and
tiles_avx512 (the decode products on the file's blocks), gemm with gemm_pack, gemm_avx2 and gemm_avx512 (many rows on
the blocks), tables_avx512 (int8 tables), decode (the one-call decode) with deltanet, attention_decode, moe and
rowops, deltanet_avx2/_avx512 (the prefill's span kernels), attention_vision_avx2/_avx512 (the vision tower's).

`DELTASERVE_NATIVE=off` turns all of it off; a CPU without AVX2/FMA/F16C, no compiler (and no prebuilt library) or a
failed build: torch's kernels, with the reason.

Why kernels of our own: torch's weight-only int8 product reads a large table well below the memory's speed, torch's
int8 x int8 product on a CPU without AVX512-VNNI is far slower than its own f32 GEMM, and nothing in torch reads GGUF
blocks (docs/kernels.md has the measurements).
"""

from __future__ import annotations

import ctypes

import torch

from deltaserve.cachedir import cache_root
from deltaserve.kernels.library import (ABI, CONSTANTS, HEADER, SIGNATURES, STRUCTS, cpu_flags, has, library,  # noqa: F401
                                        portable, reset, status)

MAX_ROWS = CONSTANTS["DS_MAX_ROWS"]  # activation rows per product, sequences per batched decode call


def cache_dir():
    return cache_root() / "native"


BLOCK_TYPES = {"Q4_K": (12, 144), "Q6_K": (CONSTANTS["DS_Q6K"], 210),  # GGUF type id, bytes per block of 256
               "Q4_K/r": (CONSTANTS["DS_Q4KR"], 152)}  # Q4_K repacked at load (its scale bits unpacked; tables_avx512.c)


def for_products(kind: str, blocks: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A file's blocks in the form the product reads fastest: Q4_K repacked once (a new table), the others
    as they are (the view of the file)."""
    lib = library()
    if kind != "Q4_K" or not has("ds_repack_q4k"):
        return kind, blocks
    rows = blocks.shape[0]
    n = blocks.numel() // BLOCK_TYPES[kind][1]
    out = torch.empty(rows, n // rows * BLOCK_TYPES["Q4_K/r"][1], dtype=torch.uint8)
    lib.ds_repack_q4k(blocks.contiguous().data_ptr(), n, out.data_ptr())
    return "Q4_K/r", out


def linear_blocks(x: torch.Tensor, kind: str, blocks: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """x [M, K] times a tensor kept as the file's own blocks (`kind` Q4_K or Q6_K; blocks: uint8 [N, K/256 *
    block bytes]) beside an int8 table: f32 [M, N]; None when the kernel cannot take it (more than 8 rows, no
    library). Q4_K runs on tables_avx512.c's repacked blocks, Q6_K on products.c's product."""
    lib = library()
    M, K = x.shape
    if not has("ds_linear_kq") or M > MAX_ROWS or K % 256 or kind not in BLOCK_TYPES:
        return None
    kind, blocks = for_products(kind, blocks)  # the kernel reads Q4_K repacked (done once at load for a model)
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    y = torch.empty(M, out_features)
    product = lib.ds_linear_kq if kind == "Q4_K/r" else lib.ds_linear_blocks
    if product(BLOCK_TYPES[kind][0], x.data_ptr(), M, K, x.stride(0), blocks.data_ptr(), out_features, y.data_ptr(),
               out_features, torch.get_num_threads()) != 0:
        return None
    return y


def dequant(gguf_type: int, data: torch.Tensor, cols: int, out: torch.Tensor) -> bool:
    """dequant.c's exact dequantization of rows of blocks (uint8 [rows, row bytes], rows contiguous) into out (f32
    [rows, cols], rows contiguous); False, with nothing written, where it does not run."""
    if not has("ds_dequant") or data.dtype != torch.uint8 or data.stride(-1) != 1 or out.dtype != torch.float32 \
            or out.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) != data.shape[1]):
        return False
    return library().ds_dequant(gguf_type, data.data_ptr(), data.shape[0], cols, out.data_ptr(), out.stride(0),
                                torch.get_num_threads()) == 0


def dequant_bf16(gguf_type: int, data: torch.Tensor, cols: int, out: torch.Tensor) -> bool:
    """`dequant`'s values rounded to bf16 as torch rounds them, written straight into out (bf16 [rows, cols], rows
    contiguous); False, with nothing written, where it does not run."""
    if not has("ds_dequant_bf16") or data.dtype != torch.uint8 or data.stride(-1) != 1 \
            or out.dtype != torch.bfloat16 or out.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) != data.shape[1]):
        return False
    return library().ds_dequant_bf16(gguf_type, data.data_ptr(), data.shape[0], cols, out.data_ptr(), out.stride(0),
                                     torch.get_num_threads()) == 0


def linear_on_blocks(x: torch.Tensor, gguf_type: int, data: torch.Tensor, y: torch.Tensor, off: int) -> bool:
    """y[:, off:off + rows] = x [M, K] (f32, rows contiguous) times the blocks (uint8 [rows, row bytes]) with
    products.c's products; False, with nothing written, where they do not take it."""
    if not has("ds_linear_blocks") or data.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) != data.shape[1]):
        return False
    m, k = x.shape
    return library().ds_linear_blocks(gguf_type, x.data_ptr(), m, k, x.stride(0), data.data_ptr(), data.shape[0],
                                      y.data_ptr() + off * y.element_size(), y.stride(0),
                                      torch.get_num_threads()) == 0


def moe_experts(experts: tuple, hidden: int, uniq: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                slot: torch.Tensor | None = None, y: torch.Tensor | None = None,
                ws: torch.Tensor | None = None) -> bool:
    """out [P, hidden] (f32, contiguous): pair i's expert (the u-th expert used, uniq[u], takes the pairs first[u] ..
    first[u] + count[u]) on row rows[i] of x [*, hidden], times weights[i]; `experts`: native.h's experts_t of the
    gate, up and down projections (the file's blocks). One native call for an MoE layer's routed experts; False, with
    nothing written, where moe.c does not take them.
    `slot` and `y` (both or neither): the routed sum itself, y [P / k, hidden] (f32, contiguous), row r the sum over its
    k choices j in order of weights[s] out[s], s = slot[r k + j] (out then holds the unweighted products). `ws`: a
    float32 buffer of at least P 3 ff values (ff: an expert's width) for the gate and up products, reused across
    layers (or None: allocated per call)."""
    if not has("ds_moe_experts") or not x.is_contiguous() or x.dtype != torch.float32:
        return False
    if (slot is None) != (y is None) or (y is not None and (not y.is_contiguous() or y.dtype != torch.float32
                                                              or out.shape[0] % y.shape[0])):
        return False
    ff = experts[0].rows
    if ws is not None and (ws.dtype != torch.float32 or not ws.is_contiguous() or ws.numel() < out.shape[0] * 3 * ff):
        return False
    gate, up, down = (ctypes.byref(e) for e in experts)
    ints = [t.to(torch.int32).contiguous() for t in (uniq, first, count, rows)]
    w = weights.float().contiguous()
    s = slot.to(torch.int32).contiguous() if slot is not None else None
    k = out.shape[0] // y.shape[0] if y is not None else 0
    return library().ds_moe_experts(gate, up, down, hidden, ints[0].numel(), *(t.data_ptr() for t in ints[:3]),
                                    x.data_ptr(), ints[3].data_ptr(), w.data_ptr(), w.numel(), out.data_ptr(),
                                    torch.get_num_threads(), s.data_ptr() if s is not None else None, k,
                                    y.data_ptr() if y is not None else None,
                                    ws.data_ptr() if ws is not None else None) == 0


def gemm_takes(gguf_type: int) -> bool:
    """Whether the blocks' GEMM (gemm.c: gemm_blocks) takes blocks of this type in this build (every quantized type
    it knows)."""
    return has("ds_gemm_type") and library().ds_gemm_type(gguf_type) > 0


def gemm_beats_f32(gguf_type: int) -> bool:
    """Whether the blocks' GEMM on this type beats torch's f32 GEMM on exact chunks for a prefill's many rows: every
    type on AVX512-VNNI; on AVX2 the ones whose packed values stay below 64 (Q4_K, Q5_K, Q6_K, Q4_1, Q5_1, Q2_K):
    the others' vpmaddubsw pair sums would saturate, so their tiles multiply each value's two nibbles apart, at
    about the f32 GEMM's speed (ds_gemm_type 2; the MoE experts' few rows still take them there)."""
    return has("ds_gemm_type") and library().ds_gemm_type(gguf_type) == 1


def gemm_blocks(x: torch.Tensor, gguf_type: int, data: torch.Tensor, y: torch.Tensor, off: int) -> bool:
    """y[:, off:off + rows] = x [M, K] (f32, rows contiguous) times blocks of a quantized type gemm_takes (uint8
    [rows, row bytes]) on the blocks' GEMM (gemm.c) for many rows (the file's values, the activations int8 per block of 32 or
    256 as llama.cpp rounds them); False, with nothing written, where it does not take it."""
    if not has("ds_gemm_blocks") or data.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) != data.shape[1]):
        return False
    m, k = x.shape
    return library().ds_gemm_blocks(gguf_type, x.data_ptr(), m, k, x.stride(0), data.data_ptr(), data.shape[0],
                                    y.data_ptr() + off * y.element_size(), y.stride(0), torch.get_num_threads()) == 0


def linear_i8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] (any float dtype) times the int8 table q [N, K] with per-row f32 scales: f32 [M, N]; None
    when the native kernel cannot take it (then the caller uses torch)."""
    lib = library()
    if not has("ds_linear_i8") or x.shape[1] % 32:
        return None
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty(M, N)
    if lib.ds_linear_i8(x.data_ptr(), M, K, x.stride(0), q.data_ptr(), scale.data_ptr(), N, y.data_ptr(), N,
                        torch.get_num_threads()) != 0:
        return None
    return y



def deltanet_ready(w, states: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether `deltanet_step` takes this layer's weights and these (conv, ssm) states: checked before any
    state is touched, so a batch never runs half on one path."""
    if not has("ds_deltanet_step"):
        return False
    tensors = [w.conv, w.a_neg, w.dt_bias, w.norm, *(t for pair in states for t in pair)]
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in tensors)


def deltanet_step(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w, cfg,
                  conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One token of a DeltaNet mixer between its projections (see deltanet.c), updating conv_state [Kc-1, C]
    and ssm_state [nv, dk, dv] in place; returns the normed, gated output [nv * dv]. The caller checked
    `deltanet_ready`; qkv, z, b, a are f32 vectors (rows of the projection's output)."""
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qkv, z, b, a = (t.float().contiguous() for t in (qkv, z, b, a))
    out = torch.empty(nv * dv)
    tensors = (qkv, z, b, a, w.conv, w.a_neg, w.dt_bias, w.norm, conv_state, ssm_state, out)
    if library().ds_deltanet_step(*(t.data_ptr() for t in tensors), nk, dk, nv, dv, w.conv.shape[1],
                                  int(cfg.value_head_order == "tiled"), float(cfg.rms_norm_eps),
                                  torch.get_num_threads()) != 0:
        raise MemoryError("the native DeltaNet step could not allocate its scratch")
    return out


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor | None:
    """The gated delta rule over a span, token by token (see deltanet_avx512.c / deltanet_avx2.c): what layers.delta_rule_chunked
    returns, `state` [H, dk, dv] updated in place; None, with nothing touched, where the kernel does not take it.
    q, k: [T, H, dk]; v: [T, H, dv]; g (log decays), beta: [T, H]."""
    lib = library()
    t, h, dk = k.shape
    dv = v.shape[-1]
    if not has("ds_delta_rule") or state.dtype != torch.float32 or not state.is_contiguous() or state.device.type != "cpu" \
            or state.shape != (h, dk, dv) or dv % 32 or dk % 2:
        return None
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(t, h, dv)
    if lib.ds_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
                         out.data_ptr(), t, h, dk, dv, torch.get_num_threads()) != 0:
        return None
    return out


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The causal conv + SiLU of layers.causal_conv over x [T, C] in one pass (conv_state [Kc-1, C] updated
    in place); None, with nothing touched, where the native kernel cannot take it. x's rows may lie apart (a slice of
    a wider projection's output): read in place, not copied."""
    lib = library()
    if not has("ds_causal_conv") or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
                          for t in (conv_state, weight)) or x.device.type != "cpu":
        return None
    ld = _rows(x, x.shape[-1])
    if ld is None:
        x = x.float().contiguous()
        ld = x.shape[1]
    t, c = x.shape
    out = torch.empty(t, c)
    if lib.ds_causal_conv(x.data_ptr(), conv_state.data_ptr(), weight.data_ptr(), out.data_ptr(), t, c,
                          weight.shape[1], torch.get_num_threads(), ld) != 0:
        raise MemoryError("the native causal conv could not allocate its scratch")
    return out


def _rows(t: torch.Tensor, width: int) -> int | None:
    """The stride between rows of t (f32 on the CPU, [rows, width] with each row's values contiguous, rows at least
    `width` apart: a view of a wider output passes), else None (then the caller's torch path runs)."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != width or \
            (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < width):
        return None
    return max(t.stride(0), width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """layers.rms_norm over the last dimension in one pass (ds_rms_norm); None where the kernel does not take it."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n) if x.dim() != 2 else x
    ld = _rows(x2, n)
    if ld is None or not has("ds_rms_norm") or weight.dtype != torch.float32 or not weight.is_contiguous() \
            or weight.numel() != n or weight.device.type != "cpu" or x2.shape[0] == 0:
        return None
    out = torch.empty(x2.shape[0], n)
    if library().ds_rms_norm(x2.data_ptr(), ld, weight.data_ptr(), out.data_ptr(), x2.shape[0], n, eps,
                             torch.get_num_threads()) != 0:
        return None
    return out.reshape(x.shape)


def l2_norm_heads(x: torch.Tensor, heads: int, d: int, scale: float) -> torch.Tensor | None:
    """x [rows, heads d] (rows may lie apart) L2-normalised per head of d values, times `scale`: [rows, heads, d]
    (layers.l2_normalize, one pass: ds_l2_norm_heads); None where the kernel does not take it."""
    ld = _rows(x, heads * d)
    if ld is None or not has("ds_l2_norm_heads") or x.shape[0] == 0:
        return None
    out = torch.empty(x.shape[0], heads, d)
    if library().ds_l2_norm_heads(x.data_ptr(), ld, out.data_ptr(), x.shape[0], heads, d, scale,
                                  torch.get_num_threads()) != 0:
        return None
    return out


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """layers.gated_rms_norm of o [rows, heads, d] (contiguous) gated by z [rows, heads d] (rows may lie apart), in
    one pass (ds_gated_rms_norm); None where the kernel does not take it."""
    if o.dim() != 3 or o.dtype != torch.float32 or not o.is_contiguous() or o.device.type != "cpu":
        return None
    rows, heads, d = o.shape
    ld = _rows(z, heads * d)
    if ld is None or not has("ds_gated_rms_norm") or weight.dtype != torch.float32 or not weight.is_contiguous() \
            or weight.numel() != d or weight.device.type != "cpu" or rows == 0:
        return None
    out = torch.empty(rows, heads, d)
    if library().ds_gated_rms_norm(o.data_ptr(), z.data_ptr(), ld, weight.data_ptr(), out.data_ptr(), rows, heads, d,
                                   eps, torch.get_num_threads()) != 0:
        return None
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) up over [rows, n] (the halves of a stacked gate/up output, rows apart) in one pass (ds_swiglu);
    None where the kernel does not take it."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.shape[0] == 0:
        return None
    n = gate.shape[1]
    lg, lu = _rows(gate, n), _rows(up, n)
    if lg is None or lu is None or not has("ds_swiglu"):
        return None
    out = torch.empty(gate.shape[0], n)
    if library().ds_swiglu(gate.data_ptr(), lg, up.data_ptr(), lu, out.data_ptr(), gate.shape[0], n,
                           torch.get_num_threads()) != 0:
        return None
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              segments: list[int] | None = None) -> torch.Tensor | None:
    """softmax(q k^T * scale) v per head, within each segment of rows (one image each): q, k, v [n, heads, dim] ->
    f32 [n, heads, dim]. bf16 inputs on attention_vision_avx512.c's kernel (f32 scores and softmax, the probabilities
    times v in bf16), f32 ones on attention_vision_avx2.c's (f32 throughout). None where this build lacks the kernel for the
    inputs' dtype, or cannot take them (not the CPU; an odd head width for bf16)."""
    lib = library()
    n, heads, dim = q.shape
    bf16 = q.dtype == torch.bfloat16
    name, size = ("ds_attention_bf16", 2) if bf16 else ("ds_attention_f32", 4)
    if not has(name) or (bf16 and dim % 2) or any(t.device.type != "cpu" or t.shape != q.shape for t in (q, k, v)):
        return None
    q, k, v = (t.to(q.dtype).contiguous() for t in (q, k, v))
    out = torch.empty(n, heads, dim)
    row = heads * dim
    start = 0
    for length in segments or [n]:
        rc = getattr(lib, name)(q.data_ptr() + size * start * row, k.data_ptr() + size * start * row,
                                v.data_ptr() + size * start * row, out.data_ptr() + 4 * start * row, length, heads,
                                dim, float(scale), torch.get_num_threads())
        if rc:
            raise MemoryError(f"the native attention could not allocate its scratch for {length} rows")
        start += length
    if start != n:
        raise ValueError(f"segments {segments} do not add up to {n} rows")
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """linear.quantize_rows_int8 for f32 rows in two passes instead of five (bit for bit the same); None
    where the native kernel does not run."""
    lib = library()
    if not has("ds_quantize_rows") or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
        return None
    m, k = x.shape
    q, scale = torch.empty(m, k, dtype=torch.int8), torch.empty(m)
    lib.ds_quantize_rows(x.data_ptr(), m, k, x.stride(0), q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return q, scale


def scale_product(acc: torch.Tensor, col: torch.Tensor, row: torch.Tensor) -> torch.Tensor | None:
    """(float)acc * col[None, :] * row[:, None] for an int32 [M, N] product, in one pass; None where the
    native kernel does not run."""
    lib = library()
    if not has("ds_scale_product") or not acc.is_contiguous() or acc.dtype != torch.int32 or acc.device.type != "cpu":
        return None
    m, n = acc.shape
    y = torch.empty(m, n)
    lib.ds_scale_product(acc.data_ptr(), m, n, col.data_ptr(), row.contiguous().data_ptr(), y.data_ptr(),
                         torch.get_num_threads())
    return y
