"""The benchmarks' model files: random weights of the real Qwen3.5 shapes, made once and cached under the user
cache directory ($DELTASERVE_CACHE_DIR or ~/.cache/deltaserve, in bench/); llama-quantize makes the quantized ones."""

from __future__ import annotations

from pathlib import Path

from deltaserve.cachedir import cache_root

CACHE = cache_root() / "bench"
REPO = Path(__file__).resolve().parents[2]


def model_file(shape: str, kind: str, layers: int | None = None, mtp: bool = False) -> Path:
    """`mtp`: the file carries an MTP block after the trunk (issue 33's costs); written directly (f32, f16, bf16,
    q8_0 only)."""
    from tools.bench.randmodel import quantize_with_llama_cpp, write_random_gguf

    CACHE.mkdir(parents=True, exist_ok=True)
    suffix = f"-{layers}L" if layers else ""
    if mtp:
        return write_random_gguf(shape, CACHE / f"qwen35-{shape}{suffix}-mtp-{kind}.gguf", kind, layers=layers,
                                 mtp=True)
    if kind.upper() in ("Q4_K_M", "Q6_K", "Q4_0"):
        out = CACHE / f"qwen35-{shape}{suffix}-{kind.upper()}.gguf"
        if out.exists():  # its f16 source is not written again (18 GB at the 9B shape)
            return out
        return quantize_with_llama_cpp(model_file(shape, "f16", layers), out, kind.upper())
    return write_random_gguf(shape, CACHE / f"qwen35-{shape}{suffix}-{kind}.gguf", kind, layers=layers)
