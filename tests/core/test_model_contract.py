"""The contract a user's model is held to (core/models/contract.py), through
the real training entry point with tiny model files: a final softmax in any
of its forms dropped with one note, floats fed 0-255 only to a model that
rescales them, and model code that ends the program, interrupts it, has
nothing to train, does not compile into a training step or fails in the
first step refused with one `error:` line, exit 2 and nothing left."""

import os
import re
import signal
import time

import pytest

from conftest import SMOKE_FLAGS, WatchedProcess, assert_ok, assert_one_error_line, train
from distributed_mpt.errors import ExitCode

MODELS = '''
import os
import signal
import time
import sys

import keras
import numpy as np


def _flat(info, dtype="uint8"):
    images = keras.Input(info.image_shape, dtype=dtype)
    return images, keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))


def removes_the_working_directory(info):  # as a library's scratch directory, made and removed
    here = os.getcwd()
    os.chdir(os.path.dirname(here))
    os.rmdir(here)
    return _flat_model(info)


def closes_its_event_loop(info):  # asyncio's, which stops waking a descriptor when it closes
    signal.set_wakeup_fd(-1)
    return _flat_model(info)


def arms_an_alarm(info):  # as a library's time-out left armed
    signal.alarm(3)
    return _flat_model(info)


def runs_functions_eagerly(info):  # a debugging line left in
    import tensorflow as tf
    tf.config.run_functions_eagerly(True)
    return _flat_model(info)


def _flat_model(info):
    images, x = _flat(info)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def softmax_layer(info):
    images, x = _flat(info)
    return keras.Model(images, keras.layers.Softmax()(keras.layers.Dense(info.num_classes)(x)))


def softmax_activation(info):
    images, x = _flat(info)
    logits = keras.layers.Dense(info.num_classes)(x)
    return keras.Model(images, keras.layers.Activation("softmax")(logits))


def softmax_dense(info):
    images, x = _flat(info)
    return keras.Model(images, keras.layers.Dense(info.num_classes, activation="softmax")(x))


def softmax_sequential(info):
    return keras.Sequential([keras.Input(info.image_shape, dtype="uint8"),
                             keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
                             keras.layers.Dense(info.num_classes), keras.layers.Softmax()])


class Subclassed(keras.Model):
    def __init__(self, classes):
        super().__init__()
        self.dense = keras.layers.Dense(classes)

    def call(self, images):
        x = keras.ops.reshape(keras.ops.cast(images, "float32") / 255, (-1, 32 * 32 * 3))
        return keras.ops.softmax(self.dense(x))


def softmax_subclassed(info):
    return Subclassed(info.num_classes)


def float_unscaled(info):
    images = keras.Input(info.image_shape)  # float32, Keras' default
    return keras.Model(images, keras.layers.Dense(info.num_classes)(keras.layers.Flatten()(images)))


def float_rescaled(info):
    images, x = _flat(info, dtype="float32")
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def float_divided(info):
    images = keras.Input(info.image_shape)
    x = keras.layers.Flatten()(keras.layers.ZeroPadding2D()(images) / 255.0)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def mobilenet(info, preprocessing):
    return keras.applications.MobileNetV3Small(
        input_shape=info.image_shape, alpha=0.75, minimalistic=True, weights=None,
        classes=info.num_classes, include_preprocessing=preprocessing)


def mobilenet_preprocessing(info):
    return mobilenet(info, True)


def mobilenet_without_preprocessing(info):
    return mobilenet(info, False)


class Convolutions(keras.Model):
    def __init__(self, classes):
        super().__init__()
        self.convolution = keras.layers.Conv2D(4, 3)
        self.dense = keras.layers.Dense(classes)

    def call(self, images):
        return self.dense(keras.ops.mean(self.convolution(images), axis=(1, 2)))


def convolves_uint8(info):
    return Convolutions(info.num_classes)


def asserts_on_its_logits(info):  # takes uint8 well; its own check fails on any images
    import tensorflow as tf

    images, x = _flat(info)
    logits = keras.layers.Dense(info.num_classes)(x)

    def checked(t):
        tf.debugging.assert_less(tf.reduce_max(t), -1e9, message="logits out of range")
        return t

    return keras.Model(images, keras.layers.Lambda(checked)(logits))


def frozen(info):
    images, x = _flat(info)
    dense = keras.layers.Dense(info.num_classes)
    dense.trainable = False
    return keras.Model(images, dense(x))


class NumpyInCall(keras.Model):
    """Runs when called eagerly, as the probe call is; not in a graph."""

    def __init__(self, classes):
        super().__init__()
        self.dense = keras.layers.Dense(classes)

    def call(self, images):
        x = keras.ops.mean(keras.ops.cast(images, "float32") / 255, axis=(1, 2))
        return self.dense(x * float(np.asarray(keras.ops.max(x))))


def numpy_in_call(info):
    return NumpyInCall(info.num_classes)


class BatchOfTwo(NumpyInCall):
    """Takes the probe call's batch of 2 images, and no other."""

    def call(self, images):
        x = keras.ops.mean(keras.ops.cast(images, "float32") / 255, axis=(1, 2))
        return self.dense(keras.ops.reshape(x, (2, -1)))


def batch_of_two(info):
    return BatchOfTwo(info.num_classes)


class GhostBatches(NumpyInCall):
    """Centres each virtual batch of 2 images (as ghost batch norm takes its
    statistics): any even batch, the probe's and the run's of 32."""

    def call(self, images):
        x = keras.ops.mean(keras.ops.cast(images, "float32") / 255, axis=(1, 2))
        ghosts = keras.ops.reshape(x, (-1, 2, 3))
        return self.dense(keras.ops.reshape(ghosts - keras.ops.mean(ghosts, 1, keepdims=True),
                                            (-1, 3)))


def ghost_batches(info):
    return GhostBatches(info.num_classes)


class AssertsInTraining(NumpyInCall):
    """Checks its batch only as it trains, and only when the step runs: an
    assertion, as a kernel missing for a dtype, that no trace can find."""

    def call(self, images, training=False):
        x = keras.ops.mean(keras.ops.cast(images, "float32") / 255, axis=(1, 2))
        if training:
            import tensorflow as tf
            tf.debugging.assert_equal(tf.shape(x)[0] % 3, 0, message="a batch of 3s, please")
        return self.dense(x)


def asserts_in_training(info):
    return AssertsInTraining(info.num_classes)


class FailsInTheStep(NumpyInCall):
    """Trains once, in the contract's trace; its second training call, the
    run's step, which autograph converts, raises."""

    def call(self, images, training=False):
        self.trained = getattr(self, "trained", 0) + training
        if self.trained > 1:
            raise TypeError("trains only once, " + "and " * 100)
        return self.dense(keras.ops.mean(keras.ops.cast(images, "float32"), axis=(1, 2)))


def fails_in_the_step(info):
    return FailsInTheStep(info.num_classes)


class FailsInItsThirdTrace(NumpyInCall):
    """Traced for training by the contract, then at the early crops' size
    for the first steps; its third trace, at the whole images' size, raises."""

    def call(self, images, training=False):
        self.traced = getattr(self, "traced", 0) + training
        if self.traced > 2:
            raise TypeError("no whole images after crops")
        return self.dense(keras.ops.mean(keras.ops.cast(images, "float32"), axis=(1, 2)))


def fails_in_its_third_trace(info):
    return FailsInItsThirdTrace(info.num_classes)


class FailsInEvaluation(keras.layers.Layer):
    """Passes the contract's probe (2 images) and training step; its inference call at
    the evaluation's batch fails, as a branch of its own for test time may."""

    def call(self, images, training=False):
        if not training:
            import tensorflow as tf
            tf.debugging.assert_less_equal(tf.shape(images)[0], 2, message="2 at test time")
        return images


def fails_in_evaluation(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(FailsInEvaluation()(images)))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


class FailsAtStepThree(keras.layers.Layer):
    """Counts its training calls that run, and asserts on the count: the
    first two steps pass, the third fails, as a check on later batches may."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                     trainable=False, name="calls")

    def call(self, x, training=False):
        if training:
            import tensorflow as tf
            self.calls.assign_add(1)
            tf.debugging.assert_less(self.calls, 3, message="fails at step three")
        return x


def fails_at_step_three(info):
    images, x = _flat(info)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(FailsAtStepThree()(x)))


class CountsOut(keras.layers.Layer):
    """Python run in the graph (tf.numpy_function) that raises from its
    4th call on: after the probes and the first steps that ran it."""

    def call(self, x):
        import tensorflow as tf

        def count(values, calls=[]):
            calls.append(1)
            if len(calls) >= 4:
                raise RuntimeError("counted out")
            return values
        return tf.ensure_shape(tf.numpy_function(count, [x], x.dtype), x.shape)


def counts_out(info):
    images, x = _flat(info)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(CountsOut(name="counts")(x)))


def fails_at_step_three_with_jitter(info):  # its normalize layer, where the jitter goes in
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Normalization(mean=0.0, variance=1.0, name="normalize")(images)
    x = FailsAtStepThree(name="norm")(keras.layers.Flatten()(x))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x), name="mine")


def fails_at_step_three_with_batch_norm(info):  # Keras' momentum: recalibrated after 2 steps
    images, x = _flat(info)
    x = keras.layers.BatchNormalization()(FailsAtStepThree()(x))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def integer_logits(info):
    images, x = _flat(info)
    logits = keras.layers.Dense(info.num_classes)(x)
    return keras.Model(images, keras.ops.cast(100 * logits, "int32"))


class Composite(keras.Model):  # logits as a tensor that is not dense
    def __init__(self, classes, make):
        super().__init__()
        self.make, self.flat, self.dense = make, keras.layers.Flatten(), keras.layers.Dense(classes)

    def call(self, images, training=False):
        return self.make(self.dense(self.flat(keras.ops.cast(images, "float32") / 255)))


def sparse_logits(info):
    import tensorflow as tf
    return Composite(info.num_classes, tf.sparse.from_dense)


def ragged_logits(info):
    import tensorflow as tf
    return Composite(info.num_classes, tf.RaggedTensor.from_tensor)


def stopped_gradient(info):
    images, x = _flat(info)
    return keras.Model(images, keras.ops.stop_gradient(keras.layers.Dense(info.num_classes)(x)))


def exits(info):
    sys.exit(0)


def exits_at_once(info):
    os._exit(0)


def interrupts(info):
    raise KeyboardInterrupt


def disables_eager(info):
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    return _flat_model(info)


def clears_session(info):
    keras.backend.clear_session()
    return _flat_model(info)


def closes_stdout(info):
    sys.stdout.close()
    return _flat_model(info)


def closes_stderr(info):
    sys.stderr.close()
    return _flat_model(info)


def replaces_stdout(info):  # to hear a library's prints, and forgets to put it back
    import io
    sys.stdout = io.StringIO()
    return _flat_model(info)


def drops_stderr_and_fails(info):  # as code written for pythonw does
    sys.stderr = None
    raise ValueError("no model today")


def closes_descriptor_1(info):  # as a library that makes itself a daemon does
    os.close(1)
    return _flat_model(info)


class Unsayable(Exception):
    def __str__(self):
        raise RuntimeError("its own __str__ fails")


def unsayable(info):
    raise Unsayable
'''
FLAGS = ["--dataset=synthetic", "--synthetic_examples=256", "--per_replica_batch_size=32",
         "--precision=float32", "--warmup_epochs=0", "--noevaluate", "--noexport",
         "--train_steps=2", "--steps_per_loop=2", "--log_every_steps=2"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "contract_models.py"
    path.write_text(MODELS)
    return path


@pytest.mark.parametrize("function, dropped", [
    ("softmax_layer", "its last layer, Softmax"),
    ("softmax_activation", "the softmax activation of its last layer, Activation"),
    ("softmax_dense", "the softmax activation of its last layer, Dense"),
    ("softmax_sequential", "its last layer, Softmax"),
])
def test_a_final_softmax_in_any_form_is_dropped_with_one_note(model_file, tmp_path, function,
                                                              dropped):
    result = train([*FLAGS, f"--model={model_file}:{function}", f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    notes = [line for line in result.stdout.splitlines() if "ends in a softmax" in line]
    assert len(notes) == 1 and dropped in notes[0], result.stdout
    assert "export adds it back" in notes[0]
    assert "Received: inputs" not in result.stderr, "no Keras warning of the cut model's call"


UNSCALED = "unscaled: this package gives every model pixels 0-255, not 0-1. Rescale them first"


@pytest.mark.parametrize("function, fragment", [
    ("softmax_subclassed", "from its call(): a subclassed model's softmax is code, which cannot "
                           "be dropped as a final softmax layer is: return logits"),
    ("float_unscaled", "takes its images as float32 and gives them to Dense 'dense"),
    ("mobilenet_without_preprocessing", "takes its images as float32 and gives them to Conv2D"),
    ("frozen", "has no trainable weights (2 frozen): there is nothing to train"),
    # What works in the eager probe call of 2 images, but not in the step,
    # which is a graph at the training batch: refused before it is compiled.
    ("numpy_in_call", "failed when compiled into a training step on 32 uint8 images [32, 32, 3], "
                      "as a graph (a tf.function) (NotImplementedError in NumpyInCall.call(): "
                      "Cannot convert a symbolic tf.Tensor"),
    ("batch_of_two", "failed when compiled into a training step on 32 uint8 images"),
    ("integer_logits", "returns int32, not floating-point logits"),
    # Their shape and dtype pass, and reading their values raised: a traceback, exit 1.
    ("sparse_logits", "returns a SparseTensor, not one dense tensor"),
    ("ragged_logits", "returns a RaggedTensor, not one dense tensor"),
    # What only running finds: its files are made, and removed with it.
    ("asserts_in_training", "failed in the run's first training step (InvalidArgumentError: "
                            "assertion failed: [a batch of 3s, please]"),
    ("stopped_gradient", "no gradient reaches its weights from its logits"),
])
def test_a_model_that_breaks_the_contract_says_why_and_leaves_nothing(model_file, tmp_path,
                                                                     function, fragment):
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:{function}", f"--model_dir={run}"])
    assert_one_error_line(result, fragment)
    if "gives them to" in fragment:  # the layer's name is numbered per process: dense_2
        assert UNSCALED in result.stderr
    assert not run.exists(), "refused before any file was written, or they went with it"


def test_a_model_failing_in_the_first_step_on_two_replicas_is_named_in_one_line(model_file,
                                                                                tmp_path):
    """Two replicas' errors come as a count of root errors; TensorFlow's
    node lines after its warnings stay off the console."""
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:asserts_in_training", f"--model_dir={run}",
                    "--strategy=mirrored", "--cpu_replicas=2"])
    assert_one_error_line(result, "failed in the run's first training step (InvalidArgumentError: "
                                  "assertion failed: [a batch of 3s, please]")
    assert "\t [[" not in result.stderr
    assert not run.exists()


def test_a_model_failing_in_the_evaluation_is_one_error_line_and_keeps_its_checkpoints(
        model_file, tmp_path):
    """Its inference call, first run in the evaluation: a traceback, exit 1."""
    run, model = tmp_path / "run", f"--model={model_file}:fails_in_evaluation"
    result = train([*FLAGS, model, f"--model_dir={run}", "--evaluate"])
    assert_one_error_line(result, "failed in an evaluation on the test images; its checkpoints "
                                  "are kept: run again with --noevaluate to go on (a change "
                                  "to the model's source makes another network: it trains "
                                  "anew, in another --model_dir) "
                                  "(InvalidArgumentError: assertion failed: [2 at test time]")
    assert (run / "checkpoints" / "ckpt-2.index").is_file()
    result = train([*FLAGS, model, f"--model_dir={run}"])
    assert_ok(result)
    assert "resuming from step 2" in result.stdout


def test_a_python_error_in_the_first_step_is_named_with_its_line(model_file, tmp_path):
    """Autograph, which converts the step, had put "in user code:" first:
    all the line said was "(TypeError: in user code:)"."""
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:fails_in_the_step", f"--model_dir={run}"])
    raising = '            raise TypeError("trains only once, " + "and " * 100)'
    line = 1 + MODELS.splitlines().index(raising)  # a message too long to show whole
    assert_one_error_line(result, f"failed in the run's first training step (TypeError at "
                                  f"{model_file}:{line} in FailsInTheStep.call(): trains only "
                                  f"once, {'and ' * 5}")
    assert not run.exists()


def test_a_model_failing_in_a_later_training_step_is_named_in_one_line(model_file, tmp_path):
    """Its third step, after the first had run and a checkpoint was saved:
    a traceback, exit 1, that said nothing of whose error it was. Its
    checkpoint stays; a resume from it meets the same line."""
    run, model = tmp_path / "run", f"--model={model_file}:fails_at_step_three"
    for _ in range(2):  # the second resumes from step 2, in the same --model_dir
        result = train([*FLAGS, model, f"--model_dir={run}", "--train_steps=6",
                        "--checkpoint_every_steps=2"])
        assert_one_error_line(result, "fails_at_step_three failed in training step")
        line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
        assert "(InvalidArgumentError: assertion failed: [fails at step three]" in line, line
        assert line.endswith("; the run's checkpoints are kept, the latest of step 2"), line
        assert sorted(path.name for path in (run / "checkpoints").glob("ckpt-*.index")) == \
            ["ckpt-2.index"]
    assert "resuming from step 2" in result.stdout


def test_a_model_failing_in_a_later_step_with_color_jitter_is_named_in_one_line(model_file,
                                                                               tmp_path):
    """With jitter the step calls the part of the model after its
    normalize layer, a model cut from it: the model's all the same."""
    result = train([*FLAGS, f"--model={model_file}:fails_at_step_three_with_jitter",
                    f"--model_dir={tmp_path / 'run'}", "--train_steps=4",
                    "--brightness_jitter=0.1"])
    assert_one_error_line(result, "fails_at_step_three_with_jitter failed in training steps 3-4")


def test_a_models_python_failing_in_its_graph_in_a_later_step_is_named_in_one_line(
        model_file, tmp_path):
    """What a tf.numpy_function of its raises reaches the step as TensorFlow's
    UnknownError, which names no model in itself: it was a traceback, exit 1."""
    result = train([*FLAGS, f"--model={model_file}:counts_out",
                    f"--model_dir={tmp_path / 'run'}", "--train_steps=8"])
    assert_one_error_line(result, "counts_out failed in training step")
    assert "(UnknownError: RuntimeError: counted out" in result.stderr, result.stderr


def test_a_model_whose_code_fails_traced_anew_later_is_named_with_its_line(model_file,
                                                                          tmp_path):
    """Its Python code, traced again where the early crops end (step 9)."""
    result = train([*FLAGS, f"--model={model_file}:fails_in_its_third_trace",
                    f"--model_dir={tmp_path / 'run'}", "--train_steps=16",
                    "--early_crop_size=24", "--early_crop_epochs=1"])
    line = 1 + MODELS.splitlines().index('            raise TypeError("no whole images after '
                                         'crops")')
    assert_one_error_line(result, "fails_in_its_third_trace failed in training step")
    assert f"(TypeError at {model_file}:{line} in FailsInItsThirdTrace.call(): no whole images " \
           f"after crops); no checkpoint was saved yet" in result.stderr


def test_a_model_failing_in_the_batch_norm_recalibration_is_named_in_one_line(model_file,
                                                                             tmp_path):
    """Its training-mode call, in the forward passes over training images
    after the last step: a traceback, exit 1. Its checkpoint is kept, and a
    run again without the recalibration finishes."""
    run, model = tmp_path / "run", f"--model={model_file}:fails_at_step_three_with_batch_norm"
    result = train([*FLAGS, model, f"--model_dir={run}"])
    assert_one_error_line(result, "failed in the batch-norm recalibration after training "
                                  "(InvalidArgumentError: assertion failed: [fails at step three]")
    line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert "; the run's checkpoints are kept, the latest of step 2: run again with " \
           "--bn_recalibration=off to finish" in line and "{{function_node" not in line, line
    assert (run / "checkpoints" / "ckpt-2.index").is_file()
    result = train([*FLAGS, model, f"--model_dir={run}", "--bn_recalibration=off"])
    assert_ok(result)
    assert "nothing is left to train" in result.stdout


def test_only_an_error_inside_the_users_model_is_blamed_on_it():
    """A later step's op that fails outside the model's name scope (the
    package's loss, its optimizer) stays the package's: not named as the model's."""
    import keras
    import tensorflow as tf

    from distributed_mpt.core.models.blame import is_the_models

    images = keras.Input((4,))
    model = keras.Model(images, keras.layers.Dense(2, name="logits")(images), name="mine")

    def failed(node):
        return tf.errors.InvalidArgumentError(None, None, f"assertion failed\n\t [[{{{{node "
                                                          f"{node}}}}}]] [Op:__inference_x]")

    assert is_the_models(failed("while/cond_1/mine/logits/MatMul"), model)
    assert is_the_models(failed("gradient_tape/while/mine_1/logits_1/Assert/Assert"), model)
    assert not is_the_models(failed("while/cond_1/categorical_crossentropy/Assert/Assert"), model)
    assert not is_the_models(failed("while/cond_1/logits"), model), "an op, not a scope, named so"
    assert is_the_models(failed("while/cond_1/replica_1/mine_2/logits/Assert/Assert"), model)
    assert is_the_models(failed("mine/logits/Assert/Assert"), model), "the recalibration's call"
    # A package's scope named as one of the model's layers, or as the model,
    # is the package's: only the model's own scope, opened by the step, is its.
    norm = keras.Model(images, keras.layers.LayerNormalization(name="norm")(images), name="norm")
    for package in ("while/cond/cond/grouped/update/norm/Sqrt", "update_3/norm/transpose/x",
                    "while/cond_1/categorical_crossentropy/norm/Assert/Assert"):
        assert not is_the_models(failed(package), norm), package
        assert not is_the_models(failed(package.replace("norm", "logits")), model), package
    assert is_the_models(failed("while/cond_1/norm_1/norm/Sqrt"), norm)
    assert not is_the_models(ValueError("a bug of the package's own"), model)

    class Unsayable(Exception):
        def __str__(self):
            raise RuntimeError("its own __str__ fails")

    assert not is_the_models(Unsayable(), model), "and no error of its own"


@pytest.mark.parametrize("function", ["float_rescaled", "float_divided", pytest.param(
    "mobilenet_preprocessing", marks=pytest.mark.slow)])  # 1.5 min under load
def test_float_input_that_the_model_rescales_itself_trains(model_file, tmp_path, function):
    """0-255 as floats is what these expect: a Rescaling layer, arithmetic
    on the input after a padding, and keras.applications' own preprocessing."""
    assert_ok(train([*FLAGS, f"--model={model_file}:{function}",
                     f"--model_dir={tmp_path / 'run'}"]))


def test_a_model_that_needs_its_batch_in_pairs_is_traced_at_the_runs_batch_and_trains(
        model_file, tmp_path):
    # Traced at 3 images, it was refused; the run's batch is what runs.
    assert_ok(train([*FLAGS, f"--model={model_file}:ghost_batches",
                     f"--model_dir={tmp_path / 'run'}"]))


def test_a_model_that_cannot_take_uint8_says_why_in_one_whole_line(model_file, tmp_path):
    result = train([*FLAGS, f"--model={model_file}:convolves_uint8",
                    f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "failed when called on two uint8 images [32, 32, 3], 0-255")
    line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    # What Keras said, from inside its "Exception encountered when calling"
    # wrapper, and the fix after it: the line ends as a sentence ends.
    assert "(ValueError in Conv2D.call(): Incompatible type conversion requested" in line
    assert line.endswith("(keras.layers.Rescaling(1 / 255) does both)"), line


def test_a_model_whose_own_check_fails_is_not_said_to_refuse_uint8(model_file, tmp_path):
    """Its call raised on the probe's two images for a reason of its own: the
    line names that reason, and does not blame the input it takes well."""
    result = train([*FLAGS, f"--model={model_file}:asserts_on_its_logits",
                    f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "failed when called on two uint8 images [32, 32, 3], 0-255")
    line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert "logits out of range" in line and "does not take uint8" not in line, line


@pytest.mark.parametrize("function, fragment", [
    ("exits", "failed to build its model (it called sys.exit(0), which would end the run as if "
              "it had finished"),
    # Exit 0, nothing trained nor said, before.
    ("exits_at_once", "failed to build its model (it called os._exit(0), which would end the "
                      "run as if it had finished"),
    ("interrupts", "failed to build its model (KeyboardInterrupt, raised by the model's own code"),
    # Its message's own code failed: a traceback, before.
    ("unsayable", "failed to build its model (Unsayable: Unsayable (whose message cannot be "
                  "shown))"),
])
def test_a_model_function_that_ends_the_program_is_one_error_line(model_file, tmp_path, function,
                                                                 fragment):
    run = tmp_path / "run"
    # A process of its own: its exit status is what a launcher acts on.
    result = train([*FLAGS, f"--model={model_file}:{function}", f"--model_dir={run}"],
                   timeout=300)
    assert_one_error_line(result, fragment)
    assert not run.exists()


@pytest.mark.parametrize("function, fragment, flags", [
    # Each was a traceback, exit 1: the probe call on a symbolic tensor;
    # "IndexError: pop from empty list" as the strategy's scope ended; the
    # next progress line; "lost sys.stderr", with the run's files left.
    ("disables_eager", "turned off eager execution (tf.compat.v1.disable_eager_execution() or "
                       "disable_v2_behavior()), which TensorFlow cannot turn on again", []),
    ("clears_session", "reset TensorFlow's default graph (keras.backend.clear_session() or "
                       "tf.compat.v1.reset_default_graph() does), which ended the scope of the "
                       "run's MirroredStrategy: the variables made after it would not be "
                       "mirrored across its 2 replicas",
     ["--strategy=mirrored", "--cpu_replicas=2"]),
    ("closes_stdout", "closed sys.stdout, to which the run writes its progress lines: remove "
                      "that call (contextlib.redirect_stdout", []),
    ("closes_stderr", "closed sys.stderr, to which the run writes its warnings and errors", []),
    # The next file opened took descriptor 1: the progress lines went into
    # TensorBoard's events file, exit 0.
    ("closes_descriptor_1", "closed or replaced file descriptor 1 (stdout), to which the run "
                            "writes its progress lines: remove that call", []),
])
def test_a_model_that_breaks_what_cannot_be_set_back_is_one_error_line(model_file, tmp_path,
                                                                      function, fragment, flags):
    run = tmp_path / "run"
    # A process of its own: what the model breaks is the process's, and the
    # console's streams are the console script's.
    result = train([*FLAGS, *flags, f"--model={model_file}:{function}", f"--model_dir={run}"],
                   timeout=300)
    assert_one_error_line(result, fragment)
    assert not run.exists()


def test_a_stream_a_model_replaces_is_set_back_with_a_warning(model_file, tmp_path):
    """sys.stdout replaced by an io.StringIO: exit 0, every progress line
    lost without a word."""
    result = train([*FLAGS, f"--model={model_file}:replaces_stdout",
                    f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    assert re.search(r"^step +2/2", result.stdout, re.M), result.stdout
    assert "changed sys.stdout, which the run relies on: set back" in result.stderr


def test_a_model_that_runs_tf_functions_eagerly_trains_compiled_with_a_warning(model_file,
                                                                               tmp_path):
    """tf.config.run_functions_eagerly(True) in a model function: the run's
    compiled steps ran eagerly, 4.3 times slower (a small CNN, 2 cores of a Zen 5
    AMD EPYC with AVX512_BF16), without a word."""
    import tensorflow as tf

    try:
        result = train([*FLAGS, f"--model={model_file}:runs_functions_eagerly",
                        f"--model_dir={tmp_path / 'run'}"])
        eagerly = tf.config.functions_run_eagerly()
    finally:
        tf.config.run_functions_eagerly(False)
    assert_ok(result)
    assert "changed whether tf.functions run eagerly (tf.config.run_functions_eagerly), which " \
           "the run relies on: set back" in result.stderr
    assert not eagerly, "the steps ran eagerly"
    assert "run_functions_eagerly` option is set" not in result.stderr, "tf.data's warning of it"


def test_a_model_that_drops_stderr_and_fails_says_so_on_stderr(model_file, tmp_path):
    """sys.stderr = None, then an error: the error line went to stdout,
    exit 1, as for a traceback."""
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:drops_stderr_and_fails", f"--model_dir={run}"])
    assert_one_error_line(result, "failed to build its model (ValueError: no model today)")
    assert "changed sys.stderr, which the run relies on: set back" in result.stderr
    assert "error:" not in result.stdout
    assert not run.exists()


def test_a_model_file_whose_module_getattr_raises_is_one_error_line(tmp_path):
    # A module's __getattr__ answers for a name it does not define: code too.
    source = tmp_path / "lazy.py"
    source.write_text("def __getattr__(name):\n    raise RuntimeError(f'no {name} yet')\n")
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={source}:net", f"--model_dir={run}"])
    assert_one_error_line(result, "does not import (RuntimeError: no net yet)")
    assert not run.exists()


def test_what_a_model_changes_of_the_process_is_set_back(tmp_path, capfd):
    """A model function that ignored SIGTERM and Ctrl-C (as some libraries
    do) left a run that only SIGKILL stopped, without a checkpoint; one that
    changed the working directory broke a relative --model_dir."""
    import os
    import signal

    from distributed_mpt.core.models.contract import users_code

    cwd, handlers = os.getcwd(), [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        with users_code("m.py:net", "failed to build its model"):
            os.chdir(tmp_path)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert os.getcwd() == cwd
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    warnings = [line for line in capfd.readouterr().err.splitlines() if "--model=" in line]
    assert warnings == [
        "warning: --model=m.py:net changed the working directory and the handlers of stop "
        "signals, which the run relies on: set back"]


def test_a_working_directory_that_cannot_be_set_back_is_refused(model_file, tmp_path,
                                                                 monkeypatch):
    """The model removed the directory the run was started from: it was
    'set back', said the warning, and the run went on elsewhere, where a
    relative --model_dir would have led."""
    started_in = tmp_path / "scratch"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:removes_the_working_directory",
                    f"--model_dir={run}"])
    assert_one_error_line(result, f"changed the working directory, which the run relies on, "
                                  f"and it cannot be set back ({started_in}: No such file or "
                                  f"directory): relative paths would lead elsewhere")
    assert "set back" not in result.stderr.replace("cannot be set back", "")
    assert not run.exists()


def test_a_models_wakeup_descriptor_is_set_back_and_a_stop_still_stops_the_run(model_file,
                                                                                tmp_path):
    """A model function that stopped the signals waking the run's stop
    handling (as asyncio's loop does when it closes) left a run that
    SIGTERM and Ctrl-C could not stop: only SIGKILL, without a checkpoint."""
    run = WatchedProcess("distributed_mpt.train", [
        *SMOKE_FLAGS, f"--model={model_file}:closes_its_event_loop", "--train_steps=100000",
        f"--model_dir={tmp_path / 'run'}"])
    run.wait_for(r"^step +\d+/100000", timeout=300)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == ExitCode.PREEMPTED, run.output()[-3000:]
    assert "changed the descriptor that signals wake (signal.set_wakeup_fd), which the run " \
           "relies on: set back" in run.output()
    assert re.search(r"stopped by a signal at step \d+; checkpoint saved", run.output())


def test_an_alarm_a_model_arms_is_disarmed_and_the_run_outlives_it(model_file, tmp_path):
    """SIGALRM killed the run 3 s after the model function returned, with
    no line and the exit status of a peer's time-out (142), all training lost."""
    run = WatchedProcess("distributed_mpt.train", [
        *SMOKE_FLAGS, f"--model={model_file}:arms_an_alarm", "--train_steps=100000",
        f"--model_dir={tmp_path / 'run'}"])
    run.wait_for(r"^step +\d+/100000", timeout=300)
    time.sleep(6)  # twice the alarm's time, which it was set to before the first step
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == ExitCode.PREEMPTED, run.output()[-3000:]
    assert re.search(r"stopped by a signal at step \d+; checkpoint saved", run.output())
    assert "changed the real-time timer (signal.alarm or signal.setitimer(signal.ITIMER_REAL)), " \
           "which the run relies on: set back" in run.output()


def test_a_wakeup_descriptor_that_cannot_be_set_back_is_refused():
    from distributed_mpt.core.models.contract import ModelError, users_code

    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    try:
        with pytest.raises(ModelError, match=r"changed the descriptor that signals wake "
                                             r"\(signal.set_wakeup_fd\), which the run relies on, "
                                             r"and it cannot be set back \(.*\): a stop signal "
                                             r"would not stop it with a checkpoint"):
            with users_code("m.py:net", "failed to build its model"):
                signal.set_wakeup_fd(-1)
                os.close(write)  # the run's own, closed by the model
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)


def test_a_model_that_sets_the_precision_policy_itself_is_refused(tmp_path):
    """It trained in float16 without loss scaling, while config.json and
    the export said float32."""
    source = tmp_path / "policy.py"
    source.write_text("import keras\n\ndef net(info):\n"
                      "    keras.mixed_precision.set_global_policy('mixed_float16')\n"
                      "    images = keras.Input(info.image_shape, dtype='uint8')\n"
                      "    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))\n"
                      "    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))\n")
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--model={source}:net", f"--model_dir={run}"]),
                          "sets the mixed-precision policy itself (mixed_float16)")
    assert not run.exists()


def test_the_policy_a_model_sets_is_set_back_and_refused():
    import keras

    from distributed_mpt.core.models.contract import ModelError, users_code

    with pytest.raises(ModelError, match=r"\(float64\).*pass --precision \(auto, "):
        with users_code("m.py:net", "failed to build its model"):
            keras.mixed_precision.set_global_policy("float64")
    assert keras.mixed_precision.global_policy().name == "float32", "set back"


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its parent (the
    run, or whatever adopted it) has not reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_process_the_model_forks_ends_and_leaves_the_run_to_its_parent(tmp_path):
    """The forked child returned from the model function and trained too,
    then hung for ever as an orphan holding the --model_dir lock: every
    later run on that directory was refused, exit 144."""
    forked = tmp_path / "forked"
    source = tmp_path / "forks.py"
    source.write_text("import os\nimport keras\n\ndef net(info):\n"
                      "    images = keras.Input(info.image_shape, dtype='uint8')\n"
                      "    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))\n"
                      "    model = keras.Model(images, keras.layers.Dense(info.num_classes)(x))\n"
                      "    child = os.fork()\n"
                      "    if child:\n"
                      f"        with open({str(forked)!r}, 'a') as f:\n"
                      "            f.write(f'{child}\\n')\n"
                      "    return model\n")
    run = tmp_path / "run"
    for steps in (2, 4):  # the second resumes the first, in the same --model_dir
        result = train([*FLAGS, f"--train_steps={steps}", f"--model={source}:net",
                        f"--model_dir={run}"], timeout=300)
        assert_ok(result)
        assert len(re.findall(rf"^step +{steps}/{steps}", result.stdout, re.M)) == 1, \
            result.stdout
        assert "a process that --model=" in result.stderr
    children = [int(pid) for pid in forked.read_text().split()]
    assert len(children) == 2
    deadline = time.monotonic() + 60
    while not all(_ended(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(_ended(pid) for pid in children), children
