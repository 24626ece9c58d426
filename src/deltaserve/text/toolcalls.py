"""Tool calls in the Qwen3.5 format: the tools a request offers, and the calls a model writes, parsed into OpenAI's.

The model's chat template renders the offered tools (a `<tools>` block and its instructions), earlier assistant
`tool_calls` and `tool` messages (`<tool_response>`). A model calls a tool by writing, after optional reasoning:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

several such blocks in one answer. `ToolCallParser` reads that text as it streams and hands out events: content
(text that is not a call: held back while it may be the start of `<tool_call>`), the start of a call (its id and
function name) and its arguments (a JSON object as a string). A block becomes a call only when all of it holds:

* it is closed (`</tool_call>`) and is one `<function=NAME>...</function>` of `<parameter=P>...</parameter>`s;
* NAME is a function the request offered, and every P is a parameter its JSON schema declares (unless the schema
  declares none, or allows additional properties), each at most once;
* every value converts to its parameter's type: a string as written; an integer, a number, a boolean, null, an
  object or an array from its text (JSON; a boolean also as Python writes it, `True`, which is how the template
  renders one); a schema that allows several types takes the first that the text is.

Anything else (a block left open, an unknown function or parameter, a value of the wrong type, a `<tool_call>` in
a fenced code block) stays content, as written. Parsing never raises on what a model writes. `parse` reads a
whole answer the same way (it is the streaming parser run once), so a streamed and a non-streamed answer agree.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from deltaserve.errors import DeltaserveError
from deltaserve.text.stream import held_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FENCE = "```"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")  # \Z, not $: "$" matched before a trailing newline
MAX_TOOLS = 128
MAX_DEPTH = 48  # objects and arrays nested in a schema or in a call's arguments (OpenAI's schemas: 10 object levels)


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep objects and arrays nest in `value`, counted without recursion and no further than `limit` + 1 (a
    schema nested 900 deep stalled xgrammar's compile for a minute; 490 deep overflowed the template's recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    depth = nesting_depth(value, limit)
    if depth > limit:
        raise ToolError(f"{where} nests objects and arrays more than {limit} levels deep (at least {depth}): refused "
                        f"before it is compiled or rendered")

# the markup's parts are one newline apart (the template's); one whitespace character of any kind is read the same
# (xgrammar's qwen_xml grammar allows it), so a value is what lies between them
_FUNCTION = re.compile(r"^\s*<function=([^>\n]{1,200})>\s?(.*?)\s?</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]{1,200})>\s?(.*?)\s?</parameter>", re.S)
_INTEGER = re.compile(r"^-?(0|[1-9][0-9]*)$")


class ToolError(DeltaserveError, ValueError):
    """Tools or a tool_choice that cannot be served (the message names the problem)."""


@dataclass(frozen=True)
class Tool:
    """An offered function: its name, description and JSON schema of parameters (an object schema)."""

    name: str
    parameters: dict
    description: str | None = None

    def openai(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass
class ToolCall:
    """A parsed call: OpenAI's `id`, `function.name` and `function.arguments` (a JSON object, as a string)."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> dict:
        return json.loads(self.arguments)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolChoice:
    """What a request asks of the tools: mode "auto" | "none" | "required" (a named function: "required" with
    `name`), and whether more than one call may come back."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """Whether the answer must be constrained: a call required (or a named one), or at most one call."""
        return self.mode == "required" or (self.mode == "auto" and not self.parallel)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- tools and tool_choice, as requests give them ----------------------------------------------------------------

def normalize_tools(tools: Any) -> tuple[Tool, ...]:
    """OpenAI's `tools` (a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}; a
    bare function object is accepted too) as Tools; a malformed list raises ToolError naming the entry."""
    if tools is None:
        return ()
    if isinstance(tools, tuple) and all(isinstance(t, Tool) for t in tools):
        return tools
    if not isinstance(tools, (list, tuple)):
        raise ToolError(f"tools must be a list of function tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(tools)} tools, more than the limit of {MAX_TOOLS}")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if isinstance(t, Tool):
            tool = t
        else:
            if hasattr(t, "model_dump"):
                t = t.model_dump()
            if not isinstance(t, dict):
                raise ToolError(f"tools[{i}] must be an object, got {type(t).__name__}")
            kind = t.get("type", "function")
            if kind != "function":
                raise ToolError(f"tools[{i}].type must be 'function' (the only kind this server calls), got {kind!r}")
            fn = t.get("function", t if "name" in t else None)
            if not isinstance(fn, dict):
                raise ToolError(f"tools[{i}].function must be an object with a 'name'")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME_PATTERN.match(name):
                raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-', '.' or ':', "
                                f"got {str(name)[:80]!r}")
            params = fn.get("parameters")
            if params is None:
                params = {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
            check_depth(params, f"tools[{i}].function.parameters")
            if params.get("type", "object") != "object":
                raise ToolError(f"tools[{i}].function.parameters must describe an object (type 'object'), "
                                f"got type {params.get('type')!r}")
            props = params.get("properties", {})
            if not isinstance(props, dict) or not all(isinstance(k, str) and k and NAME_PATTERN.match(k)
                                                      for k in props):
                raise ToolError(f"tools[{i}].function.parameters.properties must map parameter names (1-64 "
                                "letters, digits, '_', '-', '.' or ':') to schemas")
            description = fn.get("description")
            if description is not None and not isinstance(description, str):
                raise ToolError(f"tools[{i}].function.description must be a string")
            tool = Tool(name, params, description)
        if tool.name in seen:
            raise ToolError(f"tools[{i}]: the function name {tool.name!r} is offered twice")
        seen.add(tool.name)
        out.append(tool)
    return tuple(out)


def normalize_tool_choice(tool_choice: Any, tools: tuple[Tool, ...], parallel: bool | None = True) -> ToolChoice:
    """OpenAI's `tool_choice` ("auto", "none", "required", {"type": "function", "function": {"name": N}}; absent:
    "auto" when tools are offered) as a ToolChoice; one that names no offered function raises ToolError."""
    parallel = True if parallel is None else bool(parallel)
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump()
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", None, parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ToolError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {tool_choice[:80]!r}")
        if tool_choice == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools: the request offers none")
        return ToolChoice(tool_choice if tools else "none", None, parallel)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {t.name for t in tools}:
            offered = ", ".join(t.name for t in tools) or "none"
            raise ToolError(f"tool_choice names the function {name[:80]!r}, which the request does not offer "
                            f"(offered: {offered})")
        return ToolChoice("required", name, parallel)
    raise ToolError(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")


def arguments_object(arguments: Any, where: str = "arguments") -> dict:
    """A call's arguments as the chat template renders them (a mapping): OpenAI sends a JSON string."""
    if isinstance(arguments, dict):
        check_depth(arguments, where)
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:
            raise ToolError(f"{where} must be a JSON object (as a string), and is not JSON: {e}"[:300]) from None
        if isinstance(value, dict):
            check_depth(value, where)
            return value
        raise ToolError(f"{where} must be a JSON object, got {type(value).__name__}")
    raise ToolError(f"{where} must be a JSON object (as a string), got {type(arguments).__name__}")


# -- values by their schema ------------------------------------------------------------------------------------

class _NoValue(Exception):
    pass


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in the order to try them ([] : any)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: list[str] = []
            for sub in schema[key]:
                sub_types = _types(sub)
                if not sub_types:
                    return []
                out += [x for x in sub_types if x not in out]
            return out
    if "enum" in schema and isinstance(schema["enum"], list):
        return list(dict.fromkeys(_JSON_TYPE.get(type(v), "string") for v in schema["enum"]))
    if "const" in schema:
        return [_JSON_TYPE.get(type(schema["const"]), "string")]
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


_JSON_TYPE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", dict: "object",
              list: "array"}


def _as(kind: str, text: str) -> Any:
    s = text.strip()
    if kind == "string":
        return text
    if kind == "integer":
        if _INTEGER.match(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            raise _NoValue() from None
        if math.isfinite(f) and f == int(f) and abs(f) < 2 ** 63:
            return int(f)
        raise _NoValue()
    if kind == "number":
        try:
            v = json.loads(s, parse_constant=_refuse)
        except ValueError:
            raise _NoValue() from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _NoValue()  # 1e999 is a JSON number whose value no JSON can hold
        return v
    if kind == "boolean":
        low = s.lower()
        if low in ("true", "false"):
            return low == "true"
        raise _NoValue()
    if kind == "null":
        if s in ("null", "None", ""):
            return None
        raise _NoValue()
    if kind in ("object", "array"):
        try:
            v = json.loads(s, parse_constant=_refuse)
        except (ValueError, RecursionError):
            raise _NoValue() from None
        if isinstance(v, dict if kind == "object" else list) and _finite(v):
            return v
        raise _NoValue()
    raise _NoValue()


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(v: Any, depth: int = 0) -> bool:
    if depth > 200:
        return False
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x, depth + 1) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x, depth + 1) for x in v)
    return True


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema types it as; raises _NoValue when it is none of them."""
    kinds = _types(schema)
    if not kinds:  # any value: JSON when the text is JSON, else the text
        try:
            v = json.loads(text, parse_constant=_refuse)
        except (ValueError, RecursionError):
            return text
        return v if _finite(v) else text
    # a string is tried last: "3" for ["integer", "string"] is the integer
    order = [k for k in kinds if k != "string"] + (["string"] if "string" in kinds else [])
    for kind in order:
        try:
            return _as(kind, text)
        except _NoValue:
            continue
    raise _NoValue()


def parse_block(body: str, tools: dict[str, Tool]) -> tuple[str, dict] | None:
    """The (name, arguments) of one `<tool_call>` block's inside, or None when it is not a valid call."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    tool = tools.get(name)
    if tool is None:
        return None
    props = tool.parameters.get("properties") or {}
    extra_ok = not props or tool.parameters.get("additionalProperties") not in (None, False)
    args: dict[str, Any] = {}
    pos = 0
    for pm in _PARAMETER.finditer(inner):
        if inner[pos:pm.start()].strip():  # text between parameters: not this format
            return None
        pos = pm.end()
        pname = pm.group(1).strip()
        if pname in args:
            return None
        if pname not in props and not extra_ok:
            return None
        schema = props.get(pname)
        if schema is None and isinstance(tool.parameters.get("additionalProperties"), dict):
            schema = tool.parameters["additionalProperties"]
        try:
            args[pname] = convert_value(pm.group(2), schema)
        except _NoValue:
            return None
    if inner[pos:].strip():
        return None
    return name, args


# -- the streaming parser --------------------------------------------------------------------------------------

@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str  # a piece of the arguments' JSON string; a call's pieces joined are its arguments


Event = Content | CallStart | CallArguments


@dataclass
class ToolCallParser:
    """Reads an answer as it streams (`push`, then `finish`) and says what is content and what is a call.

    `parallel` False: at most one call comes back (a later block stays content). Whitespace next to a call is
    markup, not content: whitespace is held until text follows it, dropped when a call follows it instead (or
    ends the answer after calls), and the whitespace that opens the text after a call is dropped; so a streamed
    answer's content equals the whole answer's. `finish(cut=True)` (the budget ran out) drops a call still open:
    its markup is never content (`cut` says it happened)."""

    tools: Iterable[Tool]
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""

    def __post_init__(self):
        self._tools = {t.name: t for t in normalize_tools(tuple(self.tools))}
        self._buf = ""          # text not yet handed out
        self._in_call = False   # the buffer holds a block opened by <tool_call>
        self._fences = 0        # code fences in the content so far (odd: inside a fenced block)
        self._ws = ""           # whitespace held back: content or markup, as what follows it says
        self._after_call = False
        self.cut = False

    def _emit_content(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        self._fences += text.count(FENCE)
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self.content += body
            out.append(Content(body))

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while True:
            if not self._in_call:
                k = self._buf.find(CALL_START)
                # a <tool_call> inside a fenced code block is text: emit through it
                while k >= 0 and (self._fences + self._buf[:k].count(FENCE)) % 2 == 1:
                    k = self._buf.find(CALL_START, k + len(CALL_START))
                if k < 0:
                    keep = held_tail(self._buf, [CALL_START, FENCE])
                    self._emit_content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._emit_content(self._buf[:k], out)
                self._buf = self._buf[k:]
                self._in_call = True
            end = self._buf.find(CALL_END)
            if end < 0:
                return out
            block, self._buf = self._buf[:end + len(CALL_END)], self._buf[end + len(CALL_END):]
            self._in_call = False
            self._close(block, out)

    def _close(self, block: str, out: list[Event]) -> None:
        parsed = None
        if self.parallel or not self.calls:
            try:
                parsed = parse_block(block[len(CALL_START):-len(CALL_END)], self._tools)
            except Exception:  # noqa: BLE001 - what a model writes never breaks a turn
                parsed = None
        if parsed is None:
            self._emit_content(block, out)
            return
        name, args = parsed
        call = ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        self._ws, self._after_call = "", True  # whitespace around a call is markup
        out.append(CallStart(index, call.id, name))
        out.append(CallArguments(index, call.arguments))

    def finish(self, cut: bool = False) -> list[Event]:
        """What is left: a held-back tail as content; an unclosed block as content, or with `cut` (the token
        budget ended the answer inside it) nothing; held whitespace as content unless calls came."""
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._in_call and cut:
            self.cut, rest = True, ""
        self._in_call = False
        self._emit_content(rest, out)
        if self._ws and not self.calls and not self.cut:
            self.content += self._ws
            out.append(Content(self._ws))
        self._ws = ""
        return out

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) once finished: content None when there are calls and no other text."""
        content = self.content
        if self.calls:
            content = content or None
        return content, list(self.calls)


def parse(text: str, tools: Iterable[Tool], parallel: bool = True, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's (content, tool calls), exactly as `ToolCallParser` streams them."""
    p = ToolCallParser(normalize_tools(tuple(tools)), parallel)
    p.push(text)
    p.finish(cut)
    return p.result()


def template_messages(messages: Iterable[Any]) -> list[Any]:
    """Messages as the chat template renders them: each assistant `tool_calls` entry as {"id", "type", "function":
    {"name", "arguments": an object}} (OpenAI sends arguments as a JSON string; a `ToolCall` is taken as it is).
    A malformed call raises ToolError naming it."""
    out: list[Any] = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump()
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            if not isinstance(calls, (list, tuple)):
                raise ToolError(f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if isinstance(c, ToolCall):
                    c = c.openai()
                elif hasattr(c, "model_dump"):
                    c = c.model_dump()
                fn = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ToolError(f"{where}.function must be an object with a 'name'")
                args = arguments_object(fn.get("arguments") or {}, f"{where}.function.arguments")
                fixed.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
