"""Images as a conversation carries them: content parts in, decoded images and their placeholder ids out.

A message's content may hold image parts, in the forms clients send: OpenAI's `{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}` (or the url as a string), the Responses API's `{"type": "input_image",
"image_url": ...}`, and for the Python API `{"type": "image", "image": PIL image | bytes | path}`. `take_images`
replaces each with `{"type": "image"}` (what the chat template renders as <|vision_start|><|image_pad|><|vision_end|>)
and returns the images, decoded (`preprocess.decode_image`: the pixel limit checked from the header, bombs and broken
files refused), in the order the template renders them.

In the prompt's ids, an image's one <|image_pad|> becomes one id per merged patch, and those ids say which image it
is: `vocab_size + (the first 48 bits of the pixels' sha256 + k) mod 2**48` for its k-th token. So the tokens a state
covers cover its images' content: two conversations whose text is equal and whose images differ never share a state
(in a slot or the state store), and the same image sent again matches. The trunk never sees these ids: the session
embeds their rows from the vision encoder (`vision.span.ImageSpan`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.errors import DeltaserveError

SPACE = 1 << 48
IMAGE_PARTS = ("image", "image_url", "input_image")
DEFAULT_MAX_PIXELS = 16_777_216      # a decoded image's pixels (--max-image-pixels)
MAX_IMAGE_BYTES = 20 << 20           # an encoded image's bytes


class ImageInputError(DeltaserveError):
    """An image part that cannot be read (malformed, not an image, too large, a link not allowed). `where`: the part
    (`messages[i].content[j]`) where one is known."""

    where: str | None = None


@dataclass
class ImageInput:
    image: Any            # PIL.Image.Image, RGB
    digest: bytes         # sha256 of its size and pixels

    @classmethod
    def of(cls, image) -> "ImageInput":
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}:".encode())
        h.update(rgb.tobytes())
        return cls(rgb, h.digest())

    def ids(self, vocab_size: int, count: int) -> list[int]:
        """The placeholder ids of this image's `count` tokens (see the module's notes)."""
        base = int.from_bytes(self.digest[:6], "big")
        return [vocab_size + (base + k) % SPACE for k in range(count)]


def _data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ImageInputError("an image data URL must look like data:image/png;base64,<the bytes in base64>")
    if not head.endswith(";base64"):
        raise ImageInputError("an image data URL must be base64-encoded (data:<type>;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageInputError(f"the image is larger than the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("the image data URL's payload is not valid base64") from None


URL_TIMEOUT_S = 10.0


def fetch_url(url: str, limit: int = MAX_IMAGE_BYTES, timeout: float = URL_TIMEOUT_S) -> bytes:
    """An image link's bytes (`serve --allow-image-urls`): http(s) only, at most `limit` bytes, within `timeout`
    seconds for the whole transfer; ImageInputError saying which limit a link broke."""
    import time
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ImageInputError("an image link must be http:// or https://")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "deltaserve"}),
                                    timeout=timeout) as r:
            if not r.geturl().startswith(("http://", "https://")):
                raise ImageInputError("the image link redirected off http(s)")
            size = r.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > limit:
                raise ImageInputError(f"the image link's body is {size} bytes, over the limit of {limit}")
            data = bytearray()
            while len(data) <= limit:
                chunk = r.read(65536)
                if not chunk:
                    break
                data += chunk
                if time.monotonic() - start > timeout:
                    raise ImageInputError(f"the image link did not arrive within {timeout:g} s")
            if len(data) > limit:
                raise ImageInputError(f"the image link's body is over the limit of {limit} bytes")
            return bytes(data)
    except ImageInputError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ImageInputError(f"the image link could not be fetched: {str(reason)[:200]}") from None


def decode(source: Any, max_pixels: int = DEFAULT_MAX_PIXELS, allow_files: bool = False,
           fetch=None) -> ImageInput:
    """A PIL image, bytes, a data URL, or (the Python API: `allow_files`) a path, decoded and checked; an http(s)
    link only with `fetch` (`fetch_url`, where the server allows links)."""
    from deltaserve.vision.preprocess import ImageError, decode_image

    if hasattr(source, "mode") and hasattr(source, "size"):  # a PIL image already
        w, h = source.size
        if w * h > max_pixels:
            raise ImageInputError(f"the image is {w}x{h} pixels ({w * h}), over the limit of {max_pixels} pixels")
        return ImageInput.of(source)
    if isinstance(source, str):
        if source.startswith("data:"):
            data = _data_url(source)
        elif source.startswith(("http://", "https://")):
            if fetch is None:
                raise ImageInputError("image links are not fetched (the server's --allow-image-urls fetches them): "
                                      "send the image as a data URL (data:image/png;base64,...)")
            data = fetch(source)
        elif allow_files:
            path = Path(source)
            try:
                if path.stat().st_size > MAX_IMAGE_BYTES:
                    raise ImageInputError(f"{path}: {path.stat().st_size} bytes, over the limit of {MAX_IMAGE_BYTES}")
                data = path.read_bytes()
            except OSError as e:
                raise ImageInputError(f"{path}: cannot read it ({e.strerror or e})") from None
        else:
            raise ImageInputError("an image must be a data URL (data:image/png;base64,...)")
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, os.PathLike) and allow_files:
        return decode(os.fspath(source), max_pixels, allow_files, fetch)
    else:
        raise ImageInputError(f"an image must be a data URL, bytes or a PIL image, not {type(source).__name__}")
    try:
        return ImageInput.of(decode_image(data, max_pixels, max_bytes=MAX_IMAGE_BYTES))
    except ImageError as e:
        raise ImageInputError(str(e)) from None


def part_source(part: dict) -> Any | None:
    """The image an image part carries (None: not an image part)."""
    kind = part.get("type")
    if kind == "image":
        return part.get("image", part.get("image_url"))
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return None


def take_images(messages: list, max_pixels: int = DEFAULT_MAX_PIXELS, allow_files: bool = False,
                fetch=None) -> tuple[list, list[ImageInput]]:
    """The messages with each image part as {"type": "image"}, and the images, in order. ImageInputError names the
    part (`messages[i].content[j]`) and what is wrong with it."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                source = part_source(p)
                where = f"messages[{i}].content[{j}]"
                try:
                    if source is None:
                        raise ImageInputError("an image part without its image")
                    images.append(decode(source, max_pixels, allow_files, fetch))
                except ImageInputError as e:
                    err = ImageInputError(f"{where}: {e}")
                    err.where = where
                    raise err from None
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out, images


def expand(ids: list[int], images: list[ImageInput], image_pad_id: int, vocab_size: int, tokens_of) -> list[int]:
    """The prompt ids with each image's one <|image_pad|> (the template's, in order) replaced by its placeholder ids
    (`tokens_of(image)` of them)."""
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_pad_id:
            if k >= len(images):
                raise DeltaserveError(f"the rendered prompt has more image placeholders than the {len(images)} "
                                      "image(s) given")
            out += images[k].ids(vocab_size, tokens_of(images[k].image))
            k += 1
        else:
            out.append(t)
    if k != len(images):
        raise DeltaserveError(f"{len(images)} image(s) given, and the chat template rendered {k} placeholder(s) "
                              "for them (a system message cannot hold one)")
    return out
