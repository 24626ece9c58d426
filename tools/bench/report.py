"""The benchmark's table, plots and benchmarks/RESULTS.md from the results JSON."""

from __future__ import annotations

from pathlib import Path


def _r(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def write_report(r: dict, out: Path) -> str:
    lines = [f"# deltaserve benchmarks ({r['date']})", "",
             f"Command: `{r['command']}`  ", f"CPU: {r['cpu']}, {r['threads']} threads, torch {r['torch']}; medians of "
             f"{r['repeats']} runs. Random weights of the real Qwen3.5-0.8B shape, real vocabulary (248,320).", ""]
    if "speed" in r:
        lines += ["## Prefill (pp512) and decode (tg), tokens/s", "",
                  "| file | engine | pp512 | tg | pp vs llama.cpp | tg vs llama.cpp |", "|---|---|---|---|---|---|"]
        for kind, engines in r["speed"].items():
            ref = engines.get("llama.cpp")
            for name, m in engines.items():
                lines.append(f"| {kind} | {name} | {m['pp512']:.1f} | {m['tg']:.1f} | "
                             f"{_r(m['pp512'], ref['pp512']) if ref else '-'} | {_r(m['tg'], ref['tg']) if ref else '-'} |")
        # the bound takes the highest read bandwidth measured in the run: once at its start and once in each
        # deltaserve round's own process (the machine's bandwidth moves from minute to minute)
        seen = [r["read_bandwidth"]] + [v for engines in r["speed"].values()
                                         for v in engines.get("deltaserve", {}).get("read_bandwidth_runs", [])]
        bw = max(seen)
        lines += ["", f"Measured read bandwidth: {bw / 1e9:.1f} GB/s, the highest of {len(seen)} measurements "
                      f"({min(seen) / 1e9:.1f}-{bw / 1e9:.1f} GB/s: at the start, and in each deltaserve round's process; "
                      f"{r['threads']} threads, a 1 GiB reduction).", ""]
        for kind, engines in r["speed"].items():
            d = engines.get("deltaserve")
            if d:
                bound = bw / d["decode_bytes_per_token"]
                lines.append(f"- {kind}: deltaserve decode reads {d['decode_bytes_per_token'] / 2**20:.0f} MiB of weights "
                             f"per token: bandwidth bound {bound:.1f} tok/s, reached {d['tg'] / bound:.0%}.")
        lines.append("")
    if "peak_rss" in r:
        lines += ["## Peak resident memory of `deltaserve run`", "", "| file | file size | peak RSS | ratio |",
                  "|---|---|---|---|"]
        for kind, m in r["peak_rss"].items():
            lines.append(f"| {kind} | {m['file_bytes'] / 2**20:.0f} MiB | {m['peak_rss'] / 2**20:.0f} MiB | {m['ratio']:.2f} |")
        lines.append("")
    if "aggregate" in r:
        a = r["aggregate"]
        lines += ["## Batched decode across conversations", "",
                  f"{a['conversations']} conversations at once: {a['many_tok_s']:.1f} tok/s in all, against "
                  f"{a['one_tok_s']:.1f} tok/s for one ({a['ratio']:.2f}x).", ""]
    if "chat" in r:
        ch = r["chat"]
        n = len(ch["deltaserve"].get("runs", [])) or 1
        lines += [f"## A 12-turn chat: time to first token per turn (ms, median of {n} conversation"
                  f"{'s' if n > 1 else ''} per engine, run in turn)", "",
                  "| turn | prompt tokens (deltaserve) | deltaserve | llama-server | ratio |", "|---|---|---|---|---|"]
        for d, l in zip(ch["deltaserve"]["turns"], ch["llama-server"]["turns"]):
            lines.append(f"| {d['turn']} | {d['prompt_tokens']} | {d['ttft_s'] * 1000:.0f} | {l['ttft_s'] * 1000:.0f} | "
                         f"{d['ttft_s'] / l['ttft_s']:.2f} |")
        dr, lr = ch["deltaserve"]["regenerate_ttft_s"], ch["llama-server"]["regenerate_ttft_s"]
        lines += ["", f"Regenerate of turn 12: deltaserve {dr * 1000:.0f} ms, llama-server {lr * 1000:.0f} ms "
                  f"({dr / lr:.2f}x).", ""]
    text = "\n".join(lines) + "\n"
    (out / "RESULTS.md").write_text(text)
    _plots(r, out)
    return text


def _plots(r: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "speed" in r:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "pp512", "prefill pp512 (tok/s)"), (axes[1], "tg", "decode (tok/s)")):
            labels, values = [], []
            for kind, engines in r["speed"].items():
                for name, m in engines.items():
                    labels.append(f"{name}\n{kind}")
                    values.append(m[key])
            ax.bar(range(len(values)), values, color=["C0" if "delta" in lab else "C1" if "llama" in lab else "C2"
                                                      for lab in labels])
            ax.set_xticks(range(len(values)), labels, fontsize=8)
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / "speed.png", dpi=110)
        plt.close(fig)
    if "chat" in r:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, m in r["chat"].items():
            ax.plot([t["turn"] for t in m["turns"]], [t["ttft_s"] * 1000 for t in m["turns"]], "o-", label=name)
        ax.set_xlabel("turn"), ax.set_ylabel("TTFT (ms)"), ax.legend(), ax.set_title("12-turn chat, time to first token")
        fig.tight_layout()
        fig.savefig(out / "chat.png", dpi=110)
        plt.close(fig)


# -- a chart beside each results file ------------------------------------------------------------------------------

ENGINE_COLORS = {"deltaserve": "C0", "llama.cpp": "C1", "llama-server": "C1", "transformers": "C2"}


def charts(directory: Path) -> list[Path]:
    """A PNG beside every results JSON under `directory` (`NAME.json` -> `NAME.png`), by `chart`; a JSON whose
    bench drew its own PNG after writing it is left with that one. What was written."""
    written = []
    for path in sorted(Path(directory).rglob("*.json")):
        png = path.with_suffix(".png")
        if png.exists() and png.stat().st_mtime >= path.stat().st_mtime and not _ours(png):
            continue
        if chart(path) is not None:
            written.append(png)
    return written


def _ours(png: Path) -> bool:
    """Whether a PNG was drawn by `chart` (it says so in its metadata), so that it is drawn again from new results."""
    try:
        from PIL import Image

        with Image.open(png) as im:
            return im.info.get("Software", "") == CHART_SOFTWARE
    except (OSError, ValueError):
        return False


CHART_SOFTWARE = "deltaserve tools/bench/report.py chart"


def chart(path: Path) -> Path | None:
    """The chart of one results JSON, written beside it as NAME.png: tokens/s by file, preset or shape against
    llama.cpp (and the memory's bound on decode where the run measured it), or what the bench compares. None for
    a JSON of no known bench (or without matplotlib)."""
    import json

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    r = json.loads(Path(path).read_text())
    if not isinstance(r, dict):
        return None
    for test, draw in PLOTTERS:
        if test(r):
            fig = draw(r, plt)
            break
    else:
        return None
    title = " · ".join(str(x) for x in (r.get("cpu"), r.get("device"), r.get("date")) if x)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=80, metadata={"Software": CHART_SOFTWARE})
    plt.close(fig)
    return out


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], title: str, ylabel: str = "tokens/s") -> None:
    """Grouped bars: one group per label, one bar per series (engine)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=name, color=ENGINE_COLORS.get(name, f"C{k + 2}"))
    ax.set_xticks(range(len(groups)), groups, fontsize=7, rotation=45 if len(groups) > 6 else 0,
                  ha="right" if len(groups) > 6 else "center")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _speed(r: dict, plt):
    """`bench speed`: pp512 and decode by file and engine; decode against the bound the measured read bandwidth
    puts on it (weights read per token)."""
    kinds = list(r["speed"])
    engines = list(dict.fromkeys(e for k in kinds for e in r["speed"][k]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "pp512", "prefill pp512"), (axes[1], "tg", "decode")):
        _bars(ax, kinds, {e: [r["speed"][k].get(e, {}).get(key) for k in kinds] for e in engines}, title)
    seen = [r.get("read_bandwidth") or 0] + [v for k in kinds
                                            for v in r["speed"][k].get("deltaserve", {}).get("read_bandwidth_runs", [])]
    bw = max(seen)
    for i, k in enumerate(kinds):
        d = r["speed"][k].get("deltaserve", {})
        if bw and d.get("decode_bytes_per_token"):
            bound = bw / d["decode_bytes_per_token"]
            axes[1].hlines(bound, i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                           label="memory bound" if i == 0 else None)
    axes[1].legend(fontsize=7)
    return fig


def _row_label(row: dict) -> str:
    parts = [row.get("preset"), row.get("shape"), row.get("kind"), f"{row['layers']}L" if row.get("layers") else None]
    return " ".join(str(p) for p in parts if p)


def _rows(r: dict, plt):
    """`bench quants | sizes | moe`: prefill and decode of each row (preset, shape, layers) against llama.cpp; the
    MoE runs that measured the memory's floor draw decode's bound from it."""
    rows = r["rows"]
    labels = [_row_label(x) for x in rows]
    engines = [e for e in ("deltaserve", "llama.cpp") if any(e in x for x in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 0.55 * len(rows) + 4), 4.2))
    for ax, key, title in ((axes[0], "pp", f"prefill pp{r.get('pp', '')}"), (axes[1], "tg", "decode")):
        _bars(ax, labels, {e: [x.get(e, {}).get(key) for x in rows] for e in engines}, title)
    floor = r.get("floor") or {}
    marked = False
    for i, x in enumerate(rows):
        f = floor.get(x.get("kind"))
        if f and x.get("layers"):
            bound = f["read_bandwidth"] / (f["fixed_bytes"] + x["layers"] * f["bytes_per_layer"])
            axes[1].hlines(bound, i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                           label=None if marked else "memory bound")
            marked = True
    if marked:
        axes[1].legend(fontsize=7)
    return fig


def _gpu(r: dict, plt):
    rows = r["rows"]
    labels = [f"{x['shape']} {x.get('dtype', '')}" for x in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    _bars(axes[0], labels, {"deltaserve": [x.get("pp512_tok_s") for x in rows]}, "prefill pp512")
    _bars(axes[1], labels, {"deltaserve": [x.get("tg_tok_s") for x in rows]}, "decode")
    return fig


def _mtp(r: dict, plt):
    """`bench mtp`: a verification of k+1 rows against one decode step, per shape and engine; the demo model's
    tokens/s per drafting mode."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, (shape, engines) in enumerate(r["costs"].items()):
        for name, c in engines.items():
            if not c.get("decode_s") or not c.get("verify_s"):
                continue
            rows = sorted(c["verify_s"], key=int)
            axes[0].plot([int(x) + 1 for x in rows], [c["verify_s"][x] / c["decode_s"] for x in rows],
                         "o-" if name == "deltaserve" else "s--", color=f"C{k}", label=f"{name} {shape}")
    axes[0].set_xlabel("rows verified (the sampled token and its drafts)")
    axes[0].set_ylabel("x one decode step")
    axes[0].set_title("a verification's cost", fontsize=10)
    axes[0].legend(fontsize=6)
    modes = {**{f"deltaserve {m}": v for m, v in r.get("demo", {}).items() if isinstance(v, dict)},
             **{f"llama-server {m}": v for m, v in r.get("demo_llama_server", {}).items() if isinstance(v, dict)}}
    axes[1].bar(range(len(modes)), [v.get("tok_s") or 0 for v in modes.values()],
                color=["C0" if m.startswith("deltaserve") else "C1" for m in modes])
    axes[1].set_xticks(range(len(modes)), list(modes), fontsize=7, rotation=30, ha="right")
    axes[1].set_title("the demo model, by drafting mode", fontsize=10)
    axes[1].set_ylabel("tokens/s")
    return fig


def _vision(r: dict, plt):
    sizes = [s for s in r["deltaserve"] if isinstance(r["deltaserve"][s], dict)]
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars(ax, [f"{s} px ({r['deltaserve'][s].get('tokens', '?')} tokens)" for s in sizes],
          {e: [r.get(e, {}).get(s, {}).get("first_token_s") for s in sizes] for e in ("deltaserve", "llama-server")},
          "an image's first token", "seconds")
    return fig


def _responses(r: dict, plt):
    names = list(r["summary"])
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
    ax.barh(range(len(names)), [r["summary"][n]["turn_n_ttft_s"] * 1000 for n in names],
            color=["C0" if n.startswith("deltaserve") else "C1" for n in names])
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"turn {r.get('turns', '')} time to first token (ms)")
    return fig


def _grammar(r: dict, plt):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([0, 1], [r["decode_tok_s_free"], r["decode_tok_s_schema"]], color=["C0", "C2"])
    ax.set_xticks([0, 1], ["free", "json_schema mask"])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{r.get('model', '')}: {r.get('slowdown_pct', '?')} % slower under a schema", fontsize=9)
    return fig


def _threads(r: dict, plt):
    rows = r["results"]
    labels = [f"{x['model']}\n--threads {x['asked']} ({x['threads']})" for x in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    _bars(ax, labels, {"quiet machine": [x.get("quiet") for x in rows],
                       "a core taken": [x.get("contended") for x in rows]}, "decode with and without a busy core")
    return fig


def _replicas(r: dict, plt):
    runs = r["runs"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.bar(range(len(runs)), [x.get("throughput_tok_s") or 0 for x in runs], color="C0")
    ax.set_xticks(range(len(runs)), [x["label"] for x in runs], fontsize=8)
    ax.set_ylabel("tokens/s, all conversations")
    ax.set_title(f"{r.get('conversations', '')} conversations x {r.get('turns', '')} turns", fontsize=10)
    return fig


def _context(r: dict, plt):
    """`bench context`: decode and prefill tokens/s against depth, one line per engine and KV cache type; the
    memory's bound on decode for each cache type as a dashed line."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple[str, str], list[dict]] = {}
    for row in r["rows"]:
        lines.setdefault((row["engine"], row["kv_type"]), []).append(row)
    marks = {"f32": "o", "f16": "s", "bf16": "^", "q8_0": "D"}
    colors = {("deltaserve", "f32"): "tab:blue", ("deltaserve", "f16"): "tab:cyan",
              ("deltaserve", "bf16"): "tab:purple",
              ("llama.cpp", "f16"): "tab:orange", ("llama.cpp", "q8_0"): "tab:red"}
    for (engine, kv), rows in lines.items():
        rows = sorted(rows, key=lambda x: x["depth"])
        for ax, key in ((axes[0], "decode_tok_s"), (axes[1], "prefill_tok_s")):
            pts = [(x["depth"], x[key]) for x in rows if x.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=marks.get(kv, "o"), color=colors.get((engine, kv), "tab:green"),
                        linestyle="-" if engine == "deltaserve" else ":", label=f"{engine} {kv}")
    bounds: dict[str, dict[int, float]] = {}
    for row in r["rows"]:
        kv = "16-bit" if row["kv_type"] in ("f16", "bf16") else row["kv_type"]
        bounds.setdefault(kv, {})[row["depth"]] = row["bound_tok_s"]
    for k, (kv, pts) in enumerate(sorted(bounds.items())):
        depths = sorted(pts)
        axes[0].plot(depths, [pts[d] for d in depths], linestyle="--", color=("black", "dimgray", "darkgray")[k % 3],
                     linewidth=1,
                     label=f"bound, {kv} cache")
    depths = sorted({row["depth"] for row in r["rows"]})
    for ax, title in ((axes[0], f"decode of {r.get('tg', '')} tokens at depth"), (axes[1], "prefill")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [f"{d // 1024}K" if d % 1024 == 0 else str(d) for d in depths])
        ax.minorticks_off()
        ax.set_xlabel("depth (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    return fig


PLOTTERS = [
    (lambda r: r.get("bench") == "context" and isinstance(r.get("rows"), list), _context),
    (lambda r: isinstance(r.get("speed"), dict), _speed),
    (lambda r: "device" in r and isinstance(r.get("rows"), list), _gpu),
    (lambda r: isinstance(r.get("rows"), list) and r["rows"] and isinstance(r["rows"][0], dict)
     and ("deltaserve" in r["rows"][0] or "llama.cpp" in r["rows"][0]), _rows),
    (lambda r: isinstance(r.get("costs"), dict), _mtp),
    (lambda r: isinstance(r.get("deltaserve"), dict) and "llama-server" in r, _vision),
    (lambda r: isinstance(r.get("summary"), dict) and "turns" in r, _responses),
    (lambda r: "decode_tok_s_free" in r, _grammar),
    (lambda r: isinstance(r.get("results"), list) and r["results"] and "quiet" in r["results"][0], _threads),
    (lambda r: isinstance(r.get("runs"), list) and r["runs"] and "throughput_tok_s" in r["runs"][0], _replicas),
]
