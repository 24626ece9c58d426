"""The real Qwen3.5 shapes (from the published config.json files), for benchmarks with random weights."""

from __future__ import annotations

from deltaserve.formats.config import HybridConfig

# text_config of Qwen/Qwen3.5-0.8B and Qwen/Qwen3.5-9B (vocab 248,320; context 262,144; rope theta 1e7;
# partial rotary 0.25; full attention every 4th layer)
SHAPES: dict[str, dict] = {
    "0.8B": dict(hidden_size=1024, intermediate_size=3584, num_layers=24, num_attention_heads=8, num_kv_heads=2,
                 head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=16,
                 linear_value_head_dim=128, tie_word_embeddings=True),
    # not a published shape: the real vocabulary under a few small layers, for tests that need a model whose
    # random answers do not end by chance (an end-of-text token 1 in 248,320)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=4, num_attention_heads=2, num_kv_heads=1,
                 head_dim=64, linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=2,
                 linear_value_head_dim=32, tie_word_embeddings=True),
    "9B": dict(hidden_size=4096, intermediate_size=12288, num_layers=32, num_attention_heads=16, num_kv_heads=4,
               head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
               linear_value_head_dim=128, tie_word_embeddings=False),
    # text_config of Qwen/Qwen3.5-35B-A3B (qwen35moe): 256 experts of 512, 8 a token, a shared expert of 512
    "35B-A3B": dict(hidden_size=2048, intermediate_size=0, num_layers=40, num_attention_heads=16, num_kv_heads=2,
                    head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                    linear_value_head_dim=128, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512),
}


def shape_config(name: str, vocab_size: int = 248320, context: int = 262144, layers: int | None = None) -> HybridConfig:
    s = dict(SHAPES[name])
    if layers is not None:
        s["num_layers"] = layers
    return HybridConfig(
        vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=1e7, rotary_dim=s["head_dim"] // 4,
        context_length=context, layer_types=HybridConfig.layer_types_for(s["num_layers"], 4), conv_kernel=4,
        value_head_order="tiled", eos_token_ids=(248046,), arch="qwen35moe" if s.get("num_experts") else "qwen35",
        **s)
