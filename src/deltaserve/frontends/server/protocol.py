"""The OpenAI request schema, as pydantic models; every mistake is a 400 naming the parameter.

`ChatCompletionRequest` and `CompletionRequest` declare what the server accepts (types, ranges, defaults);
`parse_chat` / `parse_completion` validate a parsed JSON body against them and turn the first validation
error into the OpenAI error object (`APIError`), then hand the engine a `GenerationRequest`. Fields OpenAI
defines that this server does not know are ignored, as OpenAI ignores them; a null field means "absent".
The per-server limits (`Limits`) travel in the validation context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, WrapValidator,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from deltaserve.errors import DeltaserveError
from deltaserve.api import GrammarError, normalize
from deltaserve.session.driver import MAX_TOP
from deltaserve.session.turns import TurnRequest, ask
from deltaserve.api import ToolChoice, ToolError, normalize_tool_choice, normalize_tools
from deltaserve.api import ImageInputError, ImageLimits, fetch_url, private_fetch_url
from deltaserve.api import EFFORTS, ThinkingDefaults, rendered_thinking


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


def parse_json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}"[:300]) from None
    except RecursionError:
        raise bad("the request body nests its JSON too deeply") from None


def clamp_headers(req) -> dict:
    """A max_tokens clamped to the server's limit, said in a header on every API (the body says it too)."""
    if not getattr(req, "clamped", None):
        return {}
    c = req.clamped
    return {"x-deltaserve-max-tokens": f"{c['limit']} (clamped from {c['requested']}: --max-tokens-limit)"}


@dataclass
class Limits:
    max_tokens: int | None = None  # --max-tokens-limit: a request's max_tokens above it is clamped to it (None: the context)
    max_messages: int = 512
    max_body: int = 4 << 20
    max_stop: int = 4
    max_image_pixels: int = 16_777_216
    image_urls: bool = False      # --allow-image-urls: http(s) image links are fetched (size and time bounded)
    compile_timeout: float = 10.0  # --compile-timeout: a schema's compile is stopped past it (a 400)
    max_images: int = 8                       # --max-images: image parts in one request
    max_total_pixels: int = 33_554_432        # --max-image-pixels-total: their decoded pixels together
    private_image_urls: bool = False          # --allow-private-image-urls: links to loopback/private addresses
    vision: bool = True                       # the model has a vision encoder (else an image part is refused unread)
    context: int | None = None                # the served context (a token-id prompt longer is refused unread)
    thinking: ThinkingDefaults = field(default_factory=ThinkingDefaults)  # --reasoning-budget and its kin
    max_n: int = 8                            # the most choices a request may ask for (`n`): one decode forward's rows


def image_limits(limits: Limits) -> ImageLimits:
    """What a request's images may be on this server (vision.inputs.take_images checks them)."""
    fetch = (private_fetch_url if limits.private_image_urls else fetch_url) if limits.image_urls else None
    return ImageLimits(limits.max_image_pixels, limits.max_images, limits.max_total_pixels, fetch, limits.vision)


SEED_LIMIT = 1 << 63  # a seed is 0 <= seed < 2**63 (the sampler's generator takes a signed 64-bit integer)
MAX_CACHE_SALT = 256


@dataclass
class GenerationRequest:
    """A validated request, as the engine reads it."""
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
    turn: TurnRequest | None = None      # /v1/chat/completions: the chat turn (session.turns), messages to format
    prompt: str | list[int] | None = None  # /v1/completions: raw text or token ids
    response_format: dict | None = None  # deltaserve.session.grammar.normalize's form; None: text
    keep_end: bool = False               # the session keeps the state after the answer (a stored response's)
    cache_salt: str | None = None        # vLLM's: the request's prefix cache apart from other salts (frontends/server/tenants.py)
    partition: str | None = None         # set by the server: whose cache this request may reuse (tenant and salt)
    client: str = ""                     # set by the server: who sent it (its share of the compile queue)
    thinking_budget: int | None = None   # thinking tokens at most (None: unlimited; session/thinking.py)
    thinking_message: str | None = None  # the bridge sentence before a closing the turn writes
    logprobs: int | None = None          # each token's log-probability and this many top ones' (None: not asked)
    echo: bool = False                   # /v1/completions: the prompt's text and log-probabilities first
    n: int = 1                           # choices: the prompt prefilled once, its state forked n ways
    clamped: dict | None = None          # set by the server: max_tokens above its limit ({"requested", "limit"})

    def sampling(self) -> dict:
        out = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                   seed=self.seed, repetition_penalty=self.repetition_penalty,
                   presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        if self.partition is not None:  # a session keeps the partitions' states apart (Session.generate)
            out["partition"] = self.partition
        if self.thinking_budget is not None:
            out["thinking_budget"] = self.thinking_budget
        if self.thinking_message:
            out["thinking_message"] = self.thinking_message
        return out


MAX_BUDGET_MESSAGE = 1000  # characters of a bridge sentence


def thinking_of(limits: Limits, effort: str | None, asked: dict, message: str | None,
                enable_thinking: bool | None) -> tuple[bool | None, int | None, str]:
    """(enable_thinking, the thinking budget, the bridge sentence) of a request: its token budget (llama.cpp's
    reasoning_budget_tokens or vLLM's thinking_token_budget; -1 unlimited), else its effort level's, else the
    server's (--reasoning-budget). Thinking is off where anything says so (enable_thinking false, effort none, a
    budget of 0), on where an effort level or enable_thinking true asks for it. A budget over the server's max_tokens limit is refused (a request
    generates at most that many thinking tokens and that many answer tokens)."""
    given = {k: v for k, v in asked.items() if v is not None}
    if len(set(given.values())) > 1:
        said = " and ".join(f"{k} {v}" for k, v in given.items())
        raise bad(f"{said} disagree: give one thinking budget", next(iter(given)))
    budget = next(iter(given.values()), None)
    param = next(iter(given), None)
    defaults = limits.thinking
    if budget is not None:
        budget = None if budget == -1 else budget
        if effort == "none" and budget:
            raise bad(f"reasoning_effort 'none' turns thinking off and {param} asks for {budget} thinking tokens",
                      "reasoning_effort")
        most = limits.max_tokens or limits.context  # the max_tokens limit (default: the context)
        if budget is not None and most is not None and budget > most:
            raise bad(f"'{param}' must be at most {most} (this server's max_tokens limit; -1: "
                      f"unlimited, max_tokens then bounds thought and answer together), got {budget}", param)
    elif effort is not None:
        budget = defaults.efforts.get(effort)
    else:
        budget = defaults.budget
    if enable_thinking is None and effort is not None:
        enable_thinking = effort != "none"
    return rendered_thinking(enable_thinking, budget), budget, defaults.message if message is None else message


# -- custom errors ------------------------------------------------------------------------------------
# A custom error's message says the problem after the parameter's name ("'n' must be 1 ..."), unless its ctx
# says "whole" (the message stands as it is); ctx may also carry "code" (the OpenAI error code) and "param"
# (the parameter's name, for an error the model raises as a whole).

def _problem(message: str, **ctx) -> PydanticCustomError:
    return PydanticCustomError("deltaserve", message, ctx or None)


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def _one_error(problem: str) -> WrapValidator:
    """Any failure of a union type as one error, not one per member of the union."""
    def wrap(v, handler):
        try:
            return handler(v)
        except ValidationError:
            raise _problem(f"{problem}, got {_kind(v)}") from None
    return WrapValidator(wrap)


def _refused_unless(*allowed, message: str | None = None) -> WrapValidator:
    """A parameter this server does not implement: any value but those `allowed` (which mean "off") is refused."""
    def wrap(v, handler):
        if v in allowed:
            return v
        if message:
            raise _problem(message, code="unsupported_parameter", whole=True)
        raise _problem("is not supported by this server", code="unsupported_parameter")
    return WrapValidator(wrap)


def _response_format(v, handler):
    """text (no constraint), json_object or json_schema: the latter two normalised by deltaserve.session.grammar (the
    schema itself is compiled, and a schema the engine cannot compile refused, when the request is served)."""
    try:
        fmt = normalize(v)
    except GrammarError as e:
        raise _problem(str(e), whole=True) from None
    return handler(fmt)


def _tools(v, handler):
    """OpenAI's function tools, checked by deltaserve.text.toolcalls (names, parameter schemas as objects)."""
    v = handler(v)
    try:
        return normalize_tools(v)
    except ToolError as e:
        raise _problem(str(e), whole=True, param="tools") from None


def _text_parts(v, handler):
    try:
        return handler(v)
    except ValidationError as e:
        if isinstance(v, list):
            j = next((loc[1] for err in e.errors() if len(loc := err["loc"]) > 1 and isinstance(loc[1], int)), 0)
            raise _problem(f"must hold text and image_url parts only, and part {j} is neither (this server reads "
                           "text and images)") from None
        raise _problem(f"must be a string or a list of text parts, got {_kind(v)}") from None


def _prompt(v, handler):
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt (text, or token ids: lm-evaluation-harness sends [[ids]])
    if isinstance(v, list) and len(v) > 1 and all(isinstance(x, (str, list)) for x in v):
        raise _problem(f"holds a batch of {len(v)} prompts: this server answers one prompt a request (send each "
                       "in a request of its own; they run side by side on the slots)")
    if isinstance(v, str) and not v:
        raise _problem("must not be empty")
    try:
        return handler(v)
    except ValidationError:
        raise _problem(f"must be a string, a list of one string, or a list of token ids, got {_kind(v)}") from None


# -- the models -----------------------------------------------------------------------------------
Unit = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
ROLES = ("system", "user", "assistant", "tool", "developer")
NO_TOOLS = "tools are served on /v1/chat/completions, not on /v1/completions"
LEGACY_FUNCTIONS = ("'functions' and 'function_call' are OpenAI's deprecated form of tools: send tools=[{\"type\": "
                    "\"function\", \"function\": {...}}] and tool_choice instead")


class _Strict(BaseModel):
    # strict: "1" is not an integer, "yes" not a boolean, true not a number; NaN and infinities are refused
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """An image, as a data URL (deltaserve.vision.inputs decodes it; links are not fetched)."""
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    arguments: str | dict = "{}"


class ToolCallIn(_Strict):
    """An assistant message's tool call, as OpenAI sends it back (arguments: a JSON object, as a string)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: Annotated[str | list[TextPart | ImagePart] | None, WrapValidator(_text_parts)] = \
        Field(None, validate_default=True)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role") not in ("assistant", None):
            raise _problem("is required")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def rendered(self):
        """The content as the turn pipeline takes it: the text, or the parts where there are images."""
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            return [p.model_dump(exclude_none=True) for p in self.content]
        return self.text()


class ChatTemplateKwargs(_Strict):
    model_config = ConfigDict(extra="allow")
    enable_thinking: bool | None = None

    @model_validator(mode="after")
    def _only_known(self):
        if self.model_extra:
            raise _problem(f"may only hold enable_thinking, got {sorted(self.model_extra)}")
        return self


class _Request(_Strict):
    """The fields /v1/chat/completions and /v1/completions share."""
    model: str | None = None
    n: int = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: Annotated[str | list[str] | None, _one_error("must be a string or a list of strings")] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Annotated[int | None, _refused_unless(None, 1, message="'best_of' is not served: one completion per "
                                                    "request (leave it out or send 1)")] = None
    logit_bias: Annotated[dict[str, float] | None, _refused_unless(None, {})] = None
    response_format: Annotated[dict | None, WrapValidator(_response_format)] = None
    reasoning_effort: Literal[EFFORTS] | None = None
    reasoning_budget_tokens: Annotated[int, Field(ge=-1)] | None = None   # llama.cpp's
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None     # vLLM's
    reasoning_budget_message: Annotated[str, Field(max_length=MAX_BUDGET_MESSAGE)] | None = None
    user: str | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] | None = None  # -1 / 0: disabled, as vLLM reads it
    min_p: Unit | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    _server_limits: Limits = PrivateAttr(default_factory=Limits)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body: Any):
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None}
        return body

    @field_validator("n")
    @classmethod
    def _choices(cls, v, info: ValidationInfo):
        most = _limits(info).max_n
        if not 1 <= v <= most:
            raise _problem(f"must be 1 to {most} (the choices are forks of one prefilled state, decoded together: "
                           f"one decode forward takes {most} rows), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v, info: ValidationInfo):
        stops = [v] if isinstance(v, str) else list(v or [])
        limit = _limits(info).max_stop
        if len(stops) > limit:
            raise _problem(f"may hold at most {limit} sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise _problem("sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _problem("is only allowed when 'stream' is true", param="stream_options")
        return self

    def _common(self) -> dict:
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else None
        return dict(
            model=self.model, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            max_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            stream=self.stream, include_usage=bool(self.stream_options and self.stream_options.include_usage),
            user=self.user, temperature=float(self.temperature), top_p=self.top_p, top_k=top_k, min_p=self.min_p,
            response_format=self.response_format, cache_salt=self.cache_salt,
            seed=self.seed, repetition_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
            n=self.n)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Annotated[list[dict] | None, WrapValidator(_tools)] = None
    tool_choice: Annotated[str | dict | None, _one_error("must be 'auto', 'none', 'required' or a function object")] = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[Any, _refused_unless(None, message=LEGACY_FUNCTIONS)] = None
    function_call: Annotated[Any, _refused_unless(None, message=LEGACY_FUNCTIONS)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP)] | None = None
    echo: Annotated[bool | None, _refused_unless(None, False, message="'echo' is served on /v1/completions (the "
                                                 "prompt's log-probabilities), not on /v1/chat/completions")] = None
    _choice: ToolChoice = PrivateAttr(default_factory=lambda: ToolChoice("none"))

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise _problem("'top_logprobs' needs 'logprobs' to be true", whole=True, param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_choice_fits(self):
        if self.tool_choice is not None and not self.tools:
            raise _problem("'tool_choice' is only allowed when 'tools' are specified", whole=True, param="tool_choice")
        try:
            self._choice = normalize_tool_choice(self.tool_choice, tuple(self.tools or ()), self.parallel_tool_calls)
        except ToolError as e:
            raise _problem(str(e), whole=True, param="tool_choice") from None
        return self

    @field_validator("messages", mode="before")
    @classmethod
    def _not_too_many(cls, v, info: ValidationInfo):
        limit = _limits(info).max_messages
        if isinstance(v, list) and len(v) > limit:
            raise _problem(f"holds {len(v)} messages, more than the limit of {limit}")
        return v

    def generation(self) -> GenerationRequest:
        messages = []
        for m in self.messages:
            entry = {"role": "system" if m.role == "developer" else m.role, "content": m.rendered()}
            if m.reasoning_content is not None:
                entry["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                entry["name"] = m.name
            messages.append(entry)
        thinking, budget, bridge = thinking_of(
            self._server_limits, self.reasoning_effort,
            {"reasoning_budget_tokens": self.reasoning_budget_tokens, "thinking_token_budget": self.thinking_token_budget},
            self.reasoning_budget_message,
            self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None)
        try:  # the one turn policy (session.turns): calls' arguments as objects, system messages merged, ...
            turn = ask(messages, tuple(self.tools or ()), self.tool_choice, self.parallel_tool_calls,
                       response_format=self.response_format, enable_thinking=thinking,
                       image_limits=image_limits(self._server_limits))
        except ImageInputError as e:
            raise bad(str(e)[:300], e.where or "messages") from None
        except ToolError as e:
            raise bad(str(e)[:300], "messages") from None
        except DeltaserveError as e:
            raise bad(str(e)[:300], "response_format") from None
        return GenerationRequest(turn=turn, thinking_budget=budget, thinking_message=bridge,
                                 logprobs=(self.top_logprobs or 0) if self.logprobs else None, **self._common())


class CompletionRequest(_Request):
    """POST /v1/completions."""
    prompt: Annotated[str | Annotated[list[int], Field(min_length=1)], WrapValidator(_prompt)]
    suffix: Annotated[str | None, _refused_unless(None)] = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP)] | None = None
    echo: bool = False
    tools: Annotated[list | None, _refused_unless(None, [], message=NO_TOOLS)] = None
    tool_choice: Annotated[str | dict | None, _refused_unless(None, "none", message=NO_TOOLS)] = None

    def generation(self) -> GenerationRequest:
        # a raw prompt that ends inside a thought (markup written whole) is thought under the same budget
        _, budget, bridge = thinking_of(
            self._server_limits, self.reasoning_effort,
            {"reasoning_budget_tokens": self.reasoning_budget_tokens, "thinking_token_budget": self.thinking_token_budget},
            self.reasoning_budget_message, None)
        return GenerationRequest(prompt=self.prompt, thinking_budget=budget, thinking_message=bridge,
                                 logprobs=self.logprobs, echo=self.echo, **self._common())


# -- validation errors as OpenAI error objects ----------------------------------------------------------
_JSON_KINDS = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               type(None): "null"}


def _kind(v: Any) -> str:
    kind = _JSON_KINDS.get(type(v), type(v).__name__)
    return kind if isinstance(v, (list, dict, type(None))) else f"{kind} {v!r}"


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_SAYS = {  # pydantic's error type -> what the message says after the parameter's name
    "model_type": "must be an object", "model_attributes_type": "must be an object", "dict_type": "must be an object",
    "list_type": "must be a list", "string_type": "must be a string", "int_type": "must be an integer",
    "float_type": "must be a number", "bool_type": "must be a boolean", "finite_number": "must be finite",
    "greater_than_equal": "must be at least {ge}", "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}", "less_than": "must be less than {lt}",
    "too_short": "must hold at least {min_length} item(s)", "string_too_short": "must not be empty",
    "string_too_long": "must hold at most {max_length} characters",
    "literal_error": "must be {expected}",
}


def api_error(e: ValidationError) -> APIError:
    """The first of a ValidationError's errors as the OpenAI error object (400, naming the parameter)."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    param = ctx.get("param") or _where(err["loc"]) or None
    if err["type"] == "model_type" and not err["loc"]:
        return bad(f"the request body must be a JSON object, got {_kind(err['input']).split()[0]}")
    if err["type"] == "deltaserve":
        message = err["msg"] if ctx.get("whole") else f"'{param}' {err['msg']}"
    elif err["type"] == "missing":
        message = f"'{param}' is required"
    else:
        says = _SAYS.get(err["type"])
        says = says.format(**ctx) if says else err["msg"][:1].lower() + err["msg"][1:]
        message = f"'{param}' {says}, got {_kind(err['input'])}"
    return bad(message[:300], param, ctx.get("code"))


def _prompt_fits(body: Any, limits: Limits) -> None:
    """A token-id prompt longer than the context is refused before pydantic walks its ids (a 1.3M-id list is
    seconds of validation)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if limits.context is not None and isinstance(prompt, list) and len(prompt) >= limits.context:
        raise bad(f"the prompt holds {len(prompt)} token ids, and this server's context is {limits.context} "
                  "positions: refused whole (nothing is truncated)", "prompt", "context_length_exceeded")


def _parse(model: type[_Request], body: Any, limits: Limits) -> GenerationRequest:
    _prompt_fits(body, limits)
    try:
        req = model.model_validate(body, context={"limits": limits})
        req._server_limits = limits
        return req.generation()
    except ValidationError as e:
        raise api_error(e) from None


def parse_chat(body: Any, limits: Limits) -> GenerationRequest:
    return _parse(ChatCompletionRequest, body, limits)


def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    return _parse(CompletionRequest, body, limits)
