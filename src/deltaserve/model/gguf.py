"""Reading GGUF files (memory-mapped, through the `gguf` package) with errors a user can act on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGUF_MAGIC, GGUFValueType

from ..errors import ModelFormatError


@dataclass(frozen=True)
class RawTensor:
    """One stored tensor: its type, logical shape (numpy order: rows, cols) and raw data (memory-mapped)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class _CheckedReader(GGUFReader):
    """GGUFReader that names the byte counts when a file ends before what its header promises."""

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: D401 - same contract as the base
        count = int(count)
        need = offset + count * np.dtype(dtype).itemsize
        if need > len(self.data):
            raise ModelFormatError(
                f"truncated GGUF: data up to byte {need} is needed (at offset {offset}), "
                f"but the file has {len(self.data)} bytes")
        return super()._get(offset, dtype, count, override_order)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, RawTensor]

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # a field the reader cannot decode is kept out, not fatal
        return None


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"no such model file: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, expected a GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) < 4 or int.from_bytes(head, "little") != GGUF_MAGIC:
        raise ModelFormatError(
            f"{path.name} is not a GGUF file: it starts with {head!r}, a GGUF starts with b'GGUF' ({size} bytes)")
    try:
        reader = _CheckedReader(path, "c")  # copy-on-write map: tensors are writable views, nothing is copied
    except ModelFormatError:
        raise
    except Exception as e:  # the reader's own complaints (bad version, duplicated tensor, bad type)
        raise ModelFormatError(f"{path.name} is not a readable GGUF file: {e}") from None
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = _field_value(field)
        if value is not None:
            metadata[name] = value
    tensors: dict[str, RawTensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = t.data
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ModelFormatError(f"truncated GGUF: tensor {t.name} ends at byte {end}, the file has {size} bytes")
        tensors[t.name] = RawTensor(t.name, GGMLQuantizationType(t.tensor_type), shape, data)
    return GGUFFile(path, metadata, tensors)


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return int.from_bytes(f.read(4), "little") == GGUF_MAGIC


__all__ = ["GGUFFile", "RawTensor", "read_gguf", "is_gguf", "GGUFValueType"]
