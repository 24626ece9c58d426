"""Stored responses: the Responses API's `store` and `previous_response_id`, beside the state store.

A record is one response as the server answered it (the response object), the input items its request sent
(`GET /v1/responses/{id}/input_items`), the conversation through its answer as the chat template takes it
(`messages`, without the system text, for a follow-up whose instructions or tools differ and must be rendered
again), what it was rendered with (`frame`: a hash of the system text and the tools as the template renders them),
and `tokens`: the ids the conversation holds at the end of the answer. Those ids are the key of the state the
session kept at the end of the turn (the state store keys states by the tokens they cover, `Session.generate(...,
keep_end=True)`): a follow-up's prompt is those ids and its new input, and the slot or the store that holds the
state prefills only the new input. A follow-up whose state was evicted prefills the same ids from the start: the
same tokens, the same answer, only slower (its `cached_tokens` says so).

Records live in RAM; with a directory, each is also one JSON file under DIR/responses/ (temporary name, fsync,
rename: a crash leaves no half file), read back when a server starts and on a miss (another replica's, on a shared
--state-dir). A file is checked before it is used (its format, its id against its name, its types, its size); one
that fails is refused with one notice and left alone. The records' bytes stay within a budget, the oldest leaving
first (RAM and disk alike), each eviction said once.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deltaserve.errors import DeltaserveError

FORMAT = "deltaserve-response/1"
SUBDIR = "responses"
MAX_RECORD_BYTES = 64 << 20
ID = re.compile(r"^resp_[0-9a-f]{32}$")


def new_id(prefix: str = "resp") -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def valid_id(value: str) -> bool:
    return isinstance(value, str) and ID.match(value) is not None


def pack_tokens(tokens) -> str:
    """Token ids as base64 of little-endian uint32 (a quarter of their JSON's size); "8:" and uint64 where an image's
    placeholder ids (past 2**32: deltaserve.vision.inputs) are among them."""
    tokens = [int(t) for t in tokens]
    width = 8 if tokens and max(tokens) >= 1 << 32 else 4
    data = base64.b64encode(b"".join(t.to_bytes(width, "little") for t in tokens)).decode("ascii")
    return ("8:" if width == 8 else "") + data


def unpack_tokens(text: str) -> list[int]:
    width = 8 if text.startswith("8:") else 4
    raw = base64.b64decode(text[2:] if width == 8 else text, validate=True)
    if len(raw) % width:
        raise ValueError(f"the token bytes are {len(raw)}, not a multiple of {width}")
    return [int.from_bytes(raw[i:i + width], "little") for i in range(0, len(raw), width)]


@dataclass
class ResponseRecord:
    id: str
    created_at: int
    model_sha256: str
    response: dict
    input_items: list
    messages: list
    frame: str
    tokens: list[int] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "id": self.id, "created_at": self.created_at,
                           "model_sha256": self.model_sha256, "response": self.response,
                           "input_items": self.input_items, "messages": self.messages, "frame": self.frame,
                           "tokens": pack_tokens(self.tokens)}, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, name: str) -> "ResponseRecord":
        """A record read back, checked: ValueError naming what is wrong."""
        try:
            d = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not JSON ({str(e)[:80]})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        if d.get("id") != name or not valid_id(name):
            raise ValueError(f"its id {str(d.get('id'))[:60]!r} is not its file's name {name!r}")
        kinds = {"created_at": int, "model_sha256": str, "response": dict, "input_items": list, "messages": list,
                 "frame": str, "tokens": str}
        for key, kind in kinds.items():
            if not isinstance(d.get(key), kind):
                raise ValueError(f"its {key!r} is not a {kind.__name__}")
        try:
            tokens = unpack_tokens(d["tokens"])
        except ValueError as e:
            raise ValueError(f"its tokens do not decode ({e})") from None
        return cls(name, d["created_at"], d["model_sha256"], d["response"], d["input_items"], d["messages"],
                   d["frame"], tokens)


class ResponseStore:
    """Stored responses by id; thread-safe. `budget`: the bytes the records may hold together (their JSON)."""

    def __init__(self, *, budget: int, directory: str | os.PathLike | None = None,
                 say: Callable[[str], None] | None = None):
        self.budget = max(int(budget), 0)
        self.directory = Path(directory) / SUBDIR if directory is not None else None
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._records: OrderedDict[str, tuple[ResponseRecord, int]] = OrderedDict()  # oldest first
        self._refused: set[str] = set()
        self.used = 0
        self.evicted = 0
        if self.directory is not None:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                raise DeltaserveError(f"--state-dir: cannot create {self.directory} ({e.strerror})") from None
            self._load_all()

    def say(self, line: str) -> None:
        self._say(line)

    def __len__(self) -> int:
        return len(self._records)

    # -- files ----------------------------------------------------------------------------------------------
    def _path(self, rid: str) -> Path:
        return self.directory / f"{rid}.json"

    def _read(self, rid: str) -> ResponseRecord | None:
        """The record in its file, checked; None if there is none (or it was refused before, or now: said once)."""
        if self.directory is None or rid in self._refused:
            return None
        path = self._path(rid)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not os.path.stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_size > MAX_RECORD_BYTES:
                raise ValueError(f"{st.st_size} bytes, more than the limit of {MAX_RECORD_BYTES}")
            with os.fdopen(fd, "rb") as f:
                fd = -1
                data = f.read(MAX_RECORD_BYTES + 1)
            return ResponseRecord.from_json(data, rid)
        except (OSError, ValueError) as e:
            self._refused.add(rid)
            self.say(f"[deltaserve] stored response {path} refused: {e}")
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    def _write(self, record: ResponseRecord, data: bytes) -> None:
        path = self._path(record.id)
        tmp = path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{record.id}.json")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            self.say(f"[deltaserve] stored response {record.id} not written to {self.directory} ({e.strerror}): "
                     "it is kept in RAM only")

    def _load_all(self) -> None:
        files = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if name.startswith(".tmp-") and name.endswith(".json"):
                try:  # a write that never finished (its writer is gone by now or it is old)
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > 600:
                        os.unlink(entry.path)
                except OSError:
                    pass
                continue
            if name.endswith(".json") and valid_id(name[:-5]):
                try:
                    files.append((entry.stat(follow_symlinks=False).st_mtime, name[:-5]))
                except OSError:
                    pass
        for _, rid in sorted(files):
            record = self._read(rid)
            if record is not None:
                self._keep(record, len(record.to_json()))
        with self._lock:
            self._enforce()

    # -- the records ----------------------------------------------------------------------------------------
    def _keep(self, record: ResponseRecord, size: int) -> None:
        with self._lock:
            old = self._records.pop(record.id, None)
            if old is not None:
                self.used -= old[1]
            self._records[record.id] = (record, size)
            self.used += size

    def _enforce(self) -> None:
        while self.used > self.budget and len(self._records) > 1:
            rid, (record, size) = self._records.popitem(last=False)
            self.used -= size
            self.evicted += 1
            if self.directory is not None:
                try:
                    self._path(rid).unlink()
                except OSError:
                    pass
            self.say(f"[deltaserve] stored response {rid} dropped: the stored responses hold {self.used + size} "
                     f"bytes, more than their budget of {self.budget} (a follow-up naming it is refused)")

    def put(self, record: ResponseRecord) -> None:
        data = record.to_json()
        if self.directory is not None:
            self._write(record, data)
        self._keep(record, len(data))
        with self._lock:
            self._enforce()

    def get(self, rid: str) -> ResponseRecord | None:
        if not valid_id(rid):
            return None
        with self._lock:
            held = self._records.get(rid)
        if held is not None:
            return held[0]
        record = self._read(rid)  # another process's (a replica on the same --state-dir)
        if record is not None:
            self._keep(record, len(record.to_json()))
            with self._lock:
                self._enforce()
        return record

    def delete(self, rid: str) -> bool:
        if not valid_id(rid):
            return False
        with self._lock:
            held = self._records.pop(rid, None)
            if held is not None:
                self.used -= held[1]
        gone = held is not None
        if self.directory is not None:
            try:
                self._path(rid).unlink()
                gone = True
            except OSError:
                pass
        return gone

    def snapshot(self) -> dict:
        with self._lock:
            return {"responses": len(self._records), "bytes": self.used, "budget": self.budget,
                    "evicted": self.evicted, "directory": str(self.directory) if self.directory else None}
