"""The 3-D (time, height, width) rotary positions of a prompt with images, as transformers'
`Qwen3_5Model.get_rope_index` counts them.

Text tokens get three equal rows, one more per token. An image's run of placeholder tokens (<|image_pad|>, one
per merged patch: t * (h/m) * (w/m) of them, in the encoder's order: frame, row, column) gets, from the counter's
value `s` at its start, the rows (s + frame, s + row, s + column); the counter then moves on by
max(h, w) / m only (not by the number of tokens), so the text after an image starts at s + max(h/m, w/m), and the
positions fall behind the token indices. That gap is transformers' "mrope delta": next_position - len(tokens),
the constant every later (text) token's index is shifted by, through decode.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _grids(image_grids) -> list[tuple[int, int, int]]:
    if image_grids is None:
        return []
    if isinstance(image_grids, torch.Tensor):
        image_grids = image_grids.tolist()
    grids = list(image_grids)
    if grids and not hasattr(grids[0], "__len__"):
        grids = [grids]
    return [tuple(int(v) for v in g) for g in grids]  # type: ignore[misc]


def rope_positions(input_ids, image_grids: Sequence[Sequence[int]] | torch.Tensor | None, *,
                   image_token_id: int, vision_start_token_id: int | None, spatial_merge_size: int,
                   start_position: int = 0) -> tuple[torch.Tensor, int]:
    """Positions [3, len(input_ids)] (int64) for one sequence, and the next text position.

    `image_grids` are the images' patch grids (t, h, w) as the preprocessor gives them, in the order their
    placeholder runs appear. `start_position` is the counter's value before the first token, for a sequence that
    continues one already in the cache (the counter is the `next_position` its own call returned); a whole prompt
    starts at 0. The positions of a prompt split between two calls (not inside an image's run) are those of the
    whole prompt. With `vision_start_token_id` given, an image's run must follow <|vision_start|>.

    For decode, token i (0-based over the whole sequence) after the prompt gets three equal rows, i + delta with
    delta = next_position - len(prompt) (transformers' rope_deltas).
    """
    ids = torch.as_tensor(input_ids).reshape(-1).tolist()
    grids = _grids(image_grids)
    m = spatial_merge_size
    n = len(ids)
    rows = torch.empty(3, n, dtype=torch.long)
    pos = int(start_position)
    i = 0
    image = 0
    while i < n:
        if ids[i] != image_token_id:
            j = i
            while j < n and ids[j] != image_token_id:
                j += 1
            rows[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        if image >= len(grids):
            runs = sum(1 for k in range(n) if ids[k] == image_token_id and (k == 0 or ids[k - 1] != image_token_id))
            raise ValueError(f"the prompt has image placeholder tokens past its {len(grids)} image(s) "
                             f"({runs} run(s) of image tokens)")
        if vision_start_token_id is not None and (i == 0 or ids[i - 1] != vision_start_token_id):
            raise ValueError(f"image {image + 1}'s placeholder tokens at index {i} do not follow the "
                             f"vision start token ({vision_start_token_id})")
        t, h, w = grids[image]
        if h % m or w % m:
            raise ValueError(f"image {image + 1}'s grid ({t}, {h}, {w}) is not a multiple of the merge size {m}")
        gt, gh, gw = t, h // m, w // m
        count = gt * gh * gw
        run = 0
        while i + run < n and ids[i + run] == image_token_id and run < count:
            run += 1
        if run != count:
            raise ValueError(f"image {image + 1} ({t}x{h}x{w} patches, merge {m}) takes {count} placeholder "
                             f"tokens; the prompt has {run} at index {i}")
        tt = torch.arange(gt).view(-1, 1, 1).expand(gt, gh, gw)
        hh = torch.arange(gh).view(1, -1, 1).expand(gt, gh, gw)
        ww = torch.arange(gw).view(1, 1, -1).expand(gt, gh, gw)
        rows[:, i:i + count] = torch.stack((tt, hh, ww)).reshape(3, -1) + pos
        pos += max(h, w) // m
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image(s) given, the prompt has placeholder tokens for {image}")
    return rows, pos


def text_positions(start_position: int, count: int) -> torch.Tensor:
    """[3, count] equal rows from `start_position`: the positions of text (and of every decoded token)."""
    return torch.arange(start_position, start_position + count, dtype=torch.long).expand(3, count).clone()
