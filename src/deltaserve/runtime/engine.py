"""The engine loop: the one owner of generation.

Every running generation is a `Sequence`: a coroutine (a generator, written by the session as a plain turn) that
yields what it needs the forward for next and is resumed with the result:

- `Rows`: tokens fed at its state's position through the recurrent path: one token (a decode step) or a token and
  its drafts (a speculative verification, with the snapshots to roll back to);
- `Prefill`: a span of prompt tokens through the batched path;
- `Blocking`: a function that may wait on a disk (a stored state read back), run off the loop's thread.

Between two yields the sequence samples, masks, checks its stops and hands its tokens to its sink, on the loop's
thread. The loop owns the order: each `step` runs

1. the `Rows` of every sequence waiting for them, in as few forwards as the kernels allow (`Backend.run_rows`: one
   native call takes up to 8 rows of any mix of sequences, each sequence's rows in order), then resumes each;
2. the oldest waiting prompt's current chunk, a layer at a time: while other sequences decode, as many layers as fit
   the rest of the step's time (`step_s` less what the rows took; at least one layer, so a prompt is never starved),
   then the next step runs their rows again; with nothing decoding, its layers until the chunk is done or another
   sequence arrives. A prompt is fed in chunks of `CHUNK` tokens from its span's start (a tail shorter than `GRANULE`
   goes with the chunk before it), whatever the load: the cuts are the same alone or among others, so a prompt's
   logits are the same bits either way, and a chunk large enough to multiply at full speed is never cut smaller to
   keep the others' gaps short: its layers are;
3. the sequences whose `Blocking` work finished.

A sequence whose `cancel` event is set gets `Cancelled` raised at its next step (its rows are never run again).

Threaded (`EngineLoop(threaded=True)`: the server), the loop has a thread of its own, which is also the compute
thread: every forward, state copy and load runs on it (`call`), so libgomp keeps one team for the process (see
kernels/cpu.py's `serial_here`; a thread that opens parallel regions gets a team of its own, and teams past the core
count are parked between regions: a forward then pays a wake-up per region). Inline (the Python API, `run`, the
REPL), the thread that asks for a sequence steps the loop itself until its sequence is done; several threads that
drive at once take turns stepping it, each step serving all of them.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

GRANULE = 64       # the delta rule's chunk and the attention's query block: a prompt is cut at multiples of it
CHUNK = 512        # prompt tokens a forward call takes (the prefill runs at about full speed from 128-256 up)
ROW_LOGITS = 64    # tokens a prefill call takes when every row's logits are asked for (`Prefill.rows`): 64 rows of a
                   # 248K vocabulary are 64 MB of f32, handed over and reduced before the next chunk
DEFAULT_STEP_S = 0.2   # a step's time while sequences decode: their rows, then a prompt's layers (the token gap)


class Cancelled(Exception):
    """Raised into a sequence whose client has gone: its rows are not run again."""


@dataclass
class Rows:
    """Tokens fed at the state's position, in order, through the recurrent path; resumed with their logits
    [len(tokens), vocab]. `snaps` (a verification): receives the DeltaNet states after each row but the last."""

    backend: Any
    state: Any
    tokens: list[int]
    snaps: Any = None

    @property
    def kind(self) -> str:
        return "decode" if len(self.tokens) == 1 else "verify"


@dataclass
class Prefill:
    """A span fed through the batched path; resumed with a `PrefillDone`. `fit()` (may be None) says, before each
    chunk, the most tokens one forward call may take in the memory free now (0: none batched: the chunk's tokens go
    one at a time through the recurrent path). `images`: the span's images (fed whole, never cut). `rows` (may be
    None): every row's logits are asked for (a prompt's own log-probabilities): called with each chunk's logits
    [n, vocab] and the position of its first row, before the next chunk runs (chunks of at most ROW_LOGITS tokens,
    each run whole rather than a layer at a time, so that the rows are never held for a whole prompt)."""

    backend: Any
    state: Any
    tokens: list[int]
    images: Any = None
    fit: Callable[[], int] | None = None
    rows: Callable[[Any, int], None] | None = None
    fed: int = 0
    seconds: float = 0.0
    calls: int = 0
    running: Any = None   # the current chunk's layers (a generator: Backend.prefill_steps), while it is under way
    chunk: int = 0        # its tokens


@dataclass
class PrefillDone:
    logits: Any      # the last position's logits [vocab]
    seconds: float   # time in forwards (the span's own chunks, not the other sequences' steps between them)
    calls: int       # forward calls it took


@dataclass
class Blocking:
    """`fn(*args)` off the loop's thread (it may wait on a disk); resumed with its result (or its exception)."""

    fn: Callable
    args: tuple = ()


class Sequence:
    """One generation the loop owns: its coroutine, what it waits for, how it ended."""

    def __init__(self, gen: Generator, cancel: threading.Event | None = None, label: str | None = None):
        self.gen = gen
        self.cancel = cancel
        self.label = label
        self.arrived = time.perf_counter()
        self.started: float | None = None   # when the loop first ran it (queue wait: started - arrived)
        self.work: Any = None
        self.pending: Future | None = None  # a Blocking item's run
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.finished = threading.Event()
        self.last_rows: float | None = None  # when its last rows came back (the gap to the next is a token gap)

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class EngineStats:
    """What the loop did (GET /health, /metrics): steps, forwards, rows by kind, queue waits and token gaps."""

    steps: int = 0
    forwards: int = 0
    rows: dict = field(default_factory=lambda: {"decode": 0, "verify": 0, "prefill": 0})
    prefill_chunks: int = 0
    sequences: int = 0
    cancelled: int = 0
    most_rows: int = 0          # the most rows one forward call carried
    queue_waits: deque = field(default_factory=lambda: deque(maxlen=1024))
    gaps: deque = field(default_factory=lambda: deque(maxlen=4096))
    log: deque | None = None    # (kind, detail) of every forward in order, when a test asks for it (`record`)

    def snapshot(self) -> dict:
        gaps = sorted(self.gaps)
        return {"steps": self.steps, "forwards": self.forwards, "rows": dict(self.rows),
                "prefill_chunks": self.prefill_chunks, "sequences": self.sequences, "cancelled": self.cancelled,
                "most_rows": self.most_rows,
                "token_gap_s": {"p50": _quantile(gaps, 0.5), "p99": _quantile(gaps, 0.99),
                                "max": gaps[-1] if gaps else None},
                "queue_wait_s": {"p50": _quantile(sorted(self.queue_waits), 0.5)}}


def _quantile(xs: list[float], q: float) -> float | None:
    return round(xs[min(int(q * len(xs)), len(xs) - 1)], 4) if xs else None


class EngineLoop:
    """See the module's docstring. `step_s`: a step's time while sequences decode; `chunk`: a prompt's tokens a forward
    call takes."""

    def __init__(self, threaded: bool = False, name: str = "deltaserve-engine", step_s: float = DEFAULT_STEP_S,
                 chunk: int = CHUNK):
        if step_s <= 0:
            raise ValueError(f"a step's time must be positive, got {step_s}")
        self.step_s = step_s
        self.chunk = max(GRANULE, (int(chunk) // GRANULE) * GRANULE)
        self.stats = EngineStats()
        self.threaded = threaded
        self._cv = threading.Condition()
        self._incoming: deque = deque()   # sequences and calls handed over, not yet taken in
        self._seqs: list[Sequence] = []   # taken in and not done (touched by the stepping thread alone)
        self._driving = False             # inline: some thread is stepping
        self._io: ThreadPoolExecutor | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()
            atexit.register(self.close)  # the thread ends before the interpreter does (torch's pools go after it)

    # -- handing work over ---------------------------------------------------------------------------------
    @property
    def on_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call(self, fn: Callable, *args, **kwargs):
        """`fn(*args)` on the loop's thread, between steps (inline, or already on it: here and now)."""
        if self._thread is None or self.on_loop_thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._incoming.append((fut, fn, args, kwargs))
            self._cv.notify_all()
        return fut.result()

    run = call  # a backend's work runs where the loop runs it (the name a compute thread had)

    def submit(self, gen: Generator, cancel: threading.Event | None = None, label: str | None = None) -> Sequence:
        """Hand a sequence over; `drive` or `wait` for it."""
        seq = Sequence(gen, cancel, label)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._incoming.append(seq)
            self.stats.sequences += 1
            self._cv.notify_all()
        return seq

    def drive(self, gen: Generator, cancel: threading.Event | None = None, label: str | None = None):
        """Run a sequence to its end and return what its coroutine returned (or raise what it raised)."""
        if self.on_loop_thread:  # a sequence started from inside the loop's own work: run it here, alone
            return _run_alone(gen)
        seq = self.submit(gen, cancel, label)
        return self.wait(seq)

    def wait(self, seq: Sequence):
        if self._thread is not None:
            seq.finished.wait()
            return seq.outcome()
        while True:
            with self._cv:
                while not seq.done and self._driving:
                    self._cv.wait()
                if seq.done:
                    break
                self._driving = True
            try:
                while not seq.done:
                    self.step()
            finally:
                with self._cv:
                    self._driving = False
                    self._cv.notify_all()
        return seq.outcome()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._io is not None:
            self._io.shutdown(wait=False)
        if self._thread is not None and not self.on_loop_thread:
            self._thread.join(timeout=10)

    @property
    def busy(self) -> int:
        """Sequences taken in and not done."""
        return len(self._seqs)

    # -- the loop ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._runnable():
                    if self._closed:
                        return
                    self._cv.wait()
            self.step()

    def _runnable(self) -> bool:
        return any(s.work is not None and not isinstance(s.work, Blocking) or
                   (s.pending is not None and s.pending.done()) for s in self._seqs)

    def _take_in(self) -> None:
        with self._cv:
            items = list(self._incoming)
            self._incoming.clear()
        for item in items:
            if isinstance(item, Sequence):
                self._seqs.append(item)
                self._advance(item, None)
            else:
                fut, fn, args, kwargs = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _advance(self, seq: Sequence, value, error: BaseException | None = None) -> None:
        """Resume `seq` with `value` (or raise `error` in it) until it yields its next work or ends."""
        if seq.started is None:
            seq.started = time.perf_counter()
            self.stats.queue_waits.append(seq.started - seq.arrived)
        try:
            work = seq.gen.throw(error) if error is not None else seq.gen.send(value)
        except StopIteration as stop:
            self._end(seq, value=stop.value)
            return
        except BaseException as e:  # noqa: BLE001 - the sequence's own failure, handed to whoever waits for it
            self._end(seq, error=e)
            return
        seq.work = work
        if isinstance(work, Blocking):
            if self._thread is None:  # inline: nobody else to serve meanwhile
                try:
                    result = work.fn(*work.args)
                except BaseException as e:  # noqa: BLE001
                    self._advance(seq, None, e)
                    return
                self._advance(seq, result)
                return
            if self._io is None:
                self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltaserve-io")
            seq.pending = self._io.submit(work.fn, *work.args)
            seq.pending.add_done_callback(lambda _f: self._wake())
        elif not isinstance(work, (Rows, Prefill)):
            self._advance(seq, None, TypeError(f"a sequence yielded {type(work).__name__}, not engine work"))

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _end(self, seq: Sequence, value=None, error: BaseException | None = None) -> None:
        seq.value, seq.error, seq.done, seq.work = value, error, True, None
        if seq in self._seqs:
            self._seqs.remove(seq)
        seq.finished.set()
        if self._thread is None:
            self._wake()

    def _cancel_gone(self, seqs: list[Sequence]) -> list[Sequence]:
        """Those of `seqs` whose client is still there; the others get Cancelled raised at their yield (a prompt whose
        chunk is under way finishes that chunk first: its state is consistent only between chunks)."""
        kept = []
        for s in seqs:
            if s.cancel is not None and s.cancel.is_set() and getattr(s.work, "running", None) is None:
                self.stats.cancelled += 1
                if self.stats.log is not None:
                    self.stats.log.append(("cancelled", s.label))
                self._advance(s, None, Cancelled())
            else:
                kept.append(s)
        return kept

    def step(self) -> None:
        """One step: every sequence's rows, then a chunk of the oldest waiting prompt, then finished blocking work."""
        self._take_in()
        self.stats.steps += 1
        t0 = time.perf_counter()
        waiting = self._cancel_gone([s for s in self._seqs if isinstance(s.work, Rows)])
        if waiting:
            self._run_rows(waiting)
        prompts = self._cancel_gone([s for s in self._seqs if isinstance(s.work, Prefill)])
        if prompts:
            oldest = min(prompts, key=lambda s: s.arrived)
            decoding = bool(waiting) or any(isinstance(s.work, Rows) for s in self._seqs)
            self._prefill_layers(oldest, t0 + self.step_s if decoding else None)
        for s in [s for s in self._seqs if s.pending is not None and s.pending.done()]:
            fut, s.pending = s.pending, None
            error = fut.exception()
            self._advance(s, None if error is not None else fut.result(), error)

    def _run_rows(self, seqs: list[Sequence]) -> float:
        """Every waiting sequence's rows, grouped by backend, each group in as few forwards as it allows; each
        sequence resumed with its logits. The time the forwards took."""
        groups: dict[int, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(id(s.work.backend), []).append(s)
        spent = 0.0
        for group in groups.values():
            backend = group[0].work.backend
            runs = [(s.work.state, s.work.tokens, s.work.snaps) for s in group]
            t0 = time.perf_counter()
            try:
                outs, calls = backend.run_rows(runs)
            except BaseException as e:  # noqa: BLE001 - every sequence of the forward fails with it
                for s in group:
                    self._advance(s, None, e)
                continue
            now = time.perf_counter()
            spent += now - t0
            st = self.stats
            st.forwards += calls
            nrows = sum(len(r[1]) for r in runs)
            st.most_rows = max(st.most_rows, min(nrows, getattr(backend, "max_rows", nrows)))
            for s in group:
                st.rows[s.work.kind] += len(s.work.tokens)
            if st.log is not None:
                st.log.append(("rows", tuple((s.label, len(s.work.tokens)) for s in group), calls))
            for s, logits in zip(group, outs):
                if s.last_rows is not None:
                    st.gaps.append(now - s.last_rows)
                s.last_rows = now
                self._advance(s, logits)
        return spent

    def _prefill_layers(self, seq: Sequence, deadline: float | None) -> None:
        """The prompt's current chunk (started here if none is under way), a layer at a time, until `deadline` (at
        least one layer) or, with none, until it is done or another sequence arrives."""
        w: Prefill = seq.work
        if w.running is None:
            left = len(w.tokens) - w.fed
            if w.images is not None:
                n = left  # an image's rows are fed with the span they are in
            else:
                n = min(left, self.chunk if w.rows is None else ROW_LOGITS)
                if left - n < GRANULE:
                    n = left  # a tail shorter than a granule goes with this chunk (as it does alone)
                if w.fit is not None and w.fit() <= 0:
                    self._one_token(seq, w)  # no batched plan fits the memory free now: one token at a time
                    return
            try:
                if w.images is not None:
                    w.running = _whole(w.backend.prefill, w.state, w.tokens[w.fed:w.fed + n], False, w.images)
                elif w.rows is not None:
                    w.running = _whole(_with_rows, w, w.tokens[w.fed:w.fed + n])
                else:
                    w.running = w.backend.prefill_steps(w.state, w.tokens[w.fed:w.fed + n])
            except BaseException as e:  # noqa: BLE001
                self._advance(seq, None, e)
                return
            w.chunk = n
        t0 = last = time.perf_counter()
        layers, recent = 0, deque(maxlen=4)  # the last layers' times: the next one's is taken as their longest
        while True:
            try:
                next(w.running)
                layers += 1
            except StopIteration as done:
                self._chunk_done(seq, w, done.value, time.perf_counter() - t0, layers + 1)
                return
            except BaseException as e:  # noqa: BLE001 - a forward's failure is the sequence's
                w.running = None
                self._advance(seq, None, e)
                return
            now = time.perf_counter()
            recent.append(now - last)
            last = now
            if (deadline is not None and now + max(recent) > deadline) or (deadline is None and self._incoming):
                w.seconds += now - t0
                if self.stats.log is not None:
                    self.stats.log.append(("layers", seq.label, layers))
                return

    def _chunk_done(self, seq: Sequence, w: Prefill, logits, dt: float, layers: int) -> None:
        n, w.running = w.chunk, None
        w.fed += n
        w.seconds += dt
        w.calls += 1
        st = self.stats
        st.forwards += 1
        st.prefill_chunks += 1
        st.rows["prefill"] += n
        if st.log is not None:
            st.log.append(("layers", seq.label, layers))
            st.log.append(("prefill", seq.label, n))
        if w.fed >= len(w.tokens):
            self._advance(seq, PrefillDone(logits, w.seconds, w.calls))

    def _one_token(self, seq: Sequence, w: Prefill) -> None:
        t0 = time.perf_counter()
        try:
            at = w.state.length
            outs, _ = w.backend.run_rows([(w.state, [w.tokens[w.fed]], None)])
            if w.rows is not None:
                w.rows(outs[0], at)
        except BaseException as e:  # noqa: BLE001
            self._advance(seq, None, e)
            return
        w.chunk = 1
        self._chunk_done(seq, w, outs[0][-1], time.perf_counter() - t0, 0)

    def record(self, on: bool = True) -> None:
        """Keep every forward's kind and rows, in order, in `stats.log` (for the tests of the mechanism)."""
        self.stats.log = deque() if on else None


def _whole(fn, *args):
    """A forward that is not stepped a layer at a time (a span with images), as a generator of no steps."""
    return fn(*args)
    yield  # unreachable: makes this a generator


def _with_rows(w: Prefill, tokens: list[int]):
    """A chunk of a Prefill that asks for every row's logits: its rows handed to `w.rows`, the last one returned."""
    at = w.state.length
    rows = w.backend.prefill(w.state, tokens, True)
    w.rows(rows, at)
    return rows[-1]


def _run_alone(gen: Generator):
    """A sequence run to its end on this thread with no other sequence (work done as it asks)."""
    value, error = None, None
    while True:
        try:
            work = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(work, Rows):
                value = work.backend.run_rows([(work.state, work.tokens, work.snaps)])[0][0]
            elif isinstance(work, Prefill):
                t0 = time.perf_counter()
                if work.rows is not None and work.images is None:
                    for i in range(0, len(work.tokens), ROW_LOGITS):
                        logits = _with_rows(work, work.tokens[i:i + ROW_LOGITS])
                else:
                    logits = work.backend.prefill(work.state, work.tokens, images=work.images) \
                        if work.images is not None else work.backend.prefill(work.state, work.tokens)
                value = PrefillDone(logits, time.perf_counter() - t0, 1)
            elif isinstance(work, Blocking):
                value = work.fn(*work.args)
            else:
                raise TypeError(f"a sequence yielded {type(work).__name__}, not engine work")
        except BaseException as e:  # noqa: BLE001 - raised in the sequence at its yield
            error = e
