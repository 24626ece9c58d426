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

Records live in RAM, within a budget of their own (bytes of their JSON); with a directory, each is also one file
under DIR/responses/ (temporary name, fsync, rename: a crash leaves no half file), read back when a server starts and
on a miss (another replica's, on a shared --state-dir). A file is its JSON after one line: an HMAC-SHA256 of that JSON
under the directory's key (deltaserve.session.files), so that a neighbour who can write the directory cannot plant or
edit a conversation; it is opened without following a symlink or blocking on a FIFO, checked on its descriptor, and
one that fails is refused with one notice and left alone.

Every record belongs to a tenant (the API key that stored it; None on a single-tenant server): another tenant's id is
not found. Each tenant has an equal share of the budget, and the oldest of its own records leave first when it is
over (each eviction said once): one client's responses never leave to make room for another tenant's.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import re
import secrets
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deltaserve.session import files

FORMAT = "deltaserve-response/2"  # /2: signed (an HMAC line before the JSON) and owned by a tenant
SUBDIR = "responses"
MAX_RECORD_BYTES = 64 << 20
ID = re.compile(r"resp_[0-9a-f]{32}")
MAC_HEX = 64


def new_id(prefix: str = "resp") -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def valid_id(value: str) -> bool:
    """A response id as this server makes them, the whole string (fullmatch: "resp_<hex>\\n" is not one)."""
    return isinstance(value, str) and ID.fullmatch(value) is not None


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
    tenant: str | None = None

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "id": self.id, "created_at": self.created_at,
                           "model_sha256": self.model_sha256, "response": self.response,
                           "input_items": self.input_items, "messages": self.messages, "frame": self.frame,
                           "tokens": pack_tokens(self.tokens), "tenant": self.tenant},
                          ensure_ascii=False).encode("utf-8")

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
        if d.get("tenant") is not None and not isinstance(d.get("tenant"), str):
            raise ValueError("its 'tenant' is not a string")
        try:
            tokens = unpack_tokens(d["tokens"])
        except ValueError as e:
            raise ValueError(f"its tokens do not decode ({e})") from None
        return cls(name, d["created_at"], d["model_sha256"], d["response"], d["input_items"], d["messages"],
                   d["frame"], tokens, d.get("tenant"))


def _signature(key: bytes, data: bytes) -> bytes:
    h = files.mac(key)
    h.update(data)
    return h.hexdigest().encode("ascii")


class ResponseStore:
    """Stored responses by id; thread-safe. `budget`: the bytes the records may hold together (their JSON), in equal
    shares for `tenants` tenants. Its methods read and write files: a server calls them off its event loop."""

    def __init__(self, *, budget: int, directory: str | os.PathLike | None = None,
                 say: Callable[[str], None] | None = None, tenants: int = 1):
        self.budget = max(int(budget), 0)
        self.share = self.budget // max(int(tenants), 1)
        self.directory = Path(directory) / SUBDIR if directory is not None else None
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._records: OrderedDict[str, tuple[ResponseRecord, int]] = OrderedDict()  # oldest first
        self._held: dict[str | None, int] = {}  # tenant -> bytes of its records
        self._refused: set[str] = set()
        self.used = 0
        self.evicted = 0
        self.key: bytes | None = None
        if self.directory is not None:
            files.private_dir(Path(directory), "--state-dir", self.say)
            self.key = files.directory_key(Path(directory))
            files.private_dir(self.directory, "--state-dir", self.say)
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
            data = files.read_checked(path, MAX_RECORD_BYTES)
            mac, sep, body = data.partition(b"\n")
            if not sep or len(mac) != MAC_HEX:
                raise ValueError(f"not a {FORMAT} record (no signature line)")
            if not hmac.compare_digest(mac, _signature(self.key, body)):
                raise ValueError("its HMAC does not match (forged, edited, or another directory's)")
            return ResponseRecord.from_json(body, rid)
        except files.UnsafeFile as e:
            if e.kind == "missing":
                return None
            self._refused.add(rid)
            self.say(f"[deltaserve] stored response {path} refused: {e}")
            return None
        except (OSError, ValueError) as e:
            self._refused.add(rid)
            self.say(f"[deltaserve] stored response {path} refused: {e}")
            return None

    def _write(self, record: ResponseRecord, data: bytes) -> None:
        try:
            files.write_atomic(self._path(record.id), _signature(self.key, data) + b"\n" + data, self.key)
        except OSError as e:
            self.say(f"[deltaserve] stored response {record.id} not written to {self.directory} ({e.strerror}): "
                     "it is kept in RAM only")

    def _load_all(self) -> None:
        files.remove_stale_tmps(self.directory, self.key, ".json")  # only our own: they carry the key's tag
        found = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            entries = []
        for entry in entries:
            name = entry.name
            if name.endswith(".json") and valid_id(name[:-5]):
                try:
                    found.append((entry.stat(follow_symlinks=False).st_mtime, name[:-5]))
                except OSError:
                    pass
        for _, rid in sorted(found):
            record = self._read(rid)
            if record is not None:
                self._keep(record, len(record.to_json()))
        with self._lock:
            for tenant in list(self._held):
                self._enforce(tenant)

    # -- the records ----------------------------------------------------------------------------------------
    def _keep(self, record: ResponseRecord, size: int) -> None:
        with self._lock:
            old = self._records.pop(record.id, None)
            if old is not None:
                self.used -= old[1]
                self._held[old[0].tenant] -= old[1]
            self._records[record.id] = (record, size)
            self.used += size
            self._held[record.tenant] = self._held.get(record.tenant, 0) + size

    def _enforce(self, tenant: str | None) -> None:
        """The tenant's oldest records out while it holds more than its share (its newest always stays). Lock held."""
        while self._held.get(tenant, 0) > self.share:
            mine = [rid for rid, (r, _) in self._records.items() if r.tenant == tenant]
            if len(mine) <= 1:
                break
            rid = mine[0]
            record, size = self._records.pop(rid)
            self.used -= size
            self._held[tenant] -= size
            self.evicted += 1
            if self.directory is not None:
                files.unlink_ours(self._path(rid))
            self.say(f"[deltaserve] stored response {rid} dropped: "
                     f"{'this tenant' + chr(39) + 's' if tenant is not None else 'the'} stored responses hold "
                     f"{self._held[tenant] + size} bytes, more than their budget of {self.share} (a follow-up naming "
                     "it is refused)")

    def put(self, record: ResponseRecord) -> None:
        data = record.to_json()
        if self.directory is not None:
            self._write(record, data)
        self._keep(record, len(data))
        with self._lock:
            self._enforce(record.tenant)

    def get(self, rid: str, tenant: str | None = None) -> ResponseRecord | None:
        """The record stored under `rid` by `tenant` (another tenant's is not found)."""
        if not valid_id(rid):
            return None
        with self._lock:
            held = self._records.get(rid)
        if held is not None:
            return held[0] if held[0].tenant == tenant else None
        record = self._read(rid)  # another process's (a replica on the same --state-dir)
        if record is not None:
            self._keep(record, len(record.to_json()))
            with self._lock:
                self._enforce(record.tenant)
        return record if record is not None and record.tenant == tenant else None

    def delete(self, rid: str, tenant: str | None = None) -> bool:
        if self.get(rid, tenant) is None:
            return False
        with self._lock:
            held = self._records.pop(rid, None)
            if held is not None:
                self.used -= held[1]
                self._held[held[0].tenant] -= held[1]
        if self.directory is not None:
            files.unlink_ours(self._path(rid))
        return True

    def snapshot(self) -> dict:
        with self._lock:
            return {"responses": len(self._records), "bytes": self.used, "budget": self.budget,
                    "share": self.share, "evicted": self.evicted,
                    "directory": str(self.directory) if self.directory else None}
