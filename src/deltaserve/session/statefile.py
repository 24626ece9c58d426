"""One saved decode state as a file: what it holds, how it is written, and what is checked before it is used.

A state file is a safetensors file: the parts' tensors (KV cut to the positions it holds, conv and recurrent state)
and, in its metadata, what it is valid for: the model's sha256, the deltaserve version, the token ids, the partition
(the tenant and cache salt whose conversation it is; none for a single-tenant server and for `chat --resume`), and
an HMAC-SHA256 under the directory's key (deltaserve.session.files) over all of that and every tensor's name, type,
shape and bytes. A CRC would find a flipped byte, not a neighbour who relabels one conversation's tensors with
another's tokens and recomputes it; the HMAC needs the key, which is this user's alone (0600).

Reading never trusts the name: the file is opened once (no symlink followed, no FIFO blocking the reader), checked
on the descriptor (a regular file of this user's, 0600, of exactly the size its header and the model's shapes give),
and its header and tensors are read from that descriptor. A file that fails is a `StateFileError`; `ours` says
whether it carries this directory's owner tag (a damaged state of ours, which its store may remove) or not (never
removed: somebody else's file).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Sequence

import torch

from deltaserve.engine.q8cache import Q8Cache
from deltaserve.engine.state import KV_DTYPES, Checkpoint, kv_type_of
from deltaserve.errors import DeltaserveError
from deltaserve.formats.config import HybridConfig
from deltaserve.session import files
from deltaserve.version import __version__

FORMAT = "deltaserve-state/4"  # /4: the KV cache's type (/3: an HMAC under the directory's key and a partition)
SUFFIX = ".state"
MAX_HEADER = 64 << 20  # a state file's header (its token list) is far below this
MAC_FIELDS = ("format", "model_sha256", "deltaserve", "tokens", "length", "rope_delta", "partition", "kv_type")
# a KV type's safetensors dtype name (the recurrent and conv state are F32 in every type); a q8_0 cache is two
# tensors a part: its int8 values (kv.i.k, I8) and their f16 scales, one per 32 along head_dim (kv.i.k.scale, F16)
SAFETENSORS_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "I8"}
SCALE = ".scale"


class StateFileError(DeltaserveError):
    """A state file that cannot be used: foreign, truncated, corrupt, forged, or for another model or partition.
    `ours`: the file carries this directory's owner tag (a damaged state of ours: the store may remove it); otherwise
    it is someone else's file (not a state file, another format or key, not a regular file) and is never removed."""

    def __init__(self, message: str, ours: bool = True):
        super().__init__(message)
        self.ours = ours


def checkpoint_tensors(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """The parts of a checkpoint as named, contiguous CPU tensors (KV cut to the positions it holds)."""
    n = ck.length
    out: dict[str, torch.Tensor] = {}
    for i, pair in ck.kv.items():
        for name, t in zip("kv", pair):
            t = t[:, :n].contiguous().cpu()
            if isinstance(t, Q8Cache):
                out[f"kv.{i}.{name}"], out[f"kv.{i}.{name}{SCALE}"] = t.qs, t.d
            else:
                out[f"kv.{i}.{name}"] = t
    for i, t in ck.conv.items():
        out[f"conv.{i}"] = t.contiguous().cpu()
    for i, t in ck.ssm.items():
        out[f"ssm.{i}"] = t.contiguous().cpu()
    return out


def expected_parts(config: HybridConfig, n: int,
                   kv_dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each part a state of `n` positions holds: its shape and type (the KV cache in `kv_dtype`, the rest f32; a
    q8_0 cache's values int8 and their scales f16)."""
    c = config
    parts: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in range(c.num_layers):
        if c.is_attention(i):
            for kv in "kv":
                parts[f"kv.{i}.{kv}"] = ((c.num_kv_heads, n, c.head_dim), kv_dtype)
                if kv_dtype == Q8Cache.dtype:
                    parts[f"kv.{i}.{kv}{SCALE}"] = ((c.num_kv_heads, n, c.head_dim // 32), torch.float16)
        else:
            parts[f"conv.{i}"] = ((c.conv_kernel - 1, c.conv_dim), torch.float32)
            parts[f"ssm.{i}"] = ((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                 torch.float32)
    return parts


def _mac(key: bytes, meta: dict, parts: dict[str, tuple[tuple[int, ...], memoryview]]) -> str:
    """HMAC-SHA256 of what decides what a state is valid for (the KV type among it) and of every tensor (name,
    shape, bytes)."""
    h = files.mac(key)
    h.update(json.dumps({k: meta.get(k) for k in MAC_FIELDS}, sort_keys=True).encode())
    for name in sorted(parts):
        shape, data = parts[name]
        h.update(json.dumps([name, list(shape), len(data)]).encode())
        h.update(data)
    return h.hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def file_name(tokens: Sequence[int], partition: str | None = None) -> str:
    """A state's file name: a digest of its tokens (and its partition: one conversation's tokens in two partitions
    are two files)."""
    text = json.dumps(list(map(int, tokens)), separators=(",", ":"))
    if partition is not None:
        text = f"{partition}:{text}"
    return hashlib.sha256(text.encode()).hexdigest()[:40] + SUFFIX


def write_state(path: Path, tokens: Sequence[int], ck: Checkpoint, model_sha256: str, key: bytes | None = None,
                partition: str | None = None) -> int:
    """Write `ck` (covering `tokens`) to `path` atomically, signed with `key` (None: the key of the file's directory,
    made there once); the bytes written."""
    from safetensors.torch import save

    if ck.length != len(tokens):
        raise ValueError(f"a checkpoint of {ck.length} positions does not cover {len(tokens)} tokens")
    path = Path(path)
    key = key if key is not None else files.directory_key(path.parent)
    tensors = checkpoint_tensors(ck)
    meta = {"format": FORMAT, "model_sha256": model_sha256, "deltaserve": __version__,
            "tokens": json.dumps(list(map(int, tokens)), separators=(",", ":")), "length": str(ck.length),
            "owner": files.owner_tag(key), "kv_type": kv_type_of(ck.kv_dtype)}
    if ck.rope_delta:
        meta["rope_delta"] = str(ck.rope_delta)
    if partition is not None:
        meta["partition"] = partition
    meta["mac"] = _mac(key, meta, {k: (tuple(t.shape), _bytes_of(t)) for k, t in tensors.items()})
    return files.write_atomic(path, save(tensors, metadata=meta), key)


def _head(fd: int, size: int, name: str, key: bytes | None) -> tuple[dict, dict, int]:
    """(metadata, tensor entries, where the data starts) of an open state file; its format checked, and its owner tag
    where `key` is given."""
    if size < 8:
        raise StateFileError(f"{name} is not a state file ({size} bytes)", ours=False)
    n = int.from_bytes(bytes(files.read_all(fd, 8)), "little")
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise StateFileError(f"{name} is not a state file (a header of {n} bytes in a file of {size})", ours=False)
    try:
        head = json.loads(bytes(files.read_all(fd, n, 8)))
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise StateFileError(f"{name} is not a state file (its header is not JSON)", ours=False) from None
    meta = head.pop("__metadata__", None) if isinstance(head, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise StateFileError(f"{name} is not a deltaserve state file of this format (format {found!r}, this store "
                             f"writes {FORMAT!r})", ours=False)
    if key is not None and not hmac.compare_digest(str(meta.get("owner", "")), files.owner_tag(key)):
        raise StateFileError(f"{name} was not written with this directory's key (another directory's state, or "
                             "somebody else's file)", ours=False)
    return meta, head, 8 + n


def _open(path: Path) -> tuple[int, os.stat_result]:
    try:
        return files.open_checked(path)
    except files.UnsafeFile as e:
        raise StateFileError(f"{e}" + (", not a state file" if e.kind in ("fifo", "directory", "special") else ""),
                             ours=False) from None


def read_header(path: Path, key: bytes | None = None) -> dict:
    """A state file's metadata, checked for its format (and, with `key`, its owner tag), without reading its
    tensors; nothing in it is authenticated until `read_state` checks the HMAC."""
    fd, st = _open(Path(path))
    try:
        return _head(fd, st.st_size, Path(path).name, key)[0]
    except files.UnsafeFile as e:
        raise StateFileError(f"{Path(path).name}: {e}", ours=False) from None
    finally:
        os.close(fd)


def check_identity(meta: dict, model_sha256: str, name: str) -> None:
    if meta.get("model_sha256") != model_sha256:
        raise StateFileError(f"{name} was saved for another model (sha256 {str(meta.get('model_sha256'))[:12]}..., "
                             f"this one is {model_sha256[:12]}...)")
    if meta.get("deltaserve") != __version__:
        raise StateFileError(f"{name} was saved by deltaserve {meta.get('deltaserve')}, this is {__version__}")


def read_state(path: Path, config: HybridConfig, model_sha256: str, key: bytes | None = None,
               partition: str | None = None) -> tuple[tuple[int, ...], Checkpoint]:
    """The tokens a state file covers and its checkpoint, or StateFileError saying why it is refused: not this
    directory's (`key`; None: the key of the file's directory), another model or version, another partition, a size
    its shapes do not give, or an HMAC that does not match (damaged, forged, relabelled)."""
    path = Path(path)
    key = key if key is not None else files.directory_key(path.parent)
    fd, st = _open(path)
    try:
        meta, head, start = _head(fd, st.st_size, path.name, key)
        check_identity(meta, model_sha256, path.name)
        if meta.get("partition") != partition:
            raise StateFileError(f"{path.name} belongs to another partition (another API key or cache_salt): not "
                                 "used for this one")
        try:
            tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            n = int(meta["length"])
            delta = int(meta.get("rope_delta", 0))
        except (KeyError, ValueError, TypeError):
            raise StateFileError(f"{path.name}: its header's tokens or length are malformed") from None
        if n != len(tokens) or n < 1:
            raise StateFileError(f"{path.name} says it holds {n} positions for {len(tokens)} tokens")
        kv_type = meta.get("kv_type")
        if kv_type not in KV_DTYPES:
            raise StateFileError(f"{path.name} says its KV cache is {kv_type!r}, not one of {', '.join(KV_DTYPES)}")
        expected = expected_parts(config, n, KV_DTYPES[kv_type])
        if set(head) != set(expected):
            raise StateFileError(f"{path.name} holds parts {sorted(set(head) ^ set(expected))[:4]} this model's state "
                                 f"does not have (or lacks them)")
        spans = []
        for name, (shape, dtype) in expected.items():
            info = head[name]
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            type_name = kv_type_of(dtype)
            if (not isinstance(info, dict) or info.get("dtype") != SAFETENSORS_DTYPES[type_name]
                    or info.get("shape") != list(shape) or not isinstance(offsets, list) or len(offsets) != 2):
                raise StateFileError(f"{path.name}: {name} is not the {type_name} {shape} this model needs")
            spans.append((offsets[0], offsets[1], name, shape, dtype))
        total = sum(_size(dtype) * _count(shape) for _, _, _, shape, dtype in spans)
        if st.st_size != start + total:
            raise StateFileError(f"{path.name} is not whole (truncated, or padded): it holds {st.st_size} bytes where "
                                 f"its header and this model's shapes give {start + total}")
        spans.sort()
        at = 0
        for a, b, name, shape, dtype in spans:
            if a != at or b - a != _size(dtype) * _count(shape):
                raise StateFileError(f"{path.name}: {name}'s data is not where its header says")
            at = b
        data = files.read_all(fd, total, start)
    except files.UnsafeFile as e:
        raise StateFileError(f"{path.name}: {e}") from None
    finally:
        os.close(fd)
    view = memoryview(data)
    parts = {name: (shape, view[a:b]) for a, b, name, shape, _ in spans}
    if not hmac.compare_digest(_mac(key, meta, parts), str(meta.get("mac", ""))):
        raise StateFileError(f"{path.name} is corrupt or forged (its HMAC does not match its tokens and tensors)")
    tensors = {name: torch.frombuffer(data, dtype=dtype, offset=a, count=(b - a) // _size(dtype)).reshape(shape)
               for a, b, name, shape, dtype in spans} if total else {}
    def cache(name: str):
        return Q8Cache(tensors[name], tensors[name + SCALE]) if name + SCALE in tensors else tensors[name]

    kv = {i: (cache(f"kv.{i}.k"), cache(f"kv.{i}.v")) for i in range(config.num_layers) if config.is_attention(i)}
    conv = {i: tensors[f"conv.{i}"] for i in config.deltanet_layers}
    ssm = {i: tensors[f"ssm.{i}"] for i in config.deltanet_layers}
    return tokens, Checkpoint(config, torch.device("cpu"), n, kv, conv, ssm, length=n, rope_delta=delta)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _count(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
