"""A vision tower from llama.cpp's projector GGUF (`convert_hf_to_gguf.py HF_DIR --mmproj`), as a `Vision`.

The converter's `Qwen3VLVisionModel` (Qwen3-VL, Qwen3.5, Qwen3.5-MoE) writes the HF tower `model.visual.*` under
llama.cpp's clip names, the values unchanged (the arrays GGUFReader gives are in torch's order) but for one split:

    patch_embed.proj.weight [d, c, t, p, p]  ->  v.patch_embd.weight (t = 0), v.patch_embd.weight.1 (t = 1),
                                                 each [d, c, p, p]: stacked back on dim 2 here
    patch_embed.proj.bias                    ->  v.patch_embd.bias
    pos_embed.weight                         ->  v.position_embd.weight
    blocks.{i}.norm1 / norm2                 ->  v.blk.{i}.ln1 / ln2
    blocks.{i}.attn.qkv / attn.proj          ->  v.blk.{i}.attn_qkv / attn_out
    blocks.{i}.mlp.linear_fc1 / linear_fc2   ->  v.blk.{i}.ffn_up / ffn_down
    merger.norm                              ->  v.post_ln
    merger.linear_fc1 / linear_fc2           ->  mm.0 / mm.2

The config comes from the `clip.vision.*` keys; what the file does not record is taken as Qwen3.5 has it: the
activation (the converter writes `clip.use_gelu` whatever the checkpoint says; Qwen3-VL and Qwen3.5 use the tanh
GELU), the rotary base (10000), the processor's resample (bicubic) and its pixel bounds (transformers' class
defaults unless given: a checkpoint's preprocessor_config.json bounds are not carried into the GGUF). The image
token ids are the text model's, so the caller passes them. A Qwen3-VL projector with deepstack mergers is refused:
deltaserve's encoder has no deepstack outputs.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from deltaserve.errors import ModelFormatError
from deltaserve.kernels.linear import GGUF_TYPES, BlockLinear
from deltaserve.vision.encoder import PREFIX, VisionConfig, VisionEncoder, vision_products
from deltaserve.vision.model import Vision
from deltaserve.vision.preprocess import ProcessorConfig

PROJECTOR_TYPES = ("qwen3vl_merger",)

_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_TOP = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
        "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
        "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
        "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
# the products a projector may hold quantized (on their blocks: BlockLinear), by the last part of the HF name
_LINEAR = ("attn.qkv.weight", "attn.proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
           "merger.linear_fc1.weight", "merger.linear_fc2.weight")
_FULL = ("F32", "F16", "BF16")  # read as values: the tower's own f32 or bf16 products take them
_PATCH = re.compile(r"v\.patch_embd\.weight(?:\.(\d+))?$")


def _value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _array(t) -> torch.Tensor:
    """A GGUF tensor as float32 torch, in torch's dimension order (GGML's reversed), dequantized by gguf-py."""
    import gguf

    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)]))


def _hf_name(name: str) -> str | None:
    """The HF name (less `model.visual.`) of a projector tensor, None for the patch kernels and unknown names."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK:
        return f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def load_mmproj(path: str | os.PathLike, image_token_id: int, vision_start_token_id: int | None,
                vision_end_token_id: int | None, *, min_pixels: int | None = None,
                max_pixels: int | None = None, products: str | None = None) -> Vision:
    """The Qwen3.5 / Qwen3-VL vision tower of a projector GGUF, with the text model's image token ids.

    `min_pixels` / `max_pixels` bound the processor's resize; left out, the file's `clip.vision.image_min_pixels`
    / `image_max_pixels` where it has them, else llama.cpp's bounds for these projectors (8 to 4096 merged tokens).
    `products`: the tower's ("f32" or "bf16"; left out, vision_products(): what this CPU runs fastest)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ModelFormatError(f"{path}: not a readable GGUF ({type(e).__name__}: {e})") from None
    arch = _value(reader, "general.architecture")
    if arch != "clip":
        raise ModelFormatError(f"{path}: not a projector GGUF (general.architecture is {arch!r}, a projector's is "
                               f"'clip'): pass the file made by convert_hf_to_gguf.py --mmproj")
    kind = _value(reader, "clip.vision.projector_type") or _value(reader, "clip.projector_type")
    if kind not in PROJECTOR_TYPES:
        raise ModelFormatError(f"{path}: projector type {kind!r}, not a Qwen3.5 / Qwen3-VL vision tower "
                               f"({', '.join(PROJECTOR_TYPES)})")
    if not _value(reader, "clip.has_vision_encoder"):
        raise ModelFormatError(f"{path}: the projector has no vision encoder (clip.has_vision_encoder is not set)")
    deepstack = _value(reader, "clip.vision.is_deepstack_layers") or []
    if any(deepstack) or any(t.name.startswith("v.deepstack.") for t in reader.tensors):
        raise ModelFormatError(f"{path}: a Qwen3-VL projector with deepstack mergers (layers "
                               f"{[i for i, v in enumerate(deepstack) if v]}), which deltaserve's encoder does not "
                               f"model")

    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockLinear] = {}
    kernels: dict[int, torch.Tensor] = {}
    for t in reader.tensors:
        if m := _PATCH.match(t.name):
            kernels[int(m.group(1) or 0)] = _array(t)
        elif (name := _hf_name(t.name)) is not None:
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            if name.endswith(_LINEAR) and len(t.shape) == 2 and kind not in _FULL and kind in GGUF_TYPES:
                # a quantized product's weight: its blocks as the file holds them, multiplied as the trunk's are
                data = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8).reshape(int(t.shape[1]), -1)
                blocks[PREFIX + name] = BlockLinear([(kind, data)], int(t.shape[0]))
            else:
                tensors[PREFIX + name] = _array(t)
        else:
            raise ModelFormatError(f"{path}: projector tensor {t.name} {list(t.shape)} is not one of a Qwen3.5 "
                                   f"vision tower")
    if sorted(kernels) != list(range(len(kernels))) or not kernels:
        raise ModelFormatError(f"{path}: patch kernels {sorted(kernels)}: expected v.patch_embd.weight and "
                               f"v.patch_embd.weight.1, ... (one per temporal slice)")
    shapes = {tuple(k.shape) for k in kernels.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ModelFormatError(f"{path}: the patch kernels' shapes {sorted(shapes)} are not one [d, c, p, p]")
    patch = torch.stack([kernels[i] for i in range(len(kernels))], dim=2)  # [d, c, t, p, p], as the Conv3d
    tensors[PREFIX + "patch_embed.proj.weight"] = patch

    def need(key: str):
        v = _value(reader, key)
        if v is None:
            raise ModelFormatError(f"{path}: the projector lacks the metadata key {key}")
        return v

    positions = tensors.get(PREFIX + "pos_embed.weight")
    if positions is None:
        raise ModelFormatError(f"{path}: the projector has no v.position_embd.weight (the learned position table)")
    vc = VisionConfig(
        depth=int(need("clip.vision.block_count")),
        hidden_size=int(need("clip.vision.embedding_length")),
        num_heads=int(need("clip.vision.attention.head_count")),
        intermediate_size=int(need("clip.vision.feed_forward_length")),
        in_channels=int(patch.shape[1]),
        patch_size=int(need("clip.vision.patch_size")),
        temporal_patch_size=int(patch.shape[2]),
        spatial_merge_size=int(need("clip.vision.spatial_merge_size")),
        out_hidden_size=int(need("clip.vision.projection_dim")),
        num_position_embeddings=int(positions.shape[0]),
        hidden_act="gelu_pytorch_tanh",
    )
    encoder = VisionEncoder(tensors, vc, dtype=torch.float32, products=products or vision_products(), blocks=blocks)

    # the file carries no pixel bounds: llama.cpp's clip takes 8 to 4096 merged tokens for these projectors, and so do
    # we, so that one file makes as many tokens of an image in both engines
    area = (vc.patch_size * vc.spatial_merge_size) ** 2
    mean, std = need("clip.vision.image_mean"), need("clip.vision.image_std")
    if len(mean) != vc.in_channels or len(std) != vc.in_channels:
        raise ModelFormatError(f"{path}: image mean {mean} / std {std} for {vc.in_channels} channels")
    processor = ProcessorConfig(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        min_pixels=int(min_pixels or _value(reader, "clip.vision.image_min_pixels") or 8 * area),
        max_pixels=int(max_pixels or _value(reader, "clip.vision.image_max_pixels") or 4096 * area),
        mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))
    return Vision(encoder, processor, int(image_token_id), vision_start_token_id, vision_end_token_id)
