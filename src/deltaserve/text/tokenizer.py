"""The Qwen3.5 tokenizer: byte-level BPE on the `tokenizers` library, plus the chat template.

One `Tokenizer` is built from either source a model can come in:

* a GGUF file's metadata (`Tokenizer.from_gguf_fields`): `tokenizer.ggml.tokens` are GPT-2
  "unicode-mapped" byte strings, `tokenizer.ggml.merges` are `"left right"` strings and
  `tokenizer.ggml.token_type` says which ids are control tokens (special added tokens), user-defined
  tokens (non-special added tokens) or padding (unused rows of the embedding);
* a Hugging Face directory (`Tokenizer.from_hf_dir`): `tokenizer.json` as is, with the chat template,
  eos/pad/bos from `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json`.

Both end in the same `tokenizers.Tokenizer` pipeline, the one Qwen3.5 ships: NFC normalisation,
the qwen35 split regex (isolated), byte-level mapping without prefix space, a BPE model without unk,
and the added tokens matched verbatim in the input (HF behaviour: special tokens written in the
text are recognised, whatever their `special` flag). The BPE looks a whole pre-token up in the
vocabulary before merging (`ignore_merges`), as tiktoken, Qwen's reference tokenizer, does: 83 of
the 248,044 Qwen3.5 ranks (e.g. "加拿大") cannot be made by merging two smaller tokens.

Decoding does not go through `tokenizers`: every id has a byte string (`token_bytes`: the raw bytes
of a BPE token, the UTF-8 text of an added token, nothing for a padding id) and a decode is the
concatenation of those bytes read as UTF-8 with U+FFFD for broken sequences. That keeps `decode`,
`token_bytes` and the streaming `StreamDecoder` one definition; for the Qwen vocabulary (ASCII added
tokens) it equals the `tokenizers`/transformers decode, which the tests check.

The chat template is untrusted input (it comes inside the model file): it is rendered in a jinja2
`ImmutableSandboxedEnvironment`, the way transformers renders it, and the output matches
transformers' `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import codecs
import json
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from deltaserve.errors import DeltaserveError, ModelFormatError
from deltaserve.text import bpe as native_bpe

_LITERAL_LOCK = threading.Lock()

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = [
    "QWEN35_PRETOKENIZE_REGEX",
    "QWEN2_PRETOKENIZE_REGEX",
    "PRE_TOKENIZER_REGEXES",
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTemplateError",
    "ConversationRejected",
    "Tokenizer",
    "StreamDecoder",
    "bytes_to_unicode",
]

# The split regexes. qwen35 differs from qwen2 by keeping combining marks (\p{M}) inside words, so
# that "e" + U+0301 that NFC cannot compose stays one pre-token.
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# `tokenizer.ggml.pre` value -> split regex. A GGUF without `tokenizer.ggml.pre` is read as qwen35:
# deltaserve serves only the qwen35 architecture, whose vocabulary was trained with (and whose merges
# only reproduce the model's tokenisation under) the qwen35 split; llama.cpp's fallback for a missing
# `pre` (the GPT-2 regex) would silently tokenise differently from the model's training.
PRE_TOKENIZER_REGEXES: dict[str, str] = {
    "qwen35": QWEN35_PRETOKENIZE_REGEX,
    "qwen2": QWEN2_PRETOKENIZE_REGEX,
}
DEFAULT_PRE = "qwen35"

# GGUF token types (gguf.TokenType), spelled here so that reading a model does not need `gguf`.
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Used when a model carries no template: ChatML, as Qwen writes it, thinking off as an empty block.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set text = namespace(value='') %}"
    "{%- if message.content is string %}"
    "{%- set text.value = message.content %}"
    "{%- elif message.content is iterable and message.content is not mapping %}"
    "{%- for part in message.content %}"
    "{%- if part is mapping and part.text is string %}{%- set text.value = text.value ~ part.text %}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ text.value ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


class ChatTemplateError(ModelFormatError):
    """The model's chat template is malformed, or tried something the sandbox forbids, or failed to render."""


class ConversationRejected(DeltaserveError, ValueError):
    """The chat template refused the conversation itself (it called `raise_exception(message)`).

    This is the caller's input, not the model file, at fault (e.g. "System message must be at the
    beginning."), so it is a `ValueError` a server turns into a 400, with the template's message.
    """


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 (other than space and the soft hyphen) stand for themselves;
    the other 68 bytes are given the characters from U+0100 upward, in byte order.
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _unmap(token: str) -> bytes:
    """The raw bytes behind a byte-level token string (a character outside the table stands for its UTF-8)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in token)


def _longest_bytes(tokens: Sequence[str], skip: frozenset[int] = frozenset()) -> int:
    """The most raw bytes any of these byte-level token strings stands for (what `_unmap` gives), without unmapping
    them all (0.17 s for 248,320 tokens): a token of c characters stands for c to 4c bytes (a mapped character is
    one byte, any other its UTF-8), so only the tokens long enough to beat the longest one's bytes are unmapped
    (~10 ms)."""
    if not tokens:
        return 0
    chars = np.fromiter(map(len, tokens), np.int64, len(tokens))
    if skip:
        chars[list(skip)] = 0
    best = len(_unmap(tokens[int(chars.argmax())]))
    for i in np.flatnonzero(chars * 4 > best).tolist():
        best = max(best, len(_unmap(tokens[i])))
    return best


def _merge_pairs(merges: Sequence[Any]) -> list[tuple[str, str]] | None:
    """GGUF merges ("left right" strings) as the (left, right) pairs tokenizers takes, None if one is not two
    non-empty tokens around one space. One join and one split for all of them (a per-merge Python loop took
    0.14 s for Qwen's 247,587)."""
    if not set(map(type, merges)) <= {str}:
        return None
    joined = "\n".join(merges)
    if joined.count("\n") != len(merges) - 1 or joined.count(" ") != len(merges):
        return None
    parts = joined.replace("\n", " ").split(" ")
    if "" in parts:
        return None
    return list(zip(parts[::2], parts[1::2]))


def _qwen_pipeline(backend: _Backend, regex: str) -> None:
    """Install the Qwen3.5 normaliser, pre-tokeniser and decoder on a backend tokenizer."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()


def _pre_of(backend: _Backend) -> str | None:
    """Which known split regex a backend's pre-tokeniser uses (None: not one deltaserve can name)."""
    try:
        state = json.loads(backend.pre_tokenizer.__getstate__())
    except Exception:  # no pre-tokenizer, or one without a state
        return None
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "Split" and isinstance(node.get("pattern"), dict):
                pattern = node["pattern"].get("Regex")
                if isinstance(pattern, str):
                    found.append(pattern)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(state)
    if state.get("type") == "ByteLevel" or '"use_regex": true' in json.dumps(state):
        return None  # a byte-level step that splits again is not the Qwen layout
    for name, regex in PRE_TOKENIZER_REGEXES.items():
        if found == [regex]:
            return name
    return None


def _plain(value: Any) -> Any:
    """Rebuild what a template sees from plain JSON-like types; anything else becomes an inert '<Type>' string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic):  # np.bool_(False) must stay falsy
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    dump = getattr(value, "model_dump", None)  # pydantic messages (e.g. the OpenAI SDK's)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """Messages as templates expect them: plain dicts, None-valued keys dropped, reasoning under its usual names.

    As transformers does: a key set to None (OpenAI's `content=None`, `tool_calls=None`) is removed,
    because templates handle a missing key but often render a literal None; reasoning given as
    `thinking` or `reasoning` is also offered as `reasoning_content` (and `thinking`).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ConversationRejected(f"a chat message must be a mapping with 'role' and 'content', found {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` that refuses underscore-prefixed names (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


class _TemplateDict:
    """`dict` for templates: builds plain dicts, without handing the `dict` type itself to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _TemplateRaised(Exception):
    """Carries a template's `raise_exception(message)` out of jinja2 untouched."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Not jinja2's own tojson, which HTML-escapes: chat templates expect plain JSON, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template: expected valid Jinja, found a syntax error at line {e.lineno}: {e.message}"
        ) from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: expected valid Jinja, found {type(e).__name__}: {e}") from None


class TextError(DeltaserveError, ValueError):
    """Text that cannot be tokenized as given (not valid Unicode)."""


def _check_unicode(text: str) -> None:
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise TextError(f"the text holds a lone surrogate (U+{ord(ch):04X} at character {i}): it is not valid "
                            "Unicode; send the character itself or its surrogate pair")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def bpe_model(vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None,
              ignore_merges: bool = False) -> models.BPE:
    """A byte-level BPE model the Qwen way: no unknown token, no prefixes or suffixes, no byte fallback."""
    kwargs = dict(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                  fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    if vocab is None:
        return models.BPE(**kwargs)
    return models.BPE(vocab=vocab, merges=merges or [], **kwargs)


GIL_FREE_CHARS = 1 << 15  # texts at least this long are encoded with the GIL released


def _encode(backend: _Backend, text: str) -> list[int]:
    """`backend.encode(text)`'s ids. tokenizers' `encode` holds the GIL for the whole text (8.7 s for 4 MB here: every
    other thread of the process, a server's event loop and its decode steps included, stops meanwhile); its
    `encode_batch` releases it, so a long text goes through that (same ids)."""
    if len(text) < GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=False).ids
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


_PRE_TOKEN = "\u0000deltaserve-pre-token"  # the skeleton's one word: a pre-token that bpe.c encodes


def _encoding(backend: _Backend, text: str) -> Any:
    """`backend.encode(text)`, through `encode_batch` (the GIL released) for a long text, as `_encode`."""
    if len(text) < GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=False)
    return backend.encode_batch([text], add_special_tokens=False)[0]


class _Compact:
    """A GGUF vocabulary's encode on bpe.c (text/bpe.py says why): `tokenizers` finds the added tokens and cuts
    the rest into pre-tokens (a `skeleton`: the same split, the same added tokens, a one-word model whose offsets
    say where each pre-token lies), bpe.c merges every pre-token in one call."""

    def __init__(self, bpe: "native_bpe.NativeBPE", added: list[tuple[int, str, bool]], regex: str,
                 ignore_merges: bool) -> None:
        self.bpe, self.added, self.ignore_merges = bpe, added, ignore_merges
        self.skeleton = self._skeleton(regex, added, literal=False)
        self.literal = self._skeleton(regex, added, literal=True)
        self.real = np.full(len(added) + 1, -1, np.int32)  # skeleton id -> the added token's id (0: a pre-token)
        for i, content, _ in added:
            self.real[self.skeleton.token_to_id(content)] = i
        self.by_text = {content: i for i, content, _ in added}

    @staticmethod
    def _skeleton(regex: str, added: list[tuple[int, str, bool]], literal: bool) -> _Backend:
        sk = _Backend(models.WordLevel({_PRE_TOKEN: 0}, unk_token=_PRE_TOKEN))
        sk.pre_tokenizer = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        # literal: every added token is text (its own object: the flag is per tokenizer); `encode_special_tokens`
        # covers the special ones only, so there each is added as special (<think> and <tool_call> are not)
        sk.add_tokens([AddedToken(content, special=special or literal, normalized=False)
                       for _, content, special in added])
        sk.encode_special_tokens = literal
        return sk

    def encode(self, text: str, literal: bool = False) -> list[int]:
        sk = self.literal if literal else self.skeleton
        enc = _encoding(sk, text)
        if unicodedata.is_normalized("NFC", text):
            given = self.real[np.asarray(enc.ids, np.int64)]
            return self.bpe.encode(text, given, np.asarray(enc.offsets, np.int64).reshape(-1, 2), self.ignore_merges)
        # Not NFC: as tokenizers does, the added tokens are found in the text as written and the text between
        # them is normalised on its own (normalising the whole could join an added token's last character to
        # a combining mark after it: ">" + U+0338 is "≯")
        out: list[int] = []
        at = 0
        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid:
                out += self._between(text[at:a])
                out.append(int(self.real[tid]))
                at = b
        return out + self._between(text[at:])

    def _between(self, text: str) -> list[int]:
        if not text:
            return []
        text = unicodedata.normalize("NFC", text)
        pieces = self.skeleton.pre_tokenizer.pre_tokenize_str(text)
        spans = np.asarray([span for _, span in pieces], np.int64).reshape(-1, 2)
        return self.bpe.encode(text, np.full(len(pieces), -1, np.int32), spans, self.ignore_merges)

    def token(self, i: int) -> str | None:
        raw = self.bpe.token(i)
        return None if raw is None else raw.decode("utf-8", errors="replace")

    def backend(self, regex: str, unused: frozenset[int]) -> _Backend:
        """The whole `tokenizers` backend this vocabulary makes (for what only it does: parity tests, export)."""
        tokens = [self.token(i) for i in range(self.bpe.n)]
        vocab = {t: i for i, t in enumerate(tokens) if i not in unused}
        for i in unused:
            vocab[f"\u0000deltaserve-unused-{i}"] = i
        backend = _Backend(bpe_model(vocab, [(tokens[a], tokens[b]) for a, b in self.bpe.merges()],
                                     self.ignore_merges))
        _qwen_pipeline(backend, regex)
        backend.add_tokens([AddedToken(content, special=special, normalized=False) for _, content, special in self.added])
        return backend


class Tokenizer:
    """A Qwen3.5-style byte-level BPE tokenizer with its chat template.

    Attributes:
        vocab_size: number of token ids the tokenizer knows, specials included, trailing padding
            rows of the embedding excluded (one more than the largest real id).
        eos_id, pad_id, bos_id: as the model declares them (None when it does not).
        im_start_id, im_end_id, think_start_id, think_end_id, endoftext_id: ids of those markers
            (None if absent).
        stop_ids: ids that end a generation: eos, `<|im_end|>`, `<|endoftext|>` when present, plus
            any the model lists besides (generation_config.json eos ids, GGUF eot id).
        special_ids: ids of the added tokens marked special (skipped by `decode(skip_special=True)`).
        added_ids: ids of all added tokens, special or not (e.g. `<think>` is added but not special).
        pre: the split-regex name ("qwen35", "qwen2"), None for a tokenizer.json with another split.
        chat_template: the model's Jinja template, None when it has none (the built-in ChatML is used).

    The constructor wraps a ready `tokenizers.Tokenizer` (byte-level BPE); `unused_ids` are padding
    ids inside its id range, which decode to nothing. A malformed template raises here (eagerly:
    a model whose template cannot compile is refused at load, not at its first chat).
    """

    def __init__(
        self,
        backend: _Backend | None,
        *,
        chat_template: str | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        bos_id: int | None = None,
        extra_stop_ids: Iterable[int] = (),
        unused_ids: Iterable[int] = (),
        pre: str | None = DEFAULT_PRE,
        vocab_size: int | None = None,
        longest: int | None = None,
        compact: _Compact | None = None,
    ) -> None:
        if (backend is None) == (compact is None):
            raise ValueError("a Tokenizer wraps either a tokenizers backend or a compact one")
        self._backend = backend
        self._compact = compact  # a GGUF vocabulary on bpe.c (then the backend is built only if asked for)
        self.pre = pre
        self._unused = frozenset(unused_ids)
        if compact is not None:
            self._added: dict[int, str] = {i: content for i, content, _ in compact.added}
            self.special_ids: frozenset[int] = frozenset(i for i, _, special in compact.added if special)
        else:
            added = backend.get_added_tokens_decoder()
            self._added = {i: t.content for i, t in added.items()}
            self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.added_ids: frozenset[int] = frozenset(self._added)
        if vocab_size is None:  # the builder did not say: ask the backend (0.2 s for 248,320 tokens)
            known = [i for i in self.backend.get_vocab(with_added_tokens=True).values() if i not in self._unused]
            vocab_size = (max(known) + 1) if known else 0
        self.vocab_size: int = vocab_size
        self._bytes: list[bytes] | None = None  # every id's bytes, built on first need of all of them
        self._pieces: dict[int, bytes] = {}  # the ids decoded so far, until then
        self._longest: int | None = longest  # bytes of the longest token (fewest_tokens)
        self._special_texts: tuple[str, ...] | None = None
        self._protected: tuple[str, ...] | None = None
        self._specials_re: re.Pattern | None = None
        self._literal: _Backend | None = None

        def find(content: str) -> int | None:
            i = self.token_to_id(content)
            return i if i is not None and i in self._added else None

        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.im_start_id = find("<|im_start|>")
        self.im_end_id = find("<|im_end|>")
        self.think_start_id = find("<think>")
        self.think_end_id = find("</think>")
        self.endoftext_id = find("<|endoftext|>")
        for name, value in (("eos", eos_id), ("pad", pad_id), ("bos", bos_id)):
            if value is not None and not (0 <= value < self.vocab_size):
                raise ModelFormatError(
                    f"tokenizer: expected a {name} token id below the vocabulary size {self.vocab_size}, found {value}"
                )
        stops = {i for i in (eos_id, self.im_end_id, self.endoftext_id) if i is not None}
        for i in extra_stop_ids:
            if not 0 <= int(i) < self.vocab_size:
                raise ModelFormatError(
                    f"tokenizer: expected stop token ids below the vocabulary size {self.vocab_size}, found {i}"
                )
            stops.add(int(i))
        self.stop_ids: frozenset[int] = frozenset(stops)
        self.chat_template = chat_template
        self._template = _compile_template(chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE)

    # ------------------------------------------------------------------ encode / decode

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (for parity tests and export): a compact tokenizer builds it on
        first use (~0.5 s and 66 MiB for Qwen's vocabulary; nothing of deltaserve's own encodes through it)."""
        with _LITERAL_LOCK:
            if self._backend is None:
                assert self._compact is not None
                self._backend = self._compact.backend(PRE_TOKENIZER_REGEXES[self.pre or DEFAULT_PRE], self._unused)
        return self._backend

    @property
    def compact(self) -> bool:
        """Whether encode runs on bpe.c's compact BPE (a GGUF vocabulary where bpe.c builds; text/bpe.py)."""
        return self._compact is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: NFC-normalised, added tokens written in the text recognised, no BOS added.
        Text that is not Unicode (a lone surrogate, as JSON's "\\ud800" can carry) is refused by name."""
        try:
            if self._compact is not None:
                return self._compact.encode(text)
            return _encode(self._backend, text)
        except (TypeError, UnicodeEncodeError):
            _check_unicode(text)
            raise

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The texts of the added tokens marked special (`<|im_end|>`; not `<think>`), the longest first."""
        if self._special_texts is None:
            self._special_texts = tuple(sorted({self._added[i] for i in self.special_ids if i in self._added},
                                               key=lambda t: (-len(t), t)))
        return self._special_texts

    @property
    def protected_texts(self) -> tuple[str, ...]:
        """The texts of every added token, the longest first: the chat template's structure (`<|im_end|>`, and the
        non-special `<think>`, `<tool_call>`, `<tool_response>`, FIM and repo tokens too), which a client's text
        never becomes (chat_template.py)."""
        if self._protected is None:
            self._protected = tuple(sorted(set(self._added.values()), key=lambda t: (-len(t), t)))
        return self._protected

    def encode_literal(self, text: str, literals: Mapping[str, str]) -> list[int]:
        """Token ids of `text` in which each placeholder character of `literals` stands for text that is encoded
        as text, never as an added token (chat_template.py: what a message contains cannot forge the template's
        structure). The added tokens written in `text` itself (the template's) are recognised as `encode` does; a
        stretch between them that holds a placeholder is encoded with no added token at all (what the client wrote
        there cannot join the template's text around it into one), the others as `encode` would."""
        if not literals or not any(mark in text for mark in literals):
            return self.encode(text)
        _check_unicode(text)
        if self._specials_re is None:
            self._specials_re = re.compile("|".join(re.escape(t) for t in self.protected_texts))
        ids: list[int] = []
        pos = 0

        def segment(piece: str) -> None:
            if not piece:
                return
            if not any(mark in piece for mark in literals):
                ids.extend(self.encode(piece))
                return
            for mark, literal in literals.items():
                piece = piece.replace(mark, literal)
            if self._compact is not None:
                ids.extend(self._compact.encode(piece, literal=True))
            else:
                ids.extend(_encode(self._literal_backend(), piece))

        for m in self._specials_re.finditer(text):
            segment(text[pos:m.start()])
            ids.append(self.token_to_id(m.group()))
            pos = m.end()
        segment(text[pos:])
        return ids

    def _literal_backend(self) -> _Backend:
        """A copy of the backend that encodes every added token's text as text (its own object: the flag is not
        thread-safe to flip on the shared one). `encode_special_tokens` covers special tokens alone, so in the copy
        every added token is special."""
        with _LITERAL_LOCK:
            if self._literal is None:
                spec = json.loads(self._backend.to_str())
                for entry in spec.get("added_tokens") or []:
                    entry["special"] = True
                copy = _Backend.from_str(json.dumps(spec))
                copy.encode_special_tokens = True
                self._literal = copy
        return self._literal

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._compact is not None:
            return [self.encode(t) for t in texts]
        try:
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        except TypeError:
            for t in texts:
                _check_unicode(t)
            raise

    def _table(self) -> list[bytes]:
        """Every id's bytes (0.4 s and ~15 MiB for 248,320 tokens: built only where all are needed, e.g. a
        grammar's token table; a decode looks its ids up one by one, `_piece`)."""
        if self._bytes is None:
            table = [b""] * self.vocab_size
            if self._compact is not None:
                blob, at = self._compact.bpe.pieces()
                for i, (a, b) in enumerate(zip(at[:self.vocab_size].tolist(), at[1:self.vocab_size + 1].tolist())):
                    if i not in self._unused:
                        table[i] = blob[a:b]
            else:
                for token, i in self._backend.get_vocab(True).items():
                    if i < self.vocab_size and i not in self._unused:
                        table[i] = _unmap(token)
            for i, content in self._added.items():
                if i < self.vocab_size:
                    table[i] = content.encode("utf-8")
            self._bytes = table
            self._pieces = {}
        return self._bytes

    def _piece(self, i: int) -> bytes:
        """Token i's bytes (b"" outside the vocabulary or for padding), from the table where it is built, else
        looked up once and kept."""
        if self._bytes is not None:
            return self._bytes[i] if 0 <= i < self.vocab_size else b""
        piece = self._pieces.get(i)
        if piece is None:
            if not 0 <= i < self.vocab_size or i in self._unused:
                return b""
            added = self._added.get(i)
            token = self.id_to_token(i) if added is None else None
            piece = added.encode("utf-8") if added is not None else (b"" if token is None else _unmap(token))
            self._pieces[i] = piece
        return piece

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) found without encoding: no token stands for more bytes than the
        vocabulary's longest, so the (NFC-normalised) text's UTF-8 bytes need at least that many tokens."""
        if self._longest is None:
            self._longest = max((len(b) for b in self._table()), default=1) or 1
        return -(-len(unicodedata.normalize("NFC", text).encode("utf-8", "surrogatepass")) // self._longest)

    def token_bytes(self, id: int) -> bytes:  # noqa: A002 - the brief's name
        """The raw bytes token `id` stands for; an added token's UTF-8 text; b"" for padding or unknown ids."""
        return self._piece(id)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: their bytes concatenated, read as UTF-8 (U+FFFD for broken sequences).

        Padding ids and ids outside the vocabulary contribute nothing (as in `tokenizers`);
        `skip_special` drops the added tokens marked special (`<|im_end|>`), not `<think>`.
        """
        special = self.special_ids if skip_special else frozenset()
        piece = self._piece
        data = b"".join(piece(i) for i in ids if i not in special)
        return data.decode("utf-8", errors="replace")

    def id_to_token(self, id: int) -> str | None:  # noqa: A002
        """The vocabulary string of an id (byte-level form for BPE tokens), None for padding/unknown."""
        if id in self._unused:
            return None
        if self._compact is not None:
            return self._compact.token(id) if 0 <= id < self.vocab_size else None
        return self._backend.id_to_token(id)

    def token_to_id(self, token: str) -> int | None:
        if self._compact is not None:
            i = self._compact.by_text.get(token)
            return i if i is not None else self._compact.bpe.lookup(token)
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation with the model's template (or the built-in ChatML), as transformers would.

        The template sees `messages` (None-valued keys dropped, `reasoning_content` offered),
        `add_generation_prompt`, `enable_thinking` only when it is not None (so `is defined` checks
        behave as in transformers), `tools`/`documents` (None unless given), `bos_token`,
        `eos_token`, `pad_token` when the tokenizer has them, and `extra`.

        Raises:
            ConversationRejected: the template called `raise_exception` (bad conversation).
            ChatTemplateError: the template broke the sandbox rules or failed to render.
        """
        context: dict[str, Any] = {}
        for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)):
            if i is not None:
                context[name] = self.token_bytes(i).decode("utf-8", errors="replace")
        context["tools"] = None
        context["documents"] = None
        context.update(_plain(extra))
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        context["messages"] = _prepare_messages(messages)
        context["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise ConversationRejected(f"the chat template refused the conversation: {_one_line(str(e))}") from None
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(
                f"chat template: expected a template the sandbox allows, found an unsafe operation: {_one_line(str(e))}"
            ) from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {_one_line(str(e))}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, RecursionError) as e:
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {_one_line(str(e))}") from None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], *, ignore_merges: bool = True) -> "Tokenizer":
        """Build from GGUF metadata (key -> python value) written by llama.cpp's converter or `write_gguf`.

        `ignore_merges` (default on): a pre-token that is itself in the vocabulary is emitted whole
        before any merge, as tiktoken does. Qwen's reference tokenizer is tiktoken on the Qwen ranks,
        and 83 of the 248,044 Qwen3.5 ranks (e.g. "加拿大", "新加坡") cannot be made by merging two
        smaller tokens, so a BPE that only merges never emits them. llama.cpp (qwen35 pre) and
        transformers' Qwen3_5Tokenizer merge only, and give those 83 words, when one is a whole
        pre-token, as several tokens; with `ignore_merges=False` this tokenizer does the same.
        """
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            found = "no tokenizer.ggml.model" if model is None else f"{model!r}"
            raise ModelFormatError(f"GGUF tokenizer: expected tokenizer.ggml.model 'gpt2' (byte-level BPE), found {found}")
        pre = fields.get("tokenizer.ggml.pre", DEFAULT_PRE)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ModelFormatError(
                f"GGUF tokenizer: expected tokenizer.ggml.pre to be one of {', '.join(PRE_TOKENIZER_REGEXES)}, found {pre!r}"
            )
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) and not hasattr(tokens, "strings_at") or not len(tokens):
            raise ModelFormatError(
                f"GGUF tokenizer: expected tokenizer.ggml.tokens (a list of strings), found {_describe(tokens)}"
            )
        merges = fields.get("tokenizer.ggml.merges")
        if not isinstance(merges, (list, tuple)) and not hasattr(merges, "strings_at") or not len(merges):
            raise ModelFormatError(
                f"GGUF tokenizer: expected tokenizer.ggml.merges (a list of 'left right' strings), found {_describe(merges)}"
            )
        types = fields.get("tokenizer.ggml.token_type")
        if types is None:
            types = [_TT_NORMAL] * len(tokens)
        elif len(types) != len(tokens):
            raise ModelFormatError(
                f"GGUF tokenizer: expected {len(tokens)} token types (one per token), found {len(types)}"
            )

        # The last id that is not padding: trailing padding rows are not part of the tokenizer.
        last = len(tokens) - 1
        while last >= 0 and int(types[last]) == _TT_UNUSED:
            last -= 1
        if last < 0:
            raise ModelFormatError("GGUF tokenizer: expected some tokens that are not padding, found only UNUSED tokens")
        template = fields.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"GGUF tokenizer: expected tokenizer.chat_template to be a string, found {_describe(template)}")
        if native_bpe.available():
            return cls._from_gguf_compact(fields, tokens, merges, types, last, pre, template, ignore_merges)
        tokens = list(tokens) if hasattr(tokens, "strings_at") else tokens
        merges = list(merges) if hasattr(merges, "strings_at") else merges

        # Every id up to `last` goes into the BPE vocabulary, so ids stay contiguous (tokenizers gives a
        # new added token the id len(vocab), which would collide across a gap). Padding and duplicate
        # strings get placeholders that no merge produces, and are filtered out of decode.
        # The common case runs at C speed (dict(zip), comprehensions): a per-token Python loop over the
        # 248,320 real tokens and 247,587 merges took 0.33 s of a 0.8B file's 1.05 s load.
        head = tokens[:last + 1] if last + 1 < len(tokens) else tokens
        if not set(map(type, head)) <= {str}:
            i = next(i for i, t in enumerate(head) if not isinstance(t, str))
            raise ModelFormatError(f"GGUF tokenizer: expected token {i} to be a string, found {type(head[i]).__name__}")
        odd = [i for i, k in enumerate(types[:last + 1]) if k != _TT_NORMAL]  # padding, control, user-defined
        vocab: dict[str, int] = dict(zip(head, range(last + 1)))
        unused: list[int] = []
        added: list[tuple[int, str, bool]] = []
        if len(vocab) != last + 1 or any(int(types[i]) == _TT_UNUSED for i in odd):
            vocab, seen = {}, set()
            for i, token in enumerate(head):  # duplicates or padding: the placeholders' way, one by one
                if int(types[i]) == _TT_UNUSED or token in seen:
                    unused.append(i)
                    token = f"\u0000deltaserve-unused-{i}"
                seen.add(token)
                vocab[token] = i
        unused_set = frozenset(unused)
        for i in odd:
            kind = int(types[i])
            if i not in unused_set and kind in (_TT_CONTROL, _TT_USER_DEFINED):
                added.append((i, head[i], kind == _TT_CONTROL))

        pairs = _merge_pairs(merges)
        if pairs is None:
            n, merge = next((n, m) for n, m in enumerate(merges)
                            if not isinstance(m, str) or len(p := m.split(" ")) != 2 or not all(p) or "\n" in m)
            raise ModelFormatError(f"GGUF tokenizer: expected merge {n} to be 'left right', found {merge!r}")
        longest = max(_longest_bytes(head, unused_set), *(len(c.encode("utf-8")) for _, c, _ in added), 1)
        try:
            bpe = bpe_model(vocab, pairs, ignore_merges)
        except Exception as e:
            raise ModelFormatError(f"GGUF tokenizer: expected merges of tokens in the vocabulary, found: {_one_line(str(e))}") from None
        backend = _Backend(bpe)
        _qwen_pipeline(backend, PRE_TOKENIZER_REGEXES[pre])
        backend.add_tokens([AddedToken(content, special=special, normalized=False) for _, content, special in added])
        got = backend.get_added_tokens_decoder()
        for i, content, _ in added:
            if i not in got or got[i].content != content:
                raise ModelFormatError(f"GGUF tokenizer: expected added token {content!r} at id {i}, found it elsewhere")

        return cls._with_ids(fields, backend, None, last, unused, pre, template, longest)

    @classmethod
    def _with_ids(cls, fields: Mapping[str, Any], backend: _Backend | None, compact: _Compact | None, last: int,
                  unused: list[int], pre: str, template: str | None, longest: int) -> "Tokenizer":
        """The Tokenizer of a GGUF vocabulary, its eos/pad/bos/eot ids read and checked."""
        unused_set = frozenset(unused)

        def id_field(key: str) -> int | None:
            value = fields.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelFormatError(f"GGUF tokenizer: expected {key} to be an integer, found {_describe(value)}")
            if not 0 <= value <= last or value in unused_set:
                raise ModelFormatError(
                    f"GGUF tokenizer: expected {key} to name a token (0..{last}), found {value}"
                )
            return value

        eot = [i for i in (id_field("tokenizer.ggml.eot_token_id"), id_field("tokenizer.ggml.eom_token_id")) if i is not None]
        return cls(
            backend,
            chat_template=template,
            eos_id=id_field("tokenizer.ggml.eos_token_id"),
            pad_id=id_field("tokenizer.ggml.padding_token_id"),
            bos_id=id_field("tokenizer.ggml.bos_token_id"),
            extra_stop_ids=eot,
            unused_ids=unused,
            pre=pre,
            vocab_size=last + 1,
            longest=longest,
            compact=compact,
        )

    @classmethod
    def _from_gguf_compact(cls, fields: Mapping[str, Any], tokens: Any, merges: Any, types: Sequence[int], last: int,
                           pre: str, template: str | None, ignore_merges: bool) -> "Tokenizer":
        """`from_gguf_fields` on bpe.c: the token and merge strings read where they lie (a GGUF reader's
        `strings_at`) or, given as Python strings, copied once; the same checks and errors."""
        def strings_at(values: Any, what: str) -> native_bpe.StringsAt:
            if hasattr(values, "strings_at"):
                return values.strings_at()
            if not set(map(type, values)) <= {str}:
                i = next(i for i, t in enumerate(values) if not isinstance(t, str))
                if what == "merge":
                    raise ModelFormatError(f"GGUF tokenizer: expected merge {i} to be 'left right', found {values[i]!r}")
                raise ModelFormatError(f"GGUF tokenizer: expected token {i} to be a string, found {type(values[i]).__name__}")
            return native_bpe.StringsAt.of(values)

        at = strings_at(tokens, "token").head(last + 1)
        kinds = np.asarray(types[:last + 1], np.int64)
        skip = (kinds == _TT_UNUSED).astype(np.uint8)
        try:
            bpe = native_bpe.NativeBPE(at, strings_at(merges, "merge"), skip)
        except native_bpe.BadMerge as e:
            merge = merges[e.index]
            if e.kind == 1:
                raise ModelFormatError(f"GGUF tokenizer: expected merge {e.index} to be 'left right', found {merge!r}") from None
            left, right = merge.split(" ")
            missing = (left, right, left + right)[e.part]
            raise ModelFormatError(f"GGUF tokenizer: expected merges of tokens in the vocabulary, found: merge {e.index} "
                                   f"({merge!r}) makes {missing!r}, which is not in the vocabulary") from None
        unused = np.flatnonzero(skip).tolist()  # padding, and strings an earlier token has (placeholders)
        added = [(i, bpe.token(i).decode("utf-8", errors="replace"), int(kinds[i]) == _TT_CONTROL)
                 for i in np.flatnonzero((kinds == _TT_CONTROL) | (kinds == _TT_USER_DEFINED)).tolist() if not skip[i]]
        longest = max(bpe.longest(skip), *(len(c.encode("utf-8")) for _, c, _ in added), 1)
        compact = _Compact(bpe, added, PRE_TOKENIZER_REGEXES[pre], ignore_merges)
        return cls._with_ids(fields, None, compact, last, unused, pre, template, longest)

    @classmethod
    def from_hf_dir(cls, path: str | Path, *, ignore_merges: bool | None = True) -> "Tokenizer":
        """Build from a Hugging Face model directory.

        Reads `tokenizer.json` as is (it must be a byte-level BPE), the chat template from
        `chat_template.jinja` if present, else from `tokenizer_config.json` (a string, or the entry
        named "default" of a list), `eos_token`/`pad_token`/`bos_token` from `tokenizer_config.json`,
        and `eos_token_id` (an int or a list) from `generation_config.json` as extra stop ids.

        `ignore_merges`: for a tokenizer.json with a Qwen split (qwen35/qwen2), True (default) sets
        the BPE's whole-pre-token lookup on, so the model tokenises as tiktoken does and as the same
        model read from a GGUF does (see `from_gguf_fields`); None keeps the file's setting.
        """
        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise ModelFormatError(f"HF tokenizer: expected {tj}, found no such file")
        try:
            backend = _Backend.from_file(str(tj))
        except Exception as e:
            raise ModelFormatError(f"HF tokenizer: expected a valid tokenizer.json in {root}, found: {_one_line(str(e))}") from None
        if not isinstance(backend.model, models.BPE):
            raise ModelFormatError(f"HF tokenizer: expected a BPE model in {tj}, found {type(backend.model).__name__}")
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise ModelFormatError(
                f"HF tokenizer: expected a byte-level tokenizer (ByteLevel decoder) in {tj}, found {type(backend.decoder).__name__}"
            )

        pre = _pre_of(backend)
        if ignore_merges is not None and pre is not None:
            backend.model.ignore_merges = bool(ignore_merges)

        config = _read_json(root / "tokenizer_config.json")
        template: str | None = None
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            raw = config.get("chat_template")
            if isinstance(raw, str):
                template = raw
            elif isinstance(raw, list):
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                template = named.get("default")
                if template is None:
                    raise ModelFormatError(
                        f"HF tokenizer: expected a chat template named 'default' in tokenizer_config.json, found {sorted(map(str, named))}"
                    )
            elif raw is not None:
                raise ModelFormatError(f"HF tokenizer: expected chat_template to be a string, found {_describe(raw)}")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise ModelFormatError(f"HF tokenizer: expected {key} to be a token string, found {_describe(value)}")
            i = backend.token_to_id(value)
            if i is None:
                raise ModelFormatError(f"HF tokenizer: expected {key} {value!r} to be in tokenizer.json, found no such token")
            return i

        generation = _read_json(root / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else [i for i in (gen_eos or []) if isinstance(i, int)]
        eos = token_id("eos_token")
        if eos is None and extra:
            eos = extra[0]
        return cls(
            backend,
            chat_template=template,
            eos_id=eos,
            pad_id=token_id("pad_token"),
            bos_id=token_id("bos_token"),
            extra_stop_ids=extra,
            pre=pre,
        )

    # ------------------------------------------------------------------ GGUF export

    def merges(self) -> list[str]:
        """The BPE merges as GGUF writes them ("left right"), in priority order."""
        state = json.loads(self.backend.model.__getstate__())
        return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in state.get("merges", [])]

    def write_gguf(self, writer: "gguf.GGUFWriter", vocab_size: int) -> None:
        """Write `tokenizer.ggml.*` (and `tokenizer.chat_template`) the way llama.cpp's converter does.

        Tokens are padded to `vocab_size` (the model's embedding rows) with "[PAD{i}]" of type UNUSED;
        added tokens are CONTROL when special, USER_DEFINED otherwise; `add_bos_token` is false
        (Qwen never prepends a BOS).
        """
        import gguf  # a writer's dependency, only needed here

        if self.pre is None:
            raise ModelFormatError(
                f"GGUF export: expected a tokenizer with a known split regex ({', '.join(PRE_TOKENIZER_REGEXES)}), found another pre-tokenizer"
            )
        if vocab_size < self.vocab_size:
            raise ModelFormatError(
                f"GGUF export: the tokenizer knows {self.vocab_size} token ids but the model's embedding has only {vocab_size} rows"
            )
        tokens: list[str] = []
        types: list[int] = []
        for i in range(vocab_size):
            token = None if (i in self._unused or i >= self.vocab_size) else self.id_to_token(i)
            if token is None:
                tokens.append(f"[PAD{i}]")
                types.append(gguf.TokenType.UNUSED)
            elif i in self._added:
                tokens.append(self._added[i])
                types.append(gguf.TokenType.CONTROL if i in self.special_ids else gguf.TokenType.USER_DEFINED)
            else:
                tokens.append(token)
                types.append(gguf.TokenType.NORMAL)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(self.merges())
        if self.eos_id is not None:
            writer.add_eos_token_id(self.eos_id)
        if self.pad_id is not None:
            writer.add_pad_token_id(self.pad_id)
        if self.bos_id is not None:
            writer.add_bos_token_id(self.bos_id)
        writer.add_add_bos_token(False)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def _describe(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else f"a list of {type(value[0]).__name__}"
    return f"a {type(value).__name__}"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"HF tokenizer: expected valid JSON in {path}, found: {_one_line(str(e))}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"HF tokenizer: expected a JSON object in {path}, found {_describe(data)}")
    return data


class StreamDecoder:
    """Incremental detokenisation for streaming.

    `feed(id)` returns only text that is complete; bytes of a UTF-8 character split across tokens
    are held until the character is whole. `flush()` returns the rest (a broken tail as U+FFFD).
    The concatenation of everything returned equals `tokenizer.decode(ids, skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, id: int) -> str:  # noqa: A002
        if id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(id), final=False)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


# NFC is applied by the backend's normaliser; exposed for callers that compare texts.
