"""The route table: which kernel takes a product, and in what data type, decided in one place.

A route is a function of the weights' form and block type, the activation rows, the CPU's capabilities (the native
library's build and what torch's own kernels do here) and the settings:

  blocks(kind, rows)      a tensor held as the file's own blocks (BlockLinear): the decode products (products.c with
                          rows_avx2.c or tiles_avx512.c), the blocks' GEMM (gemm_avx512.c, gemm_avx2.c) or exact
                          chunks on torch's GEMM in f32, bf16 (AMX) or int8;
  table(rows, K)          an int8 table (Int8Linear, weights="tables"): tables_avx512.c, or torch's weight-only int8,
                          int8 x int8 or bf16 GEMM;
  decode_gemm_rows()      the rows from which the one-call decode's products take the GEMM (decode.c);
  MOE_GEMM_ROWS           the pairs from which an MoE expert's prefill product does (moe.c);
  attention_dtype()       the prefill attention's matmuls; vision_products(), vision_attention(): the tower's.

Every consumer reads it here: kernels/linear.py (each product of a forward), engine/native_token.py (the one-call
decode), engine/forward.py, vision/encoder.py, the backend's route line (describe_blocks, describe_tables), and
`deltaserve inspect` prints it for the loaded model (table). Tests choose a route through `override` (the one
door), never by patching a module's private state. The measurements behind each threshold: docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from deltaserve import settings
from deltaserve.formats import quant
from deltaserve.kernels import library

# every block type a file of these models may hold (formats/quant.py dequantizes each exactly), by GGUF id
GGUF_TYPES = {t.name: int(t) for t in sorted(quant.SUPPORTED_TYPES, key=int)}
# the types the decode products multiply as they are: every quantized type and F16/BF16 (F32 is a dense weight)
PRODUCT_TYPES = frozenset(k for k in GGUF_TYPES if k != "F32")
# int8 per block of 256 with an f32 scale (llama.cpp's Q8_K) for these types' products; per block of 32 (its Q8_0)
# for the other quantized ones; F16/BF16 multiply the f32 activations as they are
A256 = frozenset(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                  "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"))
# the decode products' activations per 256 (the K-quants; products.c's blk_kind 2): the GEMM's list is A256
DECODE_A256 = frozenset(("Q4_K", "Q5_K", "Q6_K"))
# the types the 512-bit tiles multiply from their blocks; the other quantized types' rows are expanded first
TILED_512 = frozenset(("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4",
                       "Q2_K", "Q3_K", "TQ2_0", "TQ1_0"))
TILED_AVX2 = frozenset(("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"))
# the types whose decode products of 3 rows or more take the 512-bit many-row tiles (tiles_avx512.c's multi_tile: a
# weight row unpacked once for up to 4 activation rows a pass, each row summed as one row alone is summed); the
# others' stay on the pair tiles, which were as fast or faster (docs/kernels.md)
MULTI_512 = frozenset(("Q6_K",))
# the block kinds the GEMM takes (gemm.c's gemm_mode)
GEMM_KINDS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4",
              "Q3_K", "TQ1_0", "TQ2_0", "NVFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "Q2_K")
# the kinds whose many-row products take int8 chunks where the CPU has AVX512-VNNI and no AMX and the GEMM does not
# take them: at most 64 levels a block, so requantizing per row adds little; Q8_0 and 16-bit weights would lose their
# own precision there and stay exact f32 chunks (docs/accuracy.md)
INT8_CHUNK_KINDS = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_S",
                    "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")

GEMV_ROWS = 16        # the most rows the decode products take on the file's blocks; more: the GEMM or chunks
GEMV_ROWS_AMX = 32    # ... where the chunks are bf16 on AMX tiles (a fixed reorder per chunk) and the tiles 512-bit
TABLE_ROWS = library.CONSTANTS["DS_MAX_ROWS"]  # the most rows tables_avx512.c takes (beyond, int8 x int8 wins)
WEIGHT_ONLY_ROWS = 4  # int8 tables without it: torch's weight-only kernel up to here, then int8 x int8
BF16_GEMM_ROWS = 64   # ... or, where int8 x int8 is not exact, the weight-only kernel up to here, then a bf16 GEMM
DEVICE_WEIGHT_ONLY_ROWS = 16  # on an accelerator: weight-only up to here (torch._int_mm refuses fewer), then bf16
DECODE_GEMM_ROWS_VNNI = 3  # the one-call decode's products on the GEMM from here (512-bit VNNI build)
DECODE_GEMM_ROWS_AVX2 = 6  # ... (AVX2 build: its vpmaddubsw GEMM overtakes its row products at 5-6 rows)
MOE_GEMM_ROWS_VNNI = 8     # an MoE expert's prefill product on the GEMM from this many pairs (512-bit VNNI build)
MOE_GEMM_ROWS_AVX2 = 6
CHUNK_ELEMENTS = 1 << 20   # an f32 chunk of 4 MiB: cache-sized, and each product's only transient of weights
BF16_CHUNK_FACTOR = 4      # bf16 chunks (the AMX route) hold 4x the elements: oneDNN's bf16 GEMM wants wide chunks


@dataclass(frozen=True)
class Capabilities:
    """The CPU and its kernels as the routes see them (`capabilities()`; `override` replaces fields)."""
    build: str               # the native library's level ("avx512-bf16", ...), "" without a library
    why_not: str             # why there is no library ("" with one)
    flags: frozenset         # the CPU's flags (DELTASERVE_ISA hides what its level lacks)
    blocks: bool             # the decode products on the file's blocks (products.c)
    vnni512: bool            # ... on the 512-bit tiles (tiles_avx512.c) rather than the AVX2 rows
    tables: bool             # the int8 tables' products (tables_avx512.c)
    one_call: bool           # the one-call decode (decode.c)
    multi: bool              # the 512-bit many-row tiles of MULTI_512 (tiles_avx512.c's multi_tile)
    gemm_fast: frozenset     # the block types the GEMM takes faster than torch's f32 GEMM takes exact chunks
    gemm_any: frozenset      # the block types the GEMM takes at all (an MoE expert's few rows, a decode call's)
    attention_bf16: bool     # the vision tower's bf16 attention (attention_vision_avx512.c)
    attention_f32: bool      # ... and its f32 one (attention_vision_avx2.c)
    amx: bool                # torch's bf16 GEMM on AMX tiles (AMX-BF16, granted, DELTASERVE_AMX not off)
    int8_exact: bool         # torch's int8 GEMM sums exactly (without VNNI or AMX its int16 pairs saturate)
    activations: str         # DELTASERVE_ACTIVATIONS: "int8" or another (then no int8-activation kernel)
    prefill: str             # DELTASERVE_PREFILL as set: "auto", "f32", "bf16", "int8"
    batch_invariant: bool    # DELTASERVE_BATCH_INVARIANT: every decode row count on the same kernels
    vision: str              # DELTASERVE_VISION
    chunk_elements: int      # an f32 chunk's elements (x BF16_CHUNK_FACTOR in bf16)


@dataclass(frozen=True)
class Route:
    """How a product runs: `family` is what linear.py dispatches on ("blocks", "gemm", "chunks", "tables",
    "weight-only", "int8", "bf16", "dense"), `kernel` what computes it (a C file's kernel, or torch's), `dtype` what
    the activations are multiplied as ("int8/32", "int8/256": per block of 32 or 256 as llama.cpp's; "int8/row";
    "bf16"; "f32")."""
    family: str
    kernel: str
    dtype: str


_probed: dict = {}       # facts of the process, probed once: AMX granted, torch's int8 GEMM exact
_overrides: list[dict] = []
_cache: list = [None, None, -1, None]  # (settings, library generation, overrides' count, capabilities)


def _amx_granted() -> bool:
    """The CPU has AMX-BF16 and the kernel lets this process use its tiles (torch asks for them)."""
    if "amx" not in _probed:
        _probed["amx"] = "amx_bf16" in library._read_flags() and \
            bool(getattr(torch._C._cpu, "_init_amx", lambda: False)())
    return _probed["amx"]


def _int8_exact() -> bool:
    """Whether torch's int8 GEMM (torch._int_mm) sums exactly on this CPU, probed once on a product whose answer is
    known. Where oneDNN has neither AVX512-VNNI nor AMX (an AVX2 CPU; or oneDNN held to AVX2) it multiplies u8 x s8
    pairs into int16 with saturation (vpmaddubsw), and its sums come out wrong."""
    if "int8" not in _probed:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
        try:
            _probed["int8"] = bool(torch.equal(torch._int_mm(a, b), a.int() @ b.int()))
        except RuntimeError:
            _probed["int8"] = False
    return _probed["int8"]


def _measure() -> Capabilities:
    s = settings.current()
    lib = library.library()
    flags = frozenset(library.cpu_flags())
    has = (lambda name: lib is not None and hasattr(lib, name))
    gemm_fast, gemm_any = set(), set()
    if has("ds_gemm_type"):
        for kind in GEMM_KINDS:
            t = lib.ds_gemm_type(GGUF_TYPES[kind])
            if t > 0:
                gemm_any.add(kind)
            if t == 1:
                gemm_fast.add(kind)
    variant, _ = library.loaded()
    return Capabilities(
        build=variant.name if variant is not None and lib is not None else "", why_not=library.why_not(),
        flags=flags, blocks=has("ds_linear_blocks"), vnni512=has("ds_blocks_vnni"), tables=has("ds_linear_i8"),
        one_call=has("ds_decode_tokens"), multi=has("ds_blocks_multi"), gemm_fast=frozenset(gemm_fast),
        gemm_any=frozenset(gemm_any),
        attention_bf16=has("ds_attention_bf16"), attention_f32=has("ds_attention_f32"),
        amx=s.amx and "amx_bf16" in flags and _amx_granted(), int8_exact=_int8_exact(), activations=s.activations,
        prefill=s.prefill, batch_invariant=s.batch_invariant, vision=s.vision, chunk_elements=CHUNK_ELEMENTS)


def capabilities() -> Capabilities:
    """The capabilities every route is decided on: measured once for the settings and the library as they are (the
    process's probes once for its life), with `override`'s fields in place."""
    s = settings.current()
    c = _cache
    if c[0] is not s or c[1] != library.generation() or c[2] != len(_overrides):
        caps = _measure()
        for fields in _overrides:
            caps = dataclasses.replace(caps, **fields)
        c[:] = [s, library.generation(), len(_overrides), caps]
    return c[3]


@contextlib.contextmanager
def override(**fields):
    """The routes as on a CPU whose capabilities differ in `fields` (Capabilities' names) for the block: the one way
    a test chooses a route. The library's thresholds follow (apply)."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(Capabilities)}
    if unknown:
        raise TypeError(f"no capabilities called {sorted(unknown)}")
    _overrides.append(fields)
    apply()
    try:
        yield capabilities()
    finally:
        _overrides.remove(fields)
        apply()


# ---- the decisions ---------------------------------------------------------------------------------------------

def prefill_mode(c: Capabilities | None = None) -> str:
    """DELTASERVE_PREFILL: "f32", "bf16" or "int8" (every chunk in that dtype), else "auto"; "int8" is not taken
    where torch's int8 GEMM is not exact (f32 then: describe_blocks says why)."""
    c = c or capabilities()
    if c.prefill == "int8" and not c.int8_exact:
        return "f32"
    return c.prefill if c.prefill in ("f32", "bf16", "int8") else "auto"


def int8_chunks_fast(c: Capabilities | None = None) -> bool:
    """torch's int8 GEMM is the fast many-row product and AMX is not there: an AVX512-VNNI CPU without AMX tiles."""
    c = c or capabilities()
    return not c.amx and c.tables


def chunk_dtype(kind: str | None = None, c: Capabilities | None = None) -> torch.dtype:
    """The dtype of a many-row product's exact chunks of blocks of `kind`: DELTASERVE_PREFILL's, or (auto) bf16
    where AMX is there; int8 for the 4- to 6-bit kinds where int8_chunks_fast(); else f32. Without a kind: the dtype
    of most chunks (what the route line leads with)."""
    c = c or capabilities()
    mode = prefill_mode(c)
    if mode != "auto":
        return {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[mode]
    if c.amx:
        return torch.bfloat16
    if int8_chunks_fast(c) and (kind is None or kind in INT8_CHUNK_KINDS):
        return torch.int8
    return torch.float32


def block_gemm(kind: str, int8_activations: bool = True, c: Capabilities | None = None) -> bool:
    """Whether many rows on blocks of `kind` run on the blocks' GEMM (the file's values, the activations int8 per
    block as llama.cpp multiplies the type) rather than on chunks: under DELTASERVE_PREFILL=auto, without AMX (bf16
    chunks on its tiles are faster), for the kinds the GEMM takes faster than torch's f32 GEMM takes exact chunks
    (every kind with AVX512-VNNI; on AVX2 those whose packed values stay below 64). `int8_activations` False (the
    MLP's down projection, whose inputs have outliers) keeps a Q8_0 weight on exact f32 chunks."""
    c = c or capabilities()
    return kind in c.gemm_fast and (int8_activations or kind != "Q8_0") and prefill_mode(c) == "auto" and not c.amx


def block_rows(c: Capabilities | None = None) -> int:
    """The most rows a product takes on the decode products (more go to the GEMM or chunks): GEMV_ROWS, or
    GEMV_ROWS_AMX where the chunks are bf16 on AMX tiles (oneDNN reorders every chunk for them, a fixed cost whatever
    the rows) and the tiles are the 512-bit ones."""
    c = c or capabilities()
    return GEMV_ROWS_AMX if chunk_dtype(None, c) == torch.bfloat16 and c.amx and c.vnni512 else GEMV_ROWS


def _decode_kernel(kind: str, c: Capabilities, rows: int = 1) -> Route:
    """The decode products' kernel for `rows` rows on blocks of `kind` (products.c's dispatch)."""
    if kind in ("F16", "BF16"):
        return Route("blocks", "rows_f32 (products.c)", "f32")
    dtype = "int8/256" if kind in DECODE_A256 else "int8/32"
    if rows > 2 and c.multi and c.vnni512 and kind in MULTI_512:
        return Route("blocks", "multi_tile (tiles_avx512.c)", dtype)
    if kind in (TILED_512 if c.vnni512 else TILED_AVX2):
        return Route("blocks", "tiles_avx512" if c.vnni512 else "rows_avx2", dtype)
    return Route("blocks", "rows_expanded (products.c)", dtype)


def many_rows(kind: str, int8_activations: bool = True, c: Capabilities | None = None) -> Route:
    """A many-row product on blocks of `kind`: the blocks' GEMM, or exact chunks on torch's GEMM."""
    c = c or capabilities()
    if block_gemm(kind, int8_activations, c):
        return Route("gemm", "gemm_avx512" if c.vnni512 else "gemm_avx2", "int8/256" if kind in A256 else "int8/32")
    dtype = chunk_dtype(kind, c)
    return chunks(torch.float32 if dtype == torch.int8 and not int8_activations else dtype, c)


def chunks(dtype: torch.dtype, c: Capabilities | None = None) -> Route:
    """Exact chunks of the weight in `dtype` on torch's GEMM (int8: each chunk requantized per row)."""
    name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "int8"}[dtype]
    amx = name == "bf16" and (c or capabilities()).amx
    return Route("chunks", f"chunks_{name} (torch's {name} GEMM{' on AMX' if amx else ''})",
                 "int8/row" if name == "int8" else name)


def blocks(kind: str, rows: int, int8_activations: bool = True, c: Capabilities | None = None) -> Route:
    """A product of `rows` rows on a tensor held as the file's blocks of `kind`."""
    c = c or capabilities()
    if rows <= block_rows(c) and kind in PRODUCT_TYPES and c.blocks:
        return _decode_kernel(kind, c, rows)
    return many_rows(kind, int8_activations, c)


def table(rows: int, in_features: int, int8_activations: bool = True, device: str = "cpu",
          c: Capabilities | None = None) -> Route:
    """A product of `rows` rows on an int8 table of inner size `in_features`: tables_avx512.c (activations int8 per
    block of 32), torch's weight-only kernel (bf16 activations), int8 x int8 (activations int8 per row) or the table
    dequantized for a bf16 GEMM."""
    if device != "cpu":  # an accelerator: its bf16 GEMM is fast, and torch._int_mm on CUDA refuses 16 rows or fewer
        return Route("weight-only", "torch weight-only int8", "bf16") if rows <= DEVICE_WEIGHT_ONLY_ROWS else \
            Route("bf16", "torch bf16 GEMM", "bf16")
    c = c or capabilities()
    int8 = c.activations == "int8"
    if rows <= TABLE_ROWS and int8 and c.tables and in_features % 32 == 0:
        return Route("tables", "tables_avx512", "int8/32")
    int8 = int8_activations and int8 and c.int8_exact
    if rows <= WEIGHT_ONLY_ROWS or (rows <= BF16_GEMM_ROWS and not int8):
        return Route("weight-only", "torch weight-only int8", "bf16")
    return Route("int8", "torch int8 GEMM", "int8/row") if int8 else Route("bf16", "torch bf16 GEMM", "bf16")


def decode_gemm_rows(c: Capabilities | None = None) -> int:
    """The rows from which a one-call decode's products take the GEMM rather than the decode tiles (0: never). The
    integer sums are the same, the scales applied in another order: a sequence's logits differ in their last bits
    between a call below and one above it; DELTASERVE_BATCH_INVARIANT=on keeps every row count on the tiles."""
    c = c or capabilities()
    if c.batch_invariant or not c.one_call or not c.gemm_any:
        return 0
    return DECODE_GEMM_ROWS_VNNI if c.vnni512 else DECODE_GEMM_ROWS_AVX2


def moe_gemm_rows(c: Capabilities | None = None) -> int:
    """The (row, expert) pairs from which a prefill's expert product takes the GEMM (0: never)."""
    c = c or capabilities()
    return 0 if not c.gemm_any else MOE_GEMM_ROWS_VNNI if c.vnni512 else MOE_GEMM_ROWS_AVX2


def decode_step(kind: str, rows: int, c: Capabilities | None = None) -> Route:
    """A one-call decode's product of `rows` rows on a segment of `kind` (a block type, "int8" for a table, "F32")."""
    c = c or capabilities()
    if kind == "int8":
        return Route("tables", "tables_avx512", "int8/32")
    if kind == "F32":
        return Route("blocks", "f32_tiles (decode.c)", "f32")
    gemm = decode_gemm_rows(c)
    if gemm and rows >= gemm and kind in c.gemm_any:
        return Route("gemm", "gemm_avx512" if c.vnni512 else "gemm_avx2", "int8/256" if kind in A256 else "int8/32")
    return _decode_kernel(kind, c, rows)


def attention_dtype(device: str, f32_weights: bool, c: Capabilities | None = None) -> torch.dtype:
    """The prefill attention's matmuls: f32 where any weight is f32 (the exact path) or on a CPU without AMX tiles
    (there torch's bf16 matmuls lose to its f32 ones); else bf16."""
    bf16 = device != "cpu" or (c or capabilities()).amx
    return torch.float32 if f32_weights or not bf16 else torch.bfloat16


def vision_products(c: Capabilities | None = None) -> str:
    """The vision tower's products by default: DELTASERVE_VISION "f32" or "bf16" as set, else "bf16" where torch's
    bf16 GEMM runs natively (AVX512-BF16, or AMX tiles) and "f32" elsewhere (where a bf16 GEMM is emulated)."""
    c = c or capabilities()
    if c.vision in ("f32", "bf16"):
        return c.vision
    return "bf16" if "avx512_bf16" in c.flags or "amx_bf16" in c.flags else "f32"


def vision_attention(products: str, head_dim: int, device: str = "cpu", c: Capabilities | None = None) -> str | None:
    """The C kernel of the tower's attention for its products ("attention_vision_avx512": bf16, an even head width;
    "attention_vision_avx2": f32), or None (torch's SDPA)."""
    c = c or capabilities()
    if device != "cpu":
        return None
    if products == "bf16":
        return "attention_vision_avx512" if c.attention_bf16 and head_dim % 2 == 0 else None
    return "attention_vision_avx2" if c.attention_f32 else None


_recorders: list[list] = []


@contextlib.contextmanager
def recording():
    """The routes linear.py's products take while the block runs, in order (what ran, for a test to compare with
    the table)."""
    ran: list[Route] = []
    _recorders.append(ran)
    try:
        yield ran
    finally:
        _recorders.remove(ran)


def taken(route: Route) -> None:
    """A product ran on `route` (linear.py says so; kept only while something records)."""
    for r in _recorders:
        r.append(route)


def apply(lib=None) -> None:
    """Set the library's thresholds from the table (decode.c's decode GEMM rows, moe.c's expert GEMM pairs): at
    load, and again when the settings or an override change them."""
    lib = lib if lib is not None else library.library()
    if lib is None:
        return
    c = capabilities()
    if hasattr(lib, "ds_set_decode_gemm"):
        lib.ds_set_decode_gemm(decode_gemm_rows(c))
    if hasattr(lib, "ds_set_moe_gemm"):
        lib.ds_set_moe_gemm(moe_gemm_rows(c))


library.on_load(apply)


# ---- the route in words: the backend's line, and `deltaserve inspect`'s table --------------------------------------

INT8_INEXACT = "torch's int8 GEMM does not sum exactly on this CPU (no AVX512-VNNI or AMX: its int16 pair sums saturate)"


def describe_blocks(c: Capabilities | None = None) -> str:
    """What the CPU products of a model held as its file's blocks run on, said in the backend's description."""
    c = c or capabilities()
    ok, why = library.portable()
    if not ok or not c.blocks:
        return f"the file's own blocks, dequantized in chunks for torch's f32 GEMM (native kernel not used: {why})"
    auto = prefill_mode(c) == "auto"
    many = {torch.bfloat16: "bf16 chunks and torch's bf16 GEMM (AMX tiles)" if c.amx else
            "bf16 chunks and torch's bf16 GEMM",
            torch.int8: "the blocks of every quantized type on the native kernel's GEMM (the file's values, "
                        "activations int8 per block as llama.cpp's: of 256 for the K-quants and the IQ and TQ types, of 32 "
                        "for the others; Q8_0's down projection on exact f32 chunks), 16-bit ones' "
                        "exact f32 chunks and torch's f32 GEMM"
                        if auto and block_gemm("Q8_0", c=c) else
                        "4- to 6-bit blocks' chunks requantized to int8 per row and torch's int8 GEMM (AVX512-VNNI, "
                        "no AMX), Q8_0 and 16-bit ones' exact f32 chunks and torch's f32 GEMM" if auto else
                        "chunks requantized to int8 per row and torch's int8 GEMM (DELTASERVE_PREFILL=int8)"}.get(
        chunk_dtype(None, c), "exact f32 chunks and torch's f32 GEMM")
    if chunk_dtype(None, c) == torch.float32 and auto and block_gemm("Q4_K", c=c) and not block_gemm("Q8_0", c=c):
        many = (f"the {', '.join(k for k in GEMM_KINDS if block_gemm(k, c=c))} blocks on the native kernel's GEMM (the "
                f"file's values, activations int8 per block as llama.cpp's), the other types' {many}")
    if c.prefill == "int8" and prefill_mode(c) != "int8":
        many += f" (DELTASERVE_PREFILL=int8 not taken: {INT8_INEXACT})"
    return (f"products on the file's own blocks: up to {block_rows(c)} rows on the native kernel ({why}, "
            f"activations int8 per block as llama.cpp's), more rows on {many}")


def describe_tables(c: Capabilities | None = None) -> str:
    """What a CPU decode product of an int8 table runs on, said in the backend's description."""
    c = c or capabilities()
    if c.activations != "int8":
        return f"int8 tables with bf16 activations (DELTASERVE_ACTIVATIONS={c.activations})"
    ok, why = library.status()
    ok = ok and c.tables
    prefill = "" if c.int8_exact else f"; prefills on bf16 tables, not int8 x int8: {INT8_INEXACT}"
    if ok:
        return f"int8 decode products on the native kernel ({why}){prefill}"
    return f"int8 decode products on torch's weight-only kernel (native kernel not used: {why}){prefill}"


@dataclass(frozen=True)
class Row:
    """A line of the table: products on `kind` held as `weights` ("blocks", "tables", "dense"; "one call": the
    one-call decode's), rows `first` .. `last` (None: and more), and their route."""
    weights: str
    kind: str
    first: int
    last: int | None
    route: Route


def _ranges(weights: str, kind: str, decide, most: int) -> list[Row]:
    rows: list[Row] = []
    for n in range(1, most + 2):
        r = decide(n)
        if rows and rows[-1].route == r:
            rows[-1] = dataclasses.replace(rows[-1], last=n)
        else:
            rows.append(Row(weights, kind, n, n, r))
    if rows[-1].last == most + 1:
        rows[-1] = dataclasses.replace(rows[-1], last=None)
    return rows


def table_rows(forms: list[tuple[str, str, int]], c: Capabilities | None = None) -> list[Row]:
    """The route table for products on each (weights, kind, inner size) of `forms`: weights "blocks" (the file's
    blocks of GGUF type `kind`), "tables" (an int8 table), "dense" (kind "f32" or "bf16"); every row count, as ranges.
    The one-call decode's products follow for the blocks and tables (up to TABLE_ROWS rows a call)."""
    c = c or capabilities()
    out: list[Row] = []
    most = max(BF16_GEMM_ROWS, GEMV_ROWS_AMX) + 1
    # one line per form whose route can differ: the inner size matters to the int8 tables alone (a multiple of 32)
    forms = list(dict.fromkeys((w, kind, (k if k % 32 else 32) if w == "tables" else 0) for w, kind, k in forms))
    for weights, kind, k in forms:
        if weights == "blocks":
            out += _ranges(weights, kind, lambda n: blocks(kind, n, True, c), most)
        elif weights == "tables":
            out += _ranges(weights, kind, lambda n: table(n, k, True, "cpu", c), most)
        else:
            out.append(Row(weights, kind, 1, None, Route("dense", f"torch {kind} GEMM", kind)))
    if c.one_call:
        for weights, kind, _ in forms:
            if weights in ("blocks", "tables") or kind == "f32":
                seg = "int8" if weights == "tables" else "F32" if weights == "dense" else kind
                out += _ranges("one call", kind, lambda n: decode_step(seg, n, c), TABLE_ROWS - 1)
    return out


def table_lines(forms: list[tuple[str, str, int]], device: str = "cpu", f32_weights: bool = False,
                c: Capabilities | None = None) -> list[str]:
    """`table_rows` as `deltaserve inspect` prints it, with the capabilities it was decided on."""
    c = c or capabilities()
    head = (f"routes (native kernels: {c.build + ' build' if c.build else 'none: ' + c.why_not}; AMX tiles: "
            f"{'yes' if c.amx else 'no'}; torch's int8 GEMM exact: {'yes' if c.int8_exact else 'no'}; one-call "
            f"decode on the GEMM from {decode_gemm_rows(c) or 'never'} rows):")
    lines = [head]
    for r in table_rows(forms, c):
        span = f"{r.first}+" if r.last is None else f"{r.first}" if r.first == r.last else f"{r.first}-{r.last}"
        lines.append(f"  {r.weights:<9} {r.kind:<8} rows {span:<7} {r.route.kernel}, activations {r.route.dtype}")
    lines.append(f"  prefill attention in {str(attention_dtype(device, f32_weights, c)).replace('torch.', '')}; "
                 f"vision products {vision_products(c)}")
    return lines
