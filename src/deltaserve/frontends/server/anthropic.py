"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the turn pipeline.

What the Anthropic SDK, Claude Code and the tools built on them send, read into the chat turn /v1/chat/completions
makes (`turns.ask`): `system` (a string or text blocks), `messages` whose content is a string or blocks (`text`,
`image` with a base64 or URL source, `tool_use` in an assistant message, `tool_result` in a user one, `thinking`
handed back), `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`,
`disable_parallel_tool_use`), `thinking` (`enabled` with `budget_tokens`: the thinking budget of every route, the
server's --reasoning-budget where none is given; `disabled`, `adaptive`), `stop_sequences`,
`max_tokens` (required, as Anthropic requires it; clamped to the server's limit as on every route), `temperature`,
`top_p`, `top_k`, `metadata.user_id`, `stream`. The turn runs on the same slots, state store and engine loop as a
chat completion: a follow-up whose conversation a slot or the store holds prefills only its new messages
(`usage.cache_read_input_tokens` says how many were not).

The answer is framed from the turn driver's events: content blocks `thinking`, `text` and `tool_use` (its `input`
the call's arguments as an object), `stop_reason` `end_turn`, `stop_sequence` (and which), `tool_use`,
`max_tokens`, or `model_context_window_exceeded` where the context cut the answer; streamed as Anthropic's events
(`message_start`, `ping`, `content_block_start` / `content_block_delta` (`thinking_delta`, `text_delta`,
`input_json_delta`) / `content_block_stop`, `message_delta` with the stop reason and the usage, `message_stop`).
Errors are Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, the error types by status); a prompt
longer than the context is a 400 whose message begins "prompt is too long", as Anthropic words it. The key may come
as `x-api-key` (the SDK's header) or `Authorization: Bearer`; `anthropic-version` and `anthropic-beta` are accepted
as sent (one API version is served). Server tools (web search, code execution, computer use: a `type` other than
`custom`) and `document` blocks are refused by name.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deltaserve.errors import DeltaserveError
from deltaserve.frontends.server import streams
from deltaserve.frontends.server.protocol import (APIError, GenerationRequest, Limits, bad, clamp_headers,
                                                  image_limits, parse_json, thinking_of)
from deltaserve.session.turns import CallArguments, CallStart, Content, Finish, Reasoning, ask
from deltaserve.api import GrammarError, ImageInputError, ToolError, normalize

PATH = "/v1/messages"
MAX_STOP_SEQUENCES = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
OVERFLOW = "prompt is too long"


def is_ours(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                                "invalid_request_error"), "message": message}}


def from_openai(status: int, body: dict) -> dict:
    """An OpenAI error object (the server's routes share its checks) in Anthropic's shape, the parameter named."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return error_body(status, "the request failed")
    message = str(err.get("message") or "the request failed")
    if err.get("code") == "context_length_exceeded" and not message.startswith(OVERFLOW):
        message = f"{OVERFLOW}: {message}"
    param = err.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return error_body(status, message)


def _kind(v: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _need(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise bad(message[:400], param)


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False, above: bool = False):
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    _need(ok and not isinstance(v, bool), f"{key}: must be {'an integer' if integer else 'a number'}, got {_kind(v)}",
          key)
    _need((v > lo if above else v >= lo) and v <= hi and v == v,
          f"{key}: must be {'more than' if above else 'at least'} {lo} and at most {hi}, got {v}", key)
    return v


def _text_blocks(value: Any, where: str) -> str:
    """A string, or text blocks, as text (system, a tool_result's content)."""
    if isinstance(value, str):
        return value
    _need(isinstance(value, list), f"{where}: must be a string or an array of text blocks, got {_kind(value)}", where)
    out = []
    for j, b in enumerate(value):
        at = f"{where}[{j}]"
        _need(isinstance(b, dict), f"{at}: must be an object, got {_kind(b)}", at)
        if b.get("type") == "image":
            raise bad(f"{at}: an image inside a tool_result or the system prompt is not read: send it in a user "
                      "message's content", at)
        _need(b.get("type") == "text" and isinstance(b.get("text"), str),
              f"{at}: must be a text block ({{\"type\": \"text\", \"text\": ...}}), got type "
              f"{str(b.get('type'))[:40]!r}", at)
        out.append(b["text"])
    return "\n".join(out)


def _image_url(block: dict, at: str) -> str:
    src = block.get("source")
    _need(isinstance(src, dict), f"{at}.source: must be an object, got {_kind(src)}", f"{at}.source")
    kind = src.get("type")
    if kind == "base64":
        media, data = src.get("media_type"), src.get("data")
        _need(isinstance(media, str) and media.startswith("image/"), f"{at}.source.media_type: must be an image "
              f"type (image/png, image/jpeg, ...), got {str(media)[:40]!r}", f"{at}.source.media_type")
        _need(isinstance(data, str) and bool(data), f"{at}.source.data: must be base64 text", f"{at}.source.data")
        return f"data:{media};base64,{data}"
    if kind == "url":
        url = src.get("url")
        _need(isinstance(url, str) and bool(url), f"{at}.source.url: must be a string", f"{at}.source.url")
        return url
    raise bad(f"{at}.source.type: must be base64 or url, got {str(kind)[:40]!r}", f"{at}.source.type")


def messages_of(value: Any, limits: Limits) -> list[dict]:
    """Anthropic's messages as the template messages the turn pipeline takes."""
    _need(isinstance(value, list) and bool(value), f"messages: must be a non-empty array, got {_kind(value)}",
          "messages")
    _need(len(value) <= limits.max_messages, f"messages: holds {len(value)} messages, more than the limit of "
          f"{limits.max_messages}", "messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        _need(isinstance(m, dict), f"{where}: must be an object, got {_kind(m)}", where)
        role = m.get("role")
        _need(role in ("user", "assistant"), f"{where}.role: must be user or assistant, got {str(role)[:40]!r}",
              f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        _need(isinstance(content, list), f"{where}.content: must be a string or an array of content blocks, got "
              f"{_kind(content)}", f"{where}.content")
        parts: list[dict] = []      # a user message's text and images, in order
        texts: list[str] = []       # an assistant message's text
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            _need(isinstance(b, dict), f"{at}: must be an object, got {_kind(b)}", at)
            kind = b.get("type")
            if kind == "text":
                _need(isinstance(b.get("text"), str), f"{at}.text: must be a string", f"{at}.text")
                (parts.append({"type": "text", "text": b["text"]}) if role == "user" else texts.append(b["text"]))
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b, at)}})
            elif kind == "tool_result" and role == "user":
                call_id = b.get("tool_use_id")
                _need(isinstance(call_id, str) and bool(call_id), f"{at}.tool_use_id: must be a string",
                      f"{at}.tool_use_id")
                text = _text_blocks(b.get("content", ""), f"{at}.content")
                if b.get("is_error") is True and not text.lower().startswith("error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            elif kind == "tool_use" and role == "assistant":
                name, args = b.get("name"), b.get("input", {})
                _need(isinstance(name, str) and bool(name), f"{at}.name: must be a string", f"{at}.name")
                _need(isinstance(args, dict), f"{at}.input: must be an object, got {_kind(args)}", f"{at}.input")
                calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind == "thinking" and role == "assistant":
                if isinstance(b.get("thinking"), str):
                    reasoning.append(b["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # nothing readable to hand back
            else:
                raise bad(f"{at}.type: a {str(kind)[:40]!r} block is not read in a{'n' if role == 'assistant' else ''} "
                          f"{role} message here (text, image, tool_result from the user; text, thinking, tool_use "
                          "from the assistant)", f"{at}.type")
        if role == "user":
            if parts:
                images = any(p["type"] == "image_url" for p in parts)
                out.append({"role": "user", "content": parts if images else "\n".join(p["text"] for p in parts)})
        else:
            entry: dict = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                entry["reasoning_content"] = "\n".join(reasoning)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def tools_of(value: Any) -> list | None:
    if value is None:
        return None
    _need(isinstance(value, list), f"tools: must be an array, got {_kind(value)}", "tools")
    out = []
    for i, t in enumerate(value):
        at = f"tools[{i}]"
        _need(isinstance(t, dict), f"{at}: must be an object, got {_kind(t)}", at)
        kind = t.get("type", "custom")
        if kind != "custom":
            raise bad(f"{at}.type: {str(kind)[:60]!r} is a server tool: this server calls the client's own tools "
                      "only ({\"name\", \"description\", \"input_schema\"})", f"{at}.type")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object", "properties": {}})}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(value: Any, tools: list | None) -> tuple[Any, bool]:
    """(OpenAI's tool_choice, parallel calls allowed)."""
    if value is None:
        return None, True
    _need(isinstance(value, dict), f"tool_choice: must be an object, got {_kind(value)}", "tool_choice")
    kind = value.get("type")
    parallel = not value.get("disable_parallel_tool_use", False)
    if kind == "none":
        return "none", parallel
    _need(bool(tools), "tool_choice: needs tools", "tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = value.get("name")
        _need(isinstance(name, str) and bool(name), "tool_choice.name: must name a tool", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad(f"tool_choice.type: must be auto, any, tool or none, got {str(kind)[:40]!r}", "tool_choice.type")


def thinking_asked(value: Any) -> tuple[bool | None, int | None]:
    """(enable_thinking, the thinking budget in tokens asked for: None, the server's)."""
    if value is None:
        return None, None
    _need(isinstance(value, dict), f"thinking: must be an object, got {_kind(value)}", "thinking")
    kind = value.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    _need(kind == "enabled", f"thinking.type: must be enabled, disabled or adaptive, got {str(kind)[:40]!r}",
          "thinking.type")
    budget = _number(value, "budget_tokens", 0, 1 << 31, integer=True)
    return True, budget


def output_format_of(body: dict) -> dict | None:
    """Structured outputs (`output_config.format` or the beta's `output_format`): a JSON schema for the answer."""
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    fmt = fmt if fmt is not None else body.get("output_format")
    if fmt is None:
        return None
    _need(isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict),
          "output_format: must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_format")
    try:
        return normalize({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}})
    except GrammarError as e:
        raise bad(str(e).replace("response_format", "output_format")[:400], "output_format") from None


class Parsed:
    """A validated Messages request: the generation request the server runs, and what framing needs."""

    def __init__(self, gen: GenerationRequest, stops: list[str], thinking_budget: int | None):
        self.gen, self.stops, self.thinking_budget = gen, stops, thinking_budget


def parse_messages(body: Any, limits: Limits, count_only: bool = False) -> Parsed:
    """A /v1/messages (or count_tokens) body, validated: each mistake a 400 naming the parameter."""
    _need(isinstance(body, dict), f"the request body must be a JSON object, got {_kind(body)}")
    body = {k: v for k, v in body.items() if v is not None}
    model = body.get("model")
    _need(model is None or isinstance(model, str), f"model: must be a string, got {_kind(model)}", "model")
    max_tokens = None
    if not count_only:
        _need("max_tokens" in body, "max_tokens: Field required", "max_tokens")
        max_tokens = _number(body, "max_tokens", 1, 1 << 62, integer=True)
    messages = messages_of(body.get("messages"), limits)
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            messages = [{"role": "system", "content": text}] + messages
    tools = tools_of(body.get("tools"))
    choice, parallel = tool_choice_of(body.get("tool_choice"), tools)
    asked, budget = thinking_asked(body.get("thinking"))
    # the budget as the thinking budget of every route (session/thinking.py): asked, else the server's
    thinking, budget, bridge = thinking_of(limits, None, {"budget_tokens": budget}, None, asked)
    stops = body.get("stop_sequences", [])
    _need(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
          "stop_sequences: must be an array of non-empty strings", "stop_sequences")
    _need(len(stops) <= MAX_STOP_SEQUENCES, f"stop_sequences: holds {len(stops)}, more than {MAX_STOP_SEQUENCES}",
          "stop_sequences")
    metadata = body.get("metadata", {})
    _need(isinstance(metadata, dict), f"metadata: must be an object, got {_kind(metadata)}", "metadata")
    user = metadata.get("user_id")
    _need(user is None or isinstance(user, str), "metadata.user_id: must be a string", "metadata.user_id")
    stream = body.get("stream", False)
    _need(isinstance(stream, bool), f"stream: must be a boolean, got {_kind(stream)}", "stream")
    top_k = _number(body, "top_k", 0, 1 << 20, integer=True)
    fmt = output_format_of(body)
    try:
        turn = ask(messages, tools, choice, parallel, response_format=fmt, enable_thinking=thinking,
                   image_limits=image_limits(limits))
    except ImageInputError as e:
        raise bad(str(e)[:300], e.where or "messages") from None
    except ToolError as e:
        raise bad(str(e)[:300], "tools" if str(e).startswith("tools") else "messages") from None
    except DeltaserveError as e:
        raise bad(str(e)[:300], "messages") from None
    gen = GenerationRequest(
        model=model, max_tokens=max_tokens, temperature=float(_number(body, "temperature", 0.0, 1.0) or 0.0)
        if "temperature" in body else 1.0, top_p=_number(body, "top_p", 0.0, 1.0, above=True),
        top_k=top_k or None, min_p=None, seed=None, stop=list(stops), stream=stream, include_usage=False,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, user=user, turn=turn,
        thinking_budget=budget, thinking_message=bridge)
    return Parsed(gen, list(stops), budget)


# -- the answer ------------------------------------------------------------------------------------------------
def stop_of(turn, stops: list[str], tokenizer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if turn.finish_reason == "tool_calls" or (turn.finish_reason == "schema_violation" and turn.tool_calls):
        return "tool_use", None
    if turn.finish_reason == "length":
        return ("model_context_window_exceeded" if turn.context_capped else "max_tokens"), None
    if stops:  # a stop string ended it where the whole generated text holds one (the earliest)
        text = tokenizer.decode(turn.tokens)
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def schema_error(turn) -> dict:
    """A schema keyword the grammar could not enforce, broken by the answer (checked after it: session/turns.py)."""
    return {"schema_error": turn.schema_error} if getattr(turn, "schema_error", None) else {}


def usage_of(n_prompt: int, turn) -> dict:
    """Anthropic's counts: input_tokens are the prompt's tokens prefilled, cache_read_input_tokens those a slot or
    the store already held (their sum is the prompt)."""
    return {"input_tokens": n_prompt - turn.reused, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": turn.reused, "output_tokens": turn.generated}


def content_of(turn) -> list[dict]:
    out: list[dict] = []
    if turn.reasoning:
        out.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.text:
        out.append({"type": "text", "text": turn.text})
    for c in turn.tool_calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments or "{}")})
    return out


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class Blocks:
    """The turn driver's events as Anthropic's content block events (`push`), the calls settled by `finish`."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None   # the open block's kind
        self.calls: dict[int, tuple[int, str]] = {}  # call index -> (block index, arguments sent)
        self.ids: dict[int, str] = {}

    def _start(self, block: dict) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + [sse("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]

    def push(self, e) -> list[str]:
        out: list[str] = []
        if isinstance(e, Reasoning):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(sse("content_block_delta", {"index": self.index,
                                                   "delta": {"type": "thinking_delta", "thinking": e.text}}))
        elif isinstance(e, Content):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(sse("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": e.text}}))
        elif isinstance(e, CallStart):
            out += self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            self.calls[e.index] = (self.index, "")
        elif isinstance(e, CallArguments) and e.index in self.calls:
            at, sent = self.calls[e.index]
            self.calls[e.index] = (at, sent + e.text)
            out.append(sse("content_block_delta", {"index": at,
                                                   "delta": {"type": "input_json_delta", "partial_json": e.text}}))
        return out

    def finish(self, done: Finish) -> list[str]:
        """The calls as the parser settled them (the rest of their arguments; a call never started, whole)."""
        out: list[str] = []
        started = {idx: (at, sent) for idx, (at, sent) in self.calls.items()}
        for k, call in enumerate(done.tool_calls):
            at, sent = started.get(k, (None, ""))
            if at is None:
                out += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                at = self.index
            rest = call.arguments[len(sent):] if call.arguments.startswith(sent) else ""
            if rest:
                out.append(sse("content_block_delta", {"index": at,
                                                       "delta": {"type": "input_json_delta", "partial_json": rest}}))
        return out + self._stop()


# -- the routes ----------------------------------------------------------------------------------------------------
def add_routes(app, server, until_gone, client_gone) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `server` (frontends/server/app.Server)."""
    tok = server.model.tokenizer

    async def parsed(request: Request, count_only: bool = False):
        tenant = server.check_auth(request)
        server.check_json(request)
        body = await server.read_body(request)
        loop = asyncio.get_running_loop()
        p = await loop.run_in_executor(server.text_pool, lambda: parse_messages(_json(body), server.limits,
                                                                                count_only))
        server.place(p.gen, tenant, request)
        ids, thinking = await loop.run_in_executor(server.text_pool, server.prompt_ids, p.gen)
        server.check(ids, "chat", images=bool(p.gen.turn.images))
        server.check_model(p.gen)
        return p, ids, thinking

    def _json(body: bytes):
        return parse_json(body)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(request: Request):
        _, ids, _ = await parsed(request, count_only=True)
        return {"input_tokens": len(ids)}

    @app.post(PATH)
    async def messages(request: Request):
        t0 = time.perf_counter()
        try:
            p, ids, thinking = await parsed(request)
            return await answer(p, ids, thinking, t0, request)
        except client_gone:
            from fastapi.responses import Response

            return Response(status_code=499)

    async def answer(p: Parsed, ids: list[int], thinking: bool, t0: float, request: Request):
        req = p.gen
        fut, queue, cancel = await server.generate("chat", req, ids, thinking, t0, request)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        headers = {"request-id": mid, **clamp_headers(req)}
        if not req.stream:
            turn = await server.whole_turn(fut, cancel, request)
            reason, sequence = stop_of(turn, p.stops, tok)
            return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": server.model_name,
                                 "content": content_of(turn), "stop_reason": reason, "stop_sequence": sequence,
                                 "usage": usage_of(len(ids), turn), **schema_error(turn)}, headers=headers)

        async def events():
            blocks = Blocks()
            try:
                start = {"id": mid, "type": "message", "role": "assistant", "model": server.model_name, "content": [],
                         "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": len(ids), "output_tokens": 0}}
                yield sse("message_start", {"message": start}) + sse("ping", {})
                ended = None
                while True:
                    e = await queue.get()
                    if e is None:
                        break
                    if isinstance(e, Finish):
                        ended = e
                        continue
                    out = blocks.push(e)
                    if out:
                        yield "".join(out)
                try:
                    turn = await fut
                except Exception as e:  # noqa: BLE001
                    err = server.turn_error(e)
                    yield sse("error", {"error": from_openai(err.status, err.body())["error"]})
                    return
                out = blocks.finish(ended or Finish(turn.finish_reason, turn.text, turn.reasoning, turn.tool_calls))
                reason, sequence = stop_of(turn, p.stops, tok)
                yield "".join(out) + sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence,
                                                                     **schema_error(turn)},
                                                           "usage": usage_of(len(ids), turn)}) + \
                    sse("message_stop", {})
            finally:
                if not fut.done():
                    cancel.set()

        response = await streams.settle(StreamingResponse(events(), media_type="text/event-stream",
                                                          headers={"Cache-Control": "no-cache",
                                                                   "X-Accel-Buffering": "no", **headers}),
                                        lambda a: until_gone(a, request))
        if isinstance(response, JSONResponse):  # the generation failed before it said anything: its error, its status
            return JSONResponse(from_openai(response.status_code, json.loads(response.body)),
                                status_code=response.status_code)
        return response


def error_response(path: str, e: APIError) -> JSONResponse | None:
    """An APIError on a Messages route, in Anthropic's shape (None: another route's)."""
    if not is_ours(path):
        return None
    return JSONResponse(from_openai(e.status, e.body()), status_code=e.status, headers=e.headers)
