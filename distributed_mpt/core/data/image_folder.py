"""Your own labelled images: one folder per class, the layout of
`keras.utils.image_dataset_from_directory`, torchvision's `ImageFolder` and
TFDS' `ImageFolder`.

    DATA_DIR/train/<class name>/<image files>
    DATA_DIR/test/<class name>/<image files>   (or a --test_fraction of train/ held out)

The classes are train/'s folders in sorted order (label i names the i-th),
and test/ may hold only those. Every image is decoded once, at its first
frame, into uint8 RGB of `image_size` x `image_size` in host memory (core/data/
images.py: Pillow); files whose name starts with a dot (.DS_Store, editors'
swap files) are skipped, and anything else that is not an intact image is
one error naming it. The mean and standard deviation the model normalizes
with are the training images'.
"""

import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from distributed_mpt.core.data import IMAGE_FOLDER_LAYOUT as LAYOUT
from distributed_mpt.core.data import images
from distributed_mpt.core.data.dataset import SPLITS, DataSource, Dataset, DatasetInfo, ImageSplit
from distributed_mpt.errors import DataUnavailableError, quoted

NAME = "image_folder"


def load(source: DataSource, splits: Sequence[str] = SPLITS) -> Dataset:
    """The `splits` of the image folder `source.data_dir` (see the module's
    docstring); raises DataUnavailableError naming what is missing."""
    root = source.data_dir
    train_dir, test_dir = os.path.join(root, "train"), os.path.join(root, "test")
    if not os.path.isdir(train_dir):
        raise DataUnavailableError(f"--data_dir={quoted(root)} has no train/ folder: an image "
                                   f"folder is laid out as {LAYOUT}")
    class_names = _class_folders(train_dir)
    train_files = _files_by_class(train_dir, class_names)
    if os.path.isdir(test_dir):
        test_files = _files_by_class(test_dir, class_names, train_dir=train_dir)
    elif source.test_fraction > 0:
        train_files, test_files = _hold_out(train_files, source.test_fraction, source.seed)
    else:
        raise DataUnavailableError(f"--data_dir={quoted(root)} has no test/ folder: add one "
                                   f"({LAYOUT}), or pass --test_fraction to hold out a share of "
                                   f"train/ for testing")
    size = (source.image_size, source.image_size)
    # The statistics come from the training images, whichever splits are read.
    train = _decode(train_files, size)
    # In a fixed shuffled order, not by class: what is computed from the
    # first images (airbench's whitening takes 5,000) must see every class.
    order = np.random.default_rng(0).permutation(len(train))
    train = ImageSplit(train.images[order], train.labels[order])
    mean = train.images.mean(axis=(0, 1, 2), dtype=np.float64)
    variance = np.zeros(3)
    for start in range(0, len(train), 4096):  # chunks: no float copy of every image
        chunk = train.images[start:start + 4096].astype(np.float64) - mean
        variance += (chunk * chunk).sum(axis=(0, 1, 2))
    std = np.sqrt(variance / (len(train) * size[0] * size[1]))
    info = DatasetInfo(image_shape=(*size, 3), class_names=tuple(class_names),
                       mean=tuple(round(float(m), 4) for m in mean),
                       std=tuple(round(float(max(s, 1.0)), 4) for s in std))
    decoded = {"train": train}
    if "test" in splits:
        decoded["test"] = _decode(test_files, size)
    return Dataset(info, {split: decoded[split] for split in splits})


def _class_folders(directory: str) -> List[str]:
    names = sorted(entry.name for entry in os.scandir(directory)
                   if entry.is_dir() and not entry.name.startswith("."))
    if not names:
        raise DataUnavailableError(f"{quoted(directory)} holds no class folders: an image folder "
                                   f"is laid out as {LAYOUT}")
    return names


def _files_by_class(directory: str, class_names: List[str], train_dir: str = ""
                    ) -> Dict[int, List[str]]:
    """{label: the image files of its folder in `directory`, sorted}."""
    if train_dir:
        unknown = sorted(set(_class_folders(directory)) - set(class_names))
        if unknown:
            raise DataUnavailableError(
                f"{quoted(directory)} has class folder(s) {quoted(', '.join(unknown))} that "
                f"{quoted(train_dir)} does not: a model learns only the classes it trains on")
    found = {}
    for label, name in enumerate(class_names):
        folder = os.path.join(directory, name)
        paths = sorted(entry.path for entry in os.scandir(folder)
                       if not entry.name.startswith(".")) if os.path.isdir(folder) else []
        if not paths and not train_dir:
            raise DataUnavailableError(f"{quoted(folder)} holds no images: every class needs "
                                       f"training images")
        found[label] = paths
    return found


def _hold_out(files: Dict[int, List[str]], fraction: float, seed: int
              ) -> Tuple[Dict[int, List[str]], Dict[int, List[str]]]:
    """(train, test): `fraction` of each class's files, chosen by `seed`,
    held out for testing (at least one per class), the rest kept in order."""
    train, test = {}, {}
    for label, paths in files.items():
        count = max(1, round(fraction * len(paths)))
        if count >= len(paths):
            raise DataUnavailableError(
                f"--test_fraction={fraction:g} leaves no training image of class {label} "
                f"({len(paths)} image(s)): lower it, or add a test/ folder")
        held = set(np.random.default_rng([seed, label]).permutation(len(paths))[:count])
        train[label] = [p for i, p in enumerate(paths) if i not in held]
        test[label] = [p for i, p in enumerate(paths) if i in held]
    return train, test


def _decode(files: Dict[int, List[str]], size: Tuple[int, int]) -> ImageSplit:
    """Every file decoded into one uint8 array, with its label."""
    count = sum(len(paths) for paths in files.values())
    pixels = np.empty((count, *size, 3), np.uint8)
    labels = np.empty(count, np.int32)
    index = 0
    for label, paths in files.items():
        for path in paths:
            # A damaged file, or one that is not an image, is ImageError
            # (a UserError) naming it: one error line, before any training.
            pixels[index] = images.read_image(path, size)
            labels[index] = label
            index += 1
    return ImageSplit(pixels, labels)
