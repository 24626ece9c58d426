"""Log-probabilities as each API writes them (computed by the session: deltaserve/session/logprobs.py).

- chat completions: `choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...],
  "refusal": null}`, every generated token (the reasoning's and a call's markup too: they are tokens the model
  wrote), streamed with the chunk that carries the token's text;
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, with `echo` the
  prompt's tokens first (the first one's null: nothing predicts it); `top_logprobs` holds the row's best k and the
  chosen token (vLLM's form: k or k + 1 entries);
- Responses: an `output_text` part's `logprobs` (the chat form), and each `response.output_text.delta`'s.

A log-probability that is not finite (a token the grammar's mask forbade, listed in a top k larger than what it
allowed) is written as -9999.0, as OpenAI writes it: JSON has no -Infinity.
"""

from __future__ import annotations

import math

FLOOR = -9999.0


def _lp(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def token_bytes(tokenizer, i: int) -> bytes:
    try:
        return tokenizer.token_bytes(i) if 0 <= i < tokenizer.vocab_size else b""
    except (IndexError, KeyError, ValueError):
        return b""


def token_text(tokenizer, i: int) -> str:
    return token_bytes(tokenizer, i).decode("utf-8", "replace")


def _top_entry(tokenizer, i: int, lp: float) -> dict:
    b = token_bytes(tokenizer, i)
    return {"token": b.decode("utf-8", "replace"), "logprob": _lp(lp), "bytes": list(b)}


def chat_entries(entries, tokenizer) -> list[dict]:
    """The chat (and Responses) form of some generated tokens' log-probabilities."""
    out = []
    for e in entries:
        item = _top_entry(tokenizer, e.id, e.logprob)
        item["top_logprobs"] = [_top_entry(tokenizer, i, lp) for i, lp in e.top]
        out.append(item)
    return out


def chat_logprobs(entries, tokenizer) -> dict:
    return {"content": chat_entries(entries, tokenizer), "refusal": None}


class CompletionLogprobs:
    """The completions form, built up as tokens come (a stream's chunks each carry theirs): `text_offset` counts
    characters of the whole text from its start (the prompt's too, with echo)."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset

    def take(self, entries) -> dict:
        """`entries`: TokenLogprob, or None for a prompt token nothing scores (the first)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            if e is None:  # the prompt's first token: its text, and no log-probability
                continue
            text = token_text(self.tokenizer, e.id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            out["token_logprobs"].append(_lp(e.logprob))
            top: dict[str, float] = {}
            for i, lp in e.top:  # most likely first: tokens of the same text share a key, the likelier's value
                top.setdefault(token_text(self.tokenizer, i), _lp(lp))
            top.setdefault(text, _lp(e.logprob))
            out["top_logprobs"].append(top)
        return out

    def prompt(self, ids: list[int], entries) -> dict:
        """The prompt's tokens (echo): the first with a null log-probability."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in zip(ids, entries):
            if e is None:
                text = token_text(self.tokenizer, i)
                out["tokens"].append(text)
                out["text_offset"].append(self.offset)
                self.offset += len(text)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                one = self.take([e])
                for k in out:
                    out[k] += one[k]
        return out


def joined(a: dict | None, b: dict) -> dict:
    """Two completions-form pieces as one (the prompt's, then the answer's)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
