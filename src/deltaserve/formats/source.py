"""A model path opened as what it is: a GGUF file or an HF directory, read into a config, a tokenizer, metadata and
a tensor source (nothing converted: the engine decides what the weights become). And the file's identity and
content hash, computed once per process."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.errors import ModelFormatError
from deltaserve.formats import quant
from deltaserve.formats.config import HybridConfig
from deltaserve.formats.gguf import GGUFFile, GGUFStrings, is_gguf, read_gguf, split_parts
from deltaserve.formats.hf import HFSource, hf_prefix
from deltaserve.formats.layout import TensorSource
from deltaserve.text.tokenizer import Tokenizer


class GGUFSource:
    """The tensors of a GGUF file, as views of its mapping."""

    def __init__(self, f: GGUFFile):
        self.f = f

    def names(self) -> set[str]:
        return set(self.f.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.f.tensors[name].shape

    def type_name(self, name: str) -> str:
        return self.f.tensors[name].qtype.name

    def stored_bytes(self, name: str) -> int:
        return self.f.tensors[name].nbytes

    def dense(self, name: str) -> torch.Tensor:
        t = self.f.tensors[name]
        return quant.dequantize(t.data, t.qtype, t.shape)

    def blocks(self, name: str) -> np.ndarray:
        """[rows, row bytes]: a 3-D tensor (the experts of an MoE layer) as its experts' rows one after another."""
        t = self.f.tensors[name]
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else t.shape[0]
        return t.data.view(np.uint8).reshape(rows, -1)

    def release(self, name: str, lo_byte: int = 0, hi_byte: int | None = None) -> None:
        self.f.release(name, lo_byte, hi_byte)


@dataclass
class ModelFile:
    """What a model path holds, read but not converted."""

    path: Path
    format: str                 # "gguf" | "hf"
    config: HybridConfig
    tokenizer: Tokenizer
    source: TensorSource
    file_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)


def open_model(path: str | Path) -> ModelFile:
    """Read a GGUF file or an HF directory, or raise ModelFormatError naming what is wrong."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"no such model: {p}")
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.exists():
            raise ModelFormatError(f"{p} has no config.json (expected an HF Qwen3.5 directory or a GGUF file)")
        try:
            raw = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise ModelFormatError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelFormatError(f"{cfg_path} holds {type(raw).__name__ if raw is not None else 'null'}, not an "
                                   "object (expected an HF Qwen3.5 config)")
        config = HybridConfig.from_hf(raw)
        src = HFSource(p, hf_prefix(raw), config.num_layers)
        if "output.weight" not in src.names() and not config.tie_word_embeddings:
            raise ModelFormatError(f"{p.name}: missing tensor lm_head.weight (tie_word_embeddings is false)")
        return ModelFile(p, "hf", config, Tokenizer.from_hf_dir(p), src,
                         sum(f.stat().st_size for f in p.glob("*.safetensors")), {"config.json": raw})
    if not is_gguf(p):
        with open(p, "rb") as fh:
            head = fh.read(4)
        raise ModelFormatError(
            f"{p.name} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF') nor an HF model directory")
    f = read_gguf(p)
    if "token_embd.weight" not in f.tensors:
        if f.arch != "qwen35":
            HybridConfig.from_gguf(f.metadata, 0, True)  # raises the arch error
        raise ModelFormatError(f"{p.name}: missing tensor token_embd.weight")
    vocab_rows = f.tensors["token_embd.weight"].shape[0]
    config = HybridConfig.from_gguf(f.metadata, vocab_rows, tied="output.weight" not in f.tensors)
    say_once(p, config.notices)
    metadata = {k: v for k, v in f.metadata.items() if not k.startswith("tokenizer.ggml.")}
    tokenizer = Tokenizer.from_gguf_fields(f.metadata)
    # the vocabulary's and merges' lists (or where they lie in the file) are the tokenizer's now
    f.metadata = {k: v for k, v in f.metadata.items()
                  if not (k.startswith("tokenizer.ggml.") and isinstance(v, (list, GGUFStrings)))}
    return ModelFile(p, "gguf", config, tokenizer, GGUFSource(f), f.disk_bytes, metadata)


_SAID: set[tuple] = set()
_SAID_LOCK = threading.Lock()


def say_once(path: Path, notices) -> None:
    """Print what the reader noticed about a model file to stderr, once per process per file (size, mtime) and
    notice, however often it is opened; the notices stay on the config (`config.notices`) for a caller to show."""
    for line in notices:
        key = (*file_identity(path), line)
        with _SAID_LOCK:
            if key in _SAID:
                continue
            _SAID.add(key)
        print(line, file=sys.stderr, flush=True)


def model_files(p: Path) -> list[Path]:
    """The files a model's content is: an HF directory's safetensors, a split GGUF's parts, or the one file."""
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    parts = split_parts(p)
    return parts if all(f.exists() for f in parts) else [p]


def file_identity(path: Path) -> tuple[str, int, int]:
    """(resolved path, size, mtime) of a file, or of an HF directory's safetensors (a split GGUF's parts) together."""
    files = model_files(Path(path))  # by the names given (a cache's links resolve to blobs without them)
    return (str(Path(path).resolve()), sum(f.stat().st_size for f in files),
            max((f.stat().st_mtime_ns for f in files), default=0))


_HASHES: dict[tuple[str, int, int], str] = {}
_HASH_LOCK = threading.Lock()


def model_sha256(path: Path) -> str:
    """The model's content hash, computed once per process per (path, size, mtime)."""
    key = file_identity(path)
    with _HASH_LOCK:
        if key not in _HASHES:
            _HASHES[key] = hash_files(Path(path))
        return _HASHES[key]


def hash_files(p: Path) -> str:
    files = model_files(p)
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()
