"""The layer math of the Qwen3.5 hybrid, as plain functions over tensors (all state math in float32).

Shapes use T for the number of new tokens. Nothing here allocates long-lived state: the decode
state is passed in and updated in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64  # the chunk length of the chunked gated delta rule


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in float32; `weight` is the multiplicative form (1 + w_hf)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet output norm per value head: rmsnorm(o) * weight * silu(z) (weight is plain, no +1)."""
    o = o.float()
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed * F.silu(z.float())


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def mlp(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    return down(F.silu(gate(x)) * up(x))


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over time, then SiLU.

    x: [T, C] new inputs; conv_state: [K-1, C] the previous K-1 inputs (updated in place);
    weight: [C, K]. Returns [T, C].
    """
    t = x.shape[0]
    k = weight.shape[1]
    window = torch.cat([conv_state, x.to(conv_state.dtype)], dim=0)  # [K-1+T, C]
    if t == 1:
        out = (window * weight.t()).sum(0, keepdim=True)
    else:
        out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0].t()
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
    """One token of the gated delta rule, in place on `state` [H, dk, dv].

    q, k: [H, dk] (normalised, q scaled); v: [H, dv]; g, beta: [H]. Returns o: [H, dv].
    """
    state.mul_(torch.exp(g)[:, None, None])
    predicted = torch.einsum("hkv,hk->hv", state, k)
    delta = (v - predicted) * beta[:, None]
    state.add_(k[:, :, None] * delta[:, None, :])
    return torch.einsum("hkv,hk->hv", state, q)


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
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [H, n, chunk, ...]
        x = x.float()
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        x = x.transpose(0, 1)
        return x.reshape(h, n, chunk, *x.shape[2:])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    gb, bb = blocks(g), blocks(beta)  # [H, n, C]

    log_decay = gb.cumsum(-1)  # G_i within each chunk
    causal_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = log_decay[..., :, None] - log_decay[..., None, :]  # G_i - G_j
    pair = torch.exp(diff.masked_fill(~causal_incl, float("-inf")))  # Gamma_i / Gamma_j for j <= i, else 0

    kk = kb @ kb.transpose(-1, -2)
    a = (kk * pair * bb[..., :, None]).tril(-1)  # strictly lower A
    system = a + torch.eye(chunk, dtype=a.dtype, device=a.device)
    rhs_v = vb * bb[..., None]
    rhs_k = kb * (bb * torch.exp(log_decay))[..., None]
    u = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)  # d without S0
    w = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)  # d = u - w S0

    qk = (qb @ kb.transpose(-1, -2)) * pair  # includes the diagonal
    q_decayed = qb * torch.exp(log_decay)[..., None]
    total = log_decay[..., -1:]  # G_C
    k_to_end = kb * torch.exp(total - log_decay)[..., None]
    chunk_decay = torch.exp(total)[..., None]  # [H, n, 1, 1]

    out = torch.empty(h, n, chunk, dv, dtype=torch.float32, device=q.device)
    s = state
    for i in range(n):
        d = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ d
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ d
    state.copy_(s)
    return out.reshape(h, n * chunk, dv)[:, :t].transpose(0, 1)


def deltanet_mixer(x: torch.Tensor, w, cfg, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   chunked: bool) -> torch.Tensor:
    """A Gated DeltaNet layer's mixer over T new tokens. x: [T, hidden] (already normed)."""
    t = x.shape[0]
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qkv = causal_conv(w.qkv(x), conv_state, w.conv)
    q, k, v = torch.split(qkv, [nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2_normalize(q.reshape(t, nk, dk)) * (dk ** -0.5)
    k = l2_normalize(k.reshape(t, nk, dk))
    q = expand_key_heads(q, nv, cfg.value_head_order)
    k = expand_key_heads(k, nv, cfg.value_head_order)
    v = v.reshape(t, nv, dv)
    beta = torch.sigmoid(w.b(x).float())
    g = w.a_neg * F.softplus(w.a(x).float() + w.dt_bias)
    if chunked:
        o = delta_rule_chunked(q, k, v, g, beta, ssm_state)
    else:
        o = torch.stack([delta_rule_step(q[i], k[i], v[i], g[i], beta[i], ssm_state) for i in range(t)])
    z = w.z(x).reshape(t, nv, dv)
    o = gated_rms_norm(o, z, w.norm, cfg.rms_norm_eps)
    return w.out(o.reshape(t, nv * dv))


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; rotates the first rotary_dim dims (rotate-half), the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


def attention_mixer(x: torch.Tensor, w, cfg, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                    rope: tuple[torch.Tensor, torch.Tensor], query_rows: int = 512) -> torch.Tensor:
    """A gated full-attention layer's mixer over T new tokens at positions start..start+T-1.

    k_cache, v_cache: [kv_heads, capacity, hd], written in place at the new positions.
    `query_rows` bounds the attention score matrix: queries are processed that many at a time.
    """
    t = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    qg = w.q(x).reshape(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
    k = rms_norm(w.k(x).reshape(t, nkv, hd), w.k_norm, cfg.rms_norm_eps)
    v = w.v(x).reshape(t, nkv, hd).float()
    cos, sin = rope
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    end = start + t
    k_cache[:, start:end] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, start:end] = v.transpose(0, 1).to(v_cache.dtype)
    keys = k_cache[:, :end].float()
    values = v_cache[:, :end].float()
    qh = q.transpose(0, 1)  # [nh, T, hd]
    scale = 1.0 / math.sqrt(hd)
    if t == 1:
        o = F.scaled_dot_product_attention(qh, keys, values, scale=scale, enable_gqa=nh != nkv)
    else:
        pieces = []
        for r0 in range(0, t, query_rows):
            r1 = min(t, r0 + query_rows)
            qpos = torch.arange(start + r0, start + r1, device=x.device)
            kpos = torch.arange(0, end, device=x.device)
            mask = kpos[None, :] <= qpos[:, None]
            pieces.append(F.scaled_dot_product_attention(qh[:, r0:r1], keys, values, attn_mask=mask,
                                                         scale=scale, enable_gqa=nh != nkv))
        o = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    o = o.transpose(0, 1).reshape(t, nh * hd)
    o = o * torch.sigmoid(gate.reshape(t, nh * hd).float())
    return w.o(o)
