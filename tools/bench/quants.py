"""`deltaserve bench quants`: llama-quantize's presets of the Qwen3.5-0.8B shape (random weights, the real
vocabulary), each made by llama.cpp's own quantizer from the shape's f16 file: deltaserve against llama.cpp on the
same file, side by side: load, pp512, decode, peak RSS, and each engine's distance from the f16 file's exact logits
(mean |logit - exact| over a 128-token prompt, deltaserve's exact f32 forward of the f16 file as the reference).

Presets that llama-quantize makes only with an importance matrix (the 1- and 2-bit IQ types, IQ3_XXS / IQ3_XS,
Q2_K_S) are made with one: llama.cpp's llama-imatrix (built here from the same source) over this checkout's README
on the f16 file, then its llama-quantize --imatrix. MXFP4_MOE (MXFP4 experts, the rest Q8_0) is a preset of the
MoE models: it is made from the Qwen3.5-35B-A3B shape at MOE_LAYERS of its 40 layers (f16, the full width: 256
experts of 512, the real vocabulary), its distance measured from that f16 file's logits (deltaserve's f32 products
of its f16 values). `--presets A,B` runs those presets alone. Each engine runs in a fresh process per file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from tools.bench.peers import _cpu_name, in_fresh_process, use_best_llama
from tools.bench.sizes import PP, side_by_side

NEEDS_IMATRIX = ("IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "Q2_K_S")
PRESETS = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
           "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "Q2_K", "TQ2_0", "TQ1_0") + NEEDS_IMATRIX
MOE_PRESETS = ("MXFP4_MOE",)  # on the MoE shape
PRESETS += MOE_PRESETS
MOE_SHAPE, MOE_LAYERS = "35B-A3B", 4  # (fewer than 4 hold no attention layer: llama.cpp aborts on a model without one)
QUICK = ("Q5_0", "Q3_K_M", "IQ4_NL", "IQ4_XS", "IQ3_S", "Q2_K", "IQ2_XXS")
LOGIT_TOKENS = 128


def imatrix_file() -> Path:
    """An importance matrix of the 0.8B shape's f16 file, made once by llama.cpp's llama-imatrix over this checkout's
    README (4 chunks of 512 tokens)."""
    import subprocess

    from tools.bench.models import CACHE, model_file
    from tools.bench.peers import _llama_built

    out = CACHE / "qwen35-0.8B-f16.imatrix.gguf"
    if out.exists():
        return out
    binary = _llama_built("llama-imatrix", shared=False, product="llama-imatrix")
    text = Path(__file__).resolve().parents[2] / "README.md"
    part = out.with_name(out.name + ".part.gguf")
    r = subprocess.run([str(binary), "-m", str(model_file("0.8B", "f16")), "-f", str(text), "-o", str(part),
                        "-c", "512", "--chunks", "4", "-t", "2", "--output-format", "gguf"],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not part.exists():
        raise RuntimeError(f"llama-imatrix failed ({r.returncode}): {(r.stderr or r.stdout)[-600:]}")
    part.replace(out)
    return out


def preset_file(preset: str) -> Path | None:
    """The 0.8B shape quantized to `preset` by llama.cpp (made once; None where the quantizer refused): through
    llama-cpp-python's quantizer, or llama-quantize --imatrix for the presets that need an importance matrix."""
    import subprocess

    from tools.bench.models import CACHE, model_file
    from tools.bench.peers import _llama_built
    from tools.bench.randmodel import quantize_with_llama_cpp

    if preset in MOE_PRESETS:
        out = CACHE / f"qwen35-{MOE_SHAPE}-{MOE_LAYERS}L-{preset}.gguf"
        if out.exists():
            return out
        try:
            return quantize_with_llama_cpp(model_file(MOE_SHAPE, "f16", MOE_LAYERS), out, preset)
        except RuntimeError:
            return None
    out = CACHE / f"qwen35-0.8B-{preset}.gguf"
    if out.exists():
        return out
    if preset in NEEDS_IMATRIX:
        binary = _llama_built("llama-quantize", shared=False, product="llama-quantize")
        part = out.with_name(out.name + ".part")
        r = subprocess.run([str(binary), "--imatrix", str(imatrix_file()), str(model_file("0.8B", "f16")),
                            str(part), preset, "2"], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0 or not part.exists():
            return None
        part.replace(out)
        return out
    try:
        return quantize_with_llama_cpp(model_file("0.8B", "f16"), out, preset)
    except RuntimeError:
        return None


def reference_logits(path: Path, out: Path, weights: str = "exact") -> Path:
    """deltaserve's exact f32 logits of the f16 file over the bench prompt's first LOGIT_TOKENS tokens (.npy).
    `weights` "blocks" for the MoE shape: its f16 values multiplied in f32 as they are (exact f32 copies of all of
    them would not fit this machine's memory)."""
    if not out.exists():
        import deltaserve
        from tools.bench.peers import bench_ids

        m = deltaserve.load(path, weights=weights, cache=False)
        np.save(out, m.logits(bench_ids(m.config.vocab_size)[:LOGIT_TOKENS]).numpy())
    return out


def moe_reference() -> Path:
    """The MoE shape's f16 logits (.npy), its f16 file written only where they are not there yet."""
    from tools.bench.models import CACHE, model_file

    out = CACHE / f"qwen35-{MOE_SHAPE}-{MOE_LAYERS}L-f16-logits.npy"
    return out if out.exists() else reference_logits(model_file(MOE_SHAPE, "f16", MOE_LAYERS), out, weights="blocks")


def deltaserve_distance(path: Path, threads: int, ref: str) -> dict:
    import torch

    import deltaserve
    from tools.bench.peers import bench_ids

    torch.set_num_threads(threads)
    m = deltaserve.load(path, cache=False, threads=threads)
    want = torch.from_numpy(np.load(ref))
    got = m.logits(bench_ids(m.config.vocab_size)[:LOGIT_TOKENS])
    return {"distance": (got - want).abs().mean().item(), "route": m.session(quiet=True).notices[-1]}


def llama_distance(path: Path, threads: int, ref: str) -> dict:
    import llama_cpp

    from tools.bench.peers import bench_ids

    m = llama_cpp.Llama(str(path), n_ctx=LOGIT_TOKENS + 8, n_batch=LOGIT_TOKENS, n_ubatch=LOGIT_TOKENS,
                        n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    ids = bench_ids(m.n_vocab())[:LOGIT_TOKENS]
    m.eval(ids)
    want = np.load(ref)
    got = np.asarray(m.scores[:LOGIT_TOKENS, :want.shape[1]], dtype=np.float32)
    return {"distance": float(np.abs(got - want).mean())}


def main(a) -> None:
    from tools.bench.models import CACHE, model_file

    out = Path(a.out) / "quants"
    out.mkdir(parents=True, exist_ok=True)
    presets = QUICK if a.quick else PRESETS
    if getattr(a, "presets", None):
        presets = tuple(p.strip().upper() for p in a.presets.split(",") if p.strip())
        unknown = [p for p in presets if p not in PRESETS]
        if unknown:
            raise SystemExit(f"deltaserve bench quants --presets: {', '.join(unknown)} not among {', '.join(PRESETS)}")
    results: dict = {"command": a.command_line, "threads": a.threads, "cpu": _cpu_name(), "pp": PP, "tg": 16,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "rows": [], "llama.cpp_flags": use_best_llama(),
                     "not_made": {}}
    ref = reference_logits(model_file("0.8B", "f16"), CACHE / "qwen35-0.8B-f16-exact-logits.npy")
    for preset in presets:
        # the MoE preset's own reference: its shape's f16 logits, made (with the f16 file) first and once
        row_ref = moe_reference() if preset in MOE_PRESETS else ref
        path = preset_file(preset)
        if path is None:
            results["not_made"][preset] = "llama-quantize refused it" + (" (with the importance matrix)"
                                                                         if preset in NEEDS_IMATRIX else "")
            continue
        row = {"preset": preset, "file_bytes": path.stat().st_size}
        row.update(side_by_side(path, a.threads, 16, a.repeats, f"quants {preset}"))
        for engine, fn in (("llama.cpp", "llama_distance"), ("deltaserve", "deltaserve_distance")):
            row[engine].update(in_fresh_process(fn, path, a.threads, str(row_ref), module="tools.bench.quants"))
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    md = write_report(results, out)
    print(md.read_text())


def write_report(r: dict, out: Path) -> Path:
    lines = [f"# deltaserve bench quants ({r['date']})", "", f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}, {r['threads']} threads. Random weights of the Qwen3.5-0.8B shape (MXFP4_MOE: of the "
             f"{MOE_SHAPE} shape at {MOE_LAYERS} of its layers), each preset made by "
             f"llama.cpp's quantizer from the f16 file; each engine in a fresh process per file: load, a {r['pp']}-token "
             f"prefill, {r['tg']} decoded tokens, peak RSS; distance: mean |logit - the f16 file's exact logit| over "
             f"{LOGIT_TOKENS} tokens. llama.cpp: llama-cpp-python on a libllama built here with "
             f"{r.get('llama.cpp_flags') or 'the installed flags'}.", "",
             "| preset | size | pp tok/s ds / llama | tg tok/s ds / llama | distance ds / llama | peak RSS - file ds "
             "(llama) | load s ds / llama |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        d, l = row["deltaserve"], row["llama.cpp"]
        lines.append(f"| {row['preset']} | {row['file_bytes'] / 2**20:.0f} MiB | {d['pp']:.1f} / {l['pp']:.1f} "
                     f"({d['pp'] / l['pp']:.2f}x) | {d['tg']:.1f} / {l['tg']:.1f} ({d['tg'] / l['tg']:.2f}x) | "
                     f"{d['distance']:.4f} / {l['distance']:.4f} ({d['distance'] / l['distance']:.2f}x) | "
                     f"{(d['peak_rss'] - row['file_bytes']) / 2**20:+.0f} MiB ({(l['peak_rss'] - row['file_bytes']) / 2**20:+.0f}) | "
                     f"{d['load_s']:.2f} / {l['load_s']:.2f} |")
    if r.get("not_made"):
        lines += ["", "Not made: " + "; ".join(f"{k} ({v})" for k, v in r["not_made"].items())]
    routes = {row["deltaserve"].get("route") for row in r["rows"]} - {None}
    lines += ["", "deltaserve's route line(s):", ""] + [f"- `{x}`" for x in sorted(routes)]
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md
