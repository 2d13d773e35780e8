"""Use a trained model: evaluate it on a test split, or classify image files
into CIFAR-10's classes.

Classify images:   distributed-mpt-predict --model_dir=runs/r9 cat.png ship.jpg --top_k=3
Evaluate:          distributed-mpt-predict --model_dir=runs/r9 --evaluate [--data_dir=DIR]
With test-time augmentation, as the cpu_cnn94_muon recipe evaluates:
                   distributed-mpt-predict --model_dir=runs/r9 --evaluate \\
                       --tta=flip_translate_mean --tta_fraction=0.25
As JSON:           distributed-mpt-predict --model_dir=runs/r9 --json cat.png

--model_dir is a training run's directory or its export/ directory. The
export is used (the SavedModel's serving signature, as TF Serving runs it);
a run without an export yet is read from its latest checkpoint. Images of any
size in PNG, JPEG, GIF, BMP, WebP or TIFF are decoded whole and resized as a
whole (squashed, not cropped) to the size the model takes, as an image
folder's images were for training (core/data/images.py).

A line on stderr says what the model is and what it was trained on (from
export/model_info.json, or a run's config.json), and a model that learned
synthetic data, or was never trained, is flagged: its answers mean nothing.

An export is a TensorFlow program, and loading it runs the operations it
holds: use only exports you trust, as you would a script.
"""

import contextlib
import dataclasses
import gc
import json
import logging
import os
import sys
from typing import Callable, Optional

import numpy as np
from absl import flags

from distributed_mpt import cli, files
from distributed_mpt.config import DEFAULTS, TrainConfig, flat_record, user_path
from distributed_mpt.core.augmentation import TTA_VIEWS
from distributed_mpt.core.data import DATASETS, DatasetInfo, images
from distributed_mpt.errors import (CheckpointMismatchError, ConfigError, ExitCode, first_line,
                                    quoted)
from distributed_mpt.process import log_filter
from distributed_mpt.training.outputs import (EXPORT_DIR, MODEL_INFO_CONFIG_KEYS, MODEL_INFO_NAME,
                                              SAVED_MODEL_DIR, model_info)

SYNTHETIC_WARNING = (
    "warning: this model was trained on synthetic data, not CIFAR-10: its answers about "
    "photos mean nothing; train a real one with --recipe=cpu_cnn (docs/using-the-model.md)")
UNTRAINED_WARNING = (
    "warning: this model was trained for 0 steps: its answers are chance; train it, or point "
    "--model_dir at a run that trained")


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model_dir", None, "A training run's directory, or its export/.",
                        flag_values=fv)
    flags.DEFINE_bool("evaluate", False, "Report loss and accuracy on the whole test split.",
                      flag_values=fv)
    flags.DEFINE_enum("dataset", None, list(DATASETS), "Test split to evaluate on (default: the "
                      "dataset the model was trained on, else cifar10). synthetic is the "
                      "split of the model's own --seed and --synthetic_examples; image_folder "
                      "the test/ folder of --data_dir.", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "Where the test split is, as in training.",
                        flag_values=fv)
    flags.DEFINE_bool("download", DEFAULTS["download"], "Download CIFAR-10 if it is not in "
                      "--data_dir.", flag_values=fv)
    cli.define_integer(fv, "synthetic_examples", None, "As in training (default: the model's): "
                       "--dataset=synthetic's test split has a fifth as many.")
    flags.DEFINE_enum("tta", "none", TTA_VIEWS, "Test-time augmentation, as training's "
                      "--eval_tta: classify each image by the mean logits of these views of it "
                      "(flip, flip_translate, flip_translate_mean); none: the image alone.",
                      flag_values=fv)
    cli.define_float(fv, "tta_fraction", 1.0, "As training's --eval_tta_fraction: augment only "
                     "this fraction of the images, those whose plain view is least confident.",
                     upper=1.0)
    cli.define_integer(fv, "top_k", 1, "Classes to print per image, most probable first.",
                       lower=1, upper=10)
    flags.DEFINE_bool("json", False, "Print one JSON object instead of lines.", flag_values=fv)
    flags.DEFINE_string("model", None, "Your own model (file.py:function), for a checkpoint of "
                        "a run that trained it: predict imports no code that config.json "
                        "names.", flag_values=fv)
    return fv


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A trained model, ready to classify."""

    probabilities: Callable  # uint8 images [N, *image_shape] -> float32 [N, classes]
    class_names: list
    image_shape: tuple  # (height, width, channels) the model takes
    source: str  # the export or checkpoint it was read from
    info: dict   # what it is and was trained on (outputs.model_info); {} if unknown


def load_classifier(model_dir: str, users_model: Optional[str] = None) -> Classifier:
    """The model of a run directory or export directory `model_dir`: its
    export if it has one, else its newest readable checkpoint (a user's
    network built from `users_model`, --model). UserError if neither holds it."""
    if not os.path.isdir(model_dir):
        raise ConfigError(f"--model_dir={quoted(model_dir)} is not a directory: give a training "
                          f"run's directory or its export/")
    for export_dir in (model_dir, os.path.join(model_dir, EXPORT_DIR)):
        if os.path.isdir(os.path.join(export_dir, SAVED_MODEL_DIR)):
            return _load_export(export_dir)
    return _load_checkpoint(model_dir, users_model)


# The largest image side an export may take: 20,000 took 15 GB for one image.
MAX_INPUT_SIDE = 4096
# What mends a damaged export (a finished run exports again from its checkpoint).
_REEXPORT = "remove it and run the run's training command again, which exports it anew"


def _load_export(export_dir: str) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.core import precision

    saved_model = os.path.join(export_dir, SAVED_MODEL_DIR)
    files.refuse_special_files(saved_model, _REEXPORT)  # TensorFlow would wait on a FIFO for ever
    try:
        loaded = tf.saved_model.load(saved_model)
        serve = loaded.signatures["serving_default"]
        names = [n.decode() for n in loaded.class_names[0].numpy()]
    # A damaged SavedModel raises OSError, ValueError, KeyError, OpError...
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{quoted(saved_model)} cannot be loaded ({quoted(first_line(e))}): "
                          f"{_REEXPORT}") from None
    _, inputs = serve.structured_input_signature
    signature, outputs = inputs.get("images"), serve.structured_outputs
    answer = outputs.get("probabilities") if isinstance(outputs, dict) else None
    if not (signature is not None and signature.dtype == tf.uint8 and signature.shape.rank == 4
            and None not in signature.shape[1:] and signature.shape[-1] == 3
            and max(signature.shape[1:3]) <= MAX_INPUT_SIDE and answer is not None
            and answer.dtype.is_floating and answer.shape.rank == 2):
        raise ConfigError(f"{quoted(saved_model)} is not an export of this program: its serving "
                          f"signature does not map uint8 `images` [N, height, width, 3] (at most "
                          f"{MAX_INPUT_SIDE} a side) to float `probabilities` [N, classes]")
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
        _checked_config({k: info[k] for k in MODEL_INFO_CONFIG_KEYS if k in info}, info_path)
        # Before the model's first call, when its graph is optimized.
        precision.avoid_float16_reference_kernels(info.get("precision"))
    def probabilities(x):
        try:
            return serve(images=tf.constant(x))["probabilities"].numpy()
        except tf.errors.OpError as e:  # an assertion of its own, say
            raise ConfigError(f"{quoted(saved_model)} failed to run ({quoted(first_line(e))}): "
                              f"{_REEXPORT}") from None

    return Classifier(probabilities, names, tuple(signature.shape[1:]), saved_model, info)


def _load_checkpoint(model_dir: str, users_model: Optional[str]) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.core import models
    from distributed_mpt.core.models.signature import model_signature, refuse_another_model
    from distributed_mpt.training import checkpoints

    # The newest checkpoint that reads back whole, as training resumes from;
    # the `checkpoint` index file may be damaged or point at a missing one.
    step, prefix = next(((step, prefix) for step, prefix in checkpoints.checkpoints_on_disk(
        os.path.join(model_dir, "checkpoints")) if not checkpoints.why_unreadable(prefix)),
        (None, None))
    config_path = os.path.join(model_dir, "config.json")
    if not (prefix and os.path.exists(config_path)):
        raise ConfigError(f"--model_dir={quoted(model_dir)} holds no export (export/saved_model) "
                          f"and no checkpoint with its config.json")
    recorded = files.read_json(config_path)
    config = _checked_config(flat_record(recorded), config_path)
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
    try:
        model = network.build(info, config.airbench)
    except (MemoryError, tf.errors.ResourceExhaustedError):
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
                                          resolved.get("precision") or config.run.precision})

    def probabilities(x):
        return tf.nn.softmax(tf.cast(model(x, training=False), tf.float32)).numpy()

    return Classifier(probabilities, list(info.class_names), info.image_shape, prefix, trained)


def _dataset_info(config: TrainConfig, resolved: dict, config_path: str) -> DatasetInfo:
    """What the run's model was built for: recorded in config.json (the
    statistics of an image folder come from its images), else its dataset's."""
    recorded = resolved.get("dataset_info")
    if isinstance(recorded, dict):
        try:
            return DatasetInfo(**{k: tuple(v) for k, v in recorded.items()})
        except TypeError:
            raise ConfigError(f"{quoted(config_path)} is damaged (its dataset_info is not what "
                              f"this program writes): write it again, or move it away") from None
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


def _checked_config(values: dict, source: str = "") -> TrainConfig:
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


def describe(classifier: Classifier) -> str:
    """One line: what the model is, what it learned, how well it does."""
    info = classifier.info
    if not info:
        return (f"model: {quoted(classifier.source)} (it records nothing of its training: what "
                f"it learned is unknown)")
    accuracy = info.get("eval_accuracy_without_tta", info.get("eval_accuracy"))
    accuracy = (f"test accuracy {accuracy:.4f}" if isinstance(accuracy, (int, float))
                else "test accuracy not measured")
    return (f"model: {quoted(info.get('model'))} trained {info.get('steps', '?')} steps with "
            f"--dataset={quoted(info.get('dataset'))}, {accuracy} ({quoted(classifier.source)})")


@contextlib.contextmanager
def _quiet_tensorflow():
    """Keeps TensorFlow's Python warnings off the console: a checkpoint that does not fit
    gives a page of them, some as the failed restore is collected. An error line says why."""
    logger = logging.getLogger("tensorflow")  # tf.get_logger(), without importing TensorFlow
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        gc.collect()  # what a failed restore left, collected while quiet
        logger.setLevel(level)


def main(argv=None) -> int:
    """Evaluates and/or classifies as the flags say; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    fv = _flag_values()
    if cli.wants_help(argv):
        return cli.show_help(__doc__, fv)
    # As in training: TensorFlow's C++ start-up lines would bury the answer.
    with log_filter.filtering(), _quiet_tensorflow():
        # predict writes no file: nothing to keep or clean.
        return cli.guarded(lambda: _predict(fv, argv), on_interrupt="nothing written")


def _predict(fv: flags.FlagValues, argv) -> int:
    paths = cli.parse("distributed-mpt-predict", fv, argv, positionals=True)
    if getattr(sys.stdout, "closed_at_start", False):  # >&-: exit 0, the answers nowhere
        raise ConfigError("standard output is closed: give the answers somewhere to go")
    for name in ("model_dir", "data_dir"):
        fv[name].value = user_path(fv[name].value)
    if not fv.model_dir:
        raise ConfigError("--model_dir is required: a training run's directory or its export/")
    if not paths and not fv.evaluate:
        raise ConfigError("nothing to do: give image files to classify, or --evaluate")
    if not fv.tta_fraction > 0:
        raise ConfigError(f"--tta_fraction={fv.tta_fraction} must be in (0, 1]")
    if fv.synthetic_examples is not None:  # bounded as in training, before the model loads
        _checked_config({"synthetic_examples": fv.synthetic_examples})
    for path in paths:  # bad files fail before the model loads (and are read again after)
        images.read_image(path)
    classifier = load_classifier(fv.model_dir, fv.model)
    print(describe(classifier), file=sys.stderr)
    if paths and classifier.info.get("dataset") == "synthetic":
        print(SYNTHETIC_WARNING, file=sys.stderr)
    if classifier.info.get("steps") == 0:
        print(UNTRAINED_WARNING, file=sys.stderr)
    sys.stderr.flush()
    result = {"model": {"source": classifier.source, **classifier.info}}
    if fv.evaluate:
        result["evaluation"] = _evaluate_on_test_split(classifier, fv)
    if paths:
        from distributed_mpt.core.eval_views import class_probabilities

        size = classifier.image_shape[:2]
        batch = np.stack([images.read_image(path, size) for path in paths])
        names = classifier.class_names
        result["predictions"] = [
            {"file": path, "top": [{"class": names[i], "probability": float(p[i])}
                                   for i in np.argsort(-p)[:fv.top_k]]}
            for path, p in zip(paths, class_probabilities(classifier.probabilities, batch,
                                                          fv.tta, fv.tta_fraction))]
    if fv.json:
        print(json.dumps(result, indent=2))
        return ExitCode.OK
    if "evaluation" in result:
        e = result["evaluation"]
        views = ("" if e["tta"] == "none" else
                 f", test-time views {e['tta']} for {e['tta_fraction']:.0%} of them")
        print(f"{e['dataset']} test: loss {e['loss']:.4f}, accuracy {e['accuracy']:.4f} "
              f"({e['examples']} images{views})")
    for prediction in result.get("predictions", []):
        # quoted: a newline in a file's name must not forge a line of answers.
        print(f"{quoted(prediction['file'], 10_000)}: " + ", ".join(
            f"{quoted(t['class'])} {t['probability']:.3f}" for t in prediction["top"]))
    return ExitCode.OK


def _evaluate_on_test_split(classifier: Classifier, fv: flags.FlagValues) -> dict:
    """The flags' test split (by default the model's: for synthetic data, its seed's), evaluated."""
    trained = {k: v for k, v in classifier.info.items()
               if k in ("dataset", "seed", "synthetic_examples", "image_size", "test_fraction")}
    chosen = {k: v for k, v in (("dataset", fv.dataset),
                                ("synthetic_examples", fv.synthetic_examples)) if v is not None}
    split = _checked_config({**trained, **chosen, "data_dir": fv.data_dir})
    # The data_dir as given here (or None), and the model's own image size.
    chosen_data = dataclasses.replace(split.data, data_dir=fv.data_dir, download=fv.download,
                                      image_size=classifier.image_shape[0])
    loaded = chosen_data.load(split.run.seed, splits=("test",))
    dataset = chosen_data.dataset
    _refuse_other_classes(classifier, dataset, loaded.info)  # else its accuracy means nothing
    from distributed_mpt.core.eval_views import evaluate_probabilities

    return {"dataset": dataset, "tta": fv.tta, "tta_fraction": fv.tta_fraction,
            **evaluate_probabilities(classifier.probabilities, loaded.test.images,
                                     loaded.test.labels, fv.tta, fv.tta_fraction)}


def _refuse_other_classes(classifier: Classifier, dataset: str, split: DatasetInfo) -> None:
    """Raises ConfigError unless the test split of `dataset` (`split`: its
    info) has the model's classes, in its order, and image size."""
    ours, theirs = list(classifier.class_names), list(split.class_names)
    shape, its_shape = list(classifier.image_shape), list(split.image_shape)
    order = " (in another order)" if sorted(theirs) == sorted(ours) else ""
    what = (f"the classes {quoted(', '.join(theirs), 80)}{order}, and the model predicts "
            f"{quoted(', '.join(ours), 80)}" if theirs != ours else
            f"images {its_shape}, and the model takes {shape}" if its_shape != shape else "")
    if what:
        raise ConfigError(f"--dataset={dataset}'s test split has {what}: evaluate it on a test "
                          f"split of its own (--dataset, --data_dir)")


def run() -> None:
    """Console-script entry point. Ends the process at once when done,
    every output written (see `stopping.exit_now`)."""
    cli.console_script(main)


if __name__ == "__main__":
    run()
