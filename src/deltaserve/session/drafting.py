"""How many tokens a session drafts with the MTP block per step: the number that pays, as measured.

A step that drafts k tokens runs k draft steps and one verification of k+1 rows, then samples the rows it keeps;
a plain step (k = 0) decodes one token. What a step with k drafts yields per second depends on the model (what a
verification row and a draft step cost against a decode step, Python's share of each) and on the text (how many
drafts are kept), so the policy does not model it: it measures it. Each step's wall time, from its feed to the
next step's, and the tokens it produced, kept as a running average of tokens per second per k; each step takes
the k with the best, each k in 0..most tried once first, and a neighbour of the best tried again every
PROBE_EVERY steps (the text changes: a predictable stretch gets its drafts back). Where plain steps stay OFF_MARGIN
faster than the best drafting ones after OFF_AFTER steps (a model so small that the draft steps and the MTP block's
cache cost more than they save), drafting is given up for the model, and said. The acceptance per draft position
is kept too, for what the session reports.

Exactness does not depend on any of this: the verification decides every token (`Session._decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DRAFTS = 3  # at most, when the file carries an MTP block and nothing was asked
PROBE_EVERY = 16
WEIGHT = 0.25  # of a new acceptance in its running average
DECAY = 0.05  # of the tokens and seconds measured for a draft count, per step with that count
OFF_AFTER = 24  # steps measured before drafting may be given up
OFF_MARGIN = 1.15  # plain steps this much faster than the best drafting ones: drafting is given up


@dataclass
class DraftPolicy:
    most: int
    rate: dict[int, float] = field(default_factory=dict)  # k -> tokens per second of a step with k drafts
    sums: dict[int, tuple[float, float]] = field(default_factory=dict)  # k -> (tokens, seconds), decayed
    accept: list[float] = field(default_factory=list)    # per draft position: how often it was kept (reported)
    steps: int = 0
    drafted: int = 0   # in all, since the session started
    accepted: int = 0
    off: bool = False  # drafts measured not to pay: given up (the MTP cache no longer followed either)

    def __post_init__(self) -> None:
        if not self.accept:
            self.accept = [0.0] * self.most

    @classmethod
    def learned_from(cls, other: "DraftPolicy | None", most: int) -> "DraftPolicy":
        """A policy for a new session that starts from what another session of the same model measured (its rates
        and acceptances; the counts start at 0)."""
        if other is None:
            return cls(most)
        # dict() and list() copy in one step under the interpreter lock: another slot's session may be recording
        rate, sums, accept = dict(other.rate), dict(other.sums), list(other.accept)
        accept = (accept + [0.0] * most)[:most]
        return cls(most, rate={k: v for k, v in rate.items() if k <= most},
                   sums={k: v for k, v in sums.items() if k <= most}, accept=accept, off=other.off,
                   steps=other.steps)

    def choose(self, room: int) -> int:
        """The draft count for the next step, at most `room` (positions and budget left)."""
        most = max(0, min(self.most, room))
        if most == 0:
            return 0
        self.steps += 1
        for k in range(most, -1, -1):  # each count measured once, the most drafts first
            if k not in self.rate:
                return k
        best = max(range(most + 1), key=lambda k: self.rate[k])
        if self.steps % PROBE_EVERY == 0:  # a neighbour again, up first
            return best + 1 if best < most else best - 1
        return best

    def record_step(self, k: int, tokens: int, seconds: float) -> None:
        """A step with k drafts produced `tokens` tokens in `seconds` (its feed to the next step's)."""
        if seconds <= 0:
            return
        # decayed sums of tokens and seconds: a step's share is its time's (a plain step that also wrote the MTP
        # block's pending rows weighs what it cost), recent steps count more
        t, sec = self.sums.get(k, (0.0, 0.0))
        t, sec = t * (1 - DECAY) + tokens, sec * (1 - DECAY) + seconds
        self.sums[k] = (t, sec)
        self.rate[k] = t / sec
        drafting = [v for j, v in self.rate.items() if j > 0]
        if self.steps >= OFF_AFTER and 0 in self.rate and drafting and self.rate[0] > OFF_MARGIN * max(drafting):
            self.off = True

    def why_off(self) -> str:
        best = max((j for j in self.rate if j > 0), key=lambda j: self.rate[j])
        return (f"{self.rate[0]:.0f} tokens/s without drafts against {self.rate[best]:.0f} with the best count "
                f"({best}) over {self.steps} steps")

    def record_drafts(self, drafted: int, accepted: int) -> None:
        """A verification kept the first `accepted` of `drafted` drafts."""
        for i in range(min(accepted + 1, drafted)):  # the drafts that were decided: up to the first refused
            hit = 1.0 if i < accepted else 0.0
            self.accept[i] += WEIGHT * (hit - self.accept[i])
        self.drafted += drafted
        self.accepted += accepted
