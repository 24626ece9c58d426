"""How many tokens a session drafts with the MTP block per step: the number that pays, from what it measured.

A step that drafts k tokens costs k draft steps and one verification of k+1 rows, and yields 1 + a_1 + a_1 a_2 +
... + a_1...a_k tokens, a_i being how often the i-th draft is accepted when the ones before it were. The policy
keeps running averages of those acceptances and of the measured times (a verification per row count, a draft
step), and each step picks the k in 0..most with the most tokens per second; k = 0 is a plain decode step (its
time: the one-row verification's). At k = 0 it drafts one token again every PROBE_EVERY steps, so that a
conversation whose text becomes predictable gets its drafts back.

Exactness does not depend on any of this: the verification decides every token (`Session._decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DRAFTS = 3  # at most, when the file carries an MTP block and nothing was asked
PROBE_EVERY = 16
WEIGHT = 0.2  # of a new measurement in a running average


@dataclass
class DraftPolicy:
    most: int
    accept: list[float] = field(default_factory=list)  # a_i, i = 1..most
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a verification
    draft_s: float | None = None
    since_probe: int = 0
    drafted: int = 0   # in all, since the session started
    accepted: int = 0

    def __post_init__(self) -> None:
        if not self.accept:
            self.accept = [0.7] * self.most  # optimistic until measured: the first steps draft

    @classmethod
    def learned_from(cls, other: "DraftPolicy | None", most: int) -> "DraftPolicy":
        """A policy for a new session that starts from what another session of the same model measured: its times
        and acceptances (the counts start at 0)."""
        if other is None:
            return cls(most)
        accept = (list(other.accept) + [other.accept[-1] if other.accept else 0.7] * most)[:most]
        return cls(most, accept=accept, verify_s=dict(other.verify_s), draft_s=other.draft_s)

    def _verify(self, rows: int) -> float | None:
        if rows in self.verify_s:
            return self.verify_s[rows]
        if 1 in self.verify_s:  # unmeasured: a verification reads the weights once, each row adds ~a tenth
            return self.verify_s[1] * (1.0 + 0.1 * (rows - 1))
        known = sorted(self.verify_s)
        if known:
            r = known[0]
            return self.verify_s[r] / (1.0 + 0.1 * (r - 1)) * (1.0 + 0.1 * (rows - 1))
        return None

    def expected_tokens(self, k: int) -> float:
        total, chain = 1.0, 1.0
        for a in self.accept[:k]:
            chain *= a
            total += chain
        return total

    def choose(self, room: int) -> int:
        """The draft count for the next step, at most `room` (positions and budget left)."""
        most = max(0, min(self.most, room))
        if most == 0:
            return 0
        base = self._verify(1)
        if base is None or self.draft_s is None:
            return most
        best, best_rate = 0, 1.0 / base
        for k in range(1, most + 1):
            rate = self.expected_tokens(k) / (self._verify(k + 1) + k * self.draft_s)
            if rate > best_rate * 1.001:
                best, best_rate = k, rate
        if best == 0:
            self.since_probe += 1
            if self.since_probe >= PROBE_EVERY:
                self.since_probe = 0
                return 1
        return best

    def record(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """A step drafted `drafted` tokens (in draft_s seconds) of which the first `accepted` were kept, and verified
        drafted + 1 rows in verify_s seconds."""
        rows = drafted + 1
        old = self.verify_s.get(rows)
        self.verify_s[rows] = verify_s if old is None else old + WEIGHT * (verify_s - old)
        if drafted:
            per = draft_s / drafted
            self.draft_s = per if self.draft_s is None else self.draft_s + WEIGHT * (per - self.draft_s)
            for i in range(min(accepted + 1, drafted)):  # the drafts that were decided: up to the first rejected
                hit = 1.0 if i < accepted else 0.0
                self.accept[i] += WEIGHT * (hit - self.accept[i])
        self.drafted += drafted
        self.accepted += accepted
