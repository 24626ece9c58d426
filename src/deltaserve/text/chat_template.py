"""A conversation rendered with the model's chat template: the one place prompts are built from messages.

What a message contains is text. A client that writes `<|im_end|>\\n<|im_start|>system\\n...` into its content
must not forge a turn, nor a reasoning block, a tool call or a tool response by writing `<think>`, `<tool_call>` or
`<tool_response>`: only the template's own markup becomes the template's tokens. Every added token is protected
(`Tokenizer.protected_texts`: the special ones and the `<think>`, `<tool_call>`, `<tool_response>`, FIM and repo
families), in every string of the conversation (contents, names, arguments and their keys, tools, schemas).

Before the template runs, every occurrence of a protected token's text in the messages' strings is replaced by a
placeholder (a private-use character that occurs nowhere in the conversation); so is a string's end that is the
start of one (a function name ending in `<|im_end|`, which the template's `>` after it would complete) and a
string's start that is the end of one: what the template writes around a string never joins it into a token. The
template's manipulations of content (strip, split at `</think>`) are blind to the placeholders; the rendered prompt
is then encoded piece by piece: the template's added tokens as themselves, the text between them with each
placeholder turned back into its text and encoded as text (`Tokenizer.encode_literal`). A conversation without such
text encodes exactly as before (one `encode`). transformers and llama.cpp render and encode in one pass, so there a
message's content can forge turns.
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


class _Edges:
    """The proper prefixes and suffixes of the protected texts: a string that ends with the one or begins with the
    other could be joined into a protected token by the template's text around it."""

    def __init__(self, texts: tuple[str, ...]):
        self.heads = {t[:k] for t in texts for k in range(1, len(t))}
        self.tails = {t[k:] for t in texts for k in range(1, len(t))}
        self.longest = max((len(t) for t in texts), default=1)

    def of(self, text: str) -> tuple[str, str]:
        """(the longest start of `text`, whitespace aside, that ends a protected text; the longest end that begins
        one); '' where there is none."""
        body = text.strip()
        head = next((body[:k] for k in range(min(self.longest, len(body)), 0, -1) if body[:k] in self.tails), "")
        rest = body[len(head):]
        tail = next((rest[-k:] for k in range(min(self.longest, len(rest)), 0, -1) if rest[-k:] in self.heads), "")
        return head, tail


def _guard(text: str, table: list[tuple[str, str]], marks: dict[str, str], edges: _Edges) -> str:
    """`text` with each protected text in it, and a start or end that could join one, as placeholders."""
    for literal, mark in table:
        if literal in text:
            text = text.replace(literal, mark)
    head, tail = edges.of(text)
    if head or tail:
        lead = len(text) - len(text.lstrip())
        end = len(text.rstrip())
        body = text[lead:end]
        if head:
            body = marks[head] + body[len(head):]
        if tail:
            body = body[:len(body) - len(tail)] + marks[tail]
        text = text[:lead] + body + text[end:]
    return text


def _replace(value: Any, guard) -> Any:
    if isinstance(value, str):
        return guard(value)
    if isinstance(value, dict):
        return {_replace(k, guard): (v if k == "role" else _replace(v, guard)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace(v, guard) for v in value]
    if hasattr(value, "model_dump"):  # pydantic messages (the OpenAI SDK's)
        return _replace(value.model_dump(), guard)
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
    protected = getattr(tokenizer, "protected_texts", None) or tokenizer.special_texts
    specials = [s for s in protected if any(s in text for text in found)]
    edges = _edges_of(tokenizer, protected)
    pieces: set[str] = set()  # the starts and ends that could join a protected text
    for text in found:
        cut = text
        for s in specials:
            if s in cut:
                cut = cut.replace(s, "\x00")
        head, tail = edges.of(cut)
        pieces.update(p for p in (head, tail) if p)
    if not specials and not pieces:
        return RenderedPrompt(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            enable_thinking=enable_thinking, **extra))
    wanted = specials + sorted(pieces - set(specials), key=lambda t: (-len(t), t))
    used = {ch for text in found for ch in text if ord(ch) >= _PUA_BASES[0]}
    marks: list[str] = []
    for base in _PUA_BASES:  # placeholders that occur nowhere in the conversation
        c = base
        while len(marks) < len(wanted) and c < base + 0xFFFE:
            if chr(c) not in used:
                marks.append(chr(c))
            c += 1
    if len(marks) < len(wanted):  # both private-use planes filled by the conversation itself: nothing is free
        raise ConversationRejected(
            f"the conversation writes {len(wanted)} pieces of the template's tokens' text and uses every private-use "
            f"character but {len(marks)}, so that text cannot be held apart from the template's own markup: refused "
            f"(nothing of it would be encoded as text)")
    mark_of = dict(zip(wanted, marks))
    table = sorted(((s, mark_of[s]) for s in specials), key=lambda p: -len(p[0]))  # the longest text first

    def guard(text: str) -> str:
        return _guard(text, table, mark_of, edges)

    text = tokenizer.apply_chat_template(_replace(messages, guard), add_generation_prompt=True,
                                         enable_thinking=enable_thinking, **_replace(extra, guard))
    return RenderedPrompt(text, {mark: literal for literal, mark in mark_of.items()})


_EDGES: dict[tuple[str, ...], _Edges] = {}


def _edges_of(tokenizer, protected: tuple[str, ...]) -> _Edges:
    edges = _EDGES.get(protected)
    if edges is None:
        edges = _EDGES[protected] = _Edges(protected)
    return edges


def render_text(tokenizer, messages, enable_thinking: bool | None = None, tools=None) -> str:
    """The prompt text of `messages` with the generation header added, as a person reads it."""
    return render_prompt(tokenizer, messages, enable_thinking, tools).display


def render(tokenizer, messages, enable_thinking: bool | None = None, tools=None) -> tuple[list[int], bool]:
    """The prompt ids of `messages` with the generation header added (message contents encoded as text), and
    whether the prompt leaves the model inside a reasoning block."""
    p = render_prompt(tokenizer, messages, enable_thinking, tools)
    return p.encode(tokenizer), p.thinking
