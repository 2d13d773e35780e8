"""The export a run leaves in `<model_dir>/export/`: the model for TF Serving
and for Keras, its class names, and what it is and was trained on, so that
whoever uses it (distributed-mpt-predict first) can say what its answers
are worth. Written whole, then moved into place: a reader never sees half.
"""

import os
import shutil
import uuid
from typing import Sequence

from distributed_mpt import files
from distributed_mpt.core.models.contract import ModelError
from distributed_mpt.errors import ConfigError, quoted

EXPORT_DIR = "export"  # in model_dir
SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
CLASSES_FILE = "classes.txt"
MODEL_INFO_NAME = "model_info.json"
EXPORT_ENTRIES = (SAVED_MODEL_DIR, KERAS_FILE, CLASSES_FILE, MODEL_INFO_NAME)
# Staging, and a retired export, beside the export: what a killed export leaves.
STAGING_PREFIX = ".export-"
# The settings model_info.json records, TrainConfig's fields: what the model
# is and its data (synthetic_examples only for --dataset=synthetic, where it
# and the seed regenerate the test split; image_size and test_fraction only
# for an image folder, where they say how its images were read).
MODEL_INFO_CONFIG_KEYS = ("model", "model_width", "dataset", "seed", "synthetic_examples",
                          "image_size", "test_fraction")
_ONLY_FOR = {"synthetic_examples": ("synthetic",), "image_size": ("image_folder",),
             "test_fraction": ("image_folder",)}
_MODEL_INFO_SUMMARY_KEYS = (
    "precision", "steps", "epochs", "global_batch_size", "eval_loss", "eval_accuracy",
    "eval_accuracy_without_tta", "eval_examples", "eval_tta", "tensorflow_version",
    "keras_version")


def model_info(config: dict, summary: dict) -> dict:
    """model_info.json's content: the model and its data from a run's
    `config` (TrainConfig's fields, as in config.json), the training and
    its test results from `summary` (summary.json's keys, those known)."""
    info = {key: config[key] for key in MODEL_INFO_CONFIG_KEYS
            if key in config and config.get("dataset") in _ONLY_FOR.get(key, (config.get("dataset"),))}
    info.update((key, summary[key]) for key in _MODEL_INFO_SUMMARY_KEYS if key in summary)
    return info


def check_export_destination(model_dir: str) -> None:
    """Raises ConfigError if `<model_dir>/export` exists and is not an
    export this package wrote: a new export replaces the old one whole, so
    a user's file or directory of that name would be lost. Call before
    training, so that the refusal comes before hours of work."""
    path = os.path.join(model_dir, EXPORT_DIR)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not an export of this "
                          f"program, and a new export would replace it: move it away, pass "
                          f"--noexport, or choose another --model_dir")
    entries = os.listdir(path)
    # Ours: its entries are all an export's (some may be missing).
    if not set(entries) <= set(EXPORT_ENTRIES):
        others = sorted(set(entries) - set(EXPORT_ENTRIES))
        raise ConfigError(f"{quoted(path)} holds files that are not an export of this program "
                          f"({quoted(', '.join(others[:3]))}), and a new export would replace "
                          f"them: move it away, pass --noexport, or choose another --model_dir")


def check_exportable(model, name: str) -> None:
    """Raises ModelError if `model` cannot be written as the export's
    `.keras` file: a subclassed model, or a layer whose `__init__` took a
    value Keras cannot serialize, without a `get_config()`. Said before training, not after it (--model=`name`)."""
    import keras

    try:
        keras.saving.serialize_keras_object(model)
    except Exception as e:  # noqa: BLE001 - the user's get_config() may raise anything
        # Keras' message is a paragraph, then an example of get_config().
        said = " ".join(str(e).split("Example:")[0].split()) or type(e).__name__
        raise ModelError(
            f"--model={quoted(name)} cannot be saved as the export's {KERAS_FILE} "
            f"({type(e).__name__}: {quoted(said, limit=400)}): implement get_config(), returning "
            f"the arguments of its __init__ as numbers, strings and lists (docs/extending.md, "
            f"\"A subclassed model\"); or pass --noexport") from None


def export_is_whole(model_dir: str) -> bool:
    """Whether `<model_dir>/export` holds every entry an export has (not
    whether each reads back: predict finds that out)."""
    path = os.path.join(model_dir, EXPORT_DIR)
    return (all(os.path.lexists(os.path.join(path, name)) for name in EXPORT_ENTRIES)
            and os.path.isfile(os.path.join(path, SAVED_MODEL_DIR, "saved_model.pb")))


def export_model(model, model_dir: str, class_names: Sequence[str], image_shape,
                 info=None) -> str:
    """Exports `model` (logits out) to `<model_dir>/export/`: `saved_model/`
    for TF Serving, `model.keras` for Keras (its output the probabilities,
    without this package's layers), `classes.txt` (line i names class i) and,
    given `info` (see model_info), `model_info.json`. The new export replaces
    the old one only once it is complete, and never replaces what this
    package did not write (see check_export_destination).

    The SavedModel's serving signature takes `images` (uint8 [N, *image_shape],
    0-255) and returns `probabilities` (float32 [N, classes]); its
    `class_names` attribute holds the class names too.
    """
    check_export_destination(model_dir)
    final = os.path.join(model_dir, EXPORT_DIR)
    staging = os.path.join(model_dir,
                           f"{STAGING_PREFIX}{files.owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        _export_saved_model(model, os.path.join(staging, SAVED_MODEL_DIR), class_names,
                            image_shape)
        _keras_model_with_probabilities(model, image_shape).save(os.path.join(staging, KERAS_FILE))
        files.write_text(os.path.join(staging, CLASSES_FILE),
                         "".join(f"{c}\n" for c in class_names))
        if info is not None:
            files.write_json(os.path.join(staging, MODEL_INFO_NAME), info)
        if os.path.exists(final):
            retired = f"{staging}-old"
            os.replace(final, retired)
            os.replace(staging, final)
            shutil.rmtree(retired)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _keras_model_with_probabilities(model, image_shape):
    """`model` as a `.keras` file should hold it: Keras' own layers (it
    loads without this package) and a float32 softmax at the end."""
    import keras

    from distributed_mpt.core.models.layers import with_keras_layers

    plain = with_keras_layers(model)
    softmax = keras.layers.Activation("softmax", dtype="float32", name="probabilities")
    if isinstance(getattr(plain, "outputs", None), list):  # functional
        return keras.Model(plain.inputs, softmax(plain.outputs[0]), name=plain.name)
    # Subclassed: given its input, so that Keras saves a built model.
    return keras.Sequential([keras.Input(image_shape, dtype="uint8"), plain, softmax],
                            name=plain.name)


def _export_saved_model(model, path: str, class_names, image_shape) -> None:
    # Imported here: the entry points check flags before TensorFlow's slow
    # start-up.
    import keras
    import tensorflow as tf

    def serve(images):
        # A dict names the output: TF Serving, saved_model_cli and clients
        # see `probabilities` instead of Keras' default `output_0`.
        logits = tf.cast(model(images, training=False), tf.float32)
        return {"probabilities": tf.nn.softmax(logits)}

    archive = keras.export.ExportArchive()
    archive.track(model)
    # The first endpoint also becomes `serving_default`; the argument's name
    # (`images`) names the input.
    archive.add_endpoint("serve", serve, input_signature=[
        tf.TensorSpec([None, *image_shape], tf.uint8, name="images")])
    # Loaded back, `.class_names[0]` is a string tensor: the names travel
    # inside the SavedModel, not only beside it.
    archive.add_variable_collection(
        "class_names", [tf.Variable(list(class_names), trainable=False, name="class_names")])
    archive.write_out(path, verbose=False)
