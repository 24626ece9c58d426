"""The host model: a model file opened (formats/) and its weights built for the forward (engine/weights.py),
once per (path, size, mtime, weight mode) in a process."""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.engine.weights import Weights, build_weights, draft_weights, trim_heap, weight_mode
from deltaserve.errors import ModelFormatError
from deltaserve.formats.config import HybridConfig
from deltaserve.formats.layout import TensorSummary, summaries
from deltaserve.formats.source import file_identity, model_sha256, open_model
from deltaserve.text.tokenizer import Tokenizer


@dataclass
class HostModel:
    path: Path
    format: str                      # "gguf" | "hf"
    config: HybridConfig
    weights: Weights
    tokenizer: Tokenizer
    tensor_summary: list[TensorSummary]
    file_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_mode: str = "fast"
    mmproj: Path | None = None       # llama.cpp's projector GGUF: the vision encoder of a GGUF model (--mmproj)

    def sha256(self) -> str:
        """The model's content hash, computed once per process per (path, size, mtime)."""
        return model_sha256(self.path)

    @property
    def vision(self):
        """The checkpoint's vision side (deltaserve.vision.model.Vision: encoder, processor, image tokens), read on
        first use: from the projector GGUF given (`mmproj`), else from an HF directory's model.visual.*; None for a
        model without one (a GGUF file alone, a text-only checkpoint)."""
        if "vision" not in self.__dict__:
            if self.mmproj is not None:
                from deltaserve.vision.mmproj import load_mmproj

                ids = [self.tokenizer.token_to_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")]
                if ids[0] is None:
                    raise ModelFormatError(f"--mmproj {self.mmproj.name}: this model's tokenizer has no <|image_pad|> "
                                           "token for the images' places")
                vision = load_mmproj(self.mmproj, *ids)
            else:
                from deltaserve.vision.model import load_vision

                vision = load_vision(self.path) if self.format == "hf" else None
            self.__dict__["vision"] = vision
        return self.__dict__["vision"]


def load_host(path: str | os.PathLike, weights: str | None = None, draft: str | os.PathLike | None = None,
              mmproj: str | os.PathLike | None = None) -> HostModel:
    """Read a GGUF file or an HF directory into a host model, or raise ModelFormatError naming what is wrong.
    `weights`: "fast" or "exact" (see `engine.weights.weight_mode`). `draft`: a separate file carrying the model's
    MTP block (llama.cpp's converter with --mtp writes `mtp-*.gguf`), used instead of the model file's own."""
    mode = weight_mode(weights)
    # The cyclic collector paused meanwhile: the vocabulary's ~500,000 strings and merge pairs are no cycles, and
    # its full passes over them and torch's objects cost ~0.1 s of a 0.8B file's load.
    paused = gc.isenabled()
    gc.disable()
    try:
        m = open_model(path)
        built = build_weights(m.config, m.source, m.path.name, mode)
        if draft is not None:
            d = open_model(draft)
            built.mtp = draft_weights(m.config, d.source, d.config, d.path.name, built, mode)
            del d
        host = HostModel(m.path, m.format, m.config, built, m.tokenizer, summaries(m.source), m.file_bytes,
                         m.metadata, mode, Path(mmproj) if mmproj is not None else None)
        del m
    finally:
        if paused:
            gc.enable()
    trim_heap()
    return host


_HOSTS: dict[tuple, HostModel] = {}
_HOSTS_LOCK = threading.Lock()


def cached_host(path: str | os.PathLike, weights: str | None = None,
                draft: str | os.PathLike | None = None, mmproj: str | os.PathLike | None = None) -> HostModel:
    """load_host once per (path, size, mtime, weight mode, draft file) in this process: a file rewritten in place is
    read again."""
    if not Path(path).exists():
        raise ModelFormatError(f"no such model: {path}")
    if draft is not None and not Path(draft).exists():
        raise ModelFormatError(f"no such draft file: {draft}")
    if mmproj is not None and not Path(mmproj).is_file():
        raise ModelFormatError(f"no such projector file (--mmproj): {mmproj}")
    key = (*file_identity(Path(path)), weight_mode(weights),
           file_identity(Path(draft)) if draft is not None else None,
           file_identity(Path(mmproj)) if mmproj is not None else None)
    with _HOSTS_LOCK:
        host = _HOSTS.get(key)
        if host is None:
            host = load_host(path, weights, draft, mmproj)
            _HOSTS[key] = host
        return host
