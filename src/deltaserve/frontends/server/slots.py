"""Slots: resident sessions over one shared host model, a bounded queue in front of them.

A request goes to the free slot whose held tokens share the longest prefix with its prompt, else to the
least recently used free slot; with none free it waits in a bounded queue; a full queue is refused. Affinity counts
only within a partition (a tenant and cache salt, frontends/server/tenants.py): a slot whose session last served
another partition is worth nothing to this one (its session starts afresh, never from the other's tokens).
Everything here runs on the event loop thread; generations run in worker threads.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    pass


@dataclass
class Slot:
    index: int
    session: object
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    requests: int = 0
    partition: str | None = None  # whose conversation the session last held

    def affinity(self, prompt: list[int], partition: str | None = None) -> int:
        """Prompt tokens this slot's session would not prefill again. A recurrent state cannot roll back, so
        a partial common prefix is worth nothing: only the whole held sequence or the checkpoint counts; and
        another partition's tokens are worth nothing at all."""
        if partition != self.partition:
            return 0
        if partition is None:
            return self.session.reusable(prompt)
        return self.session.reusable(prompt, partition=partition)


class SlotPool:
    def __init__(self, sessions: list, queue_size: int):
        self.slots = [Slot(i, s) for i, s in enumerate(sessions)]
        self.queue_size = queue_size
        self._waiters: deque[tuple[list[int], str | None, asyncio.Future]] = deque()

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    def _pick(self, prompt: list[int], partition: str | None = None) -> Slot | None:
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        scored = [(s.affinity(prompt, partition), s) for s in free]
        reuse, best = max(scored, key=lambda p: (p[0], -p[1].last_used))
        if reuse == 0:
            best = min(free, key=lambda s: s.last_used)  # least recently used
        return best

    def _take(self, slot: Slot, partition: str | None = None) -> Slot:
        slot.busy = True
        slot.requests += 1
        slot.partition = partition
        return slot

    async def acquire(self, prompt: list[int], partition: str | None = None) -> Slot:
        if not self._waiters:
            slot = self._pick(prompt, partition)
            if slot is not None:
                return self._take(slot, partition)
        if self.waiting >= self.queue_size:
            raise QueueFull()
        fut = asyncio.get_running_loop().create_future()
        entry = (prompt, partition, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as the client left
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass
            raise

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()
        while self._waiters:
            prompt, partition, fut = self._waiters.popleft()
            if fut.done():
                continue
            chosen = self._pick(prompt, partition)
            fut.set_result(self._take(chosen, partition))
            return
