"""Image files into uint8 RGB arrays, read by the library made for it
(Pillow), bounded before anything is decoded: what an image folder is
trained on and what distributed-mpt-predict classifies go through the same
code, so a model sees a user's photo as it saw its training images.

Any format Pillow reads (PNG, JPEG, GIF, BMP, WebP, TIFF, ...): the first
frame of an animation, in RGB, resized as a whole (squashed, not cropped,
with antialiasing) to the size the model takes.
"""

import io
import os
import stat
from typing import Optional, Tuple

import numpy as np

from distributed_mpt.errors import UserError, quoted

# Far above any photo (a 50-megapixel JPEG is about 20 MB): a bigger file is
# refused before it is read into memory.
MAX_IMAGE_BYTES = 64 << 20
# A small file can decode to gigabytes (a PNG of one colour compresses
# 1000:1, a GIF holds frames of 10000 x 10000): the header's size of the one
# frame that is decoded is checked first. 100 million RGB pixels: 300 MB.
MAX_IMAGE_PIXELS = 100_000_000


class ImageError(UserError):
    """An image file that cannot be read, or is not an image."""


def read_image(path: str, size: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """The image file at `path` as uint8 [height, width, 3] RGB of `size`
    (height, width; None: its own), or ImageError naming the file and what
    is wrong."""
    from PIL import Image

    # Our bound below, checked on the header before anything is decoded,
    # replaces Pillow's (a warning on stderr from 89 million pixels on).
    Image.MAX_IMAGE_PIXELS = None
    encoded = _read_bounded(path)
    try:
        image = Image.open(io.BytesIO(encoded))  # the header only
    except Exception:  # noqa: BLE001 - UnidentifiedImageError, SyntaxError, ...
        raise ImageError(f"{quoted(path)} is not an image file (Pillow reads PNG, JPEG, GIF, "
                         f"BMP, WebP, TIFF and more)") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"{quoted(path)} says it holds {width * height:,} pixels, more than "
                         f"this program decodes ({MAX_IMAGE_PIXELS:,})")
    try:
        pixels = np.asarray(image.convert("RGB"))  # decodes the first frame only
    except Exception:  # noqa: BLE001 - OSError("image file is truncated"), ValueError, ...
        raise ImageError(f"{quoted(path)} begins as a {image.format} image does but does not "
                         f"decode (damaged or truncated): give an intact copy") from None
    return resize(pixels, size) if size else pixels


def resize(pixels: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """uint8 [H, W, 3] `pixels` as uint8 of `size` (height, width): unchanged
    if already that size, else resized with antialiasing, which averages all
    the pixels that shrink into one instead of sampling a few of them."""
    if pixels.shape[:2] == tuple(size):
        return pixels
    import tensorflow as tf

    small = tf.image.resize(pixels, size, antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(small), 0, 255), tf.uint8).numpy()


def _read_bounded(path: str) -> bytes:
    """The bytes of the regular file at `path`, at most MAX_IMAGE_BYTES. By
    kind and size before reading: a FIFO would block the read forever, and
    /dev/zero fill the memory."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ImageError(f"{quoted(path)} is not a regular file (a directory, FIFO or "
                             f"device): give an image file")
        with open(path, "rb") as f:
            encoded = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:  # missing, not readable
        raise ImageError(f"cannot read {quoted(path)} ({e.strerror})") from None
    if len(encoded) > MAX_IMAGE_BYTES:
        raise ImageError(f"{quoted(path)} is larger than an image this program reads "
                         f"({MAX_IMAGE_BYTES >> 20} MB)")
    return encoded
