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
