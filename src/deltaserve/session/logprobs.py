"""Log-probabilities: what the model gave each token, computed where the sampler sees the logits.

A generated token's log-probability is the log-softmax, in f32, of the row of logits the sampler was handed for it:
the model's logits after the grammar's mask (a token the response_format or an enforced tool choice forbids has no
probability), before the sampler's own changes (repetition, presence and frequency penalties, temperature, top-k,
top-p, min-p): the model's distribution, as vLLM's default and OpenAI's report it. `top` more: the most likely tokens
of that row and theirs, most likely first (at most MAX_TOP).

A prompt's own tokens (`echo` on completions, what evaluation harnesses score) come from the prefill's rows: the
engine loop hands every chunk's rows over (`runtime.engine.Prefill.rows`) and they are reduced here at once, so no
second forward runs and no prompt's rows are held whole. The first prompt token has none (nothing predicts it).

`Recorder` is one turn's: `add` is the decode loop's hook (Session._decode), `on_rows` the prefill's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

MAX_TOP = 20


@dataclass
class TokenLogprob:
    """One token's log-probability, and the `top` tokens of its row: (id, log-probability), most likely first."""
    id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def score_rows(rows: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each row's log-softmax at its target (row i scores targets[i]), in f32, and its `top` best."""
    x = rows.detach().reshape(len(targets), -1).float()
    lse = torch.logsumexp(x, dim=1)
    ids = torch.tensor(list(targets), dtype=torch.long, device=x.device)
    chosen = (x.gather(1, ids[:, None])[:, 0] - lse).tolist()
    if top > 0:
        vals, idx = torch.topk(x, min(top, x.shape[1]), dim=1)
        vals = (vals - lse[:, None]).tolist()
        idx = idx.tolist()
        tops = [list(zip(i, v)) for i, v in zip(idx, vals)]
    else:
        tops = [[] for _ in targets]
    return [TokenLogprob(int(t), float(c), t_) for t, c, t_ in zip(targets, chosen, tops)]


class Recorder:
    """One turn's log-probabilities: `entries` for the generated tokens (in order), `stop` for the stop token that
    ended the turn (kept apart: it is no part of the answer's text; OpenAI's completions list it, chat does not),
    `prompt` for the prompt's tokens when `echo` asked for them (None for the first)."""

    def __init__(self, top: int = 0, echo: bool = False):
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top log-probabilities must be 0 to {MAX_TOP}, got {top}")
        self.top = top
        self.echo = echo
        self.entries: list[TokenLogprob] = []
        self.prompt: list[TokenLogprob | None] = []
        self.stop: TokenLogprob | None = None  # the stop token that ended the turn (no part of the answer's text)
        self._prompt_ids: list[int] = []

    # -- the decode loop's hook ---------------------------------------------------------------------
    def add(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """The token the sampler chose from `logits` (the row it was handed)."""
        entry = score_rows(logits, [token], self.top)[0]
        self.entries.append(entry)
        return entry

    # -- the prefill's hook -------------------------------------------------------------------------
    def start_prompt(self, prompt: Sequence[int]) -> None:
        self._prompt_ids = list(prompt)
        self.prompt = [None] * len(self._prompt_ids)

    def on_rows(self, rows: torch.Tensor, position: int) -> None:
        """A prefill chunk's rows, the first at `position`: row j predicts the prompt's token at position + j + 1
        (the last prompt row predicts the answer's first token: the decode loop scores that one)."""
        rows = rows.reshape(-1, rows.shape[-1])
        n = min(rows.shape[0], len(self._prompt_ids) - 1 - position)
        if n <= 0:
            return
        targets = self._prompt_ids[position + 1:position + 1 + n]
        for j, e in enumerate(score_rows(rows[:n], targets, self.top)):
            self.prompt[position + 1 + j] = e

    def settle(self, tokens: int) -> None:
        """The turn ended with `tokens` generated: a sampled token past them (the stop token) is kept apart."""
        if len(self.entries) > tokens:
            self.stop = self.entries[tokens]
            del self.entries[tokens:]

    @property
    def prompt_complete(self) -> bool:
        return all(e is not None for e in self.prompt[1:])
