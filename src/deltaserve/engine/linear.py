"""The linear-layer seam: every matrix product of the forward goes through one `Linear.__call__`.

Dense weights today (f32 or bf16); packed quantized forms plug in behind the same call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
