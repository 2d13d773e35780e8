"""The original notebook's network: Flatten, Dense 3000, Dense 1000, Dense 10."""

import keras

from distributed_mpt.core.data import DatasetInfo
from distributed_mpt.core.models.layers import normalized_input


def build(info: DatasetInfo, width: int) -> keras.Model:
    """The notebook's MLP for `info`'s images and classes, returning logits.
    `width` is ignored: the MLP is kept exactly as the notebook had it."""
    del width
    images, x = normalized_input(info)
    x = keras.layers.Flatten()(x)
    for units in (3000, 1000):
        x = keras.layers.Dense(units, activation="relu")(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes, name="logits")(x), name="mlp")
