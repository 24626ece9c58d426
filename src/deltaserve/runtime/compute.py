"""The compute thread: one thread for a process's forwards, for the callers that run sessions on several threads
(the server).

PyTorch's CPU build runs its parallel regions on libgomp, which gives every thread that opens a parallel
region a team of worker threads of its own. Once the teams hold more threads than there are CPUs, libgomp
stops spinning between regions and parks its workers, and each of the hundreds of small parallel regions of a
forward then pays a wake-up. Measured here (2 cores, Q8_0 0.8B shape, a 106-token prefill): 260-330 ms on the
thread that loaded the model, 430-660 ms on any other thread, the first one slowed down as well.

So a multi-threaded caller runs every forward, the load and the state copies on one `ComputeThread`, and its
other threads (the event loop, the slots' threads that sample and stream) call `kernels.cpu.serial_here()` first:
their few torch ops (sampling over the vocabulary, small copies) then run inline and open no team.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Callable

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

    def close(self) -> None:
        self._queue.put(None)
