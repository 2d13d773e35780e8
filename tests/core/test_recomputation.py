"""airbench's backward pass computes cheap maps again instead of keeping them
(faster_layers.computation_of): on CPUs, in float32, no backward op reads the
whitened map or an activation's output, and every gradient is the same to
the bit as when they are kept."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
from distributed_mpt.core.models import faster_layers


@pytest.fixture(autouse=True)
def on_a_cpu(monkeypatch):
    monkeypatch.setattr(faster_layers, "compiles_here", lambda: True)
    monkeypatch.setattr(faster_layers, "_cpu", lambda: "")  # convolutions as Keras lays them out
    yield
    keras.mixed_precision.set_global_policy("float32")


def _traced_gradients(policy):
    """airbench (width 4, seeded) under `policy`: its trainable variables'
    gradients for a fixed batch, and the graph of the traced step."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = models.build_model(models.model_spec("airbench"), cifar10.INFO, 4)
    rng = np.random.default_rng(0)
    images = tf.constant(rng.integers(0, 256, (8, 32, 32, 3)), tf.uint8)
    # Each logit weighed differently: every map's gradient must be right.
    weights = tf.constant(rng.normal(size=(8, 10)), tf.float32)

    @tf.function
    def gradients(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(images, training=True), tf.float32) * weights)
            # Every op made after this one is the backward pass's.
            loss = tf.identity(loss, name="end_of_the_forward_pass")
        return tape.gradient(loss, model.trainable_variables)

    values = [np.asarray(g) for g in gradients(images)]
    return values, gradients.get_concrete_function(images).graph


def _backward_readers_of_maps_computed_again(graph):
    """For each tensor marked as computable again (the whitened map and the
    activations' outputs), how many ops of the backward pass read it, or an
    identity of it."""
    operations = graph.get_operations()
    end = next(i for i, op in enumerate(operations) if op.name == "end_of_the_forward_pass")
    backward = {op.name for op in operations[end + 1:]}
    counts = []
    for op in operations:
        for tensor in op.outputs:
            if getattr(tensor, "_computed_again", None) is None:
                continue
            aliases, readers = [tensor], 0
            while aliases:
                alias = aliases.pop()
                for reader in alias.consumers():
                    if reader.type in ("Identity", "IdentityN"):  # input i -> output i
                        aliases += [reader.outputs[i] for i, read in enumerate(reader.inputs)
                                    if read is alias]
                    elif reader.name in backward:
                        readers += 1
            counts.append(readers)
    return counts


def _input_gradients_after_kernel_gradients(graph):
    """For each convolution's input gradient, whether it waits for a kernel
    gradient."""
    return [any(control.type == "Conv2DBackpropFilter" for control in op.control_inputs)
            for op in graph.get_operations() if op.type == "Conv2DBackpropInput"]


def test_in_float32_the_backward_pass_keeps_no_map_it_can_compute_again(monkeypatch):
    again, graph = _traced_gradients("float32")
    # The whitened map, the stem's activation, then 6 batch norms' outputs,
    # each followed by its activation's. The last activation's output the
    # global pooling's gradient reads (a 3x3 map): the check sees readers.
    assert _backward_readers_of_maps_computed_again(graph) == [0] * 13 + [1]
    # Each input's gradient is made after its kernel's, once the copy the
    # kernel's gradient computed again is let go (the stem's: 142 MB at
    # batch 1536), where the convolution computes its input again.
    # (The 7th is the whitening convolution's, which nothing reads.)
    assert sorted(_input_gradients_after_kernel_gradients(graph)) == [False] + [True] * 6
    monkeypatch.setattr(faster_layers, "computation_of", lambda x: None)  # the maps kept
    kept, graph = _traced_gradients("float32")
    assert not any(_input_gradients_after_kernel_gradients(graph))
    # The activations' outputs are no longer marked; each activation's
    # gradient reads its input, the whitened map or a batch norm's output.
    assert _backward_readers_of_maps_computed_again(graph) == [1] * 7
    assert len(again) == len(kept) == len(tf.nest.flatten(again))
    for index, (a, k) in enumerate(zip(again, kept)):
        assert np.abs(k).max() > 0, index
        np.testing.assert_array_equal(a, k, err_msg=f"trainable variable {index}")


def test_in_bfloat16_only_the_activations_after_batch_norms_compute_their_input_again(monkeypatch):
    # The convolutions keep their bfloat16 inputs, and the stem its whitened
    # map (memory is not short there; and whitened again, the map was not
    # the same bits in a training step): only the activations' own gradients
    # normalize again. The same gradients to the bit as when kept.
    again, graph = _traced_gradients("mixed_bfloat16")
    readers = _backward_readers_of_maps_computed_again(graph)
    # 6 batch norms' outputs, not read, each followed by its activation's,
    # read by the convolution (or the pooling) after it.
    assert len(readers) == 12 and readers[0::2] == [0] * 6, readers
    assert all(count > 0 for count in readers[1::2]), readers
    monkeypatch.setattr(faster_layers, "computation_of", lambda x: None)
    kept, _ = _traced_gradients("mixed_bfloat16")
    for index, (a, k) in enumerate(zip(again, kept)):
        np.testing.assert_array_equal(a, k, err_msg=f"trainable variable {index}")
