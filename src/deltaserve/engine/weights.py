"""The forward's weights, built from a tensor source (formats/): one layout whatever the file, GGUF conventions.

Conventions (those of llama.cpp's converter): norm weights are multiplicative (HF's zero-centred
`w` is stored as `1 + w`), except the DeltaNet output norm which is plain in both; `ssm_a` is
`-exp(A_log)`; conv weights are [channels, K]. Value-head order is whatever the file has
(`HybridConfig.value_head_order`).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch

from deltaserve.errors import ModelFormatError
from deltaserve.formats import quant
from deltaserve.formats.config import HybridConfig
from deltaserve.formats.layout import TensorSource, check_tensors, mtp_present
from deltaserve.kernels.linear import GGUF_TYPES, PRODUCT_TYPES, BlockLinear, DenseLinear, Int8Linear, Linear, StackedLinear, row_view
from deltaserve.kernels import native
from deltaserve.kernels.native import BLOCK_TYPES
from deltaserve import settings


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
class ExpertTensor:
    """One projection of every routed expert of an MoE layer: expert e's `rows` output rows are the rows from
    e * stride + offset of `linear` ([experts x stride, in_features], the file's 3-D tensor); `of(e)` is a view of
    them, nothing copied. A fused gate_up tensor is two of these over one linear (stride 2 rows, offsets 0, rows)."""

    linear: Linear
    rows: int
    stride: int
    offset: int = 0

    def of(self, e: int) -> Linear:
        r0 = e * self.stride + self.offset
        return row_view(self.linear, r0, r0 + self.rows)

    def to(self, device) -> "ExpertTensor":
        return ExpertTensor(self.linear.to(device), self.rows, self.stride, self.offset)

    def gathered(self, experts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[P, rows]: row p is x[p] times the rows of expert experts[p], those experts' weights gathered by index (no
        host synchronisation: a CUDA graph records it). For a few rows on a device; a DenseLinear or an Int8Linear
        (what a device holds)."""
        lin, count = self.linear, self.linear.out_features // self.stride
        window = slice(self.offset, self.offset + self.rows)
        if isinstance(lin, DenseLinear):
            w = lin.weight.view(count, self.stride, -1)[:, window][experts]
            return torch.bmm(w, x.to(w.dtype)[:, :, None])[:, :, 0].float()
        if isinstance(lin, Int8Linear):
            q = lin.q.view(count, self.stride, -1)[:, window][experts]
            scale = lin.scale.view(count, self.stride)[:, window][experts]
            dtype = torch.float32 if x.device.type == "cpu" else torch.bfloat16
            return torch.bmm(q.to(dtype), x.to(dtype)[:, :, None])[:, :, 0].float() * scale
        raise TypeError(f"no gathered product of a {type(lin).__name__}")

    def native(self, count: int):
        """native.h's experts_t for these experts (the file's blocks of one type, or F32 rows: type 0), or None where
        the linear is neither (an int8 table, a device's copy)."""
        lin = self.linear
        if isinstance(lin, BlockLinear) and len(lin.segments) == 1 and lin.segments[0][1].device.type == "cpu" \
                and lin.segments[0][0] in PRODUCT_TYPES:  # a type products.c multiplies
            (kind, data), = lin.segments
            gguf_type = GGUF_TYPES[kind]
        elif isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu":
            gguf_type, data = 0, lin.weight
        else:
            return None
        if not data.is_contiguous() or data.shape[0] != count * self.stride or self.offset + self.rows > self.stride:
            return None
        row_bytes = data.shape[1] * data.element_size()
        return native.STRUCTS["experts_t"](gguf_type, self.rows, self.stride, data.data_ptr() + self.offset * row_bytes)


@dataclass
class MoEWeights:
    """The routed half of an MoE layer's FFN (the shared expert is the layer's gate_up and down): the router
    (ffn_gate_inp [E, hidden]), the shared expert's gate (ffn_gate_inp_shexp [hidden]), and the experts' gate, up
    and down projections; `top_k` experts a token."""

    router: Linear
    shared_gate: torch.Tensor
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor
    top_k: int
    _made: dict = field(default_factory=dict, repr=False, compare=False)  # each expert's linears, the native structs

    @property
    def count(self) -> int:
        return self.router.out_features

    def expert(self, e: int) -> tuple[StackedLinear, Linear]:
        """Expert e's (gate_up, down), views of the layer's tensors, made on first use."""
        if e not in self._made:
            parts = [self.gate.of(e), self.up.of(e)]
            self._made[e] = (StackedLinear(parts, fuse=False), self.down.of(e))
        return self._made[e]

    def native(self) -> tuple | None:
        """The gate, up and down experts as native.h's experts_t (for moe.c's grouped products), made once; None
        where one of them is not the file's blocks or F32 rows. The structs point into tensors this object holds."""
        if "native" not in self._made:
            structs = tuple(t.native(self.count) for t in (self.gate, self.up, self.down))
            self._made["native"] = None if any(s is None for s in structs) else structs
        return self._made["native"]

    def expert_nbytes(self) -> int:
        """The bytes of one expert's three projections (what a token reads per expert it uses)."""
        return sum(t.linear.nbytes * t.rows // t.linear.out_features for t in (self.gate, self.up, self.down))

    def to(self, device) -> "MoEWeights":
        gate = self.gate.to(device)
        up = ExpertTensor(gate.linear, self.up.rows, self.up.stride, self.up.offset) \
            if self.up.linear is self.gate.linear else self.up.to(device)
        return MoEWeights(self.router.to(device), self.shared_gate.to(device), gate, up, self.down.to(device),
                          self.top_k)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttentionWeights | DeltaNetWeights
    gate_up: StackedLinear  # ffn_gate, ffn_up (an MoE layer: its shared expert's)
    down: Linear
    moe: MoEWeights | None = None  # an MoE layer's router and routed experts


@dataclass
class MtpWeights:
    """The multi-token-prediction block every Qwen3.5 checkpoint ships (llama.cpp's `blk.{N}.nextn.*` after the N
    trunk blocks; HF's `mtp.*`): the next token's embedding and the trunk's last hidden state, each RMS-normed,
    concatenated [embedding | hidden] and projected (eh_proj) to the model's width, one gated-attention decoder
    block (its own KV cache; an MoE block's FFN in an MoE model), the head's norm and the head (the trunk's, unless
    the file gives the block its own). Its output row, normed, is both the next draft's logits' input and the hidden
    state the following draft step reads."""

    eh_proj: Linear          # [hidden, 2 * hidden]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    layer: LayerWeights      # a full-attention block
    head_norm: torch.Tensor  # nextn.shared_head_norm, else the trunk's output_norm
    embed: Embedding         # nextn.embed_tokens, else the trunk's table
    head: Linear             # nextn.shared_head_head, else the trunk's head

    def parts(self) -> list:
        lw = self.layer
        out = [self.eh_proj, self.enorm, self.hnorm, self.head_norm, self.embed, self.head, lw.attn_norm,
               lw.post_norm, lw.gate_up, lw.down, *vars(lw.mixer).values()]
        if lw.moe is not None:
            out += [lw.moe.router, lw.moe.shared_gate, lw.moe.gate.linear, lw.moe.up.linear, lw.moe.down.linear]
        return out

    def to(self, device, embed: Embedding, head: Linear, trunk: "Weights") -> "MtpWeights":
        """A copy on `device`; the trunk's own embedding and head (already moved) where the block shares them."""
        def mv(obj):
            return obj.to(device) if isinstance(obj, (torch.Tensor, Linear, Embedding)) else obj
        lw = self.layer
        mixer = type(lw.mixer)(**{k: mv(v) for k, v in vars(lw.mixer).items()})
        layer = LayerWeights(mv(lw.attn_norm), mv(lw.post_norm), mixer, mv(lw.gate_up), mv(lw.down),
                             lw.moe.to(device) if lw.moe is not None else None)
        return MtpWeights(mv(self.eh_proj), mv(self.enorm), mv(self.hnorm), layer,
                          mv(self.head_norm), embed if self.embed is trunk.embed else mv(self.embed),
                          head if self.head is trunk.lm_head else mv(self.head))


@dataclass
class Weights:
    embed: Embedding
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear
    tied: bool = False
    mtp: "MtpWeights | None" = None  # the multi-token-prediction block (engine/mtp.py), where the file carries one

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
            layers.append(LayerWeights(mv(lw.attn_norm), mv(lw.post_norm), mixer, mv(lw.gate_up), mv(lw.down),
                                       lw.moe.to(device) if lw.moe is not None else None))
        embed = self.embed.to(device)
        head = embed.as_linear() if self.tied else mv(self.lm_head)
        mtp = self.mtp.to(device, embed, head, self) if self.mtp is not None else None
        return Weights(embed, layers, mv(self.final_norm), head, self.tied, mtp)

    def has_f32_linears(self) -> bool:
        """True when the layers' projections are f32 (the exact path): computations then stay f32."""
        lin = self.layers[0].gate_up if self.layers else self.lm_head
        part = lin.fused if isinstance(lin, StackedLinear) and lin.fused is not None else lin
        return isinstance(part, DenseLinear) and part.weight.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        parts = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers:
            parts += [lw.attn_norm, lw.post_norm, lw.gate_up, lw.down, *vars(lw.mixer).values()]
            if lw.moe is not None:
                parts += [lw.moe.router, lw.moe.shared_gate, lw.moe.gate.linear, lw.moe.up.linear, lw.moe.down.linear]
        if self.mtp is not None:
            parts += self.mtp.parts()
        return self._bytes_of(parts)

    def linear_forms(self) -> list[tuple[str, str, int]]:
        """Every form a product of this model reads its weights in, once each: ("blocks", GGUF type, inner size) for
        the file's blocks, ("tables", "int8", inner size) for an int8 table, ("dense", "f32" or "bf16", inner size)
        for a full-precision weight (kernels/routes.py's table is made for them)."""
        parts = [self.lm_head]
        for lw in self.layers:
            parts += [lw.gate_up, lw.down, *vars(lw.mixer).values()]
            if lw.moe is not None:
                parts += [lw.moe.router, lw.moe.gate.linear, lw.moe.up.linear, lw.moe.down.linear]
        if self.mtp is not None:
            parts += self.mtp.parts()
        forms: dict[tuple[str, str, int], None] = {}

        def visit(obj):
            if isinstance(obj, StackedLinear):
                for part in ([obj.fused] if obj.fused is not None else obj.parts):
                    visit(part)
            elif isinstance(obj, BlockLinear):
                for kind in obj.types:
                    forms[("blocks", kind, obj.in_features)] = None
            elif isinstance(obj, Int8Linear):
                forms[("tables", "int8", obj.in_features)] = None
            elif isinstance(obj, DenseLinear):
                forms[("dense", str(obj.weight.dtype).replace("torch.", ""), obj.in_features)] = None
        for part in parts:
            visit(part)
        return sorted(forms)

    @property
    def mtp_nbytes(self) -> int:
        """The MTP block's own bytes (without the trunk's embedding and head where it shares them); 0 without one."""
        if self.mtp is None:
            return 0
        return self._bytes_of([p for p in self.mtp.parts() if p is not self.embed and p is not self.lm_head])

    @staticmethod
    def _bytes_of(parts) -> int:
        """The bytes the weights among `parts` hold, each storage (or each view of the file's mapping) once."""
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
        for part in parts:
            visit(part)
        return total

    @property
    def active_nbytes(self) -> int:
        """The weight bytes one token's decode reads: all of them, except the routed experts a token does not use
        (an MoE layer reads top_k of its experts) and, where the head is not the embedding table, all of that table
        but the token's row (1 GB of a 35B-A3B Q8_0 file's 1.5 GB a token counted before)."""
        unused = sum(lw.moe.expert_nbytes() * (lw.moe.count - lw.moe.top_k) for lw in self.layers
                     if lw.moe is not None)
        if not self.tied:
            table = self._bytes_of([self.embed])
            unused += table - table // max(self.embed.num_embeddings, 1)
        return self.nbytes - unused


WEIGHT_MODES = ("fast", "blocks", "tables", "exact")
CHUNK_ELEMENTS = 1 << 21  # a big tensor converts this many elements at a time (bounds the f32 transient)


def weight_mode(mode: str | None = None) -> str:
    """"blocks": every GGUF tensor stays the file's own blocks where they lie in its mapping (nothing converted;
    F32 used in place); "tables": quantized tensors become int8 per-row tables, f16/bf16 become bf16, f32 stays f32
    (the AVX512-VNNI kernels of tables_avx512.c multiply those); "exact": every tensor dequantized to f32 (the parity
    reference); "fast" (default): "blocks" (resolve_mode).
    DELTASERVE_WEIGHTS picks it too."""
    mode = mode or settings.current().weights
    if mode not in WEIGHT_MODES:
        raise ModelFormatError(f"unknown weight mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}")
    return mode


def resolve_mode(mode: str) -> str:
    """The weight mode "fast" stands for: "blocks" on every CPU (the file's own blocks, held once). It was "tables"
    on an AVX512-VNNI CPU without AMX (a Zen 4/5), for their int8 x int8 prefill; the blocks route's prefill there
    (the blocks' GEMM, routes.block_gemm) runs as fast at the memory of the file (docs/kernels.md)."""
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
    kind, shape = src.type_name(name), src.shape(name)
    rows, cols = math.prod(shape[:-1]), shape[-1]  # a 3-D tensor (an MoE layer's experts): its rows one after another
    data = src.blocks(name)
    if mode == "blocks" and data is not None and kind in GGUF_TYPES:
        blocks = torch.from_numpy(data)
        if kind == "F32":
            return DenseLinear(blocks.view(torch.float32).reshape(rows, cols))
        return BlockLinear([(kind, blocks)], cols)
    mode = "tables" if mode == "blocks" else mode  # a source without GGUF blocks (safetensors): as before
    step = max(1, CHUNK_ELEMENTS // cols)
    if data is None or rows <= step:
        out = make_linear(src.dense(name).reshape(rows, cols), kind, mode)
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


def _moe(c: HybridConfig, src: TensorSource, p: str, linear) -> MoEWeights:
    """An MoE layer's router and routed experts: each of the experts' projections one Linear over the file's 3-D
    tensor (views of its blocks where the weights stay the file's), an expert's rows a view of it."""
    ff = c.moe_intermediate_size
    if p + "ffn_gate_up_exps.weight" in src.names():
        gate_up = linear(p + "ffn_gate_up_exps.weight")
        gate, up = ExpertTensor(gate_up, ff, 2 * ff), ExpertTensor(gate_up, ff, 2 * ff, ff)
    else:
        gate = ExpertTensor(linear(p + "ffn_gate_exps.weight"), ff, ff)
        up = ExpertTensor(linear(p + "ffn_up_exps.weight"), ff, ff)
    # the experts' down projections multiply int8 activations per block (a dense MLP's keeps exact chunks for Q8_0, see
    # _down_projection): an expert's few rows per prefill would otherwise dequantize its whole tensor for them
    down = ExpertTensor(linear(p + "ffn_down_exps.weight"), c.hidden_size, c.hidden_size)
    return MoEWeights(router=linear(p + "ffn_gate_inp.weight"),
                      shared_gate=src.dense(p + "ffn_gate_inp_shexp.weight").reshape(-1).contiguous(),
                      gate=gate, up=up, down=down, top_k=c.num_experts_per_tok)


def _layer_weights(c: HybridConfig, src: TensorSource, p: str, attention: bool, linear) -> LayerWeights:
    """One decoder block's weights under the name prefix `p` (a trunk layer, or the MTP block's)."""
    def stacked(*names: str) -> StackedLinear:
        return StackedLinear([linear(p + n) for n in names])

    if attention:
        mixer: AttentionWeights | DeltaNetWeights = AttentionWeights(
            qkv=stacked("attn_q.weight", "attn_k.weight", "attn_v.weight"), o=linear(p + "attn_output.weight"),
            q_norm=src.dense(p + "attn_q_norm.weight"), k_norm=src.dense(p + "attn_k_norm.weight"))
    else:
        mixer = DeltaNetWeights(
            in_proj=stacked("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"),
            out=linear(p + "ssm_out.weight"), conv=src.dense(p + "ssm_conv1d.weight"),
            dt_bias=src.dense(p + "ssm_dt.bias"), a_neg=src.dense(p + "ssm_a"),
            norm=src.dense(p + "ssm_norm.weight"))
    ffn = "_shexp" if c.is_moe else ""  # an MoE layer's gate_up and down: its shared expert
    return LayerWeights(
        attn_norm=src.dense(p + "attn_norm.weight"), post_norm=src.dense(p + "post_attention_norm.weight"),
        mixer=mixer, gate_up=stacked(f"ffn_gate{ffn}.weight", f"ffn_up{ffn}.weight"),
        down=_down_projection(linear(p + f"ffn_down{ffn}.weight")),
        moe=_moe(c, src, p, linear) if c.is_moe else None)


def build_weights(c: HybridConfig, src: TensorSource, where: str, mode: str | None = None) -> Weights:
    """The forward's weights from a source, every matrix made what `mode` (see `weight_mode`) makes of it."""
    mode = resolve_mode(weight_mode(mode))
    check_tensors(c, src, where)

    def linear(name: str) -> Linear:
        return load_linear(src, name, mode)

    layers = [_layer_weights(c, src, f"blk.{i}.", c.is_attention(i), linear) for i in range(c.num_layers)]
    embed = load_embedding(src, "token_embd.weight", mode)
    tied = "output.weight" not in src.names()
    head = embed.as_linear() if tied else linear("output.weight")
    final_norm = src.dense("output_norm.weight")
    mtp = _mtp_weights(c, src, mode, embed, head, final_norm) if mtp_present(c, src, where) else None
    return Weights(embed, layers, final_norm, head, tied, mtp)


def _mtp_weights(c: HybridConfig, src: TensorSource, mode: str, embed: Embedding, head: Linear,
                 final_norm: torch.Tensor) -> MtpWeights:
    """The MTP block at `blk.{num_layers}` of a source (checked by `mtp_present`); the trunk's embedding, head and
    final norm where the block has none of its own."""
    p = f"blk.{c.num_layers}."
    names = src.names()

    def linear(name: str) -> Linear:
        return load_linear(src, name, mode)

    return MtpWeights(
        eh_proj=linear(p + "nextn.eh_proj.weight"), enorm=src.dense(p + "nextn.enorm.weight"),
        hnorm=src.dense(p + "nextn.hnorm.weight"),
        layer=_layer_weights(c, src, p, True, linear),
        head_norm=src.dense(p + "nextn.shared_head_norm.weight") if p + "nextn.shared_head_norm.weight" in names
        else final_norm,
        embed=load_embedding(src, p + "nextn.embed_tokens.weight", mode)
        if p + "nextn.embed_tokens.weight" in names else embed,
        head=linear(p + "nextn.shared_head_head.weight") if p + "nextn.shared_head_head.weight" in names else head)


# what a draft file's config must share with the model it drafts for
DRAFT_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                "rotary_dim", "rope_theta", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "intermediate_size")


def draft_weights(c: HybridConfig, src: TensorSource, draft_config: HybridConfig, where: str, trunk: Weights,
                  mode: str | None = None) -> MtpWeights:
    """The MTP block of a separate draft file (llama.cpp's converter with --mtp: `mtp-*.gguf`, the block and the
    embedding it shares) for the model of `c`: the shapes must be that model's; its embedding and head are the
    trunk's (one copy in memory), unless the block carries its own nextn ones."""
    mode = resolve_mode(weight_mode(mode))
    differ = [f"{k} {getattr(draft_config, k)} (the model: {getattr(c, k)})" for k in DRAFT_FIELDS
              if getattr(draft_config, k) != getattr(c, k)]
    if differ:
        raise ModelFormatError(f"{where} is not a draft for this model: " + "; ".join(differ))
    if not mtp_present(c, src, where):
        raise ModelFormatError(f"{where} carries no MTP block (blk.{c.num_layers}.nextn.eh_proj.weight)")
    return _mtp_weights(c, src, mode, trunk.embed, trunk.lm_head, trunk.final_norm)
