"""Vectorised dequantisation of GGUF tensor data in torch.

Supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K. Every kernel reproduces the float
operation order of ``gguf.quants.dequantize`` so that results are bit-identical to the reference:
f16 scales are widened to f32 first (exact), then each product/difference is a single f32 op in the
same order the reference evaluates it (K-quants: ``(d * sc) * q - (dmin * m)``). Widening integer
quants to f32 is exact, so letting torch's type promotion do it inside the multiply changes nothing.

The same code runs on CPU and CUDA tensors: all work is uint8 bit ops and elementwise float ops.
Blocks are processed in chunks so the integer intermediates stay cache-sized on CPU and the peak
extra memory is bounded on either device.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from deltaserve.errors import ModelFormatError

__all__ = ["SUPPORTED_TYPES", "dequantize", "dequantize_rows", "quantize_q8_0", "type_size"]

_T = GGMLQuantizationType

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)

_SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))

# Output elements produced per chunk. Small enough that a chunk's uint8/f32 temporaries live in
# cache on CPU; on CUDA larger chunks only cut launch overhead.
_CPU_CHUNK_ELEMS = 1 << 22
_CUDA_CHUNK_ELEMS = 1 << 24


def _as_qtype(qtype: Any) -> GGMLQuantizationType:
    if isinstance(qtype, GGMLQuantizationType):
        return qtype
    if isinstance(qtype, str) and qtype in GGMLQuantizationType.__members__:  # a type name: "Q8_0"
        return GGMLQuantizationType[qtype]
    try:
        return GGMLQuantizationType(int(qtype))
    except (ValueError, TypeError):
        raise ModelFormatError(
            f"unknown GGML tensor type {qtype!r}; supported types: {_SUPPORTED_NAMES}"
        ) from None


def _supported(qtype: Any) -> GGMLQuantizationType:
    qt = _as_qtype(qtype)
    if qt not in SUPPORTED_TYPES:
        raise ModelFormatError(
            f"GGML tensor type {qt.name} (id {int(qt)}) is not supported; supported types: {_SUPPORTED_NAMES}"
        )
    return qt


def type_size(qtype: Any) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type (any type gguf knows, not only supported ones)."""
    qt = _as_qtype(qtype)
    try:
        return GGML_QUANT_SIZES[qt]
    except KeyError:
        raise ModelFormatError(f"GGML tensor type {qt.name} has no known block size") from None


# ---------------------------------------------------------------------------------------------
# input handling


def _as_byte_tensor(data: Any) -> torch.Tensor:
    """A flat uint8 torch view of ``data``'s raw bytes (zero-copy where possible)."""
    if isinstance(data, torch.Tensor):
        t = data.reshape(-1)
        if t.dtype != torch.uint8:
            t = t.contiguous().view(torch.uint8).reshape(-1)
        return t
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray):
        raise TypeError(f"tensor data must be a numpy array, torch tensor or bytes, not {type(data).__name__}")
    arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if type(arr) is not np.ndarray:
        arr = arr.view(np.ndarray)  # np.memmap and other subclasses -> plain ndarray view
    with warnings.catch_warnings():
        # Read-only memmaps (GGUFReader) are fine: nothing here writes into the input.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def _byte_count(qt: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(number of blocks, elements per block, bytes per block) for ``shape``; validates the row length."""
    block, tsize = GGML_QUANT_SIZES[qt]
    cols = shape[-1] if shape else 1
    if any(int(s) < 0 for s in shape):
        raise ModelFormatError(f"tensor shape {tuple(shape)} has a negative dimension")
    if cols % block != 0:
        raise ModelFormatError(
            f"{qt.name} tensor row length {cols} is not a multiple of its block size {block}"
        )
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel // block, block, tsize


def _check_size(qt: GGMLQuantizationType, shape: tuple[int, ...], nbytes: int, n_blocks: int, tsize: int) -> None:
    expected = n_blocks * tsize
    if nbytes != expected:
        raise ModelFormatError(
            f"{qt.name} tensor of shape {tuple(shape)} needs {expected} bytes but the data has {nbytes}"
        )


# ---------------------------------------------------------------------------------------------
# kernels: blocks uint8 [n, bytes per block] -> write float32 into out [n, elements per block]


def _view_as(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 [n, k] as ``dtype``; copies first when the bytes are not aligned for a view."""
    blocks = blocks.contiguous()
    try:
        return blocks.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the element size (a sliced byte buffer)
        return blocks.clone().view(dtype)


def _f16_col(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian f16 at byte ``start`` of each block, widened to f32, shape [n, 1]."""
    return _view_as(blocks[:, start:start + 2], torch.float16).to(torch.float32)


def _deq_f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_view_as(blocks, torch.float32))


def _deq_f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_view_as(blocks, torch.float16))  # f16 -> f32 is exact


def _deq_bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # bf16 -> f32 is exact (the 16 bits become the high half) on CPU and CUDA alike
    out.copy_(_view_as(blocks, torch.bfloat16))


def _deq_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16_col(blocks, 0)
    out.copy_(blocks[:, 2:].view(torch.int8))  # exact widening; a mixed-dtype mul is far slower
    out.mul_(d)


def _deq_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs = blocks[:, 2:]
    q = torch.stack((qs & 0x0F, qs >> 4), dim=1).view(torch.int8).reshape(n, 32) - 8
    out.copy_(q)
    out.mul_(d)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K block (packed in bytes 4..15), uint8 [n, 8] each."""
    s = blocks[:, 4:16]
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc, mn


def _k_finish(q: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """out = (d * sc) * q - (dmin * m), with q uint8 [n, 8, 32], in the reference's order."""
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    dmin = _f16_col(blocks, 2)
    sc, mn = _k_scales(blocks)
    dsc = (d * sc).unsqueeze(-1)
    dm = (dmin * mn).unsqueeze(-1)
    o = out.view(n, 8, 32)
    o.copy_(q)
    o.mul_(dsc)
    o.sub_(dm)


def _nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [n, 128] -> [n, 8, 32]: per 32-byte group, the low nibbles then the high nibbles."""
    n = qs.shape[0]
    g = qs.reshape(n, 4, 32)
    return torch.stack((g & 0x0F, g >> 4), dim=2).reshape(n, 8, 32)


def _deq_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_finish(_nibbles_k(blocks[:, 16:144]), blocks, out)


def _deq_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    ql = _nibbles_k(blocks[:, 48:176])
    qh = blocks[:, 16:48].unsqueeze(1)  # [n, 1, 32]; bit j of byte l is the 5th bit of sub-block j, element l
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    hb = ((qh >> shifts) & 0x01) << 4
    _k_finish(ql | hb, blocks, out)


def _deq_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    ql = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    qh = ((qh >> shifts) & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8).reshape(n, 16, 16) - 32
    scales = blocks[:, 192:208].view(torch.int8)
    d = _f16_col(blocks, 208)
    dsc = (d * scales).unsqueeze(-1)
    o = out.view(n, 16, 16)
    o.copy_(q)
    o.mul_(dsc)


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    _T.F32: _deq_f32,
    _T.F16: _deq_f16,
    _T.BF16: _deq_bf16,
    _T.Q8_0: _deq_q8_0,
    _T.Q4_0: _deq_q4_0,
    _T.Q4_K: _deq_q4_k,
    _T.Q5_K: _deq_q5_k,
    _T.Q6_K: _deq_q6_k,
}


def _run(qt: GGMLQuantizationType, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Dequantise uint8 [n, bytes per block] into a fresh float32 [n, block]."""
    n = blocks.shape[0]
    out = torch.empty((n, block), dtype=torch.float32, device=blocks.device)
    if n == 0:
        return out
    kernel = _KERNELS[qt]
    if block == 1:  # plain float types: a single conversion pass, nothing to keep in cache
        kernel(blocks, out)
        return out
    per_chunk = _CUDA_CHUNK_ELEMS if blocks.device.type == "cuda" else _CPU_CHUNK_ELEMS
    step = max(1, per_chunk // block)
    for i in range(0, n, step):
        kernel(blocks[i:i + step], out[i:i + step])
    return out


# ---------------------------------------------------------------------------------------------
# public API


def dequantize(data: Any, qtype: Any, shape: Sequence[int]) -> torch.Tensor:
    """Dequantise one GGUF tensor to float32.

    ``data``: the raw bytes (numpy array of any dtype, viewed as bytes; a torch tensor on any device;
    or ``bytes``). ``shape``: the logical numpy-order shape (reversed ggml ne); blocks run along the
    last dimension. Returns a new contiguous float32 tensor of ``shape`` on ``data``'s device
    (numpy/bytes -> CPU). Raises ModelFormatError for an unsupported type or a byte count that does
    not match the shape.
    """
    qt = _supported(qtype)
    shape = tuple(int(s) for s in shape)
    n_blocks, block, tsize = _byte_count(qt, shape)
    b = _as_byte_tensor(data)
    _check_size(qt, shape, b.numel(), n_blocks, tsize)
    return _run(qt, b.view(n_blocks, tsize), block).reshape(shape)


def dequantize_rows(data: Any, qtype: Any, shape: Sequence[int], rows: Any) -> torch.Tensor:
    """Dequantise only the given rows of a 2-D tensor (e.g. an embedding lookup).

    ``rows``: integer indices (tensor, array or list, any device). Returns float32
    ``[*rows.shape, cols]`` (``[len(rows), cols]`` for 1-D rows) on ``data``'s device. Only the
    selected rows' bytes are read, so a memory-mapped table is never dequantised whole.
    Indices must lie in ``[0, shape[0])``; this is checked when ``rows`` is on the CPU (a CUDA index
    tensor is not synchronised for the check; an out-of-range one fails inside the gather).
    """
    qt = _supported(qtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ModelFormatError(f"dequantize_rows needs a 2-D tensor shape, got {shape}")
    n_blocks, block, tsize = _byte_count(qt, shape)
    b = _as_byte_tensor(data)
    _check_size(qt, shape, b.numel(), n_blocks, tsize)
    n_rows, cols = shape
    blocks_per_row = cols // block
    table = b.view(n_rows, blocks_per_row * tsize)

    idx = rows if isinstance(rows, torch.Tensor) else torch.as_tensor(np.asarray(rows, dtype=np.int64))
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex():
        raise TypeError(f"row indices must be integers, got {idx.dtype}")
    out_shape = (*idx.shape, cols)
    idx = idx.reshape(-1)
    if idx.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n_rows:
            raise IndexError(f"row index {lo if lo < 0 else hi} out of range for a tensor of {n_rows} rows")
    idx = idx.to(device=table.device, dtype=torch.long)
    sel = table.index_select(0, idx).view(idx.numel() * blocks_per_row, tsize)
    return _run(qt, sel, block).reshape(out_shape)


def quantize_q8_0(x: torch.Tensor) -> np.ndarray:
    """Quantise float32 ``[..., cols]`` (cols a multiple of 32) to raw Q8_0 bytes ``[..., cols // 32 * 34]``.

    Bit-identical to ``gguf.quants.quantize(x.numpy(), Q8_0)``: d = max|x| / 127 in f32, q = x * (1/d)
    rounded half away from zero, d stored as f16.
    """
    x = torch.as_tensor(x).detach().to(device="cpu", dtype=torch.float32)
    shape = tuple(x.shape)
    if not shape or shape[-1] % 32 != 0:
        raise ModelFormatError(f"Q8_0 needs a row length that is a multiple of 32, got shape {shape}")
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    a = v.abs()
    fl = torch.floor(a)
    r = torch.sign(v) * (fl + torch.floor(2 * (a - fl)))  # round half away from zero, exactly as gguf does
    q = r.to(torch.int8).view(torch.uint8)
    dh = d.to(torch.float16).view(torch.uint8)
    out = torch.cat((dh, q), dim=1)
    return out.numpy().reshape(*shape[:-1], shape[-1] // 32 * 34)
