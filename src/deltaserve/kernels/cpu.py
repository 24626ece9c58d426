"""The CPU under the kernels: how many threads a model's forwards take (the default of `--threads`, and the
native decode's governor), OpenMP's per-thread team size, and glibc's handling of freed blocks.

How many CPU threads a model's forwards take: the default of `--threads` follows the work.

A decode step reads every weight once and ends many parallel regions (a product, a norm, a state update per
layer), each on a barrier. Splitting a step over threads pays only where the work between two barriers is
long against a barrier; where it is short, a second thread adds barriers and nothing else, and when the core
under that thread is busy with another process each barrier waits for that thread's next time slice.
Measured on this 2-core machine (AMD EPYC, `deltaserve bench threads`, benchmarks/threads.md): the 7.8 MB demo
model decodes as fast on one thread as on two when quiet, and with one competing busy process two threads fell
to a small fraction of that while one thread kept most of it. The 0.8B shape (500-800 MB read per token) is
~1.6-1.9x faster on two threads and, with the native kernel's row tiles handed out dynamically, keeps a useful
share of its quiet speed under a competitor.

So: models that read less than `SPLIT_MIN_BYTES` per token run on one thread; larger ones on the cores this
process may run on (`os.sched_getaffinity`, which honours taskset and cgroup cpusets, unlike `os.cpu_count`).

OpenMP: PyTorch's CPU build runs its parallel regions on libgomp, which gives every thread that opens a parallel
region a team of worker threads of its own; `serial_here` lets a thread run its few torch ops without one
(runtime/engine.py says why a server needs that).
"""

from __future__ import annotations

import ctypes
import os

import torch

_gomp = None
_allocator_tuned = False

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks of up to 32 MiB for reuse instead of unmapping them (once per process).

    A forward allocates and frees many temporaries of a few MiB to a few tens of MiB (a 512-row prefill:
    [512, 8224] f32 products). By default glibc serves each from fresh mmap'd pages and returns them when
    freed, so every one pays its page faults again: a Q8_0 0.8B-shape pp512 took 1.5-1.6 s that way and
    1.06 s with the blocks kept. Memory the load frees is still handed back explicitly (malloc_trim)."""
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        ok = False
    _allocator_tuned = ok
    return ok


def _libgomp():
    """The libgomp torch loaded (found by its mapping), or None where torch uses another OpenMP runtime."""
    global _gomp
    if _gomp is None:
        path = ""
        try:
            with open("/proc/self/maps") as f:
                path = next((line.split()[-1] for line in f if "libgomp" in line and line.split()[-1].startswith("/")),
                            "")
        except OSError:
            pass
        try:
            _gomp = ctypes.CDLL(path) if path else False
        except OSError:
            _gomp = False
    return _gomp or None


def serial_here() -> bool:
    """Run the calling thread's torch ops without a parallel team, leaving every other thread as it is
    (OpenMP's thread count is a per-thread setting; torch.set_num_threads would also change MKL's and the
    default of threads started later). Returns whether it could."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch's own per-thread initialisation first, or it would undo this later
    lib.omp_set_num_threads(1)
    return True

SPLIT_MIN_BYTES = 64 << 20  # the demo model (8 MB) stays on one thread; the 0.8B shape (500+ MB) splits


def available_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


def plan_threads(weight_bytes: int, requested: int | None = None) -> tuple[int, str]:
    """(threads, why) for a model whose forward reads `weight_bytes` per token."""
    cores = available_cores()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be at least 1, got {requested}")
        return requested, "asked for"
    if weight_bytes < SPLIT_MIN_BYTES or cores == 1:
        why = (f"{weight_bytes / (1 << 20):.0f} MiB of weights per token is too little to split"
               if cores > 1 else "one core available")
        return 1, why
    return cores, f"the {cores} cores this process may use"


def plural(n: int, word: str) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} {word}" + ("" if n == 1 else "s")


PSI_CPU = "/proc/pressure/cpu"


_psi_missing = False


def cpu_stall_seconds() -> float | None:
    """Seconds, since boot, in which some runnable task of this machine waited for a CPU (the kernel's pressure
    stall information, "some" line), or None where the kernel does not report it (not asked again then)."""
    global _psi_missing
    if _psi_missing:
        return None
    try:
        with open(PSI_CPU) as f:
            return int(f.readline().rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        _psi_missing = True
        return None


class ThreadGovernor:
    """The thread count of the native decode, chosen by measuring it (see the module's docstring).

    A step of a team of `most` threads waits at every barrier for its slowest thread; when another process
    takes one of the cores, that thread runs a fraction of the time and the whole step waits for it (measured
    on the 0.8B shape, 2 cores: 31.6 tok/s quiet, 4.4-8.9 with one competing busy process; one thread: 23.4 quiet,
    19.1 with the competitor). So the decode times its steps and tries the other count for a few steps (`PROBE`
    of them), keeping whichever was faster: `most` threads on a quiet machine, one thread while a core is busy.

    When to try: where the kernel reports CPU pressure (`record`'s `stalled`: seconds in which some runnable task
    waited for a CPU during the step), a team of `most` threads tries one thread only once the steps show that
    wait (`CONTENDED` of a step's time, the median of `PROBE` steps; measured on the 0.8B shape: 0.0 ms of 26 ms
    quiet, 28-159 ms of 56-314 ms with a competitor). A quiet decode then never leaves its threads: before, it
    tried one thread after `PROBE` steps and every `EVERY`-`EVERY_MAX` after, which on the 9B shape made four of a
    16-token decode's steps run at half speed. Without that report, and on one thread (whose wait says nothing
    of the other core), it tries now and then: after `PROBE` steps first, then a probe that loses doubles the
    wait before the next (from `EVERY` steps up to `EVERY_MAX`), so a steady state costs a few percent (a probe
    of 4 steps every 64-512). Steps that turn `SLOWED` times slower than the best seen at the current count (a
    competitor arrived) try at once; a pressure-triggered try that loses waits as a periodic one does.
    """

    PROBE = 4
    EVERY = 64
    EVERY_MAX = 512
    MARGIN = 0.85  # a probe must be this much faster to take over (a few noisy steps must not move a quiet decode)
    SLOWED = 2.0  # steps this much slower than the best seen at the current count: probe now, not at the next turn
    CONTENDED = 0.1  # CPU pressure of at least this share of a step's time: another process wants our cores

    def __init__(self, most: int):
        self.most = max(int(most), 1)
        self.current = self.most
        self._trial: int | None = None      # the count being probed, if a probe runs
        self._times: dict[int, list[float]] = {}
        self._best: dict[int, float] = {}   # the fastest median of PROBE steps seen per count
        self._stalls: list[float] = []      # the last PROBE steps' CPU pressure, as shares of their times
        self._sensing = False               # whether steps come with CPU pressure
        self._every = self.PROBE  # the first probe early: a busy core is found within a few steps of the start
        self._steps = 0
        self._rows = 0
        self.switches = 0
        self.probes = 0

    def threads(self) -> int:
        return self._trial if self._trial is not None else self.current

    def record(self, seconds: float, rows: int, stalled: float | None = None) -> None:
        """One decode step of `rows` sequences took `seconds` with `threads()` threads, during which some runnable
        task waited `stalled` seconds for a CPU (None: not known)."""
        if self.most == 1:
            return
        if rows != self._rows:  # times are compared between steps of one batch size only
            self._rows, self._times, self._best, self._trial, self._steps = rows, {}, {}, None, 0
        n = self.threads()
        times = self._times.setdefault(n, [])
        times.append(seconds)
        del times[:-self.PROBE]
        if stalled is not None:
            self._sensing = True
            self._stalls.append(stalled / seconds if seconds > 0 else 0.0)
            del self._stalls[:-self.PROBE]
        self._steps += 1
        if len(times) < self.PROBE:
            return
        now = _median(times)
        slowed = now > self.SLOWED * self._best.get(n, now)
        self._best[n] = min(self._best.get(n, now), now)
        if self._trial is not None:
            if self._steps >= self.PROBE:
                self._decide()
            return
        due = self._steps >= self._every
        if self._sensing and self.current == self.most:  # try one thread only where the cores are wanted
            due = due and len(self._stalls) >= self.PROBE and _median(self._stalls) >= self.CONTENDED
        if due or slowed:
            self._trial = 1 if self.current == self.most else self.most
            self._times[self._trial] = []
            self._steps = 0
            self.probes += 1

    def _decide(self) -> None:
        trial, base = self._trial, self.current
        if _median(self._times[trial]) < self.MARGIN * _median(self._times[base]):
            self.current, self._every = trial, self.EVERY
            self.switches += 1
        else:
            self._every = min(max(self._every * 2, self.EVERY), self.EVERY_MAX)
        self._trial, self._steps = None, 0
        self._stalls = []  # the wait seen before the try is no evidence about the count now running


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]
