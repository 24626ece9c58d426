"""`deltaserve bench responses`: a chain of turns by `previous_response_id` against the same turns sent as whole history.

The 0.8B shape (Q8_0, random weights, the real vocabulary and template), 2 threads. The same user messages (70 words
each), thinking off and on, as:

- **responses chain**: POST /v1/responses with only the new message and `previous_response_id` (the server continues
  from the state it kept after the previous answer: nothing of the history is rendered, tokenized or prefilled again);
- **chat, whole history** / **responses, whole history**: the whole conversation sent each turn, the answers as a
  client sends them back (their text, without the reasoning): rendered and tokenized again, and the session reuses
  what its slot or the store holds of it;
- **responses chain from the store**: the chain while another chain takes turns in the same slot (`--slots 1`), so each
  turn's state comes back from the state store;
- **llama-server** (llama.cpp's own, the same file): chat and /v1/responses with the whole history (it keeps no
  responses: `previous_response_id` is not served there).

The last turn generates one token, so its request's time is its time to the first token; turns before it answer 24
tokens. Medians over --repeats whole conversations.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from tools.bench.models import model_file
from tools.bench.peers import _free_port, _user_text, llama_server_binary, serving

TURNS = 10
MAX_TOKENS = 24


def _post(url: str, path: str, body: dict) -> tuple[float, dict]:
    """(seconds the request took, its JSON answer)."""
    t0 = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=600)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]!r}")
    return took, r.json()


def _text(k: int, tag: int) -> str:
    return (f"Conversation {tag}. " if k == 1 else "") + _user_text(k)


def _budget(k: int, turns: int) -> int:
    """The last turn generates one token: its request's time is its time to the first token (the answers of random
    weights may open with tokens a parser holds back, which a streamed first delta would count)."""
    return 1 if k == turns else MAX_TOKENS


def chain(url: str, turns: int, think: bool, tag: int, other: bool = False) -> list[dict]:
    """A chain by previous_response_id; `other`: another chain's turn goes first each time (into the same slot)."""
    rows, prev, prev_other = [], None, None
    effort = {"effort": "medium" if think else "none"}
    for k in range(1, turns + 1):
        if other:
            body = {"input": _text(k, tag + 1000), "max_output_tokens": MAX_TOKENS, "temperature": 0,
                    "reasoning": effort, **({"previous_response_id": prev_other} if prev_other else {})}
            prev_other = _post(url, "/v1/responses", body)[1]["id"]
        body = {"input": _text(k, tag), "max_output_tokens": _budget(k, turns), "temperature": 0, "reasoning": effort,
                **({"previous_response_id": prev} if prev else {})}
        took, resp = _post(url, "/v1/responses", body)
        prev = resp["id"]
        u = resp["usage"]
        rows.append({"turn": k, "seconds": took, "input_tokens": u["input_tokens"],
                     "cached_tokens": u["input_tokens_details"]["cached_tokens"]})
    return rows


def history(url: str, turns: int, think: bool, tag: int, responses: bool = False) -> list[dict]:
    """The same user messages, the whole history sent each turn (chat completions, or Responses items), the answers
    sent back as a client sends them (their text; reasoning left out)."""
    rows, messages = [], []
    for k in range(1, turns + 1):
        messages.append({"role": "user", "content": _text(k, tag)})
        if responses:
            items = [{"type": "message", "role": m["role"], "content": m["content"]} for m in messages]
            body = {"input": items, "max_output_tokens": _budget(k, turns), "temperature": 0, "store": False,
                    "reasoning": {"effort": "medium" if think else "none"}}
            took, resp = _post(url, "/v1/responses", body)
            text = "".join(p.get("text", "") for it in resp.get("output", []) if it.get("type") == "message"
                           for p in it.get("content", []))
            u = resp.get("usage") or {}
            prompt, cached = u.get("input_tokens"), (u.get("input_tokens_details") or {}).get("cached_tokens")
        else:
            body = {"messages": messages, "max_tokens": _budget(k, turns), "temperature": 0,
                    "chat_template_kwargs": {"enable_thinking": think}}
            took, resp = _post(url, "/v1/chat/completions", body)
            text = resp["choices"][0]["message"].get("content") or ""
            u = resp.get("usage") or {}
            prompt, cached = u.get("prompt_tokens"), (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        messages.append({"role": "assistant", "content": text})
        rows.append({"turn": k, "seconds": took, "input_tokens": prompt, "cached_tokens": cached})
    return rows


def summary(runs: list[list[dict]]) -> dict:
    """Over the repeats: the median of the last turn's time (its first token), its tokens, and cached tokens."""
    last = [rows[-1] for rows in runs]
    return {"turn_n_ttft_s": statistics.median(r["seconds"] for r in last),
            "turn_n_input_tokens": last[0]["input_tokens"], "turn_n_cached_tokens": last[0]["cached_tokens"],
            "repeats": len(runs)}


def main(a) -> None:
    threads = a.threads or 2
    turns = TURNS if a.turns == 20 else a.turns  # `--turns` defaults to 20 (the session bench's): 10 here
    repeats = 1 if a.quick else max(1, a.repeats)
    path = model_file("0.8B", "q8_0")
    runs: dict[str, list] = {}

    def ours(port: int, slots: int) -> list[str]:
        return [sys.executable, "-m", "deltaserve.frontends.cli", "serve", str(path), "--port", str(port),
                "--threads", str(threads), "--device", "cpu", "--ctx", "8192", "--prefill-log", "off",
                "--slots", str(slots)]

    def each(name: str, fn, *args, **kw) -> None:
        for think in (False, True):
            key = f"{name}, thinking {'on' if think else 'off'}"
            runs[key] = [fn(*args, turns, think, tag=100 * r + 10 * think + len(runs), **kw) for r in range(repeats)]

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(ours(port, 2), url):
        chain(url, 2, False, tag=9999)  # the first requests' one-time work (template compile, allocation) first
        history(url, 2, False, tag=9998)
        each("deltaserve responses chain", chain, url)
        each("deltaserve chat, whole history", history, url)
        each("deltaserve responses, whole history", history, url, responses=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(ours(port, 1), url):
        chain(url, 2, False, tag=9997)
        each("deltaserve responses chain from the store (2 chains, 1 slot)", chain, url, other=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(llama_server_binary()), "-m", str(path), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", "8192", "-np", "1", "--jinja", "--no-warmup"]
    with serving(cmd, url):
        history(url, 2, False, tag=9996)
        each("llama-server chat, whole history", history, url)
        try:
            each("llama-server responses, whole history", history, url, responses=True)
        except Exception as e:  # noqa: BLE001 - an older llama-server without /v1/responses
            print(f"[bench] llama-server /v1/responses: {e}", file=sys.stderr)
    result = {"model": path.name, "threads": threads, "turns": turns, "answer_tokens": MAX_TOKENS,
              "summary": {k: summary(v) for k, v in runs.items()}, "runs": runs, "command": a.command_line}
    result["ratios"] = {}
    for think in ("off", "on"):
        mine = result["summary"][f"deltaserve responses chain, thinking {think}"]["turn_n_ttft_s"]
        for k, s in result["summary"].items():
            if k.endswith(f"thinking {think}") and not k.startswith("deltaserve responses chain,"):
                result["ratios"][f"turn {turns} TTFT, responses chain / {k}"] = mine / s["turn_n_ttft_s"]
    out = Path(a.out)
    (out / "responses").mkdir(parents=True, exist_ok=True)
    (out / "responses" / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# A Responses chain against whole history ({path.name}, random weights, {threads} threads)", "",
             f"`{a.command_line}`", "",
             f"{turns} turns of 70-word messages; turns 1..{turns - 1} answer {MAX_TOKENS} tokens, turn {turns} one "
             f"token, so its request's time is its time to the first token (median of {repeats}).", "",
             f"| run | turn {turns} TTFT (ms) | its input tokens | cached |", "|---|---|---|---|"]
    for k, s in result["summary"].items():
        lines.append(f"| {k} | {s['turn_n_ttft_s'] * 1000:.1f} | {s['turn_n_input_tokens']} | "
                     f"{s['turn_n_cached_tokens']} |")
    lines += ["", *(f"- {k}: {v:.2f}x" for k, v in result["ratios"].items())]
    (out / "responses" / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
