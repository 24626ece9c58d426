"""HF Qwen3.5 directory -> GGUF (arch `qwen35`, or `qwen35moe` for the MoE sibling), in the layout llama.cpp's
converter writes.

The transforms are those of the GGUF convention: norms stored as `1 + w` (not the DeltaNet output
norm), `ssm_a = -exp(A_log)`, conv weights squeezed to [channels, K], and DeltaNet value heads
reordered from grouped to tiled order when there are more value heads than key heads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from deltaserve.errors import DeltaserveError, ModelFormatError
from deltaserve.formats.config import RECURRENT_LAYERS_KEY, HybridConfig
from deltaserve.formats.hf import HFSource, hf_prefix
from deltaserve.formats.layout import check_tensors, mtp_present

TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# DeltaNet tensors whose value-head blocks are reordered: (name suffix, axis, rows per head or "dv")
_V_REORDER = {
    "attn_gate.weight": (0, "dv"),
    "ssm_beta.weight": (0, 1),
    "ssm_alpha.weight": (0, 1),
    "ssm_dt.bias": (0, 1),
    "ssm_a": (0, 1),
    "ssm_out.weight": (1, "dv"),
}


def reorder_value_heads(t: torch.Tensor, dim: int, num_key_heads: int, per_key: int, block: int,
                        to: str = "tiled") -> torch.Tensor:
    """Reorder value-head blocks (of `block` rows or columns) along `dim`: from grouped (key head major) to
    tiled (key head minor), or back with to="grouped"."""
    shape = list(t.shape)
    dim = dim % t.dim()
    outer = [num_key_heads, per_key] if to == "tiled" else [per_key, num_key_heads]
    split = shape[:dim] + outer + [block] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).contiguous().reshape(shape)


def grouped_to_tiled(t: torch.Tensor, dim: int, num_key_heads: int, per_key: int, block: int) -> torch.Tensor:
    return reorder_value_heads(t, dim, num_key_heads, per_key, block, "tiled")


def tiled_layout(name: str, t: torch.Tensor, c: HybridConfig) -> torch.Tensor:
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    if nk == nv or not name.startswith("blk."):
        return t
    r = nv // nk
    suffix = name.split(".", 2)[2]
    if suffix in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * c.key_dim
        return torch.cat([t[:qk], grouped_to_tiled(t[qk:], 0, nk, r, c.linear_value_head_dim)])
    if suffix in _V_REORDER:
        dim, block = _V_REORDER[suffix]
        return grouped_to_tiled(t, dim, nk, r, c.linear_value_head_dim if block == "dv" else block)
    return t


# tensors llama.cpp's converter keeps f32 whatever the output type (and llama-quantize leaves as they are)
_F32_TENSORS = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _storage_type(name: str, t: torch.Tensor, want: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """1-D tensors, the conv kernel and an MoE layer's router and shared expert gate stay f32 (as llama.cpp's
    converter keeps them); q8_0 needs rows of 32."""
    if t.dim() < 2 or name.endswith(_F32_TENSORS):
        return gguf.GGMLQuantizationType.F32
    if want == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] % 32:
        return gguf.GGMLQuantizationType.F16
    return want


def _encode(t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    t = t.float().contiguous()
    if qtype == gguf.GGMLQuantizationType.F32:
        return t.numpy()
    if qtype == gguf.GGMLQuantizationType.F16:
        return t.to(torch.float16).numpy()
    if qtype == gguf.GGMLQuantizationType.BF16:
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        from deltaserve.formats.quant import quantize_q8_0
        return quantize_q8_0(t)
    raise ModelFormatError(f"cannot write tensors of type {qtype.name}")


def balanced_sections(pairs: int) -> list[int]:
    first, second = -(-pairs // 3), -(-(pairs - 1) // 3)
    return [first, second, pairs - first - second]


def rope_sections(c: HybridConfig, raw: dict | None = None) -> list[int]:
    """The multimodal rope sections llama.cpp requires (4 entries). llama.cpp's interleaved M-RoPE gives
    pair i to section i % 3 while i < 3 * sections[i % 3], else to a fourth section whose text position is 0,
    so the sections must cover every rotary pair: balanced, summing to rotary_dim / 2 (the real [11, 11, 10])."""
    text = (raw or {}).get("text_config", raw or {})
    given = ((text.get("rope_parameters") or {}).get("mrope_section")) or [11, 11, 10]
    pairs = c.rotary_dim // 2
    if sum(given) != pairs:
        given = balanced_sections(pairs)
    return (list(given) + [0, 0, 0, 0])[:4]


def write_metadata(w: gguf.GGUFWriter, c: HybridConfig, name: str, file_type: int,
                   sections: list[int] | None = None, mtp: int = 0) -> None:
    """`mtp`: MTP blocks written after the trunk's (block_count counts them; nextn_predict_layers says how many)."""
    w.add_name(name)
    w.add_block_count(c.num_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    if c.intermediate_size:  # an MoE config may have no dense FFN size (llama.cpp's converter then writes none)
        w.add_feed_forward_length(c.intermediate_size)
    if c.is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.rotary_dim)
    w.add_rope_dimension_sections(sections or rope_sections(c))
    # the per-layer map, as llama.cpp's converter writes it (llama.cpp reads it first); the interval too where the
    # pattern is "full attention every N layers", for readers that know only the interval
    w.add_array(RECURRENT_LAYERS_KEY.format(arch=w.arch),
                [not c.is_attention(i) for i in range(c.num_layers)] + [False] * mtp)
    interval = _interval(c)
    if interval is not None:
        w.add_full_attention_interval(interval)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.value_dim)
    w.add_file_type(file_type)


def _interval(c: HybridConfig) -> int | None:
    """N where full attention comes every N layers, else None (the layer map alone says it)."""
    attn = c.attention_layers
    interval = attn[0] + 1 if attn else c.num_layers + 1
    if HybridConfig.layer_types_for(c.num_layers, interval) != c.layer_types:
        return None
    return interval


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, out_type: str = "f32",
            progress: Callable[[str], None] | None = None) -> Path:
    """Write `out` (a GGUF) from the HF Qwen3.5 directory `hf_dir`. Returns the path written."""
    from deltaserve.text.tokenizer import Tokenizer

    src_dir, out = Path(hf_dir), Path(out)
    if out_type not in TYPES:
        raise ModelFormatError(f"unknown output type {out_type!r}; expected one of {', '.join(TYPES)}")
    if not (src_dir / "config.json").exists():
        raise ModelFormatError(f"{src_dir} has no config.json (expected an HF Qwen3.5 directory)")
    if not out.parent.resolve().is_dir():
        raise DeltaserveError(f"cannot write {out}: the directory {out.parent} does not exist")
    if out.is_dir():
        raise DeltaserveError(f"cannot write {out}: it is a directory (name the output file)")
    raw = json.loads((src_dir / "config.json").read_text())
    c = HybridConfig.from_hf(raw)
    if c.linear_key_head_dim != c.linear_value_head_dim:
        raise ModelFormatError(f"GGUF qwen35 needs equal DeltaNet key and value head dims, found "
                               f"{c.linear_key_head_dim} and {c.linear_value_head_dim}")
    src = HFSource(src_dir, hf_prefix(raw), c.num_layers)
    check_tensors(c, src, src_dir.name)
    tokenizer = Tokenizer.from_hf_dir(src_dir)
    want, file_type = TYPES[out_type]

    tmp = out.with_suffix(out.suffix + ".part")
    w = gguf.GGUFWriter(str(tmp), c.arch)
    mtp = int(mtp_present(c, src, src_dir.name))
    write_metadata(w, c, src_dir.name, int(file_type), rope_sections(c, raw), mtp)
    tokenizer.write_gguf(w, c.vocab_size)
    names = sorted(src.names(), key=lambda n: (0, 0, n) if not n.startswith("blk.") else (1, int(n.split(".")[1]), n))
    if c.tie_word_embeddings and "output.weight" in names:
        names.remove("output.weight")  # tied: llama.cpp reuses token_embd
    for name in names:
        for gname, t in split_experts(name, tiled_layout(name, src.dense(name), c)):
            qtype = add_tensor(w, gname, t, want)
            if progress:
                progress(f"{gname} {qtype.name} {tuple(t.shape)}")
    return finish(w, tmp, out)


def split_experts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused gate_up tensor of the experts ([experts, 2 x rows, hidden], transformers' layout) as the two tensors
    llama.cpp's converter writes, ffn_gate_exps and ffn_up_exps; any other tensor as it is."""
    if not name.endswith("ffn_gate_up_exps.weight"):
        return [(name, t)]
    rows = t.shape[1] // 2
    stem = name[: -len("ffn_gate_up_exps.weight")]
    return [(stem + "ffn_gate_exps.weight", t[:, :rows].contiguous()),
            (stem + "ffn_up_exps.weight", t[:, rows:].contiguous())]


def add_tensor(w: gguf.GGUFWriter, name: str, t: torch.Tensor, want: gguf.GGMLQuantizationType):
    """Encode `t` in the storage type its name and shape call for (see `_storage_type`) and add it."""
    qtype = _storage_type(name, t, want)
    data = _encode(t, qtype)
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, np.ascontiguousarray(data), raw_shape=data.shape, raw_dtype=qtype)
    return qtype


def finish(w: gguf.GGUFWriter, tmp: Path, out: Path) -> Path:
    """Write everything added to the writer, then move the finished file into place."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out
