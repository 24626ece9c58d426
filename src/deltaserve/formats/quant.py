"""Vectorised dequantisation of GGUF tensor data in torch.

Supported types: every type llama.cpp's quantizer writes for these models: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0,
TQ2_0, MXFP4, NVFP4. The IQ types' lookup grids are gguf's own (gguf.quants builds them from ggml's tables). Every
kernel reproduces the float
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
    {_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K,
     _T.Q6_K, _T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S, _T.IQ4_NL, _T.IQ4_XS,
     _T.TQ1_0, _T.TQ2_0, _T.MXFP4, _T.NVFP4}
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
    except RuntimeError:  # storage offset or a row stride not a multiple of the element size (a sliced byte buffer)
        return torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device).copy_(blocks).view(dtype)


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




# -- the other block types: the operation order of gguf.quants' dequantize_blocks, each one f32 rounding ----------

def _shifted(x: torch.Tensor, shifts: Sequence[int], dim: int) -> torch.Tensor:
    """x >> s for each s, stacked along a new axis `dim` (uint8 or int32 bit fields)."""
    return torch.stack([x >> s for s in shifts], dim=dim)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [n, 16] -> [n, 32]: the low nibbles (values 0..15), then the high ones (16..31)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 bits of a little-endian uint32 (uint8 [n, 4]) as uint8 [n, 32], bit i at i."""
    bits = _shifted(qh, range(8), 2)  # [n, 4, 8]: byte b's bit i is value 8b + i
    return (bits & 1).reshape(qh.shape[0], 32)


def _deq_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles32(blocks[:, 4:20]))
    out.mul_(_f16_col(blocks, 0))
    out.add_(_f16_col(blocks, 2))


def _deq_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles32(blocks[:, 6:22]) | (_fifth_bits(blocks[:, 2:6]) << 4)).view(torch.int8) - 16
    out.copy_(q)
    out.mul_(_f16_col(blocks, 0))


def _deq_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles32(blocks[:, 8:24]) | (_fifth_bits(blocks[:, 4:8]) << 4))
    out.mul_(_f16_col(blocks, 0))
    out.add_(_f16_col(blocks, 2))


def _deq_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16_col(blocks, 80), _f16_col(blocks, 82)
    dl = (d * (scales & 0x0F)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4)).unsqueeze(-1)
    q = _shifted(blocks[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 2) & 3  # [n, 2, 4, 32] -> 16 groups of 16
    o = out.view(n, 16, 16)
    o.copy_(q.reshape(n, 16, 16))
    o.mul_(dl)
    o.sub_(ml)


def _deq_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    hmask, qs, sc = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16_col(blocks, 108)
    low = _shifted(sc[:, 0:8], (0, 4), 1).reshape(n, 16) & 0x0F
    high = _shifted(sc[:, 8:12], (0, 2, 4, 6), 1).reshape(n, 16) & 0x03
    scales = (low | (high << 4)).view(torch.int8) - 32
    dl = (d * scales).unsqueeze(-1)  # [n, 16, 1]
    ql = (_shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(n, 16, 16)
    qh = ((_shifted(hmask.reshape(n, 1, 32), range(8), 2) & 1) ^ 1).reshape(n, 16, 16)
    q = ql.view(torch.int8) - (qh << 2).view(torch.int8)
    o = out.view(n, 16, 16)
    o.copy_(q)
    o.mul_(dl)


def _deq_tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, qh = blocks[:, 0:48], blocks[:, 48:52]
    pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=blocks.device)
    q0 = (qs[:, :32].reshape(n, 1, 32) * pow3.view(1, 5, 1)).reshape(n, -1)  # uint8 products wrap, as numpy's
    q1 = (qs[:, 32:].reshape(n, 1, 16) * pow3.view(1, 5, 1)).reshape(n, -1)
    q2 = (qh.reshape(n, 1, 4) * pow3[:4].view(1, 4, 1)).reshape(n, -1)
    q = torch.cat((q0, q1, q2), dim=1).to(torch.int32)
    out.copy_(((q * 3) >> 8) - 1)
    out.mul_(_f16_col(blocks, 52))


def _deq_tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    q = (_shifted(blocks[:, 0:64].reshape(n, 2, 32), (0, 2, 4, 6), 2) & 3).reshape(n, 256)
    out.copy_(q.view(torch.int8) - 1)
    out.mul_(_f16_col(blocks, 64))


_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # MXFP4 / NVFP4 values, doubled
_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_TABLES: dict[tuple, torch.Tensor] = {}


def _table(key, device: torch.device, make: Callable[[], Any]) -> torch.Tensor:
    """A lookup table (a tuple's values, or gguf's grid of an IQ type) as a float32 tensor on `device`, made once."""
    k = (key, str(device))
    if k not in _TABLES:
        _TABLES[k] = torch.as_tensor(np.asarray(make(), dtype=np.float32), device=device)
    return _TABLES[k]


def _values(values: tuple, device) -> torch.Tensor:
    return _table(values, device, lambda: values)


def _grid(name: str, device) -> torch.Tensor:
    """gguf's grid of IQ type `name`: float32 [entries, values]."""
    def make():
        import gguf.quants as gq

        cls = getattr(gq, name)
        cls.init_grid()
        return cls.grid.reshape(cls.grid_shape)
    return _table(name, device, make)


def _deq_mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    e = blocks[:, 0:1].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    out.copy_(_values(_E2M1, blocks.device)[_nibbles32(blocks[:, 1:17]).long()])
    out.mul_(d)


def _deq_nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    x = blocks[:, 0:4].to(torch.int32)
    exp, man = (x >> 3) & 0xF, (x & 7).float()
    raw = torch.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * torch.exp2(exp.float() - 7))
    d = torch.where((x == 0) | (x == 0x7F), torch.zeros_like(raw), raw * 0.5).unsqueeze(-1)  # exact values
    qs = blocks[:, 4:36].reshape(n, 4, 8)
    v = _values(_E2M1, blocks.device)[torch.cat((qs & 0x0F, qs >> 4), dim=-1).long()]  # [n, 4, 16]
    out.view(n, 4, 16).copy_(d * v)


def _deq_iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_values(_IQ4NL, blocks.device)[_nibbles32(blocks[:, 2:18]).long()])
    out.mul_(_f16_col(blocks, 0))


def _deq_iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    sh = _view_as(blocks[:, 2:4], torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    low = (_shifted(blocks[:, 4:8], (0, 4), 2).reshape(n, 8) & 0x0F).to(torch.int32)
    high = (sh >> torch.arange(0, 16, 2, device=blocks.device).view(1, 8)) & 3
    dl = (d * ((low | (high << 4)) - 32)).unsqueeze(-1)  # [n, 8, 1]
    qs = blocks[:, 8:136].reshape(n, 8, 16)
    v = _values(_IQ4NL, blocks.device)[torch.cat((qs & 0x0F, qs >> 4), dim=-1).long()]  # [n, 8, 32]
    o = out.view(n, 8, 32)
    o.copy_(v)
    o.mul_(dl)


_KSIGNS: list = []


def _ksigns(device) -> torch.Tensor:
    """The signs of IQ2_XXS / IQ3_XXS: entry i of gguf's ksigns as 8 factors +-1, float32 [128, 8]."""
    def make():
        import gguf.quants as gq

        k = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
        bits = (k.reshape(128, 1) >> np.arange(8, dtype=np.uint8).reshape(1, 8)) & 1
        return np.where(bits == 0, 1.0, -1.0)
    return _table("ksigns", device, make)


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """Bytes of sign bits (uint8 [..]) as 8 factors +-1 each, float32 [.., 8]."""
    bits = (signs.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=signs.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _iq_finish(db: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor, out: torch.Tensor) -> None:
    """out = (db * grid) * signs, shapes broadcast to out's."""
    torch.mul(db * grid, signs, out=out.view(grid.shape))


def _deq_iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs = _view_as(blocks[:, 2:66], torch.int32).reshape(n, 8, 2)  # [n, 8, 2]: grid indices, then signs + scale
    aux = qs[..., 1]
    db = (d * (0.5 + ((aux >> 28) & 0xF).float()) * 0.25).view(n, 8, 1, 1)
    sign_idx = ((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=blocks.device)) & 0x7F).long()
    signs = _ksigns(blocks.device)[sign_idx]  # [n, 8, 4, 8]
    grid = _grid("IQ2_XXS", blocks.device)[_view_as(qs[..., 0].contiguous(), torch.uint8).reshape(n, 8, 4).long()]
    _iq_finish(db, grid, signs, out)


def _deq_iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs = _view_as(blocks[:, 2:66], torch.int16).to(torch.int32).reshape(n, 32) & 0xFFFF
    scales = _shifted(blocks[:, 66:74], (0, 4), 2).reshape(n, 16) & 0x0F
    db = (d * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    signs = _ksigns(blocks.device)[(qs >> 9).long()].view(n, 16, 2, 8)
    grid = _grid("IQ2_XS", blocks.device)[(qs & 511).long()].view(n, 16, 2, 8)
    _iq_finish(db, grid, signs, out)


def _deq_iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs, signs, qh, sc = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74], blocks[:, 74:82]
    scales = _shifted(sc, (0, 4), 2).reshape(n, 16) & 0x0F
    db = (d * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    high = (_shifted(qh, (0, 2, 4, 6), 2).reshape(n, 32) & 3).to(torch.int32)
    idx = qs.to(torch.int32) | (high << 8)
    grid = _grid("IQ2_S", blocks.device)[idx.long()].view(n, 16, 2, 8)
    _iq_finish(db, grid, _sign_bits(signs).view(n, 16, 2, 8), out)


def _deq_iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs = blocks[:, 2:66]
    aux = _view_as(blocks[:, 66:98], torch.int32).reshape(n, 8)
    db = (d * (0.5 + ((aux >> 28) & 0xF).float()) * 0.5).view(n, 8, 1, 1)
    sign_idx = ((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=blocks.device)) & 0x7F).long()
    signs = _ksigns(blocks.device)[sign_idx]  # [n, 8, 4, 8]
    grid = _grid("IQ3_XXS", blocks.device)[qs.long()].reshape(n, 8, 4, 8)
    _iq_finish(db, grid, signs, out)


def _deq_iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs, qh, signs, sc = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106], blocks[:, 106:110]
    scales = (_shifted(sc, (0, 4), 2).reshape(n, 8) & 0x0F).to(torch.int32)
    db = (d * (1 + 2 * scales)).view(n, 8, 1, 1)
    high = (_shifted(qh, range(8), 2).reshape(n, 64) & 1).to(torch.int32)
    grid = _grid("IQ3_S", blocks.device)[(qs.to(torch.int32) | (high << 8)).long()].reshape(n, 8, 4, 8)
    _iq_finish(db, grid, _sign_bits(signs).view(n, 8, 4, 8), out)


def _deq_iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _f16_col(blocks, 0)
    qs = blocks[:, 2:34].to(torch.int32)
    qh = _view_as(blocks[:, 34:50], torch.int16).to(torch.int32) & 0xFFFF  # [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1)).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).view(n, 8, 1, 1)
    idx = qs | (((qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=blocks.device)) & 7).reshape(n, 32) << 8)
    grid = _grid("IQ1_S", blocks.device)[idx.long()].view(n, 8, 4, 8)
    torch.mul(dl, grid + delta, out=out.view(n, 8, 4, 8))


def _deq_iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = blocks[:, 0:32].to(torch.int32)
    qh = blocks[:, 32:48]
    sc = _view_as(blocks[:, 48:56], torch.int16).to(torch.int32) & 0xFFFF  # [n, 4]
    bits = (sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=blocks.device).view(1, 4)
    d16 = bits[:, 0] | bits[:, 1] | bits[:, 2] | bits[:, 3]
    d = d16.to(torch.int16).view(torch.float16).float().view(n, 1)
    scales = ((sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=blocks.device)) & 7).reshape(n, 16)
    dl = (d * (2 * scales + 1)).view(n, 8, 2, 1, 1)
    halves = _shifted(qh, (0, 4), 2).reshape(n, 32).to(torch.int32)  # per group of 8 values: 3 index bits, a sign
    idx = qs | ((halves & 7) << 8)
    delta = torch.where((halves & 8) == 0, 0.125, -0.125).view(n, 8, 2, 2, 1)
    grid = _grid("IQ1_M", blocks.device)[idx.long()].view(n, 8, 2, 2, 8)
    torch.mul(dl, grid + delta, out=out.view(n, 8, 2, 2, 8))


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    _T.F32: _deq_f32,
    _T.F16: _deq_f16,
    _T.BF16: _deq_bf16,
    _T.Q8_0: _deq_q8_0,
    _T.Q4_0: _deq_q4_0,
    _T.Q4_K: _deq_q4_k,
    _T.Q5_K: _deq_q5_k,
    _T.Q6_K: _deq_q6_k,
    _T.Q4_1: _deq_q4_1,
    _T.Q5_0: _deq_q5_0,
    _T.Q5_1: _deq_q5_1,
    _T.Q2_K: _deq_q2_k,
    _T.Q3_K: _deq_q3_k,
    _T.TQ1_0: _deq_tq1_0,
    _T.TQ2_0: _deq_tq2_0,
    _T.MXFP4: _deq_mxfp4,
    _T.NVFP4: _deq_nvfp4,
    _T.IQ4_NL: _deq_iq4_nl,
    _T.IQ4_XS: _deq_iq4_xs,
    _T.IQ2_XXS: _deq_iq2_xxs,
    _T.IQ2_XS: _deq_iq2_xs,
    _T.IQ2_S: _deq_iq2_s,
    _T.IQ3_XXS: _deq_iq3_xxs,
    _T.IQ3_S: _deq_iq3_s,
    _T.IQ1_S: _deq_iq1_s,
    _T.IQ1_M: _deq_iq1_m,
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
