"""The layer math of the Qwen3.5 hybrid, as plain functions over tensors (all state math in float32).

Shapes use T for the number of new tokens. Nothing here allocates long-lived state: the decode
state is passed in and updated in place.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F

from deltaserve.engine.q8cache import Q8Cache
from deltaserve.engine.weights import AttentionWeights
from deltaserve.kernels import native as kernel

CHUNK = 64  # the chunk length of the chunked gated delta rule
#                     where it runs (tests compare both paths)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in float32; `weight` is the multiplicative form (1 + w_hf). On the CPU
    in one pass on the native kernel where it runs (the same arithmetic, its sum in another order)."""
    if x.dtype == torch.float32:
        out = kernel.rms_norm(x, weight, eps)
        if out is not None:
            return out
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet output norm per value head: rmsnorm(o) * weight * silu(z) (weight is plain, no +1); o [.., nv, d],
    z the same shape or [.., nv d]. On the CPU in one pass on the native kernel where it runs."""
    if o.dim() == 3 and z.dtype == torch.float32:
        out = kernel.gated_rms_norm(o, z.reshape(z.shape[0], -1) if z.dim() == 3 else z, weight, eps)
        if out is not None:
            return out
    z = z.reshape(o.shape)
    o = o.float()
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed * F.silu(z.float())


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def mlp(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), gate and up as one stacked projection (their SwiGLU in one pass on the native
    kernel where it runs)."""
    gate, up = gate_up.split(gate_up(x))
    act = kernel.swiglu(gate, up) if gate.dtype == torch.float32 else None
    return down(act if act is not None else F.silu(gate) * up)


def layer_loop(x: torch.Tensor, layers, eps: float, attention, deltanet) -> torch.Tensor:
    """The one layer loop (prefill, decode, batched decode, the MTP block): norm, mixer, residual, FFN (an MLP or an
    MoE block), residual per layer; `attention(i, h, weights)` and `deltanet(i, h, weights)` mix layer i's normed
    input."""
    for i, lw in enumerate(layers):
        x = layer(i, lw, x, eps, attention, deltanet)
    return x


def layer(i: int, lw, x: torch.Tensor, eps: float, attention, deltanet) -> torch.Tensor:
    """Layer i of the loop (a prefill the engine loop runs a few layers at a time calls it one layer a step)."""
    h = rms_norm(x, lw.attn_norm, eps)
    x = x + (attention(i, h, lw.mixer) if isinstance(lw.mixer, AttentionWeights) else deltanet(i, h, lw.mixer))
    return x + ffn(rms_norm(x, lw.post_norm, eps), lw)


def ffn(x: torch.Tensor, lw) -> torch.Tensor:
    """A layer's FFN: its MLP, or its MoE block where it has one (`lw`: engine.weights.LayerWeights)."""
    if lw.moe is not None:
        return moe(x, lw.moe, lw.gate_up, lw.down)
    return mlp(x, lw.gate_up, lw.down)


# ---------------------------------------------------------------------------------------------
# The MoE block (qwen35moe)
# ---------------------------------------------------------------------------------------------

def route(x: torch.Tensor, router, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each row of x [T, hidden] goes to and their weights ([T, top_k] each, the larger weight first):
    the softmax over the router's logits in f32, its top k, renormalised to sum to 1 (transformers'
    Qwen3_5MoeTopKRouter; llama.cpp's qwen35moe: softmax gating, weights normalised)."""
    probs = torch.softmax(router(x).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def experts_native(x: torch.Tensor, mw, counts: list[int], rows: torch.Tensor, weights: torch.Tensor,
                   out: torch.Tensor, slot: torch.Tensor | None = None, y: torch.Tensor | None = None) -> bool:
    """The routed experts of every pair (row, expert), grouped by expert, in one native call on the file's blocks
    (moe.c's products, each expert's rows read once for its pairs): False where it does not take them (a device,
    weights that are not the file's blocks). With `slot` and `y`: y gets the routed sum itself (kernel.moe_experts)."""
    structs = mw.native() if x.device.type == "cpu" else None
    if structs is None:
        return False
    used = [e for e, n in enumerate(counts) if n]
    n = torch.tensor([counts[e] for e in used])
    ws = scratch_buffer("moe gate and up", out.shape[0] * 3 * structs[0].rows, x.device) if y is not None else None
    return kernel.moe_experts(structs, x.shape[-1], torch.tensor(used), torch.cumsum(n, 0) - n, n,
                              x.contiguous(), rows, weights, out, slot, y, ws)


_SCRATCH = threading.local()


@contextlib.contextmanager
def scratch(buffers: dict | None = None):
    """Large working buffers (an MoE layer's pairs) that the layers of one forward reuse in turn, their pages faulted
    once a forward rather than once a layer (a fresh 32 MB buffer: ~4 ms of page faults, against ~2 ms to write it
    again), and dropped when it ends. Outside this, each layer allocates its own. `buffers`: the forward's own dict,
    for a forward run a few layers at a time (its buffers kept between its steps, whatever ran in between)."""
    outer = getattr(_SCRATCH, "buffers", None)
    if buffers is not None:
        _SCRATCH.buffers = buffers
    elif outer is None:
        _SCRATCH.buffers = {}
    try:
        yield
    finally:
        if buffers is not None or outer is None:
            _SCRATCH.buffers = outer


def scratch_buffer(name: str, n: int, device: torch.device) -> torch.Tensor:
    """n float32 values: the forward's buffer `name` (grown as needed) inside `scratch()` on a CPU, else a fresh one."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or device.type != "cpu":
        return torch.empty(n, dtype=torch.float32, device=device)
    b = buffers.get(name)
    if b is None or b.numel() < n:
        buffers.pop(name, None)  # the smaller one freed before the larger is made
        b = buffers[name] = torch.empty(n, dtype=torch.float32)
    return b[:n]


GATHER_PAIRS = 64  # on a device, up to this many (row, expert) pairs gather their experts' weights (moe_gathered)


def moe_gathered(x: torch.Tensor, mw, shared_gate_up, shared_down) -> torch.Tensor:
    """The MoE block for a few rows on a device (a decode step): each (row, expert) pair's expert weights gathered by
    index and multiplied in one batched product per projection, with no host synchronisation (the experts' loop in
    `moe` reads the counts on the host), so that a CUDA graph records the step. The same math as `moe`."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    weights, experts = route(x, mw.router, mw.top_k)
    pairs = experts.reshape(-1)
    xs = x.repeat_interleave(mw.top_k, dim=0)
    mid = F.silu(mw.gate.gathered(pairs, xs)) * mw.up.gathered(pairs, xs)
    out = (mw.down.gathered(pairs, mid) * weights.reshape(-1, 1)).reshape(x.shape[0], mw.top_k, -1).sum(dim=1)
    gate = torch.sigmoid(x @ mw.shared_gate)
    return out.add_(mlp(x, shared_gate_up, shared_down) * gate[:, None]).reshape(shape)


def moe(x: torch.Tensor, mw, shared_gate_up, shared_down) -> torch.Tensor:
    """The MoE block over rows x [..., hidden]: the rows are grouped by the experts they go to, and each expert
    used runs one product over its rows (its own rows of the layer's tensors, read once); each row sums its
    experts' outputs times their weights, plus the shared expert times sigmoid(its gate)."""
    if x.device.type != "cpu" and x.numel() // x.shape[-1] * mw.top_k <= GATHER_PAIRS:
        return moe_gathered(x, mw, shared_gate_up, shared_down)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts = route(x, mw.router, mw.top_k)
    flat = experts.reshape(-1)  # (row, choice) pairs, choice-minor
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=mw.count).tolist()
    rows, pair_weights = order // mw.top_k, weights.reshape(-1)[order]
    by_expert = scratch_buffer("moe pairs", flat.numel() * shape[-1], x.device).view(flat.numel(), shape[-1])
    slot = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
    routed = torch.empty(x.shape[0], shape[-1], dtype=torch.float32, device=x.device)
    if not experts_native(x, mw, counts, rows, pair_weights, by_expert, slot, routed):
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate_up, down = mw.expert(e)
                torch.mul(mlp(x.index_select(0, rows[start:start + n]), gate_up, down),
                          pair_weights[start:start + n, None], out=by_expert[start:start + n])
                start += n
        # back in (row, choice) order, each row the sum of its choices
        routed = by_expert.index_select(0, slot).reshape(x.shape[0], mw.top_k, shape[-1]).sum(dim=1)
    gate = torch.sigmoid(x.float() @ mw.shared_gate)
    out = mlp(x, shared_gate_up, shared_down).mul_(gate[:, None])
    return out.add_(routed).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, native: bool = False) -> torch.Tensor:
    """Depthwise causal conv over time, then SiLU.

    x: [T, C] new inputs; conv_state: [K-1, C] the previous K-1 inputs (updated in place);
    weight: [C, K]. Returns [T, C]. `native`: on the native kernel where it takes these tensors.
    """
    if native:
        out = kernel.causal_conv(x, conv_state, weight)
        if out is not None:
            return out
    t = x.shape[0]
    k = weight.shape[1]
    window = torch.cat([conv_state, x.to(conv_state.dtype)], dim=0)  # [K-1+T, C]
    wt = weight.t()  # [K, C]: tap j multiplies the input j steps into the window
    out = window[0:t] * wt[0]
    for j in range(1, k):  # K shifted multiply-adds (6x faster than a grouped conv1d on the CPU here)
        out.addcmul_(window[j:j + t], wt[j])
    conv_state.copy_(window[-(k - 1):])
    return F.silu(out)


def expand_key_heads(x: torch.Tensor, num_value_heads: int, order: str) -> torch.Tensor:
    """Key/query heads [.., nk, d] -> one per value head [.., nv, d], in the file's value-head order."""
    nk = x.shape[-2]
    if nk == num_value_heads:
        return x
    reps = num_value_heads // nk
    if order == "grouped":  # value head h reads key head h // reps
        return x.repeat_interleave(reps, dim=-2)
    # tiled: value head j reads key head j % nk
    return x.repeat(*([1] * (x.dim() - 2)), reps, 1)


def delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule, in place on `state` [..., H, dk, dv] (leading dims: a batch).

    q, k: [..., H, dk] (normalised, q scaled); v: [..., H, dv]; g, beta: [..., H]. Returns o: [..., H, dv].
    """
    lead = state.shape[:-2]
    dk, dv = state.shape[-2:]
    s = state.view(-1, dk, dv)  # heads (and a batch) as one bmm batch: bmm beats einsum here by ~5x
    k = k.reshape(-1, 1, dk)
    s.mul_(torch.exp(g).reshape(-1, 1, 1))
    delta = (v.reshape(-1, 1, dv) - torch.bmm(k, s)) * beta.reshape(-1, 1, 1)
    s.baddbmm_(k.transpose(1, 2), delta)
    return torch.bmm(q.reshape(-1, 1, dk), s).view(*lead, dv)


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over T tokens in chunks (UT transform), updating `state` [H, dk, dv] in place.

    q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H]. Returns o: [T, H, dv].

    Within a chunk with log-decays G_i = g_1 + ... + g_i (Gamma_i = exp(G_i)) and state S0 before it,
    the per-token corrections d_j = beta_j (v_j - Gamma_j S0^T k_j - sum_{m<j} Gamma_j/Gamma_m (k_j.k_m) d_m)
    solve the unit lower-triangular system (I + A) d = beta*v - beta*Gamma*K S0 with
    A_jm = beta_j Gamma_j/Gamma_m (k_j.k_m), m < j. Then
    o_i = Gamma_i S0^T q_i + sum_{j<=i} Gamma_i/Gamma_j (q_i.k_j) d_j and
    S_end = Gamma_C S0 + sum_j Gamma_C/Gamma_j k_j d_j^T.
    """
    t, h, dk = k.shape
    dv = v.shape[-1]
    chunk = min(chunk, t)  # a short span is one chunk of its own length (no padding to 64)
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [n, H, chunk, ...]: chunk-major, so each chunk's slice is contiguous
        x = x.float()
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        x = x.reshape(n, chunk, h, *x.shape[2:]).transpose(1, 2)
        return x.contiguous()

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    gb, bb = blocks(g), blocks(beta)  # [n, H, C]

    log_decay = gb.cumsum(-1)  # G_i within each chunk
    causal_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = log_decay[..., :, None] - log_decay[..., None, :]  # G_i - G_j
    pair = torch.exp(diff.masked_fill(~causal_incl, float("-inf")))  # Gamma_i / Gamma_j for j <= i, else 0

    kk = kb @ kb.transpose(-1, -2)
    a = (kk * pair * bb[..., :, None]).tril(-1)  # strictly lower A
    eye = torch.eye(chunk, dtype=a.dtype, device=a.device)
    # (I + A)^-1 once (one triangular solve against I is cheaper than two against the right-hand sides)
    inv = torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True)
    u = inv @ (vb * bb[..., None])                               # d without S0
    w = inv @ (kb * (bb * torch.exp(log_decay))[..., None])      # d = u - w S0

    qk = (qb @ kb.transpose(-1, -2)) * pair  # includes the diagonal
    q_decayed = qb * torch.exp(log_decay)[..., None]
    total = log_decay[..., -1:]  # G_C
    k_to_end = kb * torch.exp(total - log_decay)[..., None]
    chunk_decay = torch.exp(total)[..., None]  # [n, H, 1, 1]
    k_to_end_t = k_to_end.transpose(-1, -2).contiguous()

    out = torch.empty(n, h, chunk, dv, dtype=torch.float32, device=q.device)
    s = state
    for i in range(n):
        d = torch.baddbmm(u[i], w[i], s, alpha=-1.0)               # u - w S
        torch.baddbmm(torch.bmm(qk[i], d), q_decayed[i], s, out=out[i])
        s = torch.baddbmm(s * chunk_decay[i], k_to_end_t[i], d)
    state.copy_(s)
    return out.transpose(1, 2).reshape(n * chunk, h, dv)[:t]


def _deltanet_heads(qkv: torch.Tensor, cfg):
    """Split the conv output [R, conv_dim] into q, k (normalised, one per value head) and v, each [R, nv, d]."""
    r = qkv.shape[0]
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    q, k, v = torch.split(qkv, [nk * dk, nk * dk, nv * dv], dim=-1)
    qn = kernel.l2_norm_heads(q, nk, dk, dk ** -0.5) if q.dim() == 2 else None  # one pass where the kernel runs
    kn = kernel.l2_norm_heads(k, nk, dk, 1.0) if k.dim() == 2 else None
    q = qn if qn is not None else l2_normalize(q.reshape(r, nk, dk)) * (dk ** -0.5)
    k = kn if kn is not None else l2_normalize(k.reshape(r, nk, dk))
    return (expand_key_heads(q, nv, cfg.value_head_order), expand_key_heads(k, nv, cfg.value_head_order),
            v.reshape(r, nv, dv))


def _deltanet_project(x: torch.Tensor, w):
    """The four input projections in one call: qkv (before the conv), z, and the gates
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), per row and value head."""
    qkv, z, b, a = w.in_proj.split(w.in_proj(x))
    return qkv, z, torch.sigmoid(b.float()), w.a_neg * F.softplus(a.float() + w.dt_bias)


def _deltanet_out(o: torch.Tensor, z: torch.Tensor, w, cfg) -> torch.Tensor:
    r, nv, dv = o.shape
    return w.out(gated_rms_norm(o, z, w.norm, cfg.rms_norm_eps).reshape(r, nv * dv))


def deltanet_mixer(x: torch.Tensor, w, cfg, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   chunked: bool, native: bool = False, snaps: list | None = None) -> torch.Tensor:
    """A Gated DeltaNet layer's mixer over T new tokens of one sequence. x: [T, hidden] (already normed).
    `native`: the one-token step, the conv and the chunked delta rule on the native kernel where it takes them.
    `snaps` (the recurrent path): (conv, ssm) pairs receiving the states after rows 0..T-2."""
    if not chunked and x.shape[0] == 1 and native:
        out = deltanet_decode_native(x, w, cfg, [(conv_state, ssm_state)])
        if out is not None:
            return out
    qkv, z, beta, g = _deltanet_project(x, w)
    before = conv_state.clone() if snaps else None
    q, k, v = _deltanet_heads(causal_conv(qkv, conv_state, w.conv, native), cfg)
    if chunked:
        o = kernel.delta_rule(q, k, v, g, beta, ssm_state) if native else None
        if o is None:
            o = delta_rule_chunked(q, k, v, g, beta, ssm_state)
    else:
        rows = []
        for i in range(x.shape[0]):
            rows.append(delta_rule_step(q[i], k[i], v[i], g[i], beta[i], ssm_state))
            if snaps and i < len(snaps):
                snaps[i][1].copy_(ssm_state)
        o = torch.stack(rows)
        if snaps:  # the conv state after row i: the last K-1 inputs of [state before; rows 0..i]
            history = torch.cat([before, qkv.to(before.dtype)])
            width = before.shape[0]
            for i, (conv, _) in enumerate(snaps[:x.shape[0] - 1]):
                conv.copy_(history[i + 1:i + 1 + width])
    return _deltanet_out(o, z, w, cfg)


def deltanet_decode_native(x: torch.Tensor, w, cfg, states: list[tuple[torch.Tensor, torch.Tensor]]):
    """One token each of B sequences through the native DeltaNet step (deltanet.c), each sequence's
    (conv, ssm) state updated in place; None, with nothing touched, where the native kernel cannot take it."""
    if not kernel.deltanet_ready(w, states):
        return None
    qkv, z, b, a = w.in_proj.split(w.in_proj(x))
    o = torch.stack([kernel.deltanet_step(qkv[j], z[j], b[j], a[j], w, cfg, conv, ssm)
                     for j, (conv, ssm) in enumerate(states)])
    return w.out(o)


def deltanet_mixer_batch(x: torch.Tensor, w, cfg, conv_states: torch.Tensor, ssm_states: list) -> torch.Tensor:
    """One token each of B sequences. x: [B, hidden]; conv_states [B, K-1, C] is the sequences' conv states
    stacked (small), updated in place; ssm_states holds each sequence's own recurrent state [nv, dk, dv],
    updated in place one by one (stacking them would copy 1 MiB per sequence and layer, twice, per step)."""
    qkv, z, beta, g = _deltanet_project(x, w)
    window = torch.cat([conv_states, qkv.to(conv_states.dtype)[:, None, :]], dim=1)  # [B, K, C]
    conv_states.copy_(window[:, 1:])
    q, k, v = _deltanet_heads(F.silu((window * w.conv.t()).sum(1)), cfg)
    o = torch.stack([delta_rule_step(q[j], k[j], v[j], g[j], beta[j], s) for j, s in enumerate(ssm_states)])
    return _deltanet_out(o, z, w, cfg)


# ---------------------------------------------------------------------------------------------
# Gated attention
# ---------------------------------------------------------------------------------------------

def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim] for NEOX (rotate-half) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def mrope_tables(positions: torch.Tensor, rotary_dim: int, theta: float,
                 section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] for 3-D positions [3, T] (time, height, width), interleaved as transformers'
    Qwen3_5TextRotaryEmbedding does: frequency j takes the height row where j % 3 == 1 and j < 3 * section[1], the
    width row where j % 3 == 2 and j < 3 * section[2], the time row otherwise. Three equal rows give rope_tables'."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    j = torch.arange(half, device=positions.device)
    row = torch.zeros(half, dtype=torch.long, device=positions.device)
    row[(j % 3 == 1) & (j < 3 * section[1])] = 1
    row[(j % 3 == 2) & (j < 3 * section[2])] = 2
    chosen = positions.float()[row, :].T  # [T, half]: each frequency's own row of the position
    freqs = chosen * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; rotates the first rotary_dim dims (rotate-half), the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


def _attention_qkv(x: torch.Tensor, w, cfg, rope):
    """Projected, normed, rotated q [R, nh, hd], k, v [R, nkv, hd] and the output gate [R, nh*hd]."""
    r = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    qg, k, v = w.qkv.split(w.qkv(x))
    qg = qg.reshape(r, nh, 2 * hd)
    q = rms_norm(qg[..., :hd], w.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k.reshape(r, nkv, hd), w.k_norm, cfg.rms_norm_eps)
    v = v.reshape(r, nkv, hd).float()
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, qg[..., hd:].reshape(r, nh * hd)


def _in_cache_type(x: torch.Tensor, cache) -> torch.Tensor:
    """New keys or values for `cache`: converted to its float type; a q8_0 cache (Q8Cache) takes the f32 values and
    quantizes them itself."""
    return x if isinstance(cache, Q8Cache) else x.to(cache.dtype)


def _attend(q, k, v, k_cache, v_cache, start: int, query_rows: int, dtype=torch.float32) -> torch.Tensor:
    """Write k, v [T, nkv, hd] at positions start.. of one sequence's cache; causal attention of q [T, nh, hd]
    over the cache, `query_rows` queries at a time. Returns [T, nh * hd].

    Query heads are grouped by the KV head they read (GQA) and run as batched matmuls against that head's
    keys, without expanding the cache (2-3x faster here than SDPA, which expands it). `dtype` is the
    matmuls' input type (bf16 in the fast weight mode: 5x the f32 throughput here); softmax stays f32."""
    t, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    end = start + t
    k_cache[:, start:end] = _in_cache_type(k.transpose(0, 1), k_cache)
    v_cache[:, start:end] = _in_cache_type(v.transpose(0, 1), v_cache)
    scale = 1.0 / math.sqrt(hd)
    out = torch.empty(t, nh * hd, dtype=torch.float32, device=q.device)
    for r0 in range(0, t, query_rows):
        r1 = min(t, r0 + query_rows)
        n, last = r1 - r0, start + r1  # these queries see keys 0 .. last-1
        keys = k_cache[:, :last].to(dtype)
        values = v_cache[:, :last].to(dtype)
        qg = q[r0:r1].reshape(n, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * n, hd).to(dtype)
        scores = torch.bmm(qg, keys.transpose(1, 2)).float().mul_(scale).view(nkv, g, n, last)
        if n > 1:  # causal within the new rows: query i sees the new keys up to itself
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            scores[..., last - n:].masked_fill_(future, float("-inf"))
        p = torch.softmax(scores, dim=-1).view(nkv, g * n, last).to(dtype)
        out[r0:r1] = torch.bmm(p, values).float().view(nkv, g, n, hd).permute(2, 0, 1, 3).reshape(n, nh * hd)
    return out


def attend_at(q, k, v, k_cache, v_cache, pos: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """`_attend` for one token whose position is the device tensor `pos` [1]: k, v written there, q's attention
    over the whole cache with the positions `after` it masked (`after` [capacity] bool). Every shape is fixed by the
    cache, nothing is read back to the host, so a CUDA graph replays it at any position. The masked positions get
    weight 0 exactly; what they hold must be finite (0 x inf is NaN): engine/graph.py zeroes a cache's unused tail."""
    _, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    k_cache.index_copy_(1, pos, _in_cache_type(k.transpose(0, 1), k_cache))
    v_cache.index_copy_(1, pos, _in_cache_type(v.transpose(0, 1), v_cache))
    qg = q.reshape(nkv, g, hd).float()
    scores = torch.bmm(qg, k_cache.float().transpose(1, 2)).mul_(1.0 / math.sqrt(hd))  # [nkv, g, capacity]
    scores.masked_fill_(after, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.bmm(p, v_cache.float()).reshape(1, nh * hd)


def attention_mixer(x: torch.Tensor, w, cfg, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                    rope: tuple[torch.Tensor, torch.Tensor], query_rows: int = 64,
                    dtype=torch.float32) -> torch.Tensor:
    """A gated full-attention layer's mixer over T new tokens at positions start..start+T-1 of one sequence.

    k_cache, v_cache: [kv_heads, capacity, hd] (in f32, f16, bf16, or q8_0 blocks: a Q8Cache, dequantized on read),
    written in place at the new positions.
    `query_rows` bounds the attention score matrix: queries are processed that many at a time.
    """
    q, k, v, gate = _attention_qkv(x, w, cfg, rope)
    o = _attend(q, k, v, k_cache, v_cache, start, query_rows, dtype if x.shape[0] > 1 else torch.float32)
    return w.o(o * torch.sigmoid(gate.float()))


def attention_mixer_batch(x: torch.Tensor, w, cfg, caches: list, starts: list[int], rope) -> torch.Tensor:
    """One token each of B sequences (own caches, own positions; `rope` holds each row's position)."""
    q, k, v, gate = _attention_qkv(x, w, cfg, rope)
    o = torch.cat([_attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, starts[i], 1)
                   for i, (kc, vc) in enumerate(caches)])
    return w.o(o * torch.sigmoid(gate.float()))
