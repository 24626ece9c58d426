"""`deltaserve bench replicas`: 1 against 2 replicas on Ray Serve, one thread each, and how well the routing keeps
each conversation where its state is.

The random Qwen3.5-0.8B shape (Q8_0, the real vocabulary and template). Each configuration is `deltaserve serve
MODEL --replicas N --threads 1 --slots 2` on a local Ray instance (the replicas share a fresh --state-dir), and, as
a reference, one plain `deltaserve serve --threads T` without Ray (T = the cores 2 replicas take together). The same
conversations go to each (`CONVERSATIONS`, each with its own ~300-token system message and 60-90-word user turns,
`TURNS` turns, max_tokens `MAX_TOKENS`, temperature 0, thinking off), one client thread per conversation sending its
next turn when its previous answer is in, all started at once after one warm-up request per replica. Measured:

- aggregate decode throughput: the tokens generated over the run's wall time (what the endpoint delivers), and the
  median of each request's own decode rate (tokens after the first over the time after its first token, while the
  others run);
- time to first streamed token: median over every request, and over follow-up turns only;
- the routing's hit rate: follow-up turns whose `cached_tokens` is a full hit (the conversation's previous prompt
  less its 7-token generation header), and the router's own count of requests sent to the replica their saved
  prefix went to (`/health` router.routed).

Written to benchmarks/replicas/replicas.{md,json}. `--quick`: 4 conversations of 3 turns. About 6 minutes on 2
cores.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.bench.conversations import HEADER, first_messages, follow_up_hits, user_text

CONVERSATIONS = 8
TURNS = 4
MAX_TOKENS = 32
SLOTS = 2


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


class Endpoint:
    """`deltaserve serve` (with `replicas`: on Ray Serve) in a session of its own, on a free port."""

    def __init__(self, path: Path, replicas: int | None, threads: int, log: Path, state_dir: str):
        from tools.bench.peers import _free_port

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(path), "--port", str(port), "--slots",
               str(SLOTS), "--threads", str(threads), "--device", "cpu", "--ctx", "4096", "--state-ram", "2G",
               "--state-dir", state_dir]
        if replicas:
            cmd += ["--replicas", str(replicas)]
        self._log = open(log, "ab")
        self._log.write(f"\n$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, start_new_session=True)
        t0 = time.perf_counter()
        self._wait(600)
        self.startup_s = time.perf_counter() - t0

    def _wait(self, seconds: float) -> None:
        import httpx

        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see its log")
            try:
                r = httpx.get(self.url + "/health", timeout=10)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not come up in {seconds:.0f} s")

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=60).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its Ray instance
        except ProcessLookupError:
            pass
        self._log.close()


def stream(url: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed chat request: time to its first token, the whole time, the answer and its usage."""
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    t0 = time.perf_counter()
    first, text, usage, replica = None, "", {}, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
        replica = r.headers.get("x-deltaserve-replica")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("error"):
                raise RuntimeError(f"{url}: the stream ended with an error: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text += piece
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "total_s": total, "text": text,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "replica": int(replica) if replica is not None else None}


def drive(url: str, convs: list[int], turns: int) -> tuple[list[dict], float]:
    """Every conversation on its own client thread, all at once; rows of every request, and the wall time."""
    rows: list[dict] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(convs))

    def client(c: int) -> None:
        try:
            messages = first_messages(c)
            barrier.wait()
            for k in range(1, turns + 1):
                messages.append({"role": "user", "content": user_text(c, k)})
                t = time.perf_counter()
                r = stream(url, messages, MAX_TOKENS)
                r["decode_tok_s"] = _decode_rate(r)
                messages.append({"role": "assistant", "content": r["text"]})
                with lock:
                    rows.append(dict(r, conversation=c, turn=k, started=t))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in convs]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sorted(rows, key=lambda r: (r["turn"], r["conversation"])), wall


def _decode_rate(r: dict) -> float | None:
    """The tokens after the first over the time after the first (the stream's own decode speed)."""
    n = r.get("completion_tokens")
    span = r["total_s"] - r["ttft_s"]
    return (n - 1) / span if n and n > 1 and span > 0 else None


def run_one(label: str, path: Path, replicas: int | None, threads: int, convs: list[int], turns: int,
            log: Path) -> dict:
    print(f"[bench] replicas: {label}", file=sys.stderr)
    state_dir = tempfile.mkdtemp(prefix="deltaserve-bench-replicas-")
    ep = Endpoint(path, replicas, threads, log, state_dir)
    try:
        warm = [{"role": "user", "content": "Say hello to the river and the baker, please."}]
        for k in range(max(replicas or 1, 1) * 2):  # the first forward of each replica pays one-time costs
            stream(ep.url, [dict(warm[0], content=f"{warm[0]['content']} ({k})")], 4)
        before = ep.health()
        load0 = os.getloadavg()[0]
        rows, wall = drive(ep.url, convs, turns)
        after = ep.health()
        generated = sum(r["completion_tokens"] or 0 for r in rows)
        hits = follow_up_hits(rows)
        out = {"label": label, "replicas": replicas, "threads": threads, "startup_s": ep.startup_s, "wall_s": wall,
               "requests": len(rows), "generated_tokens": generated, "throughput_tok_s": generated / wall,
               "decode_tok_s_median": median([r["decode_tok_s"] for r in rows]),
               "ttft_median_s": median([r["ttft_s"] for r in rows]),
               "ttft_follow_up_median_s": median([r["ttft_s"] for r in rows if r["turn"] > 1]),
               "ttft_first_turn_median_s": median([r["ttft_s"] for r in rows if r["turn"] == 1]),
               "prompt_tokens_median": median([r["prompt_tokens"] for r in rows]),
               "hits": hits, "load_before": load0, "load_after": os.getloadavg()[0], "rows": rows}
        if replicas:
            routed = {k: v - before["router"]["routed"].get(k, 0) for k, v in after["router"]["routed"].items()}
            out["routed"] = {k: v for k, v in routed.items() if v}
            follow = hits["follow_up_turns"]
            out["router_prefix_share"] = prefix_share(routed, follow)
            out["per_replica"] = [{"replica": x["replica"], "threads": x.get("threads"), "requests":
                                   sum(s["requests"] for s in x.get("slots", [])),
                                   "restores_disk": x["store"]["restores"]["disk"],
                                   "restores_ram": x["store"]["restores"]["ram"]} for x in after["replicas"]]
        return out
    finally:
        ep.stop()
        import shutil

        shutil.rmtree(state_dir, ignore_errors=True)


def prefix_share(routed: dict, follow_ups: int) -> float:
    """The follow-up turns the router sent to the replica their saved prefix went to (with a free slot there, or
    with every replica full, where it waits for one of its own slots)."""
    hits = routed.get("prefix", 0) + routed.get("prefix (all full)", 0)
    return hits / follow_ups if follow_ups else float("nan")


def write_report(r: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(r, indent=1))
    lines = [f"# 1 against 2 replicas on Ray Serve ({r['date']})", "",
             f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']} ({r['cores']} cores). Random weights of the real Qwen3.5-0.8B shape (Q8_0, {r['file']}); "
             f"{r['conversations']} conversations of {r['turns']} turns at once (one client thread each), each with its "
             f"own ~300-token system message and 60-90-word user turns, max_tokens {MAX_TOKENS}, temperature 0, "
             f"thinking off; `--slots {SLOTS}` per server, streamed. Replicas: `deltaserve serve --replicas N --threads 1` "
             "on a local Ray instance, sharing one fresh --state-dir.", "",
             "The machine is shared with other engineers' tests and builds (load average in the table): the ratios "
             "are what to read, single figures move from run to run.", "",
             "| configuration | threads in all | tokens/s generated (all requests over the wall time) | decode tok/s of "
             "a request (median) | TTFT median, all (ms) | TTFT median, follow-ups (ms) | TTFT median, first turns "
             "(ms) | follow-ups with a full state hit | wall (s) | load avg before / after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in r["runs"]:
        h = e["hits"]
        total = e["threads"] * (e["replicas"] or 1)
        lines.append(f"| {e['label']} | {total} | {e['throughput_tok_s']:.1f} | {e['decode_tok_s_median']:.1f} | "
                     f"{e['ttft_median_s'] * 1000:.0f} | {e['ttft_follow_up_median_s'] * 1000:.0f} | "
                     f"{e['ttft_first_turn_median_s'] * 1000:.0f} | {h['full_hits']} of {h['follow_up_turns']} "
                     f"({h['hit_rate']:.0%}) | {e['wall_s']:.0f} | {e['load_before']:.1f} / {e['load_after']:.1f} |")
    one = next((e for e in r["runs"] if e["replicas"] == 1), None)
    two = next((e for e in r["runs"] if e["replicas"] == 2), None)
    lines.append("")
    if one and two:
        lines += [f"2 replicas against 1: **{two['throughput_tok_s'] / one['throughput_tok_s']:.2f}x** the tokens "
                  f"per second, median TTFT **{two['ttft_median_s'] / one['ttft_median_s']:.2f}x** (follow-ups "
                  f"{two['ttft_follow_up_median_s'] / one['ttft_follow_up_median_s']:.2f}x).", ""]
    for e in r["runs"]:
        if e.get("routed"):
            kept = e["routed"].get("prefix", 0) + e["routed"].get("prefix (all full)", 0)
            lines.append(f"- {e['label']}: the router sent {e['hits']['follow_up_turns']} follow-up turns; "
                         f"{kept} to the replica their saved prefix went to ({e['router_prefix_share']:.0%}; "
                         "'prefix (all full)': every replica's slots were busy, so it waited for one of its own); "
                         f"every route it took: {e['routed']}; per replica: "
                         + ", ".join(f"replica {x['replica']} {x['requests']} requests, {x['restores_disk']} restores "
                                     f"from disk, {x['restores_ram']} from RAM" for x in e["per_replica"]) + ".")
    lines += ["", "A full state hit: `cached_tokens` equal to the conversation's previous prompt less its "
              f"{HEADER}-token generation header (where the turn's checkpoint was taken). The first turns' TTFT is "
              "their whole prefill (~300-400 tokens); a follow-up's is its new suffix (~80-100 tokens) and its wait "
              "for a slot.", "", f"Run time: {r['wall_s'] / 60:.1f} min."]
    md = out / "replicas.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(a) -> None:
    from tools.bench.conversations import _cpu
    from tools.bench.models import CACHE, model_file
    from deltaserve.kernels.cpu import available_cores

    t0 = time.perf_counter()
    out = Path(a.out) / "replicas"
    path = model_file("0.8B", "q8_0")
    log = CACHE / "replicas-servers.log"
    log.write_bytes(b"")
    quick = getattr(a, "quick", False)
    n, turns = (4, 3) if quick else (CONVERSATIONS, TURNS)
    cores = available_cores()
    r: dict = {"command": a.command_line, "cpu": _cpu(), "cores": cores, "date": time.strftime("%Y-%m-%d %H:%M"),
               "file": path.name, "conversations": n, "turns": turns, "max_tokens": MAX_TOKENS, "runs": []}
    if threading.current_thread() is threading.main_thread():  # a SIGTERM stops the servers too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = [("1 replica, 1 thread", 1, 1), ("2 replicas, 1 thread each", 2, 1)]
    if not quick:
        plan.append((f"one plain deltaserve serve (no Ray), {min(cores, 2)} threads", None, min(cores, 2)))
    for i, (label, replicas, threads) in enumerate(plan):
        convs = list(range(2000 + 100 * i, 2000 + 100 * i + n))  # conversations of its own per run
        r["runs"].append(run_one(label, path, replicas, threads, convs, turns, log))
        e = r["runs"][-1]
        print(f"[bench]   {e['throughput_tok_s']:.1f} tok/s, TTFT median {e['ttft_median_s'] * 1000:.0f} ms, "
              f"{e['hits']['full_hits']} of {e['hits']['follow_up_turns']} full hits ({e['wall_s']:.0f} s)",
              file=sys.stderr)
        r["wall_s"] = time.perf_counter() - t0
        write_report(r, out)  # what is measured so far, should a later run not finish
    r["wall_s"] = time.perf_counter() - t0
    md = write_report(r, out)
    print(md.read_text())
    print(f"[bench] replicas: {r['wall_s'] / 60:.1f} min, written under {out} (server logs: {log})", file=sys.stderr)
