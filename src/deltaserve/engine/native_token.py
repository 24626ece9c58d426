"""One decoded token in one native call (`ds_decode_tokens`, kernels/c/decode.c: on every CPU with AVX2).

The torch decode runs ~25 operations per layer, each a Python call and a dispatch; at 24 layers that is
several milliseconds a token around ~13 ms of products. `TokenProgram` describes a model's layers once (the
pointers to its norms, tables or quantized blocks, its shapes) as the C structs of native.h, and decodes a
token with one call: one OpenMP team for the whole token, the products and per-head steps shared among its
threads. The math is layers.py's; tests compare it with the torch decode and with llama.cpp.

Each projection's segments say whose products read them, by what the model holds:
- the file's own blocks (a model loaded as `BlockLinear`s: every type the decode products take; a stack may mix
  types, and an F32 part of a stack is multiplied as it is): products.c's products (activations quantized as
  llama.cpp does, the same as the torch decode's products on those blocks), on any CPU;
- int8 tables (`Int8Linear`s, weights="tables"), with the Q4_K/Q6_K blocks kept beside them: tables_avx512.c's
  products, where the build has them (`routes.capabilities().tables`).
Each product's kernel, and the rows from which it takes the GEMM, are kernels/routes.py's (decode_step,
decode_gemm_rows: set in the library at load). Either needs states on the CPU whose KV caches are f32, f16 or bf16
(attention_decode.c reads each in its own type; one call's states share one type); anything else keeps the torch
decode, and `why_not` says why.
"""

from __future__ import annotations

import ctypes

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from deltaserve.formats.config import HybridConfig
from deltaserve.engine.weights import AttentionWeights, Weights
from deltaserve.kernels import linear as lin
from deltaserve.kernels import native, routes
from deltaserve.engine.state import DecodeState

# the C's structs, read from kernels/c/native.h (declared once, there)
Seg, Lin, Layer, Model = (native.STRUCTS[n] for n in ("seg_t", "lin_t", "layer_t", "model_t"))
MAX_SEGMENTS = native.CONSTANTS["DS_MAX_SEGMENTS"]
# the KV cache types the native decode reads (attention_decode.c), as ds_decode_tokens' kv_type
KV_TYPES = {torch.float32: native.CONSTANTS["DS_KV_F32"], torch.float16: native.CONSTANTS["DS_KV_F16"],
            torch.bfloat16: native.CONSTANTS["DS_KV_BF16"]}


class NotNative(Exception):
    """Why a model cannot run on the native token decode (said in the route line)."""


def _vector(t: torch.Tensor, keep: list) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise NotNative(f"a norm or gate vector is {t.dtype} on {t.device}")
    keep.append(t)
    return t.data_ptr()


def _table_linear(table: "lin.Int8Linear", keep: list) -> Lin:
    """An int8 table as tables_avx512.c's segments: the table (DS_I8), or the Q4_K/Q6_K blocks kept beside it (one
    row reads the file's own blocks, as Int8Linear does at BLOCK_ROWS)."""
    ok, why = native.status()
    c = routes.capabilities()
    if not ok or not c.tables:
        raise NotNative(f"an int8 table (the int8 tables' kernels do not run here: {why if not ok else 'not taken'})")
    if c.activations != "int8":
        raise NotNative(f"DELTASERVE_ACTIVATIONS={c.activations}")
    if table.q.device.type != "cpu":
        raise NotNative(f"an int8 table on {table.q.device}")
    out = Lin()
    out.K = table.in_features
    if table.blocks:
        if len(table.blocks) > MAX_SEGMENTS or out.K % 256:
            raise NotNative(f"{len(table.blocks)} block segments of inner size {out.K}")
        for j, (kind, data) in enumerate(table.blocks):
            out.seg[j] = Seg(native.BLOCK_TYPES[kind][0], data.shape[0], data.data_ptr(), None)
            keep.append(data)
        out.nseg = len(table.blocks)
    else:
        if out.K % 32:
            raise NotNative(f"an int8 table of inner size {out.K} (not a multiple of 32)")
        out.seg[0] = Seg(native.CONSTANTS["DS_I8"], table.out_features, table.q.data_ptr(), table.scale.data_ptr())
        out.nseg = 1
        keep.extend([table.q, table.scale])
    return out


# GGUF block types the one-call decode reads through products.c: id -> (values, bytes) per block
FILE_BLOCKS = {routes.GGUF_TYPES[k]: GGML_QUANT_SIZES[GGMLQuantizationType[k]] for k in routes.PRODUCT_TYPES}


def _file_segments(layer, in_features: int, in_stack: bool) -> list[tuple[int, torch.Tensor]]:
    """(GGUF type id, rows as stored) of a BlockLinear, a stack of them, or an F32 part of such a stack (type 0:
    F32 rows)."""
    if isinstance(layer, lin.StackedLinear):
        if layer.fused is not None:
            return _file_segments(layer.fused, in_features, in_stack)
        return [seg for part in layer.parts for seg in _file_segments(part, in_features, True)]
    if isinstance(layer, getattr(lin, "BlockLinear", ())):
        out = []
        for kind, data in layer.segments:
            gguf_type = kind if isinstance(kind, int) else routes.GGUF_TYPES.get(kind, -1)
            if gguf_type not in FILE_BLOCKS or not native.library().blk_kind(gguf_type):
                raise NotNative(f"a {kind} part of a {layer.kind} projection (products.c has no product for it)")
            values, size = FILE_BLOCKS[gguf_type]
            if in_features % values or data.device.type != "cpu" or data.dtype != torch.uint8 \
                    or data.shape[1] != in_features // values * size or not data.is_contiguous():
                raise NotNative(f"{kind} blocks {tuple(data.shape)} for an inner size of {in_features}")
            out.append((gguf_type, data))
        return out
    dense = getattr(layer, "weight", None)
    if in_stack and isinstance(layer, lin.DenseLinear) and dense.dtype == torch.float32 and dense.is_contiguous() \
            and dense.device.type == "cpu":
        return [(0, dense)]
    raise NotNative(f"a {layer.kind} projection is not the file's own blocks")


def _file_linear(layer, keep: list) -> Lin:
    """A BlockLinear (or a stack of them) as segments for products.c: one per stored tensor, typed by GGUF id."""
    segments = _file_segments(layer, layer.in_features, False)
    if len(segments) > MAX_SEGMENTS:
        raise NotNative(f"a stack of {len(segments)} tensors (at most {MAX_SEGMENTS})")
    out = Lin()
    out.K, out.nseg = layer.in_features, len(segments)
    for j, (gguf_type, data) in enumerate(segments):
        out.seg[j] = Seg(gguf_type, data.shape[0], data.data_ptr(), None)
        keep.append(data)
    return out


def _router(moe, keep: list) -> Lin:
    """An MoE layer's router rows, then its shared expert's gate as one more F32 row: one product gives both."""
    segments = _file_segments(moe.router, moe.router.in_features, True)
    segments.append((0, moe.shared_gate.reshape(1, -1)))
    if len(segments) > MAX_SEGMENTS:
        raise NotNative(f"a router of {len(segments) - 1} segments")
    out = Lin()
    out.K, out.nseg = moe.router.in_features, len(segments)
    for j, (gguf_type, data) in enumerate(segments):
        if data.dtype == torch.float32 and (data.device.type != "cpu" or not data.is_contiguous()):
            raise NotNative("a router or shared expert gate that is not contiguous f32 on the CPU")
        out.seg[j] = Seg(gguf_type, data.shape[0], data.data_ptr(), None)
        keep.append(data)
    return out


def _linear(layer, keep: list) -> Lin:
    """A projection as native.h's lin_t: an int8 table's segments (tables_avx512.c), or the file's own blocks'."""
    table = layer.fused if isinstance(layer, lin.StackedLinear) else layer
    if isinstance(table, lin.Int8Linear):
        return _table_linear(table, keep)
    return _file_linear(layer, keep)


class TokenProgram:
    """A model's layers as native.h's structs, for `decode`. Build with `TokenProgram.build` (None + why
    where the model does not qualify)."""

    def __init__(self, config: HybridConfig, weights: Weights):
        c = config
        if not routes.capabilities().one_call:
            raise NotNative(native.portable()[1])
        if c.head_dim % 8:
            raise NotNative(f"head dim {c.head_dim} is not a multiple of 8")
        self.keep: list = []
        self.config = config
        self.weights = weights
        layers = (Layer * len(weights.layers))()
        for i, lw in enumerate(weights.layers):
            L = layers[i]
            L.attn_norm, L.post_norm = _vector(lw.attn_norm, self.keep), _vector(lw.post_norm, self.keep)
            L.gate_up, L.down = _linear(lw.gate_up, self.keep), _linear(lw.down, self.keep)
            if lw.moe is not None:
                L.n_expert, L.n_used = lw.moe.count, lw.moe.top_k
                if lw.moe.top_k > native.CONSTANTS["DS_MAX_USED"]:
                    raise NotNative(f"{lw.moe.top_k} experts a token (at most {native.CONSTANTS['DS_MAX_USED']})")
                L.router = _router(lw.moe, self.keep)
                experts = lw.moe.native()
                if experts is None:
                    raise NotNative("an MoE layer's experts are not the file's blocks")
                L.exp_gate, L.exp_up, L.exp_down = experts
                self.keep.append(lw.moe)
            mx = lw.mixer
            if isinstance(mx, AttentionWeights):
                L.attention = 1
                L.mix_in, L.mix_out = _linear(mx.qkv, self.keep), _linear(mx.o, self.keep)
                L.q_norm, L.k_norm = _vector(mx.q_norm, self.keep), _vector(mx.k_norm, self.keep)
            else:
                L.attention = 0
                L.mix_in, L.mix_out = _linear(mx.in_proj, self.keep), _linear(mx.out, self.keep)
                L.conv_w, L.a_neg = _vector(mx.conv, self.keep), _vector(mx.a_neg, self.keep)
                L.dt_bias, L.norm_w = _vector(mx.dt_bias, self.keep), _vector(mx.norm, self.keep)
        m = Model()
        m.n_layers, m.hidden = len(weights.layers), c.hidden_size
        m.nk, m.dk = c.linear_num_key_heads, c.linear_key_head_dim
        m.nv, m.dv = c.linear_num_value_heads, c.linear_value_head_dim
        m.Kc, m.tiled = c.conv_kernel, int(c.value_head_order == "tiled")
        m.nh, m.nkv, m.hd, m.rotary = c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
        m.eps, m.theta = float(c.rms_norm_eps), float(c.rope_theta)
        m.final_norm = _vector(weights.final_norm, self.keep)
        m.head = _linear(weights.lm_head, self.keep)
        m.layers = layers
        self.layers, self.model = layers, m
        self.lib = native.library()

    @classmethod
    def build(cls, config: HybridConfig, weights: Weights) -> tuple["TokenProgram | None", str]:
        try:
            program = cls(config, weights)
        except NotNative as e:
            return None, f"decode through torch ops (native token decode not used: {e})"
        rows = routes.decode_gemm_rows()
        batched = (f"several sequences' rows a call, from {rows} on the block GEMM" if rows else
                   "several sequences' rows a call, all on the decode tiles (batch-invariant)")
        return program, f"one native call per decoded token ({batched})"

    MAX_BATCH = native.MAX_ROWS  # sequences per call (the products' row limit)

    def takes(self, state: DecodeState) -> bool:
        """A state on the CPU whose KV cache is f32, f16 or bf16 (KV_TYPES), as the native step reads them."""
        return state.kv_dtype in KV_TYPES and state.device.type == "cpu"

    def decode(self, states: list[DecodeState], tokens: list[int], nthreads: int | None = None,
               hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B <= MAX_BATCH sequences at its state's position: logits [B, vocab]; each state
        advances by one. The caller checked the positions and the token ids. `hidden` [B, hidden_size], when given,
        receives the rows after the final norm (what an MTP block reads)."""
        x = self.weights.embed.lookup(torch.tensor(tokens)).reshape(len(states), -1).float().clone()
        shifted = [st.length + st.rope_delta for st in states] if any(st.rope_delta for st in states) else None
        logits = self.rows(x, states, [st.length for st in states], nthreads, hidden=hidden, rope=shifted)
        for st in states:
            st.length += 1
        return logits

    def rows(self, x: torch.Tensor, states: list, pos: list[int], nthreads: int | None = None, *,
             chain: bool = False, snaps: list | None = None, hidden: torch.Tensor | None = None,
             logits: bool = True, rope: list[int] | None = None) -> torch.Tensor | None:
        """ds_decode_tokens on input rows x [B, hidden_size] (overwritten), row b at pos[b] of states[b]; logits
        [B, vocab] (None with `logits=False`: the head is not run). Rows of one state at consecutive positions, one
        after the other, form a run (a sequence's token and its drafts): they are fed in order, each seeing the ones
        before it. `chain`: the rows must form one run. `snaps[b]` (None, or a state-like object: conv, ssm dicts)
        receives the DeltaNet states after row b, for a row that is not its run's last (a list shorter than B: the
        rows past its end take none). `rope`: each row's rotary position where it is not its position (a state past
        an image: its rope_delta). Lengths are not changed here."""
        b, n = len(states), len(self.weights.layers)

        def table_of(st) -> ctypes.Array:
            ptrs = (ctypes.c_void_p * (2 * n))()
            for i in range(n):
                first, second = st.kv[i] if i in st.kv else (st.conv[i], st.ssm[i])
                ptrs[2 * i], ptrs[2 * i + 1] = first.data_ptr(), second.data_ptr()
            return ptrs

        tables: dict[int, ctypes.Array] = {}
        per_state = [tables.setdefault(id(st), table_of(st)) if id(st) not in tables else tables[id(st)]
                     for st in states]
        table = (ctypes.c_void_p * b)(*(ctypes.addressof(p) for p in per_state))
        snap_table = None
        if snaps and any(sn is not None for sn in snaps):
            if len(snaps) > b:
                raise ValueError(f"{len(snaps)} snapshots for {b} rows")
            snap_ptrs = []
            for sn in list(snaps) + [None] * (b - len(snaps)):
                if sn is None:
                    snap_ptrs.append(None)
                    continue
                ptrs = (ctypes.c_void_p * (2 * n))()
                for i in range(n):
                    if i in sn.conv:
                        ptrs[2 * i], ptrs[2 * i + 1] = sn.conv[i].data_ptr(), sn.ssm[i].data_ptr()
                snap_ptrs.append(ptrs)
            snap_table = (ctypes.c_void_p * b)(*(ctypes.addressof(p) if p is not None else None for p in snap_ptrs))
        kinds = {st.kv_dtype for st in states}
        if len(kinds) != 1 or next(iter(kinds)) not in KV_TYPES:
            raise ValueError(f"KV caches of {sorted(map(str, kinds))} in one native call (one of "
                             f"{', '.join(map(str, KV_TYPES))} for all its rows)")
        posv = (ctypes.c_int * b)(*pos)
        cap = (ctypes.c_int * b)(*(st.capacity for st in states))
        out = torch.empty(b, self.weights.lm_head.out_features) if logits else None
        if hidden is not None and (hidden.shape != (b, self.config.hidden_size) or hidden.dtype != torch.float32
                                   or not hidden.is_contiguous()):
            raise ValueError(f"hidden rows {tuple(hidden.shape)} for {b} rows of {self.config.hidden_size}")
        if self.lib.ds_decode_tokens(ctypes.byref(self.model), b, x.data_ptr(), table, posv, cap,
                                     out.data_ptr() if out is not None else None,
                                     nthreads or torch.get_num_threads(), int(chain), snap_table,
                                     hidden.data_ptr() if hidden is not None else None,
                                     (ctypes.c_int * b)(*rope) if rope is not None else None,
                                     KV_TYPES[next(iter(kinds))]) != 0:
            raise MemoryError("the native token decode could not allocate its scratch (or refused its rows)")
        return out
