"""`deltaserve bench conversations`: more conversations than slots, and a restart, against llama-server.

Issue 14's measure, on the random Qwen3.5-0.8B shape (Q8_0, the same GGUF file for both servers):

- **Many conversations over 2 slots.** 8 and 16 conversations, each with its own system message (~300 tokens)
  and user turns of 60-90 words (~60-90 tokens), 4 turns, `max_tokens` 32, temperature 0, thinking off. Driven
  round robin (one request at a time: every request finds its slot taken by another conversation) and, for 8
  conversations, concurrently (one client thread per conversation, each sending its next turn when its previous
  answer is in: its times include the wait for a slot). Servers: `deltaserve serve --slots 2` with its state
  store (RAM tier), and `llama-server -np 2` with its own prompt cache (`--cache-ram`, and its per-slot context
  checkpoints). Measured: time to first streamed token of turns 3 and 4 (600-800 tokens of prompt), medians
  and the ratio deltaserve/llama-server (goal: at most 0.5x), also as the median of the per-request ratios;
  deltaserve's `cached_tokens` on follow-up turns (a full hit: the previous prompt less its generation header);
  llama-server's own reuse from its `timings` (`cache_n`).
- **Restart.** Conversations run 3 turns on `deltaserve serve --state-dir DIR`; the server gets SIGTERM and is
  started again on the same DIR; turn 4 of each conversation is timed (after one short warm-up request: a first
  forward pays one-time costs), against the same turn-4 request on a deltaserve server without a state dir that
  never saw these conversations (a full prefill), the two in turn. Goal: at most 0.3x. The answers of both must
  be the same (temperature 0).
- **Anatomy.** In a process of its own: a full prefill of ~1000 tokens of history and a new turn, against writing
  and reading the history's state file, restoring it, and prefilling the new turn alone.

One llama-server and one deltaserve server serve every run of the first measure (each run with conversations of
its own, so nothing of an earlier run is reused), each in a process of its own with the same thread count
(`--threads`, default 2). Round robin sends each request to both servers in turn (the idle one waits), so the
bursts of load on a shared machine fall on both; the concurrent runs go one server after the other. Written to
benchmarks/conversations/conversations.{md,json}. `--quick`: 8 conversations only, round robin only. About 12
minutes on 2 quiet cores.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.bench.session_turns import WORDS

SLOTS = 2
TURNS = 4               # turns 3 and 4 measured
MAX_TOKENS = 32
SYSTEM_WORDS = 300      # about one token per word in the real vocabulary
USER_WORDS = (60, 90)
STATE_RAM = "2G"        # deltaserve's state store RAM tier (what 16 conversations' latest states need, and more)
LLAMA_CACHE_RAM_MIB = 2048  # llama-server's prompt cache, the same budget
RESTART_CONVERSATIONS = 4
HEADER = 7              # '<|im_start|>assistant\n<think>\n\n</think>\n\n': the checkpoint is taken before it


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


# -- the conversations -------------------------------------------------------------------------------------------

def system_text(conv: int) -> str:
    rng = random.Random(50_000 + conv)
    words = [rng.choice(WORDS) for _ in range(SYSTEM_WORDS)]
    return (f"You are assistant number {conv}. Keep to the notes below and answer briefly. Notes: "
            + " ".join(words).capitalize() + ".")


def user_text(conv: int, turn: int) -> str:
    rng = random.Random(1_000_003 * conv + turn)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*USER_WORDS))).capitalize() + "?"


def first_messages(conv: int) -> list[dict]:
    return [{"role": "system", "content": system_text(conv)}]


# -- one request, streamed -------------------------------------------------------------------------------------

def stream(url: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed chat request: time to its first token, the answer, usage, and llama-server's timings."""
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    t0 = time.perf_counter()
    first, text, usage, timings = None, "", {}, {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("timings"):
                timings = ev["timings"]
            for ch in ev.get("choices", []):
                delta = ch.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text += delta.get("content") or ""
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "total_s": total, "text": text,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "llama_cache_n": timings.get("cache_n"), "llama_prompt_n": timings.get("prompt_n")}


# -- the servers -------------------------------------------------------------------------------------------------

class Server:
    """One server process on a free port; stopped with SIGTERM (then killed after 60 s)."""

    def __init__(self, engine: str, path: Path, threads: int, state_dir: str | None = None,
                 log: Path | None = None):
        from tools.bench.peers import _free_port, _wait_up, llama_server_binary

        self.engine = engine
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        if engine == "deltaserve":
            cmd = [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(path), "--port", str(port),
                   "--slots", str(SLOTS), "--threads", str(threads), "--device", "cpu", "--ctx", "4096",
                   "--state-ram", STATE_RAM]
            if state_dir is not None:
                cmd += ["--state-dir", state_dir]
        else:
            cmd = [str(llama_server_binary()), "-m", str(path), "--port", str(port), "-t", str(threads), "-tb",
                   str(threads), "-c", str(4096 * SLOTS), "-np", str(SLOTS), "--jinja", "--no-warmup",
                   "--cache-ram", str(LLAMA_CACHE_RAM_MIB)]
        self.cmd = cmd
        self._log = open(log, "ab") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log)
        t0 = time.perf_counter()
        try:
            _wait_up(self.url, self.proc, 600)
        except Exception:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def health(self) -> dict:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=30).json()
        except Exception:  # noqa: BLE001 - llama-server's /health holds no store
            return {}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- driving conversations ---------------------------------------------------------------------------------------

def drive(urls: dict[str, str], convs: list[int], turns: int, concurrent: bool,
          histories: dict[int, list[dict]] | None = None) -> dict[str, list[dict]]:
    """The conversations `convs` (ids: what their system message and user turns are made from), `turns` turns
    each, against every server in `urls` (name -> url). Round robin: turn by turn, conversation by conversation,
    one request at a time, each request sent to every server in turn before the next (so a noisy second of this
    shared machine falls on both: each server still sees only its own requests, in round-robin order; every
    server's conversation continues from its own answers). Concurrently: one client thread per conversation, the
    servers one after the other. One row per request per server; `histories` (conversation -> messages so far,
    of the first server) is extended in place."""
    names = list(urls)
    hist = {name: {} for name in names}
    if histories is not None:
        hist[names[0]] = histories
    for name in names:
        for c in convs:
            hist[name].setdefault(c, first_messages(c))
    rows: dict[str, list[dict]] = {name: [] for name in names}
    lock = threading.Lock()

    def one(name: str, c: int) -> None:
        messages = hist[name][c]
        k = sum(1 for m in messages if m["role"] == "user") + 1
        messages.append({"role": "user", "content": user_text(c, k)})
        r = stream(urls[name], messages)
        messages.append({"role": "assistant", "content": r["text"]})
        with lock:
            rows[name].append(dict(r, conversation=c, turn=k))

    if not concurrent:
        for _ in range(turns):
            for c in convs:
                for name in names:
                    one(name, c)
        return rows
    for name in names:
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(convs))

        def client(c: int) -> None:
            try:
                barrier.wait()
                for _ in range(turns):
                    one(name, c)  # noqa: B023 - joined before `name` moves on
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(c,)) for c in convs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if errors:
            raise errors[0]
        rows[name].sort(key=lambda r: (r["turn"], r["conversation"]))
    return rows


def follow_up_hits(rows: list[dict]) -> dict:
    """deltaserve's cached_tokens on follow-up turns: any reuse, and a full hit (the previous prompt of the
    conversation less its generation header, where the turn's checkpoint was taken)."""
    prev = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    follow = [r for r in rows if r["turn"] > 1 and (r["conversation"], r["turn"] - 1) in prev]
    anyhit = sum(1 for r in follow if (r["cached_tokens"] or 0) > 0)
    full = sum(1 for r in follow if (r["cached_tokens"] or 0) >= prev[(r["conversation"], r["turn"] - 1)] - HEADER)
    return {"follow_up_turns": len(follow), "any_reuse": anyhit, "full_hits": full,
            "hit_rate": full / len(follow) if follow else float("nan")}


def summarize(rows: list[dict], from_turn: int = 3) -> dict:
    late = [r for r in rows if r["turn"] >= from_turn]
    return {"ttft_median_s": median([r["ttft_s"] for r in late]), "requests": len(late),
            "prompt_tokens_median": median([r["prompt_tokens"] for r in late]),
            "per_turn": {k: median([r["ttft_s"] for r in rows if r["turn"] == k])
                         for k in sorted({r["turn"] for r in rows})}}


def _store_delta(after: dict | None, before: dict | None) -> dict | None:
    """What a run added to the store's counters (the server lives through several runs)."""
    if not after or not before:
        return after
    d = dict(after)
    for key in ("hits", "misses", "tokens_not_prefilled", "refused_files", "writes", "write_errors"):
        d[key] = after[key] - before[key]
    for key in ("restores", "evictions"):
        d[key] = {t: after[key][t] - before[key][t] for t in after[key]}
    return d


def paired_ratio(ds: list[dict], llama: list[dict], from_turn: int = 3) -> float:
    """The median over requests of turn `from_turn`+ of deltaserve's TTFT over llama-server's for the same
    (conversation, turn)."""
    other = {(r["conversation"], r["turn"]): r["ttft_s"] for r in llama}
    return median([r["ttft_s"] / other[(r["conversation"], r["turn"])] for r in ds
                   if r["turn"] >= from_turn and (r["conversation"], r["turn"]) in other])


def many(servers: dict[str, Server], runs: list[tuple[int, str]], turns: int) -> list[dict]:
    """Every (conversations, mode) on both servers. Each run has conversations of its own (new ids): nothing of
    an earlier run is reused."""
    out = []
    for i, (n, mode) in enumerate(runs):
        convs = list(range(1000 * (i + 1), 1000 * (i + 1) + n))
        entry: dict = {"conversations": n, "mode": mode, "turns": turns}
        print(f"[bench] conversations: {n} {mode}", file=sys.stderr)
        t0 = time.perf_counter()
        before = servers["deltaserve"].health().get("store")
        rows = drive({name: s.url for name, s in servers.items()}, convs, turns, concurrent=mode == "concurrent")
        entry["wall_s"] = time.perf_counter() - t0
        for engine, s in servers.items():
            e = {"rows": rows[engine], **summarize(rows[engine])}
            if engine == "deltaserve":
                e["hits"] = follow_up_hits(rows[engine])
                e["store"] = _store_delta(s.health().get("store"), before)
            else:
                follow = [r for r in rows[engine] if r["turn"] > 1]
                e["llama_reuse"] = {"follow_up_turns": len(follow),
                                    "cache_n_median": median([r["llama_cache_n"] for r in follow]),
                                    "prompt_n_median": median([r["llama_prompt_n"] for r in follow]),
                                    "full_reprefills": sum(1 for r in follow if not r["llama_cache_n"])}
            entry[engine] = e
        d, l = entry["deltaserve"], entry["llama-server"]
        entry["ratio"] = d["ttft_median_s"] / l["ttft_median_s"]
        entry["paired_ratio"] = paired_ratio(d["rows"], l["rows"])
        print(f"[bench]   turns 3+: median TTFT deltaserve {d['ttft_median_s'] * 1000:.0f} ms, llama-server "
              f"{l['ttft_median_s'] * 1000:.0f} ms ({entry['ratio']:.2f}x; {entry['wall_s']:.0f} s)", file=sys.stderr)
        # the same conversations on both servers: how many answers agree (random weights, near ties)
        la = {(r["conversation"], r["turn"]): r["text"] for r in l["rows"]}
        entry["same_answers_as_llama"] = sum(1 for r in d["rows"] if la.get((r["conversation"], r["turn"])) == r["text"])
        out.append(entry)
    return out


def _wait_written(s: Server, seconds: float = 60) -> int:
    """Wait until deltaserve's store has no pending disk writes; what was still pending at the deadline."""
    deadline = time.time() + seconds
    while True:
        pending = ((s.health().get("store") or {}).get("disk") or {}).get("pending_writes", 0)
        if not pending or time.time() > deadline:
            return pending
        time.sleep(0.2)


def restart(path: Path, threads: int, n: int, fresh: Server, log: Path) -> dict:
    """Turn 4 after a restart on the same --state-dir, against the same requests on `fresh`, a deltaserve server
    without a state dir that never saw these conversations (a full prefill): one request each, in turn. The
    reference answers of turn 4 come from the first server, without a restart (the state dir is copied after
    turn 3, so the restarted server sees only what turn 3 left)."""
    state_dir = tempfile.mkdtemp(prefix="deltaserve-bench-states-")
    kept = state_dir + "-after-turn-3"
    warm = [{"role": "user", "content": "Say hello to the river and the baker, please."}]
    convs = list(range(100, 100 + n))
    try:
        print(f"[bench] restart: {n} conversations x 3 turns on --state-dir", file=sys.stderr)
        histories: dict[int, list[dict]] = {}
        with Server("deltaserve", path, threads, state_dir=state_dir, log=log) as s:
            before = drive({"deltaserve": s.url}, convs, 3, concurrent=False, histories=histories)["deltaserve"]
            # the states are written by a background thread; copied once they are all on disk
            pending = _wait_written(s)
            written = s.health().get("store")
            shutil.copytree(state_dir, kept)
            prompts = {c: h + [{"role": "user", "content": user_text(c, 4)}] for c, h in histories.items()}
            unrestarted = [dict(stream(s.url, prompts[c]), conversation=c, turn=4) for c in convs]
            t0 = time.perf_counter()
            rc = s.stop()  # SIGTERM
            stop_s = time.perf_counter() - t0
        files = sorted(Path(kept).glob("*.state"))
        out: dict = {"conversations": n, "sigterm_exit": rc, "pending_at_sigterm": pending, "stop_s": stop_s,
                     "store_before": written, "state_files": len(files),
                     "state_bytes": sum(f.stat().st_size for f in files), "first_turns": before,
                     "unrestarted": {"rows": unrestarted, "ttft_median_s": median([r["ttft_s"] for r in unrestarted])}}
        print("[bench] restart: turn 4 on the restarted server and on a fresh one, in turn", file=sys.stderr)
        with Server("deltaserve", path, threads, state_dir=kept, log=log) as s:
            stream(s.url, warm, 4)
            before_fresh = fresh.health().get("store")
            rows: dict[str, list] = {"restarted": [], "fresh": []}
            for c in convs:
                rows["restarted"].append(dict(stream(s.url, prompts[c]), conversation=c, turn=4))
                rows["fresh"].append(dict(stream(fresh.url, prompts[c]), conversation=c, turn=4))
            for label, server in (("restarted", s), ("fresh", fresh)):
                rs = rows[label]
                store = server.health().get("store")
                out[label] = {"rows": rs, "ttft_median_s": median([r["ttft_s"] for r in rs]),
                              "cached_median": median([r["cached_tokens"] for r in rs]), "startup_s": server.startup_s,
                              "store": store if label == "restarted" else _store_delta(store, before_fresh)}
        out["ratio"] = out["restarted"]["ttft_median_s"] / out["fresh"]["ttft_median_s"]
        out["same_answers"] = sum(1 for a, b in zip(out["restarted"]["rows"], out["fresh"]["rows"])
                                  if a["text"] == b["text"])
        out["same_as_unrestarted"] = sum(1 for a, b in zip(out["restarted"]["rows"], unrestarted)
                                         if a["text"] == b["text"])
        return out
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)


# -- where deltaserve's time goes on a restored turn ------------------------------------------------------------

_ANATOMY = r"""
import json, sys, tempfile, time
from pathlib import Path
import torch
import deltaserve
from deltaserve.session.store import StateStore, read_state, write_state
from tools.bench import conversations as cv

path, threads, history = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = deltaserve.load(path, threads=threads)
backend, _ = model.backend("cpu")
backend.start()
tok = model.tokenizer
messages = cv.first_messages(0)
for k in range(1, 20):
    messages.append({"role": "user", "content": cv.user_text(0, k)})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=False))
    if len(ids) >= history:
        break
    messages.append({"role": "assistant", "content": " ".join(cv.user_text(1, k).split()[:25])})
ids = ids[:history]
suffix = tok.encode(tok.apply_chat_template([{"role": "user", "content": cv.user_text(2, 1)}],
                                            add_generation_prompt=True, enable_thinking=False))
state = backend.new_state(len(ids) + len(suffix) + 8)
backend.prefill(state, ids[:32])  # warm
out = {"history_tokens": len(ids), "suffix_tokens": len(suffix)}
def timed(fn, reps=3):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); r = fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2], r
def full():
    backend.reset(state)
    return backend.prefill(state, ids + suffix)
out["full_prefill_s"], _ = timed(full)
backend.reset(state)
backend.prefill(state, ids)
ck = backend.save(state, None, exact=True)
d = Path(tempfile.mkdtemp())
f = d / "x.state"
out["write_s"], nbytes = timed(lambda: write_state(f, ids, ck, model.host.sha256()))
out["state_bytes"] = nbytes
out["read_s"], (_, ck2) = timed(lambda: read_state(f, model.config, model.host.sha256()))
out["restore_s"], _ = timed(lambda: backend.restore(state, ck2, 0))
def suffix_prefill():
    backend.restore(state, ck2, 0)
    return backend.prefill(state, suffix)
both, _ = timed(suffix_prefill)
out["suffix_prefill_s"] = both - out["restore_s"]
f.unlink()
d.rmdir()
print("[result] " + json.dumps(out))
"""


def anatomy(path: Path, threads: int, history: int = 1000) -> dict:
    """In a process of its own: a full prefill of history + a new user turn, against reading the history's state
    file, restoring it into a slot's state, and prefilling the turn alone."""
    from tools.bench.peers import REPO, _tagged

    p = subprocess.run([sys.executable, "-c", _ANATOMY, str(path), str(threads), str(history)],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    value = _tagged(p.stdout, "[result] ")
    if p.returncode != 0 or value is None:
        raise RuntimeError(f"the restore anatomy failed (exit {p.returncode}): {p.stderr[-800:]}")
    return json.loads(value)


# -- the report --------------------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1000:.0f}"


def write_report(r: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "conversations.json").write_text(json.dumps(r, indent=1))
    lines = [f"# Many conversations over {SLOTS} slots, and a restart ({r['date']})", "",
             f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}, {r['threads']} threads per server. Random weights of the real Qwen3.5-0.8B shape "
             f"(Q8_0, {r['file']}), the same file for both servers; temperature 0, max_tokens {MAX_TOKENS}, thinking "
             f"off. Each conversation has its own system message (~{SYSTEM_WORDS} tokens) and user turns of "
             f"{USER_WORDS[0]}-{USER_WORDS[1]} words. deltaserve: `serve --slots {SLOTS} --state-ram {STATE_RAM}`; "
             f"llama-server ({r.get('llama_server', '?')}): `-np {SLOTS} -c {4096 * SLOTS} --cache-ram "
             f"{LLAMA_CACHE_RAM_MIB}` (its host-memory prompt cache, and its default per-slot context checkpoints).",
             "", "The machine is shared (another engineer's tests ran at the same time): figures are medians, and "
             "the ratios are what to read; single figures move by tens of percent from run to run.", ""]
    if r.get("many"):
        lines += ["## Time to first token of turns 3 and later (ms, median over every conversation's turns 3+)", "",
                  "| conversations | driven | prompt tokens (median) | deltaserve | llama-server | ratio (goal <= 0.5) "
                  "| median of per-request ratios | deltaserve follow-ups with a full store hit | llama-server reused "
                  "tokens (median, follow-ups) | llama-server follow-ups prefilled whole |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in r["many"]:
            d, l, h = e["deltaserve"], e["llama-server"], e["deltaserve"]["hits"]
            lr = l["llama_reuse"]
            lines.append(f"| {e['conversations']} | {e['mode']} | {d['prompt_tokens_median']:.0f} | "
                         f"{_ms(d['ttft_median_s'])} | {_ms(l['ttft_median_s'])} | {e['ratio']:.2f}x | "
                         f"{e.get('paired_ratio', float('nan')):.2f}x | "
                         f"{h['full_hits']} of {h['follow_up_turns']} ({h['hit_rate']:.0%}) | "
                         f"{lr['cache_n_median']:.0f} of {l['prompt_tokens_median']:.0f} | "
                         f"{lr.get('full_reprefills', '-')} of {lr['follow_up_turns']} |")
        lines += ["", "A full store hit: `cached_tokens` equal to the conversation's previous prompt less its "
                  f"{HEADER}-token generation header (where the turn's checkpoint was taken). llama-server's reuse is "
                  "`timings.cache_n` of its own answers (0: the whole prompt prefilled). Per-request ratio: "
                  "deltaserve's TTFT over llama-server's for the same conversation and turn (round robin sends them "
                  "one right after the other). Concurrent TTFTs include the wait for one of the 2 slots.", "",
                  "Per turn (ms, median over the conversations; deltaserve / llama-server):", "",
                  "| conversations | driven | " + " | ".join(f"turn {k}" for k in e["deltaserve"]["per_turn"]) + " |",
                  "|---|---|" + "---|" * len(e["deltaserve"]["per_turn"])]
        for e in r["many"]:
            d, l = e["deltaserve"]["per_turn"], e["llama-server"]["per_turn"]
            lines.append(f"| {e['conversations']} | {e['mode']} | "
                         + " | ".join(f"{_ms(d[k])} / {_ms(l[k])}" for k in d) + " |")
        lines += ["", "deltaserve's store over each run (`/health`: that run's counters, the states held at its end):", ""]
        for e in r["many"]:
            s = e["deltaserve"].get("store") or {}
            if s:
                lines.append(f"- {e['conversations']} {e['mode']}: {s['hits']} hits, {s['misses']} misses, "
                             f"{s['restores']['ram']} restores from RAM, {s['evictions']['ram']} evicted from RAM, "
                             f"{s['ram']['states']} states in {s['ram']['bytes'] / 2**20:.0f} MiB, "
                             f"{s['tokens_not_prefilled']} tokens not prefilled.")
        lines.append("")
    if r.get("restart"):
        x = r["restart"]
        rs, fr = x["restarted"], x["fresh"]
        lines += ["## Turn 4 after a restart on the same --state-dir, against a re-prefill", "",
                  f"{x['conversations']} conversations ran 3 turns on `serve --slots {SLOTS} --state-dir DIR`; "
                  f"once its store had {x.get('pending_at_sigterm', 0)} writes pending, DIR was copied "
                  f"({x['state_files']} state files, {x['state_bytes'] / 2**20:.0f} MiB), that server answered turn 4 "
                  f"too (the reference answers, without a restart; median TTFT {_ms(x['unrestarted']['ttft_median_s'])}"
                  f" ms) and got SIGTERM (exit {x['sigterm_exit']}, {x['stop_s']:.1f} s). Turn 4 of "
                  "each conversation on a server started on the copy (after one short warm-up request), and the "
                  "same request on a deltaserve server without a state dir that never saw these conversations (the "
                  "one of the runs above: a full prefill), one request at a time, the two servers in turn. The state "
                  "files were just written, so they are read from the page cache.", "",
                  "| | prompt tokens (median) | cached tokens (median) | TTFT turn 4 (ms, median) | server start (s) |",
                  "|---|---|---|---|---|",
                  f"| restarted on DIR | {median([q['prompt_tokens'] for q in rs['rows']]):.0f} | "
                  f"{rs['cached_median']:.0f} | {_ms(rs['ttft_median_s'])} | {rs['startup_s']:.1f} |",
                  f"| fresh, no state dir (full prefill) | {median([q['prompt_tokens'] for q in fr['rows']]):.0f} | "
                  f"{fr['cached_median']:.0f} | {_ms(fr['ttft_median_s'])} | {fr['startup_s']:.1f} |", "",
                  f"Ratio restarted / re-prefill: **{x['ratio']:.2f}x** (goal <= 0.3). Answers of the restarted "
                  f"server identical to the same turn without a restart: {x.get('same_as_unrestarted', '-')} of "
                  f"{x['conversations']}; to the full re-prefill: {x['same_answers']} of {x['conversations']} (a "
                  "prefill cut at another token rounds differently, and random weights leave near ties). "
                  "Per conversation (ms): "
                  + ", ".join(f"{_ms(a['ttft_s'])} / {_ms(b['ttft_s'])}" for a, b in zip(rs["rows"], fr["rows"]))
                  + " (restarted / fresh).", ""]
        s = rs.get("store") or {}
        if s:
            lines += [f"Restarted server's store after turn 4: {s['restores']['disk']} restores from disk, "
                      f"{s['restores']['ram']} from RAM, {s['misses']} misses, {s['refused_files']} files refused.", ""]
    if r.get("anatomy"):
        a = r["anatomy"]
        lines += ["## Where a restored turn's time goes (deltaserve, in process, medians of 3)", "",
                  f"A history of {a['history_tokens']} tokens and a new user turn of {a['suffix_tokens']} tokens "
                  "(with its generation header):", "",
                  "| step | ms |", "|---|---|",
                  f"| full prefill of history + turn | {_ms(a['full_prefill_s'])} |",
                  f"| write the history's state file ({a['state_bytes'] / 2**20:.0f} MiB, fsynced) | {_ms(a['write_s'])} |",
                  f"| read + check the state file (page cache) | {_ms(a['read_s'])} |",
                  f"| restore it into a slot's state | {_ms(a['restore_s'])} |",
                  f"| prefill of the turn alone | {_ms(a['suffix_prefill_s'])} |",
                  "", f"Read + restore + suffix prefill: "
                      f"{_ms(a['read_s'] + a['restore_s'] + a['suffix_prefill_s'])} ms against "
                      f"{_ms(a['full_prefill_s'])} ms "
                      f"({(a['read_s'] + a['restore_s'] + a['suffix_prefill_s']) / a['full_prefill_s']:.2f}x).", ""]
    lines += [f"Run time: {r['wall_s'] / 60:.1f} min."]
    md = out / "conversations.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _cpu() -> str:
    """lscpu's model name, family and model (the CPU line of the report)."""
    from tools.bench.peers import _cpu_name, lscpu

    info = lscpu()
    if not info:
        return _cpu_name()
    name = info.get("Model name") or _cpu_name()
    return f"{name} (family {info.get('CPU family', '?')}, model {info.get('Model', '?')})"


def _llama_version() -> str:
    from tools.bench.peers import llama_server_binary

    try:
        p = subprocess.run([str(llama_server_binary()), "--version"], capture_output=True, text=True, timeout=30)
        line = next((x for x in (p.stdout + p.stderr).splitlines() if x.startswith("version")), "")
        return line.removeprefix("version:").strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(a) -> None:
    from tools.bench.models import CACHE, model_file

    t0 = time.perf_counter()
    out = Path(a.out) / "conversations"
    out.mkdir(parents=True, exist_ok=True)
    path = model_file("0.8B", "q8_0")
    log = CACHE / "conversations-servers.log"
    log.write_bytes(b"")
    quick = getattr(a, "quick", False)
    r: dict = {"command": a.command_line, "threads": a.threads, "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "file": path.name, "llama_server": _llama_version(), "slots": SLOTS, "max_tokens": MAX_TOKENS,
               "turns": TURNS}
    runs = [(8, "round robin")] if quick else [(8, "round robin"), (16, "round robin"), (8, "concurrent")]
    print("[bench] conversations: starting llama-server and deltaserve serve (each serves every run, one at a "
          "time)", file=sys.stderr)
    if threading.current_thread() is threading.main_thread():  # a SIGTERM stops the servers too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Server("llama-server", path, a.threads, log=log) as llama, Server("deltaserve", path, a.threads, log=log) as ds:
        r["startup_s"] = {"llama-server": llama.startup_s, "deltaserve": ds.startup_s}
        r["many"] = many({"llama-server": llama, "deltaserve": ds}, runs, TURNS)
        r["restart"] = restart(path, a.threads, RESTART_CONVERSATIONS, ds, log)
    r["anatomy"] = anatomy(path, a.threads)
    r["wall_s"] = time.perf_counter() - t0
    md = write_report(r, out)
    print(md.read_text())
    print(f"[bench] conversations: {r['wall_s'] / 60:.1f} min, written under {out} (server logs: {log})",
          file=sys.stderr)
