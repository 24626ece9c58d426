"""`deltaserve bench threads`: decode speed by thread count, quiet and with one competing busy process.

Each measure runs in a process of its own (a fresh OpenMP team with the thread count asked for), on the
embedded demo model and on the random 0.8B shape (Q8_0); the competitor is a process spinning on one core,
started before the measure and killed after it. Written to benchmarks/threads.md and threads.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.bench.peers import _cpu_name

_MEASURE = r"""
import json, sys, time
import deltaserve
path, threads, tokens, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = deltaserve.load(path or None, threads=None if threads == "auto" else int(threads))
import torch
backend, _ = model.backend("cpu")
backend.start()
ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.")
state = backend.new_state(len(ids) + tokens + 1)
runs = []
for r in range(repeats + 1):  # greedy decode steps, whatever the model would stop on (a fixed count)
    backend.reset(state)
    token = int(backend.prefill(state, ids).argmax())
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(backend.decode(state, token).argmax())
    if r:
        runs.append(tokens / (time.perf_counter() - t0))
print("[result] " + json.dumps({"threads": torch.get_num_threads(), "tok_s": sorted(runs)[len(runs) // 2],
                                "runs": runs}))
"""

_SPIN = "while True: pass"


def measure(path: str, threads: str, tokens: int, repeats: int, competitor: bool) -> dict:
    spin = subprocess.Popen([sys.executable, "-c", _SPIN]) if competitor else None
    try:
        time.sleep(0.2 if competitor else 0)
        p = subprocess.run([sys.executable, "-c", _MEASURE, path, threads, str(tokens), str(repeats)],
                           capture_output=True, text=True, timeout=1800)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    line = next((x for x in p.stdout.splitlines() if x.startswith("[result] ")), None)
    if line is None:
        raise RuntimeError(f"the decode measure failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return json.loads(line[len("[result] "):])


def run(out: Path, models: list[tuple[str, str, int]], repeats: int = 5, rounds: int = 2) -> Path:
    """Every (model, threads, quiet|contended) measured `rounds` times, interleaved; medians reported."""
    results = []
    for label, path, tokens in models:
        for threads in ("auto", "1", "2"):
            row = {"model": label, "asked": threads}
            for competitor in (False, True):
                runs = []
                for _ in range(rounds):
                    m = measure(path, threads, tokens, repeats, competitor)
                    runs += m["runs"]
                    row["threads"] = m["threads"]
                key = "contended" if competitor else "quiet"
                row[key] = statistics.median(runs)
                row[key + "_runs"] = runs
            row["kept"] = row["contended"] / row["quiet"]
            results.append(row)
            print(f"[bench] threads: {label} {threads}: quiet {row['quiet']:.1f}, one competitor "
                  f"{row['contended']:.1f} tok/s ({row['kept']:.0%})", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name(), "cores": os.cpu_count(),
            "command": "deltaserve " + " ".join(sys.argv[1:]), "repeats": repeats, "rounds": rounds}
    (out / "threads.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    lines = [f"# Decode by thread count, quiet and with one competing busy process ({meta['date']})", "",
             f"Command: `{meta['command']}`  ", f"CPU: {meta['cpu']}, {meta['cores']} cores. Each figure is the "
             f"median of {rounds} fresh processes x {repeats} decodes; the competitor is a process spinning on one "
             "core. `auto` is the default thread policy (kernels/cpu.py). Goal: under one competitor, at least "
             "40 % of the quiet throughput.", "",
             "| model | --threads | threads used | quiet tok/s | one competitor tok/s | kept |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['asked']} | {r['threads']} | {r['quiet']:.1f} | {r['contended']:.1f} | "
                     f"{r['kept']:.0%} |")
    md = out / "threads.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(a) -> None:
    from tools.bench.models import model_file

    models = [("demo (7.8 MB, F16)", "", 256)]
    if not a.quick:
        models.append(("0.8B shape, Q8_0", str(model_file("0.8B", "q8_0")), 48))
    md = run(Path(a.out), models, repeats=3 if a.quick else 5)
    print(md.read_text())
