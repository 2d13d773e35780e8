"""The models: the notebook's MLP, a residual CNN for GPUs, and airbench94's
CNN, which reaches 94% on a CPU (recipes/cpu_cnn94.flags).

Every model takes uint8 images [B, 32, 32, 3] and normalizes them itself, so
images cross to the device as uint8 and the exported model serves raw pixels.
Outputs are softmax probabilities in float32 whatever the compute precision:
a float16 softmax loses too much for the cross-entropy.
"""

import functools
from typing import Optional

import keras
import numpy as np

from distributed_mpt.training.batch_norm import FusedBatchNormalization
from distributed_mpt.training.convolution import SideBySideConv2D
from distributed_mpt.training.datasets import CIFAR10_MEAN, CIFAR10_STD, IMAGE_SHAPE, NUM_CLASSES


def build_model(name: str, width: int = 64, weight_decay: float = 0.0,
                shift_lr_multiplier: float = 1.0, muon: bool = False,
                identity_init: bool = True) -> keras.Model:
    """Builds model `name` ('mlp', 'resnet9' or 'airbench') under the current
    dtype policy.

    width: channels of the first stage of resnet9 or airbench (64 in both
    reference networks); weight_decay: L2 coefficient on every trained kernel
    and bias (0 for none). The fast biases (`fast_biases`) get weight_decay /
    shift_lr_multiplier: the trainer multiplies their gradients (the L2 term
    included) by shift_lr_multiplier, so their decay per step stays that of
    the kernels, as in airbench94. muon: airbench as airbench94_muon trains
    it, its convolution filters without L2 (Muon renormalizes them every
    step; an L2 term in their gradient would only bend the orthogonalized
    step) and its whitening bias among the fast biases. identity_init:
    airbench's convolutions start as the identity on their first c_in filters
    (`_identity_init`); else all random. Call `initialize_from_data` before
    training.
    """
    airbench = functools.partial(_airbench, muon=muon, identity_init=identity_init)
    builders = {"mlp": _mlp, "resnet9": _resnet9, "airbench": airbench}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(builders)}")
    return builders[name](width, _l2(weight_decay), _l2(weight_decay / shift_lr_multiplier))


def with_keras_layers(model: keras.Model) -> keras.Model:
    """A copy of `model`, with its weights, in which every layer of this
    package (FusedBatchNormalization, SideBySideConv2D: faster ways to train
    the same function) is the Keras layer it extends: what a `.keras` file
    should hold, so that it loads without this package."""

    def clone(layer):
        keras_class = next(c for c in type(layer).__mro__ if c.__module__.startswith("keras"))
        return keras_class.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    copy.set_weights(model.get_weights())
    return copy


def _l2(coefficient: float) -> Optional[keras.regularizers.Regularizer]:
    return keras.regularizers.L2(coefficient) if coefficient > 0 else None


def batch_norm_shifts(model: keras.Model) -> list:
    """The batch-norm shift variables (beta) of `model`."""
    return [layer.beta for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization) and layer.center]


def fast_biases(model: keras.Model, muon: bool = False) -> list:
    """The variables that --shift_lr_multiplier speeds up: the batch-norm
    shifts, and for airbench94_muon (`muon`) the whitening bias too."""
    bias = whitening_bias(model)
    return batch_norm_shifts(model) + ([bias] if muon and bias is not None else [])


def convolution_filters(model: keras.Model) -> list:
    """The trained convolution kernels of `model` (not airbench's frozen
    whitening filters): what --optimizer=muon trains with Muon."""
    return [v for v in model.trainable_variables if len(v.shape) == 4]


def whitening_bias(model: keras.Model):
    """airbench's whitening-layer bias (trained for --whiten_bias_epochs
    only), or None for the other models."""
    layers = [layer for layer in model.layers if layer.name == _WHITENING_LAYER]
    return layers[0].bias if layers else None


def synchronizes_replicas(name: str) -> bool:
    """True if model `name` all-reduces inside its forward pass (synchronized
    batch norm), which XLA-compiling a replica's step cannot hold."""
    return name in ("resnet9", "airbench")


def initialize_from_data(model: keras.Model, train_images: np.ndarray) -> None:
    """Sets the weights that a model derives from its training data (airbench's
    whitening filters); a no-op for the others. Deterministic in the images,
    so every worker computes the same weights."""
    for layer in model.layers:
        if layer.name == _WHITENING_LAYER:
            layer.kernel.assign(whitening_filters(train_images[:_WHITENING_IMAGES]))


def _inputs():
    images = keras.Input(shape=IMAGE_SHAPE, dtype="uint8", name="images")
    normalized = keras.layers.Normalization(
        mean=CIFAR10_MEAN, variance=[s * s for s in CIFAR10_STD], name="normalize")(images)
    return images, normalized


def _classifier(x, regularizer, use_bias=True, initializer="glorot_uniform"):
    logits = keras.layers.Dense(NUM_CLASSES, use_bias=use_bias, kernel_initializer=initializer,
                                kernel_regularizer=regularizer, name="logits")(x)
    return keras.layers.Activation("softmax", dtype="float32", name="probabilities")(logits)


def _mlp(width: int, regularizer, shift_regularizer) -> keras.Model:
    """The original notebook's network: Flatten, Dense 3000, Dense 1000, Dense 10.

    `width` is ignored: the MLP is kept exactly as the notebook had it.
    """
    del width, shift_regularizer  # no batch norm
    images, x = _inputs()
    x = keras.layers.Flatten()(x)
    for units in (3000, 1000):
        x = keras.layers.Dense(units, activation="relu", kernel_regularizer=regularizer)(x)
    return keras.Model(images, _classifier(x, regularizer), name="mlp")


def _resnet9(width: int, regularizer, shift_regularizer) -> keras.Model:
    """The residual network of Page's DAWNBench CIFAR-10 entries ("ResNet-9").

    Reaches 94% test accuracy in 24 epochs (D. Page, "How to train your
    ResNet", 2018; myrtle.ai). Stages of width w, 2w, 4w, 8w, residual blocks
    after the second and fourth, a global max pool, and the logits scaled by
    1/8 as in the reference.
    """

    def conv_bn(x, channels):
        x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False,
                                kernel_regularizer=regularizer)(x)
        # Synchronized: batch statistics over the global batch, so that N
        # replicas at batch b train like one at N*b, and every replica keeps
        # the same moving statistics (Keras 3 would otherwise let them drift);
        # fused where one replica sees the whole batch (batch_norm.py).
        x = FusedBatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=True,
                                      beta_regularizer=shift_regularizer)(x)
        return keras.layers.Activation("relu")(x)

    def residual(x, channels):
        return keras.layers.Add()([x, conv_bn(conv_bn(x, channels), channels)])

    images, x = _inputs()
    x = conv_bn(x, width)
    x = keras.layers.MaxPooling2D()(conv_bn(x, 2 * width))
    x = residual(x, 2 * width)
    x = keras.layers.MaxPooling2D()(conv_bn(x, 4 * width))
    x = keras.layers.MaxPooling2D()(conv_bn(x, 8 * width))
    x = residual(x, 8 * width)
    x = keras.layers.GlobalMaxPooling2D()(x)
    x = keras.layers.Rescaling(0.125)(x)
    return keras.Model(images, _classifier(x, regularizer, use_bias=False), name="resnet9")


_WHITENING_LAYER = "whiten"
_WHITENING_PATCH = 2
_WHITENING_IMAGES = 5000  # airbench's choice: enough for a 12x12 covariance
_WHITENING_EPSILON = 5e-4


def whitening_filters(images: np.ndarray) -> np.ndarray:
    """Conv2D kernel [2, 2, 3, 24] that whitens 2x2 patches of normalized
    `images` (uint8 NHWC): each eigenvector of the patch covariance scaled by
    1/sqrt(eigenvalue), and its negative (so that a ReLU-like activation after
    it keeps both signs)."""
    k, (height, width) = _WHITENING_PATCH, images.shape[1:3]
    dimensions = k * k * IMAGE_SHAPE[2]
    covariance, count = np.zeros((dimensions, dimensions)), 0
    for start in range(0, len(images), 250):  # chunks: no float copy of all images
        x = (images[start:start + 250].astype(np.float32) - np.float32(CIFAR10_MEAN)) \
            / np.float32(CIFAR10_STD)
        # Patch dimensions in the kernel's order (row, column, channel).
        patches = np.stack([x[:, i:height - k + 1 + i, j:width - k + 1 + j]
                            for i in range(k) for j in range(k)], axis=3)
        patches = patches.reshape(-1, dimensions).astype(np.float64)
        covariance += patches.T @ patches
        count += len(patches)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance / count)
    filters = eigenvectors / np.sqrt(eigenvalues + _WHITENING_EPSILON)
    filters = filters.reshape(k, k, IMAGE_SHAPE[2], -1)
    return np.concatenate([filters, -filters], axis=-1).astype(np.float32)


def _airbench(width: int, regularizer, shift_regularizer, muon: bool,
              identity_init: bool) -> keras.Model:
    """The network of Keller Jordan's airbench94 (94% on CIFAR-10 in 10 epochs;
    "94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024), as its reference
    code has it: a 2x2 whitening convolution whose frozen filters are computed
    from the data and whose bias trains briefly (--whiten_bias_epochs), then
    three stages (w, 4w, 4w channels) of conv -> max pool -> batch norm ->
    GELU -> conv -> batch norm -> GELU, a max pool and a linear classifier
    scaled by 1/9. Batch norm learns only its shift; each convolution starts
    as the identity on its first c_in filters (see `_identity_init`; unless
    not `identity_init`), and the other weights as PyTorch initializes them.
    `muon`: see build_model.
    """

    def conv(channels, **kwargs):
        return SideBySideConv2D(channels, 3, padding="same", use_bias=False,
                                kernel_initializer=_torch_init(),
                                kernel_regularizer=None if muon else regularizer, **kwargs)

    def conv_bn_gelu(x, channels, pool):
        x = conv(channels)(x)
        if pool:
            x = keras.layers.MaxPooling2D()(x)
        # Synchronized for exact N-replica equivalence, as in resnet9;
        # momentum 0.6 and epsilon 1e-12 are airbench's (its PyTorch 0.4).
        x = FusedBatchNormalization(momentum=0.6, epsilon=1e-12, scale=False, synchronized=True,
                                    beta_regularizer=shift_regularizer)(x)
        return keras.layers.Activation("gelu")(x)

    images, x = _inputs()
    patch_channels = 2 * _WHITENING_PATCH ** 2 * IMAGE_SHAPE[2]
    whiten = keras.layers.Conv2D(patch_channels, _WHITENING_PATCH, name=_WHITENING_LAYER,
                                 bias_regularizer=shift_regularizer if muon else regularizer)
    x = keras.layers.Activation("gelu")(whiten(x))
    whiten.kernel.trainable = False  # the filters come from the data; only the bias trains
    for channels in (width, 4 * width, 4 * width):
        x = conv_bn_gelu(conv_bn_gelu(x, channels, pool=True), channels, pool=False)
    x = keras.layers.GlobalMaxPooling2D()(x)  # the 3x3 map left: airbench's MaxPool2d(3)
    x = keras.layers.Rescaling(1 / 9)(x)
    model = keras.Model(images, _classifier(x, regularizer, use_bias=False, initializer=_torch_init()),
                        name="airbench")
    if identity_init:
        _identity_init(model)
    return model


def _torch_init() -> keras.initializers.Initializer:
    """PyTorch's default for Conv2d and Linear weights, U(+-1/sqrt(fan_in)),
    which airbench's hyperparameters were tuned with (Keras' Glorot is 1.7x
    larger for a 256-channel 3x3 convolution: a smaller effective learning
    rate under batch norm). A new one per layer, made after --seed is set:
    an unseeded initializer draws its seed when it is made."""
    return keras.initializers.VarianceScaling(1 / 3, mode="fan_in", distribution="uniform")


def _identity_init(model: keras.Model) -> None:
    """Sets the first c_in filters (all, if fewer) of each trained 3x3
    convolution to the identity (airbench's `dirac_` initialization): at the start each block
    passes its input through, which trains faster than random filters."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D) and layer.name != _WHITENING_LAYER:
            kernel = keras.ops.convert_to_numpy(layer.kernel)
            size, _, channels_in, channels_out = kernel.shape
            identity = np.arange(min(channels_in, channels_out))
            kernel[:, :, :, identity] = 0.0
            kernel[size // 2, size // 2, identity, identity] = 1.0
            layer.kernel.assign(kernel)
