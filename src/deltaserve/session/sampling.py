"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, penalties, a seed that reproduces."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from deltaserve.errors import DeltaserveError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        bad = []
        if self.temperature < 0:
            bad.append(f"temperature {self.temperature} < 0")
        if self.top_k is not None and self.top_k < 1:
            bad.append(f"top_k {self.top_k} < 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad.append(f"top_p {self.top_p} outside (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad.append(f"min_p {self.min_p} outside [0, 1]")
        if self.repetition_penalty <= 0:
            bad.append(f"repetition_penalty {self.repetition_penalty} <= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad.append(f"{name} {getattr(self, name)} outside [-2, 2]")
        if bad:
            raise DeltaserveError("invalid sampling parameters: " + "; ".join(bad))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def best(x: torch.Tensor) -> int:
    """The index of a 1-D row's largest value, the first of equals (torch.argmax's answer, NaN counting as largest):
    torch.max over the dimension, a third of argmax's time on a 248,320-entry row (0.12 against 0.37 ms on two
    Xeon threads), paid once a greedy token."""
    return int(torch.max(x, 0).indices)


class Sampler:
    """Samples from logits; one per generation so a seed reproduces the whole generation."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(int(params.seed))
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int]) -> int:
        p = self.params
        if p.greedy and p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
            return best(logits.detach().reshape(-1))  # no copy of the row (a batch's rows are views)
        x = logits.detach().float().reshape(-1).cpu().clone()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
            if seen.numel():
                vals = x[seen]
                x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and generated:
            counts = Counter(generated)
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor([counts[i] for i in counts], dtype=torch.float32)
            x[ids] -= p.presence_penalty + p.frequency_penalty * n
        if p.greedy:
            return best(x)
        # in float64 and from the row's maximum: a temperature as small as 1e-38 (or 5e-324) divides to -inf for
        # every other token and 0 for the best, never to inf - inf = NaN (it sampled "probability tensor contains
        # inf/nan" and the server answered 500)
        x = (x.double() - x.max()) / p.temperature
        if p.top_k is not None and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p is not None and p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = sorted_probs.cumsum(0)
            drop = cum - sorted_probs >= p.top_p  # keep the smallest set whose mass reaches top_p
            drop[0] = False  # and the most likely token always (a top_p of 5e-324 kept none)
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p is not None and p.min_p > 0:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        total = probs.sum()
        if not bool(torch.isfinite(total)) or total <= 0:  # nothing left to sample from: the most likely token
            return int(torch.argmax(x))
        return int(torch.multinomial(probs / total, 1, generator=self.generator))
