"""The fused batch norm is Keras' batch norm, faster: the same outputs, moving
statistics and gradients, and saved models that hold Keras' own layer."""

import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import subprocess_env
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
from distributed_mpt.core.models.cpu_layers import FusedBatchNormalization
from distributed_mpt.training import export


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _train_once(cls, policy, scale):
    """One training call of a fresh layer of `cls` on fixed data: its
    outputs, moving statistics and the gradients of a loss that depends on
    every output (the sum of the outputs alone would have none)."""
    keras.mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(0)
    inputs = tf.constant(rng.normal(1.0, 3.0, (16, 6, 6, 8)), tf.float32)
    weights = tf.constant(rng.normal(size=(6, 6, 8)), tf.float32)
    layer = cls(momentum=0.6, epsilon=1e-12, scale=scale)
    layer.build(inputs.shape)
    layer.beta.assign(np.linspace(-1, 1, 8))
    if scale:
        layer.gamma.assign(np.linspace(0.5, 2, 8))
    with tf.GradientTape() as tape:
        x = tf.cast(inputs, layer.compute_dtype)
        tape.watch(x)
        y = tf.cast(layer(x, training=True), tf.float32)
        loss = tf.reduce_sum(y ** 3 * weights)
    gradients = tape.gradient(loss, [x, *layer.trainable_variables])
    return [y, layer.moving_mean, layer.moving_variance, *gradients]


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("policy, rtol", [("float32", 1e-4), ("mixed_bfloat16", 2e-2)])
def test_fused_batch_norm_trains_as_keras_batch_norm_does(policy, rtol, scale):
    keras_norm = _train_once(keras.layers.BatchNormalization, policy, scale)
    fused = _train_once(FusedBatchNormalization, policy, scale)
    names = ["outputs", "moving mean", "moving variance (biased, as Keras keeps it)",
             "input gradient", *(["scale gradient"] if scale else []), "shift gradient"]
    assert len(fused) == len(names)
    for name, expected, got in zip(names, keras_norm, fused):
        expected, got = np.asarray(tf.cast(expected, tf.float32)), np.asarray(tf.cast(got, tf.float32))
        scale_of = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale_of, err_msg=name)


def test_training_runs_the_fused_kernel_and_inference_keras_arithmetic():
    layer = FusedBatchNormalization(scale=False)
    layer.build([2, 4, 4, 3])

    def kernels(training):
        call = tf.function(lambda x: layer(x, training=training))
        graph = call.get_concrete_function(tf.TensorSpec([2, 4, 4, 3], tf.float32)).graph
        return {op.type for op in graph.get_operations()}

    assert "FusedBatchNormV3" in kernels(True)
    assert "FusedBatchNormV3" not in kernels(False)  # the moving statistics, as Keras does


def test_the_keras_file_holds_keras_layers_and_the_trained_function(tmp_path):
    model = models.build_model(models.model_spec("airbench"), cifar10.INFO, 8)
    # Moved statistics and shifts, so that a copy that lost them would differ.
    model(np.random.default_rng(1).integers(0, 256, (8, 32, 32, 3), np.uint8), training=True)
    for layer in model.layers:
        if isinstance(layer, FusedBatchNormalization):
            layer.beta.assign(np.linspace(-0.5, 0.5, layer.beta.shape[0]))
    export.export_model(model, str(tmp_path), cifar10.INFO.class_names, cifar10.INFO.image_shape)
    keras_file = tmp_path / "export" / "model.keras"
    with zipfile.ZipFile(keras_file) as archive:
        config = archive.read("config.json").decode()
    for ours in ("FusedBatchNormalization", "SideBySideConv2D", "CompiledActivation",
                 "WhiteningConv2D", "distributed_mpt"):
        assert ours not in config
    assert config.count('"BatchNormalization"') == 6 and config.count('"Conv2D"') == 7
    assert config.count('"softmax"') == 1, "the model computes logits; the file, probabilities"

    # Loaded where this package is not imported, as a user's Keras loads it.
    images = np.random.default_rng(2).integers(0, 256, (4, 32, 32, 3), np.uint8)
    np.save(tmp_path / "images.npy", images)
    script = ("import sys, keras, numpy as np; "
              "model = keras.models.load_model(sys.argv[1]); "
              "assert not [m for m in sys.modules if m.startswith('distributed_mpt')]; "
              "np.save(sys.argv[2], np.asarray(model(np.load(sys.argv[3]))))")
    loaded = tmp_path / "loaded.npy"
    subprocess.run([sys.executable, "-P", "-c", script, str(keras_file), str(loaded),
                    str(tmp_path / "images.npy")], check=True, env=subprocess_env(),
                   cwd=tmp_path, timeout=120)
    np.testing.assert_allclose(np.load(loaded), np.asarray(tf.nn.softmax(model(images))),
                               rtol=1e-5, atol=1e-6)
