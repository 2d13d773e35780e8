"""Use a trained model: evaluate it on a test split, or classify image files
into CIFAR-10's classes.

Classify images:   distributed-mpt-predict --model_dir=runs/r9 cat.png ship.jpg --top_k=3
Evaluate:          distributed-mpt-predict --model_dir=runs/r9 --evaluate [--data_dir=DIR]
As JSON:           distributed-mpt-predict --model_dir=runs/r9 --json cat.png

--model_dir is a training run's directory or its export/ directory. The
export is used (the SavedModel's serving signature, as TF Serving runs it);
a run without an export yet is read from its latest checkpoint. Images of any
size (PNG, JPEG, GIF, BMP) are resized to 32x32 RGB as a whole (squashed, not
cropped), like the CIFAR-10 photos the model learned from.

A line on stderr says what the model is and what it was trained on (from
export/model_info.json, or a run's config.json), and a model that learned
synthetic data is flagged: its answers about photos mean nothing.

An export is a TensorFlow program, and loading it runs the operations it
holds: use only exports you trust, as you would a script.
"""

import contextlib
import dataclasses
import gc
import json
import logging
import os
import stat
import sys
from typing import Callable, Optional

import numpy as np
from absl import flags

from distributed_mpt.process import log_filter
from distributed_mpt.config import DATASETS, TrainConfig, user_path
from distributed_mpt.errors import CheckpointMismatchError, ConfigError, ExitCode, UserError, first_line
from distributed_mpt.training.outputs import (CLASS_NAMES, EXPORT_DIR, MODEL_INFO_CONFIG_KEYS,
                                              MODEL_INFO_NAME, SAVED_MODEL_DIR, model_info,
                                              read_json)

# Images per call when evaluating: bounds memory, not accuracy.
EVAL_BATCH_SIZE = 500
# Far above any photo (a 50-megapixel JPEG is about 20 MB): a bigger file is
# refused before it is read into memory.
MAX_IMAGE_BYTES = 64 << 20
# A small file can decode to gigabytes (a PNG of one colour compresses
# 1000:1): its header's size is checked before it is decoded.
MAX_IMAGE_PIXELS = 100_000_000

SYNTHETIC_WARNING = (
    "warning: this model was trained on synthetic data, not CIFAR-10: its answers about "
    "photos mean nothing; train a real one with --recipe=cpu_cnn (docs/using-the-model.md)")


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model_dir", None, "A training run's directory, or its export/.",
                        flag_values=fv)
    flags.DEFINE_bool("evaluate", False, "Report loss and accuracy on the whole test split.",
                      flag_values=fv)
    flags.DEFINE_enum("dataset", None, DATASETS, "Test split to evaluate on (default: the "
                      "dataset the model was trained on, else cifar10). synthetic is the "
                      "split of the model's own --seed and --synthetic_examples.",
                      flag_values=fv)
    flags.DEFINE_string("data_dir", None, "Where CIFAR-10 is, as in training.", flag_values=fv)
    flags.DEFINE_bool("download", TrainConfig.download, "Download CIFAR-10 if it is not in "
                      "--data_dir.", flag_values=fv)
    flags.DEFINE_integer("synthetic_examples", None, "As in training (default: the model's): "
                         "--dataset=synthetic's test split has a fifth as many.", flag_values=fv)
    flags.DEFINE_integer("top_k", 1, "Classes to print per image, most probable first.",
                         lower_bound=1, upper_bound=10, flag_values=fv)
    flags.DEFINE_bool("json", False, "Print one JSON object instead of lines.", flag_values=fv)
    return fv


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A trained model, ready to classify."""

    probabilities: Callable  # uint8 images [N, 32, 32, 3] -> float32 [N, classes]
    class_names: list
    source: str  # the export or checkpoint it was read from
    info: dict   # what it is and was trained on (outputs.model_info); {} if unknown


def load_classifier(model_dir: str) -> Classifier:
    """The model of a run directory or export directory `model_dir`: its
    export if it has one, else its newest readable checkpoint. Raises
    UserError if neither holds the model whole."""
    if not os.path.isdir(model_dir):
        raise ConfigError(f"--model_dir={model_dir} is not a directory: give a training run's "
                          f"directory or its export/")
    for export_dir in (model_dir, os.path.join(model_dir, EXPORT_DIR)):
        if os.path.isdir(os.path.join(export_dir, SAVED_MODEL_DIR)):
            return _load_export(export_dir)
    return _load_checkpoint(model_dir)


# What mends a damaged export (a finished run exports again from its checkpoint).
_REEXPORT = "remove it and run the run's training command again, which exports it anew"


def _load_export(export_dir: str) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.training import precision

    saved_model = os.path.join(export_dir, SAVED_MODEL_DIR)
    try:
        loaded = tf.saved_model.load(saved_model)
        serve = loaded.signatures["serving_default"]
        # Exports made before the names were shipped hold none.
        names = ([n.decode() for n in loaded.class_names[0].numpy()]
                 if hasattr(loaded, "class_names") else list(CLASS_NAMES))
    # A damaged SavedModel raises OSError, ValueError, KeyError, OpError...
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{saved_model} cannot be loaded ({first_line(e)}): {_REEXPORT}") \
            from None
    _, inputs = serve.structured_input_signature
    images, outputs = inputs.get("images"), serve.structured_outputs
    if not (images is not None and images.dtype == tf.uint8 and images.shape.rank == 4
            and images.shape[1:] == (32, 32, 3) and "probabilities" in outputs):
        raise ConfigError(f"{saved_model} is not an export of this program: its serving "
                          f"signature does not map uint8 `images` [N, 32, 32, 3] to "
                          f"`probabilities`")
    # A graph that computes answers without trained weights would serve them
    # as confidently as a trained one.
    if not getattr(loaded, "trainable_variables", None):
        raise ConfigError(f"{saved_model} holds no trained variables: {_REEXPORT}")
    classes = outputs["probabilities"].shape[-1]
    if len(names) != classes:
        raise ConfigError(f"{saved_model} names {len(names)} classes but predicts {classes}: "
                          f"{_REEXPORT}")
    info_path = os.path.join(export_dir, MODEL_INFO_NAME)
    info = read_json(info_path)
    if info:
        _checked_config({k: info[k] for k in MODEL_INFO_CONFIG_KEYS if k in info}, info_path)
        # Before the model's first call, when its graph is optimized.
        precision.avoid_float16_reference_kernels(info.get("precision"))
    return Classifier(lambda x: serve(images=tf.constant(x))["probabilities"].numpy(),
                      names, saved_model, info)


def _load_checkpoint(model_dir: str) -> Classifier:
    import tensorflow as tf

    from distributed_mpt.training import checkpointing
    from distributed_mpt.training.models import build_model

    # The newest checkpoint that reads back whole, as training resumes from;
    # the `checkpoint` index file may be damaged or point at a missing one.
    step, prefix = next(((step, prefix) for step, prefix in checkpointing.checkpoints_on_disk(
        os.path.join(model_dir, "checkpoints")) if not checkpointing.why_unreadable(prefix)),
        (None, None))
    config_path = os.path.join(model_dir, "config.json")
    if not (prefix and os.path.exists(config_path)):
        raise ConfigError(f"--model_dir={model_dir} holds no export (export/saved_model) and no "
                          f"checkpoint with its config.json")
    recorded = read_json(config_path)
    config = _checked_config(recorded, config_path)
    try:
        model = build_model(config.model, config.model_width)
    except (MemoryError, tf.errors.ResourceExhaustedError):
        raise ConfigError(f"{config_path} names a model too large for this machine's memory "
                          f"({config.model}, width {config.model_width})") from None
    mismatch = _restore_weights(model, prefix)
    if mismatch:
        raise CheckpointMismatchError(
            f"{prefix} does not hold the weights of the {config.model} of width "
            f"{config.model_width} that {config_path} names ({mismatch}): predict from the "
            f"run's export, or restore its config.json")
    # The test results are this checkpoint's only if the run ended with it.
    summary = read_json(os.path.join(model_dir, "summary.json"))
    results = summary if summary.get("steps") == step else {}
    resolved = recorded.get("resolved")
    precision = resolved.get("precision") if isinstance(resolved, dict) else None
    info = model_info(dataclasses.asdict(config),
                      {**results, "steps": step, "precision": precision or config.precision})
    return (Classifier(lambda x: model(x, training=False).numpy(), list(CLASS_NAMES), prefix,
                       info))


def _restore_weights(model, prefix: str) -> Optional[str]:
    """Restores every weight of `model` from the checkpoint at `prefix`;
    returns why it cannot, or None."""
    import tensorflow as tf

    try:
        status = tf.train.Checkpoint(model=model).restore(prefix)
        status.expect_partial()  # the optimizer's state is not needed...
        status.assert_existing_objects_matched()  # ...but every weight of the model is
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        return first_line(e)
    return None


def _checked_config(values: dict, source: str = "") -> TrainConfig:
    """`values` (TrainConfig's fields, any subset) checked as training checks
    its flags, with the same bounds; ConfigError naming the file `source` (if
    they come from one) if they fail."""
    known = {field.name for field in dataclasses.fields(TrainConfig)}
    try:
        if source and not values:
            raise ConfigError("no settings in it")
        # The run's own directory may be elsewhere now: it is not used.
        return TrainConfig(**{**{k: v for k, v in values.items() if k in known},
                              "model_dir": "."})
    except (ConfigError, TypeError, ValueError) as e:
        if not source:
            raise
        raise ConfigError(f"{source} is damaged ({first_line(e)}): write it again, or move "
                          f"it away") from None


def describe(classifier: Classifier) -> str:
    """One line: what the model is, what it learned, how well it does."""
    info = classifier.info
    if not info:
        return (f"model: {classifier.source} (it records nothing of its training: what it "
                f"learned is unknown)")
    accuracy = info.get("eval_accuracy_without_tta", info.get("eval_accuracy"))
    accuracy = (f"test accuracy {accuracy:.4f}" if isinstance(accuracy, (int, float))
                else "test accuracy not measured")
    return (f"model: {info.get('model')} trained {info.get('steps', '?')} steps with "
            f"--dataset={info.get('dataset')}, {accuracy} ({classifier.source})")


@contextlib.contextmanager
def _quiet_tensorflow():
    """Keeps TensorFlow's Python warnings off the console: a checkpoint
    that does not fit gives a page of them, some only when the objects of
    the failed restore are collected. The error line says what is wrong."""
    logger = logging.getLogger("tensorflow")  # tf.get_logger(), without importing TensorFlow
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        gc.collect()  # what a failed restore left, collected while quiet
        logger.setLevel(level)


def read_image(path: str) -> np.ndarray:
    """The image file at `path` as uint8 [32, 32, 3] RGB, or raises UserError."""
    import tensorflow as tf

    try:
        # By kind and size before reading: a FIFO would block the read
        # forever, and /dev/zero fill the memory.
        kind = os.stat(path).st_mode
        if not stat.S_ISREG(kind):
            raise UserError(f"{path} is not a regular file (a directory, FIFO or device): give "
                            f"an image file")
        with open(path, "rb") as f:
            encoded = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:  # missing, not readable
        raise UserError(f"cannot read {path} ({e.strerror})") from None
    if len(encoded) > MAX_IMAGE_BYTES:
        raise UserError(f"{path} is larger than an image this program reads "
                        f"({MAX_IMAGE_BYTES >> 20} MB)")
    pixels = _header_pixels(encoded)
    if pixels is not None and pixels > MAX_IMAGE_PIXELS:
        raise UserError(f"{path} says it holds {pixels:,} pixels, more than this program decodes "
                        f"({MAX_IMAGE_PIXELS:,})")
    try:
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    except tf.errors.InvalidArgumentError:
        kind = _image_format(encoded)
        if kind:
            raise UserError(f"{path} begins as a {kind} image does but does not decode "
                            f"(damaged or truncated): give an intact copy") from None
        raise UserError(f"{path} is not a PNG, JPEG, GIF, BMP or WebP image") from None
    # Antialiasing averages all the pixels that shrink into one, instead of
    # sampling a few of them.
    small = tf.image.resize(image, (32, 32), antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(small), 0, 255), tf.uint8).numpy()


# How each file format the decoder reads begins (WebP: RIFF, size, WEBP).
_SIGNATURES = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8", "GIF": b"GIF8", "BMP": b"BM"}


def _image_format(encoded: bytes) -> Optional[str]:
    """The image format the first bytes of `encoded` name, or None."""
    if encoded[:4] == b"RIFF" and encoded[8:12] == b"WEBP":
        return "WebP"
    return next((name for name, start in _SIGNATURES.items() if encoded.startswith(start)), None)


def _header_pixels(encoded: bytes) -> Optional[int]:
    """Width x height as the header of a PNG, GIF, BMP or JPEG says it; None
    for other formats (the decoder then refuses or bounds them)."""
    import struct

    import tensorflow as tf

    kind = _image_format(encoded)
    if kind == "PNG" and len(encoded) >= 24:
        width, height = struct.unpack(">II", encoded[16:24])
    elif kind == "GIF" and len(encoded) >= 10:
        width, height = struct.unpack("<HH", encoded[6:10])
    elif kind == "BMP" and len(encoded) >= 26:
        width, height = struct.unpack("<ii", encoded[18:26])
    elif kind == "JPEG":
        try:
            height, width = (int(x) for x in tf.image.extract_jpeg_shape(encoded)[:2])
        except tf.errors.InvalidArgumentError:
            return None  # the decoder says what is wrong with it
    else:
        return None
    return abs(width) * abs(height)


def evaluate(probabilities, images: np.ndarray, labels: np.ndarray) -> dict:
    """Mean cross-entropy and accuracy of `probabilities` over all `images`."""
    loss, correct = 0.0, 0
    for start in range(0, len(labels), EVAL_BATCH_SIZE):
        p = probabilities(images[start:start + EVAL_BATCH_SIZE])
        y = labels[start:start + EVAL_BATCH_SIZE]
        loss -= float(np.log(np.maximum(p[np.arange(len(y)), y], 1e-7)).sum())  # Keras' clip
        correct += int((p.argmax(axis=1) == y).sum())
    return {"loss": loss / len(labels), "accuracy": correct / len(labels), "examples": len(labels)}


def main(argv=None) -> int:
    """Evaluates and/or classifies as the flags say; returns the exit code."""
    # As in training: TensorFlow's C++ start-up lines would bury the answer.
    with log_filter.filtering(), _quiet_tensorflow():
        try:
            return _main(sys.argv[1:] if argv is None else argv)
        except KeyboardInterrupt:  # predict writes no file: nothing to keep or clean
            print("interrupted", file=sys.stderr, flush=True)
            return ExitCode.ABORTED


def _main(argv) -> int:
    fv = _flag_values()
    if {"-h", "--help", "--helpfull"} & set(argv):
        print(__doc__ + "\nFlags:\n" + fv.get_help())
        return ExitCode.OK
    try:
        try:
            files = fv(["distributed-mpt-predict", *argv])[1:]
        except flags.Error as e:
            raise ConfigError(first_line(e)) from None
        for name in ("model_dir", "data_dir"):
            fv[name].value = user_path(fv[name].value)
        if not fv.model_dir:
            raise ConfigError("--model_dir is required: a training run's directory or its export/")
        if not files and not fv.evaluate:
            raise ConfigError("nothing to do: give image files to classify, or --evaluate")
        if fv.synthetic_examples is not None:  # bounded as in training, before the model loads
            _checked_config({"synthetic_examples": fv.synthetic_examples})
        images = [read_image(f) for f in files]  # bad files fail before the model loads
        classifier = load_classifier(fv.model_dir)
        print(describe(classifier), file=sys.stderr)
        if files and classifier.info.get("dataset") == "synthetic":
            print(SYNTHETIC_WARNING, file=sys.stderr)
        sys.stderr.flush()
        result = {"model": {"source": classifier.source, **classifier.info}}
        if fv.evaluate:
            result["evaluation"] = _evaluate_on_test_split(classifier, fv)
        if files:
            names = classifier.class_names
            result["predictions"] = [
                {"file": f, "top": [{"class": names[i], "probability": float(p[i])}
                                    for i in np.argsort(-p)[:fv.top_k]]}
                for f, p in zip(files, classifier.probabilities(np.stack(images)))]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if fv.json:
        print(json.dumps(result, indent=2))
        return ExitCode.OK
    if "evaluation" in result:
        e = result["evaluation"]
        print(f"{e['dataset']} test: loss {e['loss']:.4f}, accuracy {e['accuracy']:.4f} "
              f"({e['examples']} images)")
    for prediction in result.get("predictions", []):
        print(f"{prediction['file']}: " + ", ".join(
            f"{t['class']} {t['probability']:.3f}" for t in prediction["top"]))
    return ExitCode.OK


def _evaluate_on_test_split(classifier: Classifier, fv: flags.FlagValues) -> dict:
    """The flags' test split (by default the one the model was trained on:
    for synthetic data, the split of its own seed and size), evaluated."""
    from distributed_mpt.training import datasets

    trained = {k: v for k, v in classifier.info.items()
               if k in ("dataset", "seed", "synthetic_examples")}
    chosen = {k: v for k, v in (("dataset", fv.dataset),
                                ("synthetic_examples", fv.synthetic_examples)) if v is not None}
    split = _checked_config({**trained, **chosen})
    (test,) = datasets.load_dataset(split.dataset, fv.data_dir, fv.download,
                                    split.synthetic_examples, split.seed, splits=("test",))
    return {"dataset": split.dataset,
            **evaluate(classifier.probabilities, test.images, test.labels)}


def run() -> None:
    """Console-script entry point. Ends the process at once when done,
    every output written (see `stopping.exit_now`)."""
    from distributed_mpt.process import console, stopping
    stopping.exit_now(console.run_with_console(main))


if __name__ == "__main__":
    run()
