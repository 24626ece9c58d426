"""Write a host model's weights as an HF Qwen3.5 directory, so transformers runs the very same weights
(the benchmarks' transformers peer). The inverse of the GGUF conventions: norms back to zero-centred,
`A_log = log(-ssm_a)`, conv weights [C, 1, K], value heads back from tiled to grouped order."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deltaserve.formats.config import HybridConfig
from deltaserve.formats.convert import reorder_value_heads
from deltaserve.formats.hf import _HF_LAYER_MAP


def tiled_to_grouped(t: torch.Tensor, dim: int, num_key_heads: int, per_key: int, block: int) -> torch.Tensor:
    return reorder_value_heads(t, dim, num_key_heads, per_key, block, "grouped")


def _grouped(name: str, t: torch.Tensor, c: HybridConfig) -> torch.Tensor:
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    if nk == nv or c.value_head_order == "grouped":
        return t
    r, dv = nv // nk, c.linear_value_head_dim
    if name in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * c.key_dim
        return torch.cat([t[:qk], tiled_to_grouped(t[qk:], 0, nk, r, dv)])
    table = {"attn_gate.weight": (0, dv), "ssm_beta.weight": (0, 1), "ssm_alpha.weight": (0, 1),
             "ssm_dt.bias": (0, 1), "ssm_a": (0, 1), "ssm_out.weight": (1, dv)}
    if name in table:
        dim, block = table[name]
        return tiled_to_grouped(t, dim, nk, r, block)
    return t


def export_hf(host, out: Path, dtype=torch.bfloat16) -> Path:
    """`host` must be loaded with weights="exact" (f32 tensors). Writes config.json + model.safetensors."""
    from safetensors.torch import save_file

    c: HybridConfig = host.config
    w = host.weights
    inverse = {gname: (hf, how) for hf, (gname, how) in _HF_LAYER_MAP.items()}
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed.weight,
                                        "model.norm.weight": w.final_norm - 1.0}
    if not w.tied:
        tensors["lm_head.weight"] = w.lm_head.dense()
    for i, lw in enumerate(w.layers):
        g: dict[str, torch.Tensor] = {"attn_norm.weight": lw.attn_norm, "post_attention_norm.weight": lw.post_norm}
        gate, up = torch.split(lw.gate_up.dense(), lw.gate_up.sizes)
        g.update({"ffn_gate.weight": gate, "ffn_up.weight": up, "ffn_down.weight": lw.down.dense()})
        m = lw.mixer
        if c.is_attention(i):
            q, k, v = torch.split(m.qkv.dense(), m.qkv.sizes)
            g.update({"attn_q.weight": q, "attn_k.weight": k, "attn_v.weight": v, "attn_output.weight": m.o.dense(),
                      "attn_q_norm.weight": m.q_norm, "attn_k_norm.weight": m.k_norm})
        else:
            qkv, z, b, a = torch.split(m.in_proj.dense(), m.in_proj.sizes)
            g.update({"attn_qkv.weight": qkv, "attn_gate.weight": z, "ssm_beta.weight": b, "ssm_alpha.weight": a,
                      "ssm_out.weight": m.out.dense(), "ssm_conv1d.weight": m.conv, "ssm_dt.bias": m.dt_bias,
                      "ssm_a": m.a_neg, "ssm_norm.weight": m.norm})
        for gname, t in g.items():
            hf, how = inverse[gname]
            t = _grouped(gname, t.float(), c)
            if how == "plus_one":
                t = t - 1.0
            elif how == "neg_exp":
                t = torch.log(-t)
            elif how == "squeeze":
                t = t.reshape(t.shape[0], 1, -1)
            tensors[f"model.layers.{i}.{hf}"] = t
    out.mkdir(parents=True, exist_ok=True)
    keep_f32 = ("A_log", "dt_bias", "norm")
    save_file({k: (v.float() if any(s in k for s in keep_f32) else v.to(dtype)).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    pairs = c.rotary_dim // 2
    from deltaserve.formats.convert import balanced_sections
    config = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.context_length, "layer_types": list(c.layer_types),
        "linear_conv_kernel_dim": c.conv_kernel, "linear_num_key_heads": c.linear_num_key_heads,
        "linear_key_head_dim": c.linear_key_head_dim, "linear_num_value_heads": c.linear_num_value_heads,
        "linear_value_head_dim": c.linear_value_head_dim, "tie_word_embeddings": w.tied,
        "eos_token_id": list(c.eos_token_ids), "torch_dtype": str(dtype).replace("torch.", ""),
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.rotary_dim / c.head_dim,
                            "mrope_section": balanced_sections(pairs)},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
