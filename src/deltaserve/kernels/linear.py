"""The linear-layer seam: every matrix product of the forward goes through one `Linear.__call__`.

Three kinds behind it, each product on the route kernels/routes.py gives it (the one place a product's kernel and data
type are decided):
- `DenseLinear`: a full-precision weight (f32 for exact parity work, bf16 for speed); activations are cast
  to the weight's dtype for the product.
- `BlockLinear`: the file's own blocks (Q8_0, Q4_0, the K-quants, the IQ and TQ types, F16, BF16, ...) where they
  lie in its mapping, nothing converted at load. Up to routes.block_rows() input rows run on the decode products
  (activations int8 per block as llama.cpp quantizes them); more rows on the blocks' GEMM (routes.block_gemm), or
  exact chunks of rows dequantized into one reused buffer and multiplied with torch's GEMM in routes.chunk_dtype():
  f32, bf16 where torch's bf16 GEMM runs on AMX tiles, int8 where its int8 GEMM is the fast one.
- `Int8Linear`: int8 values with one f32 scale per output row (what quantized GGUF tensors become in "tables"
  mode): routes.table() says which of the int8 tables' kernel, torch's weight-only kernel, int8 x int8 or a bf16
  GEMM takes a product.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from deltaserve.formats import quant
from deltaserve.kernels import native, routes
from deltaserve.kernels.routes import GGUF_TYPES, PRODUCT_TYPES  # noqa: F401 (the types, by their GGUF names)

BLOCK_ROWS = 1  # one row reads a Q4_K/Q6_K tensor's own blocks (fewer bytes); more rows: the int8 table (less unpacking)


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
        if routes._recorders:
            name = str(w.dtype).replace("torch.", "")
            routes.taken(routes.Route("dense", f"torch {name} GEMM", name))
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


def int8_product(xq: tuple[torch.Tensor, torch.Tensor], wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """f32 [M, N] of int8 rows times an int8 weight [N, K] (xq: the rows and their scales; ws: the weight's row
    scales): torch's int8 GEMM, then both scales in one pass."""
    xi, xs = xq
    acc = torch._int_mm(xi, wq.t())
    y = native.scale_product(acc, ws, xs)
    return y if y is not None else torch.mul(acc, ws).mul_(xs[:, None])  # int32 -> f32 in one pass


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
        route = routes.table(x2.shape[0], self.in_features, self.int8_activations, self.q.device.type)
        path = route.family
        if path == "tables":
            y = self._from_blocks(x2) if self.blocks and x2.shape[0] <= BLOCK_ROWS else None
            if y is None:
                y = native.linear_i8(x2, self.q, self.scale)
            if y is not None:
                if routes._recorders:
                    routes.taken(route)
                return y.reshape(*shape[:-1], self.out_features)
            path = "weight-only"
            route = routes.Route("weight-only", "torch weight-only int8", "bf16")
        if routes._recorders:
            routes.taken(route)
        if path == "weight-only":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.q, self.scale_bf16).float()
        elif path == "int8":
            y = int8_product(native.quantize_rows(x2) or quantize_rows_int8(x2), self.q, self.scale)
        else:
            y = F.linear(x2.to(torch.bfloat16), self.dequant(torch.bfloat16)).float()
        return y.reshape(*shape[:-1], self.out_features)

    def _from_blocks(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = [native.linear_blocks(x, kind, data, data.shape[0]) for kind, data in self.blocks]
        if any(p is None for p in parts):
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def path(self, rows: int) -> str:
        """The route family of a product of `rows` input rows (routes.table): "tables" (the int8 tables' kernel,
        activations int8 per block of 32), "weight-only" (torch's kernel: bf16 activations, int8 weights read
        directly), "int8" (int8 x int8, activations int8 per row) or "bf16" (the weight dequantized, a bf16 GEMM)."""
        return routes.table(rows, self.in_features, self.int8_activations, self.q.device.type).family

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
        if self.blocks and BLOCK_ROWS >= 1 and self.path(1) == "tables":
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


def chunk_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of an [n, k] weight per chunk in `dtype`: the route's chunk of elements (x BF16_CHUNK_FACTOR for bf16) at
    most, the chunks of about equal size (no thin last chunk: the GEMM's slow shapes are the narrow ones), a multiple
    of 16."""
    elements = routes.capabilities().chunk_elements
    most = max(1, (elements * (routes.BF16_CHUNK_FACTOR if dtype == torch.bfloat16 else 1)) // k)
    if most >= n:
        return n
    pieces = -(-n // most)
    even = -(-n // pieces)
    even = -(-even // 16) * 16
    return max(1, min(most, even))


class BlockLinear(Linear):
    """A weight [out, in] held as the file's own blocks: `segments` of (GGUF type name, uint8 [rows, row bytes])
    whose rows follow each other along the output (one for a tensor; a stack of projections keeps each part's).
    The tensors are views of the file's mapping: their pages are the file's, read when a product needs them."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]], in_features: int):
        if not segments or any(k not in GGUF_TYPES or d.dim() != 2 or d.dtype != torch.uint8 for k, d in segments):
            raise ValueError(f"BlockLinear needs (type, uint8 [rows, bytes]) segments, got "
                             f"{[(k, tuple(d.shape), d.dtype) for k, d in segments]}")
        self.segments = [(k, d) for k, d in segments]
        self.in_features = in_features
        self.out_features = sum(d.shape[0] for _, d in segments)
        self.int8_activations = True  # with int8 chunks (DELTASERVE_PREFILL=int8): else its chunks are f32

    @property
    def types(self) -> list[str]:
        return [k for k, _ in self.segments]

    @property
    def block_kind(self) -> str | None:
        return "+".join(dict.fromkeys(self.types))

    def path(self, rows: int) -> str:
        """How a product of `rows` input rows runs: "blocks" (the decode products on the file's blocks, every
        segment) or "many" (each segment on the blocks' GEMM or exact chunks: routes.many_rows)."""
        c = routes.capabilities()
        return "blocks" if all(routes.blocks(k, rows, self.int8_activations, c).family == "blocks"
                               for k in self.types) else "many"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features)
        blocks = self.path(m) == "blocks"
        low: dict = {}  # the activations in each chunk dtype, made once for every chunk of that dtype
        off = 0
        c = routes.capabilities()
        for kind, data in self.segments:
            n = data.shape[0]
            route = routes.blocks(kind, m, self.int8_activations, c) if blocks else \
                routes.many_rows(kind, self.int8_activations, c)
            if blocks:
                done = native.linear_on_blocks(x2, GGUF_TYPES[kind], data, y, off)
            else:
                done = route.family == "gemm" and native.gemm_blocks(x2, GGUF_TYPES[kind], data, y, off)
            if not done:
                dtype = routes.chunk_dtype(kind, c)
                if dtype == torch.int8 and not self.int8_activations:
                    dtype = torch.float32
                route = routes.chunks(dtype, c)
                if dtype not in low:
                    low[dtype] = (native.quantize_rows(x2) or quantize_rows_int8(x2)) if dtype == torch.int8 else \
                        x2.to(dtype)
                if dtype == torch.int8:
                    self._chunks_int8(low[dtype], kind, data, y, off)
                else:
                    self._chunks(low[dtype], kind, data, y, off)
            if routes._recorders:
                routes.taken(route)
            off += n
        return y.reshape(*shape[:-1], self.out_features)

    def _chunks_int8(self, xq: tuple[torch.Tensor, torch.Tensor], kind: str, data: torch.Tensor, y: torch.Tensor,
                     off: int) -> None:
        """`_chunks` on int8: each chunk of the weight dequantized exactly, requantized per row (the int8 tables'
        rounding, made for the chunk and gone after it), times the activations quantized per row (xq: int8 rows
        and their scales) on torch's int8 GEMM. The int8 tables' prefill, without holding the tables: for CPUs
        with AVX512-VNNI and no AMX, where an f32 chunk GEMM is much slower (docs/kernels.md)."""
        n, k = data.shape[0], self.in_features
        step = max(1, min(n, routes.capabilities().chunk_elements // k))
        buf = torch.empty(step, k)
        for r in range(0, n, step):
            r1 = min(n, r + step)
            w = dequantize_rows(kind, data[r:r1], k, buf[:r1 - r])
            y[:, off + r:off + r1] = int8_product(xq, *(native.quantize_rows(w) or quantize_rows_int8(w)))

    def _chunks(self, x: torch.Tensor, kind: str, data: torch.Tensor, y: torch.Tensor, off: int) -> None:
        n, k = data.shape[0], self.in_features
        step = chunk_rows(n, k, x.dtype)
        low = torch.empty(step, k, dtype=x.dtype) if x.dtype != torch.float32 else None
        buf = None
        for r in range(0, n, step):
            r1 = min(n, r + step)
            if low is not None and x.dtype == torch.bfloat16 and native.dequant_bf16(GGUF_TYPES[kind], data[r:r1], k,
                                                                                      low[:r1 - r]):
                w = low[:r1 - r]  # rounded to bf16 by c/dequant.c: no f32 chunk, no copy pass
            else:
                if buf is None:
                    buf = torch.empty(step, k)
                w = dequantize_rows(kind, data[r:r1], k, buf[:r1 - r])
                if low is not None:
                    w = low[:r1 - r].copy_(w)
            y[:, off + r:off + r1] = x @ w.t()

    def dequant(self, dtype=torch.float32) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features)
        off = 0
        for kind, data in self.segments:
            dequantize_rows(kind, data, self.in_features, out[off:off + data.shape[0]])
            off += data.shape[0]
        return out.to(dtype)

    def dense(self) -> torch.Tensor:
        return self.dequant(torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup): only those rows' blocks are read."""
        (kind, data), = self.segments
        sel = data.index_select(0, ids.reshape(-1).to(torch.long))
        out = torch.empty(sel.shape[0], self.in_features)
        return dequantize_rows(kind, sel, self.in_features, out).reshape(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.segments)

    @property
    def kind(self) -> str:
        return self.block_kind or "blocks"

    def to(self, device: torch.device | str) -> Linear:
        """On the CPU, itself; on an accelerator, an int8 table per output row (what its products take), built
        from the exact values a chunk at a time."""
        if torch.device(device).type == "cpu":
            return self
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scale = torch.empty(self.out_features)
        step = max(1, routes.capabilities().chunk_elements // self.in_features)
        for r in range(0, self.out_features, step):
            part = self._rows_dense(r, min(self.out_features, r + step))
            q[r:r + part.shape[0]], scale[r:r + part.shape[0]] = quantize_rows_int8(part)
        return Int8Linear(q, scale).to(device)

    def _rows_dense(self, r0: int, r1: int) -> torch.Tensor:
        parts, off = [], 0
        for kind, data in self.segments:
            n = data.shape[0]
            lo, hi = max(r0, off), min(r1, off + n)
            if lo < hi:
                parts.append(dequantize_rows(kind, data[lo - off:hi - off], self.in_features,
                                             torch.empty(hi - lo, self.in_features)))
            off += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def dequantize_rows(kind: str, data: torch.Tensor, cols: int, out: torch.Tensor) -> torch.Tensor:
    """Rows of blocks (uint8 [rows, row bytes]) into `out` (f32 [rows, cols], contiguous), exactly (what gguf's
    dequantization gives, bit for bit): c/dequant.c where the native library runs, formats.quant (torch) otherwise."""
    if not native.dequant(GGUF_TYPES[kind], data, cols, out):
        out.copy_(quant.dequantize(data.reshape(-1), kind, (data.shape[0], cols)))
    return out


def row_view(layer: Linear, r0: int, r1: int) -> Linear:
    """Output rows r0..r1 of a DenseLinear, Int8Linear or one-segment BlockLinear, as a view of its weight (nothing
    copied): one expert's rows of an MoE layer's 3-D tensor."""
    if not 0 <= r0 < r1 <= layer.out_features:
        raise ValueError(f"rows {r0}..{r1} of a {layer.out_features}-row projection")
    if isinstance(layer, DenseLinear):
        return DenseLinear(layer.weight[r0:r1])
    if isinstance(layer, Int8Linear):
        out = Int8Linear(layer.q[r0:r1], layer.scale[r0:r1])
        out.int8_activations = layer.int8_activations
        return out
    if isinstance(layer, BlockLinear) and len(layer.segments) == 1:
        (kind, data), = layer.segments
        out = BlockLinear([(kind, data[r0:r1])], layer.in_features)
        out.int8_activations = layer.int8_activations
        return out
    raise ValueError(f"no row view of a {type(layer).__name__} of {layer.kind}")


class StackedLinear(Linear):
    """Several projections of the same input as one call: outputs concatenated along the last dim.
    The parts are fused into one weight when they are of one kind (and `fuse`: a fusion copies an int8 or dense
    weight, never a BlockLinear's); otherwise each is called in turn."""

    def __init__(self, parts: list[Linear], fuse: bool = True):
        self.sizes = tuple(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(self.sizes)
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("stacked projections must share their input size")
        if not fuse and not all(isinstance(p, BlockLinear) for p in parts):
            self.fused, self.parts = None, list(parts)
        elif all(isinstance(p, Int8Linear) for p in parts):
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
        elif all(isinstance(p, BlockLinear) for p in parts):  # one product over the parts' segments, no copy
            self.fused = BlockLinear([seg for p in parts for seg in p.segments], self.in_features)
            self.parts = []
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
