"""A long conversation on one resident session, side by side with re-prefilling every turn.

Per turn: the prompt's length, the tokens new since the previous prompt, what the session reused and
prefilled, and the time to first token in both modes. Greedy answers must be the same in both modes.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

WORDS = ("the river runs past old stone houses where people keep small gardens and talk about the weather "
         "while children draw maps of islands that nobody has visited yet and a baker sells warm bread before "
         "the morning train leaves for the city with its windows full of light").split()


def user_message(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "?"


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def run(model, turns: int = 20, max_tokens: int = 24, words: tuple[int, int] = (40, 80), seed: int = 0) -> dict:
    tok = model.tokenizer
    rng = random.Random(seed)
    messages: list[dict] = []
    session = model.session(quiet=True)
    rows = []
    prev_prompt: list[int] = []
    for k in range(1, turns + 1):
        messages.append({"role": "user", "content": user_message(rng, rng.randint(*words))})
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False))
        resident = session.generate(prompt, max_tokens=max_tokens)
        t0 = time.perf_counter()
        fresh = model.generate(prompt, max_tokens=max_tokens)
        fresh_wall = time.perf_counter() - t0
        rows.append({
            "turn": k, "prompt_tokens": len(prompt), "new_since_last_prompt": len(prompt) - _common(prompt, prev_prompt),
            "reused": resident.reused, "prefilled": resident.prefilled, "start": resident.start,
            "ttft_resident_s": resident.timings.ttft_s, "ttft_reprefill_s": fresh.timings.ttft_s,
            "reprefill_wall_s": fresh_wall, "same_answer": resident.tokens == fresh.tokens,
        })
        messages.append({"role": "assistant", "content": resident.text})
        prev_prompt = prompt
    return {"turns": rows, "max_tokens": max_tokens}


def report(result: dict, out_dir: Path, label: str, command: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["turns"]
    (out_dir / "session_turns.json").write_text(json.dumps(dict(result, label=label, command=command), indent=1))
    lines = [f"# A {len(rows)}-turn conversation: resident session vs re-prefilling every turn", "",
             f"Model: {label}. Command: `{command}`", "",
             "| turn | prompt tokens | new since last prompt | reused | prefilled | start | TTFT resident (ms) | "
             "TTFT re-prefill (ms) | same answer |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['new_since_last_prompt']} | {r['reused']} | "
                     f"{r['prefilled']} | {r['start']} | {r['ttft_resident_s'] * 1000:.0f} | "
                     f"{r['ttft_reprefill_s'] * 1000:.0f} | {'yes' if r['same_answer'] else 'NO'} |")
    late = rows[len(rows) // 2:]
    res = statistics.median(r["ttft_resident_s"] for r in late)
    rep = statistics.median(r["ttft_reprefill_s"] for r in late)
    lines += ["", f"Median TTFT over turns {late[0]['turn']}-{late[-1]['turn']}: resident {res * 1000:.0f} ms, "
              f"re-prefill {rep * 1000:.0f} ms ({rep / res:.1f}x).",
              "",
              "Each turn's prompt re-renders the previous answer without the empty think block the generation "
              "header carried (the Qwen3.5 template does that), so the session resumes from the checkpoint taken "
              "before the previous generation header and prefills `<|im_start|>assistant\\n` (3 tokens) plus what is "
              "new since the previous prompt: `prefilled = new since last prompt + 3`."]
    md = out_dir / "session_turns.md"
    md.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        t = [r["turn"] for r in rows]
        a.plot(t, [r["ttft_resident_s"] * 1000 for r in rows], "o-", label="resident session")
        a.plot(t, [r["ttft_reprefill_s"] * 1000 for r in rows], "s-", label="re-prefill every turn")
        a.set_xlabel("turn"), a.set_ylabel("time to first token (ms)"), a.legend(), a.set_title("TTFT per turn")
        b.plot(t, [r["prompt_tokens"] for r in rows], "s-", label="prompt tokens (re-prefilled)")
        b.plot(t, [r["prefilled"] for r in rows], "o-", label="prefilled by the session")
        b.plot(t, [r["new_since_last_prompt"] for r in rows], "x--", label="new since the last prompt")
        b.set_xlabel("turn"), b.set_ylabel("tokens"), b.legend(), b.set_title("tokens prefilled per turn")
        fig.suptitle(label)
        fig.tight_layout()
        fig.savefig(out_dir / "session_turns.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    return md
