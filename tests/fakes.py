"""Test-side counters wrapped around production code (production code carries no test hooks)."""

from __future__ import annotations

from deltaserve.engine.state import DecodeState


def count_state_allocations(monkeypatch) -> list:
    """A list that gains one entry per DecodeState allocated from now on (in this test)."""
    made: list = []
    real = DecodeState.__init__

    def counting(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self.capacity)

    monkeypatch.setattr(DecodeState, "__init__", counting)
    return made
