"""Image tokens in a span the trunk feeds: their rows' embeddings and the span's 3-D rotary positions.

The chat template writes one <|image_pad|> per merged patch of each image (deltaserve.vision); the trunk embeds
those rows with the vision encoder's output instead of the token's embedding (in order: the images' merged patches
one after another, as transformers' masked_scatter places them), and ropes the span with its (time, height, width)
positions (`vision.positions.rope_positions`, transformers' get_rope_index). After the span, text continues at
`next_position`: the state keeps the difference from its length (`DecodeState.rope_delta`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.vision.positions import rope_positions


@dataclass
class ImageSpan:
    image_token_id: int
    embeds: torch.Tensor       # [image tokens in the span, hidden], in the order of their rows
    positions: torch.Tensor    # [3, T]
    next_position: int         # the rotary position of the first token after the span

    @classmethod
    def build(cls, ids, grids, embeds: torch.Tensor, *, image_token_id: int, vision_start_token_id: int | None,
              spatial_merge_size: int, start_position: int) -> "ImageSpan":
        """For a span of `ids` whose image runs are the images of `grids` (t, h, w) and whose merged embeddings,
        all images' in order, are `embeds`; `start_position`: the rotary position of its first token (the state's
        length plus its rope_delta)."""
        positions, nxt = rope_positions(ids, grids, image_token_id=image_token_id,
                                        vision_start_token_id=vision_start_token_id,
                                        spatial_merge_size=spatial_merge_size, start_position=start_position)
        count = int((torch.as_tensor(ids).reshape(-1) == image_token_id).sum())
        if count != embeds.shape[0]:
            raise ValueError(f"the span has {count} image tokens and {embeds.shape[0]} image embeddings")
        return cls(image_token_id, embeds, positions, nxt)

    def rows(self, i: int, j: int, ids: torch.Tensor) -> "ImageSpan":
        """The part of the span from row i to row j (a prefill chunk)."""
        if i == 0 and j == self.positions.shape[1]:
            return self
        ids = ids.reshape(-1)
        before = int((ids[:i] == self.image_token_id).sum())
        inside = int((ids[i:j] == self.image_token_id).sum())
        return ImageSpan(self.image_token_id, self.embeds[before:before + inside], self.positions[:, i:j],
                         int(self.positions[:, :j].max()) + 1 if j < self.positions.shape[1] else self.next_position)

    def placed(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings `x` [T, hidden] with the image rows replaced."""
        mask = ids.reshape(-1) == self.image_token_id
        if int(mask.sum()) != self.embeds.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens for {self.embeds.shape[0]} image embeddings")
        x = x.clone()
        x[mask] = self.embeds.to(x.device, x.dtype)
        return x
