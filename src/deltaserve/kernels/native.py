"""The native CPU kernels (`native.c`, `blocks.c`, `native_avx2.c`, `attention.c`), built for this CPU, loaded
with ctypes.

They are compiled once per machine with the system C compiler (`cc`, or `$CC`; `-march=native`) into deltaserve's
cache directory (`$DELTASERVE_CACHE_DIR`, else `~/.cache/deltaserve`); torch stays the fallback for every product
they do not take. What is compiled depends on the CPU, and the library's symbols say what it holds (`has`):

- `native.c`: int8 tables and Q4_K blocks repacked at load times a few activation rows (weights="tables"), the
  prefill's delta rule and causal conv: AVX512F + AVX512BW + AVX512-VNNI only (`status()` says whether they run,
  and why not);
- `blocks.c`: the file's own blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, F16, BF16) dequantized exactly, and products
  on them: AVX2 + FMA + F16C, so on every x86-64 CPU these machines have; where the CPU has AVX512-VNNI, the
  products of up to 16 rows are its 512-bit ones (vpdpbusd, vpdpwssd; the same integer sums), and a GEMM on the
  blocks of every quantized type takes the prefill's products without AMX (`ds_gemm_blocks`,
  kernels/linear.py's block_gemm);
- `native_avx2.c`: the one-call token decode and the decode's DeltaNet step on every CPU (each product on
  blocks.c's or, for int8 tables, native.c's), and the prefill's delta rule and causal conv for CPUs without AVX512.
- `attention.c`: the vision tower's attention over an image's patches, one pass over the keys (an online softmax):
  bf16 q, k, v with f32 scores where the CPU has AVX512-BF16 (a Zen 4/5, a Sapphire Rapids), and f32 throughout on
  AVX2 + FMA (every CPU here).

`DELTASERVE_NATIVE=off` turns all of it off; a CPU without AVX2/FMA/F16C, no compiler or a failed build: torch's
kernels, with the reason.

Why kernels of our own: torch's weight-only int8 product (`_weight_int8pack_mm`) read the 254 MB head table at
24-34 GB/s on a Zen 4, where a plain read of the same bytes ran at 35-70 GB/s; on a CPU without AVX512-VNNI
(a Zen 3 EPYC) torch's int8 x int8 product runs at about 1 GMAC/s, twenty times slower than its own f32 GEMM, and
nothing in torch reads GGUF blocks.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

import torch

from deltaserve.cachedir import cache_root
from deltaserve.cbuild import build_library, compiler
from deltaserve import settings

HERE = Path(__file__).parent
SOURCES = [HERE / "native.c", HERE / "blocks.c", HERE / "native_avx2.c", HERE / "attention.c"]
HEADER = HERE / "native.h"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
# blocks.c dequantizes bit for bit as gguf does: no a * b + c contracted into one rounding there
SOURCE_FLAGS = {"blocks.c": ["-ffp-contract=off"]}
NEEDS = ("avx2", "fma", "f16c")            # to build the library at all
NEEDS_AVX512 = ("avx512f", "avx512bw", "avx512_vnni")  # for native.c's kernels


def _header() -> tuple[dict[str, int], dict[str, type]]:
    """native.h's DS_ constants and its structs as ctypes Structures (the one declaration of both)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    consts = {k: int(v) for k, v in re.findall(r"#define\s+(DS_\w+)\s+(\d+)", text)}
    structs: dict[str, type] = {}
    scalars = {"int": ctypes.c_int, "float": ctypes.c_float}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)(?:\[(\w+)\])?", decl)
            if m is None:
                raise RuntimeError(f"native.h: a member this reader does not know: {decl!r}")
            ctype, pointer, member, length = m.groups()
            if pointer:
                kind = ctypes.POINTER(structs[ctype]) if ctype in structs else ctypes.c_void_p
            else:
                kind = scalars.get(ctype) or structs[ctype]
            if length:
                kind = kind * (consts[length] if length in consts else int(length))
            fields.append((member, kind))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return consts, structs


CONSTANTS, STRUCTS = _header()
ABI = CONSTANTS["DS_ABI"]
MAX_ROWS = CONSTANTS["DS_MAX_ROWS"]  # activation rows per product, sequences per batched decode call

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags, less AVX512's and AMX's under DELTASERVE_ISA=avx2 (every decision taken on them then
    takes an AVX2 CPU's route: the build, AMX, the bench's llama.cpp)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    if settings.current().isa == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni"))}
    return flags


def build_flags() -> list[str]:
    """The compiler's flags: this CPU's instructions, or AVX2, FMA and F16C alone (Haswell's) under
    DELTASERVE_ISA=avx2."""
    if settings.current().isa == "avx2":
        return [f if f != "-march=native" else "-march=haswell" for f in FLAGS]
    return FLAGS


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo), read once."""
    if "flags" not in _state:
        _state["flags"] = _cpu_flags()
    return _state["flags"]


def _sources() -> list[Path]:
    return [s for s in SOURCES if s.exists()]


def _build(cc: str) -> Path:
    """The shared library for these sources, compiler and CPU, built if not cached. Raises RuntimeError."""
    return build_library("native", _sources(), build_flags(), cc=cc, headers=sorted(HERE.glob("*.h")),
                         source_flags=SOURCE_FLAGS, link=["-fopenmp", "-lm"], key_extra=" ".join(sorted(cpu_flags())),
                         what="the native kernel")


# every function the library may hold, with its ctypes signature; a CPU's build holds those its ISA compiles
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {
    "ds_linear_i8": [_P, _I, _I, _L, _P, _P, _I, _P, _L, _I],
    "ds_linear_kq": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_deltanet_step": [_P] * 11 + [_I] * 6 + [_F, _I],
    "ds_causal_conv": [_P, _P, _P, _P, _I, _I, _I, _I, _L],
    "ds_repack_q4k": [_P, _L, _P],
    "ds_quantize_rows": [_P, _I, _I, _L, _P, _P, _I],
    "ds_scale_product": [_P, _I, _I, _P, _P, _P, _I],
    "ds_decode_tokens": [_P, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P],
    "ds_delta_rule": [_P] * 7 + [_I] * 5,
    "ds_dequant": [_I, _P, _L, _I, _P, _L, _I],
    "ds_dequant_bf16": [_I, _P, _L, _I, _P, _L, _I],
    "ds_linear_blocks": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_gemm_blocks": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_gemm_type": [_I],
    "ds_set_decode_gemm": [_I],
    "ds_moe_experts": [_P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _I, _P, _P],
    "ds_set_tables": [_P] * 7,
    "ds_attention_bf16": [_P, _P, _P, _P, _I, _I, _I, _F, _I],
    "ds_attention_f32": [_P, _P, _P, _P, _I, _I, _I, _F, _I],
    "ds_rms_norm": [_P, _L, _P, _P, _I, _I, _F, _I],
    "ds_l2_norm_heads": [_P, _L, _P, _I, _I, _I, _F, _I],
    "ds_gated_rms_norm": [_P, _P, _L, _P, _P, _I, _I, _I, _F, _I],
    "ds_swiglu": [_P, _L, _P, _L, _P, _I, _I, _I],
}


def _load() -> tuple[ctypes.CDLL | None, str]:
    if not settings.current().native:
        return None, "turned off by DELTASERVE_NATIVE"
    missing = [f for f in NEEDS if f not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    cc = compiler()
    if cc is None:
        return None, f"no C compiler ({settings.current().compiler}) on PATH"
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first: the library binds to the same one
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (RuntimeError, OSError) as e:
        return None, str(e)
    if lib.ds_abi_version() != ABI:
        return None, f"the cached native library is of another version ({lib.ds_abi_version()}, wanted {ABI})"
    for name, args in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    lib.ds_set_tables(*(t.ctypes.data for t in _iq_tables()))
    if hasattr(lib, "ds_set_decode_gemm"):
        lib.ds_set_decode_gemm(decode_gemm_rows(lib))
    return lib, "built"


# Rows from which a decode call's products run on blocks.c's GEMM (each tensor's panels packed once for all the rows)
# rather than on the decode tiles (which decode a tile's weights once per pair of rows and convert every pair of
# blocks' sums per row): where the GEMM overtakes the tiles. A sequence's logits then depend on whether it decoded
# among fewer or more rows than this, in their last bits (the integer sums are the same; the scales are applied in
# another order); DELTASERVE_BATCH_INVARIANT=on keeps every row count on the tiles.
DECODE_GEMM_ROWS_VNNI = 3   # the 512-bit VNNI build (a Zen 4/5, a Xeon)
DECODE_GEMM_ROWS_AVX2 = 6   # the AVX2 build's vpmaddubsw GEMM overtakes its row products at 5-6 rows


def apply_decode_gemm() -> int:
    """Set the loaded library's decode GEMM threshold from the settings as they are now (DELTASERVE_BATCH_INVARIANT);
    the threshold."""
    lib = library()
    rows = decode_gemm_rows(lib)
    if lib is not None and hasattr(lib, "ds_set_decode_gemm"):
        lib.ds_set_decode_gemm(rows)
    return rows


def decode_gemm_rows(lib=None) -> int:
    """The row count from which a decode call's products take the GEMM in this build (0: never)."""
    if settings.current().batch_invariant:
        return 0
    lib = lib or library()
    if lib is None or not hasattr(lib, "ds_set_decode_gemm"):
        return 0
    return DECODE_GEMM_ROWS_VNNI if hasattr(lib, "ds_blocks_vnni") else DECODE_GEMM_ROWS_AVX2


_TABLES: list = []


def _iq_tables() -> list:
    """The IQ types' grids (gguf's: float32, rows of 8 or 4 values) and the sign bytes, for blocks.c's dequantization
    (ds_set_tables); kept alive here for the library's lifetime."""
    if not _TABLES:
        import numpy as np
        from gguf import quants as gq

        for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"):
            cls = getattr(gq, name)
            cls.init_grid()
            _TABLES.append(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32))
        _TABLES.append(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy())
    return _TABLES


def has(name: str) -> bool:
    """Whether this machine's library holds the kernel `name` (it is compiled where the CPU runs it)."""
    lib = library()
    return lib is not None and hasattr(lib, name)


def status() -> tuple[bool, str]:
    """(available, what or why not) for native.c's AVX512 kernels (int8 tables and repacked Q4_K blocks times a few
    rows, the prefill's delta rule): built and loaded on first call, then remembered."""
    lib = library()
    if lib is None:
        return False, _state["why"]
    if not hasattr(lib, "ds_linear_i8"):
        missing = [f for f in NEEDS_AVX512 if f not in cpu_flags()]
        return False, f"this CPU lacks {', '.join(missing or NEEDS_AVX512)}"
    return True, "AVX512-VNNI, int8 activations per block of 32"


def portable() -> tuple[bool, str]:
    """(available, what or why not) for blocks.c's kernels on the file's own blocks (any CPU with AVX2, FMA and
    F16C; their 512-bit VNNI products where the CPU has AVX512-VNNI)."""
    lib = library()
    if lib is None:
        return False, _state["why"]
    if not hasattr(lib, "ds_linear_blocks"):
        return False, "not in this build"
    return True, "AVX512-VNNI" if hasattr(lib, "ds_blocks_vnni") else "AVX2"


def reset() -> None:
    """Forget the loaded state so the next `status()` decides again (tests change the environment)."""
    with _lock:
        _state.clear()


def library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load()
        return _state["lib"]


BLOCK_TYPES = {"Q4_K": (12, 144), "Q6_K": (CONSTANTS["DS_Q6K"], 210),  # GGUF type id, bytes per block of 256
               "Q4_K/r": (CONSTANTS["DS_Q4KR"], 152)}  # Q4_K repacked at load (its scale bits unpacked; native.c)


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
    library). Q4_K runs on native.c's repacked blocks, Q6_K on blocks.c's product."""
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
    """blocks.c's exact dequantization of rows of blocks (uint8 [rows, row bytes], rows contiguous) into out (f32
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
    blocks.c's products; False, with nothing written, where they do not take it."""
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
    nothing written, where blocks.c does not take them.
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
    """Whether blocks.c's GEMM (gemm_blocks) takes blocks of this type in this build (every quantized type it knows)."""
    return has("ds_gemm_type") and library().ds_gemm_type(gguf_type) > 0


def gemm_beats_f32(gguf_type: int) -> bool:
    """Whether blocks.c's GEMM on this type beats torch's f32 GEMM on exact chunks for a prefill's many rows: every
    type on AVX512-VNNI; on AVX2 the ones whose packed values stay below 64 (Q4_K, Q5_K, Q6_K, Q4_1, Q5_1, Q2_K):
    the others' vpmaddubsw pair sums would saturate, so their tiles multiply each value's two nibbles apart, at
    about the f32 GEMM's speed (ds_gemm_type 2; the MoE experts' few rows still take them there)."""
    return has("ds_gemm_type") and library().ds_gemm_type(gguf_type) == 1


def gemm_blocks(x: torch.Tensor, gguf_type: int, data: torch.Tensor, y: torch.Tensor, off: int) -> bool:
    """y[:, off:off + rows] = x [M, K] (f32, rows contiguous) times blocks of a quantized type gemm_takes (uint8
    [rows, row bytes]) on blocks.c's GEMM for many rows (the file's values, the activations int8 per block of 32 or
    256 as llama.cpp rounds them); False, with nothing written, where it does not take it."""
    if not has("ds_gemm_blocks") or data.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) != data.shape[1]):
        return False
    m, k = x.shape
    return library().ds_gemm_blocks(gguf_type, x.data_ptr(), m, k, x.stride(0), data.data_ptr(), data.shape[0],
                                    y.data_ptr() + off * y.element_size(), y.stride(0), torch.get_num_threads()) == 0


def takes(in_features: int) -> bool:
    """Whether the native int8-table kernel takes products with this inner size (and runs on this CPU)."""
    return in_features % 32 == 0 and has("ds_linear_i8")


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
    """One token of a DeltaNet mixer between its projections (see native.c), updating conv_state [Kc-1, C]
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
    """The gated delta rule over a span, token by token (see native.c): what layers.delta_rule_chunked
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
    f32 [n, heads, dim]. bf16 inputs on attention.c's AVX512-BF16 kernel (f32 scores and softmax, the probabilities
    times v in bf16), f32 ones on its AVX2 kernel (f32 throughout). None where this build lacks the kernel for the
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
