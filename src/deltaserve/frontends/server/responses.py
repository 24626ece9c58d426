"""The Responses API (`POST /v1/responses`) on the turn pipeline: its request read into a chat turn, the turn's events
written back as its items and typed stream events.

- **In.** `parse_responses` validates the body (strict types, ranges, every mistake a 400 naming the parameter as
  `input[2].content[0].type`); `input` (a string, or items: messages with `input_text` / `output_text` parts,
  `function_call`, `function_call_output`, `reasoning`) becomes the messages the template renders (calls folded into
  the assistant message before them, results as tool messages, reasoning onto the answer after it); `instructions`
  and system/developer messages are the system text; function tools, `tool_choice`, `text.format` and
  `reasoning.effort` (a thinking budget per level, none: thinking off; or llama.cpp's `reasoning_budget_tokens`)
  go to `turns.ask` and the turn as /v1/chat/completions sends them. What this
  server cannot do is refused by name: built-in tools, `background`, `include` values, `truncation: auto` (nothing
  is ever dropped silently), images and files (text only).
- **Out.** `Items` turns the turn pipeline's events (`Reasoning`, `Content`, `CallStart`, `CallArguments`,
  `Finish`) into output items (`reasoning`, `message`, `function_call`) and, streaming, the events OpenAI sends
  (`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`,
  `response.reasoning_text.delta`, ... `response.completed`). A whole answer goes through the same events, so a
  streamed response and a whole one are the same items.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from deltaserve.frontends.server.protocol import (MAX_BUDGET_MESSAGE, MAX_CACHE_SALT, SEED_LIMIT, APIError, Limits, bad,
                                                  thinking_of)
from deltaserve.api import GrammarError, normalize
from deltaserve.api import new_id, valid_id
from deltaserve.frontends.server.logprobs import chat_entries
from deltaserve.session.driver import MAX_TOP, Logprobs
from deltaserve.session.turns import CallArguments, CallStart, Content, Finish, Reasoning
from deltaserve.api import ToolError, normalize_tool_choice, normalize_tools
from deltaserve.api import EFFORTS

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "computer",
                  "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # as OpenAI bounds `metadata`
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass
class ResponsesRequest:
    """A validated /v1/responses request, as the server reads it."""
    body: dict
    model: str | None
    messages: list                    # the new input as template messages (no system ones)
    system: str | None                # instructions and the input's system/developer texts
    input_items: list                 # the input as items, with ids (for input_items)
    tools: list | None                # OpenAI's Responses function tools, as sent (echoed back)
    chat_tools: list | None           # the same as /v1/chat/completions takes them
    tool_choice: Any
    parallel_tool_calls: bool
    response_format: dict | None      # grammar.normalize's form
    text: dict                        # echoed: {"format": ...}
    enable_thinking: bool | None
    reasoning: dict | None
    max_output_tokens: int | None
    temperature: float
    top_p: float | None
    seed: int | None
    previous_response_id: str | None
    store: bool
    stream: bool
    metadata: dict
    user: str | None
    cache_salt: str | None = None
    thinking_budget: int | None = None   # thinking tokens at most (None: unlimited; session/thinking.py)
    thinking_message: str = ""           # the bridge sentence before a closing the turn writes
    logprobs: int | None = None       # top_logprobs, or 0 for include's message.output_text.logprobs; None: not asked

    def system_messages(self) -> list:
        return [{"role": "system", "content": self.system}] if self.system else []


def _kind(v: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _need(cond: bool, message: str, param: str, code: str | None = None) -> None:
    if not cond:
        raise bad(message[:400], param, code)


def _number(body: dict, key: str, lo: float, hi: float, default, integer: bool = False, above: bool = False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    _need(ok and not isinstance(v, bool), f"'{key}' must be {'an integer' if integer else 'a number'}, got "
          f"{_kind(v)}", key)
    _need((v > lo if above else v >= lo) and v <= hi and v == v,
          f"'{key}' must be {'more than' if above else 'at least'} {lo} and at most {hi}, got {v}", key)
    return v


def _text_of(parts: Any, where: str, allowed: tuple[str, ...], images: list | None = None) -> str:
    """A message's content (a string, or text parts) as its text; any other part refused by name. With `images` (a
    user message's), its parts in order are appended to it as ("text", text) and ("image", image_url)."""
    if isinstance(parts, str):
        return parts
    _need(isinstance(parts, list), f"'{where}' must be a string or an array of content parts, got {_kind(parts)}",
          where)
    out = []
    for j, p in enumerate(parts):
        at = f"{where}[{j}]"
        _need(isinstance(p, dict), f"'{at}' must be an object, got {_kind(p)}", at)
        t = p.get("type")
        if t == "input_image" and images is not None:
            url = p.get("image_url")
            _need(isinstance(url, str) and bool(url), f"'{at}.image_url' must be a data URL (data:image/...;base64,"
                  f"...), got {_kind(url)}", f"{at}.image_url", "unsupported_content")
            images.append(("image", url))
            continue
        if t in ("input_image", "input_file", "input_audio"):
            raise bad(f"'{at}' is an {t} part: this server reads text parts only ({', '.join(allowed)})", at,
                      "unsupported_content")
        _need(t in allowed, f"'{at}.type' must be one of {', '.join(allowed)}, got {str(t)[:60]!r}", f"{at}.type")
        text = p.get("text", p.get("refusal"))
        _need(isinstance(text, str), f"'{at}.text' must be a string, got {_kind(text)}", f"{at}.text")
        out.append(text)
        if images is not None:
            images.append(("text", text))
    return "".join(out)


def _string(item: dict, key: str, where: str, required: bool = True) -> str | None:
    v = item.get(key)
    if v is None and not required:
        return None
    _need(isinstance(v, str) and (v or not required), f"'{where}.{key}' must be a non-empty string, got {_kind(v)}",
          f"{where}.{key}")
    return v


def input_items(value: Any, limits: Limits) -> tuple[list, list[str], list]:
    """`input` as (template messages, system texts, items with ids)."""
    if isinstance(value, str):
        _need(bool(value), "'input' must not be empty", "input")
        value = [{"type": "message", "role": "user", "content": value}]
    _need(isinstance(value, list), f"'input' must be a string or an array of items, got {_kind(value)}", "input")
    _need(0 < len(value) <= limits.max_messages, f"'input' holds {len(value)} items: it must hold 1 to "
          f"{limits.max_messages}", "input")
    messages: list[dict] = []
    systems: list[str] = []
    items: list[dict] = []
    reasoning: list[str] = []   # reasoning items waiting for the answer they belong to
    for i, item in enumerate(value):
        where = f"input[{i}]"
        _need(isinstance(item, dict), f"'{where}' must be an object, got {_kind(item)}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            _need(role in ("user", "system", "developer", "assistant"), f"'{where}.role' must be user, system, "
                  f"developer or assistant, got {str(role)[:40]!r}", f"{where}.role")
            allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            pictures: list = []
            text = _text_of(item.get("content"), f"{where}.content", allowed + ("text",),
                            pictures if role == "user" else None)
            if role in ("system", "developer"):
                systems.append(text)
            elif role == "assistant":
                entry = {"role": "assistant", "content": text}
                if reasoning:
                    entry["reasoning_content"] = "\n".join(reasoning)
                    reasoning.clear()
                messages.append(entry)
            elif any(kind == "image" for kind, _ in pictures):  # the parts in their order
                messages.append({"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": v}} if kind == "image" else {"type": "text", "text": v}
                    for kind, v in pictures]})
            else:
                messages.append({"role": "user", "content": text})
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
            items.append({"type": "message", "id": item.get("id") if isinstance(item.get("id"), str) else
                          new_id("msg"), "role": role, "content": content, "status": "completed"})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            args = item.get("arguments", "{}")
            _need(isinstance(args, str), f"'{where}.arguments' must be a string (a JSON object), got {_kind(args)}",
                  f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                entry = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    entry["reasoning_content"] = "\n".join(reasoning)
                    reasoning.clear()
                messages.append(entry)
            items.append({"type": "function_call", "id": item.get("id") if isinstance(item.get("id"), str) else
                          new_id("fc"), "call_id": call_id, "name": name, "arguments": args, "status": "completed"})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            out = item.get("output")
            text = out if isinstance(out, str) else _text_of(out, f"{where}.output", ("input_text", "output_text"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            items.append({"type": "function_call_output", "id": item.get("id") if isinstance(item.get("id"), str)
                          else new_id("fco"), "call_id": call_id, "output": text, "status": "completed"})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            _need(isinstance(parts, list), f"'{where}.content' must be an array, got {_kind(parts)}",
                  f"{where}.content")
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                reasoning.append(text)
            items.append({"type": "reasoning", "id": item.get("id") if isinstance(item.get("id"), str) else
                          new_id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
        elif kind == "item_reference":
            raise bad(f"'{where}' is an item_reference: this server continues a conversation by "
                      "previous_response_id (send the items themselves, or name the response)", f"{where}.type",
                      "unsupported_item")
        else:
            raise bad(f"'{where}.type' must be message, function_call, function_call_output or reasoning, got "
                      f"{str(kind)[:60]!r}", f"{where}.type", "unsupported_item")
    return messages, systems, items


def _tools(value: Any) -> tuple[list | None, list | None]:
    if value is None:
        return None, None
    _need(isinstance(value, list), f"'tools' must be an array, got {_kind(value)}", "tools")
    chat = []
    for i, t in enumerate(value):
        _need(isinstance(t, dict), f"'tools[{i}]' must be an object, got {_kind(t)}", f"tools[{i}]")
        kind = t.get("type")
        if kind != "function":
            known = isinstance(kind, str) and kind.split("_20")[0] in BUILT_IN_TOOLS
            raise bad(f"'tools[{i}]' is {'the built-in tool ' if known else 'a tool of type '}{str(kind)[:60]!r}: "
                      "this server calls function tools only ({\"type\": \"function\", \"name\", \"parameters\"})",
                      f"tools[{i}].type", "unsupported_tool")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        chat.append({"type": "function", "function": fn})
    return value, chat


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name") or (value.get("function") or {}).get("name")
        return {"type": "function", "function": {"name": name}}
    raise bad(f"'tool_choice' must be 'auto', 'none', 'required' or {{\"type\": \"function\", \"name\": ...}}, got "
              f"{json.dumps(value)[:80]}", "tool_choice", "unsupported_tool_choice")


def _format(text: Any) -> tuple[dict | None, dict]:
    if text is None:
        return None, {"format": {"type": "text"}}
    _need(isinstance(text, dict), f"'text' must be an object, got {_kind(text)}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    _need(isinstance(fmt, dict), f"'text.format' must be an object, got {_kind(fmt)}", "text.format")
    try:
        return normalize(fmt), {"format": fmt}
    except GrammarError as e:
        raise bad(str(e).replace("response_format", "text.format")[:400], "text.format") from None


def parse_responses(body: Any, limits: Limits) -> ResponsesRequest:
    """A /v1/responses body, validated (a 400 naming the parameter for each mistake)."""
    _need(isinstance(body, dict), f"the request body must be a JSON object, got {_kind(body)}", None)
    body = {k: v for k, v in body.items() if v is not None}
    if body.get("background"):
        raise bad("'background' is not served: responses are answered while the request waits (or streamed)",
                  "background", "unsupported_parameter")
    include = body.get("include", [])
    _need(isinstance(include, list), f"'include' must be an array, got {_kind(include)}", "include")
    unknown = [x for x in include if x != LOGPROBS_INCLUDE]
    if unknown:
        raise bad(f"'include' asks for {', '.join(str(x)[:60] for x in unknown)}: this server fills only "
                  f"{LOGPROBS_INCLUDE!r} (no encrypted reasoning, no tool sources)", "include", "unsupported_parameter")
    if body.get("truncation", "disabled") != "disabled":
        raise bad("'truncation' must be 'disabled': a conversation longer than the context is refused whole, "
                  "never cut", "truncation", "unsupported_parameter")
    for key, what in (("conversation", "the Conversations API is not served: continue by previous_response_id"),
                      ("prompt", "prompt templates are not served: send instructions and input")):
        if key in body:
            raise bad(f"'{key}' is not supported: {what}", key, "unsupported_parameter")
    top = _number(body, "top_logprobs", 0, MAX_TOP, None, integer=True)
    logprobs = top if top is not None else (0 if LOGPROBS_INCLUDE in include else None)
    _need("input" in body, "'input' is required", "input")
    model = body.get("model")
    _need(model is None or isinstance(model, str), f"'model' must be a string, got {_kind(model)}", "model")
    messages, systems, items = input_items(body["input"], limits)
    instructions = body.get("instructions")
    _need(instructions is None or isinstance(instructions, str),
          f"'instructions' must be a string, got {_kind(instructions)}", "instructions")
    system = "\n\n".join(([instructions] if instructions else []) + systems) or None
    tools, chat_tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    parallel = body.get("parallel_tool_calls", True)
    _need(isinstance(parallel, bool), f"'parallel_tool_calls' must be a boolean, got {_kind(parallel)}",
          "parallel_tool_calls")
    try:  # the checks /v1/chat/completions makes of the same tools and choice
        offered = normalize_tools(chat_tools)
        if choice is not None and not offered and choice != "none":
            raise ToolError("'tool_choice' is only allowed when 'tools' are specified")
        normalize_tool_choice(choice, offered, parallel)
    except ToolError as e:
        raise bad(str(e)[:400], "tools" if str(e).startswith("tools") else "tool_choice") from None
    fmt, text = _format(body.get("text"))
    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        _need(isinstance(reasoning, dict), f"'reasoning' must be an object, got {_kind(reasoning)}", "reasoning")
        effort = reasoning.get("effort")
        _need(effort is None or effort in EFFORTS, f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, got "
              f"{str(effort)[:40]!r}", "reasoning.effort")
    asked = {}
    for key in ("reasoning_budget_tokens", "thinking_token_budget"):  # llama.cpp's, vLLM's
        if key in body:
            asked[key] = _number(body, key, -1, 1 << 62, None, integer=True)
    bridge = body.get("reasoning_budget_message")
    _need(bridge is None or (isinstance(bridge, str) and len(bridge) <= MAX_BUDGET_MESSAGE),
          f"'reasoning_budget_message' must be a string of at most {MAX_BUDGET_MESSAGE} characters, got "
          f"{_kind(bridge)}", "reasoning_budget_message")
    thinking, budget, bridge = thinking_of(limits, effort, asked, bridge, None)
    max_out = _number(body, "max_output_tokens", 1, 1 << 62, None, integer=True)  # clamped to the limit when served
    prev = body.get("previous_response_id")
    _need(prev is None or isinstance(prev, str), f"'previous_response_id' must be a string, got {_kind(prev)}",
          "previous_response_id")
    flags = {}
    for key, default in (("store", True), ("stream", False)):
        v = body.get(key, default)
        _need(isinstance(v, bool), f"'{key}' must be a boolean, got {_kind(v)}", key)
        flags[key] = v
    metadata = body.get("metadata", {})
    _need(isinstance(metadata, dict), f"'metadata' must be an object, got {_kind(metadata)}", "metadata")
    _need(len(metadata) <= METADATA_KEYS, f"'metadata' holds {len(metadata)} keys, more than {METADATA_KEYS}",
          "metadata")
    for k, v in metadata.items():
        _need(len(k) <= METADATA_KEY_CHARS, f"'metadata' key {k[:70]!r}... is {len(k)} characters, more than "
              f"{METADATA_KEY_CHARS}", "metadata")
        _need(isinstance(v, str), f"'metadata.{k}' must be a string, got {_kind(v)}", f"metadata.{k}")
        _need(len(v) <= METADATA_VALUE_CHARS, f"'metadata.{k}' is {len(v)} characters, more than "
              f"{METADATA_VALUE_CHARS}", f"metadata.{k}")
    user = body.get("user")
    _need(user is None or isinstance(user, str), f"'user' must be a string, got {_kind(user)}", "user")
    seed = body.get("seed")
    _need(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), f"'seed' must be an integer, got "
          f"{_kind(seed)}", "seed")
    _need(seed is None or 0 <= seed < SEED_LIMIT, f"'seed' must be at least 0 and less than 2**63, got "
          f"{str(seed)[:40]}", "seed")
    salt = body.get("cache_salt")
    _need(salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT),
          f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters, got {_kind(salt)}", "cache_salt")
    return ResponsesRequest(
        body=body, model=model, messages=messages, system=system, input_items=items, tools=tools,
        chat_tools=chat_tools, tool_choice=choice, parallel_tool_calls=parallel, response_format=fmt, text=text,
        enable_thinking=thinking, reasoning=reasoning, max_output_tokens=max_out,
        temperature=float(_number(body, "temperature", 0.0, 2.0, 1.0)),
        top_p=_number(body, "top_p", 0.0, 1.0, None, above=True), seed=seed, previous_response_id=prev,
        store=flags["store"], stream=flags["stream"], metadata=metadata, user=user, cache_salt=salt,
        thinking_budget=budget, thinking_message=bridge, logprobs=logprobs)


def frame(system: str | None, rendered_tools: list | None) -> str:
    """What a conversation's opening was rendered with: its system text and its tools as the template renders them.
    A follow-up with another frame is rendered again from its items (its state cannot hold what it asks)."""
    return hashlib.sha256(json.dumps([system, rendered_tools], sort_keys=True, ensure_ascii=False)
                          .encode("utf-8")).hexdigest()


def previous_not_found(rid: str) -> APIError:
    said = rid[:100]
    why = "" if valid_id(rid) else " (response ids here are 'resp_' and 32 hex digits)"
    return APIError(400, f"previous response with id {said!r} not found{why}: it was never "
                    "stored here (store: false), was deleted, or left the stored responses' budget",
                    "invalid_request_error", "previous_response_id", "previous_response_not_found")


# -- the answer as items and events ------------------------------------------------------------------------
@dataclass
class Items:
    """The turn pipeline's events as output items and, streaming, OpenAI's typed events (`sse()` lines)."""
    response_id: str
    output: list = field(default_factory=list)
    events: list = field(default_factory=list)
    _open: dict | None = None
    _calls: dict = field(default_factory=dict)   # call index -> its output position
    seq: int = 0
    tokenizer: Any = None                        # with it, the text's log-probabilities (include / top_logprobs)
    _pending: list = field(default_factory=list)  # log-probabilities of tokens whose text has not come yet

    def emit(self, kind: str, **data) -> None:
        self.events.append({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1

    def _close(self) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        at = self.output.index(item)
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0, text=text)
            self.emit("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                      part={"type": "reasoning_text", "text": text})
        elif item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                      text=part["text"], logprobs=part["logprobs"])
            self.emit("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part)
        elif item["type"] == "function_call":
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                      arguments=item["arguments"], name=item["name"])
        item["status"] = "completed"
        self.emit("response.output_item.done", output_index=at, item=item)

    def _begin(self, item: dict) -> int:
        self._close()
        self.output.append(item)
        self._open = item
        at = len(self.output) - 1
        shown = {**item, "status": "in_progress"}
        if item["type"] == "reasoning":
            shown["content"] = []
        elif item["type"] == "message":
            shown["content"] = []
        self.emit("response.output_item.added", output_index=at, item=json.loads(json.dumps(shown)))
        if item["type"] in ("reasoning", "message"):
            part = {"type": "reasoning_text", "text": ""} if item["type"] == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.emit("response.content_part.added", item_id=item["id"], output_index=at, content_index=0, part=part)
        return at

    def push(self, events) -> None:
        for e in events:
            if isinstance(e, Logprobs):
                if not e.prompt:
                    self._pending += e.entries
                continue
            taken, self._pending = self._pending, []  # the tokens whose text this event carries
            if isinstance(e, Reasoning):
                if self._open is None or self._open["type"] != "reasoning":
                    self._begin({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                 "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
                self._open["content"][0]["text"] += e.text
                self.emit("response.reasoning_text.delta", item_id=self._open["id"],
                          output_index=len(self.output) - 1, content_index=0, delta=e.text)
            elif isinstance(e, Content):
                if self._open is None or self._open["type"] != "message":
                    self._begin({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
                self._open["content"][0]["text"] += e.text
                lp = chat_entries(taken, self.tokenizer) if self.tokenizer is not None else []
                self._open["content"][0]["logprobs"] += lp
                self.emit("response.output_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                          content_index=0, delta=e.text, logprobs=lp)
            elif isinstance(e, CallStart):
                self._calls[e.index] = self._begin({"type": "function_call", "id": new_id("fc"), "call_id": e.id,
                                                    "name": e.name, "arguments": "", "status": "in_progress"})
            elif isinstance(e, CallArguments):
                at = self._calls.get(e.index)
                if at is not None:
                    self.output[at]["arguments"] += e.text
                    self.emit("response.function_call_arguments.delta", item_id=self.output[at]["id"],
                              output_index=at, delta=e.text)
            elif isinstance(e, Finish):
                self._finish(e)

    def _finish(self, done: Finish) -> None:
        """The last event: the calls as the parser settled them (their arguments whole), every item closed."""
        for call in done.tool_calls:
            item = next((it for it in self.output if it["type"] == "function_call" and it["call_id"] == call.id), None)
            if item is None:
                self._begin({"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                             "arguments": "", "status": "in_progress"})
                item = self._open
            if item["arguments"] != call.arguments:
                rest = call.arguments[len(item["arguments"]):] if call.arguments.startswith(item["arguments"]) else ""
                if rest:
                    self.emit("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.output.index(item), delta=rest)
                item["arguments"] = call.arguments
        if self._pending and self._open is not None and self._open["type"] == "message" and self.tokenizer is not None:
            # tokens whose text never came (a stop string's, a token of no text): the message's, as chat lists them
            self._open["content"][0]["logprobs"] += chat_entries(self._pending, self.tokenizer)
        self._pending = []
        # calls the parser dropped (cut by the budget) are not answers
        kept = {c.id for c in done.tool_calls}
        self._close()
        self.output[:] = [it for it in self.output if it["type"] != "function_call" or it["call_id"] in kept]

    def texts(self) -> tuple[str, str | None, list]:
        """(the answer's text, the reasoning, the calls as assistant tool_calls) for the stored conversation."""
        content = "".join(it["content"][0]["text"] for it in self.output if it["type"] == "message")
        reasoning = "".join(it["content"][0]["text"] for it in self.output if it["type"] == "reasoning")
        calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                         "arguments": it["arguments"]}}
                 for it in self.output if it["type"] == "function_call"]
        return content, (reasoning or None), calls


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def response_object(rid: str, created: int, model: str, req: ResponsesRequest, status: str, output: list,
                    usage: dict | None, incomplete: str | None = None, error: dict | None = None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.body.get("instructions"), "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": req.store, "temperature": req.temperature, "text": req.text,
        "tool_choice": req.body.get("tool_choice", "auto"), "tools": req.tools or [], "top_p": req.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata,
        "top_logprobs": req.logprobs,
        "background": False,
    }


def usage(input_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}

