"""What the training images' augmentations and the test-time views are:
their names and meaning (the input pipeline, pipeline.py, computes them).
TensorFlow-free, so that flags are checked without it."""

import dataclasses
from typing import Optional, Tuple

from distributed_mpt.core import data
from distributed_mpt.options import Options, option, require

# Padded-crop augmentation: pad 4 pixels on each side, crop back to 32x32.
CROP_PADDING = 4
# What each means: the help of --flip (below) and of --eval_tta (training/__init__.py).
FLIPS = ("random", "alternating", "none")
TTA_VIEWS = ("none", "flip", "flip_translate", "flip_translate_mean")


# Reflect padding mirrors the image without its edge, so at most 31 pixels.
_MAX_CROP_PADDING = 31


@dataclasses.dataclass(frozen=True)
class Augmentation(Options):
    """How training images are augmented: a random translation by up to
    `crop_padding` pixels (a crop of the reflect-padded image), horizontal
    flips (`flip`, one of FLIPS), and the 2025 record's color jitter of the
    normalized image (hiverge/cifar10-speedrun; pipeline.jitter_colors): a
    brightness shift b ~ U(-brightness_jitter, brightness_jitter), then a
    contrast factor c ~ U(1 - contrast_jitter, 1 + contrast_jitter), per
    image per epoch."""

    crop_padding: int = option(
        CROP_PADDING, "Random translation of each training image by up to this many pixels (a "
        "crop of the reflect-padded image; airbench94: 2); 0: none.")
    # None: the dataset's default (its spec's `flip` in core/data).
    flip: Optional[str] = option(
        None, "Horizontal flips of training images. random: each image in each epoch "
        "with probability 1/2. alternating (airbench94's): each image flipped at random once, "
        "then all of them flipped on every odd epoch, so that every image is seen both ways "
        "in any two epochs. none. Default: " + ", ".join(
            f"{spec.name} {spec.flip}" for spec in data.DATASETS.values()) + " (a mirrored "
        "digit or letter is another sign).", FLIPS)
    early_crop_size: int = option(
        0, "Train the first --early_crop_epochs on random square crops of this many pixels "
        "a side, cut from the (translated, flipped) training images without scaling them: "
        "each step then costs about (this/image side)**2 of a full one, and objects keep the "
        "size they have in the test images. 0: none. Needs a model that takes smaller images "
        "(airbench, resnet9; not the mlp).")
    early_crop_epochs: float = option(
        0.0, "How many epochs, from the first, train on --early_crop_size crops; the rest on "
        "whole images.")
    brightness_jitter: float = option(
        0.0, "Color jitter of the 2025 record (hiverge/cifar10-speedrun: 0.1399): each training "
        "image in each epoch gets b ~ U(-this, this) added to its normalized pixels (in standard "
        "deviations); needs a model whose normalization is a layer named 'normalize'. 0: none.")
    contrast_jitter: float = option(
        0.0, "Color jitter of the 2025 record (0.1308): each training image's normalized pixels, "
        "after --brightness_jitter, multiplied by c ~ U(1 - this, 1 + this) in each epoch. 0: "
        "none.")

    def check(self) -> None:
        require(0 <= self.brightness_jitter <= 10, f"--brightness_jitter={self.brightness_jitter} "
                f"must be in [0, 10] (standard deviations)")
        require(0 <= self.contrast_jitter < 1, f"--contrast_jitter={self.contrast_jitter} must be "
                f"in [0, 1) (a fraction of the contrast)")
        require(0 <= self.crop_padding <= _MAX_CROP_PADDING,
                f"--crop_padding={self.crop_padding} must be in [0, {_MAX_CROP_PADDING}] (pixels)")
        require(self.early_crop_size >= 0,
                f"--early_crop_size={self.early_crop_size} must be >= 0 (pixels; 0: none)")
        require(self.early_crop_epochs >= 0,
                f"--early_crop_epochs={self.early_crop_epochs:g} must be >= 0")
        require((self.early_crop_size > 0) == (self.early_crop_epochs > 0),
                f"--early_crop_size={self.early_crop_size} and --early_crop_epochs="
                f"{self.early_crop_epochs:g} go together: set both, or neither")

    def early_crops(self, steps_per_epoch: int, total_steps: int) -> Tuple[int, int]:
        """(the steps, from the first, that train on early crops: the
        nearest whole step to --early_crop_epochs, at most all of them;
        the crops' side)."""
        return (min(total_steps, round(self.early_crop_epochs * steps_per_epoch)),
                self.early_crop_size)

    @property
    def jitters_colors(self) -> bool:
        """Whether batches carry color jitter (none at all when both are 0)."""
        return self.brightness_jitter > 0 or self.contrast_jitter > 0
