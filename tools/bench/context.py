"""`deltaserve bench context`: long contexts (issue 58). Prefill of prompts of each depth and decode (TG tokens) at
that depth, deltaserve in its KV cache types against llama.cpp's `llama-bench` on the same file (its default f16
cache, and q8_0 keys and values, which need its flash attention on), with the decode's bound at each depth: the bytes
a token reads divided by the plain-read bandwidth measured in the same run.

deltaserve runs as a user runs it (`deltaserve.load(path, kv_type=...)`, a resident session, greedy), one fresh
process per KV type, the depths in increasing order: a turn whose prompt is DEPTH tokens gives the prefill's
tokens/s, and its TG+1 generated tokens the decode's at that depth (TG steps fed); the process's VmHWM after a
depth's turns is that depth's peak RSS. llama.cpp runs as llama-bench measures it: `-p DEPTH -n 0` for prefill
(--no-warmup: its warmup would prefill the whole prompt once more), `-p 0 -n TG -d DEPTH` for decode at depth, built
as `bench` builds llama.cpp (peers.py: this CPU's widest vector flags, never AMX).

The bytes a decoded token reads: the weights as the file holds them (the token embedding left out where the file has
its own output matrix: a token reads one row of it), the DeltaNet layers' recurrent and conv state (f32), and the
attention layers' keys and values at the decoded tokens' mean position (depth + TG/2) in the cache's type
(engine/state.py's kv_position_bytes). The bound is the median plain-read bandwidth (a 1 GiB tensor summed, several
times, before and after the runs) divided by those bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from deltaserve.errors import DeltaserveError
from tools.bench.peers import _cpu_name, in_fresh_process, lscpu, median
from tools.bench.sizes import _peak_rss

TG = 32
DEFAULT_DEPTHS = "4096,16384"
DEFAULT_KV = "f32,f16"
DEFAULT_LLAMA_KV = "f16,q8_0"
LLAMA_KV = ("f16", "q8_0")
READ_GIB = 1.0
READ_REPS = 7


# -- the flags ------------------------------------------------------------------------------------------------------

def parse_list(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def parse_depths(text: str) -> list[int]:
    """--depths: positive token counts (4096, 16K and 4k alike), in increasing order, each once."""
    out = []
    for item in parse_list(text):
        scale = 1024 if item[-1] in "kK" else 1
        try:
            n = int(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise DeltaserveError(f"--depths: {item!r} is not a token count (e.g. 4096,16384 or 4K,16K)") from None
        if n < 1:
            raise DeltaserveError(f"--depths: {item!r} is not a positive token count")
        out.append(n)
    if not out:
        raise DeltaserveError("--depths: no depth given (e.g. 4096,16384)")
    return sorted(set(out))


def parse_kv_types(text: str) -> list[str]:
    """--kv-type: deltaserve's KV cache types to run, each one built (engine/state.py refuses the others)."""
    from deltaserve.engine.state import kv_torch_dtype

    kinds = list(dict.fromkeys(parse_list(text)))
    if not kinds:
        raise DeltaserveError("--kv-type: no KV cache type given (e.g. f32,f16)")
    for k in kinds:
        kv_torch_dtype(k)  # one line naming the types that exist, or those built
    return kinds


def parse_llama_kv(text: str | None) -> list[str]:
    """--llama-kv-type: llama.cpp's cache types to run (f16, q8_0); "none" (or empty) runs no llama.cpp."""
    kinds = [] if text is None or text.strip().lower() == "none" else list(dict.fromkeys(parse_list(text)))
    unknown = [k for k in kinds if k not in LLAMA_KV]
    if unknown:
        raise DeltaserveError(f"--llama-kv-type: {', '.join(unknown)} not among {', '.join(LLAMA_KV)} (or none)")
    return kinds


# -- what a token reads -------------------------------------------------------------------------------------------

def token_bytes_plan(path: Path) -> dict:
    """The file's side of a decoded token's bytes: the weights it reads as the file holds them, the recurrent state,
    the KV bytes of one position per cache type; the declared context."""
    from deltaserve.engine.state import KV_TYPES, kv_position_bytes
    from deltaserve.formats.config import HybridConfig
    from deltaserve.formats.gguf import read_gguf

    f = read_gguf(path)
    tied = "output.weight" not in f.tensors
    config = HybridConfig.from_gguf(f.metadata, f.tensors["token_embd.weight"].shape[0], tied=tied)
    # the token embedding is the output matrix of a tied file (read whole by every token); else one row of it
    weights = sum(t.nbytes for name, t in f.tensors.items()
                  if not (name == "token_embd.weight" and not tied) and "nextn." not in name)
    return {"path": str(path), "file_bytes": f.disk_bytes, "weights_read_bytes": weights, "tied_embeddings": tied,
            "recurrent_state_bytes": config.recurrent_state_bytes(), "context_length": config.context_length,
            "kv_position_bytes": {t: kv_position_bytes(config, t) for t in KV_TYPES}}


def token_bytes(plan: dict, kv_type: str, depth: int, tg: int = TG) -> float:
    """The bytes a decoded token reads at `depth` with a cache of `kv_type`: the weights, the recurrent state, and the
    keys and values of the decoded tokens' mean position (depth + tg/2)."""
    return (plan["weights_read_bytes"] + plan["recurrent_state_bytes"]
            + plan["kv_position_bytes"][kv_type] * (depth + tg / 2))


def read_bandwidth_runs(threads: int, gib: float | None = None, reps: int = READ_REPS) -> list[float]:
    """Bytes/s of a plain read: a large f32 tensor (READ_GIB) summed `reps` times (after one untimed pass), each
    run's rate."""
    import torch

    gib = READ_GIB if gib is None else gib
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        runs.append(x.numel() * 4 / (time.perf_counter() - t0))
    del x
    return runs


def cpu_line() -> str:
    """lscpu's model name, cores and threads per core (the /proc/cpuinfo name where lscpu is missing)."""
    info = lscpu()
    if not info:
        return _cpu_name()
    name = info.get("Model name") or _cpu_name()
    parts = [f"{info['CPU(s)']} CPUs" if "CPU(s)" in info else None,
             f"{info['Thread(s) per core']} thread(s) per core" if "Thread(s) per core" in info else None,
             f"L3 {info['L3 cache']}" if "L3 cache" in info else None]
    return name + "".join(f", {p}" for p in parts if p)


# -- deltaserve -----------------------------------------------------------------------------------------------------

def prompt_ids(vocab: int, n: int, specials: set[int]) -> list[int]:
    """`n` token ids, the same for every run: seeded, below min(200000, vocab), no added or stop token (a turn's prompt
    may not open a thought or end itself)."""
    import torch

    g = torch.Generator().manual_seed(58)
    top = min(200000, vocab)
    ids = [t for t in torch.randint(0, top, (n + n // 8 + 64,), generator=g).tolist() if t not in specials]
    while len(ids) < n:
        ids += [t for t in torch.randint(0, top, (n,), generator=g).tolist() if t not in specials]
    return ids[:n]


def deltaserve_depths(path: Path, threads: int, kv_type: str, depths: list[int], tg: int, repeats: int) -> dict:
    """In a process of its own, the model loaded with `kv_type`: for each depth (increasing), `repeats` turns of a
    `depth`-token prompt and tg+1 greedy tokens, each on a fresh resident session (after one untimed 64-token turn);
    the process's peak RSS after each depth's turns (the peak of that depth's turns: the depths run in increasing
    order, each larger than the last)."""
    import torch

    import deltaserve
    from deltaserve.kernels import native

    torch.set_num_threads(threads)
    native.library()  # built (or found built) before any clock
    m = deltaserve.load(path, threads=threads, kv_type=kv_type, cache=False)
    tok = m.host.tokenizer
    specials = set(tok.added_ids) | set(tok.stop_ids)
    ids = prompt_ids(m.config.vocab_size, max(depths), specials)
    m.session(quiet=True, mtp=0).generate(ids[:64], max_tokens=2, stop=[])
    out: dict = {"depths": {}, "threads": torch.get_num_threads()}
    for depth in sorted(depths):
        runs = []
        for _ in range(repeats):
            s = m.session(quiet=True, mtp=0)
            s.stop_ids = frozenset()  # every turn decodes its tg+1 tokens, as llama-bench's generation does (a stop
            # token the random weights chose would end it early)
            out["notices"] = list(s.notices)
            turn = s.generate(ids[:depth], max_tokens=tg + 1, stop=[])
            runs.append({"prefill_tok_s": turn.prefill_tok_s, "decode_tok_s": turn.decode_tok_s,
                         "prefilled": turn.prefilled, "generated": turn.generated, "finish": turn.finish_reason})
            del s, turn
        out["depths"][str(depth)] = {"runs": runs, "peak_rss": _peak_rss()}
    out["route"] = out["notices"][-1] if out.get("notices") else None
    return out


# -- llama.cpp ------------------------------------------------------------------------------------------------------

def llama_bench_argv(binary: Path | str, path: Path, kv_type: str, depths: list[int], threads: int, repeats: int,
                     tg: int = TG) -> dict[str, list[str]]:
    """llama-bench's two command lines for one cache type: prefill of each depth (`-p D -n 0`; no warmup run, which
    would prefill the whole prompt once more) and decode of `tg` tokens at each depth (`-p 0 -n TG -d D`). q8_0 keys
    and values need its flash attention on (`-fa 1`); f16 is its default cache, run with its default flags."""
    common = [str(binary), "-m", str(path), "-t", str(threads), "-r", str(max(1, repeats)), "-o", "json"]
    if kv_type == "q8_0":
        common += ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]
    elif kv_type != "f16":
        raise DeltaserveError(f"llama.cpp's cache types here: {', '.join(LLAMA_KV)}, not {kv_type}")
    ds = ",".join(str(d) for d in depths)
    return {"prefill": common + ["-p", ds, "-n", "0", "--no-warmup"],
            "decode": common + ["-p", "0", "-n", str(tg), "-d", ds]}


def run_llama_bench(argv: list[str], every: float = 0.2) -> tuple[list[dict], int | None]:
    """llama-bench's JSON records of one command line, and the peak RSS of its process: its VmHWM, read every
    `every` seconds while it runs (the last reading; None if it ended before one). Not wait4's ru_maxrss: Linux
    counts in it the high-water mark of the memory the child had before its exec, this larger process's."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        peak = None
        while True:  # the first reading a moment after the start: by then it runs llama-bench, exec'd
            try:
                proc.wait(timeout=every)
                break
            except subprocess.TimeoutExpired:
                pass
            try:
                with open(f"/proc/{proc.pid}/status") as fh:
                    peak = next((int(x.split()[1]) * 1024 for x in fh if x.startswith("VmHWM:")), peak)
            except OSError:
                pass
        out.seek(0), err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {' '.join(argv)}\n{errors[-800:]}")
    return json.loads(text[text.index("["):]), peak


def llama_rows(records: list[dict], kv_type: str, plan: dict, bandwidth: float, peak_rss: dict[str, int]) -> list[dict]:
    """One row per depth from llama-bench's records of one cache type (its prefill and its decode command)."""
    rows: dict[int, dict] = {}
    for rec in records:
        prefill = rec["n_gen"] == 0
        depth = rec["n_prompt"] if prefill else rec["n_depth"]
        row = rows.setdefault(depth, {"engine": "llama.cpp", "kv_type": kv_type, "depth": depth,
                                      "flash_attn": rec.get("flash_attn"), "threads": rec.get("n_threads")})
        key = "prefill" if prefill else "decode"
        row[f"{key}_tok_s"] = rec["avg_ts"]
        row[f"{key}_runs"] = rec.get("samples_ts", [rec["avg_ts"]])
        row[f"{key}_peak_rss"] = peak_rss.get(key)
        row["type_k"], row["type_v"] = rec.get("type_k"), rec.get("type_v")
    return [with_bound(rows[d], plan, bandwidth) for d in sorted(rows)]


def with_bound(row: dict, plan: dict, bandwidth: float, tg: int = TG) -> dict:
    """The row with the bytes its decoded token reads, the bound they and the bandwidth put on decode, and the
    measured decode's fraction of it."""
    row["token_bytes"] = token_bytes(plan, row["kv_type"], row["depth"], tg)
    row["bound_tok_s"] = bandwidth / row["token_bytes"]
    if row.get("decode_tok_s") is not None:
        row["decode_over_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
    return row


# -- the run --------------------------------------------------------------------------------------------------------

def default_model() -> Path:
    from tools.bench.models import model_file

    return model_file("0.8B", "q8_0")


def flags(a) -> tuple[list[int], list[str], list[str], Path, dict]:
    """The run's depths, deltaserve's and llama.cpp's cache types, the file and its bytes plan, from the flags: each
    refused in one line (before any directory is made or anything runs)."""
    depths = parse_depths(getattr(a, "depths", None) or DEFAULT_DEPTHS)
    kinds = parse_kv_types(getattr(a, "kv_type", None) or DEFAULT_KV)
    llama_kinds = parse_llama_kv(getattr(a, "llama_kv_type", DEFAULT_LLAMA_KV))
    path = Path(getattr(a, "model", None) or default_model())
    if not path.is_file():
        raise DeltaserveError(f"--model {path}: not a file (the GGUF file both engines run)")
    plan = token_bytes_plan(path)
    longest = depths[-1] + TG + 1
    if longest > plan["context_length"]:
        raise DeltaserveError(f"--depths: a depth of {depths[-1]} and {TG + 1} generated tokens need {longest} "
                              f"positions; {path.name} declares {plan['context_length']}")
    return depths, kinds, llama_kinds, path, plan


def main(a) -> Path:
    """The bench: results.json, RESULTS.md and results.png under --out; the markdown's path."""
    from tools.bench.peers import _llama_built, use_best_llama
    from tools.bench.report import chart
    from tools.bench.sizes import warm_page_cache

    depths, kinds, llama_kinds, path, plan = flags(a)
    threads, repeats = a.threads, max(1, a.repeats)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"bench": "context", "command": a.command_line, "cpu": cpu_line(), "threads": threads,
                     "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M"), "tg": TG, "depths": depths,
                     "model": plan, "rows": [], "skipped": {}}
    print(f"[bench] context: read bandwidth ({READ_GIB:g} GiB, {READ_REPS} reps)", file=sys.stderr, flush=True)
    bw_runs = read_bandwidth_runs(threads)
    ds_rows: list[dict] = []

    def save(complete: bool) -> Path:
        """results.json and RESULTS.md of what has run so far (after each engine's runs: a run cut short keeps what
        it measured, marked incomplete), the bounds from the bandwidth read so far; the chart once complete."""
        bw = median(bw_runs)
        results["read_bandwidth"] = {"median": bw, "runs": list(bw_runs), "gib": READ_GIB}
        results["rows"] = [with_bound(dict(row), plan, bw) for row in ds_rows]
        for rec in results.get("llama_records", []):
            results["rows"] += llama_rows(rec["records"], rec["kv_type"], plan, bw, rec["peak_rss"])
        results["complete"] = complete
        (out / "results.json").write_text(json.dumps(results, indent=1))
        md = write_report(results, out)
        if complete:  # (a run cut short: `charts` of report.py draws its chart from the JSON it left)
            chart(out / "results.json")
        return md

    for kv in kinds:
        print(f"[bench] context: deltaserve, {kv} cache, depths {', '.join(map(str, depths))}", file=sys.stderr,
              flush=True)
        warm_page_cache(path)
        got = in_fresh_process("deltaserve_depths", path, threads, kv, depths, TG, repeats,
                               module="tools.bench.context")
        for depth in depths:
            d = got["depths"][str(depth)]
            runs = d["runs"]
            ds_rows.append({"engine": "deltaserve", "kv_type": kv, "depth": depth,
                            "prefill_tok_s": median([r["prefill_tok_s"] for r in runs]),
                            "decode_tok_s": median([r["decode_tok_s"] for r in runs]),
                            "prefill_runs": [r["prefill_tok_s"] for r in runs],
                            "decode_runs": [r["decode_tok_s"] for r in runs], "turns": runs,
                            "peak_rss": d["peak_rss"], "route": got["route"], "threads": got["threads"]})
        save(False)
    if llama_kinds:
        results["llama.cpp_flags"] = use_best_llama()
        binary = _llama_built("llama-bench", shared=False, product="llama-bench")
        results["llama.cpp_commands"] = {}
        results["llama_records"] = []
        for kv in llama_kinds:
            records, peaks = [], {}
            for key, argv in llama_bench_argv(binary, path, kv, depths, threads, repeats).items():
                print(f"[bench] context: llama-bench, {kv} cache, {key}", file=sys.stderr, flush=True)
                warm_page_cache(path)
                got, peaks[key] = run_llama_bench(argv)
                records += got
                results["llama.cpp_commands"][f"{kv} {key}"] = " ".join(argv)
            results["llama_records"].append({"kv_type": kv, "records": records, "peak_rss": peaks})
            save(False)
    else:
        results["skipped"]["llama.cpp"] = "--llama-kv-type none"
    bw_runs += read_bandwidth_runs(threads)  # the machine's bandwidth moves: measured again after the runs
    md = save(True)
    print(md.read_text())
    return md


def write_report(r: dict, out: Path) -> Path:
    m = r["model"]
    bw = r["read_bandwidth"]
    llama = (f"llama.cpp: llama-bench (`-p DEPTH -n 0 --no-warmup`; `-p 0 -n {r['tg']} -d DEPTH`), built with "
             f"{r.get('llama.cpp_flags')}; peak RSS of its decode process (all depths)."
             if r.get("llama.cpp_commands") else "")
    lines = [f"# deltaserve bench context ({r['date']})", "", f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}; {r['threads']} threads; medians of {r['repeats']} run(s). File: "
             f"`{Path(m['path']).name}` ({m['file_bytes'] / 2**20:.0f} MiB). deltaserve: a fresh process per KV "
             f"type (the depths in increasing order), a resident session's turn of a DEPTH-token prompt and "
             f"{r['tg'] + 1} greedy tokens (prefill tok/s, and decode of {r['tg']} steps at that depth); peak RSS is "
             f"that process's VmHWM after the depth's turns. {llama}", "",
             f"The bound: the plain-read bandwidth, {bw['median'] / 1e9:.1f} GB/s (median of {len(bw['runs'])} "
             f"reads of a {bw['gib']:g} GiB tensor before and after the runs, {min(bw['runs']) / 1e9:.1f}-"
             f"{max(bw['runs']) / 1e9:.1f}), over the bytes a decoded token reads: the weights as the file holds them "
             f"({m['weights_read_bytes'] / 2**20:.0f} MiB), the recurrent state "
             f"({m['recurrent_state_bytes'] / 2**20:.1f} MiB) and the keys and values at depth + {r['tg'] // 2} ("
             + ", ".join(f"{t} {b / 1024:.1f} KiB" for t, b in m["kv_position_bytes"].items()) + " a position).", "",
             "| engine | KV cache | depth | prefill tok/s | decode tok/s | bound tok/s | decode / bound | "
             "a token reads | peak RSS |", "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        rss = row.get("peak_rss") or row.get("decode_peak_rss")
        lines.append(f"| {row['engine']} | {row['kv_type']} | {row['depth']} | {_f(row.get('prefill_tok_s'))} | "
                     f"{_f(row.get('decode_tok_s'), 2)} | {row['bound_tok_s']:.2f} | "
                     f"{_f(row.get('decode_over_bound'), 2)} | {row['token_bytes'] / 2**20:.0f} MiB | "
                     f"{f'{rss / 2**20:.0f} MiB' if rss else '-'} |")
    if not r.get("complete", True):
        lines += ["", "**Incomplete**: written after each engine's runs, and the run went no further; the bound from "
                      "the bandwidth read before the runs alone."]
    for engine, why in r.get("skipped", {}).items():
        lines += ["", f"{engine}: not run ({why})."]
    routes = {row.get("route") for row in r["rows"]} - {None}
    lines += ["", "deltaserve's route line(s):", ""] + [f"- `{x}`" for x in sorted(routes)]
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
