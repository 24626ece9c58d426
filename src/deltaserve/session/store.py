"""The conversation state store: saved decode states beyond the slots, in RAM and on disk, across restarts.

A hybrid model's recurrent state cannot be cut back to a shorter prefix, so a conversation resumes only from
a state saved at the right token: the checkpoint a turn takes just before its generation header. The store
keeps those checkpoints, keyed by the token ids they cover; a prompt that extends one is restored from the
longest and prefills only its new suffix.

- **Index.** Saved states are found by the longest stored proper prefix of a prompt: the prompt's prefix hashes
  (one pass, a polynomial hash mod 2^61-1) are looked up at every stored length, longest first, and a hit is
  confirmed token by token. This is what a prefix tree over token ids answers, in one dict and one pass.
- **Tiers.** RAM (`ram_bytes`) and, with a directory, disk (`disk_bytes`). With a directory every state is written
  through to disk by one background thread (so a `kill -9` loses only the states still being written); the
  least recently used leave RAM first (their disk copy stays), then disk. Without a directory they leave RAM
  for good. An entry is visible only once it is complete, and never changes after: two requests of one
  conversation may restore the same entry at once, each into its own state.
- **Files.** One safetensors file per state (deltaserve.session.statefile): the parts' tensors and, in its metadata,
  what it is valid for (the model's sha256, the deltaserve version, the token ids, the partition) under an HMAC keyed
  by the directory's secret (deltaserve.session.files). Written under a temporary name, fsynced and renamed: a crash
  mid-write leaves no half file under the final name. A file is opened once, never through a symlink and never
  blocking on a FIFO, and checked on its descriptor; one that does not match, is truncated, corrupt or forged is
  refused with one notice and its turn prefills from scratch.
- **Partitions.** Every entry belongs to a partition (a digest of an API key's tenant and a request's cache_salt;
  None on a single-tenant server): a look-up finds only its own partition's states, so a prefix cached for one
  tenant never answers, nor shortens the time to the first token of, another's.
- **Several processes on one directory** (replicas on a shared `--state-dir`, deltaserve/ray.py). Each process
  indexes the files the others write: whenever the directory has changed since it last looked (its mtime moves with
  every rename into it and every removal; a change within the last `RECENT_S` is looked at again, since mtimes are
  coarse), a look-up first lists it, reads the headers of the files it does not know and forgets the ones another
  process removed (quietly: that is the other's budget at work, not damage). The disk budget is the directory's:
  every process counts every state file in it and removes the least recently used (file times, comparable across
  processes) while the total is over; RAM budgets are each process's own. A temporary file is removed at start only
  when it carries the directory key's tag and its writer is gone (a pid of this host that no longer runs) or it is
  older than `STALE_TMP_S`; nothing else in the directory is ever removed but a damaged state of ours.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from deltaserve.engine.state import Checkpoint, kv_position_bytes
from deltaserve.errors import DeltaserveError
from deltaserve.formats.config import HybridConfig
from deltaserve.session import files
from deltaserve.session.statefile import (FORMAT, MAX_HEADER, SUFFIX, StateFileError, check_identity,  # noqa: F401
                                          checkpoint_tensors, expected_parts, file_name, read_header, read_state,
                                          write_state)

_MOD = (1 << 61) - 1
_BASE = 1_000_003
RECENT_S = 2.0        # a directory changed this recently is listed again at the next look-up (coarse mtimes)
STALE_TMP_S = files.STALE_TMP_S
_HOST = files.HOST
_STORE_NAME = re.compile(r"[0-9a-f]{40}" + re.escape(SUFFIX))  # file_name's: the store's own states


def parse_size(text: str) -> int:
    """'512M', '4G', '2GiB', '1.5g', '0', '12345' (bytes) -> bytes. Units are powers of 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise DeltaserveError(f"not a size: {text!r} (write e.g. 512M, 4G or 0)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def saved_state_bytes(config: HybridConfig, positions: int, kv_dtype_bytes: int = 4, kv_type: str | None = None) -> int:
    """What one saved state of `positions` costs: the KV part grows with the positions (in `kv_type` where given,
    else `kv_dtype_bytes` a value), the recurrent part not."""
    per = kv_position_bytes(config, kv_type) if kv_type is not None else config.kv_bytes_per_position(kv_dtype_bytes)
    return per * positions + config.recurrent_state_bytes()


# -- the store ----------------------------------------------------------------------------------------------------

def prefix_hashes(tokens: Sequence[int], upto: int) -> list[int]:
    """The polynomial hash (mod 2^61 - 1) of every prefix of tokens[:upto], shortest first."""
    out, h = [], 0
    for t in tokens[:upto]:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


@dataclass
class Entry:
    tokens: tuple[int, ...]
    nbytes: int
    hash: int
    partition: str | None = None  # whose conversation (a tenant and cache salt's digest); None: single-tenant
    ram: Checkpoint | None = None
    file: Path | None = None
    file_bytes: int = 0
    writing: bool = False
    used: float = field(default_factory=time.time)  # wall clock: compared with the file times of other processes


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    restores_ram: int = 0
    restores_disk: int = 0
    evictions_ram: int = 0
    evictions_disk: int = 0
    saved_tokens: int = 0        # prompt tokens not prefilled thanks to the store
    refused_files: int = 0
    writes: int = 0
    write_errors: int = 0


class StateStore:
    """Saved decode states keyed by the tokens they cover; thread-safe. `say` hears every notice once."""

    def __init__(self, config: HybridConfig, *, ram_bytes: int, directory: str | os.PathLike | None = None,
                 disk_bytes: int = 0, model_sha256: str | Callable[[], str] = "",
                 say: Callable[[str], None] | None = None):
        # entries are keyed by (partition, tokens): a state saved for one partition is never found for another
        if ram_bytes < 0 or disk_bytes < 0:
            raise DeltaserveError(f"state store budgets cannot be negative (RAM {ram_bytes}, disk {disk_bytes})")
        self.config = config
        self.ram_budget = ram_bytes
        self.directory = Path(directory) if directory is not None else None
        self.disk_budget = disk_bytes if self.directory is not None else 0
        self._sha = model_sha256
        self._say = say or (lambda line: None)
        self.notices: list[str] = []
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._entries: dict[tuple[str | None, tuple[int, ...]], Entry] = {}
        self._by_hash: dict[tuple[str | None, int, int], list[Entry]] = {}
        self._lengths: dict[str | None, dict[int, int]] = {}   # partition -> stored length -> how many entries have it
        self.key: bytes | None = None  # the directory's key (deltaserve.session.files): files signed and checked with it
        self.ram_used = 0
        self.disk_used = 0
        self._queue: list[Entry] = []
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._writer: threading.Thread | None = None
        self._dir_mtime: int | None = None        # the directory's mtime (ns) when it was last listed
        self._passed: set[str] = set()           # file names not to read again (another model's, or refused)
        self._refresh_lock = threading.Lock()    # one listing at a time
        if self.directory is not None:
            files.private_dir(self.directory, "--state-dir", self.say)  # conversations: the user's only
            self.key = files.directory_key(self.directory)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="deltaserve-state-writer", daemon=True)
            self._writer.start()

    # -- identity and notices -------------------------------------------------------------------------------
    @property
    def model_sha256(self) -> str:
        if callable(self._sha):
            self._sha = self._sha()
        return self._sha

    def say(self, line: str) -> None:
        self.notices.append(line)
        self._say(line)

    @property
    def on_disk(self) -> bool:
        return self.directory is not None and self.disk_budget > 0

    def describe(self) -> str:
        per_pos = self.config.kv_bytes_per_position()
        base = (f"state store: RAM {human(self.ram_budget)}"
                + (f", disk {human(self.disk_budget)} in {self.directory}" if self.on_disk else
                   ", no disk tier (--state-dir DIR keeps states across restarts)")
                + f"; one saved state costs {human(self.config.recurrent_state_bytes())} recurrent + "
                  f"{per_pos / 1024:.1f} KiB per position (1024 positions: "
                  f"{human(saved_state_bytes(self.config, 1024))})")
        with self._lock:
            if self._entries:
                base += f"; {len(self._entries)} states found on disk ({human(self.disk_used)})"
        return base

    # -- the index ------------------------------------------------------------------------------------------
    def _add(self, e: Entry) -> None:
        self._entries[(e.partition, e.tokens)] = e
        self._by_hash.setdefault((e.partition, len(e.tokens), e.hash), []).append(e)
        lengths = self._lengths.setdefault(e.partition, {})
        lengths[len(e.tokens)] = lengths.get(len(e.tokens), 0) + 1

    def _is_current(self, e: Entry) -> bool:
        return self._entries.get((e.partition, e.tokens)) is e

    def _remove(self, e: Entry) -> None:
        if not self._is_current(e):
            return
        del self._entries[(e.partition, e.tokens)]
        key = (e.partition, len(e.tokens), e.hash)
        bucket = self._by_hash.get(key, [])
        if e in bucket:
            bucket.remove(e)
        if not bucket:
            self._by_hash.pop(key, None)
        n = len(e.tokens)
        lengths = self._lengths[e.partition]
        lengths[n] -= 1
        if not lengths[n]:
            del lengths[n]
            if not lengths:
                del self._lengths[e.partition]
        if e.ram is not None:
            self.ram_used -= e.nbytes
            e.ram = None

    def _longest(self, prompt: Sequence[int], longer_than: int = 0, partition: str | None = None) -> Entry | None:
        lengths = sorted((n for n in self._lengths.get(partition, ()) if longer_than < n < len(prompt)), reverse=True)
        if not lengths:
            return None
        hashes = prefix_hashes(prompt, lengths[0])
        for n in lengths:
            for e in self._by_hash.get((partition, n, hashes[n - 1]), ()):
                if e.tokens == tuple(prompt[:n]):
                    return e
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int], partition: str | None = None) -> int:
        """How many of `prompt`'s tokens the longest state stored for `partition` covers (0: none); reads nothing
        from disk."""
        with self._lock:
            e = self._longest(prompt, partition=partition)
            return len(e.tokens) if e is not None else 0

    # -- take and put -----------------------------------------------------------------------------------------
    def take(self, prompt: Sequence[int], longer_than: int = 0, count_miss: bool = True,
             partition: str | None = None) -> tuple[tuple[int, ...], Checkpoint] | None:
        """The longest state stored for `partition` that is a proper prefix of `prompt` and longer than
        `longer_than`, loaded (from disk if it is only there), or None (a miss, counted when `count_miss`). A file
        that is refused is dropped and the next longest tried."""
        self.refresh()
        while True:
            with self._lock:
                e = self._longest(prompt, longer_than, partition)
                if e is None:
                    self.stats.misses += count_miss
                    return None
                e.used = time.time()
                ck, path = e.ram, e.file
            if ck is not None:
                with self._lock:
                    self.stats.hits += 1
                    self.stats.restores_ram += 1
                    self.stats.saved_tokens += len(e.tokens)
                return e.tokens, ck
            if path is None:  # evicted from RAM while its write failed: gone
                with self._lock:
                    self._remove(e)
                continue
            try:
                tokens, ck = read_state(path, self.config, self.model_sha256, self.key, e.partition)
                if tokens != e.tokens:
                    raise StateFileError(f"{path.name} covers other tokens than its index entry")
            except (StateFileError, OSError) as err:
                if not path.exists():  # another process on the directory removed it (its budget): not damage
                    with self._lock:
                        self._forget_file(e)
                    continue
                self.say(f"[deltaserve] state store: refused {err}; the turn prefills instead")
                with self._lock:
                    self.stats.refused_files += 1
                    if isinstance(err, StateFileError) and not err.ours:  # replaced by something not its own
                        self._forget_file(e)
                        self._passed.add(path.name)
                    else:
                        self._drop_file(e)
                    self._remove(e)
                continue
            with self._lock:
                self.stats.hits += 1
                self.stats.restores_disk += 1
                self.stats.saved_tokens += len(e.tokens)
                if self._is_current(e) and e.ram is None and e.nbytes <= self.ram_budget:
                    e.ram = ck  # recently used: back in RAM
                    self.ram_used += e.nbytes
                    self._enforce()
            return tokens, ck

    def put(self, tokens: Sequence[int], ck: Checkpoint, partition: str | None = None) -> bool:
        """Keep `ck` (covering `tokens`, saved for `partition`; the store owns it from now on, nobody may write to
        it). False when it fits neither tier. A state already stored under the same tokens and partition is only
        marked used."""
        tokens = tuple(int(t) for t in tokens)
        if ck.length != len(tokens) or not tokens:
            raise ValueError(f"a checkpoint of {ck.length} positions does not cover {len(tokens)} tokens")
        if ck.device.type != "cpu":
            ck = _to_cpu(ck)
        nbytes = ck.nbytes
        with self._lock:
            old = self._entries.get((partition, tokens))
            if old is not None:
                old.used = time.time()
                return True
            fits_ram, fits_disk = nbytes <= self.ram_budget, self.on_disk and nbytes <= self.disk_budget
            if not (fits_ram or fits_disk):
                return False
            e = Entry(tokens, nbytes, prefix_hashes(tokens, len(tokens))[-1], partition, ram=ck)
            self.ram_used += nbytes  # until it is written, even a state bound for disk only is held in RAM
            self._add(e)
            if fits_disk:
                e.writing = True
                self._queue.append(e)
                self._wake.notify()
            self._enforce()
            return True

    def _enforce(self) -> None:
        """Least recently used out of RAM (to disk, where a copy is or will be), then off disk. Lock held."""
        if self.ram_used > self.ram_budget:
            for e in sorted((e for e in self._entries.values() if e.ram is not None), key=lambda e: e.used):
                if self.ram_used <= self.ram_budget:
                    break
                if e.writing:
                    continue  # released once written
                if e.file is not None:
                    e.ram = None
                    self.ram_used -= e.nbytes
                else:
                    self._remove(e)
                self.stats.evictions_ram += 1
        if self.disk_used > self.disk_budget:
            for e in sorted((e for e in self._entries.values() if e.file is not None), key=lambda e: e.used):
                if self.disk_used <= self.disk_budget:
                    break
                self._drop_file(e)
                if e.ram is None:
                    self._remove(e)
                self.stats.evictions_disk += 1

    def _drop_file(self, e: Entry) -> None:
        if e.file is None:
            return
        files.unlink_ours(e.file)
        self.disk_used -= e.file_bytes
        e.file, e.file_bytes = None, 0

    # -- the disk tier --------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                e = self._queue[0]
                alive = self._is_current(e)
                ck = e.ram
            path, size, err = None, 0, None
            if alive and ck is not None:
                path = self.directory / file_name(e.tokens, e.partition)
                try:
                    size = write_state(path, e.tokens, ck, self.model_sha256, self.key, e.partition)
                except Exception as x:  # noqa: BLE001 - a full or failing disk costs the disk copy, not the server
                    err = x
            with self._lock:
                self._queue.pop(0)
                e.writing = False
                if err is not None:
                    self.stats.write_errors += 1
                    msg = f"[deltaserve] state store: could not write a state to {self.directory} ({err})"
                elif path is not None:
                    self.stats.writes += 1
                    if self._is_current(e):
                        self.disk_used += size - (e.file_bytes if e.file is not None else 0)
                        e.file, e.file_bytes = path, size
                    else:
                        files.unlink_ours(path)
                    msg = None
                if e.ram is not None and e.nbytes > self.ram_budget:  # bound for disk only
                    e.ram = None
                    self.ram_used -= e.nbytes
                    if e.file is None:
                        self._remove(e)
                self._enforce()
                self._wake.notify_all()
            if err is not None and msg not in self.notices:
                self.say(msg)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every state put so far is on disk (or failed to be); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=5)

    def _scan(self) -> None:
        """At start: remove the temporary files crashed writes left (not those of a write another process on this
        directory is making), then index every state file in it (`refresh`)."""
        files.remove_stale_tmps(self.directory, self.key, SUFFIX)  # only ours: they carry the key's tag
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> int:
        """Index what other processes wrote to the directory since it was last listed, and forget what they removed;
        nothing to do (one stat) when it has not changed. The states it found. A file that is refused is said once
        and removed; one saved for another model or version is left alone (said once per listing that finds some)."""
        d = self.directory
        if d is None:
            return 0
        with self._refresh_lock:
            try:
                mtime = os.stat(d).st_mtime_ns
            except OSError:
                return 0
            if not force and mtime == self._dir_mtime and time.time() - mtime / 1e9 > RECENT_S:
                return 0
            try:
                entries = [x for x in os.scandir(d) if x.name.endswith(SUFFIX) and not x.name.startswith(".")]
                listed = {x.name: x for x in entries if x.is_file(follow_symlinks=False)}
            except OSError:
                return 0
            odd = sorted(x.name for x in entries if x.name not in listed and x.name not in self._passed)
            if odd:  # a FIFO, a directory, a symlink: never opened (a FIFO blocks the reader), never removed
                self._passed.update(odd)
                self.say(f"[deltaserve] state store: {len(odd)} entr{'ies' if len(odd) != 1 else 'y'} in {d} named "
                         f"*{SUFFIX} {'are' if len(odd) != 1 else 'is'} not a regular file ({', '.join(odd[:3])}"
                         f"{', ...' if len(odd) > 3 else ''}): skipped, left alone")
            self._dir_mtime = mtime
            with self._lock:
                known = {e.file.name: e for e in self._entries.values() if e.file is not None}
                for name, e in known.items():
                    if name not in listed:  # another process removed it (its share of the disk budget)
                        self._forget_file(e)
                have = set(self._entries)
            new = []
            for name, x in listed.items():
                if name in known or name in self._passed:
                    continue
                try:
                    st = x.stat()
                except OSError:
                    continue
                new.append((st.st_mtime, st.st_size, Path(x.path)))
            found, foreign, others = 0, 0, []
            for mtime_s, size, path in sorted(new):  # oldest first
                if not _STORE_NAME.fullmatch(path.name):  # not named as the store names its states (a chat's NAME.state)
                    others.append(path.name)
                    self._passed.add(path.name)
                    continue
                try:
                    meta = read_header(path, self.key)
                    try:
                        check_identity(meta, self.model_sha256, path.name)
                    except StateFileError:
                        foreign += 1
                        self._passed.add(path.name)
                        continue
                    tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
                    partition = meta.get("partition")
                    if partition is not None and not isinstance(partition, str):
                        raise StateFileError(f"{path.name}: its partition is not a string")
                    if (not tokens or int(meta.get("length", -1)) != len(tokens)
                            or path.name != file_name(tokens, partition)):
                        raise StateFileError(f"{path.name} does not hold what its name and header say")
                except (StateFileError, ValueError, KeyError, OSError) as err:
                    if not path.exists():
                        continue  # removed by another process while this one looked
                    if isinstance(err, StateFileError) and not err.ours:  # not this store's file: never removed
                        others.append(path.name)
                        self._passed.add(path.name)
                        continue
                    self.stats.refused_files += 1
                    self.say(f"[deltaserve] state store: refused {err}; removed it")
                    files.unlink_ours(path)
                    self._passed.add(path.name)
                    continue
                with self._lock:
                    e = self._entries.get((partition, tokens))
                    if e is not None and (partition, tokens) in have and (e.writing or e.file is not None):
                        continue  # this process's own write, just renamed into place: the writer counts it
                    if e is None:
                        e = Entry(tokens, saved_state_bytes(self.config, len(tokens)),
                                  prefix_hashes(tokens, len(tokens))[-1], partition)
                        e.used = mtime_s
                        self._add(e)
                    if e.file is None:  # another process wrote these tokens' state: this one may read it too
                        e.file, e.file_bytes = path, size
                        self.disk_used += size
                        found += 1
            if others:
                self.say(f"[deltaserve] state store: {len(others)} file{'s' if len(others) != 1 else ''} in {d} "
                         f"named *{SUFFIX} {'are' if len(others) != 1 else 'is'} not this store's ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}): left alone, not used")
            if foreign:
                self.say(f"[deltaserve] state store: {foreign} state file{'s' if foreign != 1 else ''} in {d} "
                         f"belong to another model or deltaserve version: left alone, not used")
            with self._lock:
                self._enforce()
            return found

    def _forget_file(self, e: Entry) -> None:
        """`e`'s file is gone (removed by another process): not counted any more; the entry goes unless RAM holds it.
        Lock held."""
        if e.file is None:
            return
        self.disk_used -= e.file_bytes
        e.file, e.file_bytes = None, 0
        if e.ram is None and not e.writing:
            self._remove(e)

    # -- what the operator sees -------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            s = self.stats
            in_ram = sum(1 for e in self._entries.values() if e.ram is not None)
            on_disk = sum(1 for e in self._entries.values() if e.file is not None)
            return {
                "ram": {"states": in_ram, "bytes": self.ram_used, "budget": self.ram_budget},
                "disk": {"states": on_disk, "bytes": self.disk_used, "budget": self.disk_budget,
                         "directory": str(self.directory) if self.directory is not None else None,
                         "pending_writes": len(self._queue)},
                "states": len(self._entries), "hits": s.hits, "misses": s.misses,
                "restores": {"ram": s.restores_ram, "disk": s.restores_disk},
                "evictions": {"ram": s.evictions_ram, "disk": s.evictions_disk},
                "tokens_not_prefilled": s.saved_tokens, "refused_files": s.refused_files,
                "writes": s.writes, "write_errors": s.write_errors,
            }


def _to_cpu(ck: Checkpoint) -> Checkpoint:
    n = ck.length
    kv = {i: (k[:, :n].to("cpu"), v[:, :n].to("cpu")) for i, (k, v) in ck.kv.items()}
    conv = {i: t.to("cpu") for i, t in ck.conv.items()}
    ssm = {i: t.to("cpu") for i, t in ck.ssm.items()}
    return Checkpoint(ck.config, torch.device("cpu"), n, kv, conv, ssm, length=n, rope_delta=ck.rope_delta)
