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
from typing import Any, Callable

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


def fetch_url(url: str, limit: int = MAX_IMAGE_BYTES, timeout: float = URL_TIMEOUT_S,
              allow_private: bool = False) -> bytes:
    """An image link's bytes (`serve --allow-image-urls`; vision.fetch: public addresses only unless
    `allow_private`, redirects checked, one deadline, a byte cap); ImageInputError with one message for every
    failure."""
    from deltaserve.vision.fetch import FetchFailed, fetch_image

    try:
        return fetch_image(url, limit, timeout, allow_private)
    except FetchFailed as e:
        raise ImageInputError(str(e)) from None


def private_fetch_url(url: str) -> bytes:
    """`fetch_url` that may reach loopback and private addresses (`--allow-private-image-urls`)."""
    return fetch_url(url, allow_private=True)


@dataclass
class ImageLimits:
    """What one request's images may be: each at most `max_pixels`; at most `max_images` of them and
    `max_total_pixels` together (read from their headers before any is decoded); links fetched by `fetch` (None:
    refused); `vision` False: the model has no vision encoder, so any image part is refused before it is read."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int | None = None
    max_total_pixels: int | None = None
    fetch: Callable[[str], bytes] | None = None
    vision: bool = True


def _raw(source: Any, allow_files: bool, fetch) -> Any:
    """An image part's source as bytes (a data URL decoded, a link fetched, a path read) or a PIL image."""
    if hasattr(source, "mode") and hasattr(source, "size"):  # a PIL image already
        return source
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
        return _raw(os.fspath(source), allow_files, fetch)
    else:
        raise ImageInputError(f"an image must be a data URL, bytes or a PIL image, not {type(source).__name__}")
    return data


def header_pixels(raw: Any) -> int:
    """The pixels an image's header declares (0 where it cannot be read: its decode refuses it, by name)."""
    if hasattr(raw, "size") and hasattr(raw, "mode"):
        return raw.size[0] * raw.size[1]
    from deltaserve.vision.preprocess import IMAGE_FORMATS, _open_header

    try:
        im = _open_header(bytes(raw), IMAGE_FORMATS)
    except Exception:  # noqa: BLE001 - a broken header: decode_image says what is wrong with it
        return 0
    return im.size[0] * im.size[1] if im is not None else 0


def _decoded(raw: Any, max_pixels: int) -> ImageInput:
    from deltaserve.vision.preprocess import ImageError, decode_image

    if hasattr(raw, "mode") and hasattr(raw, "size"):
        w, h = raw.size
        if w * h > max_pixels:
            raise ImageInputError(f"the image is {w}x{h} pixels ({w * h}), over the limit of {max_pixels} pixels")
        return ImageInput.of(raw)
    try:
        return ImageInput.of(decode_image(raw, max_pixels, max_bytes=MAX_IMAGE_BYTES))
    except ImageError as e:
        raise ImageInputError(str(e)) from None


def decode(source: Any, max_pixels: int = DEFAULT_MAX_PIXELS, allow_files: bool = False,
           fetch=None) -> ImageInput:
    """A PIL image, bytes, a data URL, or (the Python API: `allow_files`) a path, decoded and checked; an http(s)
    link only with `fetch` (`fetch_url`, where the server allows links)."""
    return _decoded(_raw(source, allow_files, fetch), max_pixels)


def part_source(part: dict) -> Any | None:
    """The image an image part carries (None: not an image part)."""
    kind = part.get("type")
    if kind == "image":
        return part.get("image", part.get("image_url"))
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return None


def _at(where: str, e: Exception) -> ImageInputError:
    err = ImageInputError(f"{where}: {e}")
    err.where = where
    return err


def take_images(messages: list, max_pixels: int = DEFAULT_MAX_PIXELS, allow_files: bool = False,
                fetch=None, limits: ImageLimits | None = None) -> tuple[list, list[ImageInput]]:
    """The messages with each image part as {"type": "image"}, and the images, in order. ImageInputError names the
    part (`messages[i].content[j]`) and what is wrong with it. With `limits` (the server's): the parts are counted,
    and refused before any is read where the model has no vision encoder; their sources are read and their headers'
    pixels added up before any is decoded."""
    if limits is not None:
        max_pixels, fetch = limits.max_pixels, limits.fetch
    out, found = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                found.append((f"messages[{i}].content[{j}]", part_source(p)))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    if not found:
        return out, []
    if limits is not None and not limits.vision:
        raise _at(found[0][0], ImageInputError(f"this model has no vision encoder: image parts are refused unread "
                                               f"({len(found)} in this request)"))
    if limits is not None and limits.max_images is not None and len(found) > limits.max_images:
        raise _at(found[limits.max_images][0], ImageInputError(
            f"the request holds {len(found)} images, more than this server's limit of {limits.max_images} "
            "(--max-images)"))
    raws, total = [], 0
    for where, source in found:
        try:
            if source is None:
                raise ImageInputError("an image part without its image")
            raw = _raw(source, allow_files, fetch)
        except ImageInputError as e:
            raise _at(where, e) from None
        raws.append(raw)
        pixels = header_pixels(raw)
        if pixels > max_pixels:  # its own limit first: refused from its header, by its decode (nothing decoded)
            try:
                _decoded(raw, max_pixels)
            except ImageInputError as e:
                raise _at(where, e) from None
        total += pixels
        if limits is not None and limits.max_total_pixels is not None and total > limits.max_total_pixels:
            raise _at(where, ImageInputError(
                f"the images up to this one declare {total} pixels together, over this server's limit of "
                f"{limits.max_total_pixels} for one request (--max-image-pixels-total): refused before any is "
                "decoded"))
    images = []
    for (where, _), raw in zip(found, raws):
        try:
            images.append(_decoded(raw, max_pixels))
        except ImageInputError as e:
            raise _at(where, e) from None
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
