"""Reading GGUF files, memory-mapped, with errors a user can act on.

The layout constants (value types, tensor types, block sizes) come from the `gguf` package. The header
is parsed here rather than by `gguf.GGUFReader`, which builds a numpy array per string and takes about
12 s on the real Qwen3.5 vocabulary (500K strings); this parser takes a fraction of a second and says
exactly where a truncated file ends.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from deltaserve.errors import ModelFormatError
from deltaserve.text import bpe

LAZY_STRINGS = 4096  # a string array this long stays in the file (GGUFStrings): the vocabulary and its merges

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class RawTensor:
    """One stored tensor: its type, logical shape (numpy order: rows, cols) and raw bytes (memory-mapped)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, the tensor's bytes in the file

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, RawTensor]
    buf: Any = None        # the mapping the tensors view
    data_start: int = 0
    parts: list["GGUFFile"] = field(default_factory=list)  # a split GGUF's files, this one first (empty: one file)
    _owner: dict[str, "GGUFFile"] = field(default_factory=dict, repr=False)  # a split's tensor -> the part holding it

    @property
    def disk_bytes(self) -> int:
        """The bytes of the file, or of every part of a split GGUF together."""
        return sum(p.path.stat().st_size for p in (self.parts or [self]))

    def release(self, name: str, lo_byte: int = 0, hi_byte: int | None = None) -> None:
        """Give back the pages of a tensor (or of its bytes lo_byte..hi_byte) already converted (they are not
        read again): keeps the load's peak resident memory near the converted weights, not the file plus
        the weights."""
        owner = self._owner.get(name, self)
        if owner is not self:
            return owner.release(name, lo_byte, hi_byte)
        t = self.tensors.get(name)
        if t is None or self.buf is None or not hasattr(self.buf, "madvise"):
            return
        hi_byte = t.nbytes if hi_byte is None else min(hi_byte, t.nbytes)
        start = t.data.__array_interface__["data"][0] - np.frombuffer(self.buf, np.uint8, 1).__array_interface__["data"][0]
        page = mmap.PAGESIZE
        lo = -(-(start + lo_byte) // page) * page
        hi = (start + hi_byte) // page * page
        if hi > lo:
            try:
                self.buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                pass

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")


_U64 = struct.Struct("<Q")


class GGUFStrings(Sequence):
    """An array of strings left where the file has it: each string decoded when asked for (UTF-8, U+FFFD for a
    broken sequence, as `_Cursor.strings`), and `strings_at` for the tokenizer's bpe.c, which reads the bytes
    themselves. A vocabulary read into Python strings took ~75 MiB and 0.12 s for Qwen's 248,320 tokens and
    247,587 merges; this holds two int64 arrays per array of strings. Equal to a list of the same strings."""

    def __init__(self, buf: Any, start: np.ndarray, length: np.ndarray):
        self._buf, self._start, self._length = buf, start, length

    def __len__(self) -> int:
        return len(self._start)

    def _one(self, i: int) -> str:
        a = int(self._start[i])
        return bytes(self._buf[a:a + int(self._length[i])]).decode("utf-8", errors="replace")

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._one(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"string {i} of {len(self)}")
        return self._one(i % len(self))

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        return [self._one(j) for j in range(len(self))]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, GGUFStrings)):
            return len(self) == len(other) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<GGUFStrings: {len(self)} strings>"

    def strings_at(self) -> bpe.StringsAt:
        return bpe.StringsAt(self._buf, self._start, self._length)


class _Cursor:
    def __init__(self, buf, name: str):
        self.buf = buf
        self.pos = 0
        self.name = name

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(f"truncated GGUF: {self.name} ends at byte {len(self.buf)} while reading "
                                   f"{what} (needs byte {self.pos + n})")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """An array of `count` strings: the bytes cut out in one tight loop, then decoded in one call where every
        string is valid UTF-8 without NUL (a vocabulary is ~500,000 of them: per-string method calls took 3.4 s
        of a 0.8B file's 10 s load; a slice, a check and a decode each, 0.18 s; this, 0.12 s)."""
        buf, pos, end, raw = self.buf, self.pos, len(self.buf), []
        append, length = raw.append, _U64.unpack_from
        try:
            for _ in range(count):
                (n,) = length(buf, pos)
                pos += 8
                append(buf[pos:pos + n])
                pos += n
        except struct.error:
            pos = end + 1
        if pos > end:
            return self._strings_checked(count, what)  # truncated: the careful walk names where
        self.pos = pos
        if not raw:
            return []
        blob = b"\x00".join(raw)
        if blob.count(0) == count - 1:
            try:
                return blob.decode("utf-8").split("\x00")
            except UnicodeDecodeError:
                pass
        return [r.decode("utf-8", errors="replace") for r in raw]

    def lazy_strings(self, count: int, what: str) -> GGUFStrings | None:
        """`count` strings left in the file, walked by bpe.c (None where it is not built)."""
        try:
            walked = bpe.gguf_strings(self.buf, self.pos, count)
        except IndexError as e:
            raise ModelFormatError(f"truncated GGUF: {self.name} ends at byte {len(self.buf)} while reading {what} "
                                   f"(needs byte {e.args[0]})") from None
        if walked is None:
            return None
        start, length, self.pos = walked
        return GGUFStrings(self.buf, start, length)

    def _strings_checked(self, count: int, what: str) -> list[str]:
        """`strings` one at a time with every bound checked: raises the truncation error at the string that runs
        past the end."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = _U64.unpack_from(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.need(n, what)
            out.append(bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            sub = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if sub == GGUFValueType.STRING:
                if count >= LAZY_STRINGS and (lazy := self.lazy_strings(count, what)) is not None:
                    return lazy
                return self.strings(count, what)
            if sub in _NUMPY:
                dt = np.dtype(_NUMPY[sub])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if sub == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY, what) for _ in range(count)]
            raise ModelFormatError(f"{self.name}: {what} is an array of unknown value type {sub}")
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        raise ModelFormatError(f"{self.name}: {what} has unknown value type {vtype}")


@dataclass
class GGUFHeader:
    """A GGUF's header alone, parsed from its first bytes (the Hub's files are planned for before they are fetched):
    the metadata, and each tensor's type and shape (numpy order)."""

    metadata: dict[str, Any]
    tensors: dict[str, tuple[GGMLQuantizationType, tuple[int, ...]]]
    data_start: int


class TruncatedHeader(ModelFormatError):
    """The bytes given end inside the header: more of the file is needed."""


def parse_header(buf, name: str) -> tuple[int, dict[str, Any], list, int]:
    """(version, metadata, [(tensor, dims, type, offset)], where the tensor data starts) of the GGUF in `buf`."""
    if len(buf) < 4 or int.from_bytes(bytes(buf[:4]), "little") != GGUF_MAGIC:
        raise ModelFormatError(f"{name} is not a GGUF file: it starts with {bytes(buf[:4])!r}, a GGUF starts with "
                               "b'GGUF'")
    c = _Cursor(buf, name)
    c.pos = 4
    version = c.scalar("<I", "the version")
    if version not in (2, 3):
        raise ModelFormatError(f"{name}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors = c.scalar("<Q", "the tensor count")
    n_kv = c.scalar("<Q", "the metadata count")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ModelFormatError(f"{name}: implausible header ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        vtype = c.scalar("<I", f"the type of {key}")
        metadata[key] = c.value(vtype, key)
    infos = []
    for i in range(n_tensors):
        tname = c.string(f"tensor name {i}")
        n_dims = c.scalar("<I", f"the dims of {tname}")
        if n_dims > 8:
            raise ModelFormatError(f"{name}: tensor {tname} claims {n_dims} dimensions")
        dims = [c.scalar("<Q", f"the dims of {tname}") for _ in range(n_dims)]
        raw_type = c.scalar("<I", f"the type of {tname}")
        offset = c.scalar("<Q", f"the offset of {tname}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFormatError(f"{name}: tensor {tname} has unknown type id {raw_type}") from None
        infos.append((tname, dims, qtype, offset))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    return version, metadata, infos, -(-c.pos // align) * align


def architecture(path: str | os.PathLike) -> str | None:
    """A GGUF's general.architecture from the metadata before it (the first key of every converter's files), read
    from the file's first bytes without parsing the rest of its header."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(1 << 20)
    if len(head) < 24 or int.from_bytes(head[:4], "little") != GGUF_MAGIC:
        raise ModelFormatError(f"{p.name} is not a GGUF file: it starts with {head[:4]!r}")
    c = _Cursor(head, p.name)
    c.pos = 24  # magic, version, tensor count, metadata count
    n_kv = int.from_bytes(head[16:24], "little")
    for i in range(min(n_kv, 1 << 24)):
        key = c.string(f"metadata key {i}")
        value = c.value(c.scalar("<I", f"the type of {key}"), key)
        if key == "general.architecture":
            return str(value)
    return None


def read_header(head: bytes, name: str) -> GGUFHeader:
    """The header of a GGUF from its first bytes; TruncatedHeader where they end inside it (ask for more)."""
    try:
        _, metadata, infos, start = parse_header(head, name)
    except ModelFormatError as e:
        if str(e).startswith("truncated GGUF"):
            raise TruncatedHeader(str(e)) from None
        raise
    return GGUFHeader(metadata, {t: (q, tuple(int(d) for d in reversed(dims))) for t, dims, q, _ in infos}, start)


SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str | os.PathLike) -> list[Path]:
    """The files of a split GGUF named by its first part (`NAME-00001-of-0000N.gguf`, as llama.cpp's gguf-split
    and converters write them), in order; [path] for a file that is not named as a first part."""
    p = Path(path)
    m = SPLIT_NAME.match(p.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) < 2:
        return [p]
    count = int(m["count"])
    return [p.with_name(f"{m['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """A GGUF file memory-mapped; a split GGUF (its first part named) with the tensors of every part."""
    first = read_gguf_part(path)
    count = int(first.metadata.get("split.count", 1) or 1)
    number = int(first.metadata.get("split.no", 0) or 0)
    if number != 0:
        m = SPLIT_NAME.match(first.path.name)
        first_name = (f"{m['stem']}-00001-of-{m['count']}.gguf" if m else "its first part")
        raise ModelFormatError(f"{first.path.name} is part {number + 1} of {count} of a split GGUF: pass the first "
                               f"part, {first_name} (the others are read beside it)")
    if count < 2:
        return first
    names = split_parts(first.path)
    if len(names) != count:
        raise ModelFormatError(f"{first.path.name} is the first of {count} parts of a split GGUF, but its name does "
                               f"not say so: the parts must be named NAME-00001-of-{count:05d}.gguf ... "
                               f"NAME-{count:05d}-of-{count:05d}.gguf, side by side")
    missing = [n.name for n in names[1:] if not n.exists()]
    if missing:
        raise ModelFormatError(f"{first.path.name} is the first of {count} parts of a split GGUF and "
                               f"{len(missing)} of the others are missing beside it: {', '.join(missing)}")
    first.parts = [first]
    for k, name in enumerate(names[1:], 1):
        part = read_gguf_part(name)
        no = int(part.metadata.get("split.no", -1))
        if no != k or int(part.metadata.get("split.count", 0)) != count:
            raise ModelFormatError(f"{name.name} says it is part {no + 1} of {part.metadata.get('split.count')}, "
                                   f"not part {k + 1} of {count} as its name does")
        for t, tensor in part.tensors.items():
            if t in first.tensors:
                raise ModelFormatError(f"{name.name}: tensor {t} appears in two parts of the split GGUF")
            first.tensors[t] = tensor
            first._owner[t] = part
        first.parts.append(part)
    declared = first.metadata.get("split.tensors.count")
    if declared is not None and int(declared) != len(first.tensors):
        raise ModelFormatError(f"{first.path.name}: the split GGUF declares {declared} tensors and its {count} parts "
                               f"hold {len(first.tensors)}")
    return first


def read_gguf_part(path: str | os.PathLike) -> GGUFFile:
    """One GGUF file (or one part of a split GGUF) memory-mapped."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"no such model file: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, expected a GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or int.from_bytes(head, "little") != GGUF_MAGIC:
            raise ModelFormatError(f"{path.name} is not a GGUF file: it starts with {head!r}, "
                                   f"a GGUF starts with b'GGUF' ({size} bytes)")
        # copy-on-write: tensors are writable views (torch wants that), nothing is copied unless written
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    version, metadata, infos, start = parse_header(buf, path.name)
    tensors: dict[str, RawTensor] = {}
    whole = np.frombuffer(buf, dtype=np.uint8)
    for name, dims, qtype, offset in infos:
        if name in tensors:
            raise ModelFormatError(f"{path.name}: tensor {name} appears twice")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise ModelFormatError(f"{path.name}: tensor {name} rows of {dims[0]} are not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        begin = start + offset
        end = begin + n_bytes
        if end > size:
            raise ModelFormatError(f"truncated GGUF: tensor {name} ends at byte {end}, the file has {size} bytes")
        shape = tuple(int(d) for d in reversed(dims))
        tensors[name] = RawTensor(name, qtype, shape, whole[begin:end])
    return GGUFFile(path, version, metadata, tensors, buf, start)


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return int.from_bytes(f.read(4), "little") == GGUF_MAGIC


__all__ = ["GGUFFile", "GGUFHeader", "GGUFStrings", "RawTensor", "read_gguf", "read_header", "is_gguf", "split_parts",
           "architecture"]
