"""The compile queue: what constrains an answer (a schema, an enforced tool choice), compiled before the request takes
a slot, without one client's slow schemas holding up everybody else's.

- **Fast lane.** A grammar already compiled (the engine's cache) or `json_object` (a fixed grammar of ours) is served
  at once on a thread of its own, never behind a queue of schemas (session/grammar.py: `isolated(cache_only=True)`
  compiles nothing and says NotCached).
- **Fair queue.** The rest compile one at a time in the compile process (bounded in time, stopped when their client
  leaves: session/compile_worker.py). Waiting compiles are queued per client (its API key's tenant and its address)
  and taken round-robin: a client with twenty slow schemas waiting delays another's one schema by at most one compile
  of its own, not twenty. A client may have at most `PER_CLIENT` compiles waiting; more are refused (429) by name.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from deltaserve.frontends.server.protocol import APIError
from deltaserve.api import NotCached, isolated

PER_CLIENT = 4


class CompileQueue:
    def __init__(self, timeout_s: float, per_client: int = PER_CLIENT, gone_errors: tuple = ()):
        self.timeout_s = timeout_s
        self.gone_errors = (asyncio.CancelledError, *gone_errors)  # what a request whose client left raises
        self.per_client = per_client
        self.fast_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-grammar-fast")
        self.slow_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-grammar")
        self._queues: OrderedDict[str, deque] = OrderedDict()  # client -> waiting compiles, in turn order
        self._busy = False
        # waiting for the compile thread; on it; whose client left; served by the fast lane; refused (over a share)
        self.counts = {"waiting": 0, "running": 0, "abandoned": 0, "fast": 0, "refused": 0}

    async def grammar(self, work: tuple, client: str, gone_of=None):
        """`work[0](*work[1:])` (a grammar compile) for `client`; `gone_of(awaitable)` awaits it while watching the
        client (server.until_gone); the compile is stopped once the client has left."""
        loop = asyncio.get_running_loop()
        gone = threading.Event()
        watch = gone_of or (lambda a: a)

        def fast():
            with isolated(self.timeout_s, gone.is_set, cache_only=True):
                return work[0](*work[1:])

        try:
            try:
                out = await watch(loop.run_in_executor(self.fast_pool, fast))
                self.counts["fast"] += 1
                return out
            except NotCached:
                pass
            return await watch(self._slow(work, client, gone))
        except self.gone_errors:
            gone.set()
            self.counts["abandoned"] += 1  # not started yet: never will be; running: stopped
            raise

    async def _slow(self, work: tuple, client: str, gone: threading.Event):
        waiting = self._queues.get(client)
        if waiting is not None and len(waiting) >= self.per_client:
            self.counts["refused"] += 1
            raise APIError(429, f"this client already has {len(waiting)} schemas waiting to compile (at most "
                                f"{self.per_client} at once): retry once they are done", "rate_limit_error",
                           "response_format", "too_many_compiles", {"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()

        def compile_it():
            self.counts["running"] += 1  # (this thread alone writes it)
            try:
                with isolated(self.timeout_s, gone.is_set):
                    return work[0](*work[1:])
            finally:
                self.counts["running"] -= 1

        entry = (compile_it, fut)
        self._queues.setdefault(client, deque()).append(entry)
        self.counts["waiting"] += 1
        self._next()
        try:
            return await fut
        finally:
            self.counts["waiting"] -= 1
            q = self._queues.get(client)
            if q is not None and entry in q:  # left before its turn: never started
                q.remove(entry)
                if not q:
                    del self._queues[client]

    def _next(self) -> None:
        """Start the next client's next compile (round-robin over clients) unless one is running."""
        if self._busy:
            return
        while self._queues:
            client, q = next(iter(self._queues.items()))
            self._queues.move_to_end(client)  # its next compile waits for the others' turns
            fn, fut = q.popleft()
            if not q:
                del self._queues[client]
            if fut.done():
                continue
            self._busy = True
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(self.slow_pool, fn)

            def done(f, fut=fut):
                self._busy = False
                if not fut.done():
                    if f.cancelled():
                        fut.cancel()
                    elif f.exception() is not None:
                        fut.set_exception(f.exception())
                    else:
                        fut.set_result(f.result())
                self._next()

            running.add_done_callback(done)
            return
