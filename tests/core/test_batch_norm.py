"""The fused batch norm is Keras' batch norm, faster: the same outputs, moving
statistics and gradients, and saved models that hold Keras' own layer. Moving
statistics that a short run cannot have made converge are recalibrated over
training images, so that evaluation matches training."""

import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (assert_ok, assert_same_weights, checkpoint_weights, read_summary,
                      subprocess_env, train, weights_of_one_and_two_replicas)
from distributed_mpt.core import batch_norm, models
from distributed_mpt.core.data import cifar10
from distributed_mpt.core.models.faster_layers import FusedBatchNormalization
from distributed_mpt.training import outputs


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
    outputs.export_model(model, str(tmp_path), cifar10.INFO.class_names, cifar10.INFO.image_shape)
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


# --- moving statistics that a short run cannot have made converge -------------

# MobileNet's momentum (keras.applications): a run of tens of steps leaves
# the moving statistics nearly the initial ones (0.999 ** 40 = 0.96).
SLOW_STATISTICS = '''
import keras


def slow_statistics(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(images)
    x = keras.layers.Conv2D(8, 3, use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=0.999)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))
'''


def test_recalibration_sets_each_moving_statistic_to_the_mean_of_the_batches_statistics():
    model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3),
                              FusedBatchNormalization(momentum=0.999, synchronized=True),
                              keras.layers.ReLU(),
                              keras.layers.BatchNormalization(momentum=0.9, synchronized=True)])
    first, second = batch_norm.batch_norm_layers(model)
    first.beta.assign([0.5, -0.5, 1.0, 0.0])  # so that the second layer sees shifted inputs
    rng = np.random.default_rng(3)
    batches = [rng.normal(2.0, 3.0, (16, 6, 6, 3)).astype(np.float32) for _ in range(3)]
    strategy = tf.distribute.get_strategy()

    def recalibrate():
        batch_norm.recalibrate(model, strategy, iter([(b, np.zeros(16)) for b in batches]),
                               len(batches), [first, second])

    recalibrate()
    inputs = [model.layers[0](b) for b in batches]  # what the first layer normalizes
    expected = np.mean([tf.reduce_mean(x, [0, 1, 2]) for x in inputs], 0)
    np.testing.assert_allclose(first.moving_mean, expected, rtol=1e-5, atol=1e-6)
    expected = np.mean([tf.math.reduce_variance(x, [0, 1, 2]) for x in inputs], 0)
    np.testing.assert_allclose(first.moving_variance, expected, rtol=1e-5)
    # The second layer's inputs, as training computes them: the first
    # normalized with each batch's statistics.
    inputs = [tf.nn.relu(tf.nn.batch_normalization(x, *tf.nn.moments(x, [0, 1, 2]), first.beta,
                                                   first.gamma, first.epsilon)) for x in inputs]
    expected = np.mean([tf.math.reduce_variance(x, [0, 1, 2]) for x in inputs], 0)
    np.testing.assert_allclose(second.moving_variance, expected, rtol=1e-4)
    assert (first.momentum, second.momentum) == (0.999, 0.9), "the momenta are given back"

    statistics = [keras.ops.convert_to_numpy(v) for v in (first.moving_mean, second.moving_variance)]
    recalibrate()  # what a run resumed after it (a lost export) does again
    for before, after in zip(statistics, (first.moving_mean, second.moving_variance)):
        np.testing.assert_array_equal(before, after)


def test_unconverged_statistics_are_recalibrated_and_evaluation_then_matches_training(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(SLOW_STATISTICS)
    flags = ["--dataset=synthetic", "--synthetic_examples=1024", f"--model={path}:slow_statistics",
             "--per_replica_batch_size=32", "--train_steps=40", "--learning_rate=0.5",
             "--warmup_epochs=0", "--precision=float32", "--steps_per_loop=10", "--noexport"]
    kept = train([*flags, "--bn_recalibration=off", f"--model_dir={tmp_path / 'kept'}"])
    assert_ok(kept)
    assert "recalibrating" not in kept.stdout
    result = train([*flags, f"--model_dir={tmp_path / 'auto'}"])
    assert_ok(result)
    notes = [line for line in result.stdout.splitlines() if line.startswith("recalibrating")]
    assert notes[0] == ("recalibrating the moving statistics of 1 of 1 batch-norm layers over 1,024 "
                     "unaugmented training images (at momentum 0.999, 40 steps leave the initial "
                     "statistics 96% of their weight; --bn_recalibration=off keeps them)")
    before, after = read_summary(tmp_path / "kept"), read_summary(tmp_path / "auto")
    print(f"train accuracy {after['train_accuracy']:.3f}; evaluated with the moving statistics "
          f"as trained {before['eval_accuracy']:.3f}, recalibrated {after['eval_accuracy']:.3f}")
    assert before["train_accuracy"] == after["train_accuracy"] > 0.5, "the same training"
    assert before["eval_accuracy"] < after["train_accuracy"] - 0.3
    assert after["eval_accuracy"] > after["train_accuracy"] - 0.1
    assert after["bn_recalibration"] == {"layers": 1, "images": 1024}
    assert before["bn_recalibration"] is None
    # The checkpoint holds them: predict reading it, or a lost export made
    # again, evaluates as the run did.
    saved = checkpoint_weights(tmp_path / "auto")
    name = next(n for n in saved if "moving_variance" in n)
    assert not np.allclose(saved[name], checkpoint_weights(tmp_path / "kept")[name], rtol=0.1)


# --- N replicas train like one, batch norm synchronized ------------------------


def test_two_replicas_train_a_network_of_six_batch_norms_like_one(tmp_path):
    # airbench: three stages of two synchronized batch norms each. One
    # replica trains them with the fused kernel, two with Keras' all-reduced
    # E[x^2] - E[x]^2; training amplifies the round-off of either (over a
    # whole run as far as one replica on another thread count: README).
    common = ["--dataset=synthetic", "--synthetic_examples=512", "--model=airbench",
              "--model_width=4", "--train_steps=8", "--warmup_epochs=0", "--precision=float32",
              "--steps_per_loop=4", "--noevaluate", "--noexport"]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path)
    assert sum("moving_variance" in name for name in single) == 6
    assert_same_weights(mirrored, single, rtol=1e-4, atol=1e-5)
