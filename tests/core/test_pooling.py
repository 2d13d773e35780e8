"""airbench's lean max pooling is Keras' 2x2 max pooling, bit for bit,
gradient included, whose backward pass does not keep the pooled map; used
for float32 maps only (in bfloat16 it costs more time than it saves memory:
faster_layers.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.core.models import faster_layers
from distributed_mpt.core.models.faster_layers import LeanMaxPooling2D


def _values_and_gradients(layer, x, weights):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        # Each output weighed differently: every gradient must reach its own pixel.
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
    return [np.asarray(tf.cast(t, tf.float32)) for t in (y, tape.gradient(loss, x))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(4, 31, 31, 8), (3, 7, 7, 16), (2, 16, 16, 5), (2, 3, 3, 4)])
def test_lean_pooling_gives_keras_values_and_gradients_exactly(dtype, shape):
    # Odd sizes (airbench's 31, 15, 7 and 3 pixels: "valid" drops the last
    # row and column) and small integers: most windows hold ties, whose
    # gradient must go to the same pixel as Keras'.
    rng = np.random.default_rng(0)
    x = tf.cast(rng.integers(-3, 3, shape), dtype)
    weights = tf.constant(rng.normal(size=(shape[0], shape[1] // 2, shape[2] // 2, shape[3])),
                          tf.float32)
    keras_pool = _values_and_gradients(keras.layers.MaxPooling2D(dtype=dtype), x, weights)
    lean = _values_and_gradients(faster_layers.max_pool_2x2, x, weights)
    for what, expected, ours in zip(("values", "gradients"), keras_pool, lean):
        np.testing.assert_array_equal(ours, expected, err_msg=what)


def _backward_ops_reading_the_input(layer):
    """The ops of the gradient that read the pooled map (or an identity of
    it): what keeps it in memory until the backward pass."""

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        return tape.gradient(loss, x)

    graph = gradient.get_concrete_function(tf.TensorSpec([2, 31, 31, 8], tf.float32)).graph
    images = graph.inputs[0]
    aliases, readers = [images], []
    while aliases:
        for op in aliases.pop().consumers():
            if op.type in ("Identity", "IdentityN"):
                aliases += [t for t in op.outputs if t.shape == images.shape]
            elif op.name.startswith("gradient_tape/"):
                readers.append(op.type)
    return readers


def test_the_backward_pass_does_not_keep_the_pooled_map():
    # Keras' MaxPoolGrad reads it: the check can see a reader.
    assert _backward_ops_reading_the_input(keras.layers.MaxPooling2D())
    assert _backward_ops_reading_the_input(LeanMaxPooling2D()) == []


def test_the_gradient_is_written_once():
    # The row and column "valid" pooling dropped are padded inside the
    # compiled gradient: padded after it, the image-sized gradient was held
    # twice at once (airbench's first pooling: 354 + 378 MB in float32).
    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(faster_layers.max_pool_2x2(x))
        return tape.gradient(loss, x)

    graph = gradient.get_concrete_function(tf.TensorSpec([2, 31, 31, 8], tf.float32)).graph
    assert "Pad" not in {op.type for op in graph.get_operations()}
    assert gradient(tf.ones([2, 31, 31, 8])).shape == (2, 31, 31, 8)


def test_other_poolings_dtypes_and_gpus_get_keras_pooling(monkeypatch):
    x = tf.zeros([1, 9, 9, 2])
    calls = []
    monkeypatch.setattr(faster_layers, "max_pool_2x2", lambda images: calls.append(1) or images)
    LeanMaxPooling2D(pool_size=3)(x)
    LeanMaxPooling2D(padding="same")(x)
    LeanMaxPooling2D(dtype="bfloat16")(tf.cast(x, tf.bfloat16))
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: False)  # GPUs
    assert LeanMaxPooling2D()(x).shape == (1, 4, 4, 2)
    assert calls == []
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: True)
    LeanMaxPooling2D()(x)
    assert calls == [1]
