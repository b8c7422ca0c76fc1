"""Property test: base64 ``data:`` URLs of media as asyncllm reads them, against vLLM's MediaConnector and MediaIO.

The reference is written from vLLM's source (vllm/frontend/processing/multimodal/media/connector.py
``_load_data_url``; image.py, audio.py, video.py ``load_base64``), not from asyncllm's parsers:

- the header is what lies between ``data:`` and the first ``,`` (none: refused); the part after its last ``;`` must be
  exactly ``base64`` (in that case; no ``;`` or another last part: refused, so a missing marker, a marker before
  ``;charset=...`` or ``BASE64`` are refused); the media type is its first part and vLLM checks none of it;
- an image's and an audio's payload are decoded as pybase64's ``validate=True`` decodes: ASCII of the standard alphabet
  only (no whitespace, no URL-safe ``-`` / ``_``), padded to a multiple of four; an empty payload is no bytes;
- a video's payload is decoded without ``validate`` (pybase64's default): a non-ASCII character is refused, any other
  character outside the alphabet (line breaks, spaces, ``-``, ``@``) is dropped, then the rest must be padded as above.

asyncllm differs from this on purpose in the header only, each difference a branch of `asyncllm_expected`: an image's
media type must be ``image/*`` (any case), ``application/octet-stream`` or none, and its ``base64`` marker is taken in
any case (docs/multimodal.md); a video's type must be none or start ``video/`` (``data:video/<type>;base64``); an
audio's header is not read at all (only its payload). vLLM's ``video/jpeg`` list of comma-separated frames is not
drawn (asyncllm reads no such list).

Drawn: a data URL of a small real file (a PNG made with PIL, a WAV made with ``wave``; the video reader's bytes are
not decoded here, so either serves) plus a few drawn bytes (so the padding and the ``+`` / ``/`` characters vary),
with a drawn media type (each modality's, another modality's, upper case, ``application/octet-stream``, none, text),
drawn parameters (``;charset=utf-8``, ``;name=...``) before or after a drawn marker (``;base64`` in three cases, none,
with a space), or no comma at all, and drawn payload mangling (line breaks every 76 or a drawn number of characters,
``\\r\\n``, spaces, padding removed, the URL-safe alphabet, a junk or a non-ASCII character, an empty payload).
Checked: asyncllm returns exactly the bytes the reference decodes, or refuses when it refuses with an
`InvalidRequestError` naming the drawn field; never another exception.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import string
import wave

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import InvalidRequestError
from asyncllm.mm.audios import _file_bytes
from asyncllm.mm.images import data_url_bytes, read_image
from asyncllm.mm.video_files import _file_source

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "400"))
ALPHABET = string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/"
MODALITIES = ("image", "audio", "video")


# ---------------------------------------------------------------- the reference: vLLM's data: URL reading
def vllm_media_type(url: str) -> str | None:
    """The media type vLLM's connector hands to ``load_base64``, or None when the header is refused."""
    rest = url[len("data:"):]
    if "," not in rest:
        return None
    header = rest[:rest.index(",")]
    if ";" not in header:
        return None
    last_semicolon = header.rindex(";")
    if header[last_semicolon + 1:] != "base64":
        return None
    return header.split(";")[0]


def quads(text: str) -> bytes | None:
    """Standard-alphabet base64 with its padding, decoded by hand (trailing bits beyond the last byte ignored, as
    pybase64 and the standard library do); None when not a whole number of padded quads."""
    if len(text) % 4:
        return None
    body = text.rstrip("=")
    padding = len(text) - len(body)
    if padding > 2 or any(c not in ALPHABET for c in body):
        return None
    value = 0
    for c in body:
        value = value * 64 + ALPHABET.index(c)
    nbytes = len(body) * 6 // 8
    extra_bits = len(body) * 6 - nbytes * 8
    return (value >> extra_bits).to_bytes(nbytes, "big") if nbytes else b""


def strict_base64(payload: str) -> bytes | None:
    """pybase64's ``b64decode(payload, validate=True)`` (vLLM's image and audio), None for its error."""
    return quads(payload)


def lenient_base64(payload: str) -> bytes | None:
    """pybase64's ``b64decode(payload)`` (vLLM's video): non-ASCII refused, other non-alphabet characters dropped."""
    if not payload.isascii():
        return None
    return quads("".join(c for c in payload if c in ALPHABET or c == "="))


def vllm_bytes(url: str, modality: str) -> bytes | None:
    """The bytes vLLM reads out of ``url`` for ``modality``, or None when it refuses the URL."""
    if vllm_media_type(url) is None:
        return None
    payload = url.partition(",")[2]
    return lenient_base64(payload) if modality == "video" else strict_base64(payload)


def asyncllm_expected(url: str, modality: str) -> bytes | None:
    """`vllm_bytes` with asyncllm's deliberate header differences (module docstring)."""
    header, comma, payload = url.partition(",")
    parts = header[len("data:"):].split(";")
    media_type = parts[0]
    if modality == "audio":  # only the payload is read
        return strict_base64(payload)
    if modality == "image":
        allowed = media_type.lower() in ("", "application/octet-stream") or media_type.lower().startswith("image/")
        marked = len(parts) > 1 and parts[-1].lower() == "base64"
        return strict_base64(payload) if comma and marked and allowed else None
    allowed = media_type == "" or media_type.startswith("video/")
    return vllm_bytes(url, modality) if allowed else None


# ---------------------------------------------------------------- asyncllm's readers
def asyncllm_bytes(url: str, modality: str, field: str) -> bytes:
    if modality == "image":
        got = data_url_bytes(url, field)
        assert read_image(url, field) == got
        return got
    if modality == "audio":
        return _file_bytes(url, field)
    return _file_source(url, field).getvalue()


# ---------------------------------------------------------------- draws
@functools.cache
def media_file(modality: str) -> bytes:
    """A 2 x 3 RGBA PNG for an image, 5 samples of 8 kHz mono 16-bit WAV for an audio or a video (not decoded)."""
    buffer = io.BytesIO()
    if modality == "image":
        from PIL import Image

        Image.new("RGBA", (2, 3), (10, 200, 30, 128)).save(buffer, format="PNG")
    else:
        with wave.open(buffer, "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(8000)
            f.writeframes(b"\x01\x00\xff\x7f\x00\x80\x10\x00\xfe\xff")
    return buffer.getvalue()


MEDIA_TYPES = ("image/png", "image/jpeg", "IMAGE/PNG", "Image/Webp", "audio/wav", "audio/mpeg", "AUDIO/WAV",
               "video/mp4", "video/webm", "VIDEO/MP4", "Video/mp4", "application/octet-stream",
               "APPLICATION/OCTET-STREAM", "", "text/plain", "base64", "image", "video", "audio/")
NEAR_TYPES = {"image": ("image/png", "IMAGE/PNG", "", "application/octet-stream", "image", "image/"),
              "audio": ("audio/wav", "AUDIO/WAV", "", "application/octet-stream", "image/png", "video/mp4"),
              "video": ("video/mp4", "VIDEO/MP4", "Video/mp4", "", "video", "application/octet-stream", "image/png")}
"""Per modality: its own type in two cases, none, and the near misses a header check could get wrong."""
PARAMETERS = (";charset=utf-8", ";name=a.png", ";filename=\"x y\"", ";foo")
MARKERS = (";base64",) * 6 + (";BASE64", ";Base64", "", "; base64", ";base64 ", ";base-64")

def wrapped(text: str, width: int, newline: str) -> str:
    return newline.join(text[i:i + width] for i in range(0, len(text), width))


@st.composite
def mangled(draw: st.DrawFn, payload: str) -> str:
    """``payload`` with none, one or two drawn manglings."""
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 1, 2)))):
        how = draw(st.sampled_from(("wrap76", "wrap_crlf", "wrap_n", "space", "unpad", "urlsafe", "junk",
                                    "non_ascii", "empty", "trailing_newline")))
        at = draw(st.integers(0, len(payload)))
        if how == "wrap76":
            payload = wrapped(payload, 76, "\n")
        elif how == "wrap_crlf":
            payload = wrapped(payload, 76, "\r\n")
        elif how == "wrap_n":
            payload = wrapped(payload, draw(st.integers(1, 80)), draw(st.sampled_from(("\n", " ", "\t"))))
        elif how == "space":
            payload = payload[:at] + " " + payload[at:]
        elif how == "unpad":
            payload = payload.rstrip("=")
        elif how == "urlsafe":
            payload = payload.translate(str.maketrans("+/", "-_"))
        elif how == "junk":
            payload = payload[:at] + draw(st.sampled_from("@!*.%\\\"#$&,;:")) + payload[at:]
        elif how == "non_ascii":
            payload = payload[:at] + draw(st.sampled_from(("é", "\u2026", "\u00a0", "\uff21"))) + payload[at:]
        elif how == "empty":
            payload = ""
        else:
            payload += "\n"
    return payload


@st.composite
def data_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(modality, a data: URL of one of its files with a drawn header and payload)."""
    modality = draw(st.sampled_from(MODALITIES))
    raw = media_file(modality) + draw(st.binary(max_size=5))
    payload = draw(mangled(base64.b64encode(raw).decode()))
    before = "".join(draw(st.lists(st.sampled_from(PARAMETERS), max_size=2)))
    after = draw(st.sampled_from(("",) * 5 + PARAMETERS))
    media_type = draw(st.sampled_from(NEAR_TYPES[modality]) | st.sampled_from(MEDIA_TYPES))
    header = "data:" + media_type + before + draw(st.sampled_from(MARKERS)) + after
    comma = draw(st.sampled_from(("",) + (",",) * 7))
    return modality, header + comma + payload


# ---------------------------------------------------------------- the property
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(data_urls(), st.sampled_from(("images[0]", "messages[0].content[1]", "audios[2]", "videos[1]")))
@example(("image", "data:;base64,QUJD"), "images[0]")
@example(("image", "data:application/octet-stream;base64,QUJD"), "images[0]")
@example(("image", "data:IMAGE/PNG;charset=utf-8;BASE64,QUJD"), "images[0]")
@example(("image", "data:image;base64,QUJD"), "images[0]")
@example(("image", "data:image/png;base64"), "images[0]")
@example(("image", "data:image/png;base64,QU JD"), "images[0]")
@example(("audio", "data:audio/wav,QUJD"), "audios[0]")
@example(("audio", "data:audio/wav;base64,QUJ\nD"), "audios[0]")
@example(("video", "data:;base64,QUJD"), "videos[0]")
@example(("video", "data:video/mp4;base64"), "videos[0]")
@example(("video", "data:VIDEO/MP4;base64,QUJD"), "videos[0]")
@example(("video", "data:video/mp4;charset=utf-8;base64,QU,J\r\nD"), "videos[0]")
@example(("video", "data:video/mp4;base64,QUJD-_+/+/"), "videos[0]")
def test_data_url_read_as_vllm_reads_it(drawn: tuple[str, str], field: str) -> None:
    modality, url = drawn
    expected = asyncllm_expected(url, modality)
    try:
        got = asyncllm_bytes(url, modality, field)
    except InvalidRequestError as exc:
        assert expected is None, f"{modality} {url[:120]!r} refused ({exc}), expected {len(expected)} bytes"
        assert exc.field == field, (exc.field, field)
        return
    assert expected is not None, f"{modality} {url[:120]!r} accepted, expected a refusal"
    assert got == expected


@pytest.mark.parametrize("modality", MODALITIES)
def test_plain_base64_is_the_file(modality: str) -> None:
    """What an OpenAI client sends, ``data:<type>;base64,<b64encode(file)>``, is the file for vLLM and asyncllm."""
    raw = media_file(modality)
    url = f"data:{modality}/{'png' if modality == 'image' else 'wav'};base64," + base64.b64encode(raw).decode()
    assert vllm_bytes(url, modality) == asyncllm_expected(url, modality) == raw
    assert asyncllm_bytes(url, modality, "x") == raw


# ---------------------------------------------------------------- the bugs this test found (plain examples)
@pytest.mark.parametrize("modality", MODALITIES)
def test_non_ascii_payload_is_an_invalid_request(modality: str) -> None:
    """A non-ASCII character in the payload (a pasted ellipsis, a no-break space) made the standard library raise a
    bare ``ValueError`` ("string argument should contain only ASCII characters"), not a ``binascii.Error``: images
    and videos let it through untyped."""
    url = f"data:{modality}/png;base64,QUJD\u2026"
    with pytest.raises(InvalidRequestError) as info:
        asyncllm_bytes(url, modality, "prompt.media[0]")
    assert info.value.field == "prompt.media[0]"


def test_wrapped_base64_video_is_read_as_vllm_reads_it() -> None:
    """A video's base64 wrapped at 76 characters (``base64 clip.mp4`` in a shell, MIME encoders) is read by vLLM, whose
    VideoMediaIO decodes without ``validate``; asyncllm refused it."""
    raw = media_file("video") * 20
    url = "data:video/mp4;base64," + base64.encodebytes(raw).decode()
    assert "\n" in url and vllm_bytes(url, "video") == raw
    assert _file_source(url, "videos[0]").getvalue() == raw
