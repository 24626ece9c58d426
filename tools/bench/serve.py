"""`deltaserve bench serve`: the server under several users, against llama-server on the same files (issue 52).

On the random Qwen3.5-0.8B shape in Q8_0 and Q4_K_M (tools/bench/models.py), `deltaserve serve --slots 8` against
`llama-server -np 8 -c 65536` (llama.cpp built as `bench` builds it: this CPU's widest vector flags), the same
thread count (`--threads`, default 2), each server in a process of its own, one at a time:

- **Streams**: 1, 2, 4 and 8 clients at once, each streaming `/v1/completions` of its own 40-token prompt (token
  ids) for `STREAM_TOKENS` tokens. Tokens per second in all are counted over the window in which every stream is
  decoding (from the last stream's first token to the first stream's last token), from the clients' own arrival
  times of the streamed tokens.
- **A long prompt among streams**: one client streams a long answer; once it has 10 tokens, a second client sends a
  `LONG`-token prompt. Measured: the first client's longest gap between two tokens while the long prompt prefills (its
  send to its first token), and the long prompt's time to first token, against the same prompt's time to first
  token with no other client (a prompt of other tokens each time: nothing is reused).
- **One stream, in-process**: in a fresh process, `deltaserve.load(...).generate` (a one-call session: the issue's
  measure) and the bare forward's pp512 and decode (tools/bench/peers.py's), to compare a stream through the
  server with the engine called directly.

Each round runs both servers on both files; `--repeats` rounds, medians reported, every run kept in the JSON.
Written under --out: serve.json, serve.md, serve.png.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from tools.bench.models import model_file
from tools.bench.peers import (_cpu_name, _free_port, in_fresh_process, llama_server_binary,
                               serving, use_best_llama)

FILES = ("q8_0", "Q4_K_M")
STREAMS = (1, 2, 4, 8)
STREAM_TOKENS = 96
PROMPT_TOKENS = 40
LONG = 3500
SLOTS = 8


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ids(seed: int, n: int, vocab: int = 240000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _body(engine: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if engine == "llama-server":
        body["ignore_eos"] = True  # a random model's end-of-text would end a stream early
    return body


class Stream:
    """One streamed completion on a thread of its own: the arrival time of each token."""

    def __init__(self, url: str, engine: str, prompt: list[int], max_tokens: int):
        self.url, self.body = url, _body(engine, prompt, max_tokens)
        self.times: list[float] = []
        self.sent = 0.0
        self.stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.thread.start()
        return self

    def _run(self) -> None:
        import httpx

        self.sent = time.perf_counter()
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=900) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    ev = json.loads(line[5:])
                    for ch in ev.get("choices", []):
                        if ch.get("text"):
                            self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - said in the results
            self.error = f"{type(e).__name__}: {e}"

    def join(self) -> "Stream":
        self.thread.join()
        return self


def streams(url: str, engine: str, n: int, seed: int) -> dict:
    barrier = threading.Barrier(n)
    runs = [Stream(url, engine, _ids(seed + k, PROMPT_TOKENS), STREAM_TOKENS) for k in range(n)]

    def go(s):
        barrier.wait()
        s._run()

    threads = [threading.Thread(target=go, args=(s,)) for s in runs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    errors = [s.error for s in runs if s.error]
    if errors or any(len(s.times) < 2 for s in runs):
        return {"streams": n, "error": errors[0] if errors else "a stream ended without tokens"}
    lo, hi = max(s.times[0] for s in runs), min(s.times[-1] for s in runs)
    inside = sum(sum(1 for t in s.times if lo < t <= hi) for s in runs)
    return {"streams": n, "tok_s": inside / (hi - lo) if hi > lo else None,
            "tokens": [len(s.times) for s in runs], "window_s": hi - lo}


def long_prompt(url: str, engine: str, seed: int, with_stream: bool) -> dict:
    other = None
    if with_stream:
        other = Stream(url, engine, _ids(seed + 1, PROMPT_TOKENS), 4000).start()
        deadline = time.time() + 120
        while len(other.times) < 10 and time.time() < deadline and other.error is None:
            time.sleep(0.01)
    long = Stream(url, engine, _ids(seed, LONG), 4).start()
    while not long.times and long.thread.is_alive():
        time.sleep(0.005)
    first = long.times[0] if long.times else None
    long.join()
    out = {"ttft_s": first - long.sent if first else None, "error": long.error}
    if other is not None:
        other.stop.set()
        inside = [t for t in other.times if long.sent <= t <= (first or long.sent)]
        before = [t for t in other.times if t < long.sent][-1:]
        after = [t for t in other.times if first and t > first][:1]
        marks = before + inside + after
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        out.update(max_gap_s=max(gaps) if gaps else None, tokens_during=len(inside),
                   median_gap_s=median([b - a for a, b in zip(other.times[:10], other.times[1:10])]))
        other.join()
    return out


def deltaserve_generate(path: Path, threads: int, repeats: int = 3) -> dict:
    """One stream in-process as the issue measures it: `deltaserve.load(path).generate(...)` (a one-call session:
    sampling and detokenizing included), the decode's tokens per second, the median of `repeats` turns of a prompt
    of PROMPT_TOKENS ids and STREAM_TOKENS tokens (run in a fresh process: tools/bench/peers.in_fresh_process)."""
    import deltaserve

    m = deltaserve.load(path, threads=threads)
    rates = []
    for r in range(repeats + 1):
        turn = m.generate(_ids(500 + r, PROMPT_TOKENS), max_tokens=STREAM_TOKENS, stop=[])
        if r:  # the first turn pays one-time costs
            rates.append(turn.decode_tok_s)
    return {"tg": median(rates), "tg_runs": rates}


def serve_cmd(engine: str, path: Path, port: int, threads: int) -> list[str]:
    if engine == "deltaserve":
        return [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(path), "--port", str(port), "--slots",
                str(SLOTS), "--threads", str(threads), "--device", "cpu", "--ctx", "8192", "--prefill-log", "off"]
    return [str(llama_server_binary()), "-m", str(path), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-c", str(SLOTS * 8192), "-np", str(SLOTS), "--no-warmup"]


def route_line(url: str) -> str | None:
    import httpx

    try:
        health = httpx.get(url + "/health", timeout=10).json()
    except Exception:  # noqa: BLE001
        return None
    notes = [n for s in health.get("slots", [])[:1] for n in s.get("notices", []) if n.startswith("Backend:")]
    return notes[0] if notes else None


def one_server(engine: str, path: Path, threads: int, seed: int) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(serve_cmd(engine, path, port, threads), url):
        streams(url, engine, 1, seed + 999)  # warm: the first forwards pay one-time costs
        out = {"streams": [streams(url, engine, n, seed + 100 * n) for n in STREAMS],
               "long_alone": long_prompt(url, engine, seed + 7, False),
               "long_with_stream": long_prompt(url, engine, seed + 11, True)}
        if engine == "deltaserve":
            out["route"] = route_line(url)
    return out


def summarize(runs: list[dict]) -> dict:
    s = {"streams": {}}
    for n in STREAMS:
        s["streams"][n] = median([next((x.get("tok_s") for x in r["streams"] if x["streams"] == n), None)
                                  for r in runs])
    s["long_alone_ttft_s"] = median([r["long_alone"]["ttft_s"] for r in runs])
    s["long_ttft_s"] = median([r["long_with_stream"]["ttft_s"] for r in runs])
    s["max_gap_s"] = median([r["long_with_stream"].get("max_gap_s") for r in runs])
    return s


def main(a) -> None:
    repeats = max(1, a.repeats)
    threads = a.threads or 2
    best = use_best_llama()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name(), "threads": threads, "repeats": repeats,
              "command": a.command_line, "llama_cpp_flags": best, "long_tokens": LONG, "stream_tokens": STREAM_TOKENS,
              "slots": SLOTS, "files": {}}
    paths = {kind: model_file("0.8B", kind) for kind in FILES}
    for kind in FILES:
        result["files"][kind] = {"deltaserve": {"runs": []}, "llama-server": {"runs": []}, "in_process": [],
                                 "in_process_generate": []}
    for rnd in range(repeats):
        for kind in FILES:
            path = paths[kind]
            entry = result["files"][kind]
            entry["in_process"].append(in_fresh_process("deltaserve_pp_tg", path, threads, 1, 64))
            entry["in_process_generate"].append(in_fresh_process("deltaserve_generate", path, threads,
                                                                 module="tools.bench.serve"))
            for engine in ("deltaserve", "llama-server"):
                print(f"[bench] serve: round {rnd + 1}/{repeats}, {kind}, {engine}", file=sys.stderr, flush=True)
                entry[engine]["runs"].append(one_server(engine, path, threads, seed=1000 * rnd + 17))
    for kind in FILES:
        entry = result["files"][kind]
        for engine in ("deltaserve", "llama-server"):
            entry[engine]["summary"] = summarize(entry[engine]["runs"])
        entry["in_process_tg"] = median([r["tg"] for r in entry["in_process"]])
        entry["in_process_pp512"] = median([r["pp512"] for r in entry["in_process"]])
        entry["in_process_generate_tg"] = median([r["tg"] for r in entry["in_process_generate"]])
    out = Path(a.out)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    md = report(result, out)
    print(md.read_text())


def _x(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def report(r: dict, out: Path) -> Path:
    lines = [f"# deltaserve serve under several users ({r['date']})", "",
             f"Command: `{r['command']}`  ", f"CPU: {r['cpu']}, {r['threads']} threads; {r['repeats']} round(s), "
             f"medians. Random weights of the Qwen3.5-0.8B shape. deltaserve `serve --slots {r['slots']}`, "
             f"llama-server `-np {r['slots']} -c {r['slots'] * 8192}` ({r['llama_cpp_flags']}).", ""]
    for kind, e in r["files"].items():
        d, l = e["deltaserve"]["summary"], e["llama-server"]["summary"]
        one = d["streams"].get(1) or d["streams"].get("1")
        lines += [f"## {kind}", "", "| streams | deltaserve tok/s | llama-server tok/s | ratio | deltaserve vs its one "
                  "stream |", "|---|---|---|---|---|"]
        for n in STREAMS:
            dn, ln = d["streams"].get(n) or d["streams"].get(str(n)), l["streams"].get(n) or l["streams"].get(str(n))
            lines.append(f"| {n} | {dn or 0:.1f} | {ln or 0:.1f} | {_x(dn, ln)} | {_x(dn, one)} |")
        gen = e.get("in_process_generate_tg")
        lines += ["", f"One stream through the server: {one or 0:.1f} tok/s; in-process, the same file: "
                      f"`deltaserve.load(...).generate` {gen or 0:.1f} tok/s ({_x(one, gen)}), the bare forward's "
                      f"decode after pp512 {e['in_process_tg']:.1f} tok/s ({_x(one, e['in_process_tg'])}); in-process "
                      f"pp512 {e['in_process_pp512']:.1f} tok/s.", "",
                  f"A {r['long_tokens']}-token prompt while another client streams: | engine | longest gap of the "
                  "streaming client (s) | the long prompt's TTFT (s) | alone (s) | ratio |", "|---|---|---|---|---|"]
        for name, s in (("deltaserve", d), ("llama-server", l)):
            lines.append(f"| {name} | {s['max_gap_s'] or 0:.2f} | {s['long_ttft_s'] or 0:.2f} | "
                         f"{s['long_alone_ttft_s'] or 0:.2f} | {_x(s['long_ttft_s'], s['long_alone_ttft_s'])} |")
        routes = {run.get("route") for run in e["deltaserve"]["runs"]} - {None}
        lines += ["", "deltaserve's route line: " + "; ".join(f"`{x}`" for x in sorted(routes)), ""]
    md = out / "serve.md"
    md.write_text("\n".join(lines) + "\n")
    try:
        chart(r, out / "serve.png")
    except Exception as e:  # noqa: BLE001 - the numbers stand without their picture
        print(f"[bench] serve: no chart ({type(e).__name__}: {e})", file=sys.stderr)
    return md


def chart(r: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(r["files"]), figsize=(5 * len(r["files"]), 3.6), squeeze=False)
    for ax, (kind, e) in zip(axes[0], r["files"].items()):
        for name in ("deltaserve", "llama-server"):
            s = e[name]["summary"]["streams"]
            ax.plot(list(STREAMS), [s.get(n) or s.get(str(n)) or 0 for n in STREAMS], marker="o", label=name)
        ax.set_title(f"0.8B {kind}: decode tok/s in all")
        ax.set_xlabel("streams at once")
        ax.set_xticks(list(STREAMS))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
