"""A user's own network, from a file outside the package
(`--model=path/to/file.py:function`): every guarantee the built-in models
get (N replicas train like one, a resume ends with the weights of an
uninterrupted run, the export and predict), and a broken one refused before
any training with one line naming it."""

import json
import os
import sys
import uuid

import numpy as np
import pytest
from PIL import Image

from conftest import (assert_ok, assert_one_error_line, assert_same_weights, run_in_process,
                      subprocess_env, train, weights_of_one_and_two_replicas,
                      weights_of_whole_and_resumed)

# A plain Keras network as a user writes one: its own normalization, Keras'
# BatchNormalization (unsynchronized, as Keras makes it) and a softmax at
# the end, none of which the package asked for.
USER_MODEL = '''
import keras


def small_cnn(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(images)
    x = keras.layers.Conv2D(8, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes, activation="softmax")(x))


class Unsaveable(keras.Model):
    """Subclassed, made from the DatasetInfo, without get_config(): Keras
    cannot write it as a .keras file."""

    def __init__(self, info):
        super().__init__()
        self.rescale = keras.layers.Rescaling(1 / 255)
        self.classify = keras.layers.Dense(info.num_classes)

    def call(self, images):
        return self.classify(keras.ops.mean(self.rescale(images), axis=(1, 2)))


def unsaveable(info):
    return Unsaveable(info)


class NormalizedInCall(keras.Model):
    """Subclassed, its Normalization built by Keras' symbolic first call."""

    def __init__(self, info):
        super().__init__()
        self.normalize = keras.layers.Normalization(mean=info.mean,
                                                    variance=[s * s for s in info.std])
        self.classify = keras.layers.Dense(info.num_classes)

    def call(self, images):
        return self.classify(keras.ops.mean(self.normalize(images), axis=(1, 2)))


def normalized_in_call(info):
    return NormalizedInCall(info)


def muon_everywhere(info):
    """The dense kernel trained by --optimizer's rule too; a softmax dropped
    (the hook must survive it)."""
    model = small_cnn(info)
    model.parameter_group = lambda variable: "filters" if len(variable.shape) >= 2 else None
    return model


def zero_filters(info):
    """Its convolution starts at zero, as some initialisations have it."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(images)
    x = keras.layers.Conv2D(8, 3, padding="same", kernel_initializer="zeros")(x)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.BatchNormalization()(x))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


class Talkative(keras.layers.Layer):
    """Says so on stdout each time it is called, as a debugging print does."""

    def call(self, images):
        print("called on a batch")
        return images


def summarized(info):
    """Says what it built, on stdout, as Keras' summary() does, and then at
    each call."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(Talkative()(images)))
    model = keras.Model(images, keras.layers.Dense(info.num_classes)(x))
    model.summary()
    return model


class NoSingleImage(keras.layers.Layer):
    """Fails on a batch of one image, which training never gives it."""

    def call(self, images):
        if images.shape[0] == 1:
            raise ValueError("one image is not a batch")
        return images


def no_single_image(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(NoSingleImage()(images)))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def named_probabilities(info):
    """Its last layer named for what it gives, as a Dense with a softmax does."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes, activation="softmax",
                                                  name="probabilities")(x))


class OutOfMemoryOnOneImage(keras.layers.Layer):
    """Runs out of memory on a batch of one image, as a model may at
    predict's batch: TensorFlow's allocator's error, or Python's."""

    def __init__(self, python=False, **kwargs):
        super().__init__(**kwargs)
        self.python = python

    def call(self, images):
        if images.shape[0] == 1:
            if self.python:
                raise MemoryError()
            import tensorflow as tf
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor with shape[1,3072]")
        return images


def out_of_memory(info, python=False):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(
        OutOfMemoryOnOneImage(python)(images)))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def python_out_of_memory(info):
    return out_of_memory(info, python=True)


class UnknownErrorOnOneImage(keras.layers.Layer):
    """A bug of the model's on a batch of one image, which TensorFlow's
    runtime raises as an UnknownError (as a py_function's may)."""

    def call(self, images):
        if images.shape[0] == 1:
            import tensorflow as tf
            raise tf.errors.UnknownError(None, None, "a bug of the model")
        return images


def unknown_error(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(UnknownErrorOnOneImage()(images)))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def two_outputs(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, [keras.layers.Dense(info.num_classes)(x),
                                keras.layers.Dense(info.num_classes)(x)])


not_a_function = 42


async def async_model(info):
    return small_cnn(info)


class PythonInGraph(keras.Model):
    """Rescales its images in Python: it trains, but a SavedModel cannot
    hold the callback."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.classify = keras.layers.Dense(num_classes)

    def call(self, images):
        import tensorflow as tf

        x = tf.py_function(lambda t: tf.cast(t, tf.float32) / 255, [images], tf.float32)
        return self.classify(tf.reshape(x, (-1, 32 * 32 * 3)))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


def python_in_graph(info):
    return PythonInGraph(info.num_classes)


def terabytes(info):
    """A single layer of 10^12 weights, far more than any memory holds."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(10 ** 12 // 3072)(x))


class OwnStep(keras.Model):
    """What Keras' fit() would call, not this package's run."""

    def train_step(self, data):
        raise RuntimeError("fit() only")


def own_step(info):
    model = small_cnn(info)
    model = OwnStep(model.inputs[0], model.outputs[0])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def nan_from_the_start(info):
    """Its output is NaN before any update: a bias initialized so."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(
        info.num_classes, bias_initializer=keras.initializers.Constant(float("nan")))(x))


class NanWhenEvaluated(keras.layers.Layer):
    """Its input in training, NaN in inference: as moving statistics gone NaN."""

    def call(self, x, training=None):
        return x if training else x * float("nan")


def nan_when_evaluated(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, NanWhenEvaluated()(keras.layers.Dense(info.num_classes)(x)))


def no_such_group(info):
    model = small_cnn(info)
    model.parameter_group = lambda variable: "muon"
    return model


class Centered(keras.layers.Layer):
    """A layer of the user's own, without a get_config() of its own."""

    def call(self, images):
        return keras.ops.cast(images, "float32") / 127.5 - 1.0


def own_layer(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.GlobalAveragePooling2D()(Centered()(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def with_dropout(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    x = keras.layers.Dropout(0.5)(keras.layers.Dense(16, activation="relu")(x))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def wrong_classes(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes + 1)(x))
'''
FLAGS = ["--dataset=synthetic", "--synthetic_examples=256", "--per_replica_batch_size=32",
         "--precision=float32", "--warmup_epochs=0", "--noevaluate", "--noexport",
         "--steps_per_loop=4", "--log_every_steps=4"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_models.py"
    path.write_text(USER_MODEL)
    return path


def test_it_trains_on_two_replicas_as_on_one(model_file, tmp_path):
    common = [*FLAGS, f"--model={model_file}:small_cnn", "--train_steps=8"]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path)
    # Batch norm's moving statistics among them: synchronized across replicas.
    assert any("moving_variance" in name for name in single)
    # float32 round-off: the convolution's bias, which batch norm
    # cancels, has no true gradient and moves by round-off alone (1e-6).
    assert_same_weights(mirrored, single, rtol=1e-4, atol=1e-5)


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(model_file, tmp_path):
    common = [*FLAGS, f"--model={model_file}:small_cnn", "--train_steps=80", "--steps_per_loop=2",
              "--log_every_steps=2"]
    expected, resumed = weights_of_whole_and_resumed(common, tmp_path, steps=80)
    assert_same_weights(resumed, expected, rtol=1e-5, atol=1e-6)


def test_a_resumed_run_of_a_model_with_dropout_draws_the_masks_it_would_have(model_file,
                                                                               tmp_path):
    # Keras checkpoints weights alone: its seed generators' state was lost,
    # and the resumed run drew other masks from there.
    common = [*FLAGS, f"--model={model_file}:with_dropout", "--train_steps=80",
              "--steps_per_loop=2", "--log_every_steps=2"]
    expected, resumed = weights_of_whole_and_resumed(common, tmp_path, steps=80)
    assert any(name.startswith("random_state/") for name in expected)
    assert_same_weights(resumed, expected, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_saved_without_the_random_state_resumes_with_a_warning(model_file, tmp_path,
                                                                             monkeypatch):
    from distributed_mpt.training import build
    common = [*FLAGS, f"--model={model_file}:with_dropout", "--train_steps=8",
              f"--model_dir={tmp_path / 'run'}"]
    with monkeypatch.context() as older:  # as the versions before it saved
        older.setattr(build, "random_state", lambda model: [])
        assert_ok(train(common))
    result = train(common)
    assert_ok(result)
    assert "holds no state of the model's random layers" in result.stderr, result.stderr[-2000:]


def test_its_export_serves_probabilities_and_predict_reads_it(model_file, tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--model={model_file}:small_cnn", "--train_steps=4", "--export",
                     f"--model_dir={run}"]))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((20, 24, 3), 200, np.uint8)).save(photo)
    from distributed_mpt.predict import main
    result = run_in_process(main, [f"--model_dir={run}", "--top_k=10", "--json", str(photo)])
    assert_ok(result)
    import json
    top = json.loads(result.stdout)["predictions"][0]["top"]
    # The model's own softmax was dropped for training and added back once.
    assert sum(t["probability"] for t in top) == pytest.approx(1.0, abs=1e-4)
    assert len({t["probability"] for t in top}) > 1
    assert "--dataset=synthetic" in result.stderr and "small_cnn" in result.stderr


def test_what_a_model_prints_leaves_predict_json_readable(model_file, tmp_path):
    """model.summary() in the model function, and a print in a layer's
    call() as predict ran it, went to stdout, before the object of predict
    --json from a checkpoint: stdout was no JSON."""
    run, model = tmp_path / "run", f"--model={model_file}:summarized"
    assert_ok(train([*FLAGS, model, "--train_steps=2", f"--model_dir={run}"]))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(photo)
    from distributed_mpt.predict import main
    result = run_in_process(main, [f"--model_dir={run}", model, "--json", str(photo)])
    assert_ok(result)
    import json
    assert json.loads(result.stdout)["predictions"][0]["top"]
    assert "Total params" in result.stderr and "called on a batch" in result.stderr


def test_a_model_that_fails_on_the_images_predict_gives_it_is_named_in_one_line(model_file,
                                                                                tmp_path):
    """Its call() raising on one image, from a checkpoint: a traceback, exit 1."""
    run, model = tmp_path / "run", f"--model={model_file}:no_single_image"
    assert_ok(train([*FLAGS, model, "--train_steps=2", f"--model_dir={run}"]))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(photo)
    from distributed_mpt.predict import main
    result = run_in_process(main, [f"--model_dir={run}", model, str(photo)])
    assert_one_error_line(result, f"{model} failed when called on 1 image(s) (ValueError in ")
    assert "one image is not a batch" in result.stderr


def test_a_last_layer_named_probabilities_is_exported(model_file, tmp_path):
    """The export's softmax took the same name: "The name "probabilities" is used 2 times",
    the export failed after training, exit 2."""
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--model={model_file}:named_probabilities", "--train_steps=2",
                     "--export", f"--model_dir={run}"]))
    import keras
    loaded = keras.models.load_model(run / "export" / "model.keras")
    sums = loaded([np.zeros((2, 32, 32, 3), np.uint8)]).numpy().sum(axis=1)
    assert sums == pytest.approx([1, 1], abs=1e-4), "its softmax dropped, and added back once"


@pytest.mark.parametrize("function, raised", [
    ("out_of_memory", "ResourceExhaustedError in OutOfMemoryOnOneImage.call(): OOM when "),
    ("python_out_of_memory", "MemoryError in OutOfMemoryOnOneImage.call()")])
def test_a_model_out_of_memory_in_predict_is_said_as_memory_not_blamed_on_it(
        model_file, tmp_path, function, raised):
    """Its call() under users_code blamed the model for the memory ("failed
    when called on 1 image(s)"), as an evaluation does not."""
    run, model = tmp_path / "run", f"--model={model_file}:{function}"
    assert_ok(train([*FLAGS, model, "--train_steps=2", f"--model_dir={run}"]))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(photo)
    from distributed_mpt.predict import main
    result = run_in_process(main, [f"--model_dir={run}", model, str(photo)])
    assert_one_error_line(result, f"classifying 1 image(s) with {run}/checkpoints/ckpt-2 ran out "
                                  f"of memory ({raised}")
    assert "failed when called" not in result.stderr
    assert "Arguments received" not in result.stderr, "Keras' list, for a MemoryError's message"


def test_a_models_own_tensorflow_error_in_predict_is_blamed_on_it_in_one_line(model_file, tmp_path):
    """Predict let the errors an evaluation leaves to the run's handlers
    (UnknownError, InternalError, ...) pass its model's call, and has no such
    handler: a traceback, exit 1 (found in review)."""
    run, model = tmp_path / "run", f"--model={model_file}:unknown_error"
    assert_ok(train([*FLAGS, model, "--train_steps=2", f"--model_dir={run}"]))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(photo)
    from distributed_mpt.predict import main
    assert_one_error_line(run_in_process(main, [f"--model_dir={run}", model, str(photo)]),
                          "failed when called on 1 image(s) (UnknownError in "
                          "UnknownErrorOnOneImage.call(): a bug of the model")


def test_a_layer_of_its_own_is_exported_and_keras_loads_it_given_the_class(model_file, tmp_path):
    # The export swaps this package's layers for Keras' own; a user's layer
    # was swapped for the bare keras Layer, and the run failed after training.
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--model={model_file}:own_layer", "--train_steps=2", "--export",
                     f"--model_dir={run}"]))
    import importlib.util

    import keras
    spec = importlib.util.spec_from_file_location("user_models", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loaded = keras.models.load_model(run / "export" / "model.keras",
                                     custom_objects={"Centered": module.Centered})
    probabilities = np.asarray(loaded([np.zeros((2, 32, 32, 3), np.uint8)]))  # its one input
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("source, fragment", [
    ("{file}:missing_function", "has no function missing_function"),
    ("{file}:wrong_classes", "returns shape [2, 11] for 2 images"),
    ("{broken}:small_cnn", "does not import (SyntaxError"),
    # It takes uint8: not what it lacks. Said whole, with the fix.
    ("{file}:normalized_in_call", ("a layer of this subclassed model kept a tensor of the symbolic "
                                   "call in which Keras first builds such a model",
                                   "docs/extending.md")),
    ("{tmp}/nowhere.py:small_cnn", "is not a file"),
    ("{file}:no_such_group", ("failed to say which parameter group its variables train in "
                              "(ValueError: model.parameter_group(",
                              "returned 'muon': name one of filters, shifts, kernels, others")),
    ("no_such_package.models:small_cnn", "cannot find module no_such_package.models"),
])
def test_a_model_that_breaks_the_contract_is_one_error_line_before_training(
        model_file, tmp_path, source, fragment):
    broken = tmp_path / "broken.py"
    broken.write_text("def small_cnn(info):\n    return (\n")
    run = tmp_path / "run"
    model = source.format(file=model_file, broken=broken, tmp=tmp_path)
    result = train([*FLAGS, f"--model={model}", "--train_steps=4", f"--model_dir={run}"])
    first, *more = (fragment,) if isinstance(fragment, str) else fragment
    assert_one_error_line(result, first)
    assert all(part in result.stderr for part in more), result.stderr  # said whole
    assert not run.exists(), "nothing written"


@pytest.mark.parametrize("as_module", [False, True])
def test_a_model_file_too_large_to_be_code_is_one_error_line_at_once(tmp_path, monkeypatch,
                                                                     as_module):
    """Python compiled a model file of 60 MB for minutes, holding the GIL:
    Ctrl-C and SIGTERM went unanswered all that time. Given as
    `package.module:function`, the module's file is held to the same size."""
    name = f"huge_{uuid.uuid4().hex[:8]}"  # a module name no other test imported
    huge = tmp_path / f"{name}.py"
    huge.write_text(f"{USER_MODEL}\n# {'0' * (9 << 20)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    model = f"{name}:small_cnn" if as_module else f"{huge}:small_cnn"
    result = train([*FLAGS, f"--model={model}", "--train_steps=2", f"--model_dir={run}"])
    assert_one_error_line(result, f"{name}.py holds 9 MB, more than the 8 MB of Python a model "
                                  f"file may hold")
    assert not run.exists()
    assert name not in sys.modules, "refused before it was imported"


def test_the_model_says_which_variables_train_by_the_optimizers_rule(model_file, tmp_path):
    # By default Muon trains the 4-D filters only, and the run says so.
    default = train([*FLAGS, f"--model={model_file}:small_cnn", "--optimizer=muon",
                     "--train_steps=2", f"--model_dir={tmp_path / 'default'}"])
    assert_ok(default)
    assert "parameter groups: filters: Muon, 1 variable(s), 216 weights" in default.stdout
    assert "kernels: NesterovSGD, 1 variable(s), 80 weights" in default.stdout
    chosen = train([*FLAGS, f"--model={model_file}:muon_everywhere", "--optimizer=muon",
                    "--train_steps=2", f"--model_dir={tmp_path / 'chosen'}"])
    assert_ok(chosen)
    assert "parameter groups: filters: Muon, 2 variable(s), 296 weights" in chosen.stdout
    assert "kernels:" not in chosen.stdout


def test_filters_that_start_at_zero_train_with_muon(model_file, tmp_path):
    """Muon scaled them back to their norm, 0: the loss was NaN at step 2,
    and the run said to lower a learning rate that had nothing to do with it."""
    result = train([*FLAGS, f"--model={model_file}:zero_filters", "--optimizer=muon",
                    "--train_steps=4", f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    assert "filters: Muon, 1 variable(s), 216 weights" in result.stdout


def test_a_loss_not_finite_from_the_first_step_names_the_model_not_the_learning_rate(
        model_file, tmp_path):
    """Step 1's loss is of the initial weights: the run said to lower the
    learning rate, which no update had used yet (found by a probe)."""
    result = train([*FLAGS, f"--model={model_file}:nan_from_the_start", "--train_steps=4",
                    f"--model_dir={tmp_path / 'run'}"])
    assert result.returncode == 3, result.stderr[-2000:]
    assert_one_error_line(result, "the loss was NaN or infinite from the first step on",
                          exit_code=3)
    assert "learning rate causes" in result.stderr and "lower the" not in result.stderr


@pytest.mark.parametrize("when, steps, saved, kept", [
    ("at the end", 4, [4], "kept the checkpoint of step 4, exported nothing"),
    ("mid-run", 16, [4], "kept the last good checkpoint (step 4) untouched")])
def test_an_evaluation_not_finite_ends_the_run_as_diverged_writing_nothing_of_it(
        model_file, tmp_path, when, steps, saved, kept):
    """A NaN evaluation loss (the training loss finite) reached the export,
    whose model_info.json refused it with a traceback; during training it was
    logged as null, and the run trained on and saved the model that gave it."""
    run = tmp_path / "run"
    flags = [f for f in FLAGS if f not in ("--noevaluate", "--noexport")]
    flags = [*flags, f"--model={model_file}:nan_when_evaluated", f"--train_steps={steps}",
             "--eval_every_epochs=1", "--checkpoint_every_steps=4", f"--model_dir={run}"]
    evaluated = steps // 2 if steps > 8 else steps  # 8 steps an epoch
    result = train(flags)
    assert_one_error_line(result, f"the evaluation at step {evaluated} gave a NaN or infinite "
                          f"eval_loss", exit_code=3)
    assert kept in result.stderr and "its variables are finite" in result.stderr
    assert "overflow or a division in the model's inference" in result.stderr
    assert sorted(int(p.name[5:-6]) for p in (run / "checkpoints").glob("ckpt-*.index")) == saved
    assert not (run / "export").exists() and not (run / "summary.json").exists()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged and not any("eval_loss" in record for record in logged), "no NaN logged"
    json.loads((run / "config.json").read_text())
    # Run again, it resumes there (at the end: with no step to train) and ends so again.
    assert_one_error_line(train(flags), f"the evaluation at step {evaluated} gave", exit_code=3)


@pytest.mark.parametrize("function, fragment", [
    ("two_outputs", "returns 2 outputs (a list); it must return one"),
    ("not_a_function", "has no function not_a_function (not_a_function is 'int')")])
def test_a_model_that_is_not_one_function_of_one_output_is_named_so(model_file, tmp_path,
                                                                  function, fragment):
    """Two outputs were said to be 'shape []', a number 'no function'."""
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--model={model_file}:{function}", "--train_steps=2",
                                 f"--model_dir={run}"]), fragment)
    assert not run.exists()


def test_an_async_model_function_is_one_error_line(model_file, tmp_path):
    """Its error line was followed by Python's warning of a coroutine never
    awaited, with a line of the package's code: seen at the process's end."""
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:async_model", "--train_steps=2",
                    f"--model_dir={run}"], timeout=300)
    assert_one_error_line(result, "returned coroutine, not a keras.Model")
    assert "never awaited" not in result.stderr
    assert not run.exists()


def test_a_model_that_calls_python_in_its_graph_is_refused_an_export_before_training(
        model_file, tmp_path):
    """A tf.py_function trained and was exported; then predict failed on the
    SavedModel ("Could not find callback"), and said to train it again."""
    run = tmp_path / "run"
    model = f"--model={model_file}:python_in_graph"
    result = train([*FLAGS, model, "--train_steps=2", "--export", f"--model_dir={run}"])
    assert_one_error_line(result, "calls Python inside its graph (EagerPyFunc: tf.py_function")
    assert "or pass --noexport" in result.stderr and not run.exists()
    assert_ok(train([*FLAGS, model, "--train_steps=2", f"--model_dir={run}"]))


def test_a_model_too_large_for_any_memory_is_one_error_line(model_file, tmp_path):
    """TensorFlow refuses its one weight before making it; its allocator's
    report went on for lines (its limit, its use, ...) before the error.
    TensorFlow's log level as users have it: the tests' own hides warnings."""
    run = tmp_path / "run"
    env = subprocess_env()
    del env["TF_CPP_MIN_LOG_LEVEL"]
    result = train([*FLAGS, f"--model={model_file}:terabytes", "--train_steps=2",
                    f"--model_dir={run}"], env=env)
    assert_one_error_line(result, "failed to build its model (ResourceExhaustedError")
    assert result.stderr.startswith("error:"), result.stderr
    assert not run.exists()


def test_what_only_keras_fit_uses_of_a_model_is_said_once(model_file, tmp_path):
    """A model's own train_step() and compile() were passed over without a
    word: the user believed their step trained it."""
    result = train([*FLAGS, f"--model={model_file}:own_step", "--train_steps=2",
                    f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    notes = [line for line in result.stdout.splitlines() if "fit() alone uses" in line]
    assert len(notes) == 1, result.stdout
    assert "its train_step() and the compile() it was given" in notes[0]


def test_a_run_resumes_with_its_model_file_spelled_otherwise(model_file, tmp_path):
    """A run started with --model=FILE relative to its directory was refused
    as 'trained otherwise' when resumed by the file's absolute path (as a
    cluster's job in another directory gives it): the file is compared by
    its code, not by how its path is written."""
    run = tmp_path / "run"
    relative = os.path.relpath(model_file)
    assert_ok(train([*FLAGS, f"--model={relative}:small_cnn", "--train_steps=4",
                     f"--model_dir={run}"]))
    resumed = train([*FLAGS, f"--model={model_file}:small_cnn", "--train_steps=8",
                     f"--model_dir={run}"])
    assert_ok(resumed)
    assert "resum" in resumed.stdout
    assert_one_error_line(train([*FLAGS, f"--model={model_file}:zero_filters", "--train_steps=12",
                                 f"--model_dir={run}"]), "small_cnn")


def test_a_model_the_export_cannot_save_is_one_error_line_before_training(model_file, tmp_path):
    """Not a traceback after the whole run, at the export; with --noexport,
    which writes no .keras file, it trains."""
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={model_file}:unsaveable", "--train_steps=2", "--export",
                    f"--model_dir={run}"])
    assert_one_error_line(result, "cannot be saved as the export's model.keras (NotImplementedError: "
                                  "Object Unsaveable was created by passing non-serializable")
    assert "implement get_config()" in result.stderr and "--noexport" in result.stderr
    assert not run.exists(), "nothing written"
    assert_ok(train([*FLAGS, f"--model={model_file}:unsaveable", "--train_steps=2",
                     f"--model_dir={run}"]))


def test_a_model_flag_that_names_nothing_is_refused_without_tensorflow(tmp_path):
    result = train([*FLAGS, "--model=resnet9000", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "is not one of mlp, resnet9, airbench")


@pytest.mark.slow
def test_workers_whose_model_files_differ_refuse_together(tmp_path):
    """The same flag, `--model=my_models.py:small_cnn`, read from another
    file on each worker (another working directory, a stale copy on one
    node): both refuse before training, naming what differs. The copies
    differ in an activation, which no variable shows: the source does."""
    import subprocess
    import sys

    from conftest import SMOKE_FLAGS
    from distributed_mpt.launch import free_ports, worker_tf_configs

    flags = [*SMOKE_FLAGS, "--communication=ring", "--per_replica_batch_size=16",
             "--peer_timeout_seconds=60", "--train_steps=4", "--precision=float32",
             "--model=my_models.py:small_cnn", f"--model_dir={tmp_path / 'run'}"]
    workers = []
    for index, tf_config in enumerate(worker_tf_configs(free_ports(2))):
        directory = tmp_path / f"node{index}"
        directory.mkdir()
        (directory / "my_models.py").write_text(
            USER_MODEL.replace("ReLU()", "ReLU(max_value=6.0)") if index else USER_MODEL)
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "distributed_mpt.train", *flags], cwd=directory,
            env=subprocess_env(TF_CONFIG=tf_config), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    for worker in workers:
        output = worker.communicate(timeout=300)[0]
        assert worker.returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "model file (and the modules it imports) differ" in errors[0], output[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training"


@pytest.mark.slow
def test_a_peer_of_a_worker_whose_first_step_failed_names_the_step(tmp_path):
    """Worker 0's model fails in the first step on its own (an assertion on
    its shard); worker 1 only sees worker 0 go, and said nothing of where."""
    import subprocess
    import sys

    from conftest import SMOKE_FLAGS
    from distributed_mpt.launch import free_ports, worker_tf_configs

    source = tmp_path / "worker_zero_fails.py"
    source.write_text(
        "import json, os\nimport keras\nimport tensorflow as tf\n\n"
        "TASK = json.loads(os.environ['TF_CONFIG'])['task']['index']\n\n\n"
        "class Net(keras.Model):\n"
        "    def __init__(self, classes):\n"
        "        super().__init__()\n"
        "        self.dense = keras.layers.Dense(classes)\n\n"
        "    def call(self, images, training=False):\n"
        "        x = keras.ops.mean(keras.ops.cast(images, 'float32') / 255, axis=(1, 2))\n"
        "        if training:  # what only running finds, on one worker\n"
        "            task = tf.py_function(lambda: TASK, [], tf.int32)\n"
        "            tf.debugging.assert_equal(task, 1, message='not on worker 0')\n"
        "        return self.dense(x)\n\n\n"
        "def net(info):\n    return Net(info.num_classes)\n")
    flags = [*SMOKE_FLAGS, "--communication=ring", "--per_replica_batch_size=16",
             "--peer_timeout_seconds=60", "--train_steps=4", "--precision=float32",
             f"--model={source}:net", f"--model_dir={tmp_path / 'run'}"]
    workers = [subprocess.Popen([sys.executable, "-m", "distributed_mpt.train", *flags],
                                env=subprocess_env(TF_CONFIG=tf_config), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
               for tf_config in worker_tf_configs(free_ports(2))]
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    errors = [[line for line in output.splitlines() if line.startswith("error:")]
              for output in outputs]
    assert workers[0].returncode == 2 and "failed in the run's first training step" in errors[0][0]
    assert workers[1].returncode == 141, outputs[1][-3000:]
    assert len(errors[1]) == 1 and "lost a peer" in errors[1][0], outputs[1][-3000:]
    assert (f"in the run's first training step, where a peer's --model={source}:net may have "
            f"failed (its own log would say so)") in errors[1][0]
