"""`deltaserve bench mtp` (issue 33): speculative decoding with the model's own MTP block.

1. The demo model (it carries a trained MTP block): greedy chat turns whose answers are long enough to decode
   (the README's four turns and prompts that repeat or reverse a text), decode tokens/s with drafts (adaptive, and a
   fixed 3) against without, and the acceptance; llama-server on the same file with `--spec-type draft-mtp
   --spec-draft-n-max 3` and without, its own `timings` (predicted_per_second, draft_n, draft_n_accepted).
2. The cost of a verification: random weights of the Qwen3.5-0.8B shape (whole) and of the 9B shape (LAYERS of its
   32 layers, extrapolated as the moe bench does: a token's seconds = fixed + layers x per layer), Q8_0, both
   carrying an MTP block: one verify pass of k+1 rows against one decode step for k = 1..4, and a draft step, in
   deltaserve; llama.cpp's pass over k+1 tokens (llama-cpp-python, logits for every row) against one token. Random
   weights draft nothing useful: only the costs mean something there; the speed-up at an acceptance a with k drafts is
   (1 + a + ... + a^k) / (verify(k+1) + k x draft), stated next to the measured figures.
Each engine runs in a fresh process per measurement.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from tools.bench.peers import (_cpu_name, _free_port, in_fresh_process, llama_server_binary, median, serving,
                               use_best_llama)

LAYERS = (4, 8)
FULL_9B = 32
CONTEXT = 256  # the position the verifications and decode steps run at
KS = (1, 2, 3, 4)

DEMO_PROMPTS = [
    ["My locker code is 4821.", "What is 12 + 9?", "Reverse these words: red fox blue", "What is my locker code?"],
    ["Repeat after me: the quick brown fox jumps over the lazy dog near the river bank"],
    ["Reverse these words: one two three four five six seven eight"],
    ["Repeat after me: green apples and red cherries fill the basket on the kitchen table"],
    ["My dog is called Biscuit.", "Repeat after me: my dog is called Biscuit and he likes the park"],
]


# -- 1. the demo model -------------------------------------------------------------------------------------------

def deltaserve_demo(path: str, threads: int, mtp, rounds: int) -> dict:
    """Greedy chat turns (DEMO_PROMPTS), `rounds` times: decode tok/s over all turns (generated tokens after the
    first over decode seconds), drafted and accepted; the tokens, to compare between settings."""
    import torch

    import deltaserve

    torch.set_num_threads(threads)
    m = deltaserve.load(path, threads=threads)
    rates, outputs, drafted, accepted = [], [], 0, 0
    for r in range(rounds):
        gen = secs = 0.0
        for conv in DEMO_PROMPTS:
            s = m.session(mtp=3 if mtp == "fixed3" else mtp, quiet=True)
            if mtp == "fixed3":  # no adaptation: three drafts every step (llama-server's --spec-draft-n-max 3)
                s._policy.choose = lambda room: min(3, room)
            messages = []
            for text in conv:
                messages.append({"role": "user", "content": text})
                t = s.chat(messages, max_tokens=96, enable_thinking=False)
                messages.append({"role": "assistant", "content": t.text})
                gen += max(t.generated - 1, 0)
                secs += t.timings.decode_s
                if r == 0:
                    outputs.append(t.tokens)
                    drafted += t.drafted
                    accepted += t.accepted
        rates.append(gen / secs if secs else 0.0)
    return {"tok_s": median(rates), "runs": rates, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "outputs": outputs,
            "generated": sum(len(o) for o in outputs)}


def llama_server_demo(path: Path, threads: int, spec: bool) -> dict:
    """llama-server on the demo file, the same turns (its chat template, greedy, thinking off): predicted tokens/s
    and its draft counts from each response's `timings`."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(llama_server_binary()), "-m", str(path), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-np", "1", "--jinja", "--no-warmup", "--temp", "0"]
    if spec:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    with serving(cmd, url):
        predicted = secs = 0.0
        drafted = accepted = 0
        texts = []
        for conv in DEMO_PROMPTS:
            messages = []
            for text in conv:
                messages.append({"role": "user", "content": text})
                body = {"messages": messages, "max_tokens": 96, "temperature": 0.0, "cache_prompt": False,
                        "chat_template_kwargs": {"enable_thinking": False}}
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
                t = r.get("timings") or {}
                answer = r["choices"][0]["message"].get("content") or ""
                messages.append({"role": "assistant", "content": answer})
                texts.append(answer)
                predicted += t.get("predicted_n", 0)
                secs += t.get("predicted_ms", 0.0) / 1000
                drafted += t.get("draft_n", 0) or 0
                accepted += t.get("draft_n_accepted", 0) or 0
        return {"tok_s": predicted / secs if secs else 0.0, "drafted": drafted, "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None, "texts": texts}


# -- 2. the cost of a verification --------------------------------------------------------------------------------

def deltaserve_costs(path: str, threads: int, repeats: int) -> dict:
    """Seconds of one decode step, of a verify chain of k+1 rows (k = 1..4) and of a draft step, at CONTEXT."""
    import torch

    import deltaserve
    from deltaserve.engine.forward import Forward

    torch.set_num_threads(threads)
    m = deltaserve.load(path, cache=False, threads=threads)
    f = Forward(m.config, m.host.weights)
    ids = torch.randint(0, 200000, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    st = f.new_state(CONTEXT + 64)
    f.prefill(st, ids)
    snaps = f.new_snapshots(max(KS))

    def timed(fn, n=max(3, repeats * 3)):
        out = []
        for _ in range(n):
            base = st.length
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            st.length = base  # the same positions again: the KV past them is never read
        return statistics.median(out)

    tok = ids[-1]
    decode = timed(lambda: f.decode(st, tok))
    verify = {k: timed(lambda k=k: f.verify(st, [tok] * (k + 1), snaps)) for k in KS}
    # a step whose first draft is rejected (verify 4 rows, roll back to 1) against one that keeps them all
    def step(kept: int) -> float:
        t0 = time.perf_counter()
        f.verify(st, [tok] * 4, snaps)
        f.rollback(st, snaps, kept, 4)
        return time.perf_counter() - t0

    rejected = timed(lambda: step(1))
    kept_all = timed(lambda: step(4))
    draft = None
    if f.mtp is not None:
        cache = f.mtp.new_cache(CONTEXT + 64)
        out = torch.zeros(m.config.hidden_size)
        draft = timed(lambda: f.mtp.next(cache, CONTEXT, tok, out))
    return {"decode_s": decode, "verify_s": verify, "draft_s": draft, "rejected_step_s": rejected,
            "kept_step_s": kept_all, "route": f.token_program()[1],
            "draft_route": f.mtp.why if f.mtp is not None else None}


def llama_costs(path: str, threads: int, repeats: int) -> dict:
    """llama.cpp's one token, and a pass over k+1 tokens with logits for each (what its verification runs), at
    CONTEXT (llama-cpp-python; the KV of the timed tokens removed after each)."""
    import llama_cpp

    m = llama_cpp.Llama(str(path), n_ctx=CONTEXT + 64, n_batch=CONTEXT, n_ubatch=CONTEXT, n_threads=threads,
                        n_threads_batch=threads, logits_all=True, verbose=False)

    rng = random.Random(0)
    ids = [rng.randrange(200000) for _ in range(CONTEXT)]

    def timed(n_tokens: int) -> float:
        out = []
        for _ in range(max(3, repeats * 3)):
            m.reset()  # a recurrent state cannot be cut back: the context again before each timed pass
            m.eval(ids)
            t0 = time.perf_counter()
            m.eval(ids[:n_tokens])
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    decode = timed(1)
    return {"decode_s": decode, "verify_s": {k: timed(k + 1) for k in KS}}


def extrapolate(by_layers: dict[int, float], full: int) -> dict:
    (l0, s0), (l1, s1) = sorted(by_layers.items())
    per = (s1 - s0) / (l1 - l0)
    fixed = s0 - l0 * per
    return {"per_layer_s": per, "fixed_s": fixed, "full_s": fixed + full * per}


def mtp_file(shape: str, layers: int | None) -> Path:
    from tools.bench.models import model_file

    return model_file(shape, "q8_0", layers, mtp=True)


def main(a) -> None:
    from deltaserve.demo import DEMO_FILE

    out = Path(a.out) / "mtp"
    out.mkdir(parents=True, exist_ok=True)
    rounds = max(1, a.repeats)
    r: dict = {"command": a.command_line, "threads": a.threads, "cpu": _cpu_name(), "context": CONTEXT,
               "date": time.strftime("%Y-%m-%d %H:%M"), "llama.cpp_flags": use_best_llama()}
    demo = str(DEMO_FILE)
    r["demo"] = {name: in_fresh_process("deltaserve_demo", Path(demo), a.threads, mtp, rounds,
                                        module="tools.bench.mtp")
                 for name, mtp in (("off", 0), ("adaptive", None), ("fixed3", "fixed3"))}
    r["demo"]["same_output"] = all(r["demo"][k]["outputs"] == r["demo"]["off"]["outputs"]
                                   for k in ("adaptive", "fixed3"))
    try:
        r["demo_llama_server"] = {name: llama_server_demo(Path(demo), a.threads, spec)
                                  for name, spec in (("off", False), ("draft-mtp", True))}
    except Exception as e:  # noqa: BLE001 - said in the report: the rest stands without it
        r["demo_llama_server"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "results.json").write_text(json.dumps(r, indent=1))
    r["costs"] = {}
    shapes = [("0.8B", None)] + ([] if a.quick else [("9B", n) for n in LAYERS])
    for shape, layers in shapes:
        path = mtp_file(shape, layers)
        key = f"{shape}" + (f"-{layers}L" if layers else "")
        print(f"[bench] mtp costs: {key}", file=sys.stderr, flush=True)
        r["costs"][key] = {"deltaserve": in_fresh_process("deltaserve_costs", path, a.threads, rounds,
                                                          module="tools.bench.mtp"),
                           "llama.cpp": in_fresh_process("llama_costs", path, a.threads, rounds,
                                                         module="tools.bench.mtp")}
        (out / "results.json").write_text(json.dumps(r, indent=1))
    finish(r, out, a.quick)


def int_keys(r: dict) -> None:
    """verify_s by row count, as integers again (a child's JSON made them strings)."""
    for engines in r.get("costs", {}).values():
        for m in engines.values():
            m["verify_s"] = {int(k): v for k, v in m["verify_s"].items()}


def finish(r: dict, out: Path, quick: bool) -> None:
    """The 9B shape's 32-layer figures from its two layer counts, results.json and RESULTS.md."""
    int_keys(r)
    if not quick:
        full = {}
        for engine in ("deltaserve", "llama.cpp"):
            rows = {n: r["costs"][f"9B-{n}L"][engine] for n in LAYERS}
            full[engine] = {"decode_s": extrapolate({n: v["decode_s"] for n, v in rows.items()}, FULL_9B)["full_s"],
                            "verify_s": {k: extrapolate({n: v["verify_s"][k] for n, v in rows.items()},
                                                        FULL_9B)["full_s"] for k in KS}}
            if engine == "deltaserve":
                # the draft step is one block and the head: it does not grow with the trunk's layers
                full[engine]["draft_s"] = statistics.mean(v["draft_s"] for v in rows.values())
        r["costs"]["9B (32 layers, extrapolated)"] = full
    (out / "results.json").write_text(json.dumps(r, indent=1))
    int_keys(r)
    md = write_report(r, out)
    print(md.read_text())


def write_report(r: dict, out: Path) -> Path:
    lines = [f"# deltaserve bench mtp ({r['date']})", "", f"Command: `{r['command']}`  ",
             f"CPU: {r['cpu']}, {r['threads']} threads; llama.cpp built here with {r['llama.cpp_flags']}.", ""]
    d = r["demo"]
    lines += ["## The demo model (its trained MTP block), greedy chat turns", "",
              "| engine | drafts | decode tok/s | vs its own without | drafted | accepted | acceptance |",
              "|---|---|---|---|---|---|---|"]
    for name in ("off", "adaptive", "fixed3"):
        m = d[name]
        acc = f"{m['acceptance']:.2f}" if m["acceptance"] is not None else "-"
        lines.append(f"| deltaserve | {name} | {m['tok_s']:.1f} | {m['tok_s'] / d['off']['tok_s']:.2f}x | "
                     f"{m['drafted']} | {m['accepted']} | {acc} |")
    ls = r.get("demo_llama_server") or {}
    if "error" in ls:
        lines.append(f"| llama-server | - | not measured: {ls['error']} | | | | |")
    else:
        for name in ("off", "draft-mtp"):
            m = ls[name]
            acc = f"{m['acceptance']:.2f}" if m["acceptance"] is not None else "-"
            lines.append(f"| llama-server | {name} | {m['tok_s']:.1f} | {m['tok_s'] / ls['off']['tok_s']:.2f}x | "
                         f"{m['drafted']} | {m['accepted']} | {acc} |")
        lines += ["", f"deltaserve with drafts (adaptive) against llama-server's MTP decode: "
                      f"{d['adaptive']['tok_s'] / ls['draft-mtp']['tok_s']:.2f}x; fixed 3: "
                      f"{d['fixed3']['tok_s'] / ls['draft-mtp']['tok_s']:.2f}x."]
    lines += ["", f"Greedy output identical with and without drafts: {d['same_output']} "
                  f"({d['off']['generated']} tokens over {sum(len(c) for c in DEMO_PROMPTS)} turns)."]
    lines += ["", f"## The cost of a verification (random weights, Q8_0, at position {r['context']})", "",
              "| shape | engine | decode ms | verify 2 / decode | verify 3 | verify 4 | verify 5 | draft step / decode |",
              "|---|---|---|---|---|---|---|---|"]
    for key, engines in r.get("costs", {}).items():
        for engine, m in engines.items():
            dec = m["decode_s"]
            draft = f"{m['draft_s'] / dec:.3f}" if m.get("draft_s") else "-"
            lines.append(f"| {key} | {engine} | {dec * 1e3:.1f} | "
                         + " | ".join(f"{m['verify_s'][k] / dec:.2f}x" for k in KS) + f" | {draft} |")
    full = r.get("costs", {}).get("9B (32 layers, extrapolated)")
    if full:
        ds, most = full["deltaserve"], r["costs"][f"9B-{max(LAYERS)}L"]["deltaserve"]
        ratios = {k: most["verify_s"][k] / most["decode_s"] for k in KS}
        draft = ds["draft_s"] / ds["decode_s"]
        lines += ["", f"The 32-layer row extrapolates each figure from the difference of two measurements, within their "
                      f"noise of each other (a verification of 4 rows cannot cost less than one of 3): the speed-up "
                      f"below takes the verifications as measured at {max(LAYERS)} layers (their ratio to a decode "
                      f"step: " + ", ".join(f"{k + 1} rows {ratios[k]:.2f}x" for k in KS) + ") and the draft step "
                      f"over the 32-layer decode ({draft:.3f}x: the block and the head, whatever the trunk's depth). "
                      "Drafting k tokens at acceptance a: (1 + a + ... + a^k) / (verify(k+1) + k x draft), in decode "
                      "steps:", "",
                  "| a | k=1 | k=2 | k=3 | k=4 |", "|---|---|---|---|---|"]
        for acc in (0.5, 0.7, 0.9):
            lines.append(f"| {acc} | " + " | ".join(
                f"{sum(acc ** i for i in range(k + 1)) / (ratios[k] + k * draft):.2f}x" for k in KS) + " |")
    md = out / "RESULTS.md"
    md.write_text("\n".join(lines) + "\n")
    return md
