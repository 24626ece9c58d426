"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/version`, `/api/ps`) on the turn
pipeline, for the desktop and web front ends that speak it (and the `ollama` Python client).

`/api/chat` takes `messages` (`content`, `images` as base64, an assistant's `tool_calls` with arguments as objects,
its `thinking`; `tool` messages), `tools` (OpenAI's form, as Ollama takes them), `format` (`"json"` or a JSON schema,
on the grammar), `think` (a boolean; a level, low/medium/high, is that effort level's thinking budget), `options` (`num_predict` as max_tokens, clamped as on
every route; `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty`; `num_ctx` and the load-time options are the server's, not a request's), `stream` (true by
default, as Ollama does: one JSON object a line), `logprobs` / `top_logprobs`. `/api/generate` renders its `prompt`
(and `system`) with the chat template as a user turn, or sends it as it is with `raw`. The answer carries Ollama's
counts (`prompt_eval_count`: the prompt's tokens prefilled, `eval_count`, durations in nanoseconds) and
`done_reason` (`stop`, `length`; `context_capped: true` where the context cut it). The model must be named as the
server serves it (`/api/tags` lists it). What Ollama does and this server does not (pulling, creating, copying,
deleting models, embeddings, `suffix`, `context`) is a 404 or a 400 naming it. Errors are Ollama's `{"error": ...}`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import datetime, timezone

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltaserve.api import __version__
from deltaserve.errors import DeltaserveError
from deltaserve.frontends.server.logprobs import token_text
from deltaserve.frontends.server.protocol import (APIError, GenerationRequest, Limits, bad, image_limits, parse_json, thinking_of)
from deltaserve.session.driver import MAX_TOP, Logprobs
from deltaserve.session.turns import CallArguments, CallStart, Content, Finish, Reasoning, ask
from deltaserve.api import GrammarError, ImageInputError, ToolError, normalize

PREFIX = "/api/"
SAMPLING = {"temperature": ("temperature", float, 0.0, 2.0), "top_p": ("top_p", float, 0.0, 1.0),
            "top_k": ("top_k", int, 0, 1 << 20), "min_p": ("min_p", float, 0.0, 1.0),
            "seed": ("seed", int, 0, (1 << 63) - 1), "repeat_penalty": ("repetition_penalty", float, 0.01, 10.0),
            "presence_penalty": ("presence_penalty", float, -2.0, 2.0),
            "frequency_penalty": ("frequency_penalty", float, -2.0, 2.0)}


def is_ours(path: str) -> bool:
    return path.startswith(PREFIX)


def error_response(path: str, e: APIError) -> JSONResponse | None:
    if not is_ours(path):
        return None
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def _kind(v) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _need(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise bad(message[:400], param)


def _image_url(data, where: str) -> str:
    _need(isinstance(data, str) and bool(data), f"{where}: an image must be base64 text, got {_kind(data)}", where)
    try:
        head = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=False)[:12]
    except ValueError:
        raise bad(f"{where}: not valid base64", where) from None
    media = "image/jpeg" if head.startswith(b"\xff\xd8") else "image/gif" if head.startswith(b"GIF8") else \
        "image/webp" if head[8:12] == b"WEBP" else "image/png"
    return f"data:{media};base64,{data}"


def messages_of(value, limits: Limits) -> list[dict]:
    _need(isinstance(value, list), f"messages: must be an array, got {_kind(value)}", "messages")
    _need(len(value) <= limits.max_messages, f"messages: holds {len(value)}, more than the limit of "
          f"{limits.max_messages}", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        _need(isinstance(m, dict), f"{where}: must be an object, got {_kind(m)}", where)
        role = m.get("role")
        _need(role in ("system", "user", "assistant", "tool"), f"{where}.role: must be system, user, assistant or "
              f"tool, got {str(role)[:40]!r}", f"{where}.role")
        content = m.get("content") or ""
        _need(isinstance(content, str), f"{where}.content: must be a string, got {_kind(content)}", f"{where}.content")
        entry: dict = {"role": role, "content": content}
        images = m.get("images") or []
        _need(isinstance(images, list), f"{where}.images: must be an array of base64 images", f"{where}.images")
        if images:
            entry["content"] = [{"type": "image_url", "image_url": {"url": _image_url(d, f"{where}.images[{j}]")}}
                                for j, d in enumerate(images)] + ([{"type": "text", "text": content}] if content else [])
        if role == "assistant":
            if isinstance(m.get("thinking"), str) and m["thinking"]:
                entry["reasoning_content"] = m["thinking"]
            calls = m.get("tool_calls") or []
            _need(isinstance(calls, list), f"{where}.tool_calls: must be an array", f"{where}.tool_calls")
            if calls:
                entry["tool_calls"] = []
                for j, c in enumerate(calls):
                    fn = c.get("function") if isinstance(c, dict) else None
                    _need(isinstance(fn, dict) and isinstance(fn.get("name"), str),
                          f"{where}.tool_calls[{j}].function: must name a function", f"{where}.tool_calls[{j}]")
                    args = fn.get("arguments", {})
                    entry["tool_calls"].append({"id": f"call_{i}_{j}", "type": "function",
                                                "function": {"name": fn["name"], "arguments": args}})
        out.append(entry)
    return out


def format_of(value):
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    _need(isinstance(value, dict), f"format: must be \"json\" or a JSON schema, got {_kind(value)}", "format")
    try:
        return normalize({"type": "json_schema", "json_schema": {"schema": value}})
    except GrammarError as e:
        raise bad(str(e).replace("response_format", "format")[:400], "format") from None


def think_of(value) -> tuple[bool | None, str | None]:
    """(enable_thinking, an effort level: its thinking budget, session/thinking.py)."""
    if value is None:
        return None, None
    if isinstance(value, bool):
        return value, None
    _need(value in ("low", "medium", "high"), f"think: must be a boolean or low, medium, high, got {value!r}", "think")
    return True, value


def sampling_of(options) -> dict:
    if options is None:
        return {}
    _need(isinstance(options, dict), f"options: must be an object, got {_kind(options)}", "options")
    out = {}
    for key, (name, kind, lo, hi) in SAMPLING.items():
        v = options.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        _need(ok and lo <= v <= hi, f"options.{key}: must be {'an integer' if kind is int else 'a number'} from {lo} "
              f"to {hi}, got {str(v)[:40]}", f"options.{key}")
        out[name] = kind(v)
    if out.get("top_k") == 0:
        out.pop("top_k")
    return out


class Parsed:
    def __init__(self, gen: GenerationRequest, chat: bool):
        self.gen, self.chat = gen, chat


def parse(body, limits: Limits, chat: bool) -> Parsed:
    _need(isinstance(body, dict), f"the request body must be a JSON object, got {_kind(body)}")
    model = body.get("model")
    _need(isinstance(model, str) and bool(model), "model is required", "model")
    options = body.get("options") or {}
    sampling = sampling_of(options)
    n = options.get("num_predict") if isinstance(options, dict) else None
    _need(n is None or (isinstance(n, int) and not isinstance(n, bool)), "options.num_predict: must be an integer",
          "options.num_predict")
    max_tokens = n if n is not None and n > 0 else None  # -1, -2: as many as the limit and the context allow
    stop = options.get("stop") if isinstance(options, dict) else None
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    _need(all(isinstance(s, str) and s for s in stop) and len(stop) <= 16, "options.stop: must be up to 16 strings",
          "options.stop")
    stream = body.get("stream", True)
    _need(isinstance(stream, bool), f"stream: must be a boolean, got {_kind(stream)}", "stream")
    top = body.get("top_logprobs")
    _need(top is None or (isinstance(top, int) and 0 <= top <= MAX_TOP), f"top_logprobs: must be 0 to {MAX_TOP}",
          "top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") is True or top else None
    fmt = format_of(body.get("format"))
    asked, effort = think_of(body.get("think"))
    thinking, budget, bridge = thinking_of(limits, effort, {}, None, asked)
    prompt = None
    try:
        if chat:
            turn = ask(messages_of(body.get("messages", []) or [], limits), body.get("tools"), None, True,
                       response_format=fmt, enable_thinking=thinking, image_limits=image_limits(limits))
        else:
            for key, what in (("suffix", "fill-in-the-middle is not served"),
                              ("context", "the deprecated context ids are not served: send the conversation to "
                                          "/api/chat")):
                _need(not body.get(key), f"{key}: {what}", key)
            text = body.get("prompt") or ""
            _need(isinstance(text, str), f"prompt: must be a string, got {_kind(text)}", "prompt")
            turn = None
            if body.get("raw"):
                _need(bool(text), "prompt: must not be empty with raw", "prompt")
                prompt = text
            else:
                message = {"role": "user", "content": text}
                if body.get("images"):
                    message = messages_of([{**message, "images": body["images"]}], limits)[0]
                system = body.get("system")
                head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
                turn = ask(head + [message], None, None, True, response_format=fmt, enable_thinking=thinking,
                           image_limits=image_limits(limits))
    except ImageInputError as e:
        raise bad(str(e)[:300], e.where or "messages") from None
    except ToolError as e:
        raise bad(str(e)[:300], "tools") from None
    except DeltaserveError as e:
        raise bad(str(e)[:300], "messages") from None
    gen = GenerationRequest(model=model, max_tokens=max_tokens, temperature=sampling.get("temperature", 0.8),
                            top_p=sampling.get("top_p"), top_k=sampling.get("top_k"), min_p=sampling.get("min_p"),
                            seed=sampling.get("seed"), stop=stop, stream=stream, include_usage=False,
                            repetition_penalty=sampling.get("repetition_penalty", 1.0),
                            presence_penalty=sampling.get("presence_penalty", 0.0),
                            frequency_penalty=sampling.get("frequency_penalty", 0.0), user=None, turn=turn,
                            prompt=prompt, response_format=fmt if prompt is not None else None, logprobs=logprobs,
                            thinking_budget=budget, thinking_message=bridge)
    return Parsed(gen, chat)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def add_routes(app, server, until_gone, client_gone) -> None:
    tok = server.model.tokenizer
    model = server.model
    started = datetime.fromtimestamp(server.started, timezone.utc).isoformat().replace("+00:00", "Z")

    def details() -> dict:
        return {"parent_model": "", "format": "gguf" if model.path.suffix == ".gguf" else "safetensors",
                "family": "qwen35", "families": ["qwen35"], "parameter_size": "",
                "quantization_level": ""}

    def size() -> int:
        p = model.path
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() else p.stat().st_size

    @app.get("/api/version")
    async def version(request: Request):
        return {"version": __version__}

    @app.get("/api/tags")
    async def tags(request: Request):
        server.check_auth(request)
        entry = {"name": server.model_name, "model": server.model_name, "modified_at": started, "size": size(),
                 "digest": server.store.model_sha256, "details": details()}
        return {"models": [entry]}

    @app.get("/api/ps")
    async def ps(request: Request):
        server.check_auth(request)
        return {"models": [{"name": server.model_name, "model": server.model_name, "size": size(),
                            "digest": server.store.model_sha256, "details": details(), "size_vram": 0,
                            "expires_at": "2999-01-01T00:00:00Z", "context_length": server.context}]}

    @app.post("/api/show")
    async def show(request: Request):
        server.check_auth(request)
        body = await server.read_json(request)
        name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
        if name not in server.model_names:
            raise APIError(404, f"model {str(name)[:100]!r} not found: this server serves {server.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        c = model.config
        caps = ["completion", "tools", "thinking"] + (["vision"] if model.host.vision is not None else [])
        return {"modelfile": "", "parameters": "", "template": tok.chat_template or "", "details": details(),
                "model_info": {"general.architecture": "qwen35", "qwen35.context_length": server.context,
                               "qwen35.block_count": c.num_layers, "qwen35.vocab_size": c.vocab_size},
                "capabilities": caps, "modified_at": started}

    async def run(request: Request, chat: bool):
        t0 = time.perf_counter()
        tenant = server.check_auth(request)
        server.check_json(request)
        body = await server.read_body(request)
        loop = asyncio.get_running_loop()
        try:
            p = await loop.run_in_executor(server.text_pool, lambda: parse(parse_json(body), server.limits, chat))
            req = p.gen
            server.place(req, tenant, request)
            ids, thinking = await loop.run_in_executor(server.text_pool, server.prompt_ids, req)
            server.check(ids, "chat" if chat else "completion", images=req.turn is not None and bool(req.turn.images))
            server.check_model(req)
            return await answer(req, ids, thinking, t0, request, chat)
        except client_gone:
            return Response(status_code=499)

    def counts(ids, turn, t0: float) -> dict:
        ns = lambda s: int(s * 1e9)  # noqa: E731
        out = {"done": True, "done_reason": "length" if turn.finish_reason == "length" else "stop",
               "total_duration": ns(time.perf_counter() - t0), "load_duration": 0,
               "prompt_eval_count": len(ids) - turn.reused, "prompt_eval_duration": ns(turn.timings.prefill_s),
               "eval_count": turn.generated, "eval_duration": ns(turn.timings.decode_s)}
        if turn.context_capped:
            out["context_capped"] = True
        return out

    def logprob_entries(entries) -> list[dict]:
        return [{"token": token_text(tok, e.id), "logprob": e.logprob,
                 "top_logprobs": [{"token": token_text(tok, i), "logprob": lp} for i, lp in e.top]} for e in entries]

    def calls_of(turn_calls) -> list[dict]:
        return [{"function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")}} for c in turn_calls]

    async def answer(req, ids, thinking, t0, request, chat: bool):
        fut, queue, cancel = await server.generate("chat" if chat else "completion", req, ids, thinking, t0, request)
        head = {"model": server.model_name}
        if not req.stream:
            turn = await server.whole_turn(fut, cancel, request)
            out = {**head, "created_at": _now()}
            if chat:
                message = {"role": "assistant", "content": turn.text}
                if turn.reasoning:
                    message["thinking"] = turn.reasoning
                if turn.tool_calls:
                    message["tool_calls"] = calls_of(turn.tool_calls)
                out["message"] = message
            else:
                out["response"] = turn.text
                if turn.reasoning:
                    out["thinking"] = turn.reasoning
            if req.logprobs is not None:
                out["logprobs"] = logprob_entries(turn.logprobs.entries)
            return JSONResponse({**out, **counts(ids, turn, t0)})

        def line(obj: dict) -> str:
            return json.dumps({**head, "created_at": _now(), **obj}, ensure_ascii=False) + "\n"

        def piece(text: str = "", reasoning: str = "", calls=None, lp=None) -> str:
            if chat:
                message = {"role": "assistant", "content": text}
                if reasoning:
                    message["thinking"] = reasoning
                if calls:
                    message["tool_calls"] = calls
                obj = {"message": message, "done": False}
            else:
                obj = {"response": text, "done": False, **({"thinking": reasoning} if reasoning else {})}
            if lp:
                obj["logprobs"] = lp
            return line(obj)

        async def events():
            pending: list = []
            try:
                while True:
                    e = await queue.get()
                    if e is None:
                        break
                    if isinstance(e, Logprobs):
                        if not e.prompt:
                            pending += e.entries
                        continue
                    lp = logprob_entries(pending) if pending else None
                    pending = []
                    if isinstance(e, Reasoning):
                        yield piece(reasoning=e.text, lp=lp)
                    elif isinstance(e, Content):
                        yield piece(text=e.text, lp=lp)
                    elif isinstance(e, (CallStart, CallArguments, Finish)):
                        continue  # a call goes out whole, once the parser has settled it (as Ollama sends them)
                try:
                    turn = await fut
                except Exception as e:  # noqa: BLE001
                    yield json.dumps({"error": server.turn_error(e).message}) + "\n"
                    return
                if turn.tool_calls:
                    yield piece(calls=calls_of(turn.tool_calls))
                last = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
                yield line({**last, **counts(ids, turn, t0)})
            finally:
                if not fut.done():
                    cancel.set()

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @app.post("/api/chat")
    async def chat_route(request: Request):
        return await run(request, True)

    @app.post("/api/generate")
    async def generate_route(request: Request):
        return await run(request, False)
