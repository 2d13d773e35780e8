"""What an image folder (`--dataset=image_folder`) takes of the memory: its
decoded images once, and a folder too large for the memory refused in one
line before any image is decoded."""

import subprocess
import sys
import tracemalloc

from PIL import Image

from conftest import REPO, subprocess_env
from distributed_mpt.core.data import DataOptions


def _folder_of_links(root, train_per_class: int, side: int):
    """train/ and test/ of two classes, every image a copy of one PNG of
    `side` x `side`: a folder of many images made at once. Copies, not
    links: two paths to one file are refused (each image is read once)."""
    root.mkdir()
    photo = root / "photo.png"
    Image.new("RGB", (side, side), (90, 20, 200)).save(photo)
    for split, count in (("train", train_per_class), ("test", 1)):
        for name in ("cats", "dogs"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                (root / split / name / f"{i}.png").write_bytes(photo.read_bytes())
    return root


# A process that loads an image folder with its address space capped 200 MB
# above what it has mapped, as on a machine without the memory for it.
_LOAD_IN_LITTLE_MEMORY = """
import resource, sys
from distributed_mpt.core.data import DataOptions, image_folder
from distributed_mpt.errors import UserError
with open("/proc/self/status") as status:
    mapped = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (200 << 20),) * 2)
try:
    DataOptions(dataset="image_folder", data_dir=sys.argv[1], image_size=512).load(seed=0)
except UserError as e:
    print(e)
"""


def test_a_folder_too_large_for_the_memory_is_one_error_line_not_a_traceback(tmp_path):
    """It was a MemoryError's traceback (exit 1), or the images decoded
    for hours into memory the run did not have: 402 images at 512 x 512
    take 316 MB."""
    folder = _folder_of_links(tmp_path / "photos", train_per_class=200, side=8)
    result = subprocess.run([sys.executable, "-c", _LOAD_IN_LITTLE_MEMORY, folder],
                            capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                            timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout == (f"the 402 images of {folder} take 0.3 GB of memory at "
                             f"--image_size=512, more than this process could get: lower "
                             f"--image_size, or give the run more memory\n")


def test_a_folder_is_held_once_in_memory_not_copied_to_shuffle_or_measure(tmp_path):
    """Training's images were copied whole to shuffle them, and their
    statistics taken on float64 copies of 4,096 images at once: 1.4 GB for
    400 images of 256 x 256 (79 MB), and 26 GB at 512 x 512."""
    folder = _folder_of_links(tmp_path / "photos", train_per_class=200, side=256)
    options = DataOptions(dataset="image_folder", data_dir=str(folder), image_size=256)
    tracemalloc.start()
    try:
        dataset = options.load(seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(dataset.train) == 400
    assert peak < 3 * dataset.train.images.nbytes, f"{peak / 1e6:.0f} MB"
