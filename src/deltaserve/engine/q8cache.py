"""The q8_0 KV cache: llama.cpp's `-ctk q8_0 -ctv q8_0` blocks, held as two torch tensors.

A cache of shape [kv_heads, capacity, head_dim] is `qs`, int8 values of that shape, and `d`, one f16 scale per 32
values along head_dim ([kv_heads, capacity, head_dim / 32]): 34 bytes per 32 values, as the capacity plan counts
(engine/state.py KV_BYTES_PER_VALUE). A block's scale is max|x| / 127 and its values x / scale rounded to nearest,
halves away from zero: `gguf.quants`' Q8_0 (the reference of ggml-quants.c), bit for bit.

`Q8Cache` stands where a cache tensor stands (DecodeState.kv, Checkpoint.kv) and answers the few tensor operations
the engine does on a cache: slices along the positions (`cache[:, a:b]`, a view), assignment of float values (which
quantizes them), `copy_`, `index_copy_`, `zero_`, `to(dtype)` (dequantized: what the torch attention reads),
`to(device)`. Its `dtype` is torch.int8 (its values' type; engine/state.py names it q8_0). The one-call native
decode does not read it: a q8_0 cache decodes through torch ops.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per q8_0 block (one f16 scale each)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D a multiple of 32) as q8_0: (int8 values [..., D], f16 scales [..., D / 32]), rounded as
    gguf.quants' Q8_0 (scale max|x|/127 in f32, values x * (1/scale) rounded halves away from zero)."""
    x = x.float()
    if x.shape[-1] % BLOCK:
        raise ValueError(f"a q8_0 cache needs head_dim a multiple of {BLOCK}, got {x.shape[-1]}")
    b = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    a = v.abs()
    floored = a.floor()
    q = (floored + (2 * (a - floored)).floor()) * v.sign()  # gguf.quants' np_roundf
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1).to(torch.float16)


def dequantize(qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of q8_0 blocks (int8 `qs` [..., D], f16 scales `d` [..., D / 32]) in `dtype` (value x scale in
    f32, as gguf.quants' dequantization)."""
    out = qs.float()  # a new contiguous tensor: the scales multiply into it in place (half the time of a product)
    out.view(*out.shape[:-1], out.shape[-1] // BLOCK, BLOCK).mul_(d.float().unsqueeze(-1))
    return out if dtype == torch.float32 else out.to(dtype)


class Q8Cache:
    """One attention layer's keys or values in q8_0: `qs` int8 [kv_heads, positions, head_dim] and `d` f16
    [kv_heads, positions, head_dim / 32]. Indexing selects along the first two dims only (heads, positions)."""

    dtype = torch.int8

    def __init__(self, qs: torch.Tensor, d: torch.Tensor):
        self.qs, self.d = qs, d

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> Q8Cache:
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros((*shape[:-1], shape[-1] // BLOCK), dtype=torch.float16, device=device))

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> Q8Cache:
        return cls(torch.empty(shape, dtype=torch.int8, device=device),
                   torch.empty((*shape[:-1], shape[-1] // BLOCK), dtype=torch.float16, device=device))

    @classmethod
    def of(cls, x: torch.Tensor) -> Q8Cache:
        """A float cache (or a Q8Cache, returned as it is) quantized."""
        return x if isinstance(x, Q8Cache) else cls(*quantize(x))

    @property
    def shape(self) -> torch.Size:
        return self.qs.shape

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes

    def data_ptr(self) -> int:
        return self.qs.data_ptr()

    def __getitem__(self, index) -> Q8Cache:
        return Q8Cache(self.qs[index], self.d[index])

    def __setitem__(self, index, value) -> None:
        qs, d = (value.qs, value.d) if isinstance(value, Q8Cache) else quantize(value)
        self.qs[index] = qs
        self.d[index] = d

    def copy_(self, src) -> Q8Cache:
        """`src` (a Q8Cache, or float values: quantized) copied in."""
        self[...] = src
        return self

    def index_copy_(self, dim: int, index: torch.Tensor, src: torch.Tensor) -> Q8Cache:
        """Float values `src` quantized into the positions `index` along `dim` (0 or 1: not head_dim)."""
        qs, d = (src.qs, src.d) if isinstance(src, Q8Cache) else quantize(src)
        self.qs.index_copy_(dim, index, qs)
        self.d.index_copy_(dim, index, d)
        return self

    def zero_(self) -> Q8Cache:
        self.qs.zero_()
        self.d.zero_()
        return self

    def contiguous(self) -> Q8Cache:
        return Q8Cache(self.qs.contiguous(), self.d.contiguous())

    def cpu(self) -> Q8Cache:
        return self.to("cpu")

    def float(self) -> torch.Tensor:
        return dequantize(self.qs, self.d)

    def to(self, target) -> Q8Cache | torch.Tensor:
        """`to(dtype)`: the values dequantized in that float type (itself for int8); `to(device)`: moved."""
        if isinstance(target, torch.dtype):
            return self if target == torch.int8 else dequantize(self.qs, self.d, target)
        return Q8Cache(self.qs.to(target), self.d.to(target))

    def __repr__(self) -> str:
        return f"Q8Cache(shape={tuple(self.shape)}, device={self.device})"
