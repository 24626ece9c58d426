"""Images for Qwen3.5 / Qwen3.6: decoding and preprocessing (`preprocess`, needs Pillow), the vision encoder
(`encoder`), and the language model's 3-D rotary positions for prompts with images (`positions`).

The names below load their module on first use, so importing deltaserve.vision costs nothing and needs no Pillow
until an image is decoded. The preprocessing function itself is `deltaserve.vision.preprocess.preprocess` (the
package attribute `preprocess` is its module).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ImageError": "preprocess",
    "IMAGE_FORMATS": "preprocess",
    "ProcessorConfig": "preprocess",
    "decode_image": "preprocess",
    "image_grid": "preprocess",
    "smart_resize": "preprocess",
    "to_rgb": "preprocess",
    "VisionConfig": "encoder",
    "VisionEncoder": "encoder",
    "vision_tensors": "encoder",
    "rope_positions": "positions",
    "text_positions": "positions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
