"""Rewrite a GGUF with one thing changed (arch, a tensor dropped or reshaped): bad files for the error tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType


def rewrite(src: Path, dst: Path, arch: str | None = None, drop: str | None = None,
            reshape: tuple[str, int] | None = None, meta: dict | None = None,
            fill: tuple[str, float] | None = None, replace: dict | None = None) -> Path:
    """Copy `src` to `dst`: `arch` renames the architecture (and its key prefix), `drop` leaves a tensor out,
    `reshape=(name, rows)` keeps only the first `rows` rows of a 2-D f32 tensor, `meta` overrides values, `fill=(name, value)` sets every value of an f32 tensor,
    `replace={name: (type, raw bytes [rows, row bytes])}` stores a tensor as other blocks of the same logical shape."""
    r = GGUFReader(src)
    old_arch = r.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), new_arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = new_arch + name[len(old_arch):] if name.startswith(old_arch + ".") else name
        vtype = field.types[0]
        value = field.contents()
        if meta and key in meta:
            value = meta[key]
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name == drop:
            continue
        if replace and t.name in replace:
            qtype, raw = replace[t.name]
            w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            continue
        data = np.array(t.data)
        if reshape and t.name == reshape[0]:
            data = data[: reshape[1]]
        if fill and t.name == fill[0]:
            data = np.full_like(data, fill[1])
        add_tensor(w, t.name, data, t.tensor_type)
    finish(w)
    return dst


def add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, tensor_type) -> None:
    """A tensor as the reader gave it: f32 and f16 as values, every other type as its raw blocks."""
    if tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=tensor_type)


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
