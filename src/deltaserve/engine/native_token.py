"""One decoded token in one native call (`ds_decode_token` in native.c).

The torch decode runs ~25 operations per layer, each a Python call and a dispatch; at 24 layers that is
several milliseconds a token around ~13 ms of products. `TokenProgram` describes a model's layers once (the
pointers to its norms, tables or quantized blocks, its shapes) as the C structs of native.c, and decodes a
token with one call: one OpenMP team for the whole token, the products and per-head steps shared among its
threads. The math is layers.py's; tests compare it with the torch decode and with llama.cpp.

It takes a model whose every product is an int8 table or Q4_K/Q6_K blocks (a Q8_0, Q4_0 or K-quant file on
the int8 route) and a state with f32 caches; anything else keeps the torch decode, and `why_not` says why.
"""

from __future__ import annotations

import ctypes

import torch

from deltaserve.formats.config import HybridConfig
from deltaserve.engine.weights import AttentionWeights, Weights
from deltaserve.kernels import linear as lin
from deltaserve.kernels import native
from deltaserve.engine.state import DecodeState

# native.c's structs, read from kernels/native.h (declared once, there)
Seg, Lin, Layer, Model = (native.STRUCTS[n] for n in ("seg_t", "lin_t", "layer_t", "model_t"))
MAX_SEGMENTS = native.CONSTANTS["DS_MAX_SEGMENTS"]


class NotNative(Exception):
    """Why a model cannot run on the native token decode (said in the route line)."""


def _vector(t: torch.Tensor, keep: list) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise NotNative(f"a norm or gate vector is {t.dtype} on {t.device}")
    keep.append(t)
    return t.data_ptr()


def _linear(layer, keep: list) -> Lin:
    """A linear (an Int8Linear, or a stack fused into one) as segments of int8 table or Q4_K/Q6_K blocks."""
    table = getattr(layer, "fused", None) if isinstance(layer, lin.StackedLinear) else layer
    if not isinstance(table, lin.Int8Linear) or table.q.device.type != "cpu":
        raise NotNative(f"a {layer.kind} projection is not an int8 table or quantized blocks")
    out = Lin()
    out.K = table.in_features
    if table.blocks:  # one row reads the file's own blocks (as Int8Linear does at BLOCK_ROWS)
        if len(table.blocks) > MAX_SEGMENTS or out.K % 256:
            raise NotNative(f"{len(table.blocks)} block segments of inner size {out.K}")
        for j, (kind, data) in enumerate(table.blocks):
            out.seg[j] = Seg(native.BLOCK_TYPES[kind][0], data.shape[0], data.data_ptr(), None)
            keep.append(data)
        out.nseg = len(table.blocks)
    else:
        if out.K % 32:
            raise NotNative(f"an int8 table of inner size {out.K} (not a multiple of 32)")
        out.seg[0] = Seg(0, table.out_features, table.q.data_ptr(), table.scale.data_ptr())
        out.nseg = 1
        keep.extend([table.q, table.scale])
    return out


class TokenProgram:
    """A model's layers as native.c's structs, for `decode`. Build with `TokenProgram.build` (None + why
    where the model does not qualify)."""

    def __init__(self, config: HybridConfig, weights: Weights):
        c = config
        if lin.activations() != "int8":
            raise NotNative(f"DELTASERVE_ACTIVATIONS={lin.activations()}")
        ok, why = native.status()
        if not ok:
            raise NotNative(why)
        if c.head_dim % 16:
            raise NotNative(f"head dim {c.head_dim} is not a multiple of 16")
        self.keep: list = []
        self.config = config
        self.weights = weights
        layers = (Layer * len(weights.layers))()
        for i, lw in enumerate(weights.layers):
            L = layers[i]
            L.attn_norm, L.post_norm = _vector(lw.attn_norm, self.keep), _vector(lw.post_norm, self.keep)
            L.gate_up, L.down = _linear(lw.gate_up, self.keep), _linear(lw.down, self.keep)
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
        m.n_layers, m.hidden, m.inter = len(weights.layers), c.hidden_size, c.intermediate_size
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
            return cls(config, weights), "one native call per decoded token"
        except NotNative as e:
            return None, f"decode through torch ops (native token decode not used: {e})"

    MAX_BATCH = native.MAX_ROWS  # sequences per call (the products' row limit)

    def takes(self, state: DecodeState) -> bool:
        """f32 caches and states on the CPU, as the native step reads them."""
        return state.kv_dtype == torch.float32 and state.device.type == "cpu"

    def decode(self, states: list[DecodeState], tokens: list[int], nthreads: int | None = None) -> torch.Tensor:
        """One token for each of B <= MAX_BATCH sequences at its state's position: logits [B, vocab]; each state
        advances by one. The caller checked the positions and the token ids."""
        w, b = self.weights, len(states)
        x = w.embed.lookup(torch.tensor(tokens)).reshape(b, -1).float().clone()
        n = len(w.layers)
        per_state = []
        for st in states:
            ptrs = (ctypes.c_void_p * (2 * n))()
            for i in range(n):
                first, second = st.kv[i] if i in st.kv else (st.conv[i], st.ssm[i])
                ptrs[2 * i], ptrs[2 * i + 1] = first.data_ptr(), second.data_ptr()
            per_state.append(ptrs)
        table = (ctypes.c_void_p * b)(*(ctypes.addressof(p) for p in per_state))
        pos = (ctypes.c_int * b)(*(st.length for st in states))
        cap = (ctypes.c_int * b)(*(st.capacity for st in states))
        logits = torch.empty(b, w.lm_head.out_features)
        if self.lib.ds_decode_tokens(ctypes.byref(self.model), b, x.data_ptr(), table, pos, cap, logits.data_ptr(),
                                     nthreads or torch.get_num_threads()) != 0:
            raise MemoryError("the native token decode could not allocate its scratch")
        for st in states:
            st.length += 1
        return logits
