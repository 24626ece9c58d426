"""A checkpoint's vision side as one object: its encoder, its image processor's settings and the image tokens.

`load_vision(directory)` reads an HF checkpoint directory (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): `model.visual.*` from its safetensors (sharded or not), `vision_config` and the
image token ids from config.json, the processor's settings from preprocessor_config.json (its defaults where the
directory has none). `Vision.encode(images)` preprocesses Pillow images and encodes them; `Vision.span(ids, images,
start_position)` gives the trunk what it needs for a span holding their placeholder tokens (`vision.span.ImageSpan`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from deltaserve.errors import ModelFormatError
from deltaserve.vision.encoder import PREFIX, VisionConfig, VisionEncoder, vision_products


@dataclass
class Vision:
    encoder: VisionEncoder
    processor: "object"            # preprocess.ProcessorConfig
    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None

    @property
    def merge(self) -> int:
        return self.encoder.config.spatial_merge_size

    def grid(self, image) -> tuple[int, int, int]:
        return self.processor.grid(*image.size)

    def tokens(self, image) -> int:
        """The placeholder tokens an image takes in the prompt."""
        return self.encoder.config.tokens(self.grid(image))

    def encode(self, images: Sequence) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Pillow images (RGB) -> (their merged embeddings one after another [tokens, hidden], their grids)."""
        from deltaserve.vision.preprocess import preprocess

        pixels, grids = [], []
        for im in images:
            values, grid = preprocess(im, **self.processor.kwargs())
            pixels.append(values)
            grids.append(tuple(int(v) for v in grid))
        if not pixels:
            return torch.empty(0, self.encoder.config.out_hidden_size), []
        with torch.inference_mode():
            return self.encoder.encode(torch.cat(pixels), grids), grids

    def span(self, ids, images: Sequence, start_position: int):
        """The `ImageSpan` of a span of prompt ids whose image placeholders are `images`' (in order)."""
        from deltaserve.vision.span import ImageSpan

        embeds, grids = self.encode(images)
        return ImageSpan.build(ids, grids, embeds, image_token_id=self.image_token_id,
                               vision_start_token_id=self.vision_start_token_id, spatial_merge_size=self.merge,
                               start_position=start_position)


def load_vision(directory: str | Path, products: str | None = None) -> Vision | None:
    """The vision side of an HF checkpoint directory, or None when it has none (a text-only checkpoint).
    `products`: the tower's ("f32" or "bf16"; left out, vision_products(): what this CPU runs fastest)."""
    from safetensors import safe_open

    from deltaserve.vision.preprocess import ProcessorConfig

    d = Path(directory)
    config = json.loads((d / "config.json").read_text())
    if not isinstance(config.get("vision_config"), dict):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(d.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    tensors[name] = f.get_tensor(name)
    if not tensors:
        return None  # a config that names a tower whose weights the directory does not hold
    vc = VisionConfig.from_hf(config)
    encoder = VisionEncoder(tensors, vc, dtype=torch.float32, products=products or vision_products())
    pre = d / "preprocessor_config.json"
    processor = ProcessorConfig.from_hf(json.loads(pre.read_text())) if pre.exists() else \
        ProcessorConfig(patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                        merge_size=vc.spatial_merge_size)
    if processor.patch_size != vc.patch_size or processor.merge_size != vc.spatial_merge_size:
        raise ModelFormatError(f"{d}: the image processor's patch {processor.patch_size} / merge "
                               f"{processor.merge_size} differ from the vision encoder's {vc.patch_size} / "
                               f"{vc.spatial_merge_size}")
    image = config.get("image_token_id")
    if not isinstance(image, int):
        raise ModelFormatError(f"{d}/config.json has a vision_config but no image_token_id")
    return Vision(encoder, processor, image, config.get("vision_start_token_id"), config.get("vision_end_token_id"))
