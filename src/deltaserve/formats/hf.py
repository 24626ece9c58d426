"""HF safetensors directories (Qwen3_5ForCausalLM or the multimodal one's text model), read in GGUF names and
conventions: tensors renamed and transformed on read, nothing converted ahead of time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.errors import ModelFormatError


_HF_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm.weight", "plus_one"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "plus_one"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", None),
    "mlp.up_proj.weight": ("ffn_up.weight", None),
    "mlp.down_proj.weight": ("ffn_down.weight", None),
    "self_attn.q_proj.weight": ("attn_q.weight", None),
    "self_attn.k_proj.weight": ("attn_k.weight", None),
    "self_attn.v_proj.weight": ("attn_v.weight", None),
    "self_attn.o_proj.weight": ("attn_output.weight", None),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "plus_one"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "plus_one"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", None),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", None),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", None),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", None),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "squeeze"),
    "linear_attn.dt_bias": ("ssm_dt.bias", None),
    "linear_attn.A_log": ("ssm_a", "neg_exp"),
    "linear_attn.norm.weight": ("ssm_norm.weight", None),
    "linear_attn.out_proj.weight": ("ssm_out.weight", None),
    # the MoE block (Qwen3_5MoeSparseMoeBlock): the router, the experts fused as transformers holds them (gate and
    # up rows of each expert in one 3-D tensor), the shared expert and its gate
    "mlp.gate.weight": ("ffn_gate_inp.weight", None),
    "mlp.experts.gate_up_proj": ("ffn_gate_up_exps.weight", None),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", None),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", None),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", None),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", None),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", None),
}
# experts stored one tensor each (`mlp.experts.{e}.gate_proj.weight`): stacked on read into the 3-D tensor
_HF_EXPERT_MAP = {"gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight",
                  "down_proj.weight": "ffn_down_exps.weight"}


# the MTP block's own tensors (`mtp.*`, outside the text model's prefix), renamed as llama.cpp's converter does
_HF_MTP_MAP = {"fc.weight": ("nextn.eh_proj.weight", None),
               "pre_fc_norm_embedding.weight": ("nextn.enorm.weight", "plus_one"),
               "pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", "plus_one"),
               "norm.weight": ("nextn.shared_head_norm.weight", "plus_one")}


def hf_to_gguf_name(name: str, prefix: str, num_layers: int | None = None) -> tuple[str, str | None] | None:
    """The GGUF name and transform of an HF tensor name under `prefix` ("model." or "model.language_model.").
    With `num_layers`, the MTP block (`mtp.*`) becomes block `num_layers`, as llama.cpp's converter writes it."""
    if name == "lm_head.weight":
        return "output.weight", None
    for mtp in ("mtp.", "model.mtp."):
        if num_layers is not None and name.startswith(mtp):
            rest = name[len(mtp):]
            if rest in _HF_MTP_MAP:
                gname, how = _HF_MTP_MAP[rest]
                return f"blk.{num_layers}.{gname}", how
            if rest.startswith("layers.0."):
                mapped = hf_to_gguf_name(prefix + "layers.0." + rest[len("layers.0."):], prefix)
                if mapped is not None:
                    return f"blk.{num_layers}." + mapped[0].split(".", 2)[2], mapped[1]
            return None
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest == "embed_tokens.weight":
        return "token_embd.weight", None
    if rest == "norm.weight":
        return "output_norm.weight", "plus_one"
    if rest.startswith("layers."):
        _, idx, tail = rest.split(".", 2)
        if tail in _HF_LAYER_MAP:
            gname, how = _HF_LAYER_MAP[tail]
            return f"blk.{idx}.{gname}", how
        if tail.startswith("mlp.experts."):
            expert, _, proj = tail[len("mlp.experts."):].partition(".")
            if expert.isdigit() and proj in _HF_EXPERT_MAP:
                return f"blk.{idx}.{_HF_EXPERT_MAP[proj]}", f"expert:{int(expert)}"
    return None


def apply_hf_transform(t: torch.Tensor, how: str | None) -> torch.Tensor:
    if how == "plus_one":
        return t.float() + 1.0
    if how == "neg_exp":
        return -torch.exp(t.float())
    if how == "squeeze":
        return t.reshape(t.shape[0], -1)
    return t


class HFSource:
    """Tensors of an HF Qwen3.5 directory, renamed and transformed to GGUF conventions on read."""

    def __init__(self, directory: Path, prefix: str, num_layers: int | None = None):
        from safetensors import safe_open

        self.dir = directory
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{directory}: no *.safetensors files (expected HF Qwen3.5 weights)")
        index_path = directory / "model.safetensors.index.json"
        if index_path.exists():
            try:
                wanted = set(json.loads(index_path.read_text())["weight_map"].values())
            except (ValueError, KeyError) as e:
                raise ModelFormatError(f"{index_path.name} is not a valid safetensors index: {e}") from None
            missing = sorted(w for w in wanted if not (directory / w).exists())
            if missing:
                raise ModelFormatError(f"{directory}: the index names shards that are missing: {', '.join(missing)}")
        self._handles = []
        self._where: dict[str, tuple[Any, str, str | None]] = {}
        experts: dict[str, dict[int, tuple[Any, str]]] = {}  # one tensor per expert: stacked on read
        for path in files:
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:
                raise ModelFormatError(f"{path.name} is not a readable safetensors file: {e}") from None
            self._handles.append(h)
            for name in h.keys():
                mapped = hf_to_gguf_name(name, prefix, num_layers)
                if mapped is None:
                    continue  # vision tower, anything not part of the text model
                gname, how = mapped
                if how and how.startswith("expert:"):
                    experts.setdefault(gname, {})[int(how.split(":")[1])] = (h, name)
                else:
                    self._where[gname] = (h, name, how)
        for gname, parts in experts.items():
            if sorted(parts) != list(range(len(parts))):
                missing = sorted(set(range(max(parts) + 1)) - set(parts))
                raise ModelFormatError(f"{directory}: {gname} is stored one tensor per expert, and experts {missing[:8]} "
                                       f"of {max(parts) + 1} are missing")
            self._where[gname] = ([parts[e] for e in range(len(parts))], "", "stack")

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        h, hf_name, how = self._where[name]
        if how == "stack":
            first, first_name = h[0]
            return (len(h), *first.get_slice(first_name).get_shape())
        shape = tuple(h.get_slice(hf_name).get_shape())
        if how == "squeeze":
            shape = (shape[0], int(np.prod(shape[1:])))
        return shape

    def type_name(self, name: str) -> str:
        h, hf_name, how = self._where[name]
        if how == "stack":
            h, hf_name = h[0]
        return str(h.get_slice(hf_name).get_dtype())

    def stored_bytes(self, name: str) -> int:
        sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
        return int(np.prod(self.shape(name))) * sizes.get(self.type_name(name).upper(), 4)

    def dense(self, name: str) -> torch.Tensor:
        h, hf_name, how = self._where[name]
        if how == "stack":
            return torch.stack([self._read(part, part_name).float() for part, part_name in h])
        return apply_hf_transform(self._read(h, hf_name), how).float().contiguous()

    @staticmethod
    def _read(h: Any, hf_name: str) -> torch.Tensor:
        try:
            return h.get_tensor(hf_name)
        except Exception as e:
            raise ModelFormatError(f"tensor {hf_name} could not be read: {e}") from None

    def blocks(self, name: str) -> None:
        return None  # safetensors hold no quantized blocks

    def release(self, name: str, lo_byte: int = 0, hi_byte: int | None = None) -> None:
        pass


def hf_prefix(config: dict) -> str:
    archs = config.get("architectures") or []
    if any("ConditionalGeneration" in a for a in archs) or "text_config" in config:
        return "model.language_model."
    return "model."
