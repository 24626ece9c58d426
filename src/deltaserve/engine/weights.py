"""The forward's weights, built from a tensor source (formats/): one layout whatever the file, GGUF conventions.

Conventions (those of llama.cpp's converter): norm weights are multiplicative (HF's zero-centred
`w` is stored as `1 + w`), except the DeltaNet output norm which is plain in both; `ssm_a` is
`-exp(A_log)`; conv weights are [channels, K]. Value-head order is whatever the file has
(`HybridConfig.value_head_order`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from deltaserve.errors import ModelFormatError
from deltaserve.formats import quant
from deltaserve.formats.config import HybridConfig
from deltaserve.formats.layout import TensorSource, check_tensors
from deltaserve.kernels.linear import GGUF_TYPES, BlockLinear, DenseLinear, Int8Linear, Linear, StackedLinear
from deltaserve.kernels.native import BLOCK_TYPES


class Embedding:
    """Token embedding rows [vocab, hidden], looked up by row: a dense tensor or an int8 table. A tied LM
    head is the same table seen as a Linear (no second copy)."""

    def __init__(self, table: torch.Tensor | Int8Linear | BlockLinear):
        self.table = table
        self.num_embeddings, self.dim = (table.out_features, table.in_features) if isinstance(table, Linear) \
            else tuple(table.shape)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.dense() if isinstance(self.table, Linear) else self.table

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, Linear):
            return self.table.rows(ids)
        return self.table.index_select(0, ids).float()

    def as_linear(self) -> Linear:
        return self.table if isinstance(self.table, Linear) else DenseLinear(self.table)

    @property
    def nbytes(self) -> int:
        t = self.table
        return t.nbytes if isinstance(t, Linear) else t.numel() * t.element_size()

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

        def add_view(t: torch.Tensor):  # a view of the file's mapping: its own bytes, not the whole file's
            nonlocal total
            key = t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()

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
                for _, blocks in getattr(obj, "segments", ()):  # a tensor held as the file's blocks
                    add_view(blocks)
        visit(self.embed)
        visit(self.final_norm)
        visit(self.lm_head)
        for lw in self.layers:
            for v in (lw.attn_norm, lw.post_norm, lw.gate_up, lw.down, *vars(lw.mixer).values()):
                visit(v)
        return total


WEIGHT_MODES = ("fast", "blocks", "tables", "exact")
CHUNK_ELEMENTS = 1 << 21  # a big tensor converts this many elements at a time (bounds the f32 transient)


def weight_mode(mode: str | None = None) -> str:
    """"blocks": every GGUF tensor stays the file's own blocks where they lie in its mapping (nothing converted;
    F32 used in place); "tables": quantized tensors become int8 per-row tables, f16/bf16 become bf16, f32 stays f32
    (the AVX512-VNNI kernels of native.c multiply those); "exact": every tensor dequantized to f32 (the parity
    reference); "fast" (default): "blocks" (resolve_mode).
    DELTASERVE_WEIGHTS picks it too."""
    mode = mode or os.environ.get("DELTASERVE_WEIGHTS", "fast")
    if mode not in WEIGHT_MODES:
        raise ModelFormatError(f"unknown weight mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}")
    return mode


def resolve_mode(mode: str) -> str:
    """The weight mode "fast" stands for: "blocks" on every CPU (the file's own blocks, held once). It was "tables"
    on an AVX512-VNNI CPU without AMX (a Zen 4/5), for their int8 x int8 prefill; the blocks route's prefill there
    (blocks.c's GEMM on the blocks, linear.block_gemm; int8 chunks for Q4_0) runs as fast at the memory of the file
    (measured with AMX left out on the Xeon: 0.8B Q4_K_M pp512 on int8 chunks 467 tok/s against the tables' 466,
    peak RSS 915 MiB against 1611; the GEMM 1.15-1.3x the int8 chunks)."""
    return "blocks" if mode == "fast" else mode


def make_linear(w: torch.Tensor, source_type: str, mode: str) -> Linear:
    """The Linear a tensor of `source_type` (a GGUF type name or a torch dtype name) becomes in `mode`."""
    if mode == "exact" or source_type in ("F32", "float32", "torch.float32"):
        return DenseLinear(w.float())
    if source_type in ("F16", "BF16", "float16", "bfloat16", "torch.float16", "torch.bfloat16"):
        return DenseLinear(w.to(torch.bfloat16))
    return Int8Linear.from_float(w)


def load_linear(src: TensorSource, name: str, mode: str) -> Linear:
    """One matrix of `src` as the Linear `mode` makes of it. In "blocks" mode a GGUF tensor is a view of the
    mapping (nothing read now). Otherwise a file's tensor converts a chunk of rows at a time (each chunk's file
    pages given back once converted); a Q4_K/Q6_K tensor's own blocks are kept too, as a view of the mapping, for
    the native decode (its pages come back from the page cache when decode reads them)."""
    kind, (rows, cols) = src.type_name(name), src.shape(name)
    data = src.blocks(name)
    if mode == "blocks" and data is not None and kind in GGUF_TYPES:
        blocks = torch.from_numpy(data)
        if kind == "F32":
            return DenseLinear(blocks.view(torch.float32).reshape(rows, cols))
        return BlockLinear([(kind, blocks)], cols)
    mode = "tables" if mode == "blocks" else mode  # a source without GGUF blocks (safetensors): as before
    step = max(1, CHUNK_ELEMENTS // cols)
    if data is None or rows <= step:
        out = make_linear(src.dense(name), kind, mode)
        trim_heap()  # the f32 transient's pages back now, not left as holes under the next tensors
    else:
        row_bytes = data.shape[1]
        out = None
        for r in range(0, rows, step):
            r1 = min(rows, r + step)
            part = make_linear(quant.dequantize(data[r:r1].reshape(-1), kind, (r1 - r, cols)), kind, mode)
            if out is None:  # the whole table, filled chunk by chunk (no concatenation copy)
                out = Int8Linear(torch.empty((rows, cols), dtype=torch.int8), torch.empty(rows)) \
                    if isinstance(part, Int8Linear) else \
                    DenseLinear(torch.empty((rows, cols), dtype=part.weight.dtype))
            if isinstance(out, Int8Linear):
                out.q[r:r1], out.scale[r:r1] = part.q, part.scale
            else:
                out.weight[r:r1] = part.weight
            del part
            src.release(name, r * row_bytes, r1 * row_bytes)  # this chunk's file pages, now converted
            trim_heap()
        if isinstance(out, Int8Linear):
            out.scale_bf16 = out.scale.to(torch.bfloat16)
    if data is not None and isinstance(out, Int8Linear) and kind in BLOCK_TYPES and cols % 256 == 0:
        out.keep_blocks([(kind, torch.from_numpy(data))])
    src.release(name)
    return out


def load_embedding(src: TensorSource, name: str, mode: str) -> Embedding:
    table = load_linear(src, name, mode)
    return Embedding(table if isinstance(table, (Int8Linear, BlockLinear)) else table.weight)


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise): the load's transients are gone."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _down_projection(down: Linear) -> Linear:
    """The MLP's down projection reads silu(gate) * up, whose outlier channels int8 activations per row
    would flatten (3.6x the file's own error on the trained demo model, against 2.1x without): its
    many-row products stay bf16."""
    if isinstance(down, (Int8Linear, BlockLinear)):
        down.int8_activations = False
    return down


def build_weights(c: HybridConfig, src: TensorSource, where: str, mode: str | None = None) -> Weights:
    """The forward's weights from a source, every matrix made what `mode` (see `weight_mode`) makes of it."""
    mode = resolve_mode(weight_mode(mode))
    check_tensors(c, src, where)
    layers = []

    def linear(name: str) -> Linear:
        return load_linear(src, name, mode)

    for i in range(c.num_layers):
        p = f"blk.{i}."

        def stacked(*names: str) -> StackedLinear:
            return StackedLinear([linear(p + n) for n in names])

        if c.is_attention(i):
            mixer: AttentionWeights | DeltaNetWeights = AttentionWeights(
                qkv=stacked("attn_q.weight", "attn_k.weight", "attn_v.weight"), o=linear(p + "attn_output.weight"),
                q_norm=src.dense(p + "attn_q_norm.weight"), k_norm=src.dense(p + "attn_k_norm.weight"))
        else:
            mixer = DeltaNetWeights(
                in_proj=stacked("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"),
                out=linear(p + "ssm_out.weight"), conv=src.dense(p + "ssm_conv1d.weight"),
                dt_bias=src.dense(p + "ssm_dt.bias"), a_neg=src.dense(p + "ssm_a"),
                norm=src.dense(p + "ssm_norm.weight"))
        layers.append(LayerWeights(
            attn_norm=src.dense(p + "attn_norm.weight"), post_norm=src.dense(p + "post_attention_norm.weight"),
            mixer=mixer, gate_up=stacked("ffn_gate.weight", "ffn_up.weight"),
            down=_down_projection(linear(p + "ffn_down.weight"))))
    embed = load_embedding(src, "token_embd.weight", mode)
    tied = "output.weight" not in src.names()
    head = embed.as_linear() if tied else linear("output.weight")
    return Weights(embed, layers, src.dense("output_norm.weight"), head, tied)
