"""Images convolved side by side, and a weight gradient computed tap by tap,
are the same convolution: the same outputs and gradients as Keras' Conv2D,
computed so only where it pays."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.core.models import faster_layers as layers
from distributed_mpt.core.models.faster_layers import SideBySideConv2D


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("count, width, per_row", [(5, 7, 8), (16, 3, 16), (3, 3, 2)])
def test_side_by_side_is_the_convolution_with_its_gradients(count, width, per_row):
    _assert_the_convolution(lambda x, k: layers.side_by_side(
        lambda rows: tf.nn.conv2d(rows, k, 1, "SAME"), x, per_row, gap=1),
        images=(count, width, width, 4), kernel=(3, 3, 4, 6))


def _assert_the_convolution(convolve, images, kernel):
    """convolve(images, kernel) has the outputs and gradients (of images and
    kernel) of tf.nn.conv2d's stride-1 "same" convolution, on random values
    of the shapes given."""
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=images), tf.float32)
    kernel = tf.constant(rng.normal(size=kernel), tf.float32)
    # A loss that weighs every output differently, so that an output moved
    # to another pixel or image, or a tap read from the wrong shift, would
    # change the gradients.
    weights = tf.constant(rng.normal(size=(*images.shape[:3], kernel.shape[3])), tf.float32)

    def outputs_and_gradients(convolve):
        with tf.GradientTape() as tape:
            tape.watch([images, kernel])
            outputs = convolve(images, kernel)
            loss = tf.reduce_sum(outputs * weights)
        return [outputs, *tape.gradient(loss, [images, kernel])]

    direct = outputs_and_gradients(lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"))
    for name, expected, actual in zip(("outputs", "image gradient", "kernel gradient"),
                                      direct, outputs_and_gradients(convolve)):
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4, err_msg=name)


def _convolution_ops(width, policy, channels=8):
    keras.mixed_precision.set_global_policy(policy)
    layer = SideBySideConv2D(channels, 3, padding="same", use_bias=False)
    call = tf.function(lambda x: layer(x))
    spec = tf.TensorSpec([None, width, width, channels], tf.float32)
    return [op.type for op in call.get_concrete_function(spec).graph.get_operations()]


def test_narrow_bfloat16_images_go_side_by_side_only_where_that_pays(monkeypatch):
    monkeypatch.setattr(layers, "_cpu", lambda: "amx")
    assert "Transpose" in _convolution_ops(7, "mixed_bfloat16")
    assert "Transpose" in _convolution_ops(3, "mixed_bfloat16")
    # Wider images, and float32, ran slower side by side: convolved as they are.
    assert "Transpose" not in _convolution_ops(15, "mixed_bfloat16")
    assert "Transpose" not in _convolution_ops(7, "float32")
    monkeypatch.setattr(layers, "_cpu", lambda: "")
    assert "Transpose" not in _convolution_ops(7, "mixed_bfloat16")


def test_the_layer_computes_what_keras_conv2d_computes(monkeypatch):
    monkeypatch.setattr(layers, "_cpu", lambda: "amx")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    images = np.random.default_rng(1).normal(size=(10, 7, 7, 8)).astype(np.float32)
    ours = SideBySideConv2D(16, 3, padding="same")
    theirs = keras.layers.Conv2D(16, 3, padding="same")
    ours.build(images.shape)
    theirs.build(images.shape)
    theirs.set_weights(ours.get_weights())
    np.testing.assert_allclose(np.asarray(ours(images), np.float32),
                               np.asarray(theirs(images), np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("count, width, kernel_size, channels, filters",
                         # rows (count x width^2) in 4 parts, and not
                         [(4, 7, 3, 4, 6), (5, 7, 3, 4, 6), (3, 3, 3, 8, 5), (2, 6, 5, 3, 4)])
def test_the_weight_gradient_by_taps_is_the_convolutions(count, width, kernel_size, channels,
                                                         filters):
    _assert_the_convolution(layers.convolve_with_weight_gradient_by_taps,
                            images=(count, width, width, channels),
                            kernel=(kernel_size, kernel_size, channels, filters))


def _gradient_ops(width, policy, channels=8):
    keras.mixed_precision.set_global_policy(policy)
    layer = SideBySideConv2D(channels, 3, padding="same", use_bias=False)

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            y = layer(x)
        return tape.gradient(y, layer.kernel)

    spec = tf.TensorSpec([None, width, width, channels], tf.float32)
    return [op.type for op in gradient.get_concrete_function(spec).graph.get_operations()]


def test_weight_gradients_by_taps_only_where_they_pay(monkeypatch):
    monkeypatch.setattr(layers, "_cpu", lambda: "avx512_bf16")
    for width in (7, 3):
        ops = _gradient_ops(width, "mixed_bfloat16")
        assert "BatchMatMulV2" in ops and "Conv2DBackpropFilter" not in ops
    # 15 pixels wide, and float32, ran faster with oneDNN's own kernel.
    for width, policy in ((15, "mixed_bfloat16"), (7, "float32")):
        ops = _gradient_ops(width, policy)
        assert not {"MatMul", "BatchMatMulV2"} & set(ops) and "Conv2DBackpropFilter" in ops
    monkeypatch.setattr(layers, "_cpu", lambda: "")
    assert not {"MatMul", "BatchMatMulV2"} & set(_gradient_ops(7, "mixed_bfloat16"))


def test_the_shifted_copies_of_the_taps_are_made_in_the_backward_pass_two_at_a_time():
    # Made when their inputs were, in the forward pass, the padded images and
    # their 9 shifted copies were kept until the backward pass: 0.6 GB more
    # at the peak of a cpu_cnn94_muon run on a Zen 5 EPYC (docs/performance.md).
    @tf.function
    def weight_gradient(images, output_gradient):
        return layers.weight_gradient_by_taps(images, output_gradient, (3, 3, 8, 6))

    spec = tf.TensorSpec([4, 7, 7, 8], tf.bfloat16), tf.TensorSpec([4, 7, 7, 6], tf.bfloat16)
    operations = weight_gradient.get_concrete_function(*spec).graph.get_operations()
    pad, = [op for op in operations if op.type in ("Pad", "PadV2")]
    assert _waits_for(pad) == ["output_gradient"]
    products = [op for op in operations if op.type == "BatchMatMulV2"]
    copies = [op.inputs[0].op.inputs[0].op for op in products]  # matmul <- reshape <- slice
    assert [op.type for op in copies] == ["StridedSlice"] * 9
    # Each copy after the product two taps before it.
    assert [_waits_for(op) for op in copies] == [[], []] + [[p.name] for p in products[:-2]]


def _waits_for(op):
    """The names of the ops that op, or the constants it reads, wait for
    (control inputs: TensorFlow gives them to the first ops made in a
    `tf.control_dependencies` block)."""
    return sorted({c.name for o in [op] + [i.op for i in op.inputs] for c in o.control_inputs})
