"""Layers the built-in models share, and that a user's model may use:
normalization of uint8 input, a whitening convolution computed from the
data, and the copy of a model an export holds (Keras' own layers in place of
this package's: faster_layers.py has the faster ones).
"""

import keras
import numpy as np
import tensorflow as tf

from distributed_mpt.core.data import DatasetInfo
from distributed_mpt.core.models.faster_layers import computable_again


def normalized_input(info: DatasetInfo):
    """(uint8 image input of `info`'s shape, the images normalized with its
    mean and std): how every model starts, so that images cross to the
    device as uint8 and an export serves raw pixels."""
    images = keras.Input(shape=info.image_shape, dtype="uint8", name="images")
    normalized = keras.layers.Normalization(
        mean=info.mean, variance=[s * s for s in info.std], name="normalize")(images)
    return images, normalized


class WhiteningConv2D(keras.layers.Conv2D):
    """A convolution whose filters whiten the patches of the training images
    (airbench's first layer): computed from the data by
    `initialize_from_data`, then frozen; only its bias trains (for as long
    as the optimizer's whitening-bias group says). It makes `2 x patch
    dimensions` filters: each eigenvector of the patch covariance scaled by
    1/sqrt(eigenvalue), and its negative, so that an activation after it
    keeps both signs."""

    EPSILON = 5e-4
    # Of the largest eigenvalue: a direction varying 1e-5 as much (in std)
    # is rounding of the normalized pixels (float32's is 1e-7), not data.
    UNSPANNED = 1e-10
    IMAGES = 5000  # airbench's choice: enough for a 12x12 covariance (the 2025 record: 960)

    def __init__(self, kernel_size: int, channels_in: int, mean, std, images: int = IMAGES,
                 **kwargs):
        super().__init__(2 * kernel_size * kernel_size * channels_in, kernel_size, **kwargs)
        # Not in get_config: an export holds a plain Conv2D (with_keras_layers).
        self._normalization = (np.float32(mean), np.float32(std))
        self._images = images

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.trainable = False  # the filters come from the data

    def call(self, inputs):
        """Keras' convolution and bias, marked as cheap to compute again from
        `inputs` (2x2 filters, 3 channels in): the backward pass recomputes
        the whitened map, the largest of airbench's after its first
        convolution, rather than keep it (faster_layers.computation_of)."""
        # float32 only, where memory is short: in bfloat16 the map computed
        # again in the training step was not the same bits (docs/performance.md).
        if not self.use_bias or self.compute_dtype != "float32":
            return super().call(inputs)
        # Read here, in the compute dtype: Keras' variables autocast only
        # inside this call, and the backward pass's computation is outside.
        kernel, bias = (tf.cast(v, self.compute_dtype) for v in (self.kernel, self.bias))
        bias_shape = (1,) * (len(inputs.shape) - 1) + (self.filters,)

        def whiten():  # Keras' Conv2D.call, op for op: the same bits
            return keras.ops.add(self.convolution_op(inputs, kernel), keras.ops.reshape(bias, bias_shape))

        return computable_again(whiten(), whiten)

    def initialize_from_data(self, train_images: np.ndarray) -> None:
        """Sets the filters from the first `images` (IMAGES by default) of
        `train_images` (uint8 NHWC). Deterministic in the images: every
        worker gets the same."""
        self.kernel.assign(self.whitening_filters(train_images[:self._images]))

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
        eigenvalues, eigenvectors = np.linalg.eigh(covariance / count)  # ascending
        filters = eigenvectors / np.sqrt(eigenvalues + self.EPSILON)
        # A direction the images do not vary in (greyscale's three equal
        # channels leave 8 of 12) gives a filter whose output is the same on
        # every patch: rounding noise in float32, exact zeros in bfloat16.
        # Airbench's identity-initialized convolutions carry such a constant
        # channel through batch norm after batch norm, and each (epsilon
        # 1e-12) multiplies its gradient by 1e6: one bfloat16 step made a
        # shift 1e19 and the evaluation NaN. Those filters repeat the
        # strongest directions' instead: a channel that varies.
        spanned = np.flatnonzero(eigenvalues > eigenvalues[-1] * self.UNSPANNED)
        unspanned = np.flatnonzero(eigenvalues <= eigenvalues[-1] * self.UNSPANNED)
        if len(spanned) and len(unspanned):
            strongest_first = spanned[::-1]
            filters[:, unspanned] = filters[:, np.resize(strongest_first, len(unspanned))]
        filters = filters.reshape(k, k, channels, -1)
        return np.concatenate([filters, -filters], axis=-1).astype(np.float32)


def with_keras_layers(model: keras.Model) -> keras.Model:
    """A copy of `model`, with its weights, in which every layer of this
    package is the Keras layer it extends: what a `.keras` file should hold,
    so that it loads without this package. A model Keras cannot clone (a
    subclassed one of the user's) is returned as it is."""

    def clone(layer):
        # A user's own layer stays itself: the first Keras class above it
        # may be the bare Layer, which has no call().
        outside = next(c for c in type(layer).__mro__
                       if not c.__module__.startswith("distributed_mpt."))
        return outside.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone)
    except ValueError:  # "Expected `model` argument to be a functional `Model` instance"
        return model
    copy.set_weights(model.get_weights())
    return copy
