"""Use a trained model: evaluate it on CIFAR-10's test split, or classify
image files into CIFAR-10's classes.

Classify images:   distributed-mpt-predict --model_dir=runs/r9 cat.png ship.jpg --top_k=3
Evaluate:          distributed-mpt-predict --model_dir=runs/r9 --evaluate [--data_dir=DIR]
As JSON:           distributed-mpt-predict --model_dir=runs/r9 --json cat.png

--model_dir is a training run's directory or its export/ directory. The
export is used (the SavedModel's serving signature, as TF Serving runs it);
a run without an export yet is read from its latest checkpoint. Images of any
size (PNG, JPEG, GIF, BMP) are resized to 32x32 RGB as a whole (squashed, not
cropped), like the CIFAR-10 photos the model learned from.
"""

import json
import os
import sys

import numpy as np
from absl import flags

from distributed_mpt import log_filter
from distributed_mpt.config import DATASETS, TrainConfig
from distributed_mpt.errors import ConfigError, UserError
from distributed_mpt.outputs import CLASS_NAMES, read_json

# Images per call when evaluating: bounds memory, not accuracy.
EVAL_BATCH_SIZE = 500


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    d = lambda name: TrainConfig.__dataclass_fields__[name].default  # noqa: E731
    flags.DEFINE_string("model_dir", None, "A training run's directory, or its export/.",
                        flag_values=fv)
    flags.DEFINE_bool("evaluate", False, "Report loss and accuracy on the whole test split.",
                      flag_values=fv)
    flags.DEFINE_enum("dataset", d("dataset"), DATASETS, "Test split to evaluate "
                      "on; synthetic is the one a --dataset=synthetic run (default --seed) "
                      "learned.", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory.", flag_values=fv)
    flags.DEFINE_bool("download", d("download"), "Download CIFAR-10 if it is not in --data_dir.",
                      flag_values=fv)
    flags.DEFINE_integer("synthetic_examples", d("synthetic_examples"), "As in training: "
                         "--dataset=synthetic's test split has a fifth as many.", flag_values=fv)
    flags.DEFINE_integer("top_k", 1, "Classes to print per image, most probable first.",
                         lower_bound=1, upper_bound=10, flag_values=fv)
    flags.DEFINE_bool("json", False, "Print one JSON object instead of lines.", flag_values=fv)
    return fv


def load_classifier(model_dir: str):
    """Returns (probabilities, class_names, source): a function from uint8
    images [N, 32, 32, 3] to float32 probabilities [N, classes], the names of
    the classes, and the path the model was read from."""
    import tensorflow as tf

    for export_dir in (model_dir, os.path.join(model_dir, "export")):
        saved_model = os.path.join(export_dir, "saved_model")
        if os.path.exists(os.path.join(saved_model, "saved_model.pb")):
            loaded = tf.saved_model.load(saved_model)
            serve = loaded.signatures["serving_default"]
            # Exports made before the names were shipped hold none.
            names = ([n.decode() for n in loaded.class_names[0].numpy()]
                     if hasattr(loaded, "class_names") else list(CLASS_NAMES))
            return (lambda images: serve(images=tf.constant(images))["probabilities"].numpy(),
                    names, saved_model)
    from distributed_mpt import checkpointing
    # The newest checkpoint that reads back whole, as training resumes from;
    # the `checkpoint` index file may be damaged or point at a missing one.
    checkpoint = next((prefix for _, prefix in checkpointing.checkpoints_on_disk(
        os.path.join(model_dir, "checkpoints")) if not checkpointing.why_unreadable(prefix)), None)
    config_path = os.path.join(model_dir, "config.json")
    if not (checkpoint and os.path.exists(config_path)):
        raise ConfigError(f"--model_dir={model_dir} holds no export (export/saved_model) and no "
                          f"checkpoint with its config.json")
    from distributed_mpt.models import build_model
    config = read_json(config_path)
    if not isinstance(config.get("model"), str) or not isinstance(config.get("model_width"), int):
        raise ConfigError(f"{config_path} is damaged (no model and model_width): evaluate the "
                          f"run's export instead, or write config.json again")
    try:
        model = build_model(config["model"], config["model_width"])
    except ValueError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    # Only the model: the optimizer's state in the checkpoint is not needed.
    tf.train.Checkpoint(model=model).restore(checkpoint).expect_partial()
    return lambda images: model(images, training=False).numpy(), list(CLASS_NAMES), checkpoint


def read_image(path: str) -> np.ndarray:
    """The image file at `path` as uint8 [32, 32, 3] RGB, or raises UserError."""
    import tensorflow as tf

    try:
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    except tf.errors.InvalidArgumentError:
        raise UserError(f"{path} is not a PNG, JPEG, GIF, BMP or WebP image") from None
    except tf.errors.OpError as e:  # missing, a directory, not readable
        raise UserError(f"cannot read {path} ({type(e).__name__})") from None
    # Antialiasing averages all the pixels that shrink into one, instead of
    # sampling a few of them.
    small = tf.image.resize(image, (32, 32), antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(small), 0, 255), tf.uint8).numpy()


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
    with log_filter.filtering():
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv) -> int:
    fv = _flag_values()
    if {"-h", "--help", "--helpfull"} & set(argv):
        print(__doc__ + "\nFlags:\n" + fv.get_help())
        return 0
    try:
        try:
            files = fv(["distributed-mpt-predict", *argv])[1:]
        except flags.Error as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        if not fv.model_dir:
            raise ConfigError("--model_dir is required: a training run's directory or its export/")
        if not files and not fv.evaluate:
            raise ConfigError("nothing to do: give image files to classify, or --evaluate")
        images = [read_image(f) for f in files]  # bad files fail before the model loads
        probabilities, names, source = load_classifier(fv.model_dir)
        print(f"model: {source}", file=sys.stderr)
        result = {}
        if fv.evaluate:
            from distributed_mpt import data
            _, test = data.load_dataset(fv.dataset, fv.data_dir, fv.download,
                                        fv.synthetic_examples, TrainConfig.seed)
            result["evaluation"] = evaluate(probabilities, test.images, test.labels)
        if files:
            result["predictions"] = [
                {"file": f, "top": [{"class": names[i], "probability": float(p[i])}
                                    for i in np.argsort(-p)[:fv.top_k]]}
                for f, p in zip(files, probabilities(np.stack(images)))]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if fv.json:
        print(json.dumps(result, indent=2))
        return 0
    if "evaluation" in result:
        e = result["evaluation"]
        print(f"{fv.dataset} test: loss {e['loss']:.4f}, accuracy {e['accuracy']:.4f} "
              f"({e['examples']} images)")
    for prediction in result.get("predictions", []):
        print(f"{prediction['file']}: " + ", ".join(
            f"{t['class']} {t['probability']:.3f}" for t in prediction["top"]))
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
