"""The public entry points: `deltaserve.load(path)` and the model it returns."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from .engine.backend import Backend, select_backend
from .engine.forward import Forward
from .model.loader import HostModel, cached_host, load_host
from .session import Session, Turn


class Model:
    """A loaded Qwen3.5 hybrid: config, tokenizer, host weights; sessions run on it."""

    def __init__(self, host: HostModel, device: str = "cpu"):
        self.host = host
        self.device = device
        self._cpu_forward: Forward | None = None
        self._accelerators: dict[str, Backend] = {}  # uploaded once per device, shared by sessions

    @property
    def config(self):
        return self.host.config

    @property
    def tokenizer(self):
        return self.host.tokenizer

    @property
    def path(self):
        return self.host.path

    def _reference_forward(self) -> Forward:
        if self._cpu_forward is None:
            self._cpu_forward = Forward(self.host.config, self.host.weights, "cpu")
        return self._cpu_forward

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 logits, teacher-forced on a fresh state (the CPU forward)."""
        ids = list(ids)
        if not ids:
            raise ValueError("logits() needs at least one token")
        f = self._reference_forward()
        state = f.new_state(len(ids))
        return f.prefill(state, ids, all_logits=True)

    def backend(self, device: str | None = None) -> tuple[Backend, str | None]:
        """The backend for `device`; an accelerator's (weights uploaded) is made once and shared."""
        backend, notice = select_backend(self.host, device or self.device)
        if backend.accelerator:
            backend = self._accelerators.setdefault(backend.name, backend)
        return backend, notice

    def session(self, context: int | None = None, device: str | None = None, backend: Backend | None = None,
                guard=None, quiet: bool = False, one_call: bool = False, plan_memory=None,
                plan_positions: int | None = None) -> Session:
        """A resident session: its state starts at 4096 positions and grows by doubling."""
        notice = None
        if backend is None:
            backend, notice = self.backend(device)
        if guard is None and backend.accelerator:
            from .engine.guard import ParityGuard
            guard = ParityGuard()
        s = Session(self.host, backend, context=context, one_call=one_call, guard=guard, quiet=quiet,
                    plan_memory=plan_memory, plan_positions=plan_positions)
        if notice:
            s.notices.insert(0, notice)
        return s

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 256, **kwargs) -> Turn:
        """One call on a one-call session sized to the call exactly."""
        session_kw = {k: kwargs.pop(k) for k in ("device", "backend", "quiet", "context") if k in kwargs}
        session_kw.setdefault("quiet", True)
        return self.session(one_call=True, **session_kw).generate(prompt_ids, max_tokens=max_tokens, **kwargs)


def load(path: str | os.PathLike, device: str = "cpu", threads: int | None = None, cache: bool = True,
         weights: str | None = None) -> Model:
    """Load a Qwen3.5 GGUF file or HF directory. `threads` sets torch's CPU threads. `weights`: "fast"
    (default: quantized tensors as int8 tables, 16-bit ones as bf16, f32 kept) or "exact" (all f32)."""
    if threads:
        torch.set_num_threads(int(threads))
    host = cached_host(path, weights) if cache else load_host(path, weights)
    return Model(host, device)
