"""A compiled activation is Keras' activation, in fewer passes: the same
values and gradients, compiled by XLA where that pays, Keras' own arithmetic
elsewhere."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.core.models import faster_layers
from distributed_mpt.core.models.faster_layers import CompiledActivation, FusedBatchNormalization


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _values_and_gradients(layer, x, weights):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        # A loss that weighs every output differently: each output's own
        # gradient must be right, not only their sum.
        loss = tf.reduce_sum(tf.cast(y, weights.dtype) * weights)
    return [np.asarray(tf.cast(t, tf.float64)) for t in (y, tape.gradient(loss, x))]


@pytest.mark.parametrize("name", faster_layers.COMPILED_ACTIVATIONS)
def test_the_compiled_activation_computes_keras_activation_and_its_gradient(name):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(0.0, 3.0, (4, 5, 5, 8)), tf.float32)  # both tails and the bend
    weights = tf.constant(rng.normal(size=(4, 5, 5, 8)), tf.float32)
    expected = _values_and_gradients(keras.layers.Activation(name), x, weights)
    compiled = _values_and_gradients(CompiledActivation(name), x, weights)
    for what, e, c in zip(("values", "gradients"), expected, compiled):
        np.testing.assert_allclose(c, e, rtol=1e-6, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("name", faster_layers.COMPILED_ACTIVATIONS)
def test_in_bfloat16_the_compiled_activation_is_as_close_to_the_exact_function(name):
    # Keras rounds each of its ops to bfloat16; the compiled function
    # computes in float32 and rounds once: never further from the exact
    # values (float64) than Keras' own bfloat16 arithmetic.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    rng = np.random.default_rng(1)
    x = tf.cast(tf.constant(rng.normal(0.0, 3.0, (2048,)), tf.float32), tf.bfloat16)
    weights = tf.constant(rng.normal(size=(2048,)), tf.float32)
    exact = _values_and_gradients(keras.layers.Activation(name, dtype="float64"),
                                  tf.cast(x, tf.float64), tf.cast(weights, tf.float64))
    ours = _values_and_gradients(CompiledActivation(name), x, weights)
    theirs = _values_and_gradients(keras.layers.Activation(name), x, weights)
    for what, e, o, t in zip(("values", "gradients"), exact, ours, theirs):
        assert np.abs(o - e).max() <= np.abs(t - e).max(), what
        np.testing.assert_allclose(o, e, rtol=2e-2, atol=2e-2, err_msg=what)


def _op_types(layer):
    call = tf.function(lambda x: layer(x))
    graph = call.get_concrete_function(tf.TensorSpec([2, 3, 3, 4], tf.float32)).graph
    types, compiled = set(), False
    for op in graph.get_operations():
        types.add(op.type)
        try:
            compiled |= op.get_attr("_XlaMustCompile")
        except ValueError:
            pass
    return types, compiled


def test_compiled_only_where_it_pays(monkeypatch):
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: True)
    types, compiled = _op_types(CompiledActivation("gelu"))
    assert compiled and "Erfc" not in types  # inside the XLA function
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: False)  # GPUs
    types, compiled = _op_types(CompiledActivation("gelu"))
    assert not compiled and "Erfc" in types  # Keras' own ops


def test_an_activation_without_a_compiled_form_is_refused():
    with pytest.raises(ValueError, match="relu"):
        CompiledActivation("relu")  # TensorFlow fuses ReLU into batch norm itself


def test_after_a_fused_batch_norm_the_gradient_normalizes_again_instead_of_keeping_the_output(
        monkeypatch):
    # airbench's batch norm -> GELU in bfloat16, as the training step traces
    # it: the gradient must be the same to the bit, and no op of the
    # backward pass may read the normalized map (so it is not kept).
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: True)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(1.0, 3.0, (8, 5, 5, 16)), tf.float32)
    weights = tf.constant(rng.normal(size=(8, 5, 5, 16)), tf.float32)
    norm, activation = FusedBatchNormalization(scale=False, epsilon=1e-12), CompiledActivation("gelu")
    norm.build(x.shape)

    def gradients(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = activation(norm(tf.cast(x, tf.bfloat16), training=True))
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        return tape.gradient(loss, [x, norm.beta])

    def readers_of_the_normalized_map():
        graph = tf.function(gradients).get_concrete_function(x).graph
        normalized, = [op.outputs[0] for op in graph.get_operations()
                       if op.type == "FusedBatchNormV3" and op.get_attr("is_training")]
        return sorted(op.get_attr("f").name.split("_")[-2] for op in normalized.consumers()
                      if op.type.endswith("PartitionedCall"))

    normalized_again = [np.asarray(g) for g in tf.function(gradients)(x)]
    assert readers_of_the_normalized_map() == ["forward"]
    monkeypatch.setattr(faster_layers, "computation_of", lambda x: None)  # the map kept
    kept = [np.asarray(g) for g in tf.function(gradients)(x)]
    assert readers_of_the_normalized_map() == ["backward", "forward"]
    for what, a, b in zip(("input", "shift"), normalized_again, kept):
        assert np.abs(b).max() > 0, what
        np.testing.assert_array_equal(a, b, err_msg=what)
