"""What the training images' augmentations and the test-time views are:
their names and meaning (the input pipeline, pipeline.py, computes them).
TensorFlow-free, so that flags are checked without it."""

import dataclasses

# Padded-crop augmentation: pad 4 pixels on each side, crop back to 32x32.
CROP_PADDING = 4
# random: each image in each epoch with probability 1/2. alternating
# (airbench94's): each image flipped at random once, then all of them
# flipped on every odd epoch, so that every image is seen both ways in any
# two epochs. none.
FLIPS = ("random", "alternating", "none")
# none; flip: the image and its mirror image; flip_translate (airbench94's):
# those two, weighted 1/2, and both again shifted one pixel up-left and
# down-right, 1/8 each; flip_translate_mean (the 2025 record's): the same
# six, 1/6 each.
TTA_VIEWS = ("none", "flip", "flip_translate", "flip_translate_mean")


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """How training images are augmented: a random translation by up to
    `crop_padding` pixels (a crop of the reflect-padded image), horizontal
    flips (`flip`, one of FLIPS), and the 2025 record's color jitter of the
    normalized image (hiverge/cifar10-speedrun; pipeline.jitter_colors): a
    brightness shift b ~ U(-brightness, brightness), then a contrast factor
    c ~ U(1 - contrast, 1 + contrast), per image per epoch."""

    crop_padding: int = CROP_PADDING
    flip: str = "random"
    brightness: float = 0.0
    contrast: float = 0.0

    @property
    def jitters_colors(self) -> bool:
        """Whether batches carry color jitter (none at all when both are 0)."""
        return self.brightness > 0 or self.contrast > 0
