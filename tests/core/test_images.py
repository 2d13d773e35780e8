"""The one image decoder of training's image folders and of predict
(core/data/images.py), on files made here with Pillow: every frame bounded
before it is decoded, the formats it reads read at the scale the file
means, and a damaged file of each refused by name."""

import io
import struct
import subprocess
import sys
import tracemalloc
import zlib
from typing import Optional

import numpy as np
import pytest
from PIL import Image, ImageFile

from conftest import REPO, deadline, made_a_fifo_when_checked, subprocess_env
from distributed_mpt.core.data import images


def _encoded(image, fmt, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _read(tmp_path, encoded: Optional[bytes], name="image"):
    """read_image of a file of `encoded` (None: the file already there)."""
    path = tmp_path / name
    if encoded is not None:
        path.write_bytes(encoded)
    return images.read_image(str(path))


def _refused(tmp_path, encoded: Optional[bytes], fragment: str, name="image"):
    with pytest.raises(images.ImageError) as raised:
        _read(tmp_path, encoded, name)
    message = str(raised.value)
    assert message.startswith(str(tmp_path / name)) and fragment in message, message
    return message


def _png(width: int, height: int, depth: int, colour: int, rows: bytes) -> bytes:
    """A PNG written chunk by chunk, to say what Pillow would not write."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9))
            + chunk(b"IEND", b""))


def test_an_image_too_long_to_resize_is_refused_by_name(tmp_path):
    """25 million pixels in one row, within the bounds: TensorFlow's
    antialiased resize raised InternalError ("Span is too large"), a
    traceback in training and in predict."""
    path = tmp_path / "row.png"
    path.write_bytes(_png(25_000_000, 1, 8, 0, b"\0" + b"\x80" * 25_000_000))
    with pytest.raises(images.ImageError) as raised:
        images.read_image(str(path), (32, 32))
    assert str(raised.value) == (f"{path} is 25,000,000 x 1 pixels, an aspect ratio too extreme "
                                 f"for the resize to 32 x 32: crop it nearer to a square")


def test_a_row_too_long_for_pillow_is_named_as_such_not_as_memory(tmp_path):
    """100 million pixels in one row, within the bounds: "did not fit in
    the memory left ... free memory", with 21 GB free."""
    path = tmp_path / "row.png"
    path.write_bytes(_png(100_000_000, 1, 8, 0, b"\0" + b"\x80" * 100_000_000))
    with pytest.raises(images.ImageError) as raised:
        images.read_image(str(path))
    assert str(raised.value) == (f"{path} is 100,000,000 pixels wide, a row longer than Pillow "
                                 f"converts at once: crop it nearer to a square")


# --- depth: scaled as the file means it, or refused by name ------------------

@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_greyscale_is_scaled_to_0_255_not_clipped_white(tmp_path, fmt):
    ramp = np.linspace(0, 65535, 8 * 64).round().astype(np.uint16).reshape(8, 64)
    image = Image.fromarray(ramp)
    assert image.mode == "I;16"
    pixels = _read(tmp_path, _encoded(image, fmt))
    expected = (ramp >> 8).astype(np.uint8)  # as Pillow reads 16-bit colour
    assert pixels.shape == (8, 64, 3) and (pixels == expected[..., None]).all()
    assert pixels.min() == 0 and pixels.max() == 255 and 120 < pixels.mean() < 135


def test_16_bit_rgb_png_keeps_its_colour(tmp_path):
    rows = b"".join(b"\x00" + np.tile(np.array([40000, 1000, 65535], ">u2"), 4).tobytes()
                    for _ in range(4))
    pixels = _read(tmp_path, _png(4, 4, 16, 2, rows))
    assert (pixels == [40000 >> 8, 1000 >> 8, 255]).all(), pixels[0, 0]


@pytest.mark.parametrize("values, kind", [
    (np.arange(64, dtype=np.int32).reshape(8, 8) * 1000, "32-bit integer pixels"),
    (np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), "32-bit floating-point pixels")])
def test_32_bit_integer_and_float_tiffs_are_refused_by_name_not_flattened(tmp_path, values, kind):
    _refused(tmp_path, _encoded(Image.fromarray(values), "TIFF"), kind)


# --- bounds: every format, every frame, before decoding ----------------------

def _huge_png_entry() -> bytes:
    # A PNG that says 12,000 x 9,000 pixels (108 million): refused before its
    # rows are read, so it needs only the first.
    return _png(12_000, 9_000, 1, 0, b"\x00" * 1501)


def _ico(entry: bytes) -> bytes:
    # Its directory says 256 x 256 (0 means 256); the PNG inside says more,
    # and Pillow reads the PNG's size only when it decodes.
    directory = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(entry), 6 + 16)
    return struct.pack("<HHH", 0, 1, 1) + directory + entry


def _icns(entry: bytes) -> bytes:
    # ic10: a 1024 x 1024 PNG, it says; this one is larger.
    return (b"icns" + struct.pack(">I", 16 + len(entry)) + b"ic10" + struct.pack(">I", 8 + len(entry))
            + entry)


@pytest.mark.parametrize("container, kind", [(_ico, "ICO"), (_icns, "ICNS")])
def test_icons_whose_entry_is_larger_than_they_say_are_refused_by_name(tmp_path, container, kind):
    _refused(tmp_path, container(_huge_png_entry()), f"is an image in the {kind} format, which "
                                                     f"this program does not read")


def test_a_later_gif_frame_that_grows_the_screen_past_the_bound_is_refused(tmp_path):
    frames = [Image.new("L", (16, 16), colour) for colour in (0, 255)]
    encoded = bytearray(_encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]))
    # The second image descriptor (","): its width and height say 20,000.
    second = encoded.index(b",", encoded.index(b",") + 1)
    encoded[second + 5:second + 9] = struct.pack("<HH", 20_000, 20_000)
    _refused(tmp_path, bytes(encoded), "says it holds 400,000,000 pixels, more than this "
                                       "program decodes (100,000,000)")


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP", "TIFF"])
def test_frames_together_are_bounded_before_the_next_is_decoded(tmp_path, monkeypatch, fmt):
    # At a bound of 100,000 pixels (the real one: 100 million, which
    # tests/entry_points/test_predict_bounds.py's 30 frames of 2000 x 2000 pass at the
    # 26th), 10 frames of 100 x 100 are 100,000: 11 are too many, whatever
    # their format.
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100_000)
    frames = [Image.new("RGB", (100, 100), (i * 20, 0, 0)).convert("P" if fmt == "GIF" else "RGB")
              for i in range(11)]
    animation = _encoded(frames[0], fmt, save_all=True, append_images=frames[1:])
    _refused(tmp_path, animation, "holds 11 or more frames of 110,000 pixels in all, more than "
                                  "this program decodes (100,000)")
    assert _read(tmp_path, _encoded(frames[0], fmt, save_all=True, append_images=frames[1:10])
                 ).shape == (100, 100, 3)


def test_more_frames_than_the_bound_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "MAX_FRAMES", 10)  # the real one: 1,000, as slow to make
    frames = [Image.new("L", (1, 1), 255 * (i % 2)) for i in range(11)]
    _refused(tmp_path, _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]),
             "holds more than 10 frames")
    assert _read(tmp_path, _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:10])
                 ).shape == (1, 1, 3)


# A process that reads an image with its address space capped 80 MB above
# what it has mapped: room to read the file (a buffer of MAX_IMAGE_BYTES,
# 64 MB), not for Pillow's decoded pixels, as on a machine without the memory.
_DECODE_IN_LITTLE_MEMORY = """
import resource, sys
from distributed_mpt.core.data import images
images.read_image(sys.argv[2])  # Pillow's plugins imported, on a small image
with open("/proc/self/status") as status:
    mapped = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (80 << 20),) * 2)
try:
    images.read_image(sys.argv[1])
except images.ImageError as e:
    print(e)
"""


def test_an_image_larger_than_the_memory_left_is_refused_as_that_not_as_damaged(tmp_path):
    # 40 million pixels, 160 MB as Pillow holds RGB (4 bytes a pixel): within
    # the bounds, beyond the 80 MB left.
    large, small = tmp_path / "large.png", tmp_path / "small.png"
    Image.new("RGB", (8000, 5000), (90, 20, 200)).save(large)
    Image.new("RGB", (8, 8)).save(small)
    result = subprocess.run([sys.executable, "-c", _DECODE_IN_LITTLE_MEMORY, large, small],
                            capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{large} did not fit in the memory left to decode it: "
                                    f"images of up to 100,000,000 pixels are read, which may "
                                    f"take about 1.7 GB"), result.stdout
    assert "damaged" not in result.stdout


def test_a_resize_larger_than_the_memory_left_is_refused_as_that(tmp_path, monkeypatch):
    # The resize to a model's size is the larger peak of the two (MAX_IMAGE_PIXELS).
    path = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (90, 20, 200)).save(path)

    def no_memory(pixels, size):
        raise MemoryError()
    monkeypatch.setattr(images, "resize", no_memory)
    with pytest.raises(images.ImageError, match="did not fit in the memory left to decode it"):
        images.read_image(str(path), (32, 32))
    assert images.read_image(str(path)).shape == (48, 64, 3)  # no resize: none needed


def test_a_file_made_a_fifo_after_its_check_is_refused_not_waited_on(tmp_path, monkeypatch):
    path = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(path)
    made_a_fifo_when_checked(monkeypatch, path)
    with deadline(30):
        _refused(tmp_path, None, "is a FIFO, not a regular file: give an image file", "photo.png")


def test_an_empty_file_is_named_empty(tmp_path):
    """It was "not an image file", which sent a user looking for its format."""
    _refused(tmp_path, b"", "is empty (0 bytes): give an image file", "photo.png")


def test_a_small_image_is_read_without_allocating_the_bound(tmp_path):
    # read(MAX_IMAGE_BYTES + 1) allocates its 64 MB before it reads a byte.
    encoded = _encoded(Image.new("RGB", (8, 8)), "PNG")
    _read(tmp_path, encoded)  # Pillow's plugins imported
    tracemalloc.start()
    try:
        _read(tmp_path, encoded)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"reading an image of 8 x 8 pixels allocated at most {peak:,} bytes")
    assert peak < 4 << 20


# --- damage: decoded whole, read to the end ----------------------------------

# 30 wide, so that BMP pads its rows; a gradient, whose JPEG libjpeg decodes
# whole without its last two bytes.
_PICTURE = np.stack([*np.meshgrid(np.arange(30) * 8, np.arange(40) * 6), np.full((40, 30), 90)], -1)
_PICTURE = Image.fromarray(_PICTURE.astype(np.uint8))
_FRAMES = [Image.fromarray(np.full((24, 32, 3), colour, np.uint8)) for colour in (10, 120, 240)]


def _still(fmt):
    return _encoded(_PICTURE.convert("P") if fmt == "GIF" else _PICTURE, fmt)


def _animated(fmt):
    frames = [f.convert("P") for f in _FRAMES] if fmt == "GIF" else _FRAMES
    return _encoded(frames[0], fmt, save_all=True, append_images=frames[1:])


# Files and where to cut them. Pillow decodes some of these cuts without a
# word on its own: the frames after the first, and the ends past the pixels
# (a GIF's trailer, a PNG's IEND, a JPEG's end marker, a BMP's last padding).
# A multi-page TIFF written by Pillow ends with 4 bytes that nothing points
# at: cut from 8 bytes on.
_TAILS = (1, 2, 3, 4, 8, 12, 20, 40)
CUT_SHORT = {
    "PNG": (_still, _TAILS), "animated PNG": (_animated, _TAILS),
    "JPEG": (_still, _TAILS), "GIF": (_still, _TAILS), "animated GIF": (_animated, _TAILS),
    "BMP": (_still, _TAILS), "WEBP": (_still, _TAILS), "animated WEBP": (_animated, _TAILS),
    "TIFF": (_still, _TAILS), "multi-page TIFF": (_animated, _TAILS[4:]),
}


@pytest.mark.parametrize("name", CUT_SHORT)
def test_a_file_cut_short_is_refused_by_name_wherever_it_ends(tmp_path, name):
    make, tails = CUT_SHORT[name]
    fmt = name.split()[-1]
    whole = make(fmt)
    assert _read(tmp_path, whole).dtype == np.uint8
    for cut in (*tails, len(whole) // 2):
        _refused(tmp_path, whole[:-cut], f"begins as a {fmt} image does but does not decode")


def test_every_changed_byte_of_a_png_s_pixel_data_is_refused(tmp_path):
    # zlib decodes some such changes into other pixels, and Pillow skips the
    # chunks' CRCs: the changes are found by them.
    whole = _still("PNG")
    start = whole.index(b"IDAT") + 4
    for at in range(start, start + int.from_bytes(whole[start - 8:start - 4], "big") + 4):
        damaged = bytearray(whole)
        damaged[at] ^= 0x01
        _refused(tmp_path, bytes(damaged), "begins as a PNG image does but does not decode")


def test_a_png_of_many_colour_profiles_is_refused_before_pillow_inflates_them(tmp_path):
    """Pillow inflates every iCCP chunk, 1 MB from 1 kB: a 10 MB file of
    them took three minutes to read; a PNG holds one at most."""
    photo = _encoded(Image.new("RGB", (8, 8)), "PNG", icc_profile=bytes(1_000_000))
    start = photo.index(b"iCCP") - 4
    end = start + 12 + struct.unpack(">I", photo[start:start + 4])[0]
    assert _read(tmp_path, photo).shape == (8, 8, 3), "one profile is read"
    _refused(tmp_path, photo[:end] + photo[start:end] * 99 + photo[end:],
             "holds 100 colour profiles (iCCP chunks), where a PNG holds one at most")


def test_a_png_that_pillow_reads_with_a_warning_is_refused_not_read(tmp_path, capfd):
    # An APNG control chunk that says 0 frames: Pillow prints a Python
    # warning (two lines on stderr) and reads the still image on.
    damaged = bytearray(_animated("PNG"))
    at = damaged.index(b"acTL")
    damaged[at + 4:at + 8] = struct.pack(">I", 0)
    damaged[at + 12:at + 16] = struct.pack(">I", zlib.crc32(bytes(damaged[at:at + 12])))
    _refused(tmp_path, bytes(damaged), "begins as a PNG image does but does not decode (Invalid "
                                       "APNG")
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"])
def test_an_intact_file_of_each_format_reads_and_data_after_its_end_is_no_damage(tmp_path, fmt):
    picture = _PICTURE.convert("P") if fmt == "GIF" else _PICTURE
    encoded = _encoded(picture, fmt)
    pixels = _read(tmp_path, encoded)
    assert pixels.shape == (40, 30, 3) and pixels.dtype == np.uint8
    if fmt != "GIF":  # a GIF ends with its trailer byte, and is checked so
        assert (_read(tmp_path, encoded + b"\x00" * 64) == pixels).all()


def test_a_png_cut_in_its_header_is_refused_without_a_memory_address(tmp_path):
    # Pillow's "cannot identify image file <_io.BytesIO object at 0x7f...>"
    # named our buffer, not the user's file (found by a probe of image folders).
    message = _refused(tmp_path, _still("PNG")[:12], "does not decode (cannot identify image file)")
    assert "0x" not in message and "BytesIO" not in message, message


def test_a_truncated_file_is_refused_even_if_other_code_told_pillow_to_accept_them(tmp_path):
    truncated = _encoded(_PICTURE, "PNG")[:-40]
    ImageFile.LOAD_TRUNCATED_IMAGES = True  # as a user's model file might
    try:
        _refused(tmp_path, truncated, "begins as a PNG image does but does not decode")
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True, "the caller's setting restored"
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


# Blocks of 8 x 8 pixels (a JPEG's own blocks: its colours come back near
# exactly), 2 high and 3 wide, each its own colour: any turn or flip moves them.
_BLOCKS = np.kron(np.arange(6, dtype=np.uint8).reshape(2, 3, 1) * 40 + np.array(
    [10, 60, 120], np.uint8), np.ones((8, 8, 1), np.uint8))
# EXIF Orientation: how the stored pixels are turned to be seen, by numpy.
_TURNS = {2: np.fliplr, 3: lambda a: np.rot90(a, 2), 6: lambda a: np.rot90(a, -1),
          8: lambda a: np.rot90(a, 1)}


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", sorted(_TURNS))
def test_a_photo_stored_turned_is_read_as_its_exif_orientation_says(tmp_path, fmt, orientation):
    """A phone stores a photo held upright sideways, with an Orientation
    tag: it was trained on and classified sideways."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    options = {"JPEG": {"quality": 100, "subsampling": 0}, "WEBP": {"lossless": True}}.get(fmt, {})
    encoded = _encoded(Image.fromarray(_BLOCKS), fmt, exif=exif, **options)
    pixels = _read(tmp_path, encoded)
    upright = _TURNS[orientation](_BLOCKS)
    assert pixels.shape == upright.shape
    np.testing.assert_allclose(pixels, upright, atol=6)
    exif[0x0112] = 1  # upright as stored
    assert (_read(tmp_path, _encoded(Image.fromarray(_BLOCKS), "PNG", exif=exif)) == _BLOCKS).all()


def test_a_malformed_tag_beside_the_orientation_is_no_damage(tmp_path):
    """An Orientation of 6 and, beside it, an interop pointer typed as two
    signed bytes, which Pillow cannot write back: the photo was refused as
    "damaged or truncated" (found by a probe of image folders)."""
    exif = bytes.fromhex("45786966000049492a000800000002001201030001000000060000"
                         "0005a0060002000000ffffffff00000000")
    encoded = _encoded(Image.fromarray(_BLOCKS), "JPEG", quality=100, subsampling=0, exif=exif)
    np.testing.assert_allclose(_read(tmp_path, encoded), _TURNS[6](_BLOCKS), atol=6)


def test_an_exif_block_that_does_not_parse_is_no_damage_and_no_turn(tmp_path):
    encoded = _encoded(Image.fromarray(_BLOCKS), "JPEG", quality=100, subsampling=0,
                       exif=b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff")
    np.testing.assert_allclose(_read(tmp_path, encoded), _BLOCKS, atol=6)
