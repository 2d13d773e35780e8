"""An example of a network of your own (docs/extending.md): a small CNN.

Train it with --model=/models/model.py:small_cnn in the flags of
k8s/settings/settings.yaml; replace it, or add files beside it (and list
them in kustomization.yaml), for your own.
"""

import keras


def small_cnn(info):
    """info: the dataset's DatasetInfo (image_shape, num_classes, class_names, mean, std)."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Normalization(mean=info.mean, variance=[s * s for s in info.std])(images)
    for width in (32, 64):
        x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))
