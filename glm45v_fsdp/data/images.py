"""Reading one image file of a data record, safely: a bounded decode, downscaled to the processor's pixel budget.

PIL's own guard against decompression bombs (`Image.MAX_IMAGE_PIXELS`) either warns or raises a
`DecompressionBombError`, which is not an `OSError`. Here the guard is ours instead: the header gives the size
without decoding; a JPEG larger than the budget is decoded at a reduced scale (libjpeg's 1/2, 1/4, 1/8 `draft`), so a
20000x20000 photo costs a 2500x2500 decode; what is still over `max_decode_pixels` is refused by name; the decoded image
is then resized to at most `max_pixels` (the image processor would resize it there anyway, after a full-size decode).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

from PIL import Image


class BadImage(Exception):
    """An image file that cannot be used; the message says why and what to do."""


@contextlib.contextmanager
def _own_size_guard() -> Iterator[None]:
    """PIL's decompression-bomb check off while this module applies its own."""
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def _fit(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) scaled down, aspect ratio kept, to at most max_pixels."""
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def require_content(path: Path, bad: type[Exception], read_hint: str = "", empty_hint: str = "") -> None:
    """`bad` when the media file `path` cannot be read or holds 0 bytes, before a decoder sees it; each hint ends
    its message (what to do)."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise bad(f"it cannot be read ({error.strerror}){read_hint}") from None
    if size == 0:
        raise bad(f"the file is empty (0 bytes){empty_hint}")


def load_image(path: Path, max_pixels: int, max_decode_pixels: int) -> Image.Image:
    """The RGB image of `path`, at most `max_pixels` pixels; `BadImage` when the file is empty, not an image,
    truncated or otherwise undecodable, or larger than `max_decode_pixels` even at a reduced decoding scale."""
    require_content(path, BadImage)
    with _own_size_guard():
        try:
            with Image.open(path) as image:
                width, height = image.size
                if width * height > max_pixels and image.format == "JPEG":
                    image.draft("RGB", _fit(width, height, max_pixels))  # decodes at 1/2, 1/4 or 1/8 scale
                decoded_w, decoded_h = image.size
                if decoded_w * decoded_h > max_decode_pixels:
                    raise BadImage(
                        f"it is {width}x{height} pixels ({image.format}); decoding it needs {decoded_w * decoded_h:,} "
                        f"pixels, over data.max_image_pixels={max_decode_pixels:,}. Downscale the file, or raise "
                        f"data.max_image_pixels if the memory allows"
                    )
                rgb = image.convert("RGB")  # decodes now: a truncated or damaged file fails here
        except BadImage:
            raise
        except Exception as error:  # PIL's decoders raise OSError, SyntaxError, ValueError, EOFError, struct.error
            raise BadImage(f"it cannot be decoded as an image: {type(error).__name__}: {error}") from None
    if rgb.width * rgb.height > max_pixels:
        rgb = rgb.resize(_fit(rgb.width, rgb.height, max_pixels), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return rgb
