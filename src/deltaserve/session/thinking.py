"""Thinking under control: a budget of thinking tokens, effort levels mapped to budgets, and a loop guard.

A turn whose prompt leaves the model inside a thought (the generation header ends in `<think>`, no `</think>` after
it) gets a `Thought`: a step of the turn's decode loop (`Session._decode`) that counts the tokens the model thinks
and, when the budget is spent or the `LoopGuard` sees the thought repeat itself, puts the closing in place of the
next sampled token: an optional bridge sentence (llama.cpp's `--reasoning-budget-message`; Qwen's suggestion for
this case is a sentence telling the model to answer from what it has thought so far), then what the chat template
writes after a thought: `\\n</think>\\n\\n` (the newline left out where the thought already ends in one). Those
tokens are fed like sampled ones, through the same feed, so the state, the next turn's reuse and the state store
hold exactly what was generated plus what was inserted. The answer then runs under its own `max_tokens`.

- **Budget** (`thinking_budget`): None is unlimited (`max_tokens` then bounds thought and answer together, as before);
  N >= 0 thinking tokens at most, and the answer has `max_tokens` of its own after the closing, so a turn generates
  at most N + the closing + `max_tokens` tokens (and never past the context). When the budget is spent the next token
  is still sampled: if it is `</think>` the model closed the thought itself (anything else, an end of turn too, gives
  way to the closing). 0 closes the thought at once (a chat turn
  renders thinking off instead: `rendered_thinking`, the template's own empty block).
- **Effort levels** (OpenAI's `reasoning_effort`, Responses' `reasoning.effort`): `EFFORT_BUDGETS`, configurable
  (`parse_effort_budgets`).
- **Loop guard** (`LoopGuard`): a thought whose last tokens are one unit of p tokens (p <= MAX_PERIOD) written
  REPEATS times in a row, over at least MIN_SPAN tokens, is closed the same way (`reasoning_ended` "loop_guard"): a
  unit of MIN_SPAN / REPEATS tokens or more is caught 2 periods after its repetition began, a shorter one once
  MIN_SPAN tokens repeat (a number's digits, "0000", are not a loop). On by default; `DELTASERVE_LOOP_GUARD=off`
  or `--loop-guard off` turns it off.
- **Grammar after the closing**: a constrained answer (a response_format, a forced tool call) of a turn that thinks
  starts its grammar after the closing, whoever closed the thought (the closing's `\\n\\n` is written by the turn
  where the model closed it); while the model thinks the grammar is not consulted and the turn cannot end.

What a turn reports (`Turn`): `reasoning_tokens` (the thought's tokens the model wrote; never more than the budget),
`reasoning_ended` ("model", "budget", "loop_guard", or "unclosed" where the turn ended inside the thought; None
where the prompt opened none), and `inserted_tokens` (the bridge and the closing the turn wrote).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from deltaserve.errors import DeltaserveError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# thinking tokens per effort level (None: unlimited); none is thinking off
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192,
                                         "xhigh": 32768}
MAX_PERIOD = 512   # the longest repeated unit the loop guard looks for, in tokens
REPEATS = 3        # copies of the unit in a row that make a loop
MIN_SPAN = 64      # and the fewest tokens they cover
CLOSING = "\n</think>\n\n"  # what the chat template writes after a thought (the thought stripped of its last newlines)
PLACEHOLDER = "\ue000"      # stands for a bridge sentence, which is encoded as text (never as a template token)


def check_budget(value, what: str = "thinking_budget") -> int | None:
    """A budget as a turn takes it: None or -1 unlimited, else a count of tokens >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeltaserveError(f"{what} must be a whole number of tokens (-1 or None: unlimited, 0: thinking off), "
                              f"got {value!r}")
    if value < -1:
        raise DeltaserveError(f"{what} must be -1 (unlimited), 0 (thinking off) or more, got {value}")
    return None if value == -1 else value


def rendered_thinking(enable_thinking: bool | None, budget: int | None) -> bool | None:
    """enable_thinking as a chat turn renders it under `budget`: a budget of 0 renders thinking off (the template's
    own empty thought, which the model was trained on), anything else as asked."""
    return False if budget == 0 else enable_thinking


def parse_effort_budgets(text: str | None, base: dict | None = None) -> dict[str, int | None]:
    """`--reasoning-effort-budgets none=0,low=256,...` over the defaults: each level a budget (-1: unlimited)."""
    table = dict(EFFORT_BUDGETS if base is None else base)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        level, sep, count = part.partition("=")
        level = level.strip().lower()
        if not sep or level not in EFFORTS:
            raise DeltaserveError(f"reasoning effort budgets: {part.strip()!r} is not LEVEL=N with LEVEL one of "
                                  f"{', '.join(EFFORTS)}")
        try:
            n = int(count.strip())
        except ValueError:
            raise DeltaserveError(f"reasoning effort budgets: {level}={count.strip()!r} is not a whole number of "
                                  "tokens") from None
        table[level] = check_budget(n, f"reasoning effort budget {level}")
    return table


@dataclass(frozen=True)
class ThinkingDefaults:
    """A server's thinking settings: the budget a request that names none gets (None: unlimited), the bridge
    sentence, and the budget of each effort level."""
    budget: int | None = None
    message: str = ""
    efforts: dict = field(default_factory=lambda: dict(EFFORT_BUDGETS))

    def describe(self) -> str:
        levels = ", ".join(f"{k} {'unlimited' if v is None else v}" for k, v in self.efforts.items())
        said = "unlimited" if self.budget is None else ("off" if self.budget == 0 else f"{self.budget} tokens")
        bridge = f"{self.message!r} and " if self.message else ""
        return (f"thinking budget {said} (--reasoning-budget; a request's reasoning_budget_tokens or "
                f"reasoning_effort wins: {levels}); a thought the budget or the loop guard closes ends with {bridge}"
                f"</think>")


def opens_thought(prompt: Sequence[int], tokenizer) -> bool:
    """Whether `prompt` leaves the model inside a thought: its last `<think>` comes after its last `<|im_start|>`
    (the generation header's) and no `</think>` follows it."""
    start, end = getattr(tokenizer, "think_start_id", None), getattr(tokenizer, "think_end_id", None)
    if start is None or end is None:
        return False
    im = getattr(tokenizer, "im_start_id", None)
    for t in reversed(prompt):
        if t == end or (im is not None and t == im):
            return False
        if t == start:
            return True
    return False


class LoopGuard:
    """Sees a token stream repeat itself: after each token, for every period p up to MAX_PERIOD, how many tokens in a
    row equal the one p before them (a unit of p tokens written r times in a row leaves (r - 1) p). Looping when, for
    some p, that run covers REPEATS copies of the unit and MIN_SPAN tokens. Vectorised over the periods."""

    def __init__(self, max_period: int = MAX_PERIOD, repeats: int = REPEATS, min_span: int = MIN_SPAN):
        p = np.arange(1, max_period + 1)
        self.need = np.maximum((repeats - 1) * p, min_span - p)  # the run period p needs
        self.window = np.full(max_period, -1, dtype=np.int64)    # window[p - 1]: the token p back
        self.run = np.zeros(max_period, dtype=np.int64)
        self.tokens = 0
        self.found: tuple[int, int] | None = None  # (the unit's tokens, its copies) once looping

    def push(self, token: int) -> bool:
        """Take the next token; True once the stream loops (then `found` says how)."""
        self.run = np.where(self.window == token, self.run + 1, 0)
        self.window[1:] = self.window[:-1]
        self.window[0] = token
        self.tokens += 1
        hit = np.flatnonzero(self.run >= self.need)
        if hit.size and self.found is None:
            p = int(hit[0]) + 1
            self.found = (p, (int(self.run[p - 1]) + p) // p)
        return hit.size > 0


class Thought:
    """One turn's thought under control (see the module's notes). The decode loop hands each sampled token to `step`
    (which puts the closing's next token in its place while one is being written, or where the budget is spent or
    the thought loops) and, once the token is out, asks `after` for its token budget."""

    def __init__(self, tokenizer, *, budget: int | None, message: str | None, guard: LoopGuard | None,
                 max_tokens: int, stop_ids, grammar: bool):
        self.tok = tokenizer
        self.end_id = tokenizer.think_end_id
        self.budget = budget
        self.message = (message or "").strip("\n")
        self.guard = guard
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.grammar = grammar
        self.written = 0            # the thought's tokens the model wrote
        self.inserted = 0           # tokens the turn wrote in its place (the bridge and the closing)
        self.closed_by_model = False
        self.ended: str | None = None  # "model", "budget", "loop_guard"
        self.pending: list[int] = []
        self.open = False           # the closing is behind: the answer (and its grammar) has begun
        self.newline = False        # the thought's text so far ends in a newline
        # the most tokens the turn may generate before its answer's own bound is known (the context aside)
        most = max_tokens if budget is None else budget + len(self.closing_ids(False)) + max_tokens
        self.own_bound = most

    # -- what is inserted -------------------------------------------------------------------------
    def closing_ids(self, newline: bool) -> list[int]:
        """The bridge sentence (as text, never a template token) and the template's closing, after a thought whose
        text ends in a newline (`newline`) or not."""
        lead = "" if newline else "\n"
        bridge = lead + self.message + "\n" if self.message else lead
        ids = self.tok.encode_literal(PLACEHOLDER, {PLACEHOLDER: bridge}) if bridge else []
        return ids + [self.end_id] + self.tok.encode(CLOSING.split("</think>", 1)[1])

    def _close(self, why: str) -> None:
        self.ended = why
        self.pending = self.closing_ids(self.written > 0 and self.newline)

    # -- the decode loop's hooks ------------------------------------------------------------------
    @property
    def answering(self) -> bool:
        """The thought is closed and its closing written: the answer (and its grammar) has begun."""
        return self.open

    def step(self, token: int) -> int:
        """The token this step takes in place of the one sampled (`token`): the closing's next token while one is
        being written, else `take(token)`."""
        if self.pending:
            self.inserted += 1
            return self.pending.pop(0)
        return self.take(token)

    def take(self, token: int) -> int:
        """A sampled token: itself, or the closing's first token where the budget is spent (a `</think>` sampled
        then is the model's own close). A thought that loops is closed after its token."""
        if self.ended is not None:
            return token
        if token == self.end_id:
            self.ended, self.closed_by_model = "model", True
            if self.grammar:  # the template's blank line, then the grammar's answer (as after a forced close)
                self.pending = self.tok.encode(CLOSING.split("</think>", 1)[1])
            return token
        if self.budget is not None and self.written >= self.budget:  # a stop token too: the answer is still due
            self._close("budget")
            return self.step(token)
        if token in self.stop_ids:
            return token
        self.written += 1
        self.newline = self.tok.decode([token]).endswith("\n")
        if self.guard is not None and self.guard.push(token):
            self._close("loop_guard")
        return token

    def after(self, budget: int, generated: int) -> int:
        """The turn's token budget once its `generated`th token is out (taken, accepted by the grammar, handed
        out): when that token ends the closing, the answer begins, under its own `max_tokens` where the thought had
        a budget."""
        if self.ended is None or self.pending or self.open:
            return budget
        self.open = True
        if self.budget is None:
            return budget
        self.own_bound = min(self.own_bound, generated + self.max_tokens)
        return min(budget, self.own_bound)

    def gate(self, constraint):
        """The turn's grammar, consulted only once the thought is closed (None stays None)."""
        return None if constraint is None else _Gated(constraint, self)

    def notice(self) -> str | None:
        """The log line of a loop the guard closed (None otherwise)."""
        if self.ended != "loop_guard" or self.guard is None or self.guard.found is None:
            return None
        p, r = self.guard.found
        return (f"[deltaserve] loop guard: the thought repeated a unit of {p} tokens {r} times in a row; closed "
                f"after {self.written} thinking tokens")

    def report(self, turn) -> None:
        """What the thought was, onto the turn."""
        turn.reasoning_tokens = self.written
        turn.reasoning_ended = self.ended or "unclosed"
        turn.inserted_tokens = self.inserted
        turn.closing_tokens = self.inserted + int(self.closed_by_model)


class _Gated:
    """A grammar that sleeps while the model thinks: no mask but the stop tokens' (a constrained turn cannot end
    inside its thought), every token accepted, nothing rolled back; the grammar itself once the thought is closed."""

    def __init__(self, constraint, thought: Thought):
        self.inner, self.thought = constraint, thought

    def done(self) -> bool:
        return self.thought.answering and self.inner.done()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.thought.answering:
            return self.inner.mask(logits)
        row = logits.detach().reshape(-1).float().clone()
        stops = [s for s in self.thought.stop_ids if 0 <= s < row.numel()]
        if stops:
            row[stops] = float("-inf")
        return row

    def accept(self, token: int) -> bool:
        return self.inner.accept(token) if self.thought.answering else True

    def rollback(self, tokens: int) -> None:
        if self.thought.answering:
            self.inner.rollback(tokens)


def start(session, prompt: Sequence[int], max_tokens: int, budget: int | None, message: str | None, stop_ids,
          grammar: bool) -> Thought | None:
    """The thought of a turn whose prompt opens one (None otherwise: nothing in the turn changes)."""
    budget = check_budget(budget)
    if not opens_thought(prompt, session.tokenizer):
        return None
    guard = LoopGuard() if session.loop_guard else None
    return Thought(session.tokenizer, budget=budget, message=message, guard=guard, max_tokens=max_tokens,
                   stop_ids=stop_ids, grammar=grammar)
