"""From a model path (a GGUF file or an HF directory) to a host model: config, weights, tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deltaserve.engine import native
from deltaserve.engine.linear import DenseLinear, Int8Linear, Linear
from deltaserve.errors import ModelFormatError
from deltaserve.model import quant
from deltaserve.model.config import HybridConfig

if TYPE_CHECKING:
    from deltaserve.model.tokenizer import Tokenizer
from deltaserve.model.gguf import GGUFFile, is_gguf, read_gguf
from deltaserve.model.weights import Embedding, TensorSummary, Weights, build_weights


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

WEIGHT_MODES = ("fast", "exact")


def weight_mode(mode: str | None = None) -> str:
    """"fast" (default): quantized tensors become int8 per-row tables, f16/bf16 become bf16, f32 stays f32;
    "exact": every tensor dequantized to f32 (the parity reference). DELTASERVE_WEIGHTS picks it too."""
    mode = mode or os.environ.get("DELTASERVE_WEIGHTS", "fast")
    if mode not in WEIGHT_MODES:
        raise ModelFormatError(f"unknown weight mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}")
    return mode


def make_linear(w: torch.Tensor, source_type: str, mode: str) -> Linear:
    """The Linear a tensor of `source_type` (a GGUF type name or a torch dtype name) becomes in `mode`."""
    if mode == "exact" or source_type in ("F32", "float32", "torch.float32"):
        return DenseLinear(w.float())
    if source_type in ("F16", "BF16", "float16", "bfloat16", "torch.float16", "torch.bfloat16"):
        return DenseLinear(w.to(torch.bfloat16))
    return Int8Linear.from_float(w)


class GGUFSource:
    def __init__(self, f: GGUFFile, mode: str = "fast"):
        self.f = f
        self.mode = mode

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

    CHUNK_ELEMENTS = 1 << 21  # convert big tensors this many elements at a time (bounds the f32 transient)

    def linear(self, name: str) -> Linear:
        t = self.f.tensors[name]
        rows, cols = t.shape
        step = max(1, self.CHUNK_ELEMENTS // cols)
        if rows <= step:
            out = make_linear(self.dense(name), t.qtype.name, self.mode)
            _trim_heap()  # the f32 transient's pages back now, not left as holes under the next tensors
        else:
            row_bytes = t.nbytes // rows
            out = None
            for r in range(0, rows, step):
                r1 = min(rows, r + step)
                part = make_linear(quant.dequantize(t.data[r * row_bytes:r1 * row_bytes], t.qtype, (r1 - r, cols)),
                                   t.qtype.name, self.mode)
                if out is None:  # the whole table, filled chunk by chunk (no concatenation copy)
                    out = Int8Linear(torch.empty((rows, cols), dtype=torch.int8), torch.empty(rows)) \
                        if isinstance(part, Int8Linear) else \
                        DenseLinear(torch.empty((rows, cols), dtype=part.weight.dtype))
                if isinstance(out, Int8Linear):
                    out.q[r:r1], out.scale[r:r1] = part.q, part.scale
                else:
                    out.weight[r:r1] = part.weight
                del part
                self.f.release(name, r * row_bytes, r1 * row_bytes)  # this chunk's file pages, now converted
                _trim_heap()
            if isinstance(out, Int8Linear):
                out.scale_bf16 = out.scale.to(torch.bfloat16)
        if isinstance(out, Int8Linear) and t.qtype.name in native.BLOCK_TYPES and cols % 256 == 0:
            # the file's own blocks, for the native decode kernel: a view of the mapping, no copy (its pages
            # come back from the page cache when decode reads them)
            out.keep_blocks([(t.qtype.name, torch.from_numpy(t.data.view(np.uint8).reshape(rows, -1)))])
        self.f.release(name)
        return out

    def embedding(self, name: str) -> Embedding:
        table = self.linear(name)
        return Embedding(table if isinstance(table, Int8Linear) else table.weight)


# ---------------------------------------------------------------------------------------------
# HF safetensors directories
# ---------------------------------------------------------------------------------------------

_HF_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm.weight", "plus_one"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "plus_one"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", None),
    "mlp.up_proj.weight": ("ffn_up.weight", None),
    "mlp.down_proj.weight": ("ffn_down.weight", None),
    "self_attn.q_proj.weight": ("attn_q.weight", None),
    "self_attn.k_proj.weight": ("attn_k.weight", None),
    "self_attn.v_proj.weight": ("attn_v.weight", None),
    "self_attn.o_proj.weight": ("attn_output.weight", None),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "plus_one"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "plus_one"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", None),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", None),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", None),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", None),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "squeeze"),
    "linear_attn.dt_bias": ("ssm_dt.bias", None),
    "linear_attn.A_log": ("ssm_a", "neg_exp"),
    "linear_attn.norm.weight": ("ssm_norm.weight", None),
    "linear_attn.out_proj.weight": ("ssm_out.weight", None),
}


def hf_to_gguf_name(name: str, prefix: str) -> tuple[str, str | None] | None:
    """The GGUF name and transform of an HF tensor name under `prefix` ("model." or "model.language_model.")."""
    if name == "lm_head.weight":
        return "output.weight", None
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest == "embed_tokens.weight":
        return "token_embd.weight", None
    if rest == "norm.weight":
        return "output_norm.weight", "plus_one"
    if rest.startswith("layers."):
        _, idx, tail = rest.split(".", 2)
        if tail in _HF_LAYER_MAP:
            gname, how = _HF_LAYER_MAP[tail]
            return f"blk.{idx}.{gname}", how
    return None


def apply_hf_transform(t: torch.Tensor, how: str | None) -> torch.Tensor:
    if how == "plus_one":
        return t.float() + 1.0
    if how == "neg_exp":
        return -torch.exp(t.float())
    if how == "squeeze":
        return t.reshape(t.shape[0], -1)
    return t


class HFSource:
    """Tensors of an HF Qwen3.5 directory, renamed and transformed to GGUF conventions on read."""

    def __init__(self, directory: Path, prefix: str, mode: str = "fast"):
        from safetensors import safe_open

        self.mode = mode
        self.dir = directory
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{directory}: no *.safetensors files (expected HF Qwen3.5 weights)")
        index_path = directory / "model.safetensors.index.json"
        if index_path.exists():
            try:
                wanted = set(json.loads(index_path.read_text())["weight_map"].values())
            except (ValueError, KeyError) as e:
                raise ModelFormatError(f"{index_path.name} is not a valid safetensors index: {e}") from None
            missing = sorted(w for w in wanted if not (directory / w).exists())
            if missing:
                raise ModelFormatError(f"{directory}: the index names shards that are missing: {', '.join(missing)}")
        self._handles = []
        self._where: dict[str, tuple[Any, str, str | None]] = {}
        for path in files:
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:
                raise ModelFormatError(f"{path.name} is not a readable safetensors file: {e}") from None
            self._handles.append(h)
            for name in h.keys():
                mapped = hf_to_gguf_name(name, prefix)
                if mapped is None:
                    continue  # vision tower, mtp.*, anything not part of the text model
                gname, how = mapped
                self._where[gname] = (h, name, how)

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        h, hf_name, how = self._where[name]
        shape = tuple(h.get_slice(hf_name).get_shape())
        if how == "squeeze":
            shape = (shape[0], int(np.prod(shape[1:])))
        return shape

    def type_name(self, name: str) -> str:
        h, hf_name, _ = self._where[name]
        return str(h.get_slice(hf_name).get_dtype())

    def stored_bytes(self, name: str) -> int:
        sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
        return int(np.prod(self.shape(name))) * sizes.get(self.type_name(name).upper(), 4)

    def dense(self, name: str) -> torch.Tensor:
        h, hf_name, how = self._where[name]
        try:
            t = h.get_tensor(hf_name)
        except Exception as e:
            raise ModelFormatError(f"tensor {hf_name} could not be read: {e}") from None
        return apply_hf_transform(t, how).float().contiguous()

    def linear(self, name: str) -> Linear:
        return make_linear(self.dense(name), self.type_name(name), self.mode)

    def embedding(self, name: str) -> Embedding:
        table = self.linear(name)
        return Embedding(table if isinstance(table, Int8Linear) else table.weight)


def _hf_prefix(config: dict) -> str:
    archs = config.get("architectures") or []
    if any("ConditionalGeneration" in a for a in archs) or "text_config" in config:
        return "model.language_model."
    return "model."


# ---------------------------------------------------------------------------------------------
# The host model
# ---------------------------------------------------------------------------------------------

@dataclass
class HostModel:
    path: Path
    format: str                      # "gguf" | "hf"
    config: HybridConfig
    weights: Weights
    tokenizer: "Tokenizer"
    tensor_summary: list[TensorSummary]
    load_seconds: float
    file_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_mode: str = "fast"

    @property
    def identity(self) -> tuple[str, int, int]:
        return file_identity(self.path)

    def sha256(self) -> str:
        """The model's content hash, computed once per process per (path, size, mtime)."""
        return model_sha256(self.path)


def file_identity(path: Path) -> tuple[str, int, int]:
    p = Path(path).resolve()
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        return (str(p), sum(f.stat().st_size for f in files), max((f.stat().st_mtime_ns for f in files), default=0))
    st = p.stat()
    return (str(p), st.st_size, st.st_mtime_ns)


_HASHES: dict[tuple[str, int, int], str] = {}
_HASH_LOCK = threading.Lock()
HASH_COUNT = {"computed": 0}  # how many times a file was actually hashed (tests check it is once)


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise): the load's transients are gone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def model_sha256(path: Path) -> str:
    key = file_identity(path)
    with _HASH_LOCK:
        if key in _HASHES:
            return _HASHES[key]
        p = Path(key[0])
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        HASH_COUNT["computed"] += 1
        _HASHES[key] = h.hexdigest()
        return _HASHES[key]


def _summaries(src) -> list[TensorSummary]:
    out = []
    for name in sorted(src.names(), key=_tensor_sort_key):
        shape = tuple(src.shape(name))
        out.append(TensorSummary(name, src.type_name(name), shape, src.stored_bytes(name)))
    return out


def _tensor_sort_key(name: str):
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        return (1, int(i), rest)
    return (0 if name.startswith("token") else 2, 0, name)


def load_host(path: str | os.PathLike, weights: str | None = None) -> HostModel:
    """Read a GGUF file or an HF directory into a host model, or raise ModelFormatError naming what is wrong.
    `weights`: "fast" or "exact" (see `weight_mode`)."""
    from deltaserve.model.tokenizer import Tokenizer

    t0 = time.perf_counter()
    mode = weight_mode(weights)
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
        config = HybridConfig.from_hf(raw)
        src = HFSource(p, _hf_prefix(raw), mode)
        if "output.weight" not in src.names() and not config.tie_word_embeddings:
            raise ModelFormatError(f"{p.name}: missing tensor lm_head.weight (tie_word_embeddings is false)")
        tokenizer = Tokenizer.from_hf_dir(p)
        fmt = "hf"
        metadata: dict[str, Any] = {"config.json": raw}
        file_bytes = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    else:
        if not is_gguf(p):
            with open(p, "rb") as fh:
                head = fh.read(4)
            raise ModelFormatError(
                f"{p.name} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF') nor an HF model directory")
        f = read_gguf(p)
        src = GGUFSource(f, mode)
        if "token_embd.weight" not in f.tensors:
            arch = f.arch
            if arch != "qwen35":
                HybridConfig.from_gguf(f.metadata, 0, True)  # raises the arch error
            raise ModelFormatError(f"{p.name}: missing tensor token_embd.weight")
        vocab_rows = f.tensors["token_embd.weight"].shape[0]
        config = HybridConfig.from_gguf(f.metadata, vocab_rows, tied="output.weight" not in f.tensors)
        tokenizer = Tokenizer.from_gguf_fields(f.metadata)
        fmt = "gguf"
        metadata = {k: v for k, v in f.metadata.items() if not k.startswith("tokenizer.ggml.")}
        file_bytes = p.stat().st_size
    weights = build_weights(config, src, p.name)
    summary = _summaries(src)
    host = HostModel(p, fmt, config, weights, tokenizer, summary, time.perf_counter() - t0, file_bytes, metadata)
    host.weight_mode = mode
    del src
    _trim_heap()
    return host


_HOSTS: dict[tuple, HostModel] = {}
_HOSTS_LOCK = threading.Lock()


def cached_host(path: str | os.PathLike, weights: str | None = None) -> HostModel:
    """load_host once per (path, size, mtime, weight mode) in this process: a file rewritten in place is
    read again."""
    if not Path(path).exists():
        raise ModelFormatError(f"no such model: {path}")
    key = (*file_identity(Path(path)), weight_mode(weights))
    with _HOSTS_LOCK:
        host = _HOSTS.get(key)
        if host is None:
            host = load_host(path, weights)
            _HOSTS[key] = host
        return host
