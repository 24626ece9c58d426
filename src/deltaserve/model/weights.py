"""The host model's weights, in one layout whatever the file: GGUF tensor names and conventions.

Conventions (those of llama.cpp's converter): norm weights are multiplicative (HF's zero-centred
`w` is stored as `1 + w`), except the DeltaNet output norm which is plain in both; `ssm_a` is
`-exp(A_log)`; conv weights are [channels, K]. Value-head order is whatever the file has
(`HybridConfig.value_head_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from deltaserve.engine.linear import DenseLinear, Int8Linear, Linear, StackedLinear
from deltaserve.errors import ModelFormatError
from deltaserve.model.config import HybridConfig


class Embedding:
    """Token embedding rows [vocab, hidden], looked up by row: a dense tensor or an int8 table. A tied LM
    head is the same table seen as a Linear (no second copy)."""

    def __init__(self, table: torch.Tensor | Int8Linear):
        self.table = table
        self.num_embeddings, self.dim = (table.out_features, table.in_features) if isinstance(table, Int8Linear) \
            else tuple(table.shape)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.dense() if isinstance(self.table, Int8Linear) else self.table

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, Int8Linear):
            return self.table.rows(ids)
        return self.table.index_select(0, ids).float()

    def as_linear(self) -> Linear:
        return self.table if isinstance(self.table, Int8Linear) else DenseLinear(self.table)

    @property
    def nbytes(self) -> int:
        t = self.table
        return t.nbytes if isinstance(t, Int8Linear) else t.numel() * t.element_size()

    def to(self, device) -> "Embedding":
        return Embedding(self.table.to(device))


@dataclass
class AttentionWeights:
    qkv: StackedLinear     # attn_q (query | gate per head), attn_k, attn_v
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class DeltaNetWeights:
    in_proj: StackedLinear  # attn_qkv, attn_gate (z), ssm_beta (b), ssm_alpha (a)
    out: Linear
    conv: torch.Tensor     # [conv_dim, K]
    dt_bias: torch.Tensor  # [nv]
    a_neg: torch.Tensor    # [nv] = -exp(A_log)
    norm: torch.Tensor     # [dv]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttentionWeights | DeltaNetWeights
    gate_up: StackedLinear  # ffn_gate, ffn_up
    down: Linear


@dataclass
class Weights:
    embed: Embedding
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear
    tied: bool = False

    def to(self, device) -> "Weights":
        """A copy of every tensor on `device` (the upload)."""
        def mv(obj):
            if isinstance(obj, torch.Tensor):
                return obj.to(device)
            if isinstance(obj, (Linear, Embedding)):
                return obj.to(device)
            return obj
        layers = []
        for lw in self.layers:
            m = lw.mixer
            mixer = type(m)(**{k: mv(v) for k, v in vars(m).items()})
            layers.append(LayerWeights(mv(lw.attn_norm), mv(lw.post_norm), mixer, mv(lw.gate_up), mv(lw.down)))
        embed = self.embed.to(device)
        head = embed.as_linear() if self.tied else mv(self.lm_head)
        return Weights(embed, layers, mv(self.final_norm), head, self.tied)

    def has_f32_linears(self) -> bool:
        """True when the layers' projections are f32 (the exact path): computations then stay f32."""
        lin = self.layers[0].gate_up if self.layers else self.lm_head
        part = lin.fused if isinstance(lin, StackedLinear) and lin.fused is not None else lin
        return isinstance(part, DenseLinear) and part.weight.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor):
            nonlocal total
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()

        def visit(obj):
            if isinstance(obj, torch.Tensor):
                add(obj)
            elif isinstance(obj, Embedding):
                visit(obj.table)
            elif isinstance(obj, StackedLinear):
                for part in ([obj.fused] if obj.fused is not None else obj.parts):
                    visit(part)
            elif isinstance(obj, Linear):
                for v in vars(obj).values():
                    if isinstance(v, torch.Tensor):
                        add(v)
                for _, blocks in getattr(obj, "blocks", ()):  # a quantized file's own blocks, kept for decode
                    add(blocks)
        visit(self.embed)
        visit(self.final_norm)
        visit(self.lm_head)
        for lw in self.layers:
            for v in (lw.attn_norm, lw.post_norm, lw.gate_up, lw.down, *vars(lw.mixer).values()):
                visit(v)
        return total


class TensorSource(Protocol):
    """Where the builder reads tensors from, by GGUF name, already in GGUF conventions."""

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dense(self, name: str) -> torch.Tensor: ...      # float32
    def linear(self, name: str) -> Linear: ...
    def embedding(self, name: str) -> Embedding: ...
    def type_name(self, name: str) -> str: ...


def expected_shapes(c: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a qwen35 file must hold (GGUF names, numpy order), except the optional `output.weight`."""
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


def check_tensors(c: HybridConfig, src: TensorSource, where: str) -> None:
    """Every expected tensor present with its expected shape, or one clear error naming both."""
    have = src.names()
    for name, shape in expected_shapes(c).items():
        if name not in have:
            raise ModelFormatError(f"{where}: missing tensor {name} (expected shape {shape} for this config)")
        found = src.shape(name)
        if tuple(found) != tuple(shape):
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(found)}, expected {shape}")
    if "output.weight" in have and tuple(src.shape("output.weight")) != (c.vocab_size, c.hidden_size):
        raise ModelFormatError(f"{where}: tensor output.weight has shape {tuple(src.shape('output.weight'))}, "
                               f"expected {(c.vocab_size, c.hidden_size)}")


def _down_projection(down: Linear) -> Linear:
    """The MLP's down projection reads silu(gate) * up, whose outlier channels int8 activations per row
    would flatten (3.6x the file's own error on the trained demo model, against 2.1x without): its
    many-row products stay bf16."""
    if isinstance(down, Int8Linear):
        down.int8_activations = False
    return down


def build_weights(c: HybridConfig, src: TensorSource, where: str,
                  progress: Callable[[int, int], None] | None = None) -> Weights:
    check_tensors(c, src, where)
    layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        def stacked(*names: str) -> StackedLinear:
            return StackedLinear([src.linear(p + n) for n in names])

        if c.is_attention(i):
            mixer: AttentionWeights | DeltaNetWeights = AttentionWeights(
                qkv=stacked("attn_q.weight", "attn_k.weight", "attn_v.weight"), o=src.linear(p + "attn_output.weight"),
                q_norm=src.dense(p + "attn_q_norm.weight"), k_norm=src.dense(p + "attn_k_norm.weight"))
        else:
            mixer = DeltaNetWeights(
                in_proj=stacked("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"),
                out=src.linear(p + "ssm_out.weight"), conv=src.dense(p + "ssm_conv1d.weight"),
                dt_bias=src.dense(p + "ssm_dt.bias"), a_neg=src.dense(p + "ssm_a"),
                norm=src.dense(p + "ssm_norm.weight"))
        layers.append(LayerWeights(
            attn_norm=src.dense(p + "attn_norm.weight"), post_norm=src.dense(p + "post_attention_norm.weight"),
            mixer=mixer, gate_up=stacked("ffn_gate.weight", "ffn_up.weight"),
            down=_down_projection(src.linear(p + "ffn_down.weight"))))
        if progress:
            progress(i + 1, c.num_layers)
    embed = src.embedding("token_embd.weight")
    tied = "output.weight" not in src.names()
    head = embed.as_linear() if tied else src.linear("output.weight")
    return Weights(embed, layers, src.dense("output_norm.weight"), head, tied)


@dataclass
class TensorSummary:
    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int
    extra: dict = field(default_factory=dict)
