"""Image files into uint8 RGB arrays, read by the library made for it
(Pillow), bounded before anything is decoded: what an image folder is
trained on and what distributed-mpt-predict classifies go through the same
code, so a model sees a user's photo as it saw its training images.

The formats are those whose decoders this module was tested against,
damaged and oversized (tests/core/test_images.py): PNG (animated too), JPEG (and
MPO, as cameras and phones write it), GIF, BMP, WebP and TIFF. Any other
(HEIC, AVIF, TGA, ICO, PSD, ...) is refused by name, not handed to a
decoder whose bounds were never checked. A file is decoded whole: every frame of an
animation or page of a TIFF (within the frame and pixel bounds), and read to
its end marker, so that a truncated file is refused, not trained on. The
first frame is the image, turned upright as its EXIF Orientation tag says (a
phone's photo is stored sideways with one), in RGB, resized as a whole
(squashed, not cropped, with antialiasing) to the size the model takes.
16-bit greyscale is scaled to 0-255; 32-bit integers and floats, whose
range the file does not say, are refused.
"""

import contextlib
import errno
import io
import os
import re
import warnings
from typing import Optional, Tuple

import numpy as np

from distributed_mpt import files
from distributed_mpt.errors import UserError, quoted, too_long_to_open

# Far above any photo (a 50-megapixel JPEG is about 20 MB): a bigger file is
# refused before it is read into memory.
MAX_IMAGE_BYTES = 64 << 20
# A small file can decode to gigabytes (a PNG of one colour compresses
# 1000:1, a GIF holds frames of 10000 x 10000): each frame's size is checked
# before it is decoded, and the frames of one file together hold at most
# this many. Decoding one of that many pixels costs far more than their 300
# MB of RGB: measured with Pillow 13 on 2 cores of an AMD EPYC (Zen 1), a PNG of 100
# million pixels peaked at about 776 MB (1083 MB with the resize to a
# model's size), an animated WebP at about 1700 MB.
MAX_IMAGE_PIXELS = 100_000_000
# What an image within the bounds may cost while decoded (the WebP above),
# for the message of a machine that has less to give.
DECODE_MEMORY = "about 1.7 GB"
# Frames of an animation or pages of a TIFF: each is decoded (a damaged one
# is a damaged file), and even a 1-pixel frame costs Python's time.
MAX_FRAMES = 1000
# Pillow's names of the formats read (its JPEG reader opens MPO files too),
# and how an error line names them.
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
FORMAT_NAMES = "PNG, JPEG, GIF, BMP, WebP and TIFF"
# The modes Pillow gives these formats' 8-bit images, which its
# convert("RGB") turns into what the file shows.
_EIGHT_BIT = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
# 16-bit greyscale, which convert("RGB") would clip to 255: nearly all white.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_WITHOUT_RANGE = {"I": "32-bit integer", "F": "32-bit floating-point"}
# A PNG's last chunk, whole: no data, so always the same CRC.
_PNG_END = b"IEND\xaeB`\x82"


class ImageError(UserError):
    """An image file that cannot be read, or is not an image."""


def read_image(path: str, size: Optional[Tuple[int, int]] = None,
               encoded: Optional[bytes] = None) -> np.ndarray:
    """The image file at `path` (its bytes `encoded`, if file_bytes read
    them already) as uint8 [height, width, 3] RGB of `size` (height, width;
    None: its own), or ImageError naming the file and what is wrong."""
    encoded = file_bytes(path) if encoded is None else encoded
    with _bounded_pillow() as noted:
        pixels = _decode(path, encoded, noted)
    try:
        return resize(pixels, size) if size else pixels
    except MemoryError:  # the resize is the larger peak (see MAX_IMAGE_PIXELS)
        raise _out_of_memory(path) from None
    except ValueError as e:
        raise ImageError(f"{quoted(path)} is {pixels.shape[1]:,} x {pixels.shape[0]:,} pixels, "
                         f"{e} to {size[1]} x {size[0]}: crop it nearer to a square") from None


def _out_of_memory(path: str) -> "ImageError":
    return ImageError(f"{quoted(path)} did not fit in the memory left to decode it: images of "
                      f"up to {MAX_IMAGE_PIXELS:,} pixels are read, which may take "
                      f"{DECODE_MEMORY}; free memory, or give a smaller image")


def resize(pixels: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """uint8 [H, W, 3] `pixels` as uint8 of `size` (height, width): unchanged
    if already that size, else resized with antialiasing, which averages all
    the pixels that shrink into one instead of sampling a few of them.
    ValueError if TensorFlow cannot (an extreme aspect ratio)."""
    if pixels.shape[:2] == tuple(size):
        return pixels
    import tensorflow as tf

    try:
        small = tf.image.resize(pixels, size, antialias=True)
    except tf.errors.InternalError:  # "Span is too large": 25 million pixels in a row, say
        raise ValueError("an aspect ratio too extreme for the resize") from None
    except tf.errors.ResourceExhaustedError:
        raise MemoryError from None
    return tf.cast(tf.clip_by_value(tf.round(small), 0, 255), tf.uint8).numpy()


@contextlib.contextmanager
def _bounded_pillow():
    """Pillow's own size checks at this module's bound, as errors: they are
    made per format where only the decoder knows a size (a WebP's canvas
    before its decoder allocates it, a GIF frame that grows the screen, a
    TIFF page's tiles). A truncated file an error, whatever a user's code in
    this process set. Yields the list of Pillow's other warnings, kept from
    the user's screen: the caller judges them."""
    from PIL import Image, ImageFile

    saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    # Pillow warns above its bound (and raises above twice it).
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = MAX_IMAGE_PIXELS, False
    try:
        with warnings.catch_warnings(record=True) as noted:
            warnings.simplefilter("always")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield noted
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = saved


# A 100,000,000 x 1 PNG raised MemoryError in Pillow's conversion with 21 GB
# free, 60,000,000 x 1 did not (Pillow 13.0, 2 cores of an AMD EPYC).
_LONGEST_ROW_BYTES = 1 << 28


def _decode(path: str, encoded: bytes, noted: list) -> np.ndarray:
    """The first frame of the image file `encoded` in RGB, every frame
    decoded and the file checked to its end (`noted`: Pillow's warnings, as
    they come); ImageError otherwise."""
    from PIL import Image

    if not encoded:
        raise ImageError(f"{quoted(path)} is empty (0 bytes): give an image file")
    kind = _signature(encoded)
    if kind not in FORMATS:
        raise ImageError(
            f"{quoted(path)} is an image in the {kind} format, which this program does not "
            f"read: convert it to PNG ({FORMAT_NAMES} are read)" if kind else
            f"{quoted(path)} is not an image file ({FORMAT_NAMES} are read)")
    profiles = _png_profiles(encoded) if kind == "PNG" else 0
    if profiles > 1:
        raise ImageError(f"{quoted(path)} holds {profiles:,} colour profiles (iCCP chunks), "
                         f"where a PNG holds one at most: give an intact copy")
    width = 0
    try:
        with Image.open(io.BytesIO(encoded), formats=FORMATS) as image:  # the header only
            first, pixels_in_all = None, 0
            for index in range(MAX_FRAMES + 1):
                try:
                    image.seek(index)
                except EOFError:
                    break
                width, height = image.size
                pixels_in_all += width * height
                if index == MAX_FRAMES or pixels_in_all > MAX_IMAGE_PIXELS or not width * height:
                    raise _too_large(path, index + 1, width, height, pixels_in_all)
                extent = _pixel_data_end(image, encoded)  # what load() forgets
                image.load()
                if index == 0:
                    first = _rgb(_upright(image), path)
            damage = _cut_short(image.format, encoded, extent) or _warned(kind, noted)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        said = re.search(r"\((\d+) pixels\)", str(e))
        count = f"{int(said[1]):,}" if said else "more"
        raise ImageError(f"{quoted(path)} says it holds {count} pixels, more than this program "
                         f"decodes ({MAX_IMAGE_PIXELS:,})") from None
    except ImageError:
        raise
    except MemoryError:  # not damage: the same file decodes where there is memory...
        if width * 4 > _LONGEST_ROW_BYTES:  # ...or not: Pillow's own limit on a row
            raise ImageError(f"{quoted(path)} is {width:,} pixels wide, a row longer than "
                             f"Pillow converts at once: crop it nearer to a square") from None
        raise _out_of_memory(path) from None
    except Exception as e:  # noqa: BLE001 - OSError("image file is truncated"), SyntaxError, ...
        damage = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        damage = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", damage)  # not the user's
    if damage:
        raise ImageError(f"{quoted(path)} begins as a {kind} image does but does not decode "
                         f"({quoted(damage)}): it is damaged or truncated; give an intact copy")
    return first


# Formats Pillow has no reader for, by their first bytes: what a phone saves
# (HEIC, in an ISO media file of one of these brands) and JPEG XL.
_UNREAD_SIGNATURES = (
    (re.compile(rb"....ftyp(heic|heix|hevc|hevx|heim|heis|mif1|msf1)", re.DOTALL), "HEIC"),
    (re.compile(rb"\xff\x0a|\x00\x00\x00\x0cJXL \r\n\x87\n"), "JPEG XL"))


def _signature(encoded: bytes) -> Optional[str]:
    """The format whose signature `encoded` starts with, by Pillow's own
    tests of the first bytes (no decoder runs); another format's than ours
    only if its reader takes the header too (a TGA begins as a CUR does,
    and has no signature: it is tried last); None if no format's."""
    from PIL import Image

    Image.init()
    for name in (*FORMATS, *Image.ID):  # ours first, as Image.open tries them
        accept = Image.OPEN[name][1]
        try:
            if accept is not None and accept(encoded[:16]) and (
                    name in FORMATS or _header_reads_as(name, encoded)):
                return name
        except Exception:  # noqa: BLE001 - a test that cannot read so short a prefix
            continue
    unread = next((name for signature, name in _UNREAD_SIGNATURES
                   if signature.match(encoded)), None)
    return unread or ("TGA" if _header_reads_as("TGA", encoded) else None)


def _header_reads_as(name: str, encoded: bytes) -> bool:
    """Whether Pillow's reader of the format `name` takes the header of
    `encoded` (its size and mode: no pixel is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(encoded), formats=[name]):
            return True
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return True  # it read a size, and a large one
    except Exception:  # noqa: BLE001 - UnidentifiedImageError, SyntaxError, ...
        return False


def _png_profiles(encoded: bytes) -> int:
    """How many colour profiles (iCCP chunks) the PNG `encoded` holds.
    Pillow inflates each, up to 1 MB from 1 kB: a 10 MB file of them took
    three minutes to read (2 shared cores of an AMD EPYC family 25 model 1,
    Zen 3, AVX2 only)."""
    count, at = 0, 8  # after the signature: length, type, data, CRC
    while at + 8 <= len(encoded):
        count += encoded[at + 4:at + 8] == b"iCCP"
        at += 12 + int.from_bytes(encoded[at:at + 4], "big")
    return count


def _too_large(path: str, frames: int, width: int, height: int, in_all: int) -> ImageError:
    if frames > MAX_FRAMES:
        return ImageError(f"{quoted(path)} holds more than {MAX_FRAMES:,} frames, more than "
                          f"this program decodes: save its first frame as a still image")
    if not width * height:
        return ImageError(f"{quoted(path)} says it holds a frame of {width} x {height} pixels: "
                          f"an image has at least one")
    if frames == 1:
        return ImageError(f"{quoted(path)} says it holds {width * height:,} pixels, more than "
                          f"this program decodes ({MAX_IMAGE_PIXELS:,})")
    return ImageError(f"{quoted(path)} holds {frames} or more frames of {in_all:,} pixels in "
                      f"all, more than this program decodes ({MAX_IMAGE_PIXELS:,}): save its "
                      f"first frame as a still image")


def _upright(frame):
    """`frame` turned as its EXIF Orientation tag says it is seen (as
    Pillow's ImageOps.exif_transpose turns it): a phone stores a photo as its sensor read it,
    sideways if held upright, and says so only in that tag. The frame itself
    where the tag is absent, 1 (upright) or not a valid value (Pillow reads
    a damaged EXIF block as empty, with a warning)."""
    from PIL import ExifTags, Image

    turns = Image.Transpose
    # Not ImageOps.exif_transpose, which also writes the EXIF block back
    # without the tag: a camera's malformed tag beside it (an SBYTE interop
    # pointer) failed that, and an intact photo was refused as damaged.
    turn = {2: turns.FLIP_LEFT_RIGHT, 3: turns.ROTATE_180, 4: turns.FLIP_TOP_BOTTOM,
            5: turns.TRANSPOSE, 6: turns.ROTATE_270, 7: turns.TRANSVERSE,
            8: turns.ROTATE_90}.get(frame.getexif().get(ExifTags.Base.Orientation, 1))
    return frame.transpose(turn) if turn is not None else frame


def _rgb(image, path: str) -> np.ndarray:
    """The decoded frame `image` as uint8 RGB, at the scale the file means."""
    if image.mode in _EIGHT_BIT:
        return np.asarray(image.convert("RGB"))
    if image.mode in _SIXTEEN_BIT:
        # The high byte, as Pillow reads 16-bit colour (and libpng strips
        # 16 bits to 8): 65535 is 255, and grey and colour files agree.
        grey = (np.asarray(image) >> 8).astype(np.uint8)
        return np.repeat(grey[..., np.newaxis], 3, axis=-1)
    if image.mode in _WITHOUT_RANGE:
        raise ImageError(f"{quoted(path)} holds {_WITHOUT_RANGE[image.mode]} pixels, and the "
                         f"file does not say which of them are black and white: save it with "
                         f"8 or 16 bits per channel")
    raise ImageError(f"{quoted(path)} holds pixels of Pillow's mode {image.mode}, which this "
                     f"program does not turn into RGB: save it as 8-bit RGB or greyscale")


def _warned(kind: str, noted: list) -> str:
    """The damage that Pillow only warns of, reading on without the part: a
    TIFF directory or an APNG frame control that does not read back whole
    (empty if none)."""
    plugin = {"TIFF": "TiffImagePlugin.py", "PNG": "PngImagePlugin.py"}.get(kind)
    return next((str(w.message) for w in noted if os.path.basename(w.filename) == plugin), "")


def _pixel_data_end(image, encoded: bytes) -> int:
    """Where a BMP says its pixel data ends (0 for other formats). Pillow
    reads an uncompressed BMP that lacks its rows' last padding bytes, and an
    RLE one that stops early, as whole: the rest is left black."""
    if image.format != "BMP" or not image.tile:
        return 0
    codec, extents, offset, args = image.tile[0]
    if codec == "raw":  # args: raw mode, bytes a row (padded to 4), direction
        return offset + args[1] * (extents[3] - extents[1])
    return offset + int.from_bytes(encoded[34:38], "little")  # RLE: its size (biSizeImage)


def _cut_short(kind: str, encoded: bytes, pixel_data_end: int) -> str:
    """What is missing at the end of the file `encoded` of format `kind`,
    decoded without error: the ends that Pillow's decoders do not ask for
    (they stop once they have the pixels). Empty if nothing is."""
    from PIL import Image

    if kind == "PNG":
        try:  # every chunk's CRC up to IEND (whose own is fixed): Pillow decodes without them
            with Image.open(io.BytesIO(encoded), formats=["PNG"]) as again:
                again.verify()
        except Exception as e:  # noqa: BLE001 - SyntaxError("broken PNG file"), OSError, ...
            return f"its chunks do not read back to IEND: {e}"
        if _PNG_END not in encoded:
            return "its IEND chunk is cut short"
    elif kind == "GIF" and not encoded.endswith(b";"):
        return "it does not end with the GIF trailer"
    elif kind in ("JPEG", "MPO") and not _jpeg_scan_ends(encoded):
        return "its first image does not end with an EOI marker"
    elif kind == "BMP" and len(encoded) < pixel_data_end:
        return f"it ends {pixel_data_end - len(encoded)} bytes before its pixel data does"
    return ""


def _jpeg_scan_ends(encoded: bytes) -> bool:
    """Whether the first image of a JPEG file has its end marker after its
    first scan. In a scan's data an FF byte is followed by 00 or a restart
    marker, so FF D9 there can only be the end."""
    at = 2  # after SOI
    while at + 4 <= len(encoded) and encoded[at] == 0xFF:
        if encoded[at + 1] == 0xFF:  # fill bytes before a marker
            at += 1
        elif encoded[at + 1] == 0xDA:  # start of scan
            return encoded.find(b"\xff\xd9", at) >= 0
        else:  # a segment: marker, then its length (which counts itself)
            at += 2 + int.from_bytes(encoded[at + 2:at + 4], "big")
    return False


def file_bytes(path: str) -> bytes:
    """The bytes of the regular file at `path`, at most MAX_IMAGE_BYTES, by
    files.read_bounded: a FIFO would block the read forever, and /dev/zero
    fill the memory."""
    try:
        return files.read_bounded(path, MAX_IMAGE_BYTES)
    except files.NotRegularFileError as e:
        raise ImageError(f"{quoted(path)} is {e.kind}, not a regular file: give an image "
                         f"file") from None
    except files.FileTooLargeError:
        raise ImageError(f"{quoted(path)} is larger than an image this program reads "
                         f"({MAX_IMAGE_BYTES >> 20} MB)") from None
    except OSError as e:  # missing, not readable
        if e.errno == errno.ENAMETOOLONG:
            raise ImageError(f"cannot open {too_long_to_open(path)}: move it to a "
                             f"shorter path, or shorten its folders' names") from None
        raise ImageError(f"cannot read {quoted(path)} ({e.strerror})") from None
