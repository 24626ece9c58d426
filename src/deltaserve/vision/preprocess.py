"""Images in: safe decoding with Pillow, then the Qwen3.5 image processor's arithmetic (transformers'
`Qwen2VLImageProcessorPil`, which `AutoImageProcessor` picks for `qwen3_5` / `qwen3_5_moe` when torchvision is
absent): smart_resize to the patch grid within min/max pixels, a bicubic resize by Pillow, rescale by 1/255 (in
float64, then float32), normalisation by mean/std, and the patch flattening in spatial-merge-block order.

`decode_image` refuses, with one line that names the numbers, what is not a picture it should decode: empty or
oversized payloads, bytes no allowed format claims, a header larger than the pixel limit (read before a single
pixel is decoded: Pillow's open is lazy, and the header is read here without Pillow's process-global
MAX_IMAGE_PIXELS check, which this module neither reads for its decision nor changes), truncated or corrupt data.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from deltaserve.errors import DeltaserveError

# The formats decode_image reads, in the order their headers are tried. Left out on purpose: formats Pillow reads
# by running another program (EPS via Ghostscript) or that are not pictures a client sends (fonts, scientific
# containers, video); MPO (multi-picture JPEG from cameras) comes in through the JPEG plugin.
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "PPM", "QOI", "ICO")

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the Qwen2VLImageProcessor class defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(DeltaserveError, ValueError):
    """An image refused: not an image, truncated, over the size or pixel limit, an aspect ratio the grid cannot
    hold. The message is one line meant for the client (an HTTP 400), the numbers named."""


@dataclass(frozen=True)
class ProcessorConfig:
    """The image processor's settings. The defaults are transformers 5.24's `Qwen2VLImageProcessor(Pil)` class
    defaults; a checkpoint's preprocessor_config.json overrides them (`from_hf`)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "ProcessorConfig":
        """From a preprocessor_config.json dict: `size` {shortest_edge, longest_edge}, overridden by top-level
        `min_pixels`/`max_pixels` where present (as transformers' __init__ does), `patch_size`,
        `temporal_patch_size`, `merge_size`, `image_mean`, `image_std`, `resample`."""
        d = cls()
        size = dict(config.get("size") or {})
        min_pixels = config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", d.min_pixels)))
        max_pixels = config.get("max_pixels", size.get("longest_edge", size.get("max_pixels", d.max_pixels)))
        return cls(
            patch_size=int(config.get("patch_size", d.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(config.get("merge_size", d.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            mean=tuple(float(v) for v in config.get("image_mean", d.mean)),
            std=tuple(float(v) for v in config.get("image_std", d.std)),
            resample=int(config.get("resample", d.resample)),
        )

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `preprocess`."""
        return dict(patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                    merge_size=self.merge_size, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                    mean=self.mean, std=self.std, resample=self.resample)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) an image of this size gets, without decoding it."""
        return image_grid(width, height, patch_size=self.patch_size, merge_size=self.merge_size,
                          min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def tokens(self, width: int, height: int) -> int:
        """How many image placeholder tokens (<|image_pad|>) an image of this size takes in the prompt."""
        t, h, w = self.grid(width, height)
        return t * h * w // (self.merge_size ** 2)


# --- decoding -----------------------------------------------------------------------------------------------

def _allowed_openers(formats: Sequence[str]):
    Image.init()  # registers every plugin once; cheap afterwards
    return [(name, Image.OPEN[name]) for name in (f.upper() for f in formats) if name in Image.OPEN]


def _open_header(data: bytes, formats: Sequence[str]) -> Image.Image | None:
    """What Image.open does, less its decompression-bomb check against the process-global limit: the first
    allowed plugin that accepts the bytes reads the header (size, mode), no pixels. None when none accepts."""
    prefix = data[:16]
    for _name, (factory, accept) in _allowed_openers(formats):
        verdict = accept(prefix) if accept else True
        if not verdict or isinstance(verdict, str):
            continue
        try:
            return factory(io.BytesIO(data), "")
        except (SyntaxError, IndexError, TypeError, struct.error):  # not this format after all (as Pillow)
            continue
    return None


def _check_pixels(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"the {what} is {width}x{height} pixels: an empty picture")
    if width * height > max_pixels:
        raise ImageError(f"the {what} is {width}x{height} pixels ({width * height}), over the limit of "
                         f"{max_pixels} pixels")


def decode_image(data: bytes, max_pixels: int, *, max_bytes: int | None = None,
                 formats: Sequence[str] = IMAGE_FORMATS) -> Image.Image:
    """Decode `data` into an RGB Pillow image, or raise ImageError.

    The width and height are read from the header and checked against `max_pixels` before any pixel is
    decoded, so a decompression bomb (a small file that claims a huge picture) costs its header only. Then the
    first frame is decoded (a truncated or corrupt file refused here), the EXIF orientation applied (as
    transformers' load_image does) and the mode converted to RGB the way the Qwen image processor converts:
    transparency composited onto white.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"an image must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {max_bytes} bytes")
    try:
        im = _open_header(data, formats)
    except ImageError:
        raise
    except Exception as e:  # a header that starts right and then breaks: truncated or corrupt
        raise ImageError(f"the image header could not be read ({len(data)} bytes): "
                         f"{type(e).__name__}: {_one_line(e)}") from None
    if im is None:
        raise ImageError(f"not an image, or not a format read here ({len(data)} bytes; formats: "
                         f"{', '.join(formats)})")
    width, height = im.size
    _check_pixels(width, height, max_pixels)
    fmt = im.format or "image"
    try:
        im.load()
        if im.size != (width, height):  # a GIF frame may grow the canvas while decoding
            _check_pixels(*im.size, max_pixels, what=f"decoded {fmt} frame")
        im = ImageOps.exif_transpose(im)
        rgb = to_rgb(im)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # a frame or tile Pillow's own global limit refuses
        raise ImageError(f"the {width}x{height} {fmt} image was refused while decoding: {_one_line(e)}") from None
    except MemoryError:
        raise ImageError(f"the {width}x{height} {fmt} image does not fit in memory") from None
    except Exception as e:
        raise ImageError(f"the {width}x{height} {fmt} image could not be decoded (truncated or corrupt, "
                         f"{len(data)} bytes): {type(e).__name__}: {_one_line(e)}") from None
    return rgb


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "no detail"


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' convert_to_rgb makes it: an image with an alpha band or a transparency entry is
    composited onto white, any other mode converted by Pillow."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# --- the processor's arithmetic -------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: both sides multiples of `factor`, the area within [min_pixels,
    max_pixels], the aspect ratio kept as well as it can be. Returns (height, width)."""
    if min(height, width) <= 0:
        raise ImageError(f"the image is {width}x{height} pixels: an empty picture")
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height} pixels: an aspect ratio of "
                         f"{max(height, width) / min(height, width):.1f}, over the limit of 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(width: int, height: int, *, patch_size: int, merge_size: int, min_pixels: int,
               max_pixels: int) -> tuple[int, int, int]:
    """The patch grid (t, h, w) `preprocess` gives an image of this size (t is 1 for a still image)."""
    rh, rw = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return 1, rh // patch_size, rw // patch_size


def preprocess(image: Image.Image, *, patch_size: int, temporal_patch_size: int, merge_size: int,
               min_pixels: int, max_pixels: int, mean: Sequence[float], std: Sequence[float],
               resample: int = Image.Resampling.BICUBIC) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image to the vision encoder's input, as transformers' Qwen2VLImageProcessorPil makes it.

    Returns pixel_values, float32 [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] (each row one
    patch, flattened channel, time, row, column; rows ordered by spatial-merge block: block row, block column,
    row in block, column in block; a still image repeated over the temporal patch), and the grid (1, h, w) in
    patches.
    """
    image = to_rgb(image)
    width, height = image.size
    rh, rw = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    resized = image.resize((rw, rh), resample=resample)
    pixels = np.asarray(resized, dtype=np.uint8)  # (H, W, C)
    # transformers: rescale in float64 then down to float32, normalize in float32 ((x - mean) / std)
    x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    channels = x.shape[-1]
    gh, gw = rh // patch_size, rw // patch_size
    m, p, t = merge_size, patch_size, temporal_patch_size
    # (H, W, C) -> (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m, m, C, p, p)
    patches = torch.from_numpy(x).reshape(gh // m, m, p, gw // m, m, p, channels).permute(0, 3, 1, 4, 6, 2, 5)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], t, p, p)
    pixel_values = patches.reshape(gh * gw, channels * t * p * p).contiguous()
    return pixel_values, (1, gh, gw)
