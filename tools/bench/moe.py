"""`deltaserve bench moe`: the Qwen3.5-35B-A3B shape (qwen35moe: 256 experts of 512, 8 a token, a shared expert),
Q8_0 and llama.cpp's Q4_K_M, deltaserve against llama.cpp side by side: load time, prefill (pp512), decode and the
peak resident memory of the process that did all three, against the file's size.

The whole model (40 layers, 21 GB at Q4_K_M, 37 GB at Q8_0) does not fit this machine's 24 GiB beside the page
cache, so the files hold fewer layers of the full width: LAYERS of them, two counts. A token's time is a fixed part
(embedding, final norm, the 248,320-row head) plus one per layer; the difference between the two counts gives the
per-layer part, and the 40-layer rate is extrapolated as 1 / (fixed + 40 x per layer) for each engine. Each count's
own ratios are reported as measured too. Random weights (tools/bench/randmodel.py; the router's are random, so
the experts a token chooses are spread as a trained router's are not), each engine in a fresh process per file, the
file read through before each run. The rounds go file after file (both layer counts in each round), so that a
round's two counts are minutes apart: the host's memory bandwidth moves by a fifth within an hour, and the
per-layer part is a difference of two measures.

A decoded token reads at least its weights (the routed experts' n_used of n_expert), a DeltaNet layer's state (read
and written) and an attention layer's KV cache: `decode_floor` counts those bytes from the file and divides them by
the highest read bandwidth measured during the run (a 2-thread reduction over 1 GiB, in a process of its own between
the rounds). That gives the fastest decode any engine could show on this host, and so the highest decode ratio
against llama.cpp's measured rate that the host allows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tools.bench.peers import _cpu_name, in_fresh_process, use_best_llama
from tools.bench.sizes import PP, engine_medians, side_by_side

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


def at_full(values: dict[int, float]) -> float:
    """The value at FULL layers of the straight line through two (layer count, value) points."""
    (l0, v0), (l1, v1) = sorted(values.items())
    return v0 + (v1 - v0) / (l1 - l0) * (FULL - l0)


def memory_at_full(rows: list[dict], engine: str) -> dict:
    """An engine's peak RSS and load time at FULL layers, each a straight line through the two layer counts (as the
    token's time), and the file's size likewise: a process holds what the file maps (the weights it touches) plus
    what it allocates, whose fixed part (the runtime, the prefill's working set) weighs on a 4-layer file as it does
    not on the 40-layer one."""
    rss = at_full({r["layers"]: r[engine]["peak_rss"] for r in rows})
    file = at_full({r["layers"]: r["file_bytes"] for r in rows})
    return {"peak_rss": rss, "file_bytes": file, "rss_over_file": rss / file,
            "load_s": at_full({r["layers"]: r[engine]["load_s"] for r in rows})}


def decode_floor(path: Path, position: int) -> dict:
    """The bytes one decoded token must read in a qwen35moe file, from its tensors and metadata alone (whatever the
    engine): per layer its tensors, the routed experts' (`*_exps`) at n_used of n_expert; a DeltaNet layer's
    recurrent state and conv window, read and written, in f32 (llama.cpp and deltaserve both keep them so); an
    attention layer's K and V cache up to `position`, in f16 (llama.cpp's; deltaserve keeps f32 and reads twice
    that). Fixed: every tensor outside the layers but the embedding (one row of it is read). {"layers": [bytes
    of layer i], "fixed": bytes}."""
    from gguf import GGUFReader

    r = GGUFReader(path)

    def meta(key: str):
        return r.fields[f"qwen35moe.{key}"].contents()

    n_layers, share = meta("block_count"), meta("expert_used_count") / meta("expert_count")
    dk, nk, nv_dv, kc = meta("ssm.state_size"), meta("ssm.group_count"), meta("ssm.inner_size"), meta("ssm.conv_kernel")
    recurrent = meta("attention.recurrent_layers")
    state = 2 * 4 * (nv_dv * dk + (kc - 1) * (2 * nk * dk + nv_dv))
    kv = 2 * 2 * meta("attention.head_count_kv") * meta("attention.key_length") * position
    layers, fixed = [0.0] * n_layers, 0.0
    for t in r.tensors:
        if t.name.startswith("blk."):
            layers[int(t.name.split(".")[1])] += t.n_bytes * (share if "_exps." in t.name else 1.0)
        elif not t.name.startswith("token_embd"):
            fixed += t.n_bytes
    return {"layers": [b + (state if recurrent[i] else kv) for i, b in enumerate(layers)], "fixed": fixed}


def bandwidth_run(path: Path, threads: int) -> dict:
    """The host's read bandwidth now (in a process of its own: the bench's own process keeps no OpenMP team; `path`
    unused, as in_fresh_process passes one)."""
    from tools.bench.peers import read_bandwidth

    return {"read_bandwidth": read_bandwidth(threads)}


def ceilings(results: dict) -> dict:
    """Per kind: the decode floor at FULL layers (its bytes over the highest bandwidth measured), each engine's
    per-layer time against the floor's, and the highest decode ratio against llama.cpp's extrapolated rate that the
    floor allows."""
    bw = max(results["read_bandwidth_runs"])
    out = {}
    for kind, d in results["decode_bytes"].items():
        layer_bytes = sum(d["layers"]) / len(d["layers"])
        per_layer, fixed = layer_bytes / bw, d["fixed"] / bw
        full = 1.0 / (fixed + FULL * per_layer)
        engines = results["full"][kind]
        out[kind] = {"read_bandwidth": bw, "bytes_per_layer": layer_bytes,
                     "fixed_bytes": d["fixed"], "per_layer_ms": per_layer * 1e3, "fixed_ms": fixed * 1e3,
                     "full": full, "ratio_ceiling": full / engines["llama.cpp"]["tg"]["full"],
                     "of_floor": {e: per_layer * 1e3 / m["tg"]["per_layer_ms"] for e, m in engines.items()}}
    return out


def per_round(rows: list[dict], engine: str, what: str) -> list[float]:
    """The FULL-layer rate extrapolated from each round's own two layer counts (their runs minutes apart)."""
    runs = {r["layers"]: r[engine]["runs"] for r in rows}
    n = min(len(v) for v in runs.values())
    return [extrapolate({layers: v[i][what] for layers, v in runs.items()})["full"] for i in range(n)]


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
    results["read_bandwidth_runs"], results["decode_bytes"] = [], {}
    for kind in kinds:
        paths = {layers: moe_file(kind, layers) for layers in LAYERS}
        # the layers the per-layer part is measured on: those of the larger count beyond the smaller's (llama.cpp's
        # Q4_K_M gives some layers Q6_K tensors where others have Q4_K, so the files' layers differ in bytes)
        small, large = (decode_floor(paths[n], PP + tg // 2) for n in (min(LAYERS), max(LAYERS)))
        results["decode_bytes"][kind] = {"layers": large["layers"][min(LAYERS):], "fixed": small["fixed"]}
        rounds: dict[int, list] = {layers: [] for layers in LAYERS}
        for i in range(max(1, a.repeats)):
            results["read_bandwidth_runs"].append(in_fresh_process("bandwidth_run", paths[min(LAYERS)], a.threads,
                                                                   module="tools.bench.moe")["read_bandwidth"])
            for layers, path in paths.items():
                label = f"moe {kind} {layers} layers, round {i + 1}"
                rounds[layers].append(side_by_side(path, a.threads, tg, 1, label))
        for layers, path in paths.items():
            row = {"kind": kind, "layers": layers, "file_bytes": path.stat().st_size}
            # side_by_side's rounds of one run each, as one: each engine's medians over the rounds, and its runs
            row.update(engine_medians({e: [run for r in rounds[layers] for run in r[e]["runs"]]
                                       for e in ("llama.cpp", "deltaserve")}))
            results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["read_bandwidth_runs"].append(in_fresh_process("bandwidth_run", paths[min(LAYERS)], a.threads,
                                                           module="tools.bench.moe")["read_bandwidth"])
    results["full"], results["rounds"] = {}, {}
    for kind in kinds:
        rows = [r for r in results["rows"] if r["kind"] == kind]
        results["full"][kind] = {engine: {what: extrapolate({r["layers"]: r[engine][what] for r in rows})
                                          for what in ("pp", "tg")} for engine in ("llama.cpp", "deltaserve")}
        for engine, m in results["full"][kind].items():
            m["memory"] = memory_at_full(rows, engine)
        results["rounds"][kind] = {what: [d / l for d, l in zip(per_round(rows, "deltaserve", what),
                                                                 per_round(rows, "llama.cpp", what))]
                                   for what in ("pp", "tg")}
    results["floor"] = ceilings(results)
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
        if all("memory" in m for engines in r["full"].values() for m in engines.values()):
            lines += ["", f"Peak RSS and load at {r['full_layers']} layers, each a straight line through the two "
                          "layer counts, as the file's size: what a process holds beyond the file (the runtime, the "
                          "prefill's working set) weighs on the small files as it does not on the full one.", "",
                      f"| file | engine | file at {r['full_layers']} | peak RSS at {r['full_layers']} | RSS / file | "
                      f"load s at {r['full_layers']} | load / llama |", "|---|---|---|---|---|---|---|"]
            for kind, engines in r["full"].items():
                ref = engines["llama.cpp"]["memory"]
                for engine, m in engines.items():
                    mm = m["memory"]
                    lines.append(f"| {kind} | {engine} | {mm['file_bytes'] / 2**20:.0f} MiB | "
                                 f"{mm['peak_rss'] / 2**20:.0f} MiB | {mm['rss_over_file']:.2f}x | "
                                 f"{mm['load_s']:.2f} | {mm['load_s'] / ref['load_s']:.2f}x |")
    for kind, ratios in r.get("rounds", {}).items():
        lines.append(f"- {kind}: the {r['full_layers']}-layer ratios of each round's own two layer counts: pp "
                     + ", ".join(f"{x:.2f}x" for x in ratios["pp"]) + "; tg " + ", ".join(f"{x:.2f}x" for x in ratios["tg"]))
    if r.get("floor"):
        bws = r["read_bandwidth_runs"]
        lines += ["", f"The decode floor: the bytes a token must read (the layers' tensors, the routed experts' "
                      f"{'n_used of n_expert'}, a DeltaNet layer's f32 state read and written, an attention layer's f16 KV "
                      f"cache at position {r['pp'] + r['tg'] // 2}; the head) over this host's read bandwidth, "
                      f"{max(bws) / 1e9:.1f} GB/s, the highest of {len(bws)} measurements in the run "
                      f"({min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s). No engine decodes faster than it on this host; "
                      f"the last column is the highest decode ratio against llama.cpp's {r['full_layers']}-layer rate "
                      "(above) that it allows.", "",
                  "| file | MiB a token per layer | fixed MiB | floor: ms per layer | llama.cpp per layer / floor's | "
                  "deltaserve per layer / floor's | floor tok/s at 40 | floor / llama at 40 |",
                  "|---|---|---|---|---|---|---|---|"]
        for kind, f in r["floor"].items():
            lines.append(f"| {kind} | {f['bytes_per_layer'] / 2**20:.1f} | {f['fixed_bytes'] / 2**20:.0f} | "
                         f"{f['per_layer_ms']:.2f} | {1 / f['of_floor']['llama.cpp']:.2f}x | "
                         f"{1 / f['of_floor']['deltaserve']:.2f}x | {f['full']:.2f} | {f['ratio_ceiling']:.2f}x |")
    routes = {run.get("route") for row in r["rows"] for run in row["deltaserve"]["runs"]} - {None}
    lines += ["", "deltaserve's route line(s):", ""] + [f"- `{x}`" for x in sorted(routes)]
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md
