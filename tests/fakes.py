"""Test-side counters wrapped around production code (production code carries no test hooks)."""

from __future__ import annotations

from deltaserve.session import decoding as decode_mod
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


def record_prompt_logits(monkeypatch) -> list:
    """A list that gains, per turn from now on, the logits its first token was sampled from (the prompt's last)."""
    seen: list = []
    real = decode_mod.Sampler  # the decode loop's (session/decoding.py)

    class Recording(real):
        def __call__(self, logits, prompt, generated):
            if not generated:
                seen.append(logits.detach().float().clone())
            return super().__call__(logits, prompt, generated)

    monkeypatch.setattr(decode_mod, "Sampler", Recording)
    return seen
