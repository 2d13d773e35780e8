"""Layers the built-in models share, and that a user's model may use:
normalization of uint8 input, a whitening convolution computed from the
data, and two Keras layers made fast on CPUs (the same function and
variables as Keras' own, which exports get in their place).

FusedBatchNormalization: Keras 3's `BatchNormalization` casts a bfloat16
activation to float32 and normalizes it in several elementwise passes,
forward and backward; on a CPU those passes, not the convolutions, bound a
small CNN's step. TensorFlow's `FusedBatchNormV3` does the same arithmetic
in one pass each way. It cannot all-reduce its statistics, so the layer
uses it only when the batch is the global one (one replica in sync); with
more, Keras' synchronized path keeps N replicas training like one.

SideBySideConv2D: oneDNN computes a convolution in blocks of output pixels
along a row. On the narrow feature maps at the end of airbench (7 and 3
pixels wide) those blocks run mostly empty: on a Xeon with AMX, in
bfloat16, the weight gradient of its 3-pixel stage ran at 41 GFLOP/s,
against 253 with 16 of the images side by side in rows 64 pixels wide.
Images placed side by side, with a zero gap between neighbours, give the
same convolution. It pays only there: on the same Xeon in float32 (no AMX)
the rearrangement made airbench's step 11% slower (docs/performance.md).
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from distributed_mpt.core import precision
from distributed_mpt.core.data import DatasetInfo

# Images up to this wide are placed side by side in rows of about
# ROW_WIDTH pixels; wider ones are convolved as they are.
MAX_IMAGE_WIDTH = 7
ROW_WIDTH = 64


def normalized_input(info: DatasetInfo):
    """(uint8 image input of `info`'s shape, the images normalized with its
    mean and std): how every model starts, so that images cross to the
    device as uint8 and an export serves raw pixels."""
    images = keras.Input(shape=info.image_shape, dtype="uint8", name="images")
    normalized = keras.layers.Normalization(
        mean=info.mean, variance=[s * s for s in info.std], name="normalize")(images)
    return images, normalized


class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization`, the same function and variables,
    trained by `FusedBatchNormV3` when one replica sees the global batch
    (and the input is NHWC, channels last, unmasked)."""

    def call(self, inputs, training=None, mask=None):
        replicas = tf.distribute.get_replica_context()  # None in a cross-replica context
        fusable = (training and self.trainable and mask is None and not self.renorm
                   and len(inputs.shape) == 4 and self.axis in (-1, 3)
                   and replicas is not None and replicas.num_replicas_in_sync == 1)
        if not fusable:
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        ones, zeros = tf.ones([channels], tf.float32), tf.zeros([channels], tf.float32)
        empty = tf.constant([], tf.float32)
        outputs, mean, variance, *_ = tf.raw_ops.FusedBatchNormV3(
            x=inputs, scale=tf.cast(self.gamma, tf.float32) if self.scale else ones,
            offset=tf.cast(self.beta, tf.float32) if self.center else zeros,
            mean=empty, variance=empty, epsilon=self.epsilon, is_training=True)
        # The kernel returns the unbiased (n - 1) variance, for its own moving
        # average; Keras' moving variance, which inference uses, is biased.
        count = tf.cast(tf.size(inputs) // channels, tf.float32)
        variance *= (count - 1.0) / count
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(outputs, self.compute_dtype)


class SideBySideConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D`, the same function and variables, which
    convolves images of at most MAX_IMAGE_WIDTH pixels side by side where
    that is faster: bfloat16 on a CPU with AMX, no GPU. Only a stride-1,
    "same"-padded, channels-last convolution is rearranged."""

    def convolution_op(self, inputs, kernel):
        width = inputs.shape[2]
        rearrangeable = (self.padding == "same" and self.data_format == "channels_last"
                         and tuple(self.strides) == (1, 1) and tuple(self.dilation_rate) == (1, 1)
                         and self.kernel_size[1] % 2 == 1 and None not in inputs.shape[1:])
        if not (rearrangeable and width <= MAX_IMAGE_WIDTH and _pays_side_by_side(inputs.dtype)):
            return super().convolution_op(inputs, kernel)
        return side_by_side(lambda rows: super(SideBySideConv2D, self).convolution_op(rows, kernel),
                            inputs, ROW_WIDTH // (width + 1), gap=self.kernel_size[1] // 2)


def _pays_side_by_side(dtype) -> bool:
    """Whether convolving narrow images side by side is faster here (see
    the module's docstring): in bfloat16 on AMX, without GPUs."""
    return dtype == tf.bfloat16 and _amx_without_gpus()


@functools.cache
def _amx_without_gpus() -> bool:
    return ("amx_bf16" in precision.cpu_bfloat16_instructions()
            and not tf.config.list_physical_devices("GPU"))


def side_by_side(convolve, images, per_row: int, gap: int):
    """`convolve(images)` computed on rows of `per_row` images side by side,
    each followed by `gap` zero columns (half the kernel's width, so that
    no output pixel reaches past its image into the next one); zero images
    fill the last row. images: [N, H, W, C] of static H, W and C."""
    count = tf.shape(images)[0]
    _, height, width, channels = images.shape
    spaced = width + gap
    padded = tf.pad(images, [[0, -count % per_row], [0, 0], [0, gap], [0, 0]])
    # [N, H, W + gap, C] -> [N / per_row, H, per_row * (W + gap), C]
    rows = tf.transpose(tf.reshape(padded, [-1, per_row, height, spaced, channels]), [0, 2, 1, 3, 4])
    outputs = convolve(tf.reshape(rows, [-1, height, per_row * spaced, channels]))
    # ... and back, without the gaps and the filling images.
    filters = outputs.shape[-1]
    outputs = tf.transpose(tf.reshape(outputs, [-1, height, per_row, spaced, filters]), [0, 2, 1, 3, 4])
    return tf.reshape(outputs, [-1, height, spaced, filters])[:count, :, :width]


class WhiteningConv2D(keras.layers.Conv2D):
    """A convolution whose filters whiten the patches of the training images
    (airbench's first layer): computed from the data by
    `initialize_from_data`, then frozen; only its bias trains (for as long
    as the optimizer's whitening-bias group says). It makes `2 x patch
    dimensions` filters: each eigenvector of the patch covariance scaled by
    1/sqrt(eigenvalue), and its negative, so that an activation after it
    keeps both signs."""

    EPSILON = 5e-4
    IMAGES = 5000  # airbench's choice: enough for a 12x12 covariance

    def __init__(self, kernel_size: int, channels_in: int, mean, std, **kwargs):
        super().__init__(2 * kernel_size * kernel_size * channels_in, kernel_size, **kwargs)
        # Not in get_config: an export holds a plain Conv2D (with_keras_layers).
        self._normalization = (np.float32(mean), np.float32(std))

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.trainable = False  # the filters come from the data

    def initialize_from_data(self, train_images: np.ndarray) -> None:
        """Sets the filters from the first IMAGES of `train_images` (uint8
        NHWC). Deterministic in the images: every worker gets the same."""
        self.kernel.assign(self.whitening_filters(train_images[:self.IMAGES]))

    def whitening_filters(self, images: np.ndarray) -> np.ndarray:
        """The kernel [k, k, c, 2 k k c] that whitens k x k patches of
        `images` normalized as the model normalizes them."""
        k, (height, width), channels = self.kernel_size[0], images.shape[1:3], images.shape[3]
        mean, std = self._normalization
        dimensions = k * k * channels
        covariance, count = np.zeros((dimensions, dimensions)), 0
        for start in range(0, len(images), 250):  # chunks: no float copy of all images
            x = (images[start:start + 250].astype(np.float32) - mean) / std
            # Patch dimensions in the kernel's order (row, column, channel).
            patches = np.stack([x[:, i:height - k + 1 + i, j:width - k + 1 + j]
                                for i in range(k) for j in range(k)], axis=3)
            patches = patches.reshape(-1, dimensions).astype(np.float64)
            covariance += patches.T @ patches
            count += len(patches)
        eigenvalues, eigenvectors = np.linalg.eigh(covariance / count)
        filters = eigenvectors / np.sqrt(eigenvalues + self.EPSILON)
        filters = filters.reshape(k, k, channels, -1)
        return np.concatenate([filters, -filters], axis=-1).astype(np.float32)


def with_keras_layers(model: keras.Model) -> keras.Model:
    """A copy of `model`, with its weights, in which every layer of this
    package is the Keras layer it extends: what a `.keras` file should hold,
    so that it loads without this package. A model Keras cannot clone (a
    subclassed one of the user's) is returned as it is."""

    def clone(layer):
        keras_class = next(c for c in type(layer).__mro__ if c.__module__.startswith("keras"))
        return keras_class.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone)
    except ValueError:  # "Expected `model` argument to be a functional `Model` instance"
        return model
    copy.set_weights(model.get_weights())
    return copy
