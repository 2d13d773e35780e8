"""CIFAR-shaped synthetic data whose labels can be learned: training and
tests without a download."""

from typing import Sequence

import numpy as np

from distributed_mpt.core.data import cifar10
from distributed_mpt.core.data.dataset import SPLITS, Dataset, ImageSplit

NAME = "synthetic"
# CIFAR-10's shape, classes and statistics: a model built for one is built
# for the other, so a smoke test exercises what a real run does.
INFO = cifar10.INFO


def load(options, seed: int, splits: Sequence[str] = SPLITS, headroom=None) -> Dataset:
    """`options.synthetic_examples` (a DataOptions) training examples and a
    fifth as many test examples, made from `seed` (see `make_synthetic`)."""
    examples = options.synthetic_examples
    train, test = make_synthetic(examples, max(examples // 5, 1), seed)
    made = {"train": train, "test": test}
    return Dataset(INFO, {split: made[split] for split in splits})


def make_synthetic(num_train: int, num_test: int, seed: int):
    """(train, test) ImageSplits of CIFAR-shaped data whose labels can be
    learned from the images.

    Each class has a fixed random colour; an example mixes its class colour
    (3/4) with per-pixel uniform noise (1/4), so the label is a function of
    the image (its nearest class colour) and a model can tell it, while a
    model that learned nothing stays at 10% accuracy. A colour survives crops
    and flips, so augmentation keeps the labels true.
    """
    rng = np.random.default_rng(seed)
    shape, classes = INFO.image_shape, INFO.num_classes
    prototypes = np.broadcast_to(
        rng.integers(0, 256, size=(classes, 1, 1, 3), dtype=np.uint8), (classes,) + shape)

    def split(size: int) -> ImageSplit:
        labels = rng.integers(0, classes, size=size).astype(np.int32)
        images = rng.integers(0, 256, size=(size,) + shape, dtype=np.uint8)  # noise
        images >>= 2  # in place: no second copy of the split
        # 3/4 colour + 1/4 noise in uint8, in chunks so that the peak memory
        # stays near the size of the split itself.
        for start in range(0, size, 4096):
            colours = prototypes[labels[start:start + 4096]]
            images[start:start + 4096] += (colours >> 1) + (colours >> 2)
        return ImageSplit(images, labels)

    return split(num_train), split(num_test)
