"""deltaserve on Ray Serve: N replicas behind one OpenAI-compatible endpoint, each conversation routed to its state.

`deltaserve serve MODEL --replicas N` (or a Ray Serve config file naming `deltaserve.ray:build`) runs:

- **N replica deployments** (`deltaserve-replica-0` ... `-N-1`, one Ray Serve replica each): a whole `deltaserve
  serve` (slots, state store, the same FastAPI app with every route, check and error) in a Ray actor, answering the
  HTTP requests the router hands it through its ASGI app. Ray Serve restarts a replica whose process dies.
- **One router deployment** (`deltaserve-router`, the application's ingress, behind Ray Serve's HTTP proxy): it
  renders and tokenizes each generation request (the model file's tokenizer and chat template, no weights) and
  sends it to the replica that holds the longest saved prefix of its prompt, by an index of which replica each
  conversation's checkpoints went to (the prefix a turn's state covers: its prompt before the generation header).
  A prompt no replica holds goes where a consistent (rendezvous) hash of the conversation's opening tokens (up to
  its first assistant turn) puts it among the replicas that are up, so a conversation stays put from its first turn
  and only the conversations of a replica that goes away move. A Responses API request that names a stored
  response (a follow-up's `previous_response_id`, a retrieval) goes to the replica that answered it (the router
  notes each response's id from its answer's `x-deltaserve-response-id`); any other reads the response and its
  state from the shared directory. A replica whose slots are all busy sends the request
  to one with a free slot; one that is down is skipped.
- **One state store directory** (`--state-dir`) all replicas share: every turn's checkpoint is written through to
  it, and a replica that gets a conversation it never served restores the state another replica wrote
  (deltaserve/session/store.py indexes the other processes' files) and prefills only the new suffix.

Failures: a replica killed mid-request fails its in-flight requests cleanly: a request with nothing streamed yet is
retried once on another replica; a stream that had begun ends with an error event and `[DONE]`. The router marks
the replica down, sends its conversations to the others (restored from the store) and takes it back once Ray Serve
has restarted it. States are keyed by the exact token ids they cover and checked (model, version, CRC) when read,
so no answer ever comes from a wrong state.

Threads: replicas on one machine share its cores: each gets cores // replicas threads (at least 1; a model too
small to split gets 1), and asks Ray for that many CPUs.

A Ray Serve config file::

    applications:
      - name: deltaserve
        route_prefix: /
        import_path: deltaserve.ray:build
        args: {model: /models/qwen3.5-0.8b-q8_0.gguf, replicas: 2, slots: 2, state_dir: /shared/deltaserve-states}

`serve run config.yaml` (or `serve deploy` to a running cluster). `args` takes the long options of `deltaserve
serve` with underscores (model, replicas, slots, queue, threads, ctx, state_dir, state_ram, state_disk, think,
api_key, model_name, allowed_hosts, max_tokens_limit, max_body, max_messages, max_image_pixels, allow_image_urls,
compile_timeout, device, step_ms, reasoning_budget, reasoning_budget_message, reasoning_effort_budgets, loop_guard).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from deltaserve.errors import DeltaserveError
from deltaserve.api import SPLIT_MIN_BYTES, available_cores, plural
from deltaserve.api import prefix_hashes
from deltaserve.session.turns import thinking_flag

# what `deltaserve serve` would take by default, for a config file that leaves options out
DEFAULTS = dict(model=None, replicas=2, slots=2, queue=16, threads=None, ctx=None, device="cpu", think="auto",
                api_key=None, model_name=None, allowed_hosts=None, host="127.0.0.1", max_tokens_limit=None,
                max_body=4 << 20, max_messages=512, max_image_pixels=16_777_216, allow_image_urls=False,
                compile_timeout=10.0, state_ram=None, state_dir=None, state_disk=None, compute_thread="auto", revalidate=False,
                request_timeout=30.0, mtp=None, draft=None, mmproj=None, step_ms=None, reasoning_budget=-1,
                reasoning_budget_message="", reasoning_effort_budgets=None, loop_guard=None)
INDEX_ENTRIES = 1 << 16      # saved prefixes the router remembers (least recently used forgotten first)
OPENING_TOKENS = 64          # the opening of a prompt with no assistant turn marker: its first tokens
PROBE_S = 1.0                # how often the router checks its replicas
PING_TIMEOUT_S = 5.0


def options(args: dict | argparse.Namespace | None = None, **more) -> dict:
    """The replica options of `args` (a config file's args, or serve's parsed arguments) over DEFAULTS."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    given.update(more)
    unknown = sorted(set(given) - set(DEFAULTS) - {"ray_address", "port", "command", "func", "max_connections"})
    if unknown and not isinstance(args, argparse.Namespace):
        raise DeltaserveError(f"deltaserve.ray: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(DEFAULTS))})")
    opts = {k: given.get(k, v) for k, v in DEFAULTS.items()}
    opts["model"] = str(opts["model"]) if opts["model"] else None
    for key in ("state_ram", "state_disk"):
        if isinstance(opts[key], str):
            from deltaserve.api import parse_size

            opts[key] = parse_size(opts[key])
    if int(opts["replicas"]) < 1 or int(opts["slots"]) < 1:
        raise DeltaserveError(f"--replicas and --slots must be at least 1 (got {opts['replicas']}, {opts['slots']})")
    return opts


def replica_threads(model_bytes: int, replicas_here: int, cores: int, requested: int | None = None) -> tuple[int, str]:
    """(threads, why) for one of `replicas_here` replicas sharing `cores`: never more than its share of them, so
    N replicas do not oversubscribe the machine (kernels/cpu.py: a model too small to split takes one)."""
    if requested:
        return int(requested), "asked for (--threads)"
    share = max(cores // max(replicas_here, 1), 1)
    if model_bytes < SPLIT_MIN_BYTES:
        return 1, f"{model_bytes / (1 << 20):.0f} MiB of weights is too little to split"
    return share, f"{plural(cores, 'core')} shared by {plural(replicas_here, 'replica')}"


# -- which replica holds what ------------------------------------------------------------------------------------

class PrefixIndex:
    """Which replica each saved prefix went to: the longest remembered proper prefix of a prompt, found as the
    state store finds its states (prefix hashes looked up at every remembered length, longest first, then the tokens
    compared). Bounded: the least recently used prefixes are forgotten first."""

    def __init__(self, limit: int = INDEX_ENTRIES):
        self.limit = limit
        self._entries: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._by_hash: dict[tuple[int, int], tuple[int, ...]] = {}
        self._lengths: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], replica: int) -> None:
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            return
        if tokens in self._entries:
            self._entries[tokens] = replica
            self._entries.move_to_end(tokens)
            return
        self._entries[tokens] = replica
        self._by_hash[(len(tokens), prefix_hashes(tokens, len(tokens))[-1])] = tokens
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        while len(self._entries) > self.limit:
            old, _ = self._entries.popitem(last=False)
            self._by_hash.pop((len(old), prefix_hashes(old, len(old))[-1]), None)
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]

    def longest(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """(replica, tokens covered) of the longest remembered proper prefix of `prompt`, or None."""
        lengths = sorted((n for n in self._lengths if n < len(prompt)), reverse=True)
        if not lengths:
            return None
        hashes = prefix_hashes(prompt, lengths[0])
        for n in lengths:
            tokens = self._by_hash.get((n, hashes[n - 1]))
            if tokens is not None and tokens == tuple(prompt[:n]):
                self._entries.move_to_end(tokens)
                return self._entries[tokens], n
        return None


def rendezvous(key: bytes, replicas: Sequence[int]) -> int:
    """The replica a consistent (highest random weight) hash gives `key` among `replicas`: when one goes away only
    its keys move, each to where it would have gone without it."""
    return max(replicas, key=lambda r: hashlib.blake2b(key + b"/" + str(r).encode(), digest_size=8).digest())


def named_response(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request names: a POST /v1/responses's previous_response_id, or the id in
    /v1/responses/{id}[/input_items]."""
    if path == "/v1/responses" and method == "POST":
        try:
            prev = json.loads(body).get("previous_response_id")
        except (ValueError, AttributeError, RecursionError):
            return None
        return prev if isinstance(prev, str) else None
    if path.startswith("/v1/responses/"):
        return path[len("/v1/responses/"):].split("/", 1)[0] or None
    return None


class Routes:
    """The routing policy, apart from Ray (tested on its own): where a prompt goes, given which replicas are up and
    how many requests each has in flight."""

    def __init__(self, replicas: int, slots: int, im_start: int | None, assistant: Sequence[int]):
        self.n = replicas
        self.slots = slots
        self.im_start = im_start
        self.assistant = tuple(assistant)
        self.index = PrefixIndex()
        self.responses: OrderedDict[str, int] = OrderedDict()  # stored response id -> the replica that answered it
        self.inflight = [0] * replicas
        self.up = [True] * replicas
        self.counts: dict[str, int] = {}

    def checkpoint_cut(self, prompt: Sequence[int]) -> int:
        """Where a replica's session takes this prompt's checkpoint (session.checkpoint_position): before its last
        <|im_start|>, else before its last token."""
        if self.im_start is not None:
            for i in range(len(prompt) - 1, 0, -1):
                if prompt[i] == self.im_start:
                    return i
        return len(prompt) - 1

    def opening(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The conversation's opening tokens: the prompt up to its first assistant turn (the same in every turn of
        a conversation, and in its first, where that turn is the generation header), else its first tokens."""
        a, k = self.assistant, len(self.assistant)
        if self.im_start is not None and k:
            for i, t in enumerate(prompt):
                if t == self.im_start and tuple(prompt[i + 1:i + 1 + k]) == a:
                    return tuple(prompt[:i])
        return tuple(prompt[:OPENING_TOKENS])

    def _free(self, r: int) -> bool:
        return self.inflight[r] < self.slots

    def answered(self, response_id: str, replica: int) -> None:
        """A stored response (the Responses API) was answered by `replica`: its state is there."""
        self.responses[response_id] = replica
        self.responses.move_to_end(response_id)
        while len(self.responses) > self.index.limit:
            self.responses.popitem(last=False)

    def choose(self, prompt: Sequence[int] | None, avoid: Sequence[int] = (),
               response: str | None = None) -> tuple[int | None, str, int]:
        """(replica, why, tokens its state covers by the index) for a prompt (None: a request without one), or for
        a request that names a stored response (`response`: a follow-up by previous_response_id, or a retrieval):
        the replica that answered it, whose slot or store holds its state, while it is up and has a free slot (any
        other restores the state from the shared store, or reads the response's items from it)."""
        live = [r for r in range(self.n) if self.up[r] and r not in avoid]
        if not live:
            return None, "none up", 0
        least = min(live, key=lambda r: (self.inflight[r], r))
        if response is not None and response in self.responses:
            r = self.responses[response]
            if r in live and self._free(r):
                return r, "response", 0
            return least, "response replica " + ("full" if r in live else "down"), 0
        if not prompt:
            return least, "least busy", 0
        held = self.index.longest(prompt)
        if held is not None:
            r, n = held
            if r in live and self._free(r):
                return r, "prefix", n
            free = [x for x in live if self._free(x)]
            why = "prefix replica down" if r not in live else "prefix replica full"
            if free:
                return min(free, key=lambda x: (self.inflight[x], x)), why, 0
            if r in live:
                return r, "prefix (all full)", n
            return least, why, 0
        h = rendezvous(json.dumps(self.opening(prompt)).encode(), live)
        if self._free(h):
            return h, "hash", 0
        free = [x for x in live if self._free(x)]
        return (min(free, key=lambda x: (self.inflight[x], x)) if free else h), "hash replica full", 0

    def routed(self, prompt: Sequence[int] | None, replica: int, why: str) -> None:
        self.counts[why] = self.counts.get(why, 0) + 1
        if prompt:
            cut = self.checkpoint_cut(prompt)
            if cut > 0:
                self.index.put(prompt[:cut], replica)


# -- the replica: a deltaserve server in a Ray actor ---------------------------------------------------------------

class ReplicaServer:
    """One `deltaserve serve` without its socket: the model, slots, state store and FastAPI app, answering the
    HTTP requests the router hands it (`handle`) through the app's ASGI interface."""

    def __init__(self, opts: dict, index: int = 0, replicas_here: int = 1, cores: int | None = None):
        from deltaserve.api import load
        from deltaserve.frontends.common import resolve_model
        from deltaserve.frontends.server.app import HostPolicy, Server, create_app, thinking_defaults, wants_compute_thread
        from deltaserve.frontends.server.protocol import Limits

        a = argparse.Namespace(**opts)
        self.index = index
        path = resolve_model(a.model)
        try:
            size = os.path.getsize(path) if os.path.isfile(path) else sum(
                e.stat().st_size for e in os.scandir(path) if e.is_file())
        except OSError:
            size = 0
        threads, why = replica_threads(size, replicas_here, cores or available_cores(), a.threads)
        a.model = path
        model = load(path, device=a.device, threads=threads, compute_thread=wants_compute_thread(a), draft=a.draft,
                     mmproj=a.mmproj, kv_type=getattr(a, "kv_type", None))
        model.threads_why = f"replica {index}: {why}"
        if a.step_ms is not None:
            model.engine.step_s = a.step_ms / 1000
        self.threads = threads
        thinking, think = thinking_defaults(a, thinking_flag(a.think))
        self.server = Server(model, slots=a.slots, queue=a.queue, api_key=a.api_key, model_name=a.model_name,
                             limits=Limits(max_tokens=a.max_tokens_limit, max_messages=a.max_messages,
                                           max_body=a.max_body, max_image_pixels=a.max_image_pixels,
                                           image_urls=a.allow_image_urls, compile_timeout=a.compile_timeout),
                             device=a.device, think_default=think, context=a.ctx, revalidate=a.revalidate,
                             state_ram=a.state_ram, state_dir=a.state_dir, state_disk=a.state_disk,
                             hosts=HostPolicy(a.host, a.allowed_hosts), request_timeout=a.request_timeout,
                             mtp=a.mtp, thinking=thinking,
                             loop_guard=None if a.loop_guard is None else a.loop_guard == "on")
        if a.state_ram is None and replicas_here > 1:  # the default RAM share is the machine's, split between them
            self.server.store.ram_budget //= replicas_here
        self.app = create_app(self.server, webui=getattr(a, "webui", True))
        s0 = self.server.pool.slots[0].session
        print(f"[deltaserve] replica {index} (pid {os.getpid()}): {model.path.name}, backend {s0.backend.describe(s0.kv_type)}; "
              f"{self.server.store.describe().removeprefix('[deltaserve] ')}", file=sys.stderr, flush=True)

    def info(self) -> dict:
        return {"replica": self.index, "pid": os.getpid(), "host": socket.gethostname(), "threads": self.threads,
                "slots": len(self.server.pool.slots), "busy": self.server.pool.busy}

    def actor(self):
        """This replica's Ray actor (the router asks it directly whether the process is alive: a call through the
        deployment's handle would wait for a replacement instead of failing)."""
        import ray

        return ray.get_runtime_context().current_actor

    async def handle(self, head: dict, body: bytes):
        """One HTTP request through the app: yields {status, headers, body, more} once the response starts (with
        its first body bytes; a whole response when it is not streamed), then the rest of the body, chunk by chunk.
        Cancelled (the client left): the app sees the client disconnect, and stops the generation."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": head["method"], "scheme": "http", "path": head["path"],
                 "raw_path": head["path"].encode("utf-8"), "query_string": head.get("query", "").encode("latin-1"),
                 "root_path": "", "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]],
                 "client": tuple(head["client"]) if head.get("client") else None, "server": ("127.0.0.1", 0)}
        gone = asyncio.Event()
        pending = [body]

        async def receive():
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        out: asyncio.Queue = asyncio.Queue()

        async def send(message):
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda t: out.put_nowait(None))
        started = None
        try:
            while True:
                message = await out.get()
                if message is None:
                    if task.exception() is not None:
                        raise task.exception()
                    if started is not None:  # the app ended without closing its body: close it
                        yield started
                    return
                if message["type"] == "http.response.start":
                    started = {"status": message["status"],
                               "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])],
                               "body": b"", "more": True}
                    continue
                if message["type"] != "http.response.body":
                    continue
                data, more = message.get("body", b""), message.get("more_body", False)
                if started is not None:
                    started["body"], started["more"] = data, more
                    first, started = started, None
                    yield first
                elif data:
                    yield data
                if not more:
                    return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app had its chance to stop
                    task.cancel()

    def close(self) -> None:
        self.server.store.close()  # the states being written reach the disk


# -- the router ---------------------------------------------------------------------------------------------------

def _error(status: int, message: str, code: str, type_: str = "server_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def merge_metrics(texts: dict[int, str]) -> str:
    """Several replicas' Prometheus expositions as one: every sample labelled with its replica, each family's HELP
    and TYPE once, its samples together."""
    families: OrderedDict[str, list[str]] = OrderedDict()
    heads: dict[str, list[str]] = {}
    for r, text in texts.items():
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    families.setdefault(family, [])
                    heads.setdefault(family, [])
                    if line not in heads[family]:
                        heads[family].append(line)
                continue
            name, brace, rest = line.partition("{")
            if brace:
                sample = f'{name}{{replica="{r}",{rest}'
            else:
                name, _, value = line.partition(" ")
                sample = f'{name}{{replica="{r}"}} {value}'
            families.setdefault(family or name, []).append(sample)
    out = []
    for family, samples in families.items():
        out += heads.get(family, []) + samples
    return "\n".join(out) + "\n"


class ReplicaGone(Exception):
    """The replica a request waited on was found gone (by the router's watch) before it answered."""


def _is_replica_gone(e: BaseException) -> bool:
    if isinstance(e, ReplicaGone):
        return True
    import ray.exceptions
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                          ray.exceptions.NodeDiedError, ReplicaUnavailableError, DeploymentUnavailableError))


class Router:
    """The ingress: HTTP in, the replica chosen by `Routes`, the replica's response streamed back."""

    def __init__(self, opts: dict, *replicas):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from deltaserve.demo import default_model_path, thinking_default
        from deltaserve.api import open_model

        self.opts = opts
        self.handles = list(replicas)
        path = opts["model"] or str(default_model_path())
        self.tokenizer = open_model(path).tokenizer  # the tokenizer and chat template only: no weights
        think = thinking_flag(opts["think"])
        self.think = think if think is not None else thinking_default(path)
        im_start = getattr(self.tokenizer, "im_start_id", None)
        self.routes = Routes(len(replicas), int(opts["slots"]), im_start, self.tokenizer.encode("assistant"))
        self.info: list[dict | None] = [None] * len(replicas)
        self.restarts = [0] * len(replicas)
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltaserve-route")
        self.registry = reg = CollectorRegistry()
        self.m_routed = Counter("deltaserve_router_requests", "Requests the router sent, by replica and why there "
                                "(prefix: the replica its saved prefix went to; hash: the consistent hash of its "
                                "opening; ... full/down: moved to another replica).", ["replica", "route"],
                                registry=reg)
        self.m_retries = Counter("deltaserve_router_retries", "Requests retried on another replica (theirs went away "
                                 "before anything was streamed).", registry=reg)
        self.m_broken = Counter("deltaserve_router_broken_streams", "Streams that ended with an error event: their "
                                "replica went away mid-stream.", registry=reg)
        self.m_up = Gauge("deltaserve_router_replica_up", "Whether the router sends requests to a replica.",
                          ["replica"], registry=reg)
        self.m_restarts = Gauge("deltaserve_router_replica_restarts", "Times a replica came back in a new process.",
                                ["replica"], registry=reg)
        self._probe = None
        self.retries = self.broken = 0
        self.actors: list = [None] * len(replicas)
        self.down = [asyncio.Event() for _ in replicas]  # set when a replica goes away

    # -- replicas up and down -------------------------------------------------------------------------------
    async def _ping(self, r: int) -> dict | None:
        """The replica's info, or None when it is gone. An up replica is asked through its actor (a dead one fails
        at once); a down one through its deployment (that call waits until Ray Serve has started it again)."""
        try:
            if self.routes.up[r] and self.actors[r] is not None:
                await asyncio.wait_for(self.actors[r].__ray_ready__.remote(), PING_TIMEOUT_S)
                return self.info[r]
            info = await asyncio.wait_for(self.handles[r].info.remote(), PING_TIMEOUT_S)
            self.actors[r] = await asyncio.wait_for(self.handles[r].actor.remote(), PING_TIMEOUT_S)
            return info
        except asyncio.TimeoutError:
            return self.info[r] if self.routes.up[r] else None  # alive but slow (busy) is still up
        except Exception:  # noqa: BLE001 - the actor died, or is not there yet
            return None

    def _mark(self, r: int, info: dict | None) -> None:
        """Replica `r` answered (`info`: its pid, host, threads) or is gone (None)."""
        if info is None:
            if self.routes.up[r]:
                self.down[r].set()  # requests waiting for this replica's first answer go elsewhere
            self.routes.up[r] = False
            self.actors[r] = None
        else:
            if not self.routes.up[r] or self.down[r].is_set():
                self.down[r] = asyncio.Event()
            old = self.info[r]
            if old is not None and old.get("pid") != info.get("pid"):
                self.restarts[r] += 1  # Ray Serve started it again, in a new process
            self.info[r] = info
            self.routes.up[r] = True
        self.m_up.labels(replica=str(r)).set(int(self.routes.up[r]))
        self.m_restarts.labels(replica=str(r)).set(self.restarts[r])

    async def _watch(self) -> None:
        while True:
            infos = await asyncio.gather(*(self._ping(r) for r in range(len(self.handles))))
            for r, info in enumerate(infos):
                self._mark(r, info)
            await asyncio.sleep(PROBE_S)

    def _start_watch(self) -> None:
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._watch())

    # -- routing ----------------------------------------------------------------------------------------------
    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The ids a generation request's prompt renders to (as the replica will render it), or None (not a
        generation request, or one the replica will refuse: routing does not matter then)."""
        from deltaserve.frontends.server.protocol import Limits, parse_chat, parse_completion
        from deltaserve.api import driver

        if path not in ("/v1/chat/completions", "/v1/completions"):
            return None
        try:
            data = json.loads(body)
            limits = Limits(max_body=int(self.opts["max_body"]), max_messages=int(self.opts["max_messages"]),
                            max_tokens=self.opts["max_tokens_limit"])
            req = parse_chat(data, limits) if path == "/v1/chat/completions" else parse_completion(data, limits)
            # rendered by the turn driver's input half, as the replica renders it (session/driver.py)
            return driver.prepare(self.tokenizer, 1 << 62, request=req.turn, raw=req.prompt,
                                  default_thinking=self.think, images=False).ids
        except Exception:  # noqa: BLE001 - the replica answers the request's error
            return None

    async def __call__(self, request):
        from starlette.responses import JSONResponse, Response, StreamingResponse

        self._start_watch()
        path = request.url.path
        body = bytearray()
        limit = int(self.opts["max_body"])
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                break  # the replica refuses it (413) from its Content-Length or from what it gets
        head = {"method": request.method, "path": path, "query": request.url.query,
                "headers": [(k, v) for k, v in request.headers.items()],
                "client": list(request.client) if request.client else None}
        if request.method == "GET" and path in ("/health", "/metrics"):
            return await (self.health(head) if path == "/health" else self.metrics(head))
        ids = None
        if request.method == "POST":
            ids = await asyncio.get_running_loop().run_in_executor(self.text_pool, self.prompt_ids, path, bytes(body))
        named = named_response(request.method, path, bytes(body))
        tried: list[int] = []
        while True:
            r, why, _ = self.routes.choose(ids, avoid=tried, response=named)
            if r is None:
                return JSONResponse(_error(503, f"no replica is up ({len(self.handles)} configured; restarting ones "
                                           "come back within seconds): retry shortly", "no_replica"), status_code=503,
                                    headers={"Retry-After": "1"})
            if tried:
                why = "retry"
                self.m_retries.inc()
                self.retries += 1
            self.routes.routed(ids, r, why)
            self.m_routed.labels(replica=str(r), route=why).inc()
            self.routes.inflight[r] += 1
            gen = self.handles[r].options(stream=True).handle.remote(head, bytes(body))
            try:
                first = await self._first(gen, r)
            except StopAsyncIteration:
                self.routes.inflight[r] -= 1
                return Response(status_code=500)
            except asyncio.CancelledError:
                self.routes.inflight[r] -= 1
                gen.cancel()
                raise
            except Exception as e:  # noqa: BLE001
                self.routes.inflight[r] -= 1
                if _is_replica_gone(e):
                    self._mark(r, None)
                    tried.append(r)
                    if len(tried) == 1:
                        continue  # nothing was streamed: once more, on another replica
                    return JSONResponse(_error(503, f"the replicas serving this request went away twice ({tried}): "
                                               "retry shortly", "replica_failed"), status_code=503,
                                        headers={"Retry-After": "1"})
                return JSONResponse(_error(500, f"the replica failed: {type(e).__name__}: {e}"[:500],
                                           "replica_failed"), status_code=500)
            break
        headers = [(k, v) for k, v in first["headers"]] + [("x-deltaserve-replica", str(r))]  # who answered
        made = next((v for k, v in headers if k.lower() == "x-deltaserve-response-id"), None)
        if made is not None and first["status"] == 200:
            self.routes.answered(made, r)
        if not first["more"]:
            self.routes.inflight[r] -= 1
            response = Response(content=first["body"], status_code=first["status"])
            response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
            return response
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in headers)

        async def rest():
            try:
                if first["body"]:
                    yield first["body"]
                async for chunk in gen:
                    yield chunk
            except asyncio.CancelledError:
                gen.cancel()  # the client left: the replica's app sees it disconnect
                raise
            except Exception as e:  # noqa: BLE001
                if _is_replica_gone(e):
                    self._mark(r, None)
                self.m_broken.inc()
                self.broken += 1
                if sse:
                    err = _error(500, f"the replica serving this stream went away mid-answer ({type(e).__name__}); "
                                 "resend the request: the conversation continues on another replica",
                                 "replica_failed")
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                self.routes.inflight[r] -= 1

        response = StreamingResponse(rest(), status_code=first["status"])
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
                                if k.lower() not in ("content-length", "transfer-encoding")]
        return response

    async def _first(self, gen, r: int):
        """The first item of a replica's answer; ReplicaGone if the replica is found gone before it comes."""
        nxt = asyncio.ensure_future(gen.__anext__())
        gone = asyncio.ensure_future(self.down[r].wait())
        try:
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            nxt.cancel()
            raise
        finally:
            gone.cancel()
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        gen.cancel()
        raise ReplicaGone(f"replica {r} went away")

    async def _each(self, head: dict) -> dict[int, tuple[int, bytes]]:
        """`head` (a GET) answered by every replica that is up: replica -> (status, body)."""
        async def one(r):
            try:
                gen = self.handles[r].options(stream=True).handle.remote(head, b"")
                first = await asyncio.wait_for(gen.__anext__(), PING_TIMEOUT_S * 2)
                data = first["body"]
                async for chunk in gen:
                    data += chunk
                return r, (first["status"], data)
            except Exception as e:  # noqa: BLE001
                if _is_replica_gone(e):
                    self._mark(r, None)
                return r, None

        got = await asyncio.gather(*(one(r) for r in range(len(self.handles)) if self.routes.up[r]))
        return {r: x for r, x in got if x is not None}

    async def health(self, head: dict):
        from starlette.responses import JSONResponse

        unknown = [r for r in range(len(self.handles)) if self.info[r] is None]
        for r, info in zip(unknown, await asyncio.gather(*(self._ping(r) for r in unknown))):
            self._mark(r, info)
        answers = await self._each(head)
        if not answers:
            return JSONResponse({"status": "unavailable", **_error(503, "no replica is up", "no_replica")},
                                status_code=503)
        for status, data in answers.values():
            if status != 200:  # a wrong key, a Host not allowed: the replica's own answer
                return JSONResponse(json.loads(data), status_code=status)
        parsed = {r: json.loads(data) for r, (_, data) in answers.items()}
        if all(set(p) == {"status"} for p in parsed.values()):
            return JSONResponse({"status": "ok"})  # a client without the key learns only that the endpoint is up
        replicas = []
        for r in range(len(self.handles)):
            entry = {"replica": r, "up": r in parsed and self.routes.up[r], "restarts": self.restarts[r],
                     "inflight": self.routes.inflight[r], **(self.info[r] or {})}
            entry.update(parsed.get(r, {}))
            replicas.append(entry)
        first = next(iter(parsed.values()))
        return JSONResponse({"status": "ok" if all(x["up"] for x in replicas) else "degraded",
                             "model": first.get("model"), "version": first.get("version"), "replicas": replicas,
                             "router": {"routed": dict(self.routes.counts), "index_prefixes": len(self.routes.index),
                                        "retries": self.retries,
                                        "broken_streams": self.broken,
                                        "state_dir": self.opts["state_dir"]}})

    async def metrics(self, head: dict):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import JSONResponse, Response

        answers = await self._each(head)
        for status, data in answers.values():
            if status != 200:
                return Response(content=data, status_code=status, media_type="application/json")
        if not answers:
            return JSONResponse(_error(503, "no replica is up", "no_replica"), status_code=503)
        text = merge_metrics({r: data.decode("utf-8") for r, (_, data) in sorted(answers.items())})
        return Response(content=text.encode() + generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


# -- the Ray Serve application -------------------------------------------------------------------------------------

def _loopback_grpc() -> None:
    """On a node whose address is loopback (a local instance: `main`), keep Ray Serve's per-replica gRPC server
    there too: Ray Serve 2.60 binds every replica's inter-deployment gRPC server to [::]:0 (all interfaces) whatever
    the node's address, the one server of the local instance that would listen beyond loopback. Runs in the
    replica's process before Ray Serve starts that server (after the deployment's constructor)."""
    try:
        import ray
        from ray.serve._private import replica as serve_replica

        from deltaserve.frontends.server.app import is_loopback

        if not is_loopback(ray.util.get_node_ip_address()):
            return
        bind = serve_replica.add_port_to_grpc_server
    except (ImportError, AttributeError):
        return
    if getattr(bind, "deltaserve_loopback", False):
        return

    def on_loopback(server, address: str):
        return bind(server, "127.0.0.1:" + address[len("[::]:"):] if address.startswith("[::]:") else address)

    on_loopback.deltaserve_loopback = True
    serve_replica.add_port_to_grpc_server = on_loopback


def _deployments():
    from ray import serve

    quiet = {"enable_access_log": False}  # a line per request and per hop is Ray's; deltaserve says what it decides

    @serve.deployment(name="deltaserve-replica", health_check_period_s=2, health_check_timeout_s=30,
                      graceful_shutdown_timeout_s=30, logging_config=quiet)
    class DeltaserveReplica(ReplicaServer):
        def __init__(self, *args, **kwargs):
            _loopback_grpc()
            super().__init__(*args, **kwargs)

        def __del__(self):  # Ray Serve calls it when it stops the replica
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

    @serve.deployment(name="deltaserve-router", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0},
                      logging_config=quiet)
    class DeltaserveRouter(Router):
        def __init__(self, *args, **kwargs):
            _loopback_grpc()
            super().__init__(*args, **kwargs)

    return DeltaserveReplica, DeltaserveRouter


def application(opts: dict, nodes: int = 1, cores: int | None = None):
    """The Ray Serve application of `opts` (see `options`): N replica deployments and the router in front."""
    replica_cls, router_cls = _deployments()
    n = int(opts["replicas"])
    cores = cores or available_cores()
    here = -(-n // max(nodes, 1))  # replicas per machine, spread evenly
    cpus = min(float(opts["threads"] or max(cores // here, 1)), cores / here)
    queue = int(opts["queue"])
    replicas = [replica_cls.options(name=f"deltaserve-replica-{i}", num_replicas=1,
                                    max_ongoing_requests=int(opts["slots"]) + queue + 8,
                                    max_queued_requests=-1, ray_actor_options={"num_cpus": cpus})
                .bind(opts, i, here, cores) for i in range(n)]
    return router_cls.bind(opts, *replicas)


def build(args: dict):
    """The application builder a Ray Serve config file names (`import_path: deltaserve.ray:build`, `args: {...}`)."""
    import ray

    opts = options(args)
    nodes, cores = 1, None
    if ray.is_initialized():
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in alive]
        if cpus and min(cpus) > 0:
            nodes, cores = len(alive), min(cpus)
    return application(opts, nodes, cores)


# -- `deltaserve serve --replicas N` ------------------------------------------------------------------------------

def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(a) -> int:
    """`deltaserve serve MODEL --replicas N [--ray-address ADDR]`: the application on a local Ray instance bound to
    loopback (or on the cluster at ADDR), until SIGINT or SIGTERM."""
    from deltaserve.api import cache_root
    from deltaserve.frontends.common import resolve_model

    say = lambda line: print(f"[deltaserve] {line}", file=sys.stderr, flush=True)  # noqa: E731
    a.model = resolve_model(a.model)
    a.replicas = a.replicas or 1
    opts = options(a)
    cleanup = None
    if opts["state_dir"] is None:
        if a.ray_address:
            say("warning: --ray-address without --state-dir: replicas on other machines cannot restore each other's "
                "conversations (give a --state-dir every machine mounts)")
        root = cache_root() / "replica-states"
        root.mkdir(parents=True, exist_ok=True)
        opts["state_dir"] = cleanup = tempfile.mkdtemp(prefix="run-", dir=root)
        say(f"state store shared by the replicas: {cleanup} (removed at exit; --state-dir DIR keeps it)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not a.ray_address:
        # Ray runs its workers at nice 15 (below everything else on the machine): a replica is the server, not
        # background work, so on a local instance they run at the priority `deltaserve serve` would have
        os.environ.setdefault("RAY_worker_niceness", "0")
    local = not a.ray_address
    from deltaserve.frontends.server.app import is_loopback

    if local and is_loopback(a.host):
        # Ray's own servers (GCS, raylet, workers) bind the node's address: on one machine, that is loopback
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
        from ray import serve
    except ImportError:
        raise DeltaserveError("--replicas runs on Ray Serve, which is not installed: pip install 'deltaserve[ray]'") \
            from None
    port = a.port or _free_port(a.host)
    t0 = time.perf_counter()
    if local:
        ray.init(address="local", num_cpus=available_cores(), include_dashboard=False, namespace="deltaserve",
                 log_to_driver=True)
        nodes, cores = 1, available_cores()
        say(f"local Ray instance on {ray.nodes()[0]['NodeManagerAddress']} ({plural(cores, 'CPU')}, no dashboard)")
    else:
        ray.init(address=a.ray_address, namespace="deltaserve", log_to_driver=True)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in alive] or [1]
        nodes, cores = len(alive), max(min(cpus), 1)
        say(f"joined the Ray cluster at {a.ray_address}: {plural(nodes, 'node')}, {sum(cpus)} CPUs")
    n = int(opts["replicas"])
    here = -(-n // nodes)
    if here > cores:
        say(f"warning: {n} replicas on {plural(nodes, 'machine')} of {plural(cores, 'core')}: more replicas than cores "
            "per machine, they share them")
    stop = threading.Event()
    try:
        serve.start(http_options={"host": a.host, "port": port})
        serve.run(application(opts, nodes, cores), name="deltaserve", route_prefix="/", blocking=False)
        say(f"{plural(n, 'replica')} of {os.path.basename(a.model)} up in {time.perf_counter() - t0:.1f} s "
            f"({a.slots} slots each; threads each: cores // replicas per machine)")
        say(f"listening on http://{a.host}:{port}/v1")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        say("stopping the replicas")
    finally:
        try:  # on a cluster of someone else's, only this application goes; a local instance goes whole
            if local:
                serve.shutdown()
            else:
                serve.delete("deltaserve")
        finally:
            ray.shutdown()
            if cleanup is not None:
                import shutil

                shutil.rmtree(cleanup, ignore_errors=True)
    return 0
