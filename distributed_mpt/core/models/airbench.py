"""Keller Jordan's airbench94 network, the CPU's choice (94% on CIFAR-10 in
10 epochs; "94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024)."""

import keras
import numpy as np

from distributed_mpt.core.data import DatasetInfo
from distributed_mpt.core.models import AIRBENCH_ACTIVATIONS
from distributed_mpt.core.models.faster_layers import (COMPILED_ACTIVATIONS, CompiledActivation,
                                                       FusedBatchNormalization, LeanMaxPooling2D,
                                                       SideBySideConv2D)
from distributed_mpt.core.models.layers import WhiteningConv2D, normalized_input

WHITENING_PATCH = 2


def build(info: DatasetInfo, width: int, identity_init: bool = True, activation: str = "gelu",
          bn_momentum: float = 0.6, whiten_images: int = WhiteningConv2D.IMAGES) -> keras.Model:
    """airbench94's network as its reference code has it, returning logits: a
    2x2 whitening convolution whose frozen filters are computed from the
    first `whiten_images` training images (layers.WhiteningConv2D), then
    three stages (w, 4w, 4w channels) of conv -> max pool -> batch norm ->
    activation -> conv -> batch norm -> activation, a max pool and a linear
    classifier scaled by 1/9. Batch norm learns only its shift (momentum
    `bn_momentum` in Keras' sense: the old statistics' weight); each
    convolution starts as the identity on its first c_in filters (unless not
    `identity_init`: see `_identity_init`), and the other weights as PyTorch
    initializes them. The whitening layer's activation is GELU, as in both
    references; `activation` is one of AIRBENCH_ACTIVATIONS."""
    if activation not in AIRBENCH_ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: choose from {AIRBENCH_ACTIVATIONS}")

    def activate(name):
        # One compiled pass each way where it pays (faster_layers.py).
        return (CompiledActivation(name) if name in COMPILED_ACTIVATIONS
                else keras.layers.Activation(name))

    def conv(channels):
        return SideBySideConv2D(channels, 3, padding="same", use_bias=False,
                                kernel_initializer=_torch_init())

    def conv_bn_activation(x, channels, pool):
        x = conv(channels)(x)
        if pool:
            x = LeanMaxPooling2D()(x)
        # Synchronized, so that N replicas train like one, as in resnet9;
        # epsilon 1e-12 is airbench's (its PyTorch 0.4).
        x = FusedBatchNormalization(momentum=bn_momentum, epsilon=1e-12, scale=False,
                                    synchronized=True)(x)
        return activate(activation)(x)

    images, x = normalized_input(info)
    whiten = WhiteningConv2D(WHITENING_PATCH, info.image_shape[2], info.mean, info.std,
                             images=whiten_images, name="whiten")
    x = activate("gelu")(whiten(x))
    for channels in (width, 4 * width, 4 * width):
        x = conv_bn_activation(conv_bn_activation(x, channels, pool=True), channels, pool=False)
    x = keras.layers.GlobalMaxPooling2D()(x)  # the 3x3 map left: airbench's MaxPool2d(3)
    x = keras.layers.Rescaling(1 / 9)(x)
    logits = keras.layers.Dense(info.num_classes, use_bias=False, kernel_initializer=_torch_init(),
                                name="logits")(x)
    model = keras.Model(images, logits, name="airbench")
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
    convolution to the identity (airbench's `dirac_` initialization): at the
    start each block passes its input through, which trains faster than
    random filters."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D) and not isinstance(layer, WhiteningConv2D):
            kernel = keras.ops.convert_to_numpy(layer.kernel)
            size, _, channels_in, channels_out = kernel.shape
            identity = np.arange(min(channels_in, channels_out))
            kernel[:, :, :, identity] = 0.0
            kernel[size // 2, size // 2, identity, identity] = 1.0
            layer.kernel.assign(kernel)
