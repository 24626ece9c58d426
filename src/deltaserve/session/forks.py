"""Several choices of one prompt (`n > 1`): the prompt prefilled once, its state forked.

The session's turn prefills the prompt as it would for one answer; then (the hook in `Session._turn`) `Forks.start`
copies the state after the prompt into n - 1 states of their own, each exactly as large as the prompt and its
budget, and hands each to the engine loop as a sequence of its own, decoding from the same last row of logits with
the session's own decode loop (`Session._decode` on a child that shares the model and the backend and owns nothing
else: no checkpoint, no store, no drafting). The turn decodes choice 0 itself. Every step of the loop then runs the
rows of all the choices in one forward (one native call takes up to 8 rows: hence at most 8 choices).

Choice i samples with the seed `seed + i` where the request gave one (each choice is then the answer a request with
that seed alone gets: the same prompt's logits, the same sampler), with a seed of its own otherwise. A client that
leaves cancels every choice; a turn that fails cancels the forks it started.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Callable, Sequence

from deltaserve.engine.state import DecodeState
from deltaserve.errors import CapacityError


class Forks:
    """The n - 1 choices after the first: their token sinks and log-probability recorders, started by `start` from
    the turn, gathered by `wait` (each as (tokens, text, finish, ttft, decode seconds, context cut))."""

    def __init__(self, sinks: Sequence[Callable], recorders: Sequence, cancel: threading.Event | None = None):
        self.sinks = list(sinks)
        self.recorders = list(recorders)
        self.cancel = cancel or threading.Event()
        self._own_cancel = cancel is None
        self.sequences: list = []
        self.engine = None
        self.limited = False

    def __len__(self) -> int:
        return len(self.sinks)

    def start(self, session, prompt: list[int], logits, budget: int, limited: bool, params, stop_ids, stop_texts,
              t0: float, grammar, thought=None) -> None:
        """Fork the state the turn holds after `prompt` (its last row `logits`) n - 1 ways, each a sequence of the
        engine loop. `thought(child)`: a fork's own thinking budget and loop guard (session/thinking.py), where the
        prompt opens a thought."""
        n = len(self.sinks)
        positions = len(prompt) + budget
        need = n * DecodeState.bytes_for(session.host.config, positions, kv_type=session.kv_type)
        free = session._memory().free
        if need > free:
            raise CapacityError(f"{n + 1} choices need {n} more decode states of {positions} positions "
                                f"({need >> 20} MiB) and {free >> 20} MiB are free: ask for fewer choices or tokens")
        backend = session.backend
        shared = backend.save(session.state, None, exact=True)  # the prompt's state, copied once, restored n times
        self.engine, self.limited = backend.engine, limited
        for i in range(n):
            child = copy.copy(session)
            child._lock = threading.Lock()
            child.state = backend.new_state(positions, None, session.kv_dtype)  # the parent's KV type
            backend.restore(child.state, shared, 0)
            child.held = list(prompt)
            child._checkpoint, child._checkpoint_tokens, child._checkpoint_stored = None, (), False
            child._resume, child.store, child._forks = None, None, None
            child._policy, child._snaps, child._turn_drafts = None, None, (0, 0)
            child._recorder = self.recorders[i]
            child.label = f"{session.label + ' ' if session.label else ''}choice {i + 1}"
            seeded = dataclasses.replace(params, seed=params.seed + i + 1) if params.seed is not None else \
                dataclasses.replace(params, seed=None)
            gen = _choice(child, prompt, logits.clone(), budget, seeded, set(stop_ids), list(stop_texts),
                          self.sinks[i], t0, grammar, thought(child) if thought is not None else None)
            self.sequences.append(self.engine.submit(gen, self.cancel, child.label))

    def abandon(self) -> None:
        """The turn failed: its forks stop at their next step."""
        if self.sequences:
            self.cancel.set()
            for s in self.sequences:
                try:
                    self.engine.wait(s)
                except Exception:  # noqa: BLE001 - each fork's own failure is not the turn's
                    pass

    def wait(self) -> list[tuple]:
        return [self.engine.wait(s) for s in self.sequences]


def _choice(child, prompt, logits, budget, params, stop_ids, stop_texts, on_token, t0, grammar, thought):
    """One fork's decode, as a sequence of the engine loop: the session's own loop on the child's state."""
    try:
        tokens, text, finish, ttft, decode_s = yield from child._decode(prompt, logits, budget, params, stop_ids,
                                                                        stop_texts, on_token, t0, grammar, thought)
    finally:
        child.state = None  # its buffers go with it
    return tokens, text, finish, ttft, decode_s


def fork_turn(parent_turn, result: tuple, limited: bool, turn_type):
    """A fork's Turn: what it generated, on the parent's prompt (nothing of the prompt prefilled again)."""
    tokens, text, finish, ttft, decode_s = result
    out = turn_type(tokens=tokens, text=text, reused=parent_turn.reused, prefilled=0,
                    prompt_tokens=parent_turn.prompt_tokens, finish_reason=finish,
                    context_capped=finish == "length" and limited, backend=parent_turn.backend, start="fork")
    out.timings.ttft_s, out.timings.decode_s = ttft, decode_s
    return out
