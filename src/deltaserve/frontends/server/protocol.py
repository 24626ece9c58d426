"""The OpenAI request schema, validated by hand so every mistake is a 400 naming the parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error answered with the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class Limits:
    max_tokens: int = 4096
    max_messages: int = 512
    max_body: int = 4 << 20
    max_stop: int = 4


@dataclass
class GenerationRequest:
    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    user: str | None
    messages: list[dict] = field(default_factory=list)
    prompt: str | list[int] | None = None
    enable_thinking: bool | None = None

    def sampling(self) -> dict:
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, repetition_penalty=self.repetition_penalty,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    """body[key] checked to be a number (an integer when `integer`) in [lo, hi]; `default` when absent or null."""
    if body.get(key) is None:
        return default
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise bad(f"'{key}' must be {kind}, got {type(v).__name__} {v!r}"[:300], key)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{key}' must be finite, got {v}", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _common(body: dict, limits: Limits) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {type(model).__name__}", "model")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise bad(f"'n' must be an integer, got {type(n).__name__}", "n")
    if n not in (None, 1):
        raise bad(f"'n' must be 1 (one choice per request), got {n}", "n")
    mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, mt_key, None, 1, limits.max_tokens, integer=True)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        _number(body, "max_tokens", None, 1, limits.max_tokens, integer=True)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > limits.max_stop:
        raise bad(f"'stop' may hold at most {limits.max_stop} sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("'stop' sequences must not be empty", "stop")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"'stream' must be a boolean, got {type(stream).__name__}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
        include_usage = iu
    for key in ("logprobs", "echo"):
        if body.get(key) not in (None, False):
            raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")
    if body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' is not supported by this server", "top_logprobs", "unsupported_parameter")
    if body.get("logit_bias") not in (None, {}):
        raise bad("'logit_bias' is not supported by this server", "logit_bias", "unsupported_parameter")
    if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none"):
        raise bad("tools are not supported by this server", "tools", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("'response_format' other than text is not supported", "response_format", "unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user")
    seed = _number(body, "seed", None, -(2 ** 63), 2 ** 63 - 1, integer=True)
    return dict(
        model=model, max_tokens=max_tokens, stop=stops, stream=bool(stream), include_usage=include_usage, user=user,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=_number(body, "top_p", None, 0.0, 1.0),
        top_k=_number(body, "top_k", None, -1, 1 << 20, integer=True),
        min_p=_number(body, "min_p", None, 0.0, 1.0),
        seed=seed,
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0.01, 10.0)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
    )


def _fix_sampling(d: dict) -> dict:
    if d["top_k"] is not None and d["top_k"] <= 0:  # -1 / 0: disabled, as vLLM reads it
        d["top_k"] = None
    if d["top_p"] is not None and d["top_p"] <= 0:
        raise bad(f"'top_p' must be greater than 0, got {d['top_p']}", "top_p")
    return d


ROLES = ("system", "user", "assistant", "tool", "developer")


def parse_chat(body: Any, limits: Limits) -> GenerationRequest:
    d = _fix_sampling(_common(body, limits))
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad(f"'messages' must be a list, got {type(messages).__name__}", "messages")
    if not messages:
        raise bad("'messages' must hold at least one message", "messages")
    if len(messages) > limits.max_messages:
        raise bad(f"'messages' holds {len(messages)} messages, more than the limit of {limits.max_messages}", "messages")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"[:300], f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}] must be a text part (this server reads text only)",
                              f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role != "assistant":
            raise bad(f"{where}.content is required", f"{where}.content")
        if content is not None and not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        entry = {"role": "system" if role == "developer" else role, "content": content or ""}
        rc = m.get("reasoning_content")
        if rc is not None:
            if not isinstance(rc, str):
                raise bad(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
            entry["reasoning_content"] = rc
        clean.append(entry)
    thinking = None
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        unknown = set(kw) - {"enable_thinking"}
        if unknown:
            raise bad(f"'chat_template_kwargs' may only hold enable_thinking, got {sorted(unknown)}",
                      "chat_template_kwargs")
        thinking = kw.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise bad("'chat_template_kwargs.enable_thinking' must be a boolean",
                      "chat_template_kwargs.enable_thinking")
    return GenerationRequest(messages=clean, enable_thinking=thinking, **d)


def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    d = _fix_sampling(_common(body, limits))
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")
    elif not isinstance(prompt, str):
        raise bad(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
    if isinstance(prompt, str) and not prompt:
        raise bad("'prompt' must not be empty", "prompt")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    return GenerationRequest(prompt=prompt, **d)
