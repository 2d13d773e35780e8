"""The residual network of Page's DAWNBench CIFAR-10 entries ("ResNet-9")."""

import keras

from distributed_mpt.core.data import DatasetInfo
from distributed_mpt.core.models.faster_layers import FusedBatchNormalization
from distributed_mpt.core.models.layers import normalized_input


def build(info: DatasetInfo, width: int) -> keras.Model:
    """Page's ResNet-9, returning logits.

    Reaches 94% test accuracy in 24 epochs (D. Page, "How to train your
    ResNet", 2018; myrtle.ai). Stages of width w, 2w, 4w, 8w, residual blocks
    after the second and fourth, a global max pool, and the logits scaled by
    1/8 as in the reference.
    """

    def conv_bn(x, channels):
        x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(x)
        # Synchronized: batch statistics over the global batch, so that N
        # replicas at batch b train like one at N*b, and every replica keeps
        # the same moving statistics (Keras 3 would otherwise let them drift);
        # fused where one replica sees the whole batch (faster_layers.py).
        x = FusedBatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=True)(x)
        return keras.layers.Activation("relu")(x)

    def residual(x, channels):
        return keras.layers.Add()([x, conv_bn(conv_bn(x, channels), channels)])

    images, x = normalized_input(info)
    x = conv_bn(x, width)
    x = keras.layers.MaxPooling2D()(conv_bn(x, 2 * width))
    x = residual(x, 2 * width)
    x = keras.layers.MaxPooling2D()(conv_bn(x, 4 * width))
    x = keras.layers.MaxPooling2D()(conv_bn(x, 8 * width))
    x = residual(x, 8 * width)
    x = keras.layers.GlobalMaxPooling2D()(x)
    x = keras.layers.Rescaling(0.125)(x)
    logits = keras.layers.Dense(info.num_classes, use_bias=False, name="logits")(x)
    return keras.Model(images, logits, name="resnet9")
