"""Structured outputs: a JSON schema (or "any JSON object") as a token mask applied to the logits before sampling.

`compile_format(tokenizer, response_format, vocab_size, stop_ids)` turns an OpenAI `response_format`
(``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}``; ``{"type":
"text"}`` and None mean "no constraint") into a `CompiledFormat`; its `constraint()` is one generation's matcher:
at each step `mask(logits)` sets every token the grammar does not allow to -inf, the sampler picks one of the rest,
`accept(token)` advances the matcher. The model's stop tokens are allowed exactly when the grammar can end, so a
generation ends ("stop") when the JSON is complete; `done()` says when nothing but a stop token is left.

The grammar engine is xgrammar. Measured on this machine (2 CPU cores) with the real Qwen3.5 vocabulary (248,077
ids), a schema with nested objects, an array, an enum, an integer range, a number and bounded strings, stepping a
59-token answer (median / max per token of computing the mask; engine setup once per tokenizer; compile per schema):

    ===============  ============  ==========  ===========  ============
    engine           mask median   mask max    setup        compile
    ===============  ============  ==========  ===========  ============
    xgrammar 0.2.9   0.03 ms       0.15 ms     0.20 s       0.11 s
    llguidance 1.9   0.26 ms       8.1 ms      1.0 s        <0.01 s *
    outlines-core    0.003 ms **   14 ms       0.8 s        8.6 s
    ===============  ============  ==========  ===========  ============

    * llguidance compiles lazily: its cost moves into the first masks (hence the 8 ms maximum).
    ** outlines-core precomputes a full DFA index per schema (8.6 s for this one: a new schema would stall its
       request that long); its mask is a list of allowed ids, 2.7 ms on average, 14 ms on the widest states.

xgrammar has the smallest and steadiest per-token mask (its adaptive token masks are precomputed at compile time
and cached per grammar state) with a compile short enough to do per request, so it is the engine. Its own
`apply_token_bitmask_inplace` on the CPU is slow (about 8 ms for 248K logits), and so were torch's multithreaded
elementwise ops on one row on this loaded 2-core machine, so the bitmask is unpacked and applied with numpy: the
whole step (mask computed, applied to a 248K row, token accepted) measured 0.18 ms median, 2-4 ms max
(`bench_mask` below) against a decode step of tens of ms on the CPU. End to end (`python -m tools.bench.grammar`,
benchmarks/grammar.json): the 0.8B-shape q8_0 model (248,320 logits) decoded 23.89 tok/s free and 23.94 tok/s with a
schema whose every step is inside a JSON string (the densest masks), 64 tokens x 3 rounds: no measurable slowdown
(goal: at most 10 %).

Design choices:
* json_schema compiles in xgrammar's strict mode (properties and items the schema does not declare are refused,
  as OpenAI's `strict: true` requires) with no free whitespace (compact JSON: `{"a": 1, "b": [2, 3]}`), so a
  model cannot stall the answer in whitespace; the output's size is then bounded only by the schema (give
  strings a maxLength and arrays a maxItems to bound it). json_object is any JSON object, no free whitespace.
  A generation that reaches max_tokens before the JSON closes ends with finish_reason "length", honestly: its
  text is then a prefix of a valid answer, not a valid answer.
* Only the answer is constrained: a chat turn with a response_format is rendered with thinking off unless thinking
  is asked for; then the grammar sleeps while the model thinks and starts after the thought's closing, whoever
  closed it (session/thinking.py: the budget and the loop guard bound the thought).
* Tokens holding a control byte (< 0x20) and the control (special, non-stop) added tokens are never allowed: in
  compact JSON no whitespace but the space is needed, and xgrammar's string rule would let a raw control character
  into a string, which is not JSON (json.loads refuses it; found on the random-weight fixtures).
* When the grammar is complete and allows nothing but a stop token, the turn ends there ("stop") without a step
  to sample that stop; an answer that closes on the budget's last token also ends "stop".
* The engine comparison ran while another benchmark kept this 2-core machine busy: the absolute figures are noisy,
  the three engines were measured in one process under the same load.
* Tool calls (`compile_tools`): `tool_choice` "required" or a named function, and `parallel_tool_calls: false`,
  are enforced with xgrammar's structural tag for the Qwen3.5 tool-call format (`get_model_structural_tag
  ("qwen_3_5")`: `<tool_call>\n<function=NAME>\n` for an offered NAME, then each parameter as `<parameter=P>\n
  VALUE\n</parameter>` typed by the function's JSON schema, its required ones present, no others, one newline
  between the markup's parts: `max_whitespace_cnt=1`, without which random weights pile up newlines). "required"
  is the calls alone, one newline apart (xgrammar's tags with a separator: its built-in "required" lets free text
  run between calls, where random weights wandered until max_tokens), one of them with parallel_tool_calls false;
  a named function is exactly one call of it; auto with parallel_tool_calls false is xgrammar's built-in Qwen3.5
  tag: text, then at most one call, then the end. The format needs
  newlines, so tool grammars run on an engine whose vocabulary keeps tokens with control bytes (`text=True`).
  Measured on the real 248K vocabulary (0.8B GGUF's tokenizer) with get_weather and add offered, on this 2-core
  machine under a load average of 10: the text engine's setup (tokenizer info for 248K tokens, once per tokenizer)
  and the first compile 17 s, a later compile 0.15 s; mask + accept per token 0.66 ms median (15-37 ms max) over
  a two-call answer of 64 tokens, against a decode step of tens of ms.
* Compiled grammars are cached per engine (an LRU of `CACHE_SIZE` schemas, keyed on the canonical JSON of the
  format): a repeated schema costs nothing. One engine (the tokenizer info, the compiler) per tokenizer, built once.
"""

from __future__ import annotations

import atexit
import itertools
import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np
import torch

from deltaserve.errors import DeltaserveError
from deltaserve.text.toolcalls import MAX_DEPTH, nesting_depth

CACHE_SIZE = 32
_ENGINE_KEYS = itertools.count()
MAX_SCHEMA_BYTES = 1 << 18  # a schema's compact JSON (xgrammar's compile grows with it: 3,000 properties, 89 KB: 43 s)
_CONTROL = re.compile(rb"[\x00-\x1f]")


class GrammarError(DeltaserveError, ValueError):
    """A response_format the engine cannot compile (its message names the problem)."""


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # a dependency; a broken install says so plainly
        raise GrammarError("structured outputs (response_format json_object / json_schema) need the xgrammar package, "
                           f"which would not import ({e}): pip install 'deltaserve[structured]'") from e
    return xgrammar


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties", "anyOf", "oneOf", "allOf", "prefixItems")


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of `schema` xgrammar does not enforce (an answer "constrained" by it could fail it), named
    with where it is: `uniqueItems`, `contains` (and min/maxContains), `required` on an object that declares no
    `properties`, a `pattern` bounded by `maxLength`/`minLength` (the pattern's automaton never closes the string).
    None when every keyword is one the grammar holds. Walked without recursion (depth is bounded elsewhere)."""
    stack: list[tuple[Any, str]] = [(schema, "schema")]
    while stack:
        s, where = stack.pop()
        if isinstance(s, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(s))
            continue
        if not isinstance(s, dict):
            continue
        if s.get("uniqueItems") is True:
            return f"'uniqueItems' at {where}"
        for k in ("contains", "minContains", "maxContains"):
            if k in s:
                return f"'{k}' at {where}"
        if s.get("required") and not isinstance(s.get("properties"), dict):
            return f"'required' on an object without 'properties' at {where}"
        if "pattern" in s and ("maxLength" in s or "minLength" in s):
            return f"'pattern' with 'maxLength'/'minLength' at {where}"
        for k in _SUBSCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend((sub, f"{where}.{k}.{name}") for name, sub in s[k].items())
        for k in _SUBSCHEMAS:
            if isinstance(s.get(k), (dict, list)):
                stack.append((s[k], f"{where}.{k}"))
    return None


UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains")


def enforceable(schema: Any) -> Any:
    """`schema` as the grammar is given it: the keywords it does not enforce (`unenforced_keyword`) left out, so that
    what it does enforce compiles and closes (a `pattern` keeps its automaton, its length bound goes; `required`
    without `properties` goes). What was left out is checked on the finished answer (`violation`). A copy: the
    schema itself is what the answer is checked with."""
    if isinstance(schema, list):
        return [enforceable(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in UNENFORCED and (k != "uniqueItems" or v is True):
            continue
        if k in ("maxLength", "minLength") and "pattern" in schema:
            continue
        if k == "required" and not isinstance(schema.get("properties"), dict):
            continue
        if k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: enforceable(sub) for name, sub in v.items()}
        elif k in _SUBSCHEMAS and isinstance(v, (dict, list)):
            out[k] = enforceable(v)
        else:
            out[k] = v
    return out


def violation(value: Any, schema: Any, where: str) -> str | None:
    """Why `value` (a finished answer's JSON) breaks `schema` (None: it does not), for a schema whose keywords the
    grammar could not all enforce; `where` names what was checked ("response_format", "tools[get_weather]")."""
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    except jsonschema.exceptions.SchemaError as e:
        return f"{where}: the schema itself is not valid ({e.message})"[:400]
    if error is None:
        return None
    at = "".join(f"[{p!r}]" for p in error.absolute_path) or "the answer"
    return (f"{where}: {at} breaks the schema's '{error.validator}' ({error.message}); the grammar cannot enforce "
            f"'{error.validator}', so it is checked on the finished answer")[:400]


def normalize(response_format: Any) -> dict | None:
    """The format as {"type": "json_object"} or {"type": "json_schema", "schema": {...}}; None for text / absent.
    A malformed one raises GrammarError."""
    if response_format is None:
        return None
    if isinstance(response_format, str):
        response_format = {"type": response_format}
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None and "schema" in response_format:  # a bare {"type": "json_schema", "schema": {...}}
            spec = response_format
        if not isinstance(spec, dict):
            raise GrammarError("response_format of type json_schema needs a 'json_schema' object")
        schema = spec.get("schema", spec.get("json_schema"))
        if isinstance(schema, bool):
            schema = {} if schema else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema needs a 'schema' object (the JSON schema)")
        try:  # measured before it is walked: a 3 MB schema is refused for its size, not after its walks
            size = len(json.dumps(schema, separators=(",", ":")))
        except RecursionError:
            raise GrammarError(f"response_format: the JSON schema nests objects and arrays more than {MAX_DEPTH} "
                               "levels deep: refused before it is compiled") from None
        except (TypeError, ValueError) as e:
            raise GrammarError(f"response_format: the JSON schema is not JSON ({e})"[:300]) from None
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"response_format: the JSON schema is {size} bytes as compact JSON, over the limit of "
                               f"{MAX_SCHEMA_BYTES}: refused before it is compiled")
        depth = nesting_depth(schema)
        if depth > MAX_DEPTH:  # xgrammar's compile of a schema 900 deep took a minute: refused before it starts
            raise GrammarError(f"response_format: the JSON schema nests objects and arrays more than {MAX_DEPTH} "
                               f"levels deep (at least {depth}): refused before it is compiled")
        return {"type": "json_schema", "schema": schema}
    raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


class CompiledFormat:
    """A compiled response format; `constraint()` starts one generation's matcher."""

    def __init__(self, engine: "GrammarEngine", compiled, description: str):
        self.engine, self.compiled, self.description = engine, compiled, description

    def constraint(self) -> "Constraint":
        return Constraint(self.engine, self.compiled)

    def __repr__(self) -> str:
        return f"CompiledFormat({self.description})"


class Constraint:
    """One generation's matcher: mask the logits, accept the sampled token, say when only a stop is left."""

    def __init__(self, engine: "GrammarEngine", compiled):
        xgr = _xgr()
        self.engine = engine
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, engine.vocab_size)
        self._fresh = False  # the bitmask matches the matcher's state

    def _fill(self) -> torch.Tensor:
        if not self._fresh:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self._fresh = True
        return self.bitmask[0]

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens the grammar allows next (stop tokens when it can end)."""
        words = self._fill().numpy()
        return np.unpackbits(words.view(np.uint8), bitorder="little")[:self.engine.vocab_size].view(bool)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (one row over the vocabulary) as a new 1-D float32 tensor with every disallowed token at -inf.

        On the CPU this is numpy (single-threaded: about 1 ms for 248K logits even on a loaded machine, where
        torch's multithreaded elementwise ops on one row were measured at 8 ms from thread contention)."""
        allowed = self.allowed()
        row = logits.detach().reshape(-1)
        width = row.numel()
        if width != allowed.size:  # logits wider than the vocabulary the engine knows: the rest is refused
            full = np.zeros(width, dtype=bool)
            n = min(width, allowed.size)
            full[:n] = allowed[:n]
            allowed = full
        if row.device.type != "cpu":
            return row.float().masked_fill(~torch.from_numpy(allowed).to(row.device), float("-inf"))
        src = row.numpy() if row.dtype == torch.float32 else row.float().numpy()
        return torch.from_numpy(np.where(allowed, src, np.float32(-np.inf)))

    def accept(self, token: int) -> bool:
        """Advance with the sampled token; False when the grammar refuses it (the mask makes that impossible)."""
        self._fresh = False
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` accepts (drafts accepted to mask the next draft, before the verification)."""
        if tokens > 0:
            self.matcher.rollback(int(tokens))
            self._fresh = False

    def done(self) -> bool:
        """True when the grammar is complete and allows nothing but a stop token: the answer is finished."""
        if not self.matcher.is_completed():
            return False
        allowed = self.allowed().copy()
        allowed[[s for s in self.engine.stop_ids if 0 <= s < allowed.size]] = False
        return not bool(allowed.any())


# A string parameter of the Qwen3.5 call format is raw text up to "\n</parameter>": with nothing else to stop it, a
# model made to call a function it would not call (tool_choice required on "Hello!") wrote "You're welcome!</tool_call>"
# into the value and went on until max_tokens, no call parsed. A top-level string parameter of the grammar may hold
# "<", but not "</": the value ends where the model closes a tag (what the parser cannot read anyway).
NO_CLOSING_TAG = "^([^<]|<[^/])*$"
STRING_RULES = {"pattern", "enum", "const", "format", "maxLength", "minLength"}  # xgrammar keeps one rule a string


def _bounded_text(schema: Any) -> Any:
    """A tool (OpenAI form) or a parameters schema with NO_CLOSING_TAG on each top-level string parameter that has
    no rule of its own (STRING_RULES: a maxLength already bounds it, and xgrammar would drop it beside a pattern);
    the grammar's copy: the parser types arguments by the original."""
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        fn = dict(schema["function"])
        fn["parameters"] = _bounded_text(fn.get("parameters"))
        return {**schema, "function": fn}
    props = schema.get("properties")
    if not isinstance(props, dict):
        return schema
    bounded = {}
    for name, p in props.items():
        if isinstance(p, dict) and p.get("type") == "string" and not STRING_RULES & set(p):
            p = {**p, "pattern": NO_CLOSING_TAG}
        bounded[name] = p
    return {**schema, "properties": bounded}


class GrammarEngine:
    """The grammar engine for one tokenizer (xgrammar's tokenizer info and compiler, built once) and its LRU of
    compiled formats."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_ids: Iterable[int] | None = None,
                 text: bool = False):
        xgr = _xgr()
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self.stop_ids = tuple(sorted(int(s) for s in (tokenizer.stop_ids if stop_ids is None else stop_ids)))
        # control tokens (special added tokens that are not stops) never appear in an answer: empty bytes make them
        # special to xgrammar, which never allows them; the ids past the tokenizer's (padding rows) likewise. Tokens
        # holding a control byte (< 0x20) too: compact JSON has no whitespace but the space, and a raw control
        # character inside a string is not JSON (RFC 8259), yet xgrammar's string rule lets them through
        control = set(tokenizer.special_ids) - set(self.stop_ids)
        stops = set(self.stop_ids)
        vocab = []
        for i in range(min(tokenizer.vocab_size, self.vocab_size)):
            piece = b"" if i in control else tokenizer.token_bytes(i)
            if i not in stops and not text and _CONTROL.search(piece):
                piece = b""
            vocab.append(piece)
        vocab += [b""] * (self.vocab_size - len(vocab))
        self.info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=list(self.stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[str, CompiledFormat] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # how many formats were compiled (not served from the cache)
        self.key = f"{next(_ENGINE_KEYS)}-{self.vocab_size}-{int(text)}"  # this engine in the compile process (never
        # reused: another engine's tokenizer info under an old key would compile for the wrong vocabulary)

    def compile(self, response_format: Any) -> CompiledFormat | None:
        fmt = normalize(response_format)
        if fmt is None:
            return None
        key = json.dumps(fmt, sort_keys=True, separators=(",", ":"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if fmt["type"] == "json_object":  # a fixed grammar of ours: compiled here, never queued behind a client's schema
            schema = '{"type": "object"}'
            compiled = self._run({"op": "schema", "schema": schema, "strict": False},
                                 lambda: self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                                           strict_mode=False),
                                 "response_format: the JSON schema", here_always=True)
            description = "json_object"
        else:
            compiled = self._compile(json.dumps(enforceable(fmt["schema"])), strict=True)
            description = "json_schema"
        out = CompiledFormat(self, compiled, description)
        return self._remember(key, out)

    def compile_tools(self, tools, choice, answer: Any = None) -> CompiledFormat:
        """A tool choice's structural tag compiled (cached): see the module's notes. `answer` (a response_format,
        with tool_choice "auto"): the answer is one or more calls, or JSON in that format, nothing else."""
        from deltaserve.text.toolcalls import normalize_tools

        tools = normalize_tools(tools)
        if choice.name is not None:
            tools = tuple(t for t in tools if t.name == choice.name)
        offered = [_bounded_text({"type": "function", "function": {**t.openai()["function"],
                                                                    "parameters": enforceable(t.parameters)}})
                   for t in tools]
        xgr_choice = ({"type": "function", "function": {"name": choice.name}} if choice.name is not None
                      else choice.mode)
        answer = normalize(answer) if choice.mode == "auto" and choice.name is None else None
        key = json.dumps({"tools": offered, "choice": xgr_choice, "parallel": choice.parallel, "answer": answer},
                         sort_keys=True, separators=(",", ":"))
        if len(key) > 2 * MAX_SCHEMA_BYTES:
            raise GrammarError(f"tools: the functions' parameter schemas are {len(key)} bytes as compact JSON, over "
                               f"the limit of {2 * MAX_SCHEMA_BYTES}: refused before they are compiled")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        xgr = _xgr()
        try:
            if choice.mode == "required" or answer is not None:
                from xgrammar.structural_tag import (JSONSchemaFormat, OrFormat, StructuralTag, TagFormat,
                                                     TagsWithSeparatorFormat)

                # calls and nothing else: xgrammar's own "required" tag lets text run between calls (random
                # weights wandered there until max_tokens), so the calls are its tags, one newline apart
                tags = [TagFormat(begin=f"<tool_call>\n<function={t.name}>\n",
                                  content=JSONSchemaFormat(json_schema=_bounded_text(enforceable(t.parameters)),
                                                           style="qwen_xml",
                                                           max_whitespace_cnt=1),
                                  end="\n</function>\n</tool_call>") for t in tools]
                fmt = tags[0] if choice.name is not None else TagsWithSeparatorFormat(
                    tags=tags, separator="\n", at_least_one=True, stop_after_first=not choice.parallel)
                if answer is not None:  # a call (or several), or the answer as JSON of the format
                    schema = {"type": "object"} if answer["type"] == "json_object" else answer["schema"]
                    fmt = OrFormat(elements=[fmt, JSONSchemaFormat(json_schema=_bounded_text(enforceable(schema)),
                                                                   style="json",
                                                                   max_whitespace_cnt=1)])
                tag = StructuralTag(format=fmt)
            else:  # auto, one call at most: text, then a call or not, then the end
                tag = xgr.get_model_structural_tag("qwen_3_5", tools=offered, tool_choice=xgr_choice,
                                                   reasoning="disabled", parallel_tool_calls=choice.parallel,
                                                   max_whitespace_cnt=1)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own errors
            raise GrammarError(f"tools: the functions' parameter schemas cannot be compiled: {_said(e)}"[:400]) from None
        compiled = self._run({"op": "tag", "tag": tag.model_dump_json()},
                             lambda: self.compiler.compile_structural_tag(tag), "tools: the functions' parameter schemas")
        out = CompiledFormat(self, compiled, f"tools {choice.mode}" + (f" {choice.name}" if choice.name else "")
                             + (f" or {answer['type']}" if answer is not None else ""))
        return self._remember(key, out)

    def _remember(self, key, out: "CompiledFormat") -> "CompiledFormat":
        with self._lock:
            self.compiles += 1
            self._cache[key] = out
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return out

    def _compile(self, schema: str, strict: bool):
        return self._run({"op": "schema", "schema": schema, "strict": strict},
                         lambda: self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict),
                         "response_format: the JSON schema")

    def _run(self, request: dict, here, what: str, here_always: bool = False):
        """One compile: in the compile process where the caller isolates it (`isolated`: bounded in time, stopped
        when its client leaves), else here (`here()`; `here_always`: here in any case, a grammar of ours). Under
        `isolated(..., cache_only=True)` nothing is compiled: NotCached. `what` begins the refusal's message."""
        ctx = getattr(_ISOLATED, "current", None)
        if ctx is not None and ctx.cache_only and not here_always:
            raise NotCached()
        if ctx is None or here_always:
            try:
                return here()
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own errors
                raise GrammarError(f"{what} cannot be compiled: {_said(e)}"[:400]) from None
        from deltaserve.session.compile_worker import Refused, Stopped

        if ctx.stop is not None and ctx.stop():  # its client left before its turn came
            raise CompileStopped(f"{what}: not compiled (the client left)")
        proc = compile_process()
        try:
            text = proc.compile(self.key, self.info.serialize_json, request, ctx.timeout_s, ctx.stop)
        except Refused as e:
            raise GrammarError(f"{what} cannot be compiled: {_said(e)}"[:400]) from None
        except Stopped as e:
            if e.why == "gone":
                raise CompileStopped(f"{what}: its compile was stopped after {e.seconds:.1f} s (the client left)") \
                    from None
            raise GrammarError(f"{what} took over {ctx.timeout_s:g} s to compile and was stopped: make it smaller "
                               "(fewer properties, alternatives or enum values; less nesting)") from None
        except OSError as e:  # the child could not be started or died twice: say so, never hang
            raise GrammarError(f"{what} could not be compiled: the compile process failed ({e})"[:400]) from None
        return _xgr().CompiledGrammar.deserialize_json(text, self.info)


def _said(e: Exception) -> str:
    """xgrammar's message without its source locations."""
    return re.sub(r"\[[0-9:]+\] \S+:\d+: ", "", " ".join(str(e).split())) or type(e).__name__


class CompileStopped(GrammarError):
    """A compile stopped because its client left (nobody reads this message but the log)."""


class NotCached(Exception):
    """Under `isolated(..., cache_only=True)`: the grammar is not compiled yet (the server's fast lane hands it to
    the compile queue)."""


_PROCESS = None  # the compile process, started by the first isolated compile
_PROCESS_LOCK = threading.Lock()
_ISOLATED = threading.local()  # this thread's `isolated` context, if any


def compile_process():
    """The process's one compile child (`compile_worker.CompileProcess`: its counters), made on first use."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            from deltaserve.session.compile_worker import CompileProcess

            _PROCESS = CompileProcess()
            atexit.register(_PROCESS.close)
        return _PROCESS


class isolated:
    """`with isolated(timeout_s, stop):` the compiles this thread makes run in the compile process (the server's),
    each stopped past `timeout_s` seconds (a GrammarError: the request's 400) or once `stop()` is true (its client
    has left: CompileStopped). Outside it, compiles run in the caller's thread (the library's sessions)."""

    def __init__(self, timeout_s: float, stop=None, cache_only: bool = False):
        self.timeout_s, self.stop, self.cache_only = float(timeout_s), stop, cache_only

    def __enter__(self):
        _ISOLATED.current = self

    def __exit__(self, *exc):
        _ISOLATED.current = None


_ENGINES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def engine_for(tokenizer, vocab_size: int | None = None, stop_ids: Iterable[int] | None = None,
               text: bool = False) -> GrammarEngine:
    """The engine of `tokenizer` (for these logits' width and stop ids), built on first use and kept. `text`: the
    vocabulary keeps tokens holding control bytes (newlines: the tool-call format needs them)."""
    key = (int(vocab_size or tokenizer.vocab_size),
           tuple(sorted(int(s) for s in (tokenizer.stop_ids if stop_ids is None else stop_ids))), bool(text))
    with _ENGINES_LOCK:
        per = _ENGINES.setdefault(tokenizer, {})
        engine = per.get(key)
        if engine is None:
            engine = per[key] = GrammarEngine(tokenizer, key[0], key[1], text=key[2])
        return engine


def compile_tools(tokenizer, tools, choice, vocab_size: int | None = None,
                  stop_ids: Iterable[int] | None = None, answer: Any = None) -> CompiledFormat | None:
    """The grammar that enforces a tool choice (a `text.toolcalls.ToolChoice`): None where nothing is enforced
    ("none", or "auto" with parallel calls allowed and no `answer`); `answer` (a response_format, with "auto"):
    calls or JSON of that format. A schema xgrammar cannot compile raises GrammarError."""
    if not tools or choice.mode == "none" or (not choice.enforced and answer is None):
        return None
    return engine_for(tokenizer, vocab_size, stop_ids, text=True).compile_tools(tools, choice, answer)


def compile_format(tokenizer, response_format: Any, vocab_size: int | None = None,
                   stop_ids: Iterable[int] | None = None) -> CompiledFormat | None:
    """`response_format` compiled for `tokenizer` (cached); None when it asks for no constraint."""
    if isinstance(response_format, CompiledFormat):
        return response_format
    if normalize(response_format) is None:
        return None
    return engine_for(tokenizer, vocab_size, stop_ids).compile(response_format)


def bench_mask(tokenizer, response_format: Any, tokens: list[int], vocab_size: int | None = None,
               repeats: int = 3) -> dict:
    """Per-token cost of the constraint stepping through `tokens` (a valid answer): the mask computed and applied
    to a logits row, then the token accepted. Seconds: median and max per token, compile (cached: first call)."""
    import time

    t = time.perf_counter()
    fmt = compile_format(tokenizer, response_format, vocab_size)
    compile_s = time.perf_counter() - t
    logits = torch.randn(fmt.engine.vocab_size)
    per = []
    for _ in range(repeats):
        c = fmt.constraint()
        for tok in tokens:
            t = time.perf_counter()
            c.mask(logits)
            if not c.accept(tok):
                raise GrammarError(f"bench_mask: token {tok} is not allowed by the grammar")
            per.append(time.perf_counter() - t)
    per.sort()
    return {"median_s": per[len(per) // 2], "max_s": per[-1], "compile_s": compile_s, "tokens": len(tokens)}
