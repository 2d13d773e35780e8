"""Test-time augmentation: the views of a test image that are classified
together, and how their answers combine. Training's evaluation (steps.py)
averages the views' logits in the compiled step; a trained model that gives
only probabilities (an export) is classified alike by `class_probabilities`."""

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class EvalViews:
    """Test-time augmentation: evaluation's views (one of
    augmentation.TTA_VIEWS) and the fraction of the test images, the least
    confident, that get them (see steps.Trainer.evaluate)."""

    views: str = "none"
    fraction: float = 1.0


def views_of(images: tf.Tensor, views: str) -> list:
    """The views of a batch of test `images` (uint8 [B, H, W, C]) that
    test-time augmentation averages, as (weight, images) pairs whose weights
    sum to 1. `views` (one of augmentation.TTA_VIEWS): none, flip (the image
    and its mirror image, 1/2 each), flip_translate (airbench94's six: those
    two at 1/4 each, and both again shifted one pixel up-left and one pixel
    down-right, reflect-padded, at 1/8 each), or flip_translate_mean (the
    2025 record's: the same six, 1/6 each)."""
    if views == "none":
        return [(1.0, images)]
    if views == "flip_translate_mean":
        return [(1 / 6, view) for _, view in views_of(images, "flip_translate")]
    pairs = [(1.0, images)]  # (weight of the view and its mirror image, the view)
    if views == "flip_translate":
        height, width = images.shape[1:3]
        padded = tf.pad(images, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
        pairs = [(0.5, images), (0.25, padded[:, :height, :width]), (0.25, padded[:, 2:, 2:])]
    return [(weight / 2, view) for weight, image in pairs
            for view in (image, tf.reverse(image, axis=[2]))]


def least_confident(confidence: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the int(N x `fraction`) images of lowest `confidence` (top
    softmax probability of the plain view; ties by index): those that
    selective test-time augmentation (the 2025 record's) augments."""
    return np.argsort(confidence, kind="stable")[:int(len(confidence) * fraction)]


def class_probabilities(probabilities, some_images: np.ndarray, views: str = "none",
                        fraction: float = 1.0, batch_size: int = 500) -> np.ndarray:
    """`probabilities` (uint8 images -> float32 [N, classes]) of all
    `some_images`, `batch_size` at a time (which bounds memory, not the
    answer). With test-time `views` (augmentation.TTA_VIEWS), the
    int(N x `fraction`) images whose plain view is least confident (ties by
    index) are classified as training's evaluation does (steps.py): by the
    weighted mean of their views' logits."""
    def batched(function, inputs):
        return np.concatenate([function(inputs[start:start + batch_size])
                               for start in range(0, len(inputs), batch_size)])

    plain = batched(probabilities, some_images)
    if views == "none":
        return plain

    def augmented(batch):
        # A view's log-probabilities are its logits less one number per
        # image, and the weights sum to 1: the softmax of their weighted sum
        # is the softmax of the weighted sum of the logits. (Where a
        # probability underflowed to 0, its logit was ~87 below the best.)
        log_mean = sum(weight * np.log(np.maximum(probabilities(view.numpy()),
                                                  np.finfo(np.float32).tiny))
                       for weight, view in views_of(tf.constant(batch), views))
        return tf.nn.softmax(log_mean.astype(np.float32)).numpy()

    chosen = least_confident(plain.max(axis=1), fraction)
    result = plain.copy()
    if len(chosen):
        result[chosen] = batched(augmented, some_images[chosen])
    return result
