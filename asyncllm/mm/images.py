"""Image inputs: bytes, a data: URL, a path or a PIL image -> (RGB image, item key), bounded and typed; transparency
is composited onto white (`to_rgb`, as transformers and vLLM do).

An item's key is the content hash of the image, or a hash of the caller's uuid
for it (``image_uuids``, or a chat part's ``"uuid"``): then no pixel byte is read
for the key, and the same uuid means the same image (the caller's contract).

Runs on the processor thread. The size is read from the image header before any
pixel is decoded, so an oversized image costs nothing; anything PIL cannot
decode fails its own request with `InvalidRequestError`, never the engine.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError

__all__ = ["MAX_IMAGE_ASPECT_RATIO", "ImageInput", "check_aspect_ratio", "check_max_image_pixels", "check_uuid",
           "check_uuids", "data_url_bytes", "decode_image", "image_hash", "load_image", "read_image", "to_rgb",
           "uuid_key"]

ImageInput = Any
"""``bytes``, a base64 ``data:`` URL, a path (``str`` / ``os.PathLike``) or a ``PIL.Image.Image``."""
MAX_IMAGE_ASPECT_RATIO = 200
"""The most an image's or a video frame's longer side may be over its shorter one (Qwen2-VL's processor's bound;
`check_aspect_ratio`): resizing the shorter side to the encoder's (CLIP's ``shortest_edge``) makes a 60000 x 1 strip of
a few hundred bytes billions of pixels."""


def check_max_image_pixels(value: int) -> None:
    """``mm_max_image_pixels`` within PIL's own decompression-bomb bound (twice ``PIL.Image.MAX_IMAGE_PIXELS``, a
    process-wide setting, read here), which refuses a larger image before ours is checked: above it our bound would
    silently be PIL's. Checked once, by the host as it prepares a multimodal model (asyncllm/engine/prepare.py): it
    decodes the images; the core and workers, fresh interpreters with PIL's default, never decode one (a standalone
    core's preparation skips it: each attached host checks it)."""
    try:
        from PIL import Image
    except ImportError:  # no images without pillow (asyncllm/mm/processor.py says so)
        return
    if Image.MAX_IMAGE_PIXELS is not None and value > 2 * Image.MAX_IMAGE_PIXELS:
        raise ConfigError("mm_max_image_pixels", value, f"at most {2 * int(Image.MAX_IMAGE_PIXELS)}, PIL's "
                          "decompression-bomb limit (2 x PIL.Image.MAX_IMAGE_PIXELS), which refuses larger images "
                          "first; raise PIL.Image.MAX_IMAGE_PIXELS in this process before creating the engine to go higher")


def read_image(image: ImageInput, field: str) -> bytes | Any:
    """Encoded bytes for bytes and paths, the image itself for a PIL image."""
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str) and image.startswith("data:"):
        return data_url_bytes(image, field)
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        raise InvalidRequestError(field, "URLs are not fetched; pass bytes or a base64 data: URL")
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                return f.read()
        except OSError as exc:
            raise InvalidRequestError(field, f"cannot read image file {os.fspath(image)!r:.120}: {exc.strerror} (a str "
                                             "image is a path, or a data:image/<type>;base64,... URL)") from exc
    if type(image).__module__ == "numpy":
        return _array_image(image, field)
    raise InvalidRequestError(field, f"an image must be bytes, a path, a PIL image or a numpy array of pixels, got "
                                     f"{type(image).__name__}")


def _array_image(array: Any, field: str) -> Any:
    """A numpy array as vLLM takes one: uint8 pixels of shape (H, W) or (H, W, C), C 1, 3 or 4, as a PIL image (so
    it is keyed and processed as that image is)."""
    from PIL import Image

    shape = getattr(array, "shape", ())
    if getattr(array, "dtype", None) is None or array.dtype.name != "uint8" or len(shape) not in (2, 3) or (
            len(shape) == 3 and shape[2] not in (1, 3, 4)):
        raise InvalidRequestError(field, f"a numpy image must be uint8 pixels of shape (H, W) or (H, W, 1|3|4), got "
                                         f"{getattr(array, 'dtype', None)} {tuple(shape)}")
    return Image.fromarray(array[:, :, 0] if len(shape) == 3 and shape[2] == 1 else array)


def data_url_bytes(url: str, field: str) -> bytes:
    """The image of a ``data:[<media type>];base64,<data>`` URL (RFC 2397; what OpenAI clients send), decoded.

    Only base64 data of an ``image/*`` type (any case), ``application/octet-stream`` (what clients send for an
    uploaded file) or none given is taken: the bytes themselves must then be an image. The bytes are the key's
    content, so the same image as a data URL or as bytes is one cache entry."""
    header, comma, payload = url.partition(",")
    params = header.removeprefix("data:").split(";")
    kind = params[0].strip().lower()
    if not comma or params[-1].lower() != "base64" or (kind and not kind.startswith("image/")
                                                       and kind != "application/octet-stream"):
        raise InvalidRequestError(field, f"a data: URL must be 'data:image/<type>;base64,<data>', got {header!r:.60}")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:  # binascii.Error, or a ValueError for a non-ASCII character
        raise InvalidRequestError(field, f"the data: URL's base64 is invalid: {exc}") from exc


def image_hash(raw: bytes | Any) -> str:
    """A content hash (blake2b-128) of the encoded bytes, or of a PIL image's mode, size and pixels, its palette
    in a palette mode ("P", "PA": the pixels are indices into it, so equal pixels of two palettes are two images) and
    its ``transparency`` entry (which index or colour `to_rgb` makes white)."""
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(raw, bytes):
        digest.update(b"bytes:")
        digest.update(raw)
    else:
        digest.update(f"pil:{raw.mode}:{raw.size}:".encode())
        digest.update(raw.tobytes())  # loads a lazily opened image first, its palette with it
        if raw.palette is not None:
            digest.update(f":palette:{raw.palette.mode}:".encode())
            digest.update(raw.palette.tobytes())
        if raw.info.get("transparency") is not None:  # which index or colour is transparent (`to_rgb`)
            digest.update(f":transparency:{raw.info['transparency']!r}".encode())
    return digest.hexdigest()


def to_rgb(image: Any) -> Any:
    """``image`` as RGB, any transparency (an alpha band, or a ``transparency`` entry: a palette's or a colour's
    ``tRNS``) composited onto white: transformers' ``convert_to_rgb``, vLLM's ``rgba_background_color``. A plain
    ``convert("RGB")`` would show the colours under transparent pixels instead."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def load_image(image: ImageInput, field: str, max_pixels: int | None = None) -> tuple[bytes | Any, str]:
    """(the raw input to decode later, its content hash); cheap for bytes: nothing is decoded yet (a lazily opened
    PIL image is loaded to hash its pixels, after its size is checked against `max_pixels`: a truncated one
    fails here as it would decoding)."""
    raw = read_image(image, field)
    if max_pixels is not None and not isinstance(raw, bytes):
        _check_pixels(raw.size, field, max_pixels)
    try:
        return raw, image_hash(raw)
    except (OSError, ValueError) as exc:
        raise _undecodable(field, exc) from exc


_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")
"""A Python object's default repr, which PIL puts in some errors (``cannot identify image file <_io.BytesIO object at
0x7f...>``): a memory address, nothing the client sent."""


def _undecodable(field: str, exc: Exception) -> InvalidRequestError:
    """The 400 of an image PIL cannot decode (not an image format it knows, truncated, corrupt): PIL's reason
    without object reprs."""
    reason = _OBJECT_REPR.sub("", str(exc)).strip() or type(exc).__name__
    return InvalidRequestError(field, f"cannot decode the image: its bytes are not a decodable image ({reason})")


def _check_pixels(size: tuple[int, int], field: str, max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise InvalidRequestError(
            field, f"the image is {width}x{height} = {width * height} pixels, over mm_max_image_pixels={max_pixels}")
    check_aspect_ratio(height, width, field)


def check_aspect_ratio(height: int, width: int, field: str, what: str = "an image") -> None:
    """`InvalidRequestError` naming `field` for `what` (an image, a video frame) with a side of no pixels (which
    a resize would divide by), or a longer side over `MAX_IMAGE_ASPECT_RATIO` times its shorter one (Qwen2-VL's and
    its video processors' ``smart_resize`` bound), before any resize."""
    if min(height, width) < 1:
        raise InvalidRequestError(field, f"{what} of {width}x{height} needs at least one pixel each way")
    if max(height, width) > MAX_IMAGE_ASPECT_RATIO * min(height, width):
        raise InvalidRequestError(field, f"{what} of {width}x{height}: its aspect ratio {width}:{height} is over "
                                         f"{MAX_IMAGE_ASPECT_RATIO} (asyncllm.mm.images.MAX_IMAGE_ASPECT_RATIO): "
                                         "image processors resize such a strip to a huge one")


def uuid_key(uuid: str) -> str:
    """The item key of a caller-given uuid (blake2b-128 of it, apart from every content hash)."""
    return hashlib.blake2b(b"uuid:" + uuid.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def check_uuids(uuids: Any, num_images: int, field: str) -> list[str | None]:
    """The caller's uuids, one per image (None: hash that image's content); `InvalidRequestError` naming ``field``."""
    if uuids is None:
        return [None] * num_images
    if not isinstance(uuids, (list, tuple)) or len(uuids) != num_images:
        got = f"{len(uuids)} uuids" if isinstance(uuids, (list, tuple)) else f"a {type(uuids).__name__}"
        raise InvalidRequestError(field, f"must be a list with one uuid (str or None) per image: {num_images} images, got {got}")
    return [check_uuid(uuid, f"{field}[{index}]") for index, uuid in enumerate(uuids)]


def check_uuid(uuid: Any, field: str) -> str | None:
    """One caller uuid: a non-empty str, or None (hash the content)."""
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise InvalidRequestError(field, f"a uuid must be a non-empty str or None, got {uuid!r:.80}")
    return uuid


def decode_image(raw: bytes | Any, field: str, max_pixels: int) -> Any:
    """The RGB image (`to_rgb`), after checking its size against ``max_pixels`` (mm_max_image_pixels; PIL refuses
    an image over twice ``PIL.Image.MAX_IMAGE_PIXELS`` as it opens it, a bound `check_max_image_pixels` keeps ours
    within)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw)) if isinstance(raw, bytes) else raw
        _check_pixels(image.size, field, max_pixels)
        return to_rgb(image)
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own bound, at least ours (asyncllm/config_model.py)
        raise InvalidRequestError(field, f"the image is too large: {exc} (mm_max_image_pixels={max_pixels})") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise _undecodable(field, exc) from exc
