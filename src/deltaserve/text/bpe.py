"""A compact byte-level BPE for GGUF vocabularies (`bpe.c`), built with the system C compiler and loaded with ctypes.

Why our own: `tokenizers`' BPE holds Qwen3.5's 248,320 tokens and 247,587 merges in 66 MiB (a string map each
way, a merge map, each of them past a power-of-two growth step), a fifth of the 300 MiB that `deltaserve run`
may add to a 0.8B file, and building it from the GGUF's strings takes ~0.25 s of a 0.8B load. `bpe.c` keeps
the token strings once (2.3 MB) with a table of ids by string and one of merges by pair of ids: 14 MiB, built
in ~40 ms from the file's own bytes (the GGUF reader hands over where the strings lie, no Python string per
token). `tokenizers` still does everything that is not the merge loop, so the pre-tokenization is exactly its
own: the added tokens are split out and the text cut into pre-tokens by a `tokenizers.Tokenizer` with the same
pre-tokenizer and a one-word model (`skeleton`), whose offsets say which code points each pre-token spans;
`bpe.c` then merges every pre-token in one call, the GIL released. Parity with `tokenizers`' own BPE on the same
vocabulary is a test (tests/test_bpe.py); the full `tokenizers` backend is still built where one is asked for.

Measured on the Xeon (2026-12-05), Qwen3.5's vocabulary: 66 MiB -> 14 MiB held; build 0.25 s -> 0.04 s.

No compiler, a failed build, or DELTASERVE_NATIVE=off: `available()` is False and the tokenizer is
`tokenizers`' own, as before.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deltaserve.cbuild import build_library, compiler
from deltaserve import settings

HERE = Path(__file__).parent
ABI = 1

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "ds_bpe_abi": ([], _I),
    "ds_bpe_new": ([_P, _P, _P, _L, _P, _P, _P, _P, _L, _P], _P),
    "ds_bpe_free": ([_P], None),
    "ds_bpe_bytes": ([_P], _L),
    "ds_bpe_lookup": ([_P, ctypes.c_char_p, _L], _L),
    "ds_bpe_token": ([_P, _L, _P], _L),
    "ds_bpe_text": ([_P], _P),
    "ds_bpe_text_bytes": ([_P], _L),
    "ds_bpe_merges": ([_P, _P, _P], _L),
    "ds_bpe_merge_count": ([_P], _L),
    "ds_bpe_pieces": ([_P, _P, _P], _L),
    "ds_bpe_longest": ([_P, _P, _P], _L),
    "ds_bpe_encode": ([_P, _P, _P, _P, _L, _I, _P, _L], _L),
    "ds_gguf_strings": ([_P, _L, _L, _L, _P, _P], _L),
}

_lock = threading.Lock()
_state: dict = {}


def _load() -> tuple[ctypes.CDLL | None, str]:
    if not settings.current().native:
        return None, "turned off by DELTASERVE_NATIVE"
    cc = compiler()
    if cc is None:
        return None, f"no C compiler ({settings.current().compiler}) on PATH"
    try:
        lib = ctypes.CDLL(str(build_library("bpe", [HERE / "bpe.c"], ["-O2", "-fPIC"], cc=cc,
                                            what="the tokenizer's BPE")))
    except (RuntimeError, OSError) as e:
        return None, str(e)
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.ds_bpe_abi() != ABI:
        return None, f"the cached BPE library is of another version ({lib.ds_bpe_abi()}, wanted {ABI})"
    return lib, "built"


def library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load()
        return _state["lib"]


def available() -> bool:
    return library() is not None


def why_not() -> str:
    library()
    return _state["why"]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class StringsAt:
    """Where an array of strings lies: `base` (a buffer: the GGUF file's mapping, or a blob made here), each
    string's first byte and length (int64 arrays)."""

    def __init__(self, base, start: np.ndarray, length: np.ndarray):
        self.base, self.start, self.length = base, start, length

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def of(cls, strings: Sequence[str]) -> "StringsAt":
        """Strings given as Python strs (a small or hand-made vocabulary): one UTF-8 blob."""
        raw = [s.encode("utf-8", "surrogatepass") for s in strings]
        length = np.fromiter(map(len, raw), np.int64, len(raw))
        start = np.zeros(len(raw), np.int64)
        if len(raw) > 1:
            np.cumsum(length[:-1], out=start[1:])
        return cls(np.frombuffer(b"".join(raw) or b"\0", np.uint8), start, length)

    def head(self, n: int) -> "StringsAt":
        return StringsAt(self.base, self.start[:n], self.length[:n])


class BadMerge(ValueError):
    """A merge the vocabulary cannot hold: kind 1 (not two tokens around one space) or 2 (a part, or the
    joined token, is not in the vocabulary: part 0 left, 1 right, 2 joined), at merge `index`."""

    def __init__(self, kind: int, index: int, part: int):
        super().__init__(f"merge {index}: kind {kind}, part {part}")
        self.kind, self.index, self.part = kind, index, part


class NativeBPE:
    """The vocabulary and merges of one tokenizer, held by bpe.c (read-only once built: thread-safe)."""

    def __init__(self, tokens: StringsAt, merges: StringsAt, skip: np.ndarray):
        """`skip` (uint8, one per token): nonzero for a padding token (kept out of the vocabulary); on return, 2
        marks a token whose string an earlier token has (kept out too). Raises BadMerge."""
        lib = library()
        if lib is None:
            raise RuntimeError(why_not())
        self._lib = lib
        err = np.zeros(3, np.int64)
        self._skip = skip
        # the buffers must stay alive for the call only: bpe.c copies the token strings
        tb, mb = np.frombuffer(tokens.base, np.uint8), np.frombuffer(merges.base, np.uint8)
        h = lib.ds_bpe_new(_ptr(tb), _ptr(tokens.start), _ptr(tokens.length), len(tokens), _ptr(skip),
                           _ptr(mb), _ptr(merges.start), _ptr(merges.length), len(merges), _ptr(err))
        del tb, mb
        if not h:
            if int(err[0]) == 3:
                raise MemoryError("the tokenizer's BPE tables")
            raise BadMerge(int(err[0]), int(err[1]), int(err[2]))
        self._h = ctypes.c_void_p(h)
        self.n = len(tokens)
        self.nbytes = int(lib.ds_bpe_bytes(self._h))
        self._text = lib.ds_bpe_text(self._h)

    def __del__(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.ds_bpe_free(h)

    def lookup(self, token: str) -> int | None:
        raw = token.encode("utf-8", "surrogatepass")
        i = int(self._lib.ds_bpe_lookup(self._h, raw, len(raw)))
        return None if i < 0 else i

    def token(self, i: int) -> bytes | None:
        """Token i's string as the file writes it (UTF-8 bytes of the byte-level form)."""
        at = ctypes.c_int64()
        n = int(self._lib.ds_bpe_token(self._h, i, ctypes.byref(at)))
        return None if n < 0 else ctypes.string_at(self._text + at.value, n)

    def merges(self) -> list[tuple[int, int]]:
        """The merges as (left id, right id), by rank (a pair listed twice: at its later rank only)."""
        n = int(self._lib.ds_bpe_merge_count(self._h))
        left, right = np.empty(n, np.int64), np.empty(n, np.int64)
        self._lib.ds_bpe_merges(self._h, _ptr(left), _ptr(right))
        keep = left >= 0
        return list(zip(left[keep].tolist(), right[keep].tolist()))

    def pieces(self) -> tuple[bytes, np.ndarray]:
        """Every token's raw bytes: (blob, offsets), token i is blob[offsets[i]:offsets[i + 1]]."""
        out = np.empty(int(self._lib.ds_bpe_text_bytes(self._h)) + 1, np.uint8)  # unmapping never lengthens
        offsets = np.empty(self.n + 1, np.int64)
        used = int(self._lib.ds_bpe_pieces(self._h, _ptr(out), _ptr(offsets)))
        return out[:used].tobytes(), offsets

    def longest(self, skip: np.ndarray) -> int:
        """The most raw bytes any token not skipped stands for."""
        scratch = np.empty(int(self._lib.ds_bpe_text_bytes(self._h)) + 1, np.uint8)
        return int(self._lib.ds_bpe_longest(self._h, _ptr(np.ascontiguousarray(skip, np.uint8)), _ptr(scratch)))

    def encode(self, text: str, given: np.ndarray, spans: np.ndarray, ignore_merges: bool) -> list[int]:
        """The ids of `text` cut into pieces: piece t is the id given[t] where that is >= 0, else the BPE of the code
        points spans[t, 0] .. spans[t, 1]."""
        if not len(given):
            return []
        cps = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        cap = 4 * len(cps) + len(given)
        out = np.empty(cap, np.int32)
        given = np.ascontiguousarray(given, np.int32)
        spans = np.ascontiguousarray(spans, np.int64)
        n = int(self._lib.ds_bpe_encode(self._h, _ptr(cps), _ptr(given), _ptr(spans), len(given), int(ignore_merges),
                                        _ptr(out), cap))
        if n < 0:
            raise MemoryError("the tokenizer's BPE ran out of room") if n == -2 else RuntimeError("BPE output overflow")
        return out[:n].tolist()


def gguf_strings(buf, pos: int, count: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Walk a GGUF array of `count` strings at byte `pos` of `buf`: (starts, lengths, the byte after), None where
    bpe.c is not available; raises IndexError(byte needed) for an array cut short."""
    lib = library()
    if lib is None:
        return None
    whole = np.frombuffer(buf, np.uint8)
    start, length = np.empty(count, np.int64), np.empty(count, np.int64)
    end = int(lib.ds_gguf_strings(_ptr(whole), len(whole), pos, count, _ptr(start), _ptr(length)))
    if end < 0:
        raise IndexError(-1 - end)
    return start, length, end
