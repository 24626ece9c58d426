"""CPU runtime settings: one thread for a process's parallel work, for the callers that run sessions on
several threads (the server), and glibc told to keep freed blocks (`keep_freed_memory`).

PyTorch's CPU build runs its parallel regions on libgomp, which gives every thread that opens a parallel
region a team of worker threads of its own. Once the teams hold more threads than there are CPUs, libgomp
stops spinning between regions and parks its workers, and each of the hundreds of small parallel regions of a
forward then pays a wake-up. Measured here (2 cores, Q8_0 0.8B shape, a 106-token prefill): 260-330 ms on the
thread that loaded the model, 430-660 ms on any other thread, the first one slowed down as well.

So a multi-threaded caller runs every forward, the load and the state copies on one `ComputeThread`, and its
other threads (the event loop, the slots' threads that sample and stream) call `serial_here()` first: their
few torch ops (sampling over the vocabulary, small copies) then run inline and open no team.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Callable

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


class ComputeThread:
    """A thread that runs the functions handed to it, one at a time; `run` waits for the result (or raises
    what the function raised). Called from the compute thread itself, `run` calls inline."""

    def __init__(self, name: str = "deltaserve-compute"):
        self._queue: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def run(self, fn: Callable, *args, **kwargs):
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut.result()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def close(self) -> None:
        self._queue.put(None)
