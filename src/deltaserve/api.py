"""The public entry points: `deltaserve.load(path)` and the model it returns."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from deltaserve.engine.backend import Backend, select_backend
from deltaserve.demo import default_model_path, is_demo
from deltaserve.engine.forward import Forward
from deltaserve.engine.threads import plan_threads
from deltaserve.errors import DeltaserveError
from deltaserve.model.loader import HostModel, cached_host, load_host
from deltaserve.session import Session, Turn
from deltaserve.text.chat_template import render


class Model:
    """A loaded Qwen3.5 hybrid: config, tokenizer, host weights; sessions run on it."""

    def __init__(self, host: HostModel, device: str = "cpu"):
        self.host = host
        self.device = device
        self._cpu_forward: Forward | None = None
        self._accelerators: dict[str, Backend] = {}  # uploaded once per device, shared by sessions
        self.threads_why = ""  # why the CPU forwards take the threads they take (said in the backend line)

    @property
    def config(self):
        return self.host.config

    @property
    def tokenizer(self):
        return self.host.tokenizer

    @property
    def path(self):
        return self.host.path

    @property
    def thinking_default(self) -> bool | None:
        """enable_thinking when a caller does not say: the embedded demo model was trained with thinking off;
        any other model keeps its template's default (None)."""
        return False if is_demo(self.host.path) else None

    def render(self, messages, enable_thinking: bool | None = None) -> tuple[list[int], bool]:
        """A conversation's prompt ids (generation header added) and whether it leaves the model reasoning."""
        return render(self.tokenizer, messages, self.thinking_default if enable_thinking is None else enable_thinking)

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
        backend.threads_why = self.threads_why
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
            from deltaserve.engine.guard import ParityGuard
            guard = ParityGuard()
        s = Session(self.host, backend, context=context, one_call=one_call, guard=guard, quiet=quiet,
                    plan_memory=plan_memory, plan_positions=plan_positions, thinking_default=self.thinking_default)
        if notice:
            s.notices.insert(0, notice)
        return s

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 256, **kwargs) -> Turn:
        """One call on a one-call session sized to the call exactly."""
        session_kw = {k: kwargs.pop(k) for k in ("device", "backend", "quiet", "context") if k in kwargs}
        session_kw.setdefault("quiet", True)
        return self.session(one_call=True, **session_kw).generate(prompt_ids, max_tokens=max_tokens, **kwargs)


def load(path: str | os.PathLike | None = None, device: str = "cpu", threads: int | None = None, cache: bool = True,
         weights: str | None = None) -> Model:
    """Load a Qwen3.5 GGUF file or HF directory (no path: the embedded demo model). `threads`: CPU threads for
    the forwards (default: one for a model too small to split, else the cores this process may use; see
    engine/threads.py). `weights`: "fast" (default: quantized tensors as int8 tables, 16-bit ones as bf16, f32
    kept) or "exact" (all f32)."""
    if path is None:
        path = default_model_path()
    if threads is not None and int(threads) < 1:
        raise DeltaserveError(f"threads must be at least 1, got {threads}")
    host = cached_host(path, weights) if cache else load_host(path, weights)
    n, why = plan_threads(host.weights.nbytes, int(threads) if threads is not None else None)
    torch.set_num_threads(n)
    model = Model(host, device)
    model.threads_why = why
    return model
