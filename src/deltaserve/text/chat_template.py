"""A conversation rendered with the model's chat template: the one place prompts are built from messages.

What a message contains is text. A client that writes `<|im_end|>\\n<|im_start|>system\\n...` into its content
must not forge a turn: only the template's own markup becomes control tokens. Before the template runs, every
occurrence of a special token's text in the messages' strings is replaced by a placeholder (a private-use
character that occurs nowhere in the conversation); the template's manipulations of content (strip, split at
`</think>`) are blind to it; the rendered prompt is then encoded piece by piece: the template's special tokens
as themselves, the text between them with each placeholder turned back into its text and encoded as text
(`Tokenizer.encode_literal`). A conversation without such text encodes exactly as before (one `encode`).
transformers and llama.cpp render and encode in one pass, so there a message's content can forge turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.text.stream import opens_reasoning
from deltaserve.text.tokenizer import ConversationRejected

_PUA_BASES = (0xF0000, 0x100000)  # the two supplementary private-use planes


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered conversation: `text` holds placeholders where message contents wrote special tokens' text;
    `literals` maps each placeholder to that text. `display` is the prompt as a person reads it."""

    text: str
    literals: dict[str, str] = field(default_factory=dict)

    @property
    def display(self) -> str:
        text = self.text
        for mark, literal in self.literals.items():
            text = text.replace(mark, literal)
        return text

    def encode(self, tokenizer) -> list[int]:
        return tokenizer.encode_literal(self.text, self.literals)

    @property
    def thinking(self) -> bool:
        """Whether the prompt leaves the model inside a reasoning block."""
        return opens_reasoning(self.text)


def _strings(value: Any, out: list[str]) -> None:
    """Every string of `value`, the keys of its mappings too (a call's argument names and a tool schema's property
    names render as text: `<parameter=KEY>`, `tojson`)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                out.append(k)
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)


def _replace(value: Any, table: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for literal, mark in table:
            if literal in value:
                value = value.replace(literal, mark)
        return value
    if isinstance(value, dict):
        return {_replace(k, table): (v if k == "role" else _replace(v, table)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace(v, table) for v in value]
    if hasattr(value, "model_dump"):  # pydantic messages (the OpenAI SDK's)
        return _replace(value.model_dump(), table)
    return value


def render_prompt(tokenizer, messages, enable_thinking: bool | None = None, tools=None) -> RenderedPrompt:
    """`messages` rendered with the generation header added (`enable_thinking` None: the template's default),
    special-token text in their strings held apart as literals. `tools`: the functions offered (OpenAI's list of
    {"type": "function", "function": {...}}), rendered by the template; assistant messages' `tool_calls` need
    their arguments as objects (`toolcalls.arguments_object`)."""
    messages = [m.model_dump() if hasattr(m, "model_dump") else m for m in messages]
    extra = {"tools": list(tools)} if tools else {}
    found: list[str] = []
    _strings(messages, found)
    _strings(extra, found)
    specials = [s for s in tokenizer.special_texts if any(s in text for text in found)]
    if not specials:
        return RenderedPrompt(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            enable_thinking=enable_thinking, **extra))
    used = {ch for text in found for ch in text if ord(ch) >= _PUA_BASES[0]}
    marks: list[str] = []
    for base in _PUA_BASES:  # placeholders that occur nowhere in the conversation
        c = base
        while len(marks) < len(specials) and c < base + 0xFFFE:
            if chr(c) not in used:
                marks.append(chr(c))
            c += 1
    if len(marks) < len(specials):  # both private-use planes filled by the conversation itself: nothing is free
        raise ConversationRejected(
            f"the conversation writes {len(specials)} special tokens' text and uses every private-use character but "
            f"{len(marks)}, so that text cannot be held apart from the template's own markup: refused (nothing of "
            f"it would be encoded as text)")
    table = sorted(zip(specials, marks), key=lambda p: -len(p[0]))  # the longest special text first
    text = tokenizer.apply_chat_template(_replace(messages, table), add_generation_prompt=True,
                                         enable_thinking=enable_thinking, **_replace(extra, table))
    return RenderedPrompt(text, {mark: literal for literal, mark in table})


def render_text(tokenizer, messages, enable_thinking: bool | None = None, tools=None) -> str:
    """The prompt text of `messages` with the generation header added, as a person reads it."""
    return render_prompt(tokenizer, messages, enable_thinking, tools).display


def render(tokenizer, messages, enable_thinking: bool | None = None, tools=None) -> tuple[list[int], bool]:
    """The prompt ids of `messages` with the generation header added (message contents encoded as text), and
    whether the prompt leaves the model inside a reasoning block."""
    p = render_prompt(tokenizer, messages, enable_thinking, tools)
    return p.encode(tokenizer), p.thinking
