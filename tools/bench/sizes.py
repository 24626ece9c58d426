"""`deltaserve bench sizes`: the sizes users run (issue 15): the 0.8B and the 9B shapes, Q8_0 and llama.cpp's Q4_K_M,
deltaserve against llama.cpp side by side: load time, prefill (pp512), decode, and the peak resident memory of the
process that did all three, against the file's size; and the peak resident memory of a short chat as a user runs it
(`deltaserve run FILE -p ... -n 16`; llama.cpp: llama-cpp-python's chat completion of the same prompt, its default
512-position context), the issue's "file + 300 MiB" on the 0.8B shape.

Each engine runs in a fresh process of its own per file (its VmHWM is then its own peak), the engines in turn.
Random weights of the real shapes (tools/bench/randmodel.py writes them one tensor at a time; the 9B Q4_K_M file is
made by llama.cpp's quantizer from a 9B f16 file of ~18 GB: mind the disk).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tools.bench.peers import _cpu_name, bench_ids, in_fresh_process, median, use_best_llama

PP = 512
RUN_PROMPT = "Hello there, how are you today?"


def warm_page_cache(path: Path) -> None:
    """Read the file through once, so that every engine starts with it in the page cache (a run that found it
    evicted read it from disk: a 0.8B prefill at 275 tok/s against 419 in the next round, llama.cpp's 9B load
    4-16 s)."""
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def deltaserve_sizes(path: Path, threads: int, pp: int, tg: int) -> dict:
    import torch

    import deltaserve
    import deltaserve.api  # noqa: F401 - deltaserve's modules imported before the clock, as llama_cpp's are
    from deltaserve.engine.forward import Forward

    from deltaserve.kernels import native

    torch.set_num_threads(threads)
    native.library()  # built (or found built) before the clock: a first run's compile is in neither load nor prefill
    t0 = time.perf_counter()
    m = deltaserve.load(path, cache=False, threads=threads)
    load_s = time.perf_counter() - t0
    f = Forward(m.config, m.host.weights)
    ids = bench_ids(m.config.vocab_size)[:pp]
    st = f.new_state(pp + tg + 8)
    t = time.perf_counter()
    logits = f.prefill(st, ids)
    pp_s = time.perf_counter() - t
    tok = int(logits.argmax())
    f.decode(st, tok)
    t = time.perf_counter()
    for _ in range(tg):
        tok = int(f.decode(st, tok).argmax())
    tg_s = time.perf_counter() - t
    route = m.session(quiet=True).notices[-1]
    return {"load_s": load_s, "pp": pp / pp_s, "tg": tg / tg_s, "peak_rss": _peak_rss(), "route": route}


def deltaserve_run_rss(path: Path, threads: int, pp: int, tg: int) -> dict:
    """`deltaserve run` as a user types it, in this process: its peak RSS."""
    from deltaserve.frontends.cli import main as cli

    code = cli(["run", str(path), "-p", RUN_PROMPT, "-n", str(tg), "--threads", str(threads)])
    if code:
        raise RuntimeError(f"deltaserve run exited {code}")
    return {"run_rss": _peak_rss()}


def llama_run_rss(path: Path, threads: int, pp: int, tg: int) -> dict:
    import llama_cpp

    m = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, verbose=False)
    m.create_chat_completion([{"role": "user", "content": RUN_PROMPT}], max_tokens=tg, temperature=0)
    return {"run_rss": _peak_rss()}


def llama_sizes(path: Path, threads: int, pp: int, tg: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    m = llama_cpp.Llama(str(path), n_ctx=pp + tg + 16, n_batch=pp, n_ubatch=pp, n_threads=threads,
                        n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = bench_ids(m.n_vocab())[:pp]
    t = time.perf_counter()
    m.eval(ids)
    pp_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(tg):
        m.eval([ids[i]])
    tg_s = time.perf_counter() - t
    return {"load_s": load_s, "pp": pp / pp_s, "tg": tg / tg_s, "peak_rss": _peak_rss()}


def side_by_side(path: Path, threads: int, tg: int, repeats: int, label: str, run_rss: bool = False) -> dict:
    """llama.cpp's and deltaserve's load, pp512, decode and peak RSS on one file, each engine in a fresh process
    per round (the rounds interleaved, the file read through before each): {engine: medians and the runs}.
    `run_rss`: also each engine's peak RSS of a short chat as a user runs it."""
    runs: dict[str, list] = {"llama.cpp": [], "deltaserve": []}
    for i in range(max(1, repeats)):
        for engine, fn in (("llama.cpp", "llama_sizes"), ("deltaserve", "deltaserve_sizes")):
            print(f"[bench] {label}: {engine}, round {i + 1}", file=sys.stderr, flush=True)
            warm_page_cache(path)
            run = in_fresh_process(fn, path, threads, PP, tg, module="tools.bench.sizes")
            if run_rss:
                warm_page_cache(path)
                run.update(in_fresh_process(fn.replace("_sizes", "_run_rss"), path, threads, PP, tg,
                                            module="tools.bench.sizes"))
            runs[engine].append(run)
    return engine_medians(runs, run_rss)


def engine_medians(runs: dict[str, list], run_rss: bool = False) -> dict:
    """{engine: its runs' medians of each measure, and the runs} from {engine: [one run's measures, ..]}."""
    keys = ("load_s", "pp", "tg", "peak_rss") + (("run_rss",) if run_rss else ())
    return {engine: {**{k: median([r[k] for r in rs]) for k in keys}, "runs": rs} for engine, rs in runs.items()}


def main(a) -> None:
    from tools.bench.models import model_file

    out = Path(a.out) / "sizes"
    out.mkdir(parents=True, exist_ok=True)
    shapes = ["0.8B"] if a.quick else ["0.8B", "9B"]
    tg = 8 if a.quick else 16
    results: dict = {"command": a.command_line, "threads": a.threads, "cpu": _cpu_name(), "pp": PP, "tg": tg,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "rows": [], "llama.cpp_flags": use_best_llama()}
    for shape in shapes:
        for kind in ("q8_0", "Q4_K_M"):
            path = model_file(shape, kind)
            row = {"shape": shape, "kind": kind, "file_bytes": path.stat().st_size}
            row.update(side_by_side(path, a.threads, tg, 1 if shape == "9B" else a.repeats, f"sizes {shape} {kind}",
                                    run_rss=True))
            results["rows"].append(row)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    md = write_report(results, out)
    print(md.read_text())


def write_report(r: dict, out: Path) -> Path:
    lines = [f"# deltaserve bench sizes ({r['date']})", "", f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}, {r['threads']} threads. Random weights of the real Qwen3.5 shapes; each engine in a "
             f"fresh process per file: load, a {r['pp']}-token prefill, {r['tg']} decoded tokens; peak RSS is that "
             f"process's VmHWM; the file is read through before each run (both engines find it in the page cache). Load is the time to read the file into a model, each engine's Python modules imported "
             f"before the clock (torch's ~1 s import and llama_cpp's are in neither). llama.cpp: llama-cpp-python on a libllama built here with "
             f"{r.get('llama.cpp_flags') or 'the installed flags'}.", "",
             f"`run` peak RSS: a fresh process that runs a {r['tg']}-token chat answer to a short prompt as a user does "
             "(`deltaserve run FILE -p ...`; llama.cpp: llama-cpp-python's chat completion, 512-position context), "
             "and what it holds beyond the file.", "",
             "| shape | file | size | engine | load s | pp tok/s | tg tok/s | peak RSS | RSS / file | `run` peak RSS | "
             "`run` - file | load / llama | pp / llama | tg / llama |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        ref = row["llama.cpp"]
        for engine in ("llama.cpp", "deltaserve"):
            m = row[engine]
            lines.append(f"| {row['shape']} | {row['kind']} | {row['file_bytes'] / 2**20:.0f} MiB | {engine} | "
                         f"{m['load_s']:.2f} | {m['pp']:.1f} | {m['tg']:.2f} | {m['peak_rss'] / 2**20:.0f} MiB | "
                         f"{m['peak_rss'] / row['file_bytes']:.2f}x | {m['run_rss'] / 2**20:.0f} MiB | "
                         f"{(m['run_rss'] - row['file_bytes']) / 2**20:+.0f} MiB | {m['load_s'] / ref['load_s']:.2f}x | "
                         f"{m['pp'] / ref['pp']:.2f}x | {m['tg'] / ref['tg']:.2f}x |")
    routes = {run.get("route") for row in r["rows"] for run in row["deltaserve"]["runs"]} - {None}
    lines += ["", "deltaserve's route line(s):", ""] + [f"- `{x}`" for x in sorted(routes)]
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md
