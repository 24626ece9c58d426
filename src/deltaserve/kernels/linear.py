"""The linear-layer seam: every matrix product of the forward goes through one `Linear.__call__`.

Three kinds behind it:
- `DenseLinear`: a full-precision weight (f32 for exact parity work, bf16 for speed); activations are cast
  to the weight's dtype for the product.
- `BlockLinear`: the file's own blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, F16, BF16) where they lie in its mapping,
  nothing converted at load. Up to block_rows() input rows (16; 32 where chunks run on AMX) run on blocks.c's products (activations int8 per
  block as llama.cpp quantizes them); more rows dequantize a chunk of rows at a time, exactly, into an f32
  buffer of CHUNK_ELEMENTS and multiply it with torch's GEMM (the chunk is the only copy, and it is reused): f32,
  or bf16 where torch's bf16 GEMM runs on AMX tiles (`chunk_dtype`: about 4.6x its f32 GEMM on a Xeon here, and on
  the trained demo model's Q8_0 file a prefill 0.79x llama.cpp's distance from the f32 logits, f32 chunks 0.68x).
- `Int8Linear`: int8 values with one f32 scale per output row (what quantized GGUF tensors become).
  On the CPU, decode-sized inputs (up to 8 rows: one conversation's step, or a batch of them) go through
  the native AVX512-VNNI kernel (`native.py`; activations int8 per block of 32), or torch's weight-only
  kernel where that is not available; prefill-sized inputs run int8 x int8 (`torch._int_mm`) with the
  activations quantized per row, except the MLP down projection, whose inputs keep bf16 (see `path`).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from deltaserve.formats import quant
from deltaserve.kernels import native
from deltaserve import settings

NATIVE_ROWS = native.MAX_ROWS  # up to this many input rows take the native kernel (beyond, int8 x int8 wins)
BLOCK_ROWS = 1  # one row reads a Q4_K/Q6_K tensor's own blocks (fewer bytes); more rows: the int8 table (less unpacking)
DECODE_ROWS = 4  # up to this many input rows take the weight-only int8 kernel; more: int8 x int8


def activations() -> str:
    """DELTASERVE_ACTIVATIONS: "int8" (default) or "bf16" (every product the bf16 way, none on the native kernel),
    as the process read its settings (deltaserve.settings)."""
    return settings.current().activations

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


_INT8_EXACT: list[bool] = []


def int8_gemm_exact() -> bool:
    """Whether torch's int8 GEMM (torch._int_mm) sums exactly on this CPU. Where oneDNN has neither AVX512-VNNI nor
    AMX (an AVX2 CPU, a Zen 3; or oneDNN held to AVX2) it multiplies u8 x s8 pairs into int16 with saturation
    (vpmaddubsw), and its sums come out wrong: off by up to 90,924 on random int8 [64, 512] x [512, 64] with
    ONEDNN_MAX_CPU_ISA=AVX2 on the Xeon here, exact without it. Probed once, on a product whose answer is known."""
    if not _INT8_EXACT:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
        try:
            _INT8_EXACT.append(bool(torch.equal(torch._int_mm(a, b), a.int() @ b.int())))
        except RuntimeError:
            _INT8_EXACT.append(False)
    return _INT8_EXACT[0]


INT8_INEXACT = "torch's int8 GEMM does not sum exactly on this CPU (no AVX512-VNNI or AMX: its int16 pair sums saturate)"


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
        """How a product of `rows` input rows runs: "native" (the AVX512-VNNI kernel, activations int8 per
        block of 32), "weight-only" (torch's kernel: bf16 activations, int8 weights read directly), "int8"
        (int8 x int8, activations int8 per row) or "bf16" (the weight dequantized, a bf16 GEMM)."""
        if self.q.device.type != "cpu":  # an accelerator: its bf16 GEMM is fast, and torch._int_mm on CUDA
            return "weight-only" if rows <= 16 else "bf16"  # refuses 16 rows or fewer
        int8 = activations() == "int8"
        if rows <= NATIVE_ROWS and int8 and native.takes(self.in_features):
            return "native"  # per-block activation scales: also fine for the down projection's outliers
        int8 = self.int8_activations and int8 and int8_gemm_exact()  # else bf16 (int8_route says so)
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


# every block type a file of these models may hold (formats/quant.py dequantizes each exactly), by GGUF id
GGUF_TYPES = {t.name: int(t) for t in sorted(quant.SUPPORTED_TYPES, key=int)}
# the types blocks.c multiplies as they are: Q8_0, Q4_0 and the K-quants on int8 activations (as llama.cpp's), F16 and
# BF16 in f32; every other block type by dequantizing each row exactly and multiplying it in f32 (its kind 4)
PRODUCT_TYPES = {k for k in GGUF_TYPES if k != "F32"}
BLOCK_GEMV_ROWS = 16  # up to this many rows: blocks.c's int8 products; beyond: exact chunks and a GEMM
BLOCK_ROWS_AMX = 32  # the same where the chunks are bf16 on AMX tiles and blocks.c's products 512-bit (block_rows)
CHUNK_ELEMENTS = 1 << 20  # an f32 chunk of 4 MiB: cache-sized, and each product's only transient of weights
# bf16 chunks (the AMX route) hold 4x the elements (8 MiB): oneDNN's bf16 GEMM of 512 prefill rows by a chunk of 512
# weight rows ran at half the rate of 1024 rows or more (measured on two threads of a Xeon with AMX, K = 2048:
# 1.17 ms for 512 rows, 1.16 ms for 1024; ~400-470 GMAC/s at 384-512 rows, 650-900 from 1024 up)
BF16_CHUNK_FACTOR = 4


def chunk_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of an [n, k] weight per chunk in `dtype`: CHUNK_ELEMENTS (x BF16_CHUNK_FACTOR for bf16) at most, the
    chunks of about equal size (no thin last chunk: the GEMM's slow shapes are the narrow ones), a multiple of 16."""
    most = max(1, (CHUNK_ELEMENTS * (BF16_CHUNK_FACTOR if dtype == torch.bfloat16 else 1)) // k)
    if most >= n:
        return n
    pieces = -(-n // most)
    even = -(-n // pieces)
    even = -(-even // 16) * 16
    return max(1, min(most, even))


_AMX: list[bool] = []
# the block kinds whose many-row products take int8 chunks by default where the CPU has AVX512-VNNI and no AMX and
# blocks.c's GEMM does not take them (block_gemm): each of their rows holds at most 64 levels per block,
# coarser than int8 per row, so requantizing adds little (0.8B trained demo, Q4_K_M prefill: 0.98x llama.cpp's error
# against f32, f32 chunks 0.95x); Q8_0 and 16-bit weights would lose their own precision there (Q8_0: 1.31x, the
# issue's bound is 1.1x) and stay exact f32 chunks
INT8_CHUNK_KINDS = ("Q4_0", "Q4_K", "Q5_K", "Q6_K",  # and every type of at most 5 bits a value the file may hold:
                    "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS",
                    "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")


def amx_bf16() -> bool:
    """True where the CPU has AMX-BF16 and the kernel lets this process use its tiles (torch asks for them; torch's
    oneDNN then runs bf16 GEMMs on them). Found once per process. DELTASERVE_AMX=off routes as on a CPU without
    AMX (to measure that route here; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps torch's own GEMMs off the tiles)."""
    if not _AMX:
        _AMX.append(settings.current().amx and "amx_bf16" in native.cpu_flags()
                    and bool(getattr(torch._C._cpu, "_init_amx", lambda: False)()))
    return _AMX[0]


def int8_chunks_fast() -> bool:
    """True where torch's int8 GEMM is the fast many-row product and AMX is not there: an AVX512-VNNI CPU (the one
    native.c builds for) without AMX tiles, a Zen 4/5. Measured on the Xeon with AMX left out (DELTASERVE_AMX=off
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), 0.8B pp512: Q4_K_M int8 chunks 467 tok/s, f32 chunks 288, bf16 185, the
    int8 tables 466 (at 1.76x the memory); Q8_0 455, 284, 184 and 452. On an AVX2 CPU (a Zen 3) torch's int8
    GEMM runs at about 1 GMAC/s against 20 for its f32 one."""
    return not amx_bf16() and native.status()[0]


def prefill_mode() -> str:
    """DELTASERVE_PREFILL: "f32", "bf16" or "int8" (every chunk in that dtype), else "auto"."""
    mode = settings.current().prefill
    if mode == "int8" and not int8_gemm_exact():
        return "f32"  # blocks_route says why
    return mode if mode in ("f32", "bf16", "int8") else "auto"


def chunk_dtype(kind: str | None = None) -> torch.dtype:
    """The dtype of BlockLinear's many-row products on blocks of `kind`: DELTASERVE_PREFILL "f32" (exact weights,
    f32 activations), "bf16", "int8" (each chunk of the weight requantized per row, the activations per row, torch's
    int8 GEMM: the int8 tables' prefill without the tables, see BlockLinear._chunks_int8), or "auto" (default):
    bf16 where amx_bf16(); int8 for the 4- to 6-bit kinds (INT8_CHUNK_KINDS) where int8_chunks_fast(); else f32.
    Without a kind: the dtype of most chunks (what the route line leads with)."""
    mode = prefill_mode()
    if mode != "auto":
        return {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[mode]
    if amx_bf16():
        return torch.bfloat16
    if int8_chunks_fast() and (kind is None or kind in INT8_CHUNK_KINDS):
        return torch.int8
    return torch.float32


# the block kinds blocks.c's many-row GEMM takes (ds_gemm_blocks): Q8_0 and the K-quants from their own bytes, every
# other quantized type from its rows as the products expand them (a scale per 32 or 16, a min for Q4_1/Q5_1/Q2_K).
# On the Xeon routed as a CPU without AMX, 512 rows on 2 threads, [3584, 1024] / [1024, 3584]: IQ4_XS 5.5 / 6.5 ms on
# the GEMM against 8.8 on int8 chunks and 17.2-17.3 on the down projection's f32 chunks; Q4_0 5.3 / 6.0 against
# 8.1-8.5 and 16.4-17.3; Q5_0, Q4_1, Q5_1, IQ4_NL, MXFP4 5.1-6.7 against 7.6-9.9 and 15.2-20.2; the types with a
# scale per 16 (Q3_K, the IQ grids, ternary, NVFP4) 6.9-9.9 against 7.3-10.7 and 14.2-19.7
GEMM_KINDS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4",
              "Q3_K", "TQ1_0", "TQ2_0", "NVFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "Q2_K")
# ... of which those whose activations the GEMM rounds to int8 per block of 256 with an f32 scale (llama.cpp's Q8_K,
# what it multiplies these types with; blocks.c's gemm_a256): the tile then scales each sub-block's sum by the weight's
# scale alone and the activations' once per 256, a multiply less per sub-block (Xeon, AMX left out, [3584, 1024] x
# 512 rows: Q6_K 6.9 -> 5.7 ms, Q4_K 5.1 -> 4.3, IQ2_XS 7.4 -> 5.8). The others' per block of 32 (Q8_0's).
GEMM_A256 = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
             "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")


def block_gemm(kind: str, int8_activations: bool = True) -> bool:
    """Whether many rows on blocks of `kind` run on blocks.c's GEMM on the blocks themselves (ds_gemm_blocks: the
    file's values exactly, the activations int8 per block as llama.cpp multiplies the type: of 32 with an f16 scale
    (Q8_0's) or, for GEMM_A256, of 256 with an f32 scale (Q8_K's)) rather than on chunks: GEMM_KINDS under
    DELTASERVE_PREFILL=auto where the CPU has AVX512-VNNI and no AMX (a Zen 4/5), and on an AVX2 CPU (a Zen 3) the
    kinds its vpmaddubsw tiles take faster than torch's f32 GEMM takes exact chunks (native.gemm_beats_f32: Q4_K,
    Q5_K, Q6_K, Q4_1, Q5_1, Q2_K; a Q4_K [8192, 2048] x 512 rows 50-65 ms against 96); where AMX is there, bf16
    chunks on its tiles are faster (torch's bf16 GEMM 645-800 GOP/s against this GEMM's 500-690).
    Measured on the Xeon with AMX left out, 512 rows on 2 threads: a Q8_0 [3584, 1024] 5.4-7.5 ms against 16.6-21.5
    for torch's f32 GEMM on the exact chunks; Q4_K 5.7 against 16.8; Q6_K 8.5 against 18.1 (its scales come every
    16 values). The int8 chunks (requantized per row) ran as fast, but took the trained demo's Q8_0 prefill to 1.31x
    llama.cpp's error against f32 (the issue's bound is 1.1x) and its Q4_K_M one to 0.98x (this GEMM: 0.95x).
    `int8_activations` False (the MLP's down projection, whose inputs have outliers) keeps a Q8_0 weight on exact
    f32 chunks: on the GEMM the Q8_0 prefill came to 1.11x llama.cpp's error, on f32 chunks 0.95x; a 4- to 6-bit
    weight's own error is far larger than that rounding (Q4_K_M: 0.953x with it on the GEMM, 0.954x without)."""
    return kind in GEMM_KINDS and (int8_activations or kind != "Q8_0") and prefill_mode() == "auto" \
        and not amx_bf16() and native.has("ds_gemm_blocks") and native.gemm_beats_f32(GGUF_TYPES[kind])


def block_rows() -> int:
    """The most input rows a product takes on blocks.c's products (more go to chunks): BLOCK_GEMV_ROWS, or
    BLOCK_ROWS_AMX where the chunks are bf16 on AMX tiles and blocks.c's products are the 512-bit VNNI ones. There
    oneDNN reorders every chunk for its tiles, a fixed ~230 ms of a 0.8B prefill whatever the rows, and blocks.c's
    products stay faster up to 32-40 rows (a 0.8B prefill on the Xeon, blocks against chunks: 24 rows 191 against
    280 ms (Q4_K_M), 217 against 271 (Q8_0); 32 rows 254 / 305 and 278 / 284; 48 rows 362 / 332 and 387 / 292)."""
    if chunk_dtype() == torch.bfloat16 and amx_bf16() and native.has("ds_blocks_vnni"):
        return BLOCK_ROWS_AMX
    return BLOCK_GEMV_ROWS


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
        """How a product of `rows` input rows runs: "blocks" (blocks.c's int8 products on the file's blocks) or
        "chunks" (exact chunks of the weight, torch's GEMM in chunk_dtype())."""
        if rows <= block_rows() and all(k in PRODUCT_TYPES for k in self.types) and native.portable()[0]:
            return "blocks"
        return "chunks"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features)
        blocks = self.path(m) == "blocks"
        low: dict = {}  # the activations in each chunk_dtype(kind), made once for every chunk of that dtype
        off = 0
        for kind, data in self.segments:
            n = data.shape[0]
            if blocks:
                done = native.linear_on_blocks(x2, GGUF_TYPES[kind], data, y, off)
            else:
                done = block_gemm(kind, self.int8_activations) and native.gemm_blocks(x2, GGUF_TYPES[kind], data, y, off)
            if not done:
                dtype = chunk_dtype(kind)
                if dtype == torch.int8 and not self.int8_activations:
                    dtype = torch.float32
                if dtype not in low:
                    low[dtype] = (native.quantize_rows(x2) or quantize_rows_int8(x2)) if dtype == torch.int8 else \
                        x2.to(dtype)
                if dtype == torch.int8:
                    self._chunks_int8(low[dtype], kind, data, y, off)
                else:
                    self._chunks(low[dtype], kind, data, y, off)
            off += n
        return y.reshape(*shape[:-1], self.out_features)

    def _chunks_int8(self, xq: tuple[torch.Tensor, torch.Tensor], kind: str, data: torch.Tensor, y: torch.Tensor,
                     off: int) -> None:
        """`_chunks` on int8: each chunk of the weight dequantized exactly, requantized per row (the int8 tables'
        rounding, made for the chunk and gone after it), times the activations quantized per row (xq: int8 rows
        and their scales) on torch's int8 GEMM. The int8 tables' prefill, without holding the tables: for CPUs
        with AVX512-VNNI and no AMX, where an f32 chunk GEMM is much slower (a 0.8B Q4_K_M pp512 on the Xeon with
        oneDNN held to AVX512: f32 chunks 184-200 tok/s, bf16 139; the tables' int8 GEMM 527)."""
        n, k = data.shape[0], self.in_features
        step = max(1, min(n, CHUNK_ELEMENTS // k))
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
                w = low[:r1 - r]  # rounded to bf16 on the way out of blocks.c: no f32 chunk, no copy pass
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
        step = max(1, CHUNK_ELEMENTS // self.in_features)
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
    dequantization gives, bit for bit): blocks.c where it runs, formats.quant (torch) otherwise."""
    if not native.dequant(GGUF_TYPES[kind], data, cols, out):
        out.copy_(quant.dequantize(data.reshape(-1), kind, (data.shape[0], cols)))
    return out


def blocks_route() -> str:
    """What the CPU products of a model held as its file's blocks run on, said in the backend's description."""
    ok, why = native.portable()
    if not ok:
        return f"the file's own blocks, dequantized in chunks for torch's f32 GEMM (native kernel not used: {why})"
    auto = prefill_mode() == "auto"
    many = {torch.bfloat16: "bf16 chunks and torch's bf16 GEMM (AMX tiles)" if amx_bf16() else
            "bf16 chunks and torch's bf16 GEMM",
            torch.int8: "the blocks of every quantized type on the native kernel's GEMM (the file's values, "
                        "activations int8 per block as llama.cpp's: of 256 for the K-quants and the IQ and TQ types, of 32 "
                        "for the others; Q8_0's down projection on exact f32 chunks), 16-bit ones' "
                        "exact f32 chunks and torch's f32 GEMM"
                        if auto and block_gemm("Q8_0") else
                        "4- to 6-bit blocks' chunks requantized to int8 per row and torch's int8 GEMM (AVX512-VNNI, "
                        "no AMX), Q8_0 and 16-bit ones' exact f32 chunks and torch's f32 GEMM" if auto else
                        "chunks requantized to int8 per row and torch's int8 GEMM (DELTASERVE_PREFILL=int8)"}.get(
        chunk_dtype(), "exact f32 chunks and torch's f32 GEMM")
    if chunk_dtype() == torch.float32 and auto and block_gemm("Q4_K") and not block_gemm("Q8_0"):  # the AVX2 GEMM
        many = (f"the {', '.join(k for k in GEMM_KINDS if block_gemm(k))} blocks on the native kernel's GEMM (the "
                f"file's values, activations int8 per block as llama.cpp's), the other types' {many}")
    if settings.current().prefill == "int8" and prefill_mode() != "int8":
        many += f" (DELTASERVE_PREFILL=int8 not taken: {INT8_INEXACT})"
    return (f"products on the file's own blocks: up to {block_rows()} rows on the native kernel ({why}, "
            f"activations int8 per block as llama.cpp's), more rows on {many}")


def int8_route() -> str:
    """What a CPU decode product of an int8 table runs on, said in the backend's description."""
    if activations() != "int8":
        return f"int8 tables with bf16 activations (DELTASERVE_ACTIVATIONS={activations()})"
    ok, why = native.status()
    prefill = "" if int8_gemm_exact() else f"; prefills on bf16 tables, not int8 x int8: {INT8_INEXACT}"
    if ok:
        return f"int8 decode products on the native kernel ({why}){prefill}"
    return f"int8 decode products on torch's weight-only kernel (native kernel not used: {why}){prefill}"


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
