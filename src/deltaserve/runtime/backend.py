"""Where a forward runs: the CPU, a CUDA device through PyTorch, or a test backend that fails on demand.

The session talks to a backend through this narrow seam only. An accelerator backend reports every
failure of its own as `AcceleratorFailure`, which the session answers by moving to the CPU.
"""

from __future__ import annotations

import weakref

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.runtime import capacity as cap
from deltaserve.runtime.capacity import Memory, cpu_memory
from deltaserve.engine.host import HostModel
from deltaserve.engine.forward import Forward
from deltaserve.kernels import routes
from deltaserve.kernels.linear import BlockLinear, Int8Linear
from deltaserve.engine.state import Checkpoint, DecodeState, DEFAULT_KV_TYPE
from deltaserve.kernels.cpu import plural
from deltaserve import settings


class AcceleratorFailure(Exception):
    """Something on the accelerator failed; the session falls back to the CPU with this reason."""


class Backend:
    """One device's view of a host model. Subclasses override `_setup` and the device facts."""

    accelerator = False
    name = "cpu"
    overhead = cap.CPU_OVERHEAD  # what the capacity plan adds for the runtime on this device

    def __init__(self, host: HostModel):
        self.host = host
        self.forward: Forward | None = None
        self._engine = None  # the engine loop whose thread runs this backend's work (runtime/engine.py)
        self.threads_why = ""  # why the CPU forwards take the threads they do (kernels/cpu.py), for the route line

    def fallback(self) -> "Backend":
        """The CPU backend a session moves to when this one fails: it keeps the engine loop and the thread note."""
        cpu = CPUBackend(self.host)
        cpu.threads_why = self.threads_why
        cpu.use_engine(self.engine)
        return cpu

    @property
    def engine(self):
        """The engine loop that runs this backend's sequences (an inline one of its own unless one was given)."""
        if self._engine is None:
            from deltaserve.runtime.engine import EngineLoop

            self._engine = EngineLoop(threaded=False)
        return self._engine

    def use_engine(self, engine) -> None:
        """Run this backend's sequences, forwards and state work on `engine` (shared by every backend of a model)."""
        self._engine = engine

    def stats(self) -> dict:
        """What the operator sees of this backend (GET /health)."""
        return {"name": self.name, "engine": self.engine.stats.snapshot()}

    @property
    def max_rows(self) -> int:
        """Rows one forward call of the recurrent path takes (the native decode's; torch takes any number)."""
        from deltaserve.engine.native_token import TokenProgram

        return TokenProgram.MAX_BATCH

    def _on_compute(self, fn, *args):
        """`fn(*args)` on the engine loop's thread (here, when the loop is inline or this is its thread)."""
        return self.engine.call(fn, *args)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise the device and put the weights there (once; sessions may share a backend)."""
        if self.forward is None:
            self.forward = Forward(self.host.config, self._device_weights(), self.device)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _device_weights(self):
        return self.host.weights

    def bind_thread(self) -> None:
        """Make this backend's device current in the calling thread (CUDA contexts are per thread)."""

    def memory(self) -> Memory:
        return cpu_memory()

    def describe(self, kv_type: str = DEFAULT_KV_TYPE) -> str:
        """The route line: the CPU's threads, the products' kernels, how a token decodes with a KV cache of
        `kv_type` (the one-call native decode reads an f32, f16 or bf16 cache in its own type; a q8_0 cache takes
        the torch attention)."""
        head = self.host.weights.lm_head
        program, decode = self.forward.token_program() if isinstance(head, (Int8Linear, BlockLinear)) else (None, "")
        if program is not None and kv_type == "q8_0":
            decode = ("decode through torch ops (the q8_0 KV cache: its int8 blocks dequantized by the torch "
                      "attention; the one-call native decode does not read q8_0)")
        elif program is not None and kv_type != "f32":
            decode += f"; its attention reads the {kv_type} KV cache in its type"
        if isinstance(head, Int8Linear):
            route = f"; {routes.describe_tables()}; {decode}"
        elif isinstance(head, BlockLinear):
            route = f"; {routes.describe_blocks()}; {decode}"
        else:
            route = ""
        said = program is not None and kv_type != "f32"  # the decode's words above name the cache's type
        kv = "" if said else f"; KV cache {kv_type}"
        why = f": {self.threads_why}" if self.threads_why else ""
        threads = self._on_compute(torch.get_num_threads)  # the engine loop's thread runs the forwards: its count
        return f"CPU ({plural(threads, 'thread')}{why}{route}{kv})"

    # -- state ------------------------------------------------------------------------------------
    def new_state(self, capacity: int, plan: cap.PrefillPlan | None = None,
                  kv_dtype: torch.dtype = torch.float32) -> DecodeState:
        """A state of `capacity` positions whose prefills follow `plan` (rows per call, attention query rows), its KV
        cache held in `kv_dtype`."""
        plan = plan or cap.PREFILL_PLANS[0]
        return self._on_compute(self.forward.new_state, capacity, kv_dtype, plan.rows, plan.query_rows)

    def reset(self, state: DecodeState) -> None:
        self._on_compute(state.reset)

    def save(self, state: DecodeState, into: Checkpoint | None, exact: bool = False) -> Checkpoint:
        return self._on_compute(state.checkpoint, into, exact)

    def restore(self, state: DecodeState, ck: Checkpoint, valid_prefix: int) -> None:
        self._on_compute(state.restore, ck, valid_prefix)

    # -- forward ----------------------------------------------------------------------------------
    def prefill(self, state: DecodeState, tokens, all_logits: bool = False, images=None) -> torch.Tensor:
        return self._on_compute(self.forward.prefill, state, tokens, all_logits, images)

    def prefill_steps(self, state: DecodeState, tokens):
        """`prefill` a layer at a time (`Forward.prefill_steps`): a generator the engine loop steps on its thread,
        running other sequences' rows between its layers; it returns the last position's logits [vocab]."""
        return self.forward.prefill_steps(state, tokens)

    def run_rows(self, runs: list) -> tuple[list[torch.Tensor], int]:
        """Rows of several sequences (`runs`: (state, tokens, snapshots or None) each), every weight read once for
        all where the kernels allow (`Forward.run_rows`): each run's logits [len(tokens), vocab], and the forward
        calls it took."""
        return self._on_compute(self.forward.run_rows, runs)

    def decode(self, state: DecodeState, token: int) -> torch.Tensor:
        """One token of one sequence: its logits [vocab]."""
        return self.run_rows([(state, [token], None)])[0][0][0]

    def run(self, fn, *args):
        """`fn(*args)` where this backend's work runs (the engine loop's thread)."""
        return self._on_compute(fn, *args)

    def rollback(self, state: DecodeState, snaps, kept: int, rows: int) -> None:
        self._on_compute(self.forward.rollback, state, snaps, kept, rows)


class CPUBackend(Backend):
    pass


class CUDABackend(Backend):
    """The same forward on a CUDA device: weights uploaded once, state on the device."""

    accelerator = True
    overhead = cap.CUDA_OVERHEAD

    def __init__(self, host: HostModel, index: int = 0):
        super().__init__(host)
        self.index = index
        self.name = f"cuda:{index}"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def start(self) -> None:
        try:
            if not torch.cuda.is_available():
                raise AcceleratorFailure("CUDA is not available to PyTorch "
                                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
            torch.cuda.set_device(self.index)
            torch.backends.cudnn.allow_tf32 = False  # the conv must stay f32 to match the CPU reference
            super().start()
        except AcceleratorFailure:
            raise
        except Exception as e:  # noqa: BLE001 - every device failure is a fallback reason
            raise AcceleratorFailure(f"the CUDA model would not build: {e}") from e

    def _device_weights(self):
        return self.host.weights.to(self.device)

    def bind_thread(self) -> None:
        try:
            torch.cuda.set_device(self.index)
        except Exception as e:  # noqa: BLE001
            raise AcceleratorFailure(f"the CUDA device would not bind to this thread: {e}") from e

    def memory(self) -> Memory:
        if not torch.cuda.is_available():
            raise AcceleratorFailure("CUDA is not available to PyTorch "
                                     f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        free, total = self._guarded("reading the free device memory", torch.cuda.mem_get_info, self.index)
        return Memory(int(free), int(total), f"{self.name}: mem_get_info")

    def describe(self, kv_type: str = DEFAULT_KV_TYPE) -> str:
        props = torch.cuda.get_device_properties(self.index)
        kv = f", KV cache {kv_type}"
        return f"GPU (CUDA, {props.name}, {props.total_memory // (1 << 20)} MiB{kv})"

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_properties(self.index).name

    @property
    def device_identity(self) -> str:
        """What a cached parity verdict depends on besides the model: this GPU (its UUID where torch reports it),
        the driver's and the CUDA runtime's versions."""
        props = torch.cuda.get_device_properties(self.index)
        try:
            driver = str(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001 - an older torch: the runtime's version still keys the verdict
            driver = "?"
        return f"{props.name} uuid {getattr(props, 'uuid', '?')} driver {driver} cuda {torch.version.cuda}"

    def _guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise AcceleratorFailure(f"{what} failed on {self.name}: {e}") from e

    def new_state(self, capacity, plan=None, kv_dtype=torch.float32):
        return self._guarded(f"a decode state for {capacity} positions", super().new_state, capacity, plan, kv_dtype)

    def reset(self, state):
        return self._guarded("the state reset", super().reset, state)

    def save(self, state, into, exact=False):
        return self._guarded("the checkpoint save", super().save, state, into, exact)

    def restore(self, state, ck, valid_prefix):
        return self._guarded("the checkpoint restore", super().restore, state, ck, valid_prefix)

    def prefill(self, state, tokens, all_logits=False, images=None):
        return self._guarded(f"the prefill at position {state.length}", super().prefill, state, tokens, all_logits,
                             images)

    def run_rows(self, runs):
        at = ", ".join(str(st.length) for st, _, _ in runs[:4])
        return self._guarded(f"the decode step at position {at}", super().run_rows, runs)

    def prefill_steps(self, state, tokens):
        steps = self._guarded(f"the prefill at position {state.length}", super().prefill_steps, state, tokens)
        while True:  # every layer's failure is the device's
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            except Exception as e:  # noqa: BLE001
                raise AcceleratorFailure(f"the prefill at position {state.length} failed on {self.name}: {e}") from e
            yield


class FaultyBackend(Backend):
    """A test accelerator: the CPU forward, posing as a device, that fails at a chosen stage.

    `stage` is one of: init, upload, alloc, prefill, decode, restore, guard. `after` is how many
    calls of that stage succeed before the failure; `corrupt` makes the guard see wrong logits
    (a silent numerical fault) instead of an exception.
    """

    accelerator = True
    STAGES = ("init", "upload", "alloc", "prefill", "decode", "restore", "guard")

    def __init__(self, host: HostModel, stage: str | None = None, after: int = 0,
                 device_name: str = "faulty-test-device", accelerator: bool = True):
        super().__init__(host)
        # a device memory of this many bytes, from which the states it holds are taken (memory() then says what is
        # free); None: the CPU's memory
        self.memory_bytes: int | None = None
        self._states = weakref.WeakSet()
        self.accelerator = accelerator  # False: a CPU whose forward breaks (no fallback, the turn fails)
        if stage is not None and stage not in self.STAGES:
            raise ValueError(f"unknown fault stage {stage!r}; expected one of {self.STAGES}")
        self.stage = stage
        self.after = after
        self.calls: dict[str, int] = {}
        self.name = "faulty"
        self.device_name = device_name

    def _hit(self, stage: str) -> None:
        n = self.calls.get(stage, 0)
        self.calls[stage] = n + 1
        if stage == self.stage and n >= self.after:
            if self.accelerator:
                raise AcceleratorFailure(f"injected {stage} failure (call {n + 1})")
            self.stage = None  # a CPU fault happens once
            raise RuntimeError(f"injected {stage} failure (call {n + 1})")

    def start(self) -> None:
        if self.forward is None:
            self._hit("init")
            self._hit("upload")
        super().start()

    def describe(self, kv_type: str = DEFAULT_KV_TYPE) -> str:
        kv = f", KV cache {kv_type}"
        return f"test accelerator ({self.device_name}{kv})"

    def new_state(self, capacity, plan=None, kv_dtype=torch.float32):
        self._hit("alloc")
        state = super().new_state(capacity, plan, kv_dtype)
        self._states.add(state)
        return state

    def memory(self) -> Memory:
        if self.memory_bytes is None:
            return super().memory()
        held = sum(st.nbytes for st in list(self._states))
        return Memory(max(self.memory_bytes - held, 0), self.memory_bytes, "faulty: test device memory")

    def restore(self, state, ck, valid_prefix):
        self._hit("restore")
        return super().restore(state, ck, valid_prefix)

    def prefill(self, state, tokens, all_logits=False, images=None):
        self._hit("prefill")
        out = super().prefill(state, tokens, all_logits, images)
        return out

    def prefill_steps(self, state, tokens):
        self._hit("prefill")
        return super().prefill_steps(state, tokens)

    def run_rows(self, runs):
        self._hit("decode")
        return super().run_rows(runs)

    def guard_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the guard sees from this device: corrupted when the fault stage is 'guard'."""
        if self.stage == "guard":
            g = torch.Generator().manual_seed(0)
            return logits + torch.randn(logits.shape, generator=g) * logits.std() * 2
        return logits


def select_backend(host: HostModel, device: str = "auto") -> tuple[Backend, str | None]:
    """The backend a session starts on, and why (a notice) when it is not the one asked for.

    `device`: "cpu", "cuda", "cuda:N", or "auto" (CUDA when PyTorch sees a device, else CPU);
    "faulty[:STAGE[:AFTER]]" is the test accelerator. DELTASERVE_DEVICE overrides "auto".
    """
    if device == "auto":
        device = settings.current().device
    if device == "cpu":
        return CPUBackend(host), None
    if device.startswith("faulty"):  # the test accelerator: faulty[:STAGE[:AFTER]]
        parts = device.split(":")
        stage = parts[1] if len(parts) > 1 and parts[1] else None
        after = int(parts[2]) if len(parts) > 2 else 0
        return FaultyBackend(host, stage=stage, after=after), None
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return CUDABackend(host, index), None
    if device != "auto":
        raise DeltaserveError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N")
    if torch.cuda.is_available():
        return CUDABackend(host, 0), None
    return CPUBackend(host), "[deltaserve] no CUDA device visible to PyTorch: serving from the CPU"
