"""Generated text as it streams: held back where it may be the start of a marker, split at markers.

One helper (`held_tail`) serves both users: stop strings (the text is cut at the first one) and the
`</think>` that ends a model's reasoning (`ReasoningSplitter`).
"""

from __future__ import annotations

THINK_END = "</think>"


def held_tail(text: str, markers: list[str]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers` (so must be held back)."""
    hold = 0
    longest = max((len(m) - 1 for m in markers), default=0)
    for j in range(1, min(longest, len(text)) + 1):
        tail = text[-j:]
        if any(m.startswith(tail) for m in markers):
            hold = j
    return hold


class StopCutter:
    """Text handed out as it comes, cut at the first stop string (not included); a tail that may start one is
    held back until it is known not to."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """(text to hand out, whether a stop string was hit)."""
        self.pending += text
        hits = [(k, s) for s in self.stops if (k := self.pending.find(s)) >= 0]
        if hits:
            out = self.pending[:min(hits)[0]]
            self.pending, self.stopped = "", True
            return out, True
        keep = held_tail(self.pending, self.stops)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class ReasoningSplitter:
    """Splits generated text into reasoning (before `</think>`) and content, as it streams. `thinking`: whether
    the prompt opened a reasoning block (the rendered prompt ends in `<think>\\n`)."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.opening = False  # just past </think>: the newlines that follow it are markup, not the answer
        self.buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to hand out for this piece."""
        if not self.in_reasoning:
            if self.opening:
                text = text.lstrip("\n")
                self.opening = not text
            return "", text
        self.buf += text
        k = self.buf.find(THINK_END)
        if k >= 0:
            reasoning, rest = self.buf[:k], self.buf[k + len(THINK_END):]
            self.buf, self.in_reasoning, self.opening = "", False, True
            return reasoning, self.push(rest)[1]
        keep = held_tail(self.buf, [THINK_END])
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def flush(self) -> tuple[str, str]:
        out, self.buf = self.buf, ""
        return (out, "") if self.in_reasoning else ("", out)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None where the prompt opened no reasoning block, content) of a whole generation."""
    s = ReasoningSplitter(thinking)
    r1, c1 = s.push(text)
    r2, c2 = s.flush()
    return ((r1 + r2).strip() if thinking else None), (c1 + c2)


def opens_reasoning(rendered_prompt: str) -> bool:
    """Whether a rendered chat prompt leaves the model inside a reasoning block."""
    return rendered_prompt.rstrip(" ").endswith("<think>\n")
