"""The linear-layer seam: every matrix product of the forward goes through one `Linear.__call__`.

Two kinds behind it:
- `DenseLinear`: a full-precision weight (f32 for exact parity work, bf16 for speed); activations are cast
  to the weight's dtype for the product.
- `Int8Linear`: int8 values with one f32 scale per output row (what quantized GGUF tensors become).
  On the CPU, decode-sized inputs (up to 8 rows: one conversation's step, or a batch of them) go through
  the native AVX512-VNNI kernel (`native.py`; activations int8 per block of 32), or torch's weight-only
  kernel where that is not available; prefill-sized inputs run int8 x int8 (`torch._int_mm`) with the
  activations quantized per row, except the MLP down projection, whose inputs keep bf16 (see `path`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deltaserve.kernels import native

NATIVE_ROWS = native.MAX_ROWS  # up to this many input rows take the native kernel (beyond, int8 x int8 wins)
BLOCK_ROWS = 1  # one row reads a Q4_K/Q6_K tensor's own blocks (fewer bytes); more rows: the int8 table (less unpacking)
DECODE_ROWS = 4  # up to this many input rows take the weight-only int8 kernel; more: int8 x int8


def activations() -> str:
    """DELTASERVE_ACTIVATIONS: "int8" (default) or "bf16" (every product the bf16 way, none on the native kernel),
    read when a product is routed (so a process may change it)."""
    return os.environ.get("DELTASERVE_ACTIVATIONS", "int8")

BF16_GEMM_ROWS = 64  # the bf16 path (dequantize, GEMM) only above this many rows: oneDNN's small-M bf16 GEMM
#                      is slow here (16 ms for 8 x 1024 x 8224), the weight-only kernel is not


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

    @property
    def decode_nbytes(self) -> int:
        """The weight bytes a one-row product reads (what bounds decode)."""
        return self.nbytes

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
        self.int8_activations = True  # many-row inputs quantized to int8 per row (else: bf16 GEMM)
        # the file's own Q4_K/Q6_K blocks, kept too where the tensor had them (decode reads them: fewer bytes):
        # (kind, uint8 [rows, blocks per row * block bytes]) segments whose rows add up to out_features
        self.blocks: list[tuple[str, torch.Tensor]] = []

    def keep_blocks(self, segments: list[tuple[str, torch.Tensor]]) -> None:
        """Keep a tensor's quantized blocks, as segments of rows (several for a stack of mixed kinds)."""
        if sum(d.shape[0] for _, d in segments) != self.out_features or any(k not in native.BLOCK_TYPES
                                                                             for k, _ in segments):
            raise ValueError(f"blocks of {[(k, d.shape[0]) for k, d in segments]} do not fit a table of "
                             f"{self.out_features} rows")
        self.blocks = [native.for_products(k, d) for k, d in segments]

    @property
    def block_kind(self) -> str | None:
        """The file's block types of the kept segments (a repacked Q4_K still reads as Q4_K)."""
        return "+".join(k.split("/")[0] for k, _ in self.blocks) or None

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Linear":
        return cls(*quantize_rows_int8(w))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        path = self.path(x2.shape[0])
        if path == "native":
            y = self._from_blocks(x2) if self.blocks and x2.shape[0] <= BLOCK_ROWS else None
            if y is None:
                y = native.linear_i8(x2, self.q, self.scale)
            if y is not None:
                return y.reshape(*shape[:-1], self.out_features)
            path = "weight-only"
        if path == "weight-only":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.q, self.scale_bf16).float()
        elif path == "int8":
            xq, xs = native.quantize_rows(x2) or quantize_rows_int8(x2)
            acc = torch._int_mm(xq, self.q.t())
            y = native.scale_product(acc, self.scale, xs)
            if y is None:
                y = torch.mul(acc, self.scale).mul_(xs[:, None])  # int32 -> f32 in one pass
        else:
            y = F.linear(x2.to(torch.bfloat16), self.dequant(torch.bfloat16)).float()
        return y.reshape(*shape[:-1], self.out_features)

    def _from_blocks(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = [native.linear_blocks(x, kind, data, data.shape[0]) for kind, data in self.blocks]
        if any(p is None for p in parts):
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def path(self, rows: int) -> str:
        """How a product of `rows` input rows runs: "native" (the AVX512-VNNI kernel, activations int8 per
        block of 32), "weight-only" (torch's kernel: bf16 activations, int8 weights read directly), "int8"
        (int8 x int8, activations int8 per row) or "bf16" (the weight dequantized, a bf16 GEMM)."""
        if self.q.device.type != "cpu":  # an accelerator: its bf16 GEMM is fast, and torch._int_mm on CUDA
            return "weight-only" if rows <= 16 else "bf16"  # refuses 16 rows or fewer
        int8 = activations() == "int8"
        if rows <= NATIVE_ROWS and int8 and native.takes(self.in_features):
            return "native"  # per-block activation scales: also fine for the down projection's outliers
        int8 = self.int8_activations and int8
        if rows <= DECODE_ROWS or (rows <= BF16_GEMM_ROWS and not int8):
            return "weight-only"
        return "int8" if int8 else "bf16"

    def dequant(self, dtype=torch.float32) -> torch.Tensor:
        scale = self.scale_bf16 if dtype == torch.bfloat16 else self.scale.to(dtype)
        return torch.mul(self.q, scale[:, None])  # int8 x scale in one pass (3x faster than convert, then scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup on the same table)."""
        return self.q.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 6 + sum(d.numel() for _, d in self.blocks)

    @property
    def decode_nbytes(self) -> int:
        if self.blocks and BLOCK_ROWS >= 1 and self.path(1) == "native":
            return sum(d.numel() for _, d in self.blocks)
        return self.q.numel() + self.scale.numel() * 4

    @property
    def kind(self) -> str:
        return "int8"

    def to(self, device: torch.device | str) -> "Int8Linear":
        out = Int8Linear(self.q.to(device), self.scale.to(device))
        out.int8_activations = self.int8_activations
        if self.blocks and out.q.device.type == "cpu":  # only the CPU kernel reads them
            out.keep_blocks(self.blocks)
        return out

    def dense(self) -> torch.Tensor:
        return self.dequant(torch.float32)


def int8_route() -> str:
    """What a CPU decode product of an int8 table runs on, said in the backend's description."""
    if activations() != "int8":
        return f"int8 tables with bf16 activations (DELTASERVE_ACTIVATIONS={activations()})"
    ok, why = native.status()
    if ok:
        return f"int8 decode products on the native kernel ({why})"
    return f"int8 decode products on torch's weight-only kernel (native kernel not used: {why})"


class StackedLinear(Linear):
    """Several projections of the same input as one call: outputs concatenated along the last dim.
    The parts are fused into one weight when they are of one kind; otherwise each is called in turn."""

    def __init__(self, parts: list[Linear]):
        self.sizes = tuple(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(self.sizes)
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("stacked projections must share their input size")
        if all(isinstance(p, Int8Linear) for p in parts):
            fused = Int8Linear(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
            if all(p.blocks for p in parts):  # the parts' blocks too, adjacent ones of one kind as one table
                segments: list[tuple[str, list[torch.Tensor]]] = []
                for kind, data in (seg for p in parts for seg in p.blocks):
                    if segments and segments[-1][0] == kind:
                        segments[-1][1].append(data)
                    else:
                        segments.append((kind, [data]))
                fused.keep_blocks([(k, d[0] if len(d) == 1 else torch.cat(d)) for k, d in segments])
            self.fused: Linear | None = fused
            self.parts: list[Linear] = []
        elif all(isinstance(p, DenseLinear) for p in parts) and len({p.weight.dtype for p in parts}) == 1:
            self.fused = DenseLinear(torch.cat([p.weight for p in parts]))
            self.parts = []
        else:
            self.fused, self.parts = None, list(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)

    @property
    def nbytes(self) -> int:
        return self.fused.nbytes if self.fused is not None else sum(p.nbytes for p in self.parts)

    @property
    def decode_nbytes(self) -> int:
        return self.fused.decode_nbytes if self.fused is not None else sum(p.decode_nbytes for p in self.parts)

    @property
    def kind(self) -> str:
        return self.fused.kind if self.fused is not None else "+".join(p.kind for p in self.parts)

    def to(self, device: torch.device | str) -> "StackedLinear":
        out = StackedLinear.__new__(StackedLinear)
        out.sizes, out.in_features, out.out_features = self.sizes, self.in_features, self.out_features
        out.fused = self.fused.to(device) if self.fused is not None else None
        out.parts = [p.to(device) for p in self.parts]
        return out

    def dense(self) -> torch.Tensor:
        return self.fused.dense() if self.fused is not None else torch.cat([p.dense() for p in self.parts])
