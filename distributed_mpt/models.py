"""The models: the notebook's MLP and a residual CNN for CIFAR-10.

Every model takes uint8 images [B, 32, 32, 3] and normalizes them itself, so
images cross to the device as uint8 and the exported model serves raw pixels.
Outputs are softmax probabilities in float32 whatever the compute precision:
a float16 softmax loses too much for the cross-entropy.
"""

from typing import Optional

import keras

from distributed_mpt.data import CIFAR10_MEAN, CIFAR10_STD, IMAGE_SHAPE, NUM_CLASSES


def build_model(name: str, width: int = 64, weight_decay: float = 0.0) -> keras.Model:
    """Builds model `name` ('mlp' or 'resnet9') under the current dtype policy.

    width: channels of the first resnet9 stage (64 in the reference network);
    weight_decay: L2 coefficient on every kernel (0 for none).
    """
    regularizer = keras.regularizers.L2(weight_decay) if weight_decay > 0 else None
    builders = {"mlp": _mlp, "resnet9": _resnet9}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(builders)}")
    return builders[name](width, regularizer)


def synchronizes_replicas(name: str) -> bool:
    """True if model `name` all-reduces inside its forward pass (synchronized
    batch norm), which XLA-compiling a replica's step cannot hold."""
    return name == "resnet9"


def _inputs():
    images = keras.Input(shape=IMAGE_SHAPE, dtype="uint8", name="images")
    normalized = keras.layers.Normalization(
        mean=CIFAR10_MEAN, variance=[s * s for s in CIFAR10_STD], name="normalize")(images)
    return images, normalized


def _classifier(x, regularizer, use_bias=True):
    logits = keras.layers.Dense(NUM_CLASSES, use_bias=use_bias, kernel_regularizer=regularizer,
                                name="logits")(x)
    return keras.layers.Activation("softmax", dtype="float32", name="probabilities")(logits)


def _mlp(width: int, regularizer: Optional[keras.regularizers.Regularizer]) -> keras.Model:
    """The original notebook's network: Flatten, Dense 3000, Dense 1000, Dense 10.

    `width` is ignored: the MLP is kept exactly as the notebook had it.
    """
    del width
    images, x = _inputs()
    x = keras.layers.Flatten()(x)
    for units in (3000, 1000):
        x = keras.layers.Dense(units, activation="relu", kernel_regularizer=regularizer)(x)
    return keras.Model(images, _classifier(x, regularizer), name="mlp")


def _resnet9(width: int, regularizer: Optional[keras.regularizers.Regularizer]) -> keras.Model:
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
        # the same moving statistics (Keras 3 would otherwise let them drift).
        x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=True)(x)
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
