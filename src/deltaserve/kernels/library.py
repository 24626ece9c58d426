"""The native library: which build of the C sources (kernels/c/) this process loads, from where, and what it holds.

The sources are compiled once per instruction-set level, every file in every build (each file compiles to nothing
where its level is missing: kernels/c/ds.h), into one shared library per level:

  avx512-bf16  AVX512 + VNNI + BF16 + GFNI   AMD Zen 4/5, Intel Sapphire Rapids and later (the AMX machines)
  avx512-vnni  AVX512 + VNNI                 Intel Cascade Lake, Ice Lake
  x86-64-v3    AVX2 + FMA + F16C + BMI       AMD Zen 1-3, Intel Haswell and later
  native       -march=native                 this CPU as it is, where none of the levels above fits it

At load the best level this CPU runs is chosen from its flags (/proc/cpuinfo); DELTASERVE_ISA names one instead
(`avx2` is x86-64-v3) and hides from every route decision what that level lacks, so an AVX512 machine runs the
route of an AVX2 CPU. A level's library is looked for by the hash of its sources and flags, without a compiler: in
the package's prebuilt directory (kernels/lib/, what a wheel would ship) and in the cache
(`$DELTASERVE_CACHE_DIR/native`, which a fleet may share); where it is not there it is compiled for that one level,
once, with the system C compiler (`cc`, or `$CC`), in parallel over the sources. `deltaserve kernels --all` builds
every level at once. Without a compiler the best prebuilt level this CPU runs is used; without any, torch's kernels
run (said, with the reason).

The files on the file's blocks give the same bits on every level (their arithmetic is explicit: intrinsics, no
contraction); the others' scalar a * b + c may become one FMA or two roundings as the compiler tunes for the level
(-march=native tunes for this CPU, a level for any), so the one-token DeltaNet step's last bits, say, can differ
between the native build and a level's, as they did between two machines' native builds.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve import settings
from deltaserve.cachedir import cache_root
from deltaserve.cbuild import build_library, compiler, source_key

HERE = Path(__file__).parent
CDIR = HERE / "c"
PREBUILT = HERE / "lib"  # libraries built before packaging (`deltaserve kernels --all --out .../kernels/lib`)
HEADER = CDIR / "native.h"
FLAGS = ["-O3", "-fopenmp", "-fPIC"]
# the files on the file's blocks, compiled without contraction (a * b + c stays two roundings): their values are
# gguf's and their sums llama.cpp's, bit for bit; the other files take the compiler's default
EXACT = ("quants.c", "dequant.c", "dequant_avx512.c", "expand.c", "activations.c", "products.c", "rows_avx2.c",
         "tiles_avx512.c", "gemm.c", "gemm_pack.c", "gemm_avx512.c", "gemm_avx2.c")

V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
V4 = V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    name: str
    march: tuple[str, ...]  # the compiler's instruction-set flags
    needs: tuple[str, ...]  # the /proc/cpuinfo flags a CPU must report to run it
    lacks: tuple[str, ...]  # flag prefixes a CPU of this level does not have (hidden under DELTASERVE_ISA=<name>)
    cpus: str


VARIANTS = (  # best first
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mgfni"),
            V4 + ("avx512_vnni", "avx512_bf16", "gfni"), (), "AMD Zen 4/5, Intel Sapphire Rapids and later"),
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), V4 + ("avx512_vnni",), ("avx512_bf16", "amx"),
            "Intel Cascade Lake, Ice Lake"),
    # Haswell's instructions are x86-64-v3's (and AES, PCLMUL, RDRND the code never asks for): the build the AVX2
    # route has been tested and measured on (DELTASERVE_ISA=avx2), kept as it was
    Variant("x86-64-v3", ("-march=haswell",), V3, ("avx512", "amx", "avx_vnni"),
            "AMD Zen 1-3, Intel Haswell and later"),
)
NATIVE = Variant("native", ("-march=native",), ("avx2", "fma", "f16c"), (), "this CPU")
ALIASES = {"avx2": "x86-64-v3"}
ISA_NAMES = tuple(v.name for v in (*VARIANTS, NATIVE)) + tuple(ALIASES)


def variant(name: str) -> Variant:
    """The variant called `name` (or an alias of it); KeyError for another."""
    name = ALIASES.get(name, name)
    for v in (*VARIANTS, NATIVE):
        if v.name == name:
            return v
    raise KeyError(name)


def _read_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def forced() -> Variant | None:
    """The variant DELTASERVE_ISA names (None: auto, the best this CPU runs; or a name that is none: _load says so)."""
    isa = settings.current().isa
    try:
        return None if isa == "auto" else variant(isa)
    except KeyError:
        return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags as the routes see them: /proc/cpuinfo's, less what the level DELTASERVE_ISA names
    lacks (every decision taken on them then takes that CPU's route: the build, AMX, the bench's llama.cpp)."""
    with _lock:
        if "flags" not in _state:
            flags = _read_flags()
            v = forced()
            if v is not None and v.lacks:
                flags = {f for f in flags if not f.startswith(v.lacks)}
            _state["flags"] = flags
        return _state["flags"]


def candidates(flags: set[str] | None = None) -> list[Variant]:
    """The variants this CPU may load, best first: the one DELTASERVE_ISA names, else every level whose flags it
    reports (and -march=native last, for a CPU none of them fits)."""
    flags = _read_flags() if flags is None else flags
    v = forced()
    if v is not None:
        return [v]
    return [v for v in VARIANTS if all(f in flags for f in v.needs)] + \
        ([NATIVE] if all(f in flags for f in NATIVE.needs) else [])


def sources() -> list[Path]:
    return sorted(CDIR.glob("*.c"))


def headers() -> list[Path]:
    return sorted(CDIR.glob("*.h"))


def _flags(v: Variant) -> tuple[list[str], dict[str, list[str]]]:
    """A level's compiler flags, and each file's own."""
    return [*FLAGS, *v.march], {name: ["-ffp-contract=off"] for name in EXACT}


def build_key(v: Variant) -> str:
    """The hash of what level `v`'s library is built from but the compiler: the sources, the headers and the flags.
    A library of these is found by it (its name, its ds_build_info)."""
    if ("key", v.name) not in _state:
        flags, per_file = _flags(v)
        _state[("key", v.name)] = source_key(sources(), headers(), repr((flags, sorted(per_file.items()))))
    return _state[("key", v.name)]


def build(v: Variant, cc: str, out_dir: Path | None = None) -> Path:
    """The library of level `v` for these sources, compiled now unless built already (into the cache, or
    `out_dir`). Raises RuntimeError (the compiler's first error) or OSError."""
    key = build_key(v)
    flags, per_file = _flags(v)
    per_file["library.c"] = [f'-DDS_BUILD="{v.name} {key}"']
    # -march=native's code depends on this CPU: its flags are part of the key (the levels' code does not)
    extra = " ".join(sorted(_read_flags())) if v is NATIVE else ""
    return build_library(f"native-{v.name}-{key}", sources(), flags, cc=cc, headers=headers(),
                         source_flags=per_file, link=["-fopenmp", "-lm"], key_extra=extra,
                         what="the native kernel", note=f" for {v.name}", out_dir=out_dir)


def build_all(out_dir: Path | None = None, names: list[str] | None = None) -> list[tuple[Variant, Path]]:
    """Every level's library (or those `names` names), compiled where not built yet: what a wheel ships in
    kernels/lib/ or a fleet keeps in its shared cache directory. Raises RuntimeError without a compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({settings.current().compiler}) on PATH")
    chosen = [variant(n) for n in names] if names else list(VARIANTS)
    return [(v, build(v, cc, out_dir)) for v in chosen]


def find(v: Variant) -> Path | None:
    """A library of level `v` built from these sources, in the prebuilt directory or the cache (any compiler's), found
    without compiling anything."""
    if v is NATIVE:  # its build depends on the CPU: only build() knows its key
        return None
    pattern = f"native-{v.name}-{build_key(v)}-*.so"
    for d in (PREBUILT, cache_root() / "native"):
        found = sorted(d.glob(pattern)) if d.is_dir() else []
        if found:
            return found[0]
    return None


# every function the library may hold, with its ctypes signature; a build holds those its level compiles
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {
    "ds_linear_i8": [_P, _I, _I, _L, _P, _P, _I, _P, _L, _I],
    "ds_linear_kq": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_deltanet_step": [_P] * 11 + [_I] * 6 + [_F, _I],
    "ds_causal_conv": [_P, _P, _P, _P, _I, _I, _I, _I, _L],
    "ds_repack_q4k": [_P, _L, _P],
    "ds_quantize_rows": [_P, _I, _I, _L, _P, _P, _I],
    "ds_scale_product": [_P, _I, _I, _P, _P, _P, _I],
    "ds_decode_tokens": [_P, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _I],
    "ds_delta_rule": [_P] * 7 + [_I] * 5,
    "ds_dequant": [_I, _P, _L, _I, _P, _L, _I],
    "ds_dequant_bf16": [_I, _P, _L, _I, _P, _L, _I],
    "ds_linear_blocks": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_gemm_blocks": [_I, _P, _I, _I, _L, _P, _I, _P, _L, _I],
    "ds_gemm_type": [_I],
    "ds_set_decode_gemm": [_I],
    "ds_set_moe_gemm": [_I],
    "ds_moe_experts": [_P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _I, _P, _P],
    "ds_set_tables": [_P] * 7,
    "ds_attention_bf16": [_P, _P, _P, _P, _I, _I, _I, _F, _I],
    "ds_attention_f32": [_P, _P, _P, _P, _I, _I, _I, _F, _I],
    "ds_rms_norm": [_P, _L, _P, _P, _I, _I, _F, _I],
    "ds_l2_norm_heads": [_P, _L, _P, _I, _I, _I, _F, _I],
    "ds_gated_rms_norm": [_P, _P, _L, _P, _P, _I, _I, _I, _F, _I],
    "ds_swiglu": [_P, _L, _P, _L, _P, _I, _I, _I],
}


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

_lock = threading.RLock()
_state: dict = {}
_on_load: list = []
_TABLES: list = []


def on_load(fn) -> None:
    """Call fn(lib) on the library once loaded (now, if it is): the routes set its thresholds so."""
    _on_load.append(fn)
    lib = _state.get("lib")
    if lib is not None:
        fn(lib)


def _iq_tables() -> list:
    """The IQ types' grids (gguf's: float32, rows of 8 or 4 values) and the sign bytes, for the C's dequantization
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


def _open(path: Path, v: Variant) -> tuple[ctypes.CDLL | None, str]:
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "ds_build_info") or lib.ds_abi_version() != ABI:
        return None, f"the library at {path} is of another version (wanted {ABI})"
    lib.ds_build_info.restype = ctypes.c_char_p
    if lib.ds_build_info().decode() != f"{v.name} {build_key(v)}":
        return None, f"the library at {path} is another build ({lib.ds_build_info().decode()})"
    return lib, ""


def _load() -> tuple[ctypes.CDLL | None, str, Variant | None, Path | None]:
    if not settings.current().native:
        return None, "turned off by DELTASERVE_NATIVE", None, None
    isa = settings.current().isa
    if isa != "auto" and isa not in ISA_NAMES:
        return None, f"DELTASERVE_ISA={isa} is not one of auto, {', '.join(ISA_NAMES)}", None, None
    flags = _read_flags()
    levels = candidates(flags)
    if not levels:
        missing = [f for f in NATIVE.needs if f not in flags]
        return None, f"this CPU lacks {', '.join(missing)}", None, None
    best = levels[0]
    if any(f not in flags for f in best.needs):
        return None, (f"DELTASERVE_ISA={isa}: this CPU lacks "
                      f"{', '.join(f for f in best.needs if f not in flags)}"), None, None
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first: the library binds to the same one
    path, why = find(best), ""
    if path is None:
        cc = compiler()
        if cc is not None:
            try:
                path = build(best, cc)
            except (RuntimeError, OSError) as e:
                why = str(e)
        else:
            why = f"no C compiler ({settings.current().compiler}) on PATH"
        if path is None:  # a lower level built before (a wheel's, a fleet's), where this one cannot be built
            path, best = next(((p, v) for v in levels[1:] if (p := find(v)) is not None), (None, best))
            if path is None:
                return None, why, None, None
    try:
        lib, why = _open(path, best)
    except OSError as e:
        return None, str(e), None, None
    if lib is None:
        return None, why, None, None
    for name, args in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    lib.ds_set_tables(*(t.ctypes.data for t in _iq_tables()))
    return lib, "built", best, path


def library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"], _state["variant"], _state["path"] = _load()
            if _state["lib"] is not None:
                for fn in _on_load:
                    fn(_state["lib"])
        return _state["lib"]


def loaded() -> tuple[Variant | None, Path | None]:
    """The level this process's library was built for, and its file (None, None without one)."""
    library()
    return _state["variant"], _state["path"]


def has(name: str) -> bool:
    """Whether this process's library holds the kernel `name` (its level compiles it)."""
    lib = library()
    return lib is not None and hasattr(lib, name)


def status() -> tuple[bool, str]:
    """(available, what or why not) for the int8 tables' kernels (tables_avx512.c: int8 tables and repacked Q4_K
    blocks times a few rows) and the prefill's 512-bit delta rule: built and loaded on first call, then remembered."""
    lib = library()
    if lib is None:
        return False, _state["why"]
    if not hasattr(lib, "ds_linear_i8"):
        missing = [f for f in ("avx512f", "avx512bw", "avx512_vnni") if f not in cpu_flags()]
        return False, f"this CPU lacks {', '.join(missing or ('avx512f', 'avx512bw', 'avx512_vnni'))}"
    return True, "AVX512-VNNI, int8 activations per block of 32"


def portable() -> tuple[bool, str]:
    """(available, what or why not) for the products on the file's own blocks (every build; their 512-bit VNNI
    tiles where the build has them)."""
    lib = library()
    if lib is None:
        return False, _state["why"]
    if not hasattr(lib, "ds_linear_blocks"):
        return False, "not in this build"
    return True, "AVX512-VNNI" if hasattr(lib, "ds_blocks_vnni") else "AVX2"


def why_not() -> str:
    """Why there is no native library ("" where there is)."""
    return "" if library() is not None else _state["why"]


def generation() -> int:
    """How many times the library's state was forgotten (reset): what a cached decision on it is keyed by."""
    return _state.get("generation", 0)


def reset() -> None:
    """Forget the loaded state so the next call decides again (tests change the environment)."""
    with _lock:
        gen = _state.get("generation", 0) + 1
        _state.clear()
        _state["generation"] = gen
