"""`deltaserve bench moe`: the Qwen3.5-35B-A3B shape (qwen35moe: 256 experts of 512, 8 a token, a shared expert),
Q8_0 and llama.cpp's Q4_K_M, deltaserve against llama.cpp side by side: load time, prefill (pp512), decode and the
peak resident memory of the process that did all three, against the file's size.

The whole model (40 layers, 21 GB at Q4_K_M, 37 GB at Q8_0) does not fit this machine's 24 GiB beside the page
cache, so the files hold fewer layers of the full width: LAYERS of them, two counts. A token's time is a fixed part
(embedding, final norm, the 248,320-row head) plus one per layer; the difference between the two counts gives the
per-layer part, and the 40-layer rate is extrapolated as 1 / (fixed + 40 x per layer) for each engine. Each count's
own ratios are reported as measured too. Random weights (tools/bench/randmodel.py; the router's are random, so
the experts a token chooses are spread as a trained router's are not), each engine in a fresh process per file, the
file read through before each run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tools.bench.peers import _cpu_name, use_best_llama
from tools.bench.sizes import PP, side_by_side

SHAPE = "35B-A3B"
LAYERS = (4, 8)
FULL = 40  # the published model's layers
KINDS = ("q8_0", "Q4_K_M")


def moe_file(kind: str, layers: int) -> Path:
    """The bench file, made once: Q4_K_M by llama.cpp's quantizer from an f16 file that is removed afterwards
    (it is the largest of them, 15 GB at 8 layers)."""
    from tools.bench.models import CACHE, model_file

    path = model_file(SHAPE, kind, layers)
    f16 = CACHE / f"qwen35-{SHAPE}-{layers}L-f16.gguf"
    if kind.upper() == "Q4_K_M" and f16.exists():
        f16.unlink()
    return path


def extrapolate(rates: dict[int, float]) -> dict:
    """From tokens/s at two layer counts: the per-layer and fixed seconds of a token, and the rate at FULL layers."""
    (l0, r0), (l1, r1) = sorted(rates.items())
    s0, s1 = 1.0 / r0, 1.0 / r1
    per_layer = (s1 - s0) / (l1 - l0)
    fixed = s0 - l0 * per_layer
    return {"per_layer_ms": per_layer * 1e3, "fixed_ms": fixed * 1e3, "full": 1.0 / (fixed + FULL * per_layer)}


def main(a) -> None:
    out = Path(a.out) / "moe"
    out.mkdir(parents=True, exist_ok=True)
    # decode is the part the layer counts' difference needs to be long enough for: at 48 tokens the per-layer
    # slopes came out negative in some runs (both engines); at 128 they were positive for both (Xeon, 2026-12-06)
    tg = 16 if a.quick else 128
    kinds = KINDS[:1] if a.quick else KINDS
    results: dict = {"command": a.command_line, "threads": a.threads, "cpu": _cpu_name(), "pp": PP, "tg": tg,
                     "shape": SHAPE, "layers": list(LAYERS), "full_layers": FULL,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "rows": [], "llama.cpp_flags": use_best_llama()}
    for kind in kinds:
        for layers in LAYERS:
            path = moe_file(kind, layers)
            row = {"kind": kind, "layers": layers, "file_bytes": path.stat().st_size}
            row.update(side_by_side(path, a.threads, tg, a.repeats, f"moe {kind} {layers} layers"))
            results["rows"].append(row)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    results["full"] = {}
    for kind in kinds:
        rows = [r for r in results["rows"] if r["kind"] == kind]
        results["full"][kind] = {engine: {what: extrapolate({r["layers"]: r[engine][what] for r in rows})
                                          for what in ("pp", "tg")} for engine in ("llama.cpp", "deltaserve")}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = write_report(results, out)
    print(md.read_text())


def write_report(r: dict, out: Path) -> Path:
    lines = [f"# deltaserve bench moe ({r['date']})", "", f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}, {r['threads']} threads. Random weights of the Qwen3.5-{r['shape']} shape (qwen35moe: "
             f"hidden 2048, 256 experts of 512, 8 a token, a shared expert of 512) with {' and '.join(map(str, r['layers']))} "
             f"of its {r['full_layers']} layers; each engine in a fresh process per file: load, a {r['pp']}-token "
             f"prefill, {r['tg']} decoded tokens; peak RSS is that process's VmHWM; the file is read through before each "
             f"run. llama.cpp: llama-cpp-python on a libllama built here with "
             f"{r.get('llama.cpp_flags') or 'the installed flags'}.", "",
             "| file | layers | size | engine | load s | pp tok/s | tg tok/s | peak RSS | RSS / file | load / llama | "
             "pp / llama | tg / llama |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        ref = row["llama.cpp"]
        for engine in ("llama.cpp", "deltaserve"):
            m = row[engine]
            lines.append(f"| {row['kind']} | {row['layers']} | {row['file_bytes'] / 2**20:.0f} MiB | {engine} | "
                         f"{m['load_s']:.2f} | {m['pp']:.1f} | {m['tg']:.2f} | {m['peak_rss'] / 2**20:.0f} MiB | "
                         f"{m['peak_rss'] / row['file_bytes']:.2f}x | {m['load_s'] / ref['load_s']:.2f}x | "
                         f"{m['pp'] / ref['pp']:.2f}x | {m['tg'] / ref['tg']:.2f}x |")
    if r.get("full"):
        lines += ["", f"Extrapolated to the full {r['full_layers']} layers (a token's seconds = fixed + layers x per "
                      f"layer, both from the two layer counts):", "",
                  "| file | engine | pp: ms a token per layer | pp: fixed ms a token | pp tok/s at 40 | tg: ms a token per "
                  "layer | tg: fixed ms a token | tg tok/s at 40 | pp / llama | tg / llama |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for kind, engines in r["full"].items():
            ref = engines["llama.cpp"]
            for engine, m in engines.items():
                lines.append(f"| {kind} | {engine} | {m['pp']['per_layer_ms']:.3f} | {m['pp']['fixed_ms']:.3f} | "
                             f"{m['pp']['full']:.1f} | "
                             f"{m['tg']['per_layer_ms']:.2f} | {m['tg']['fixed_ms']:.2f} | {m['tg']['full']:.2f} | "
                             f"{m['pp']['full'] / ref['pp']['full']:.2f}x | {m['tg']['full'] / ref['tg']['full']:.2f}x |")
    routes = {run.get("route") for row in r["rows"] for run in row["deltaserve"]["runs"]} - {None}
    lines += ["", "deltaserve's route line(s):", ""] + [f"- `{x}`" for x in sorted(routes)]
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md
