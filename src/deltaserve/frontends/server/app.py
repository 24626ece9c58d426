"""`deltaserve serve`: an OpenAI-compatible HTTP server on resident sessions.

The server knows sessions and tokens, never tensors. Each generation runs in a worker thread; the event
loop only parses, queues and streams. A client that disconnects cancels its generation, and its slot's
state stays valid for the next request of that conversation.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deltaserve.api import settings
from deltaserve.api import MAX_AGE as GUARD_MAX_AGE
from deltaserve.api import __version__
from deltaserve.frontends.common import load_model
from deltaserve.errors import ContextError, DeltaserveError
from deltaserve.api import GrammarError, compile_format, compile_process
from deltaserve.api import check_prompt
from deltaserve.session.turns import CallArguments, CallStart, Content, Finish, Reasoning, stop_ids, thinking_flag
from deltaserve.frontends.server import anthropic, connections, ollama, openapi, streams, tokens
from starlette.middleware.cors import CORSMiddleware
from deltaserve.frontends.server.logprobs import CompletionLogprobs, chat_logprobs, joined
from deltaserve.session.driver import Choice, Logprobs
from deltaserve.frontends.server.compiles import CompileQueue
from deltaserve.frontends.server.metrics import Metrics
from deltaserve.frontends.server.protocol import clamp_headers, parse_json  # noqa: F401 - parse_json: app's name too
from deltaserve.frontends.server.protocol import (APIError, GenerationRequest, Limits, bad, image_limits, parse_chat,
                                                  parse_completion)
from deltaserve.frontends.server.tenants import Keys, partition
from deltaserve.frontends.server.responses import (Items, ResponsesRequest, frame, parse_responses, previous_not_found,
                                                    response_object, sse, usage)
from deltaserve.frontends.server.slots import QueueFull, SlotPool
from deltaserve.frontends.server.webui import add_webui, has_vision
from deltaserve.api import ResponseRecord, ResponseStore, new_id
from deltaserve.api import driver
from deltaserve.session.turns import ask
from deltaserve.api import ToolError
from deltaserve.api import ThinkingDefaults, check_budget, parse_effort_budgets

FINGERPRINT = f"deltaserve-{__version__}"
RESPONSES_RAM = 64 << 20  # --responses-ram: the stored responses' budget


def parse_body(parse, body: bytes, limits: Limits):
    """A body's JSON read and validated by `parse` (parse_chat, parse_completion, parse_responses): run off the event
    loop, where a 4 MB body of schemas or token ids costs a worker thread its time, not every other request's."""
    return parse(parse_json(body), limits)


def keys_of(api_key, api_keys_file: str | None) -> Keys:
    return Keys.of(api_key, api_keys_file, say=lambda line: print(f"[deltaserve] {line}", file=sys.stderr, flush=True))


def host_name(value: str) -> str:
    """The name in a Host header (or an --allowed-hosts entry), lowercased, without its port or a final dot:
    'LocalHost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        v = v[1:end] if end > 0 else v
    else:
        name, sep, port = v.rpartition(":")
        if sep and ":" not in name and (port.isdigit() or not port):
            v = name
    return v.rstrip(".")


def is_loopback(name: str) -> bool:
    """localhost, or a loopback address (127.0.0.0/8, ::1)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """The Host names a server answers to. On a loopback bind: loopback names only (localhost, 127.0.0.1, [::1],
    any port), so that a web page whose name was rebound to 127.0.0.1 (DNS rebinding) cannot reach the server;
    on any other bind: any name. --allowed-hosts adds names (exact, or '*.example.com' for the names under one;
    '*' for any); loopback names are always allowed (no page at another site can send them)."""

    def __init__(self, bind_host: str, allowed: str | None = None):
        entries = [host_name(e) for e in (allowed or "").split(",") if e.strip()]
        self.names = {e for e in entries if e != "*" and not e.startswith("*.")}
        self.suffixes = tuple(e[1:] for e in entries if e.startswith("*."))
        self.loopback_bind = is_loopback(host_name(bind_host))
        self.any = "*" in entries or (not entries and not self.loopback_bind)

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # HTTP/1.0 may leave Host out; a browser never does
            return True
        name = host_name(header)
        return is_loopback(name) or name in self.names or (bool(self.suffixes) and name.endswith(self.suffixes))

    def describe(self) -> str:
        if self.any:
            return "any Host name" + (" (--allowed-hosts *)" if self.loopback_bind else "")
        extra = sorted(self.names) + ["*" + s for s in self.suffixes]
        return "Host names localhost, 127.0.0.1, [::1]" + (f" and {', '.join(extra)}" if extra else "") + \
            " (--allowed-hosts widens)"

    def refusal(self, header: str) -> APIError:
        shown = header if len(header) <= 100 else header[:100] + "..."
        return APIError(403, f"this server does not answer to the Host name {shown!r}: it listens on a loopback "
                             "address and answers to localhost, 127.0.0.1 and [::1] (and the names its "
                             "--allowed-hosts lists), which keeps web pages on other sites out (DNS rebinding)",
                        "invalid_request_error", None, "host_not_allowed")


def completion_entries(turn) -> list:
    """A completion's tokens' log-probabilities, the stop token that ended it last (OpenAI's completions list it)."""
    rec = turn.logprobs
    return list(rec.entries) + ([rec.stop] if rec.stop is not None else [])


def shaped(path: str, e: APIError) -> JSONResponse | None:
    """An error in the shape its route's API writes errors (Anthropic's, Ollama's), or None: OpenAI's."""
    return anthropic.error_response(path, e) or ollama.error_response(path, e)


class ClientGone(Exception):
    """The client closed its connection while its request waited (in the queue, or for a whole answer)."""


async def until_gone(awaitable, request: Request | None, every_s: float = 0.05):
    """`await awaitable`, or ClientGone (the awaitable cancelled) once the client has disconnected: a request
    that is not streaming is not cancelled by the server when its client leaves, so it watches for itself."""
    task = asyncio.ensure_future(awaitable)
    if request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise


class Server:
    def __init__(self, model, slots: int = 2, queue: int = 16, api_key: str | None = None,
                 limits: Limits | None = None, model_name: str | None = None, device: str = "auto",
                 think_default: bool | None = None, context: int | None = None, quiet: bool = False,
                 revalidate: bool = False, state_ram: int | None = None, state_dir: str | None = None,
                 state_disk: int | None = None, hosts: HostPolicy | None = None,
                 request_timeout: float = connections.DEFAULT_REQUEST_TIMEOUT, log_prefills: bool = True,
                 guard_max_age: float = GUARD_MAX_AGE, mtp: int | None = None, api_keys_file: str | None = None,
                 responses_ram: int = RESPONSES_RAM, thinking: ThinkingDefaults | None = None,
                 loop_guard: bool | None = None, cors_origins: list[str] | None = None):
        self.model = model
        self.cors_origins = list(cors_origins or [])  # --cors-origin: the origins whose pages may call the API
        self.limits = limits or Limits()
        if thinking is not None:  # the budgets of requests that name none, and of the effort levels
            self.limits.thinking = thinking
        # the keys it accepts, each a tenant where there are several (frontends/server/tenants.py)
        self.keys = keys_of(api_key, api_keys_file)
        self.api_key = api_key if self.keys.required else None  # whether a key is required (the keys are in `keys`)
        self.hosts = hosts or HostPolicy("127.0.0.1")
        self.request_timeout = request_timeout
        self.guard: connections.ConnectionGuard | None = None  # set by main, for /health
        self.model_name = model_name or model.path.name
        # the names a request's `model` may give: the served id, and the file's name with and without its suffix
        self.model_names = list(dict.fromkeys([self.model_name, model.path.name, model.path.stem]))
        self.think_default = think_default if think_default is not None else model.thinking_default  # serve gave none: the model's own
        self.metrics = Metrics()
        # the conversation state store under the slots: a conversation whose slot was taken resumes from it
        self.store_notices: list[str] = []

        def store_say(line: str) -> None:
            self.store_notices.append(line)
            if not quiet:
                print(line, file=sys.stderr, flush=True)

        self.store = model.state_store(ram=state_ram, directory=state_dir, disk=state_disk, slots=slots,
                                       context=context, say=store_say)
        # the Responses API's stored responses, beside the states, within a RAM budget of their own (--responses-ram),
        # an equal share of it for each tenant; their files are read and written off the event loop (file_pool)
        self.responses = ResponseStore(budget=responses_ram, directory=state_dir, say=store_say,
                                       tenants=self.keys.tenants)
        self.file_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-files")
        sessions = model.slots(slots, context=context, device=device, revalidate=revalidate, quiet=quiet,
                               store=self.store, log_prefills=log_prefills and not quiet, guard_max_age=guard_max_age,
                               mtp=mtp, loop_guard=loop_guard)
        self.pool = SlotPool(sessions, queue)
        self.context = sessions[0].context
        self.limits.vision = model.host.vision is not None  # without an encoder an image part is refused unread
        self.limits.context = self.context
        self.limits.max_n = sessions[0].backend.max_rows  # n > 1: the choices' rows in one decode forward
        self.executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="deltaserve-slot",
                                           initializer=model.worker_initializer())
        # templates and tokenizers run here, not on the event loop (one large request must not stall the others)
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltaserve-text",
                                            initializer=model.worker_initializer())
        # schemas compile one at a time, apart from the tokenizing (a slow compile never holds a plain request's
        # rendering up), in a process of their own: bounded in time, and stopped when their client leaves (one
        # whose client has gone while it waited is never started); a fast lane for cached grammars and
        # json_object, and each client's share of the queue (frontends/server/compiles.py)
        self.compile_queue = CompileQueue(self.limits.compile_timeout, gone_errors=(ClientGone,))
        self.compiles = self.compile_queue.counts
        self.grammar_pool = self.compile_queue.slow_pool
        self.compile_process = compile_process()
        self.started = time.time()
        model.tokenizer.fewest_tokens("")  # the vocabulary's byte table now, not in the first request
        try:  # compile the chat template now, not in the first request's time to first token
            model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except DeltaserveError:
            pass  # a template that refuses this conversation refuses it again, with its message, in a request

    # -- helpers ------------------------------------------------------------------------------------
    def identify(self, request: Request) -> tuple[bool | None, str | None]:
        """(True: one of the keys (or the server needs none); None: no Authorization header; False: no key of its;
        the key's tenant). Keys are compared in constant time."""
        if not self.keys.required:
            return True, None
        header = request.headers.get("authorization")
        if header is None:
            api_key = request.headers.get("x-api-key")  # Anthropic's header (its SDK sends the key there)
            if api_key is None:
                return None, None
            header = f"Bearer {api_key}"
        scheme, _, token = header.strip().partition(" ")
        # starlette decodes a header as latin-1: encoding it back gives the bytes the client sent
        key = self.keys.match(token.strip().encode("latin-1", "replace"))
        if key is None or scheme.lower() != "bearer":
            return False, None
        return True, key.tenant

    def authorized(self, request: Request) -> bool | None:
        return self.identify(request)[0]

    def check_auth(self, request: Request) -> str | None:
        """The request's tenant (None: a single-tenant server), or a 401."""
        ok, tenant = self.identify(request)
        if ok is not True:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           "invalid_request_error", None, "invalid_api_key")
        return tenant

    @staticmethod
    def client_of(request: Request, tenant: str | None) -> str:
        """Who a request is, for its share of the compile queue: its tenant and its address."""
        peer = request.client.host if request.client is not None else "?"
        return f"{tenant or ''}@{peer}"

    def place(self, req, tenant: str | None, request: Request):
        """The request's cache partition (its tenant and cache_salt) and its client."""
        req.partition = partition(tenant, req.cache_salt)
        req.client = self.client_of(request, tenant)
        return req

    @staticmethod
    def check_json(request: Request) -> None:
        """A POST body is JSON, and says so: a page on another site can send text/plain or a form to a server
        on this machine without asking first (no CORS preflight), never application/json."""
        given = request.headers.get("content-type")
        media = (given or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            said = f"the request's Content-Type is {given[:100]!r}" if given else "the request has no Content-Type"
            raise APIError(415, f"{said}: the body must be JSON, sent with 'Content-Type: application/json'",
                           "invalid_request_error", None, "unsupported_media_type")

    async def read_json(self, request: Request):
        return parse_json(await self.read_body(request))

    async def read_body(self, request: Request) -> bytearray:
        """The request's body, bounded in size and in time; parsed elsewhere (`parse_body`, off the event loop)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body:
            raise APIError(413, f"the request body has {length} bytes, more than the limit of {self.limits.max_body}",
                           code="request_too_large")
        body = bytearray()

        async def receive() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > self.limits.max_body:
                    raise APIError(413, f"the request body is larger than the limit of {self.limits.max_body} "
                                        "bytes", code="request_too_large")

        try:  # a body that stalls holds a connection (and its descriptor) no longer than the request timeout
            await asyncio.wait_for(receive(), self.request_timeout)
        except asyncio.TimeoutError:
            if self.guard is not None:
                self.guard.timed_out += 1
            raise APIError(408, f"the request body did not arrive whole within {self.request_timeout:g} s "
                                f"({len(body)} bytes came; --request-timeout): the connection is closed",
                           "invalid_request_error", None, "request_timeout", {"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientGone() from None  # the client left mid-body: nobody to answer
        return body

    def prompt_ids(self, req: GenerationRequest) -> tuple[list[int], bool]:
        """The request's prompt ids and whether they leave the model reasoning, from the turn driver's input half
        (session/driver.py). Runs off the event loop (a large request's template and tokenizer take seconds); text
        that surely cannot fit the context is refused before it is tokenized."""
        param = "prompt" if req.prompt is not None else "messages"
        host = self.model.host
        try:
            turn = driver.prepare(self.model.tokenizer, self.context, request=req.turn, raw=req.prompt,
                                  default_thinking=self.think_default, vision=host.vision,
                                  vocab_size=host.config.vocab_size)
        except ContextError as e:
            raise bad(str(e), param, "context_length_exceeded") from None
        except DeltaserveError as e:
            raise bad(str(e), param) from None  # the tokenizer's and the template's messages name themselves
        return turn.ids, turn.thinking

    def check_model(self, req: GenerationRequest) -> None:
        """A request that names a model this server does not serve is a 404, as OpenAI answers it (no `model`: the
        served one)."""
        if req.model is not None and req.model not in self.model_names:
            also = ", ".join(repr(n) for n in self.model_names[1:])
            raise APIError(404, f"the model {str(req.model)[:100]!r} is not served here: this server serves "
                           f"{self.model_name!r}" + (f" (it also answers to {also})" if also else ""),
                           "invalid_request_error", "model", "model_not_found")

    def check(self, ids: list[int], endpoint: str, images: bool = False) -> None:
        """The session's own prompt check, before the request takes a slot: a 400 naming the parameter."""
        param = "messages" if endpoint == "chat" else "prompt"
        try:
            check_prompt(ids, self.model.config.vocab_size, self.context, images)
        except ContextError as e:
            raise bad(str(e), param, "context_length_exceeded" if ids else None) from None
        except DeltaserveError as e:
            raise bad(str(e), param) from None

    def budget(self, req: GenerationRequest) -> int:
        """The tokens a request may generate: what it asks for, clamped to the limit (--max-tokens-limit, default
        the context; a clamp is said in the answer: `max_tokens_clamped` and the x-deltaserve-max-tokens header), or
        the limit when it asks for none. The session ends the answer where the context does and says so
        (context_capped), which it could not if the budget were cut to the context here."""
        limit = self.limits.max_tokens or self.context
        if req.max_tokens is not None and req.max_tokens > limit:
            req.clamped = {"requested": req.max_tokens, "limit": limit}
            return limit
        return req.max_tokens or limit

    # -- one generation ----------------------------------------------------------------------------
    async def generate(self, endpoint: str, req: GenerationRequest, ids: list[int], thinking: bool, t0: float,
                       request: Request | None = None):
        max_tokens = self.budget(req)
        # what constrains the answer, compiled (cached per schema) before the request takes a slot
        stops = stop_ids(self.model.tokenizer, self.model.config)
        loop = asyncio.get_running_loop()
        try:
            if req.turn is not None:
                work = (req.turn.grammar, self.model.tokenizer, self.model.config.vocab_size, stops)
            else:
                work = (compile_format, self.model.tokenizer, req.response_format, self.model.config.vocab_size, stops)
            constrained = req.turn.constrained if req.turn is not None else req.response_format is not None
            if constrained:  # the fast lane, or this client's share of the queue (frontends/server/compiles.py)
                grammar = await self.compile_queue.grammar(work, req.client, lambda a: until_gone(a, request))
            else:
                grammar = None
        except DeltaserveError as e:
            tools = req.turn is not None and req.turn.offers_tools and str(e).startswith("tools")
            raise bad(str(e), "tools" if tools else "response_format") from None
        try:
            slot = await until_gone(self.pool.acquire(ids, req.partition), request)  # a client gone while queued leaves
        except QueueFull:
            raise APIError(503, f"all {len(self.pool.slots)} slots are busy and {self.pool.queue_size} requests are "
                           "already waiting; retry shortly", "server_overloaded", None, "server_busy",
                           {"Retry-After": "1"}) from None
        cancel = threading.Event()
        events: asyncio.Queue = asyncio.Queue()  # the turn driver's events (session/driver.py), then None
        first = {}
        prepared = driver.PreparedTurn(ids, thinking, req.turn, grammar, req.keep_end)

        def on_event(e):  # on the engine loop's thread: handed over, never waited for
            if "t" not in first:
                first["t"] = time.perf_counter()
            loop.call_soon_threadsafe(events.put_nowait, e)
            return not cancel.is_set()

        def work():
            return driver.run(slot.session, prepared, max_tokens, on_event=on_event, cancel=cancel, stop=req.stop,
                              logprobs=req.logprobs, echo=req.echo, n=req.n, **req.sampling())

        fut = loop.run_in_executor(self.executor, work)

        def finished(f):
            self.pool.release(slot)
            events.put_nowait(None)
            if not f.cancelled() and f.exception() is None:
                turn = f.result()
                self.metrics.tokens(len(ids), turn.reused, turn.generated + sum(t.generated for t in turn.forks))
                self.metrics.observe("ttft", first.get("t", time.perf_counter()) - t0)
            self.metrics.observe("duration", time.perf_counter() - t0)

        fut.add_done_callback(finished)
        return fut, events, cancel

    @staticmethod
    def turn_error(e: BaseException) -> APIError:
        if isinstance(e, ContextError):
            return bad(str(e), "messages", "context_length_exceeded")
        if isinstance(e, GrammarError):
            return bad(str(e), "response_format")
        if isinstance(e, DeltaserveError):
            return bad(str(e))
        return APIError(500, f"the generation failed: {type(e).__name__}: {e}"[:500], "server_error")

    async def whole_turn(self, fut, cancel: threading.Event, request: Request | None):
        """The turn of a request that is not streamed, once it is done; a client that left cancels it (the generation
        stops at its next token and frees the slot)."""
        try:
            return await until_gone(asyncio.shield(fut), request)
        except (asyncio.CancelledError, ClientGone):
            cancel.set()
            raise
        except Exception as e:  # noqa: BLE001
            raise self.turn_error(e) from None

    def usage(self, n_prompt: int, turn) -> dict:
        """The prompt counted once, every choice's tokens (n > 1: the forks')."""
        generated = turn.generated + sum(t.generated for t in turn.forks)
        return {"prompt_tokens": n_prompt, "completion_tokens": generated,
                "total_tokens": n_prompt + generated,
                "prompt_tokens_details": {"cached_tokens": turn.reused},
                "completion_tokens_details": {"reasoning_tokens": turn.reasoning_tokens +
                                              sum(t.reasoning_tokens for t in turn.forks)}}

    async def complete(self, endpoint: str, req: GenerationRequest, ids: list[int], thinking: bool, t0: float,
                       request: Request | None = None):
        fut, queue, cancel = await self.generate(endpoint, req, ids, thinking, t0, request)
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        tok = self.model.tokenizer
        echo = endpoint != "chat" and req.echo
        prompt_text = (req.prompt if isinstance(req.prompt, str) else tok.decode(ids)) if echo else ""
        headers = clamp_headers(req)
        extra = {"max_tokens_clamped": req.clamped} if req.clamped else {}

        def prompt_logprobs(turn, wire: CompletionLogprobs) -> dict | None:
            if not echo or req.logprobs is None or turn.logprobs is None:
                return None
            return wire.prompt(ids, turn.logprobs.prompt)

        if not req.stream:
            turn = await self.whole_turn(fut, cancel, request)
            choices = []
            for index, one in enumerate([turn] + list(turn.forks)):
                if endpoint == "chat":  # the turn driver's output half (session/driver.py) set the answer's parts
                    content = one.text if one.text or not one.tool_calls else None
                    message = {"role": "assistant", "content": content, "refusal": None}
                    if one.tool_calls:
                        message["tool_calls"] = [c.openai() for c in one.tool_calls]
                    if one.reasoning is not None:
                        message["reasoning_content"] = one.reasoning
                    lp = chat_logprobs(one.logprobs.entries, tok) if req.logprobs is not None else None
                    choice = {"index": index, "message": message, "finish_reason": one.finish_reason, "logprobs": lp}
                else:
                    lp = None
                    if req.logprobs is not None:
                        wire = CompletionLogprobs(tok)
                        lp = joined(prompt_logprobs(turn, wire), wire.take(completion_entries(one)))
                    choice = {"index": index, "text": prompt_text + one.text, "finish_reason": one.finish_reason,
                              "logprobs": lp}
                if one.context_capped:  # "length" because the context ended the answer, not max_tokens
                    choice["context_capped"] = True
                if one.reasoning_ended is not None:  # how the thought ended: model, budget, loop_guard, unclosed
                    choice["reasoning_ended"] = one.reasoning_ended
                if one.schema_error:  # "schema_violation": a keyword the grammar could not enforce, checked after
                    choice["schema_error"] = one.schema_error
                choices.append(choice)
            obj = "chat.completion" if endpoint == "chat" else "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                 "choices": choices, "usage": self.usage(len(ids), turn), **extra,
                                 "system_fingerprint": FINGERPRINT}, headers=headers)

        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        pending: dict[int, list] = {}  # each choice's log-probabilities not yet sent (their tokens' text held back)
        wires = {}  # each choice's completions form (its text offsets)

        def chunk(delta: dict | None = None, finish=None, text=None, usage=None, empty=False, capped=False,
                  index: int = 0, logprobs=None, error=None, ended=None) -> str:
            if empty:
                choices = []
            elif endpoint == "chat":
                choices = [{"index": index, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}]
            else:
                choices = [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}]
            if capped:
                choices[0]["context_capped"] = True
            if ended is not None:
                choices[0]["reasoning_ended"] = ended
            if error:
                choices[0]["schema_error"] = error
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "system_fingerprint": FINGERPRINT, "choices": choices}
            if usage is not None:
                body["usage"] = usage
                body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def taken(index: int):
            """The log-probabilities waiting for choice `index`'s next chunk, in its API's form (None: not asked)."""
            if req.logprobs is None:
                return None
            entries, pending[index] = pending.get(index, []), []
            if endpoint == "chat":
                return chat_logprobs(entries, tok)
            return wires.setdefault(index, CompletionLogprobs(tok, len(prompt_text))).take(entries)

        def deltas(events, turn=None, index: int = 0) -> list[str]:
            """The turn pipeline's events as OpenAI's deltas: a call's name in its first delta, its arguments in
            the next; the finish in the last."""
            out = []
            for e in events:
                if isinstance(e, Reasoning):
                    out.append(chunk({"reasoning_content": e.text}, index=index, logprobs=taken(index)))
                elif isinstance(e, Content):
                    out.append(chunk({"content": e.text}, index=index, logprobs=taken(index)))
                elif isinstance(e, CallStart):
                    out.append(chunk({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                      "function": {"name": e.name, "arguments": ""}}]}, index=index,
                                     logprobs=taken(index)))
                elif isinstance(e, CallArguments):
                    out.append(chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]},
                                     index=index, logprobs=taken(index)))
                elif isinstance(e, Finish):
                    left = taken(index) if pending.get(index) else None
                    out.append(chunk({}, finish=e.reason, capped=turn.context_capped, index=index, logprobs=left,
                                     error=e.error, ended=turn.reasoning_ended))
            return out

        echoed: dict[int, list | None] = {}  # the choices whose prompt was sent (echo), and its log-probabilities

        def echo_chunk(index: int, entries=None) -> str:
            """The prompt, first in each choice (echo), with its log-probabilities where they were asked for."""
            if entries is None and echoed:
                entries = next(iter(echoed.values()))  # the first choice's: the prompt is the same
            echoed[index] = entries
            lp = None
            if req.logprobs is not None:
                lp = wires.setdefault(index, CompletionLogprobs(tok)).prompt(ids, entries or [None] * len(ids))
            return chunk(text=prompt_text, index=index, logprobs=lp)

        async def events():
            ended: dict[int, Finish] = {}
            try:
                if endpoint == "chat":
                    for index in range(req.n):
                        yield chunk({"role": "assistant", "content": "", "refusal": None}, index=index)
                while True:
                    e = await queue.get()
                    if e is None:
                        break
                    index = 0
                    if isinstance(e, Choice):
                        index, e = e.index, e.event
                    if isinstance(e, Logprobs) and e.prompt:
                        if echo:
                            yield echo_chunk(index, e.entries)
                    elif isinstance(e, Logprobs):
                        pending.setdefault(index, []).extend(e.entries)
                    elif isinstance(e, Finish):
                        ended[index] = e  # framed once the turn's counts are known
                    elif endpoint != "chat":
                        if echo and index not in echoed:
                            yield echo_chunk(index)
                        yield chunk(text=e.text, index=index, logprobs=taken(index))
                    else:
                        for c in deltas([e], index=index):
                            yield c
                try:
                    turn = await fut
                except Exception as e:  # noqa: BLE001
                    yield f"data: {json.dumps(self.turn_error(e).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                for index, one in enumerate([turn] + list(turn.forks)):
                    if endpoint == "chat":
                        for c in deltas([ended.get(index) or Finish(one.finish_reason, one.text, one.reasoning)], one,
                                        index):
                            yield c
                    else:
                        if echo and index not in echoed:
                            yield echo_chunk(index)
                        if one.logprobs is not None and one.logprobs.stop is not None:
                            pending.setdefault(index, []).append(one.logprobs.stop)  # the stop token, as OpenAI lists it
                        left = taken(index) if pending.get(index) else None
                        yield chunk(text="", finish=one.finish_reason, capped=one.context_capped, index=index,
                                    logprobs=left, ended=one.reasoning_ended)
                if req.include_usage:
                    yield chunk(usage=self.usage(len(ids), turn), empty=True)
                yield "data: [DONE]\n\n"
            finally:
                if not fut.done():
                    cancel.set()  # the client went away: stop the generation, keep the slot's state valid

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    # -- the Responses API (frontends/server/responses.py) -------------------------------------------------
    def responses_prompt(self, req: ResponsesRequest, tenant: str | None = None):
        """(prompt ids, whether they leave the model reasoning, the turn, the conversation's messages before this
        input, the frame, how it was rendered). A follow-up whose frame (system text, tools) is its previous
        response's continues from that response's tokens: only its new input is rendered and tokenized (and, where
        a slot or the store holds the state, prefilled); another frame renders the whole conversation again from
        its items. Runs off the event loop."""
        tok = self.model.tokenizer
        prev = None
        if req.previous_response_id is not None:
            prev = self.responses.get(req.previous_response_id, tenant)  # another tenant's is not found
            if prev is None:
                raise previous_not_found(req.previous_response_id)
            if prev.model_sha256 != self.store.model_sha256:
                raise bad(f"the previous response {req.previous_response_id!r} was made by another model "
                          f"({str(prev.response.get('model'))[:100]!r}, another file): its conversation's tokens mean "
                          f"nothing to {self.model_name!r}", "previous_response_id", "model_mismatch")
        history = list(prev.messages) if prev is not None else []
        turn_args = (req.chat_tools, req.tool_choice, req.parallel_tool_calls, req.response_format,
                     req.enable_thinking, self.limits.max_image_pixels, False, None, image_limits(self.limits))
        host = self.model.host
        try:
            turn = ask(req.messages, *turn_args)
            vision = host.vision if turn.images else None
            fr = frame(req.system, turn.rendered_tools)
            if prev is not None and prev.frame == fr and prev.tokens:
                prompt = turn.continuation(tok, self.think_default)
                ids = list(prev.tokens) + turn.encode(prompt, tok, vision, host.config.vocab_size)
                how = "state"
            else:
                if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                                  for p in m["content"]) for m in history):
                    raise DeltaserveError("the previous responses' images are not kept with them, only their state: a "
                                          "follow-up whose instructions or tools differ renders the conversation "
                                          "again and cannot (send the whole conversation, images included)")
                whole = ask(req.system_messages() + history, *turn_args)  # the new input is `turn`'s, taken once:
                whole.messages = whole.messages + turn.messages           # its images decoded, placeholders left
                whole.images = turn.images
                prompt = whole.prompt(tok, self.think_default)
                ids = whole.encode(prompt, tok, vision, host.config.vocab_size)
                how = "items" if prev is not None else "new"
        except ToolError as e:
            raise bad(str(e)[:400], "input") from None
        except DeltaserveError as e:
            raise bad(str(e)[:400], "input") from None
        return ids, prompt.thinking, turn, history, fr, how

    async def respond(self, req: ResponsesRequest, prepared, t0: float, request: Request | None = None,
                      tenant: str | None = None):
        ids, thinking, turn_req, history, fr, how = prepared
        rid, created = new_id(), int(time.time())
        gen = GenerationRequest(model=req.model, max_tokens=req.max_output_tokens, temperature=req.temperature,
                                top_p=req.top_p, top_k=None, min_p=None, seed=req.seed, stop=[], stream=req.stream,
                                include_usage=False, repetition_penalty=1.0, presence_penalty=0.0,
                                frequency_penalty=0.0, user=req.user, turn=turn_req, keep_end=req.store,
                                cache_salt=req.cache_salt, thinking_budget=req.thinking_budget,
                                thinking_message=req.thinking_message, logprobs=req.logprobs)
        if request is not None:
            self.place(gen, tenant, request)
        else:
            gen.partition = partition(tenant, req.cache_salt)
        loop = asyncio.get_running_loop()
        fut, queue, cancel = await self.generate("chat", gen, ids, thinking, t0, request)
        items = Items(rid, tokenizer=self.model.tokenizer if req.logprobs is not None else None)
        headers = {"x-deltaserve-response-id": rid, "x-deltaserve-rendered": how, **clamp_headers(gen)}

        async def finished(turn) -> dict:
            # the cause of a cut, as chat completions say it (context_capped): the context, or max_output_tokens
            incomplete = None if turn.finish_reason not in ("length", "schema_violation") else \
                "schema_violation" if turn.schema_error else \
                "context_capped" if turn.context_capped else "max_output_tokens"
            used = usage(len(ids), turn.reused, turn.generated, turn.reasoning_tokens)
            obj = response_object(rid, created, self.model_name, req, "incomplete" if incomplete else "completed",
                                  items.output, used, incomplete)
            if turn.reasoning_ended is not None:  # how the thought ended: model, budget, loop_guard, unclosed
                obj["reasoning_ended"] = turn.reasoning_ended
            if req.store:
                content, reasoning, calls = items.texts()
                answer = {"role": "assistant", "content": content}
                if reasoning is not None:
                    answer["reasoning_content"] = reasoning
                if calls:
                    answer["tool_calls"] = calls
                record = ResponseRecord(rid, created, self.store.model_sha256, obj, req.input_items,
                                        history + turn_req.messages + [answer], fr, list(ids) + list(turn.tokens),
                                        tenant)
                await loop.run_in_executor(self.file_pool, self.responses.put, record)  # a file: off the event loop
            return obj

        if not req.stream:
            turn = await self.whole_turn(fut, cancel, request)
            while not queue.empty():  # the turn driver's events, all in by the time its turn is done
                e = queue.get_nowait()
                if e is not None:
                    items.push([e])
            return JSONResponse(await finished(turn), headers=headers)

        async def events():
            sent = 0

            def fresh():
                nonlocal sent
                out = "".join(sse(e) for e in items.events[sent:])
                sent = len(items.events)
                return out

            try:
                opening = response_object(rid, created, self.model_name, req, "in_progress", [], None)
                items.emit("response.created", response=opening)
                items.emit("response.in_progress", response=opening)
                yield fresh()
                while True:
                    e = await queue.get()
                    if e is None:
                        break
                    items.push([e])
                    if len(items.events) > sent:
                        yield fresh()
                try:
                    turn = await fut
                except Exception as e:  # noqa: BLE001
                    err = self.turn_error(e)
                    items.emit("error", code=err.code or err.type, message=err.message, param=err.param)
                    items.emit("response.failed", response=response_object(
                        rid, created, self.model_name, req, "failed", items.output, None,
                        error={"code": err.code or "server_error", "message": err.message}))
                    yield fresh()
                    return
                obj = await finished(turn)
                items.emit("response.incomplete" if obj["status"] == "incomplete" else "response.completed",
                           response=obj)
                yield fresh()
            finally:
                if not fut.done():
                    cancel.set()

        return await streams.settle(StreamingResponse(events(), media_type="text/event-stream",
                                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                               **headers}),
                                    lambda a: until_gone(a, request))

    async def stored_response(self, rid: str, tenant: str | None = None) -> ResponseRecord:
        """The response stored under `rid` by this tenant (read off the event loop: it may be a file), or a 404."""
        record = await asyncio.get_running_loop().run_in_executor(self.file_pool, self.responses.get, rid, tenant)
        if record is None:
            raise APIError(404, f"no response found with id {rid[:100]!r} (never stored here, deleted, or left the "
                                "stored responses' budget)", "invalid_request_error", None, "response_not_found")
        return record

    def health(self) -> dict:
        """/health's details (for a client with the key, or on a server without one)."""
        s0 = self.pool.slots[0].session
        return {
            "status": "ok", "model": self.model_name, "path": str(self.model.path), "version": __version__,
            "backend": s0.backend.name, "layers": self.model.config.num_layers,
            "engine": s0.backend.stats()["engine"],
            "declared_context": self.model.config.context_length, "context": self.context,
            "slots": [{"index": s.index, "busy": s.busy, "held_tokens": len(s.session.held),
                       "capacity": s.session.capacity, "checkpoint": s.session.checkpoint_length,
                       "batched_prefills": s.session.batched_prefills, "replays": s.session.replays,
                       "mtp": s.session.drafting_stats(),
                       "notices": list(s.session.notices),
                       "last_prefill": s.session.prefill_lines[-1] if s.session.prefill_lines else None,
                       "backend": s.session.backend.name, "requests": s.requests} for s in self.pool.slots],
            "queue": {"waiting": self.pool.waiting, "limit": self.pool.queue_size},
            # compiles waiting for the grammar thread; on it; ones whose client left; in the compile process: the ones it
            # finished, the ones stopped because their client left or past --compile-timeout, the children started
            "grammar": {**self.compiles, "compiled": self.compile_process.compiled,
                        "stopped": self.compile_process.stopped, "timed_out": self.compile_process.timed_out,
                        "processes": self.compile_process.started},
            "store": self.store.snapshot(),
            "responses": self.responses.snapshot(),
            **({"connections": self.guard.snapshot()} if self.guard is not None else {}),
            "notices": list(dict.fromkeys([n for s in self.pool.slots for n in s.session.notices]
                                          + self.store_notices)),
        }


class HostsAndCounts:
    """The Host check and the per-route answer counts, as a plain ASGI middleware. (Starlette's `@app.middleware`
    kind runs the route in a task of its own behind a receive channel of its own, on which a client's disconnect
    never arrives: `request.is_disconnected()` stayed False and an abandoned request ran to its full budget.)"""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
              "/openapi.json", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
              "/tokenizer_info", "/api/chat", "/api/generate", "/api/tags", "/api/show")

    def __init__(self, app, server: "Server"):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        endpoint = scope["path"] if scope["path"] in self.ROUTES else "other"
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if not server.hosts.allows(host):  # before anything else: a rebound page learns nothing, not even a 404
            e = server.hosts.refusal(host)
            server.metrics.request(endpoint, e.status)
            answer = shaped(scope["path"], e) or JSONResponse(e.body(), status_code=e.status)
            return await answer(scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            server.metrics.request(endpoint, 500)
            raise
        server.metrics.request(endpoint, status[0] if status else 499)


def create_app(server: Server, webui: bool = True) -> FastAPI:
    """The server's routes; `webui`: the chat page at / (serve --no-webui leaves it out)."""
    app = FastAPI(title="deltaserve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if webui:
        add_webui(app)
    vision = has_vision(server.model.host)  # /v1/models says whether the model reads images (the page asks)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return shaped(request.url.path, e) or \
            JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = {404: ("not_found_error", "no such route: " + request.url.path),
                405: ("invalid_request_error", f"method {request.method} is not allowed on {request.url.path}")}
        type_, message = kind.get(e.status_code, ("invalid_request_error", str(e.detail)))
        err = APIError(e.status_code, message, type_, headers=getattr(e, "headers", None))
        return shaped(request.url.path, err) or \
            JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        err = APIError(500, f"internal error: {type(e).__name__}", "server_error")
        return shaped(request.url.path, err) or JSONResponse(err.body(), status_code=500)

    anthropic.add_routes(app, server, until_gone, ClientGone)  # POST /v1/messages (frontends/server/anthropic.py)
    ollama.add_routes(app, server, until_gone, ClientGone)  # /api/chat, /api/generate, ... (frontends/server/ollama.py)
    tokens.add_routes(app, server)  # /tokenize, /detokenize, /tokenizer_info (frontends/server/tokens.py)
    if server.cors_origins:  # serve --cors-origin: pages on the origins named may call the API from a browser
        app.add_middleware(CORSMiddleware, allow_origins=server.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"],
                           expose_headers=["x-deltaserve-response-id", "x-deltaserve-max-tokens", "request-id"],
                           max_age=600)
    app.add_middleware(HostsAndCounts, server=server)

    async def run(request: Request, endpoint: str):
        t0 = time.perf_counter()
        tenant = server.check_auth(request)
        server.check_json(request)
        try:
            body = await server.read_body(request)
            loop = asyncio.get_running_loop()
            # parsed off the event loop: a body's JSON, its schemas and prompt ids, its images decoded as they are read
            parse = parse_chat if endpoint == "chat" else parse_completion
            req = await loop.run_in_executor(server.text_pool, parse_body, parse, body, server.limits)
            server.place(req, tenant, request)
            ids, thinking = await loop.run_in_executor(server.text_pool, server.prompt_ids, req)
            server.check(ids, endpoint, images=req.turn is not None and bool(req.turn.images))
            server.check_model(req)
            answer = await server.complete(endpoint, req, ids, thinking, t0, request)
            return await streams.settle(answer, lambda a: until_gone(a, request))  # an error before any event: its status
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the slot was freed

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "completion")

    @app.post("/v1/responses")
    async def responses_create(request: Request):
        t0 = time.perf_counter()
        tenant = server.check_auth(request)
        server.check_json(request)
        try:
            body = await server.read_body(request)
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(server.text_pool, parse_body, parse_responses, body, server.limits)
            server.check_model(req)
            prepared = await loop.run_in_executor(server.text_pool, server.responses_prompt, req, tenant)
            try:
                check_prompt(prepared[0], server.model.config.vocab_size, server.context,
                             bool(prepared[2].images) or server.model.host.vision is not None)
            except ContextError as e:
                raise bad(str(e), "input", "context_length_exceeded") from None
            except DeltaserveError as e:
                raise bad(str(e), "input") from None
            return await server.respond(req, prepared, t0, request, tenant)
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/responses/{rid}")
    async def responses_get(request: Request, rid: str):
        tenant = server.check_auth(request)
        return (await server.stored_response(rid, tenant)).response

    @app.delete("/v1/responses/{rid}")
    async def responses_delete(request: Request, rid: str):
        tenant = server.check_auth(request)
        await server.stored_response(rid, tenant)
        await asyncio.get_running_loop().run_in_executor(server.file_pool, server.responses.delete, rid, tenant)
        return {"id": rid, "object": "response", "deleted": True}

    @app.get("/v1/responses/{rid}/input_items")
    async def responses_input_items(request: Request, rid: str):
        tenant = server.check_auth(request)
        items = list((await server.stored_response(rid, tenant)).input_items)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad(f"'order' must be asc or desc, got {order[:20]!r}", "order")
        limit = q.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise bad(f"'limit' must be an integer from 1 to 100, got {limit[:20]!r}", "limit")
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
            if at is None:
                raise bad(f"'after' names no input item of this response: {after[:100]!r}", "after")
            items = items[at + 1:]
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(server.started), "owned_by": "deltaserve",
                "context_length": server.context, "max_model_len": server.context, "vision": vision}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [model_card(server.model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        """One model (the openai client's `models.retrieve`): the served one, by its name or one it answers to."""
        server.check_auth(request)
        if model_id not in server.model_names:
            raise APIError(404, f"the model {model_id[:100]!r} is not served here: this server serves "
                           f"{server.model_name!r}", "invalid_request_error", "model", "model_not_found")
        return model_card(server.model_name)

    @app.get("/openapi.json")
    async def openapi_document(request: Request):
        """The routes and their request bodies as OpenAPI 3.1 (frontends/server/openapi.py); open, as /health is."""
        return JSONResponse(openapi.document(server.model_name))

    @app.get("/health")
    async def health(request: Request):
        # open without a key, for liveness probes: then it says only that the server is up; its details (the
        # model's path, the notices, the slots) are behind the key like the rest
        seen = server.authorized(request)
        if seen is False:
            server.check_auth(request)  # a wrong key is told so, not answered as if none were sent
        return server.health() if seen else {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.check_auth(request)
        server.metrics.slot_counts([(s.index, s.session) for s in server.pool.slots])
        server.metrics.engine_counts(server.model.engine.stats.snapshot())
        return PlainTextResponse(server.metrics.render(server.pool.waiting, server.pool.busy, len(server.pool.slots),
                                                       server.store.snapshot()),
                                 media_type=server.metrics.CONTENT_TYPE)

    return app


COMPUTE_THREAD_MIN_BYTES = 64 << 20


def thinking_defaults(a, think: bool | None) -> tuple[ThinkingDefaults, bool | None]:
    """--reasoning-budget, --reasoning-budget-message and --reasoning-effort-budgets as the server's thinking
    defaults, and --think under them (a budget of 0 is thinking off). A request generates at most --max-tokens-limit
    thinking tokens: a budget given over it is refused here, a default effort level's held to it."""
    limit = getattr(a, "max_tokens_limit", None)  # None: the context (not known yet: bounded per request)
    budget = check_budget(getattr(a, "reasoning_budget", -1), "--reasoning-budget")
    given = getattr(a, "reasoning_effort_budgets", None)
    asked = parse_effort_budgets(given, base={})
    if budget is not None and limit is not None and budget > limit:
        raise DeltaserveError(f"--reasoning-budget {budget} is more than --max-tokens-limit {limit}: a request thinks "
                              f"at most that many tokens")
    over = {k: v for k, v in asked.items() if v is not None and limit is not None and v > limit}
    if over:
        raise DeltaserveError(f"--reasoning-effort-budgets {', '.join(f'{k}={v}' for k, v in over.items())} is more "
                              f"than --max-tokens-limit {limit}: a request thinks at most that many tokens")
    efforts = {k: (v if v is None or limit is None else min(v, limit)) for k, v in parse_effort_budgets(None).items()}
    efforts.update(asked)
    if budget == 0 and think is True:
        raise DeltaserveError("--think on and --reasoning-budget 0 (thinking off) disagree: leave one out")
    if budget == 0:
        think = False
    return ThinkingDefaults(budget, getattr(a, "reasoning_budget_message", "") or "", efforts), think


def wants_compute_thread(a) -> bool:
    """--compute-thread: on, off, or auto: whether the engine loop (runtime/engine.py) has a thread of its own, which
    runs every forward (one OpenMP team for the process), or is stepped by the slots' threads in turn. Its own thread
    pays where a forward is long against a thread hand-off; a model too small to split its forwards among threads
    (one OpenMP thread: no team to keep) does as well without. auto: on for model files of 64 MiB and more."""
    if a.compute_thread != "auto":
        return a.compute_thread == "on"
    if not a.model:
        return False  # the embedded demo model (8 MB)
    try:
        if os.path.isdir(a.model):  # an HF directory: its files together
            size = sum(e.stat().st_size for e in os.scandir(a.model) if e.is_file())
        else:
            size = os.path.getsize(a.model)
    except OSError:
        return False  # a path that fails to load later, with its own message
    return size >= COMPUTE_THREAD_MIN_BYTES


def main(a) -> int:
    import uvicorn

    if a.slots < 1 or a.queue < 0:
        raise DeltaserveError(f"--slots must be at least 1 and --queue at least 0 (got {a.slots}, {a.queue})")
    request_timeout = getattr(a, "request_timeout", connections.DEFAULT_REQUEST_TIMEOUT)
    max_connections = getattr(a, "max_connections", None)
    if not request_timeout > 0 or (max_connections is not None and max_connections < 1):
        raise DeltaserveError(f"--request-timeout must be more than 0 and --max-connections at least 1 "
                              f"(got {request_timeout}, {max_connections})")
    hosts = HostPolicy(a.host, getattr(a, "allowed_hosts", None))
    limit_before, limit = connections.raise_open_file_limit()  # a flood of connections meets the hard limit
    compute = wants_compute_thread(a)  # the engine loop on a thread of its own (see runtime/engine.py)
    model = load_model(a, compute_thread=compute)
    step_ms = getattr(a, "step_ms", None)
    if step_ms is not None:
        if not step_ms > 0:
            raise DeltaserveError(f"--step-ms must be more than 0 (got {step_ms})")
        model.engine.step_s = step_ms / 1000
    load_s = model.load_seconds
    think = thinking_flag(a.think)  # None: the model's default (model.thinking_default)
    thinking, think = thinking_defaults(a, think)
    api_keys = a.api_key if isinstance(a.api_key, list) else ([a.api_key] if a.api_key else [])
    api_keys = api_keys or ([settings.current().api_key] if settings.current().api_key else [])
    server = Server(model, slots=a.slots, queue=a.queue, api_key=api_keys, model_name=a.model_name,
                    api_keys_file=getattr(a, "api_keys_file", None),
                    responses_ram=getattr(a, "responses_ram", RESPONSES_RAM),
                    limits=Limits(max_tokens=a.max_tokens_limit, max_messages=a.max_messages, max_body=a.max_body,
                                  max_image_pixels=getattr(a, "max_image_pixels", Limits.max_image_pixels),
                                  image_urls=getattr(a, "allow_image_urls", False),
                                  compile_timeout=getattr(a, "compile_timeout", Limits.compile_timeout),
                                  max_images=getattr(a, "max_images", Limits.max_images),
                                  max_total_pixels=getattr(a, "max_image_pixels_total", Limits.max_total_pixels),
                                  private_image_urls=getattr(a, "allow_private_image_urls", False)),
                    device=a.device, think_default=think, context=a.ctx, revalidate=a.revalidate,
                    state_ram=a.state_ram, state_dir=a.state_dir, state_disk=a.state_disk, hosts=hosts,
                    request_timeout=request_timeout, log_prefills=getattr(a, "prefill_log", "on") == "on",
                    guard_max_age=getattr(a, "guard_max_age", GUARD_MAX_AGE), mtp=getattr(a, "mtp", None),
                    thinking=thinking, loop_guard=None if getattr(a, "loop_guard", None) is None else a.loop_guard == "on",
                    cors_origins=getattr(a, "cors_origin", None))
    c = model.config
    s0 = server.pool.slots[0].session
    template = "from the model file" if model.tokenizer.chat_template else "built-in ChatML"
    say = lambda line: print(f"[deltaserve] {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"model {model.path} ({server.model_name}), {c.num_layers} layers "
        f"({len(c.deltanet_layers)} Gated DeltaNet + {len(c.attention_layers)} attention), loaded in {load_s:.2f} s")
    say(f"backend {s0.backend.describe(s0.kv_type)}; declared context {c.context_length}, serving {server.context}")
    default = model.thinking_default
    say(f"chat template {template}; thinking " + (('on' if think else 'off') if think is not None else
        ("the template's default" if default is None else f"{'on' if default else 'off'} (the model's default)")))
    say(f"{thinking.describe()}; loop guard {'on' if s0.loop_guard else 'off'} (--loop-guard)")
    say(("the engine loop on a thread of its own, every forward on it" if compute else
         "the engine loop stepped by the slots' threads in turn") +
        f" (--compute-thread {a.compute_thread}"
        f"{': on for model files of 64 MiB and more' if a.compute_thread == 'auto' else ''}); a step of "
        f"{model.engine.step_s * 1000:g} ms while sequences decode: their rows, then a prompt chunk (--step-ms)")
    say(server.store.describe().removeprefix("[deltaserve] "))
    keys = server.keys
    tokens_limit = a.max_tokens_limit or server.context
    say(f"{a.slots} slots, queue {a.queue}, max_tokens clamped to {tokens_limit} ("
        f"{'--max-tokens-limit' if a.max_tokens_limit else 'the context'}), body <= {a.max_body} bytes, " +
        (f"{keys.tenants} API keys, each a tenant of its own (its cached prefixes and stored responses apart)"
         if keys.tenants > 1 else "API key required" if keys.required else "no API key") +
        f"; stored responses within {server.responses.budget >> 20} MiB (--responses-ram)")
    sock = bind(a.host, a.port)
    room = connections.connection_room(limit, connections.open_files())
    cap = max_connections or (min(room, connections.MAX_CONNECTIONS_CEILING) if room else
                              connections.MAX_CONNECTIONS_CEILING)
    raised = f" (raised from {limit_before})" if limit and limit_before and limit > limit_before else ""
    say(f"open files: limit {limit if limit else 'none'}{raised}; at most {cap} connections (--max-connections; "
        f"past it the oldest that has not sent a whole request is closed); a request's head and its body each "
        f"have {request_timeout:g} s to arrive (--request-timeout)")
    if max_connections and room and max_connections > room:
        say(f"warning: --max-connections {max_connections} is more than the open-file limit leaves room for "
            f"(about {room}): the first time the process runs out of descriptors it keeps under what it held then")
    say(f"answers to {hosts.describe()}; POST bodies must be 'Content-Type: application/json'; " +
        (f"CORS for {', '.join(server.cors_origins)} (--cors-origin)" if server.cors_origins else
         "no CORS (--cors-origin allows a web page's origin)"))
    say(f"listening on http://{a.host}:{sock.getsockname()[1]}/v1" +
        (f"; the chat page at http://{a.host}:{sock.getsockname()[1]}/ (--no-webui: none)"
         if getattr(a, "webui", True) else ""))
    if not hosts.loopback_bind and not keys.required:
        say(f"warning: bound to {a.host} without --api-key: anyone who reaches this address can use the model")
    guard = connections.ConnectionGuard(request_timeout, cap, say=say)
    sock = guard.listening_socket(sock)  # its accept keeps the cap
    server.guard = guard
    # the asyncio loop (not uvloop, whose accept does not go through the socket object) and uvicorn's h11
    # protocol under the guard's deadline; an idle keep-alive connection closes after 5 s (uvicorn's default)
    config = uvicorn.Config(create_app(server, webui=getattr(a, "webui", True)), log_level="warning", access_log=False, http=guard.protocol(),
                            loop="asyncio", timeout_keep_alive=5)
    connections.install_log_filter(limit=limit)  # after uvicorn.Config, which sets up uvicorn's loggers
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.store.close()  # the states being written reach the disk before the process ends
    return 0


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything says it listens; a port in use is one clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise DeltaserveError(f"cannot listen on {host}:{port}: the address does not resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "the port is in use (another server? pick one with --port)" if e.errno == errno.EADDRINUSE else e.strerror
        raise DeltaserveError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock
