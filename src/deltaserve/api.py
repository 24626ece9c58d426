"""The public entry points: `deltaserve.load(path)` and the model it returns. The one place that builds backends,
parity guards and the sessions of a slot pool: the frontends ask it, never the runtime directly."""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from deltaserve.demo import default_model_path, thinking_default
from deltaserve.engine.forward import Forward
from deltaserve.engine.host import HostModel, cached_host, load_host
from deltaserve.errors import DeltaserveError
from deltaserve.kernels.cpu import plan_threads, serial_here
from deltaserve.runtime.backend import Backend, select_backend
from deltaserve.runtime.engine import EngineLoop
from deltaserve.runtime.guard import MAX_AGE, ParityGuard
from deltaserve.engine.state import (DecodeState, DEFAULT_KV_TYPE, KV_TYPES, kv_type_for,  # noqa: F401 - the CLI's
                                     kv_type_name)
from deltaserve.runtime.capacity import cpu_memory
from deltaserve.session.resident import Session, Turn
from deltaserve.session.store import StateStore
from deltaserve.session.turns import ask
from deltaserve.text.chat_template import RenderedPrompt

# -- the facade: what the frontends name from the layers below, through this one door (tests/test_layers.py
# lets them import only this layer, the turn modules and the errors) ----------------------------------------
from deltaserve import settings  # noqa: F401
from deltaserve.cachedir import cache_root, data_root  # noqa: F401
from deltaserve.formats.convert import convert  # noqa: F401
from deltaserve.formats.source import open_model  # noqa: F401
from deltaserve.kernels.cpu import available_cores, plural, SPLIT_MIN_BYTES  # noqa: F401
from deltaserve.runtime import capacity  # noqa: F401
from deltaserve.session import driver, files  # noqa: F401
from deltaserve.session.grammar import compile_format, compile_process, GrammarError, isolated, normalize, NotCached  # noqa: F401
from deltaserve.session.driver import check_prompt  # noqa: F401
from deltaserve.session.responses import new_id, ResponseRecord, ResponseStore, valid_id  # noqa: F401
from deltaserve.session.store import parse_size, prefix_hashes, read_header, saved_state_bytes, StateFileError  # noqa: F401
from deltaserve.session.thinking import (check_budget, EFFORT_BUDGETS, EFFORTS, parse_effort_budgets,  # noqa: F401
                                         rendered_thinking, ThinkingDefaults)
from deltaserve.text.toolcalls import normalize_tool_choice, normalize_tools, ToolChoice, ToolError  # noqa: F401
from deltaserve.version import __version__  # noqa: F401
from deltaserve.vision.encoder import PREFIX  # noqa: F401
from deltaserve.vision.inputs import decode, fetch_url, ImageInputError, ImageLimits, private_fetch_url  # noqa: F401


class Model:
    """A loaded Qwen3.5 hybrid: config, tokenizer, host weights; sessions run on it."""

    def __init__(self, host: HostModel, device: str = "cpu", engine: EngineLoop | None = None,
                 kv_type: str | None = None):
        self.host = host
        self.device = device
        self.kv_type = kv_type_for(host.config, kv_type)  # the KV cache type of its sessions unless one says otherwise
        # the one owner of generation: every session's turns run as its sequences (runtime/engine.py); threaded, its
        # thread runs every forward (a server); inline, the threads that ask for turns step it by turns
        self.engine = engine or EngineLoop(threaded=False)
        self.load_seconds = 0.0
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
        return thinking_default(self.host.path)

    def render(self, messages, enable_thinking: bool | None = None, tools=None) -> tuple[list[int], bool]:
        """A conversation's prompt ids (generation header added) and whether it leaves the model reasoning, as a
        chat turn renders them (`session.turns`)."""
        prompt = self.render_prompt(messages, enable_thinking, tools)
        return prompt.encode(self.tokenizer), prompt.thinking

    def render_prompt(self, messages, enable_thinking: bool | None = None, tools=None) -> RenderedPrompt:
        """A conversation rendered (generation header added), not yet tokenized: `.encode(tokenizer)` encodes what
        its messages contain as text, `.display` reads it, `.thinking` says whether it leaves the model reasoning.
        `tools`: the functions offered (OpenAI's list), rendered by the template."""
        return ask(messages, tools, enable_thinking=enable_thinking).prompt(self.tokenizer, self.thinking_default)

    def render_text(self, messages, enable_thinking: bool | None = None, tools=None) -> str:
        """A conversation's prompt text (generation header added), not yet tokenized."""
        return self.render_prompt(messages, enable_thinking, tools).display

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
        """The backend for `device` and the notice saying why it is not the one asked for (None when it is); an
        accelerator's (weights uploaded) is made once and shared. Its work runs on the model's engine loop."""
        backend, notice = select_backend(self.host, device or self.device)
        backend.threads_why = self.threads_why
        if backend.accelerator:
            backend = self._accelerators.setdefault(backend.name, backend)
        backend.use_engine(self.engine)
        return backend, notice

    def session(self, context: int | None = None, device: str | None = None, backend: Backend | None = None,
                guard=None, quiet: bool = False, one_call: bool = False, plan_memory=None,
                plan_positions: int | None = None, revalidate: bool = False, store: StateStore | None = None,
                guard_max_age: float = MAX_AGE, mtp: int | None = None, loop_guard: bool | None = None,
                kv_type: str | None = None) -> Session:
        """A resident session: its state starts at 4096 positions and grows by doubling. On an accelerator it
        is guarded (`revalidate`: a new parity verdict even if one is cached). `mtp`: speculative decoding with the
        file's MTP block, at most that many draft tokens a step (None: on, adaptive, where the file carries one; 0:
        off). `loop_guard`: whether a thought that repeats itself is closed (None: DELTASERVE_LOOP_GUARD, on).
        `kv_type`: the KV cache's type, f32, f16, bf16 or q8_0 (None: the model's, as `load` was given it)."""
        kv_type = self.kv_type if kv_type is None else kv_type_for(self.config, kv_type)  # a type refused here
        notice = None
        if backend is None:
            backend, notice = self.backend(device)
        if guard is None and backend.accelerator:
            guard = ParityGuard(revalidate=revalidate, max_age=guard_max_age)
        s = Session(self.host, backend, context=context, one_call=one_call, guard=guard, quiet=quiet,
                    plan_memory=plan_memory, plan_positions=plan_positions, thinking_default=self.thinking_default,
                    notice=notice, store=store, mtp=mtp, loop_guard=loop_guard, kv_type=kv_type)
        return s

    def slots(self, n: int, context: int | None = None, device: str | None = None, revalidate: bool = False,
              quiet: bool = False, store: StateStore | None = None, log_prefills: bool = False,
              guard_max_age: float = MAX_AGE, mtp: int | None = None, loop_guard: bool | None = None) -> list[Session]:
        """`n` resident sessions on one backend (weights shared), their turns sequences of the model's engine loop
        (decode rows of all of them in one forward, prompts cut into chunks between), one parity guard for all
        (`revalidate` forces a new verdict), one state store (`store`) under them all. Each slot says its own route
        decisions, named "slot i" where there are several; `log_prefills` prints each batched prefill's stats line
        too."""
        backend, notice = self.backend(device)
        guard = ParityGuard(revalidate=revalidate, max_age=guard_max_age) if backend.accelerator else None
        return [Session(self.host, backend, context=context, guard=guard, quiet=quiet,
                        thinking_default=self.thinking_default, notice=notice, store=store,
                        label=f"slot {i}" if n > 1 else None, log_prefills=log_prefills, mtp=mtp,
                        loop_guard=loop_guard, kv_type=self.kv_type) for i in range(n)]

    def state_store(self, ram: int | None = None, directory: str | os.PathLike | None = None,
                    disk: int | None = None, slots: int = 1, context: int | None = None, say=None) -> StateStore:
        """The conversation state store for this model's sessions (deltaserve/session/store.py). `ram` None: a quarter of
        the memory left once `slots` states of `context` positions (at most 8192 planned) are set aside;
        `directory`: the disk tier, kept across restarts; `disk` None: half the free space there, at most 64 GiB."""
        c = self.config
        if ram is None:
            positions = min(context or c.context_length, c.context_length, 8192)
            # the slots' states in the model's KV type
            left = cpu_memory().free - slots * DecodeState.bytes_for(c, positions, kv_type=self.kv_type)
            ram = max(left, 0) // 4
        if directory is not None and disk is None:
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)  # conversations: the user's only
                st = os.statvfs(directory)
                disk = min(st.f_bavail * st.f_frsize // 2, 64 << 30)
            except OSError as e:
                raise DeltaserveError(f"--state-dir {directory}: cannot use it ({e.strerror})") from None
        return StateStore(c, ram_bytes=ram, directory=directory, disk_bytes=disk or 0,
                          model_sha256=self.host.sha256, say=say)

    def worker_initializer(self):
        """What a thread that waits for this model's turns runs first: with a threaded engine loop, its own torch ops
        (if any) open no OpenMP team (see runtime/engine.py)."""
        return serial_here if self.engine.threaded else None

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 256, **kwargs) -> Turn:
        """One call on a one-call session sized to the call exactly."""
        session_kw = {k: kwargs.pop(k) for k in ("device", "backend", "quiet", "context", "mtp", "loop_guard", "kv_type")
                      if k in kwargs}
        session_kw.setdefault("quiet", True)
        return self.session(one_call=True, **session_kw).generate(prompt_ids, max_tokens=max_tokens, **kwargs)


def load(path: str | os.PathLike | None = None, device: str = "cpu", threads: int | None = None, cache: bool = True,
         weights: str | None = None, compute_thread: bool = False, draft: str | os.PathLike | None = None,
         mmproj: str | os.PathLike | None = None, kv_type: str | None = None) -> Model:
    """Load a Qwen3.5 GGUF file or HF directory (no path: the embedded demo model). `threads`: CPU threads for
    the forwards (default: one for a model too small to split, else the cores this process may use; see
    kernels/cpu.py). `weights`: "fast" (default: a GGUF's tensors held as the file's own blocks, see
    engine/weights.py), "blocks", "tables" (int8 tables) or "exact" (all f32). `compute_thread`: the load and
    every forward on the engine loop's own thread (for callers that run sessions on several threads, as the server
    does; see runtime/engine.py). `draft`: a separate file with the model's MTP block (`mtp-*.gguf`, as llama.cpp's
    converter writes it with --mtp) for speculative decoding. `mmproj`: llama.cpp's projector GGUF (its converter with
    --mmproj) for a GGUF model's images (an HF directory carries its own vision encoder). `kv_type`: the KV cache
    type of its sessions (engine/state.py: f32, f16, bf16 or q8_0; None: f16, the default)."""
    kv_type_name(kv_type)  # checked before the file is read
    if path is None:
        path = default_model_path()
    if threads is not None and int(threads) < 1:
        raise DeltaserveError(f"threads must be at least 1, got {threads}")
    t0 = time.perf_counter()
    engine = EngineLoop(threaded=True) if compute_thread else EngineLoop(threaded=False)

    def build() -> tuple[HostModel, str]:
        host = cached_host(path, weights, draft, mmproj) if cache else load_host(path, weights, draft, mmproj)
        n, why = plan_threads(host.weights.active_nbytes, int(threads) if threads is not None else None)
        torch.set_num_threads(n)  # on the thread that runs the forwards (OpenMP's count is per thread)
        return host, why

    host, why = engine.call(build)
    if engine.threaded:
        serial_here()  # the calling thread's own torch ops, if any, open no team
    model = Model(host, device, engine, kv_type)
    model.threads_why = why
    model.load_seconds = time.perf_counter() - t0
    return model


def route_table(host: HostModel) -> list[str]:
    """The route table of `host`'s weights on this CPU (kernels/routes.py: each product's kernel and data type by
    the rows it has), as `deltaserve inspect` prints it."""
    from deltaserve.kernels import routes

    return routes.table_lines(host.weights.linear_forms(), "cpu", host.weights.has_f32_linears())


def kernel_levels() -> list[tuple[str, str, bool]]:
    """The levels the native kernels are built for (kernels/library.py): (name, the CPUs that run it, whether this
    CPU does), best first, -march=native last."""
    from deltaserve.kernels import library

    runs = {v.name for v in library.candidates()}
    return [(v.name, v.cpus, v.name in runs) for v in (*library.VARIANTS, library.NATIVE)]


def kernel_loaded() -> str:
    """Which build of the native kernels this process loads and from where, in words (building it if it must)."""
    from deltaserve.kernels import library

    v, path = library.loaded()
    return f"{v.name} ({path})" if v is not None else f"none: {library.why_not()}"


def build_kernels(names: list[str] | None = None, out: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """The native kernels built for the levels `names` (None: every level: what a wheel's kernels/lib/ or a fleet's
    shared cache directory holds), into `out` (default: the cache), each compiled unless there already: (level,
    library path). Raises DeltaserveError on an unknown level or a failed build."""
    from pathlib import Path

    from deltaserve.kernels import library

    unknown = [n for n in names or () if n not in library.ISA_NAMES]
    if unknown:
        raise DeltaserveError(f"unknown level {', '.join(unknown)}: one of {', '.join(library.ISA_NAMES)}")
    try:
        built = library.build_all(Path(out) if out else None, names)
    except (RuntimeError, OSError) as e:
        raise DeltaserveError(f"building the native kernels failed: {e}") from None
    return [(v.name, str(path)) for v, path in built]


__all__ = [
    '__version__',
    'available_cores',
    'build_kernels',
    'cache_root',
    'capacity',
    'check_budget',
    'check_prompt',
    'compile_format',
    'compile_process',
    'convert',
    'cpu_memory',
    'data_root',
    'decode',
    'driver',
    'EFFORT_BUDGETS',
    'EFFORTS',
    'fetch_url',
    'files',
    'GrammarError',
    'ImageInputError',
    'ImageLimits',
    'isolated',
    'kernel_levels',
    'kernel_loaded',
    'DEFAULT_KV_TYPE',
    'KV_TYPES',
    'load',
    'load_host',
    'MAX_AGE',
    'Model',
    'new_id',
    'normalize',
    'normalize_tool_choice',
    'normalize_tools',
    'NotCached',
    'open_model',
    'parse_effort_budgets',
    'parse_size',
    'plural',
    'PREFIX',
    'prefix_hashes',
    'private_fetch_url',
    'read_header',
    'rendered_thinking',
    'ResponseRecord',
    'ResponseStore',
    'route_table',
    'saved_state_bytes',
    'settings',
    'SPLIT_MIN_BYTES',
    'StateFileError',
    'ThinkingDefaults',
    'ToolChoice',
    'ToolError',
    'valid_id'
]
