"""One dataclass for the Qwen3.5 hybrid, whichever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Any, Mapping

from deltaserve.errors import ModelFormatError

ATTENTION = "full_attention"
DELTANET = "linear_attention"

# GGUF keys of the layer pattern (llama.cpp's names): the per-layer map (one bool per block, true for a Gated
# DeltaNet layer) decides where present; the interval is the older, coarser form; MTP blocks follow the trunk
NEXTN_KEY = "{arch}.nextn_predict_layers"
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"
INTERVAL_KEY = "{arch}.full_attention_interval"
GGUF_ARCHS = ("qwen35", "qwen35moe")  # llama.cpp's names of the dense hybrid and its MoE sibling
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class HybridConfig:
    """The shape of a Qwen3.5 hybrid: Gated DeltaNet layers interleaved with gated full attention.

    `value_head_order` says how the file lays out DeltaNet value heads when there are more of them
    than key heads: "grouped" (HF: value head h reads key head h // (nv/nk)) or "tiled" (llama.cpp's
    converter: value head j reads key head j % nk). The forward follows the file's order instead of
    permuting weights, so packed quantized blocks are never cut.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    context_length: int
    layer_types: tuple[str, ...]
    conv_kernel: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    tie_word_embeddings: bool
    value_head_order: str = "grouped"
    arch: str = "qwen35"
    # the MoE sibling (qwen35moe): every layer's FFN is a router over `num_experts` routed experts of
    # `moe_intermediate_size`, the top `num_experts_per_tok` of them per token (their softmax weights renormalised to
    # sum to 1, as transformers' Qwen3_5MoeTopKRouter and llama.cpp's qwen35moe do), plus one shared expert of
    # `shared_expert_intermediate_size` scaled by a sigmoid gate. 0 experts: a dense model, whose FFN is
    # `intermediate_size`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())
    # the rotary frequencies' split among the (time, height, width) rows of a position, interleaved (j % 3), as
    # transformers' Qwen3_5TextRotaryEmbedding reads rope_parameters.mrope_section and llama.cpp
    # {arch}.rope.dimension_sections: text gives three equal rows, so only image tokens see the difference
    mrope_section: tuple[int, ...] = (11, 11, 10)
    # what the reader noticed and the user should hear (printed once at load by formats/source.py); not part of
    # the model's identity
    notices: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if len(self.layer_types) != self.num_layers:
            problems.append(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        unknown = sorted({str(t) for t in self.layer_types} - {ATTENTION, DELTANET})
        if unknown:
            problems.append(f"layer types {unknown} (expected {ATTENTION!r} or {DELTANET!r})")
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                     "linear_value_head_dim", "conv_kernel", "vocab_size", "context_length"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} = {getattr(self, name)}")
        if self.num_attention_heads % max(self.num_kv_heads, 1):
            problems.append(f"{self.num_attention_heads} attention heads not a multiple of {self.num_kv_heads} KV heads")
        if self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            problems.append(f"{self.linear_num_value_heads} value heads not a multiple of "
                            f"{self.linear_num_key_heads} key heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            problems.append(f"rotary dim {self.rotary_dim} for head dim {self.head_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                problems.append(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) <= 0:
                    problems.append(f"{name} = {getattr(self, name)}")
        elif self.intermediate_size <= 0:
            problems.append(f"intermediate_size = {self.intermediate_size}")
        if self.value_head_order not in ("grouped", "tiled"):
            problems.append(f"value head order {self.value_head_order!r}")
        if problems:
            raise ModelFormatError("not a usable Qwen3.5 hybrid config: " + "; ".join(problems))

    # -- derived shapes -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def ffn_size(self) -> int:
        """The widest FFN activation a token makes: the dense FFN's, or the shared expert's / a routed one's."""
        return max(self.intermediate_size, self.moe_intermediate_size, self.shared_expert_intermediate_size)

    def describe(self) -> str:
        """The model in a few words, for the route line."""
        if self.is_moe:
            return (f"{self.arch} hybrid MoE, {self.num_layers} layers, {self.num_experts_per_tok} of "
                    f"{self.num_experts} experts a token + a shared expert")
        return f"{self.arch} hybrid, {self.num_layers} layers"

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != ATTENTION)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def kv_bytes_per_position(self, dtype_bytes: int = 4) -> int:
        """KV cache bytes one position costs across all attention layers."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes * len(self.attention_layers)

    def recurrent_state_bytes(self) -> int:
        """Conv + recurrent state of all DeltaNet layers (f32), independent of length."""
        per_layer = (self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
                     + (self.conv_kernel - 1) * self.conv_dim) * 4
        return per_layer * len(self.deltanet_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("notices")
        return d

    # -- sources ---------------------------------------------------------------------------------
    @staticmethod
    def layer_types_for(num_layers: int, interval: int) -> tuple[str, ...]:
        if interval <= 0:
            raise ModelFormatError(f"full_attention_interval must be positive, found {interval}")
        return tuple(ATTENTION if (i + 1) % interval == 0 else DELTANET for i in range(num_layers))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "HybridConfig":
        """From an HF config.json (Qwen3_5ForCausalLM, or the multimodal one's `text_config`)."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
        tmt = text.get("model_type", model_type)
        if tmt not in HF_MODEL_TYPES and not any(a.startswith("Qwen3_5") for a in archs):
            raise ModelFormatError(
                f"expected a Qwen3.5 config (model_type {' / '.join(HF_MODEL_TYPES)}), found model_type "
                f"{model_type!r}, architectures {archs}")
        moe = "moe" in str(tmt).lower() or any("Moe" in a for a in archs)

        def need(key: str) -> Any:
            if key not in text:
                raise ModelFormatError(f"config.json has no {key!r} (expected a Qwen3.5 text config)")
            return text[key]

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            layer_types = cls.layer_types_for(num_layers, int(text.get("full_attention_interval", 4)))
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        experts = dict(
            num_experts=int(need("num_experts")), num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=int(need("shared_expert_intermediate_size"))) if moe else {}
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(text.get("intermediate_size") or 0) if moe else int(need("intermediate_size")),
            num_layers=num_layers,
            num_attention_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rotary_dim=int(head_dim * partial),
            context_length=int(text.get("max_position_embeddings", 262144)),
            layer_types=tuple(layer_types),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            tie_word_embeddings=bool(tie),
            value_head_order="grouped",
            arch="qwen35moe" if moe else "qwen35",
            eos_token_ids=eos_ids,
            mrope_section=tuple(int(v) for v in rope.get("mrope_section", (11, 11, 10))[:3]),
            **experts,
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_rows: int, tied: bool) -> "HybridConfig":
        """From GGUF metadata of arch `qwen35` or `qwen35moe`. `vocab_rows` is the embedding's row count."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ModelFormatError(f"expected a GGUF of architecture {' or '.join(map(repr, GGUF_ARCHS))}, "
                                   f"found {arch!r}")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"GGUF metadata has no {full!r} (expected in a {arch} file)")
            return meta[full]

        experts: dict[str, Any] = {}
        if arch == "qwen35moe":
            experts = dict(num_experts=_one_count(need("expert_count"), f"{arch}.expert_count"),
                           num_experts_per_tok=_one_count(need("expert_used_count"), f"{arch}.expert_used_count"),
                           moe_intermediate_size=_one_count(need("expert_feed_forward_length"),
                                                            f"{arch}.expert_feed_forward_length"),
                           shared_expert_intermediate_size=_one_count(need("expert_shared_feed_forward_length"),
                                                                      f"{arch}.expert_shared_feed_forward_length"))

        blocks = int(need("block_count"))
        nextn = meta.get(NEXTN_KEY.format(arch=arch), 0)
        if isinstance(nextn, bool) or not isinstance(nextn, int) or not 0 <= nextn < blocks:
            raise ModelFormatError(f"{NEXTN_KEY.format(arch=arch)} = {nextn!r} for {blocks} blocks "
                                   f"({arch}.block_count): expected a count of MTP blocks below {blocks}")
        num_layers = blocks - nextn  # the MTP blocks (nextn) follow the trunk; they are not layers of the forward
        layer_types, notices = gguf_layer_types(meta, arch, blocks, num_layers)
        head_dim = int(meta.get(f"{arch}.attention.key_length") or need("embedding_length") // need("attention.head_count"))
        inner = int(need("ssm.inner_size"))
        nv = int(need("ssm.time_step_rank"))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab_rows),
            hidden_size=int(need("embedding_length")),
            intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or 0) if experts
            else int(need("feed_forward_length")),
            num_layers=num_layers,
            num_attention_heads=int(need("attention.head_count")),
            num_kv_heads=int(need("attention.head_count_kv")),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim // 4)),
            context_length=int(need("context_length")),
            layer_types=layer_types,
            conv_kernel=int(need("ssm.conv_kernel")),
            linear_num_key_heads=int(need("ssm.group_count")),
            linear_key_head_dim=int(need("ssm.state_size")),
            linear_num_value_heads=nv,
            linear_value_head_dim=inner // max(nv, 1),
            tie_word_embeddings=tied,
            value_head_order="tiled",
            arch=arch,
            eos_token_ids=(int(eos),) if eos is not None else (),
            mrope_section=tuple(int(v) for v in (meta.get(f"{arch}.rope.dimension_sections") or (11, 11, 10))[:3]),
            notices=notices,
            **experts,
        )


def _one_count(value: Any, key: str) -> int:
    """A count that llama.cpp lets a file give per layer (an array): one value for every layer, or a clear refusal."""
    if isinstance(value, (list, tuple)):
        if not value or len(set(value)) != 1:
            raise ModelFormatError(f"{key} differs between layers ({list(value)[:8]}...): one value for every layer "
                                   "is supported")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(f"{key} must be an integer, found {value!r}")
    return int(value)


def gguf_layer_types(meta: Mapping[str, Any], arch: str, blocks: int, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The trunk's layer types from GGUF metadata, and the notices to give, as llama.cpp reads them: the per-layer
    map `{arch}.attention.recurrent_layers` (one entry per block, MTP blocks included; true for a Gated DeltaNet
    layer) decides where present; else `{arch}.full_attention_interval` (default 4). llama.cpp's converter writes
    both, the interval as 4 whenever the HF config lists only `layer_types`: where they disagree the map wins and
    a notice says so."""
    map_key, interval_key = RECURRENT_LAYERS_KEY.format(arch=arch), INTERVAL_KEY.format(arch=arch)
    interval = meta.get(interval_key)
    interval_ok = isinstance(interval, int) and not isinstance(interval, bool) and interval > 0
    if map_key not in meta:
        if interval is not None and not interval_ok:
            raise ModelFormatError(f"{interval_key} must be a positive integer, found {interval!r}")
        return HybridConfig.layer_types_for(num_layers, interval if interval is not None else 4), ()
    flags = meta[map_key]
    want = f"one boolean per block ({blocks}, {arch}.block_count), true for a Gated DeltaNet layer"
    if not isinstance(flags, (list, tuple)):
        raise ModelFormatError(f"{map_key} must be an array of {want}; found a single "
                               f"{type(flags).__name__} ({flags!r})")
    if len(flags) != blocks:
        raise ModelFormatError(f"{map_key} has {len(flags)} entries for {blocks} blocks: expected {want}")
    for i, v in enumerate(flags):
        if not (isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))):
            shown = f"an array of {len(v)}" if isinstance(v, (list, tuple)) else f"{v!r} ({type(v).__name__})"
            raise ModelFormatError(f"{map_key} must be an array of {want}; entry {i} of {len(flags)} is {shown}")
    types = tuple(DELTANET if v else ATTENTION for v in flags[:num_layers])
    notices: tuple[str, ...] = ()
    attention = [i for i, t in enumerate(types) if t == ATTENTION]
    if interval is not None and not interval_ok:
        notices = (f"[deltaserve] {interval_key} is {interval!r}, not a positive integer: ignored; the layer map "
                   f"{map_key} decides (full attention at layers {attention} of {num_layers})",)
    elif interval is not None and HybridConfig.layer_types_for(num_layers, interval) != types:
        by_interval = [i for i in range(num_layers) if (i + 1) % interval == 0]
        notices = (f"[deltaserve] the file's layer map {map_key} (full attention at layers {attention} of "
                   f"{num_layers}) disagrees with its {interval_key} = {interval} (which would put it at layers "
                   f"{by_interval}): following the layer map, as llama.cpp does",)
    return types, notices
