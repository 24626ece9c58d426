"""A streamed answer whose generation fails before it has said anything is answered as that error, with its status.

A streamed response commits to `200 OK` with its first byte. A generation that fails at once (a seed the sampler
cannot take, a state that would not restore) would then report its error inside a 200, where a client that checks the
status (the openai SDK does) never looks. So the stream is held until its first event that carries something (the
openings every stream sends first, chat's role delta or the Responses API's `response.created`, are held with it):
if that event is an error, the answer is the error object with its own status; otherwise the held events and the
rest are streamed as they come. Nothing is lost: the events are the generator's own, in order.
"""

from __future__ import annotations

import json
from typing import Callable

from fastapi.responses import JSONResponse, StreamingResponse

OPENING_DELTA = {"role": "assistant", "content": "", "refusal": None}
OPENING_EVENTS = ("response.created", "response.in_progress", "message_start", "ping")  # Responses', Anthropic's


def _events(chunk) -> list[dict]:
    """The JSON objects of one chunk's `data:` lines (SSE)."""
    text = chunk.decode("utf-8", "replace") if isinstance(chunk, (bytes, bytearray)) else str(chunk)
    out = []
    for line in text.split("\n"):
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            try:
                out.append(json.loads(line[6:]))
            except ValueError:
                out.append({})
    return out


def classify(chunk) -> str:
    """"opening" (says nothing yet), "error" (the first thing said is an error), or "data"."""
    events = _events(chunk)
    if not events:
        return "opening"
    for e in events:
        if not isinstance(e, dict):
            return "data"
        if "error" in e and set(e) == {"error"}:
            return "error"  # chat and completions: {"error": {...}}
        kind = e.get("type")
        if kind == "error":
            return "error"  # the Responses API's error event
        if kind in OPENING_EVENTS:
            continue
        choices = e.get("choices")
        if kind is None and isinstance(choices, list) and len(choices) == 1 and \
                choices[0].get("delta") == OPENING_DELTA and choices[0].get("finish_reason") is None:
            continue
        return "data"
    return "opening"


def error_response(chunk) -> JSONResponse:
    """The error a first chunk carries, as its own response: 500 for an internal error, else 400."""
    for e in _events(chunk):
        if "error" in e and set(e) == {"error"}:
            err = e["error"]
            break
        if e.get("type") == "error":
            inner = e.get("error") if isinstance(e.get("error"), dict) else e  # Anthropic's nests it
            err = {"message": inner.get("message"), "type": "invalid_request_error", "param": inner.get("param"),
                   "code": inner.get("code")}
            if inner.get("type") in ("api_error", "overloaded_error"):
                err["type"] = "server_error"
            if e.get("code") == "server_error":
                err["type"] = "server_error"
            break
    else:
        err = {"message": "the generation failed", "type": "server_error", "param": None, "code": None}
    status = 500 if err.get("type") == "server_error" else 400
    return JSONResponse({"error": err}, status_code=status)


async def settle(response, wait: Callable | None = None):
    """`response` unchanged unless it is a stream whose first event that says something is an error: then that error
    with its status. `wait(awaitable)` awaits the first events (server.until_gone: a client that leaves meanwhile
    closes the stream, which cancels its generation)."""
    if not isinstance(response, StreamingResponse):
        return response
    stream = response.body_iterator
    held: list = []

    async def first() -> str:
        async for chunk in stream:
            held.append(chunk)
            kind = classify(chunk)
            if kind != "opening":
                return kind
        return "end"

    try:
        kind = await (wait(first()) if wait is not None else first())
    except BaseException:
        await stream.aclose()
        raise
    if kind == "error":
        await stream.aclose()
        return error_response(held[-1])

    async def replay():
        for chunk in held:
            yield chunk
        async for chunk in stream:
            yield chunk

    response.body_iterator = replay()
    return response
