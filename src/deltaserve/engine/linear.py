"""The linear-layer seam: every matrix product of the forward goes through one `Linear.__call__`.

Two kinds behind it:
- `DenseLinear`: a full-precision weight (f32 for exact parity work, bf16 for speed); activations are cast
  to the weight's dtype for the product.
- `Int8Linear`: int8 values with one f32 scale per output row (what quantized GGUF tensors become).
  Decode-sized inputs (a few rows) go through torch's weight-only int8 kernel, which reads the int8
  weights directly (bandwidth-bound); prefill-sized inputs dequantize the weight to bf16 on the fly
  and run a bf16 GEMM (compute-bound, oneDNN). Activations enter both in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_ROWS = 16  # up to this many input rows take the weight-only int8 kernel


class Linear:
    """y = x @ W^T for x of shape [..., in_features]; the result is float32."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def nbytes(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def kind(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def to(self, device: torch.device | str) -> "Linear":  # pragma: no cover - interface
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The weight as a float32 [out, in] matrix (for tests and tied heads)."""
        raise NotImplementedError  # pragma: no cover - interface


class DenseLinear(Linear):
    """A full-precision weight [out, in]. Activations are cast to the weight's dtype for the product."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != w.dtype:
            return F.linear(x.to(w.dtype), w).float()
        return F.linear(x, w)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def kind(self) -> str:
        return str(self.weight.dtype).replace("torch.", "")

    def to(self, device: torch.device | str) -> "DenseLinear":
        return DenseLinear(self.weight.to(device))

    def dense(self) -> torch.Tensor:
        return self.weight.float()


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w ~= q * scale[:, None], |q| <= 127."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(Linear):
    """int8 weight [out, in] with an f32 scale per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8Linear needs int8 [out, in] and [out] scales, got {q.dtype} {tuple(q.shape)}, "
                             f"{tuple(scale.shape)}")
        self.q = q.contiguous()
        self.scale = scale.float().contiguous()
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        self.out_features, self.in_features = q.shape

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Linear":
        return cls(*quantize_rows_int8(w))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if x2.shape[0] <= DECODE_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale_bf16)
        else:
            y = F.linear(x2, self.dequant(torch.bfloat16))
        return y.float().reshape(*shape[:-1], self.out_features)

    def dequant(self, dtype=torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup on the same table)."""
        return self.q.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 6

    @property
    def kind(self) -> str:
        return "int8"

    def to(self, device: torch.device | str) -> "Int8Linear":
        return Int8Linear(self.q.to(device), self.scale.to(device))

    def dense(self) -> torch.Tensor:
        return self.dequant(torch.float32)
