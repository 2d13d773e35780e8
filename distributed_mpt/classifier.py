"""A trained model, ready to classify: a training run's export (the
SavedModel's serving signature, as TF Serving runs it), or where it has none
yet its newest readable checkpoint, with what the run recorded of its
training. distributed-mpt-predict answers with it (predict.py).

An export is a TensorFlow program, and loading it runs the operations it
holds: use only exports you trust, as you would a script.
"""

import dataclasses
import os
from typing import Callable, Optional

from distributed_mpt import files
from distributed_mpt.config import (DEFAULTS, TrainConfig, flat_record, section_problem,
                                    unknown_settings)
from distributed_mpt.core.data.dataset import DatasetInfo, class_names_problem
from distributed_mpt.errors import CheckpointMismatchError, ConfigError, first_line, quoted
from distributed_mpt.training.outputs import (EXPORT_DIR, MODEL_INFO_CONFIG_KEYS, MODEL_INFO_NAME,
                                              SAVED_MODEL_DIR, fingerprint_is_damaged,
                                              model_info)


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A trained model, ready to classify."""

    probabilities: Callable  # uint8 images [N, *image_shape] -> float32 [N, classes]
    class_names: list
    image_shape: tuple  # (height, width, channels) the model takes
    source: str  # the export or checkpoint it was read from
    info: dict   # what it is and was trained on (outputs.model_info); {} if unknown
    remedy: str  # what mends it where its answers are no numbers


def load_classifier(model_dir: str, users_model: Optional[str] = None) -> Classifier:
    """The model of a run directory or export directory `model_dir`: its
    export if it has one, else its newest readable checkpoint (a user's
    network built from `users_model`, --model). UserError if neither holds it."""
    try:
        os.stat(model_dir)
    except PermissionError as e:  # not "is not a directory": it may be one, past a closed folder
        raise ConfigError(f"cannot reach --model_dir={quoted(model_dir)} ({e.strerror}): a folder "
                          f"on its way is closed to this user; open it to them, or give another "
                          f"path") from None
    except OSError:
        pass  # missing, or in a loop: "is not a directory"
    if not os.path.isdir(model_dir):
        raise ConfigError(f"--model_dir={quoted(model_dir)} is not a directory: give a training "
                          f"run's directory or its export/")
    for export_dir in (model_dir, os.path.join(model_dir, EXPORT_DIR)):
        saved_model = os.path.join(export_dir, SAVED_MODEL_DIR)
        for path in (export_dir, saved_model):
            # An emptied file, a link in a loop: a damaged export, which was
            # passed over for the checkpoint without a word.
            if os.path.lexists(path) and not os.path.isdir(path):
                raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not an export's "
                                  f"folder: {_REEXPORT}")
        # One this user may not enter looks empty: it would be called no
        # export. Entering is all it takes to find saved_model/ (0711 will do).
        if os.path.isdir(export_dir):
            _refuse_closed(export_dir, os.X_OK)
        if os.path.isdir(saved_model):
            if users_model is not None:  # the export holds the network: that code would not run
                raise ConfigError(f"--model={quoted(users_model)} builds the network of a run's "
                                  f"checkpoint, and {quoted(saved_model)} is an export, which "
                                  f"holds its network and is used: drop --model")
            return _load_export(export_dir)
    return _load_checkpoint(model_dir, users_model)


# The largest image side an export may take: 20,000 took 15 GB for one image
# (2 cores of an AVX2-only AMD EPYC, Zen 3).
MAX_INPUT_SIDE = 4096
# What mends a damaged export (a finished run exports again from its checkpoint).
_REEXPORT = "remove it and run the run's training command again, which exports it anew"


def _load_export(export_dir: str) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.core import precision
    from distributed_mpt.core.eval_views import OUT_OF_MEMORY

    saved_model = os.path.join(export_dir, SAVED_MODEL_DIR)
    _refuse_what_tensorflow_cannot_read(saved_model)
    if fingerprint_is_damaged(saved_model):  # loaded past, under a traceback
        raise ConfigError(f"{quoted(saved_model)} is damaged (its fingerprint.pb does not read "
                          f"back): {_REEXPORT}")
    try:
        loaded = tf.saved_model.load(saved_model)
    # A damaged SavedModel raises OSError, ValueError, KeyError, OpError...
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{quoted(saved_model)} cannot be loaded ({quoted(first_line(e))}): "
                          f"{_REEXPORT}") from None
    # Before the class names: another program's SavedModel (Keras' export(), a
    # tf.saved_model.save) has none, and was told to train again, as if damaged.
    serve = loaded.signatures.get("serving_default")
    _, inputs = serve.structured_input_signature if serve else ((), {})
    signature, outputs = inputs.get("images"), serve.structured_outputs if serve else None
    answer = outputs.get("probabilities") if isinstance(outputs, dict) else None
    if not (signature is not None and signature.dtype == tf.uint8 and signature.shape.rank == 4
            and None not in signature.shape[1:] and signature.shape[-1] == 3
            and max(signature.shape[1:3]) <= MAX_INPUT_SIDE and answer is not None
            and answer.dtype.is_floating and answer.shape.rank == 2):
        raise ConfigError(f"{quoted(saved_model)} is not an export of this program: its serving "
                          f"signature does not map uint8 `images` [N, height, width, 3] (at most "
                          f"{MAX_INPUT_SIDE} a side) to float `probabilities` [N, classes]")
    try:
        names = [n.decode() for n in loaded.class_names[0].numpy()]
    except Exception as e:  # noqa: BLE001  (not strings: TypeError, UnicodeDecodeError...)
        why = "it holds no class names" if isinstance(e, AttributeError) else quoted(first_line(e))
        raise ConfigError(f"{quoted(saved_model)} cannot be loaded ({why}): {_REEXPORT}") from None
    problem = class_names_problem(names)  # as a run's config.json is checked
    if problem:
        raise ConfigError(f"{quoted(saved_model)} is damaged ({problem}): {_REEXPORT}")
    # A graph that computes answers without trained weights would serve them
    # as confidently as a trained one.
    if not getattr(loaded, "trainable_variables", None):
        raise ConfigError(f"{quoted(saved_model)} holds no trained variables: {_REEXPORT}")
    classes = answer.shape[-1]
    if len(names) != classes:
        raise ConfigError(f"{quoted(saved_model)} names {len(names)} classes but predicts "
                          f"{classes}: {_REEXPORT}")
    info_path = os.path.join(export_dir, MODEL_INFO_NAME)
    info = files.read_json(info_path)
    if info:
        checked_config({k: info[k] for k in MODEL_INFO_CONFIG_KEYS if k in info}, info_path)
        # Before the model's first call, when its graph is optimized.
        precision.avoid_float16_reference_kernels(info.get("precision"))
    def probabilities(x):
        try:
            return serve(images=tf.constant(x))["probabilities"].numpy()
        except OUT_OF_MEMORY as e:  # not the export's: "remove it" would lose an intact one
            raise out_of_memory(len(x), saved_model, quoted(first_line(e))) from None
        except tf.errors.OpError as e:  # an assertion of its own, say
            raise ConfigError(f"{quoted(saved_model)} failed to run ({quoted(first_line(e))}): "
                              f"{_REEXPORT}") from None

    return Classifier(probabilities, names, tuple(signature.shape[1:]), saved_model, info,
                      _REEXPORT)


def out_of_memory(images: int, source: str, said: str) -> ConfigError:
    """The error of classifying `images` with the model of `source` out of
    memory, as the error `said`."""
    return ConfigError(f"classifying {images} image(s) with {quoted(source)} ran out of memory "
                       f"({said}): give predict more memory")


def _refuse_what_tensorflow_cannot_read(saved_model: str) -> None:
    """Raises ConfigError naming the first entry of `saved_model` (itself
    included) that TensorFlow cannot read: one that is no regular file or
    folder (it would wait on a FIFO for ever; a link to a folder is not
    looked into), or one this user may not read (called missing by it, and
    the export damaged)."""
    _refuse_closed(saved_model, os.R_OK | os.X_OK)
    for root, folders, names in os.walk(saved_model):  # which skips a folder it may not list
        for name in folders + names:
            path = os.path.join(root, name)
            if os.path.islink(path) if name in folders else not files.is_regular_file(path):
                raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not a regular file "
                                  f"or folder: {_REEXPORT}")
            _refuse_closed(path, os.R_OK | os.X_OK * (name in folders))


def _refuse_closed(path: str, mode: int, context: str = "") -> None:
    """Raises ConfigError if this user lacks `mode` of access to `path`,
    which TensorFlow would call missing, or damaged; `context` begins the line."""
    why = files.why_no_access(path, mode)
    if why:
        raise ConfigError(f"{context}cannot read {quoted(path)} ({why}): make it readable for "
                          f"this user")


def _load_checkpoint(model_dir: str, users_model: Optional[str]) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.core import models
    from distributed_mpt.core.eval_views import OUT_OF_MEMORY
    from distributed_mpt.core.models.contract import cause, users_code
    from distributed_mpt.core.models.process_state import prints_to_stderr
    from distributed_mpt.core.models.signature import model_signature, refuse_another_model
    from distributed_mpt.training import checkpoints
    from distributed_mpt.training.build import memory_shortfall

    # The newest checkpoint that reads back whole, as training resumes from;
    # the `checkpoint` index file may be damaged or point at a missing one.
    directory = os.path.join(model_dir, "checkpoints")
    if os.path.isdir(directory):  # one this user may not list looks empty: "no checkpoint"
        _refuse_closed(directory, os.R_OK | os.X_OK,
                       f"--model_dir={quoted(model_dir)} holds no export, and ")
    step, prefix, skipped = None, None, []
    for found_step, found in checkpoints.checkpoints_on_disk(directory):
        problem = checkpoints.why_unreadable(found)
        if not problem:
            step, prefix = found_step, found
            break
        skipped.append((found, problem))
    if skipped and not prefix:  # not "no checkpoint": the fix differs
        raise ConfigError(f"--model_dir={quoted(model_dir)} holds no export, and none of its "
                          f"{len(skipped)} checkpoint(s) reads back whole "
                          f"({quoted(checkpoints.reasons(skipped))}): put back intact copies, "
                          f"make them readable for this user, or train the model again")
    config_path = os.path.join(model_dir, "config.json")
    if not (prefix and os.path.exists(config_path)):
        raise ConfigError(f"--model_dir={quoted(model_dir)} holds no export (export/saved_model) "
                          f"and no checkpoint with its config.json")
    recorded = files.read_json(config_path)
    problem = section_problem(recorded)  # read as a resume reads it: a section is not a flag
    if problem:
        raise ConfigError(f"{quoted(config_path)} is damaged ({problem}): write it again, or "
                          f"move it away")
    if unknown := unknown_settings(recorded):  # predict trains nothing: a new option fails restore
        files.warn(f"{quoted(config_path)} {unknown}; predicting without them")
    config = checked_config(flat_record(recorded), config_path)
    resolved = recorded.get("resolved") if isinstance(recorded.get("resolved"), dict) else {}
    info = _dataset_info(config, resolved, config_path)
    network = config.model
    users = models.model_spec(network.model).is_users
    if users != (users_model is not None):  # config.json is untrusted: the user names the code
        raise ConfigError(
            f"--model_dir={quoted(model_dir)} holds no export, and its checkpoint is of your own "
            f"model ({quoted(network.model)} in its config.json): give --model=FILE.py:FUNCTION, "
            f"the one it trained, as predict imports no code that a file in --model_dir names"
            if users else f"--model={quoted(users_model)} is for a run of your own model, and "
            f"--model_dir={quoted(model_dir)} trained the package's {quoted(network.model)}")
    network = dataclasses.replace(network, model=users_model) if users else network
    spec = models.model_spec(network.model)
    # Bounded before any weight exists, as training bounds it (config.json
    # is untrusted: resnet9 at width 1,024 is 6.7 GB of weights). A user's
    # network is as large as the code the user gives makes it.
    parameters = network.parameter_count(info, config.airbench)
    short = parameters and memory_shortfall(parameters, _PREDICT_COPIES_PER_WEIGHT)
    if short:
        raise ConfigError(
            f"{quoted(config_path)} names {network.too_large()[0]}, of {parameters:,} "
            f"parameters: predicting with it needs about {short[0] / 1e9:.1f} GB, more than the "
            f"{short[1].describe()}; restore the run's config.json if it was changed, or give "
            f"predict more memory")
    try:
        model = network.build(info, config.airbench)
    except OUT_OF_MEMORY:
        raise ConfigError(f"{quoted(config_path)} names a model too large for this machine's "
                          f"memory ({network.model}, width {network.model_width})") from None
    refuse_another_model(resolved, model_signature(spec, model), spec,
                         f"the run in --model_dir={quoted(model_dir)}",
                         "restore what differs, or predict from the run's export")
    mismatch = _restore_weights(model, prefix)
    if mismatch:
        raise CheckpointMismatchError(
            f"{quoted(prefix)} does not hold the weights of the {quoted(network.model)} of width "
            f"{network.model_width} that {quoted(config_path)} names ({quoted(mismatch)}): "
            f"predict from the run's export, or restore its config.json")
    # The test results are this checkpoint's only if the run ended with it.
    summary = files.read_json(os.path.join(model_dir, "summary.json"))
    results = summary if summary.get("steps") == step else {}
    trained = model_info(config.flags(), {**results, "steps": step, "precision":
                                          resolved.get("precision") or config.run.precision},
                         resolved.get("data_fingerprint"))

    if skipped:  # answers of an older model, which the describe line alone would not tell
        files.warn(f"predicting with {quoted(prefix)} (step {step}), the newest checkpoint that "
                   f"reads back whole: {len(skipped)} newer one(s) cannot be read "
                   f"({quoted(checkpoints.reasons(skipped))}); a resume of the run replaces them")

    def probabilities(x):
        # A user's call() is code that may raise on what training never gave it (one image:
        # a traceback, exit 1): one line that names it, but not for what says nothing of the
        # model (the memory's), as in an evaluation. A print in a layer's call() goes to
        # stderr either way: stdout is predict's answers.
        try:
            # Only memory is not the model's here: predict has no handler for the rest.
            with (users_code(users_model, f"failed when called on {len(x)} image(s)",
                             OUT_OF_MEMORY) if users else prints_to_stderr()):
                return tf.nn.softmax(tf.cast(model(x, training=False), tf.float32)).numpy()
        except OUT_OF_MEMORY as e:  # a traceback, or else the model blamed
            raise out_of_memory(len(x), prefix, cause(e)) from None

    return Classifier(probabilities, list(info.class_names), info.image_shape, prefix, trained,
                      "predict from the checkpoint before it (move this one's files away), or "
                      "train the model again")


# Copies of every weight predict holds from a checkpoint, at most: the
# model's, and the checkpoint's value as the restore reads it.
_PREDICT_COPIES_PER_WEIGHT = 2


def _dataset_info(config: TrainConfig, resolved: dict, config_path: str) -> DatasetInfo:
    """What the run's model was built for: recorded in config.json (the
    statistics of an image folder come from its images), else its dataset's."""
    recorded = resolved.get("dataset_info")
    if isinstance(recorded, dict):
        # Checked before a model is built for them (dataset.MAX_CLASSES says why).
        problem = class_names_problem(recorded.get("class_names"))
        try:
            if not problem:
                return DatasetInfo(**{k: tuple(v) for k, v in recorded.items()})
        except TypeError:
            problem = "its dataset_info is not what this program writes"
        raise ConfigError(f"{quoted(config_path)} is damaged ({problem}): write it again, or "
                          f"move it away")
    from distributed_mpt.core.data import cifar10
    return cifar10.INFO  # runs from before it was recorded: CIFAR-10 or synthetic


def _restore_weights(model, prefix: str) -> Optional[str]:
    """Restores every weight of `model` from `prefix`; why it cannot, or None."""
    import tensorflow as tf

    try:
        status = tf.train.Checkpoint(model=model).restore(prefix)
        status.expect_partial()  # the optimizer's state is not needed...
        status.assert_existing_objects_matched()  # ...but every weight of the model is
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        return first_line(e)
    return None


def checked_config(values: dict, source: str = "") -> TrainConfig:
    """`values` (TrainConfig's fields, any subset) checked as training checks its flags,
    with the same bounds; ConfigError naming the file `source` (if any) if they fail."""
    try:
        if source and not values:
            raise ConfigError("no settings in it")
        # The run's own directories may be elsewhere now: they are not used.
        return TrainConfig.from_flags(**{**{k: v for k, v in values.items() if k in DEFAULTS},
                              "model_dir": ".", "data_dir": values.get("data_dir") or "."})
    except (ConfigError, TypeError, ValueError) as e:
        if not source:
            raise
        raise ConfigError(f"{quoted(source)} is damaged ({quoted(first_line(e))}): write it "
                          f"again, or move it away") from None

