"""The qwen35 tensor layout: which tensors a file must hold, at which shapes, and the reading of a source.

Names and conventions are GGUF's (llama.cpp's converter): norm weights are multiplicative (HF's zero-centred `w`
is stored as `1 + w`) except the DeltaNet output norm, `ssm_a` is `-exp(A_log)`, conv weights are [channels, K].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltaserve.errors import ModelFormatError
from deltaserve.formats.config import HybridConfig


class TensorSource(Protocol):
    """Tensors by GGUF name, already in GGUF conventions (a GGUF file, or an HF directory renamed on read)."""

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def type_name(self, name: str) -> str: ...     # a GGUF type name (Q8_0, F16...) or a torch dtype name
    def stored_bytes(self, name: str) -> int: ...
    def dense(self, name: str) -> torch.Tensor: ...  # float32
    def blocks(self, name: str) -> np.ndarray | None: ...  # the file's own bytes [rows, row bytes] (GGUF), else None
    def release(self, name: str, lo_byte: int = 0, hi_byte: int | None = None) -> None: ...  # pages not needed again


@dataclass
class TensorSummary:
    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int


def expected_shapes(c: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a qwen35 (or qwen35moe) file must hold (GGUF names, numpy order), except the optional
    `output.weight` and the MoE tensors a file may hold in either of two forms (`moe_forms`)."""
    h, inter = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, h),
        "output_norm.weight": (h,),
    }
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,),
            p + "post_attention_norm.weight": (h,),
        })
        if c.is_moe:
            e, ff, sff = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            shapes.update({
                p + "ffn_gate_inp.weight": (e, h),
                p + "ffn_down_exps.weight": (e, h, ff),
                p + "ffn_gate_shexp.weight": (sff, h),
                p + "ffn_up_shexp.weight": (sff, h),
                p + "ffn_down_shexp.weight": (h, sff),
            })
        else:
            shapes.update({
                p + "ffn_gate.weight": (inter, h),
                p + "ffn_up.weight": (inter, h),
                p + "ffn_down.weight": (h, inter),
            })
        if c.is_attention(i):
            nh, nkv, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
            shapes.update({
                p + "attn_q.weight": (nh * hd * 2, h),
                p + "attn_k.weight": (nkv * hd, h),
                p + "attn_v.weight": (nkv * hd, h),
                p + "attn_output.weight": (h, nh * hd),
                p + "attn_q_norm.weight": (hd,),
                p + "attn_k_norm.weight": (hd,),
            })
        else:
            nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
            shapes.update({
                p + "attn_qkv.weight": (c.conv_dim, h),
                p + "attn_gate.weight": (nv * dv, h),
                p + "ssm_beta.weight": (nv, h),
                p + "ssm_alpha.weight": (nv, h),
                p + "ssm_conv1d.weight": (c.conv_dim, c.conv_kernel),
                p + "ssm_dt.bias": (nv,),
                p + "ssm_a": (nv,),
                p + "ssm_norm.weight": (dv,),
                p + "ssm_out.weight": (h, nv * dv),
            })
    return shapes


def moe_forms(c: HybridConfig, layer: int) -> list[list[dict[str, tuple[int, ...]]]]:
    """The MoE tensors of a layer that files hold in one of two forms, each a list of the forms it may take: the
    routed experts' gate and up projections as two 3-D tensors (llama.cpp's converter) or one fused
    `ffn_gate_up_exps` (gate rows, then up rows, per expert); the shared expert's gate as a vector or one row."""
    if not c.is_moe:
        return []
    p, e, ff, h = f"blk.{layer}.", c.num_experts, c.moe_intermediate_size, c.hidden_size
    return [[{p + "ffn_gate_exps.weight": (e, ff, h), p + "ffn_up_exps.weight": (e, ff, h)},
             {p + "ffn_gate_up_exps.weight": (e, 2 * ff, h)}],
            [{p + "ffn_gate_inp_shexp.weight": (h,)}, {p + "ffn_gate_inp_shexp.weight": (1, h)}]]


def check_tensors(c: HybridConfig, src: TensorSource, where: str) -> None:
    """Every expected tensor present with its expected shape, or one clear error naming both."""
    have = src.names()
    for name, shape in expected_shapes(c).items():
        if name not in have:
            raise ModelFormatError(f"{where}: missing tensor {name} (expected shape {shape} for this config)")
        found = src.shape(name)
        if tuple(found) != tuple(shape):
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(found)}, expected {shape}")
    for i in range(c.num_layers):
        for forms in moe_forms(c, i):
            if not any(all(n in have and tuple(src.shape(n)) == s for n, s in form.items()) for form in forms):
                found = {n: tuple(src.shape(n)) for form in forms for n in form if n in have}
                want = " or ".join(", ".join(f"{n} {s}" for n, s in form.items()) for form in forms)
                raise ModelFormatError(f"{where}: expected {want} for this config; found "
                                       + (", ".join(f"{n} {s}" for n, s in found.items()) or "none of them"))
    if "output.weight" in have and tuple(src.shape("output.weight")) != (c.vocab_size, c.hidden_size):
        raise ModelFormatError(f"{where}: tensor output.weight has shape {tuple(src.shape('output.weight'))}, "
                               f"expected {(c.vocab_size, c.hidden_size)}")


def mtp_shapes(c: HybridConfig) -> dict[str, tuple[int, ...]]:
    """The MTP block's tensors (llama.cpp's converter: `blk.{N}.*` after the N trunk blocks), except the optional
    nextn.embed_tokens / shared_head_head / shared_head_norm (the trunk's are used where absent)."""
    h, n = c.hidden_size, c.num_layers
    attention_layer = next(i for i in range(n) if c.is_attention(i))
    trunk = expected_shapes(c)
    p, q = f"blk.{n}.", f"blk.{attention_layer}."
    shapes = {p + name[len(q):]: shape for name, shape in trunk.items() if name.startswith(q)}
    shapes.update({p + "nextn.eh_proj.weight": (h, 2 * h), p + "nextn.enorm.weight": (h,),
                   p + "nextn.hnorm.weight": (h,)})
    return shapes


def mtp_present(c: HybridConfig, src: TensorSource, where: str) -> bool:
    """Whether the source carries an MTP block (its eh_proj), every tensor of it then checked as the trunk's are."""
    have = src.names()
    p = f"blk.{c.num_layers}."
    if p + "nextn.eh_proj.weight" not in have:
        return False
    for name, shape in mtp_shapes(c).items():
        if name not in have:
            raise ModelFormatError(f"{where}: the MTP block is incomplete: missing tensor {name} (expected shape "
                                   f"{shape})")
        if tuple(src.shape(name)) != tuple(shape):
            raise ModelFormatError(f"{where}: MTP tensor {name} has shape {tuple(src.shape(name))}, expected {shape}")
    for forms in moe_forms(c, c.num_layers):
        if not any(all(n in have and tuple(src.shape(n)) == s for n, s in form.items()) for form in forms):
            raise ModelFormatError(f"{where}: the MTP block's MoE tensors are incomplete")
    return True


def summaries(src: TensorSource) -> list[TensorSummary]:
    return [TensorSummary(name, src.type_name(name), tuple(src.shape(name)), src.stored_bytes(name))
            for name in sorted(src.names(), key=tensor_sort_key)]


def tensor_sort_key(name: str):
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        return (1, int(i), rest)
    return (0 if name.startswith("token") else 2, 0, name)
