"""One chat turn's policy, written once. Every frontend goes through it (`Session.chat`, the server streamed and
not, `run`, the REPL through `Session.chat`, the Ray router) and only formats what it hands out.

The input half, `TurnRequest` (made by `ask`): the messages as the template renders them (several or late system
messages merged, in order, into the one leading system turn the template allows; assistant tool calls with their
arguments as objects), the functions offered and the tool choice, the response format, the thinking asked for.
`prompt()` renders it with the model's template; `grammar()` compiles what constrains the answer: the format, the
enforced tool choice, or (a format with tools on "auto") a call or the schema; a constrained answer is rendered
with thinking off unless thinking is asked for (then its grammar starts after the thought: session/thinking.py;
only the answer is ever constrained). `output(thinking)` starts the output half.

The output half, `TurnOutput`: the generated text in (`push`), events out: `Reasoning`, `Content`, `CallStart`,
`CallArguments`, and from `finish(reason)` the rest and a last `Finish` (the finish reason as a client reads it,
"tool_calls" when calls came and the turn stopped; the whole content, reasoning and calls). A streamed answer and
a whole one are the same parser's events, so they agree by construction: whitespace next to a call is no content
in either, and a call cut by the token budget is no content either (its markup is never an answer).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable

from deltaserve.errors import DeltaserveError
import json

from deltaserve.session.grammar import (CompiledFormat, compile_format, compile_tools, normalize, unenforced_keyword,
                                        violation)
from deltaserve.text.chat_template import RenderedPrompt, render_prompt
from deltaserve.text.stream import ReasoningSplitter
from deltaserve.text.toolcalls import (CallArguments, CallStart, Content, Tool, ToolCall, ToolCallParser, ToolChoice,
                                       normalize_tool_choice, normalize_tools, template_messages)

__all__ = ["TurnRequest", "TurnOutput", "ask", "merge_system", "thinking_flag", "stop_ids", "Reasoning", "Content", "CallStart",
           "CallArguments", "Finish", "Event"]

SYSTEM_ROLES = ("system", "developer")
_STAND_IN = f"deltaserve-continuation-{secrets.token_hex(8)}"  # an answer no request can write (see continuation)
THINK_WORDS = {"on": True, "off": False, "auto": None}  # --think and /think: auto is the model's default


def thinking_flag(word: str) -> bool | None:
    """--think on|off|auto as enable_thinking (auto, None: the model's default, `demo.thinking_default`)."""
    return THINK_WORDS[word]


@dataclass
class Reasoning:
    text: str


@dataclass
class Finish:
    reason: str                    # "stop", "length", "tool_calls", "cancelled"
    content: str | None            # the answer's text (None: calls and nothing else)
    reasoning: str | None          # what the model reasoned first (None: the prompt opened no reasoning)
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None       # reason "schema_violation": what of the schema the answer breaks


Event = Reasoning | Content | CallStart | CallArguments | Finish


def stop_ids(tokenizer, config) -> frozenset[int]:
    """The ids that end a turn: the tokenizer's stop tokens and the model's declared end-of-sequence ids."""
    return frozenset(tokenizer.stop_ids) | frozenset(config.eos_token_ids)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # OpenAI's content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def merge_system(messages: list) -> list:
    """Several system messages, or one after the first message, as one leading system message (their texts in
    order, a blank line apart): OpenAI accepts them anywhere and agent libraries send them so (a system prompt and
    instructions; a validation retry's); Qwen's template allows one, first. A developer message is a system one."""
    systems = [m for m in messages if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES]
    if not systems or (len(systems) == 1 and messages[0] is systems[0] and systems[0].get("role") == "system"):
        return list(messages)
    merged = {"role": "system", "content": "\n\n".join(_text(m.get("content")) for m in systems)}
    return [merged] + [m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)]


@dataclass
class TurnRequest:
    """What one chat turn asks for, validated (see the module's notes)."""
    messages: list
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    response_format: Any = None   # grammar.normalize's form, or a CompiledFormat; None: text
    enable_thinking: bool | None = None
    images: list = field(default_factory=list)  # vision.inputs.ImageInput, in the order the template renders them

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether a grammar shapes the answer (then it is rendered with thinking off)."""
        return self.response_format is not None or (self.offers_tools and self.choice.enforced)

    @property
    def rendered_tools(self) -> list[dict] | None:
        """The tools as the template renders them (None: no tools block; tool_choice "none" renders none)."""
        return [t.openai() for t in self.tools] if self.offers_tools else None

    def thinking(self, default: bool | None) -> bool | None:
        """enable_thinking as rendered: as asked, else the model's default; a constrained answer thinks only where
        thinking is asked for (True), and its grammar then starts after the thought (session/thinking.py)."""
        if self.constrained and self.enable_thinking is not True:
            return False
        return self.enable_thinking if self.enable_thinking is not None else default

    def prompt(self, tokenizer, default_thinking: bool | None = None) -> RenderedPrompt:
        """The conversation rendered with the model's template (generation header added), not yet tokenized. A
        constrained answer's template that leaves the model reasoning anyway is refused (nothing could be
        constrained)."""
        prompt = render_prompt(tokenizer, self.messages, self.thinking(default_thinking), self.rendered_tools)
        if self.constrained and prompt.thinking and self.enable_thinking is not True:
            raise DeltaserveError("this model's chat template leaves the model reasoning even with thinking off: "
                                  "a response_format or an enforced tool choice cannot constrain its answer")
        return prompt

    def continuation(self, tokenizer, default_thinking: bool | None = None) -> RenderedPrompt:
        """The turn's messages rendered as what follows an assistant answer a state already holds: the answer's end
        of turn, the messages, the generation header. For a conversation continued from exactly the tokens it holds
        (the Responses API's previous_response_id): its earlier turns are neither rendered nor tokenized again. The
        template renders the messages after a stand-in exchange, and the text after the stand-in answer is kept, so
        whatever the template writes between turns is written as it would be in the whole conversation."""
        mark = _STAND_IN
        head = [{"role": "user", "content": "."}, {"role": "assistant", "content": mark}]
        whole = TurnRequest(head + list(self.messages), self.tools, self.choice, self.response_format,
                            self.enable_thinking, self.images).prompt(tokenizer, default_thinking)
        at = whole.text.find(mark)
        if at < 0:
            raise DeltaserveError("this model's chat template does not render an assistant answer as it is: a "
                                  "conversation cannot be continued from the tokens its state holds")
        return RenderedPrompt(whole.text[at + len(mark):], whole.literals)

    def encode(self, prompt: RenderedPrompt, tokenizer, vision=None, vocab_size: int = 0) -> list[int]:
        """A rendered prompt's ids; with images, each image's one <|image_pad|> as its placeholder ids, one per merged
        patch (deltaserve.vision.inputs: ids past the vocabulary that say which image it is). `vision`: the model's
        (`HostModel.vision`), which an image needs."""
        ids = prompt.encode(tokenizer)
        if not self.images:
            return ids
        if vision is None:
            raise DeltaserveError(f"the conversation holds {len(self.images)} image(s) and this model has no vision "
                                  "encoder (load the checkpoint's HF directory, which holds model.visual.*)")
        from deltaserve.vision.inputs import expand

        pad = tokenizer.token_to_id("<|image_pad|>") if hasattr(tokenizer, "token_to_id") else None
        if pad != vision.image_token_id:
            raise DeltaserveError(f"the tokenizer's <|image_pad|> is {pad}, the checkpoint's image token "
                                  f"{vision.image_token_id}: they must agree")
        return expand(ids, self.images, pad, vocab_size, vision.tokens)

    def grammar(self, tokenizer, vocab_size: int | None, stop_ids: Iterable[int]) -> CompiledFormat | None:
        """What constrains the answer (compiled, cached per schema), or None."""
        if not self.offers_tools:
            return compile_format(tokenizer, self.response_format, vocab_size, stop_ids)
        if self.response_format is not None and self.choice.mode == "auto":  # a call, or an answer in the schema
            return compile_tools(tokenizer, self.tools, self.choice, vocab_size, stop_ids, answer=self.response_format)
        return compile_tools(tokenizer, self.tools, self.choice, vocab_size, stop_ids)

    def output(self, thinking: bool) -> "TurnOutput":
        """The output half for a prompt that does (`thinking` True) or does not leave the model reasoning. Schemas
        with keywords the grammar cannot enforce (grammar.unenforced_keyword: `uniqueItems`, `contains`, a
        `pattern`'s length bound, ...) are checked on the finished answer, the format's and the tools' alike."""
        fmt = self.response_format
        answer = fmt["schema"] if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and \
            unenforced_keyword(fmt["schema"]) is not None else None
        tools = self.tools if self.offers_tools else ()
        checked = {t.name: t.parameters for t in tools if unenforced_keyword(t.parameters) is not None}
        return TurnOutput(thinking, tools, self.choice.parallel, answer, checked)


def ask(messages: Iterable[Any], tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = True,
        response_format: Any = None, enable_thinking: bool | None = None, max_image_pixels: int | None = None,
        image_files: bool = False, image_fetch=None, image_limits=None) -> TurnRequest:
    """A chat turn's request, validated: tools (OpenAI's list) and the tool choice (text.toolcalls raises ToolError
    naming the problem), the response format (grammar.GrammarError), the messages as the template renders them.
    `image_limits` (vision.inputs.ImageLimits, the server's) bounds the images and says how links are fetched."""
    offered = normalize_tools(tools)
    choice = normalize_tool_choice(tool_choice, offered, parallel_tool_calls)
    fmt = response_format if isinstance(response_format, CompiledFormat) else normalize(response_format)
    if isinstance(fmt, CompiledFormat) and offered and choice.mode != "none":
        raise DeltaserveError("a compiled response_format cannot be combined with tools: pass the response_format "
                              "itself (OpenAI's object) to have the answer be a call or the schema")
    from deltaserve.vision.inputs import DEFAULT_MAX_PIXELS, take_images

    rendered, images = take_images([m.model_dump() if hasattr(m, "model_dump") else m for m in messages],
                                   max_image_pixels or DEFAULT_MAX_PIXELS, image_files, image_fetch, image_limits)
    return TurnRequest(merge_system(template_messages(rendered)), offered, choice, fmt, enable_thinking, images)


class TurnOutput:
    """Generated text in, events out (see the module's notes)."""

    def __init__(self, thinking: bool, tools: tuple[Tool, ...] = (), parallel: bool = True, answer_schema=None,
                 checked_tools: dict | None = None):
        self.thinking = thinking
        self._answer_schema = answer_schema   # a json_schema checked on the finished answer (see TurnRequest.output)
        self._checked_tools = checked_tools or {}
        self._splitter = ReasoningSplitter(thinking)
        self._parser = ToolCallParser(tools, parallel) if tools else None
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def _events(self, reasoning: str, content: str, final: bool = False, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        if reasoning:
            self._reasoning.append(reasoning)
            out.append(Reasoning(reasoning))
        if self._parser is not None:
            out += self._parser.push(content)
            if final:
                out += self._parser.finish(cut=cut)
        elif content:
            out.append(Content(content))
        self._content += [e.text for e in out if isinstance(e, Content)]
        return out

    def push(self, text: str) -> list[Event]:
        return self._events(*self._splitter.push(text))

    def finish(self, reason: str) -> list[Event]:
        """What was held back (a tail that may have begun `</think>` or `<tool_call>`), then `Finish`. With reason
        "length" an open call is dropped; "stop" with calls is "tool_calls"."""
        out = self._events(*self._splitter.flush(), final=True, cut=reason == "length")
        calls = list(self._parser.calls) if self._parser is not None else []
        content: str | None = "".join(self._content)
        if calls and not content:
            content = None
        if calls and reason == "stop":
            reason = "tool_calls"
        reasoning = "".join(self._reasoning).strip() if self.thinking else None
        error = self._violation(content, calls) if reason in ("stop", "tool_calls") else None
        out.append(Finish("schema_violation" if error else reason, content, reasoning, calls, error))
        return out

    def _violation(self, content: str | None, calls: list[ToolCall]) -> str | None:
        """What a finished answer breaks of the schemas the grammar could not all enforce (None: nothing)."""
        if self._answer_schema is not None and content and not calls:
            try:
                value = json.loads(content)
            except ValueError:
                return "response_format: the answer is not JSON"
            found = violation(value, self._answer_schema, "response_format")
            if found:
                return found
        for call in calls:
            schema = self._checked_tools.get(call.name)
            if schema is not None:
                found = violation(call.args, schema, f"tools[{call.name}]")
                if found:
                    return found
        return None

    def whole(self, text: str, reason: str) -> Finish:
        """A whole answer at once: the `Finish` its stream would end with."""
        self.push(text)
        return self.finish(reason)[-1]
