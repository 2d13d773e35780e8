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
import glob
import json
import logging
import os
import sys
from typing import Callable

import numpy as np
from absl import flags

from distributed_mpt import cli
from distributed_mpt.classifier import Classifier, checked_config, load_classifier
from distributed_mpt.config import DEFAULTS, user_path
from distributed_mpt.core.augmentation import TTA_VIEWS
from distributed_mpt.core.data import DATASETS, DatasetInfo, images
from distributed_mpt.core.data.dataset import READ_AS_ONE_BY, check_held_out_split, read_as
from distributed_mpt.errors import ConfigError, ExitCode, quoted
from distributed_mpt.process import log_filter, memory
from distributed_mpt.training.outputs import DATA_INFO_KEYS

SYNTHETIC_WARNING = (
    "warning: this model was trained on synthetic data, not CIFAR-10: its answers about "
    "photos mean nothing; train a real one with --recipe=cpu_cnn (docs/using-the-model.md)")
UNTRAINED_WARNING = (
    "warning: this model was trained for 0 steps: its answers are chance; train it, or point "
    "--model_dir at a run that trained")


# The flags that choose --evaluate's test split, and mean nothing without it.
_EVALUATE_FLAGS = ("dataset", "data_dir", "download", "synthetic_examples")


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
    cli.define_integer(fv, "top_k", 1, "Classes to print per image, most probable first (at "
                       "most the model's number of classes).", lower=1)
    flags.DEFINE_bool("json", False, "Print one JSON object instead of lines.", flag_values=fv)
    flags.DEFINE_string("model", None, "Your own model (file.py:function), for a checkpoint of "
                        "a run that trained it: predict imports no code that config.json "
                        "names.", flag_values=fv)
    return fv


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
    cli.check_path_flags(fv, "model_dir", "data_dir")
    for name in ("model_dir", "data_dir"):
        fv[name].value = user_path(fv[name].value)
    if not fv.model_dir:
        raise ConfigError("--model_dir is required: a training run's directory or its export/")
    if not paths and not fv.evaluate:
        raise ConfigError("nothing to do: give image files to classify, or --evaluate")
    unused = [f"--{name}" for name in _EVALUATE_FLAGS if fv[name].present]
    if unused and not fv.evaluate:  # else ignored without a word
        raise ConfigError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for "
                          f"--evaluate's test split, which is not asked for: add --evaluate, or "
                          f"drop {'it' if len(unused) == 1 else 'them'}")
    if not fv.tta_fraction > 0:
        raise ConfigError(f"--tta_fraction={fv.tta_fraction} must be in (0, 1]")
    if fv.synthetic_examples is not None:  # bounded as in training, before the model loads
        checked_config({"synthetic_examples": fv.synthetic_examples})
    decoded = _refuse_unreadable(paths)  # before the model loads
    classifier = load_classifier(fv.model_dir, fv.model)
    classes = len(classifier.class_names)
    if paths and fv.top_k > classes:  # else fewer printed than asked, without a word
        raise ConfigError(f"--top_k={fv.top_k} is more than the {classes} classes "
                          f"{quoted(classifier.source)} predicts: give at most {classes}")
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
        names = classifier.class_names
        result["predictions"] = [
            {"file": path, "top": [{"class": names[i], "probability": float(p[i])}
                                   for i in np.argsort(-p)[:fv.top_k]]}
            for path, p in zip(paths, _file_probabilities(classifier, paths, decoded, fv))]
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


# The decoded pixels that the check before the model loads keeps for the
# answers, so that the images are decoded once: those beyond it (100,000
# photos would not fit in memory) are decoded again, a batch at a time.
_KEPT_BYTES = 128 << 20
# Images classified at a time (which bounds memory, not the answer).
_BATCH = 500


def _refuse_unreadable(paths) -> dict:
    """The decoded pixels of the first of `paths` (by index), up to _KEPT_BYTES
    of them. Raises the ImageError of the first that is no readable image,
    saying how many others are not either: one at a time, a folder of 3,000
    with a few bad ones took a run to find each."""
    failed, decoded, kept_bytes = [], {}, 0
    for index, path in enumerate(paths):
        try:
            pixels = _read_named(path)
        except images.ImageError as e:
            failed.append((path, e))
            continue
        kept_bytes += pixels.nbytes
        if kept_bytes <= _KEPT_BYTES and not failed:
            decoded[index] = pixels
    if len(failed) > 1:
        raise images.ImageError(f"{failed[0][1]} ({len(failed) - 1:,} more of the "
                                f"{len(paths):,} files given are not readable images either, "
                                f"the next {quoted(failed[1][0])})")
    if failed:
        raise failed[0][1]
    return decoded


def _read_named(path: str) -> np.ndarray:
    """images.read_image, saying what a path that names no file was likely meant as."""
    try:
        return images.read_image(path)
    except images.ImageError:
        if os.path.lexists(path) or not (path in ("", "-") or glob.has_magic(path)):
            raise
    raise images.ImageError(
        "a path given is empty (an unset shell variable?): give image files" if not path else
        "- names no file: predict reads no standard input; give image files" if path == "-" else
        f"{quoted(path)} names no file: a pattern that matched none, which the shell passes "
        f"on as it is; give image files")


def _file_probabilities(classifier: Classifier, paths, decoded: dict,
                        fv: flags.FlagValues) -> np.ndarray:
    """`_probabilities` of the images of `paths`, read _BATCH at a time at the
    model's size: `decoded` holds the pixels of some (by index), taken as used."""
    size = classifier.image_shape[:2]

    def at_size(index: int) -> np.ndarray:
        pixels = decoded.pop(index, None)
        if pixels is not None:
            with contextlib.suppress(ValueError, MemoryError):  # read_image says why, by name
                return images.resize(pixels, size)
        return images.read_image(paths[index], size)

    def answers(chosen: np.ndarray, views: str) -> np.ndarray:
        return np.concatenate([_probabilities(
            classifier, np.stack([at_size(i) for i in batch]), views, 1.0,
            lambda i, batch=batch: quoted(paths[batch[i]]))
            for batch in np.array_split(chosen, range(_BATCH, len(chosen), _BATCH))])

    everything = np.arange(len(paths))
    if fv.tta == "none" or fv.tta_fraction == 1:
        return answers(everything, fv.tta)
    from distributed_mpt.core.eval_views import least_confident

    # The least confident of all the images, as --tta_fraction says: not of each batch.
    p = answers(everything, "none")
    chosen = least_confident(p.max(axis=1), fv.tta_fraction)
    if len(chosen):
        p[chosen] = answers(chosen, fv.tta)
    return p


def _evaluate_on_test_split(classifier: Classifier, fv: flags.FlagValues) -> dict:
    """The flags' test split (by default the model's: for synthetic data, its seed's), evaluated."""
    trained = {k: v for k, v in classifier.info.items() if k in DATA_INFO_KEYS}
    chosen = {k: v for k, v in (("dataset", fv.dataset),
                                ("synthetic_examples", fv.synthetic_examples)) if v is not None}
    split = checked_config({**trained, **chosen, "data_dir": fv.data_dir})
    if split.data.dataset == "synthetic" and fv.data_dir is not None:  # else evaluated unread
        whose = "" if fv.dataset else " (the model's)"
        raise ConfigError(f"--data_dir={quoted(fv.data_dir)} is not read: the test split is "
                          f"--dataset=synthetic's{whose}, made from its seed; for the images "
                          f"there, give --dataset=image_folder or --dataset=cifar10")
    # The data_dir as given here (or None), and the model's own image size.
    chosen_data = dataclasses.replace(split.data, data_dir=fv.data_dir, download=fv.download,
                                      image_size=classifier.image_shape[0])
    loaded = chosen_data.load(split.run.seed, splits=("test",), headroom=memory.headroom())
    dataset = chosen_data.dataset
    _refuse_other_classes(classifier, dataset, loaded.info)  # else its accuracy means nothing
    check_held_out_split(loaded, classifier.info.get("data_fingerprint"), fv.data_dir)
    from distributed_mpt.core.eval_views import loss_and_accuracy

    test, names = loaded.test, loaded.info.class_names
    p = _probabilities(classifier, test.images, fv.tta, fv.tta_fraction, lambda i: (
        f"test image {i + 1} of {len(test)} of --dataset={dataset} (of class "
        f"{quoted(names[test.labels[i]])})"))
    return {"dataset": dataset, "tta": fv.tta, "tta_fraction": fv.tta_fraction,
            **loss_and_accuracy(p, test.labels)}


def _probabilities(classifier: Classifier, batch: np.ndarray, views: str, fraction: float,
                   name_of: Callable[[int], str]) -> np.ndarray:
    """The classifier's probabilities for every image of `batch`, with
    test-time `views` of its least confident `fraction`; ConfigError naming
    (`name_of` its index) the first image it answers NaN or infinity for:
    printed as numbers, they would read as answers."""
    from distributed_mpt.core.eval_views import class_probabilities

    p = class_probabilities(classifier.probabilities, batch, views, fraction, batch_size=_BATCH)
    bad = np.flatnonzero(~np.isfinite(p).all(axis=1))
    if len(bad):
        value = "NaN" if np.isnan(p[bad[0]]).any() else "infinity"
        more = f" (and {len(bad) - 1} other image(s))" if len(bad) > 1 else ""
        raise ConfigError(f"{quoted(classifier.source)} answers {value}, not probabilities, for "
                          f"{name_of(bad[0])}{more}: it is damaged, or its arithmetic overflows on "
                          f"that image; {classifier.remedy}")
    return p


def _refuse_other_classes(classifier: Classifier, dataset: str, split: DatasetInfo) -> None:
    """Raises ConfigError unless the test split of `dataset` (`split`: its
    info) has the model's classes, in its order, and image size."""
    ours, theirs = list(classifier.class_names), list(split.class_names)
    shape, its_shape = list(classifier.image_shape), list(split.image_shape)
    order = (" (in another order)" if sorted(theirs) == sorted(ours) else
             f" (spelled otherwise: in {READ_AS_ONE_BY})"
             if sorted(map(read_as, theirs)) == sorted(map(read_as, ours)) else "")
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
