"""Files a run leaves in --model_dir, each written whole or not at all.

A reader (a user, a dashboard, the next run) never sees half a file: each is
written under a temporary name in the same directory and renamed into place,
which is atomic on POSIX file systems.
"""

import errno
import json
import os
import shutil
import stat
import sys
import tempfile
import uuid
from typing import List, Optional, Tuple

from distributed_mpt.errors import ConfigError, UserError, first_line

# Prefixes of the temporary names this module writes under; run_lock.py
# clears what a killed run left with them.
TEMPORARY_PREFIX = ".tmp-"          # write_text, before its rename
WRITE_TEST_PREFIX = ".write-test-"  # check_writable
EXPORT_STAGING_PREFIX = ".export-"  # export_model: staging, retired export

# What a run keeps in --model_dir, by kind. Each is checked before training
# (check_model_dir_layout): a user's file named `export`, or a directory
# named `summary.json`, is refused then, not found after hours of training.
MODEL_DIR_DIRECTORIES = ("checkpoints", "tensorboard")  # and export/: check_export_destination
MODEL_DIR_FILES = ("config.json", "summary.json", "metrics.jsonl", "checkpoints/model.json",
                   "checkpoints/checkpoint")

# Far above any file a run writes (metrics.jsonl grows by ~200 bytes a
# line): a bigger one is not ours, and is refused before it is read.
_MAX_READ_BYTES = 1 << 28


class DamagedFileError(UserError):
    """A file in --model_dir is not what this program wrote there."""


def warn(message: str) -> None:
    """One `warning:` line on stderr: something was repaired, the run goes on."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def check_writable(directory: str, flag: str = "--model_dir") -> None:
    """Creates `directory` if needed and proves it writable, or raises
    ConfigError naming `flag`, the flag that chose it."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        kind = _kind_of(directory)
        raise ConfigError(f"{flag}={directory} is {kind}, not a directory: choose a directory "
                          f"(it is created if missing)")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=WRITE_TEST_PREFIX):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}={directory} is not writable ({e.strerror}); "
                          f"choose a directory you can write to") from None


def _kind_of(path: str) -> str:
    """What the existing `path`, not a directory, is: for error messages."""
    return ("a symbolic link to nothing" if not os.path.exists(path) else
            "a file" if os.path.isfile(path) else "a special file")


def write_json(path: str, data) -> None:
    """Writes `data` as pretty JSON to `path` atomically."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: Exception) -> bool:
    """True if `error` is a write that found no space (or quota) left."""
    if isinstance(error, OSError):
        return error.errno in _DISK_FULL
    # TensorFlow reports a failed write as ResourceExhaustedError with the
    # C library's message; out-of-memory is ResourceExhaustedError too.
    return any(os.strerror(code) in str(error) for code in _DISK_FULL)


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` atomically (temporary file, fsync, rename);
    a failed write leaves no temporary file behind."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=TEMPORARY_PREFIX,
                                     delete=False) as f:
        try:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            os.remove(f.name)
            raise
    # Temporary files are private (0600); the result is for everyone the
    # umask allows, like any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)
    os.replace(f.name, path)


def check_model_dir_layout(model_dir: str, export: bool = True) -> None:
    """Raises ConfigError if something in `model_dir` is not the kind of
    thing a run keeps under its name (a file where a directory belongs, a
    directory or a FIFO where a file belongs, and with `export` anything at
    export/ that is not an export of this program). Nothing is moved or
    deleted: it may be the user's."""
    if export:
        check_export_destination(model_dir)
    for name in MODEL_DIR_DIRECTORIES:
        path = os.path.join(model_dir, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"{path} is not a directory, but a run keeps its {name} there: "
                              f"move it away, or choose another --model_dir")
    for name in MODEL_DIR_FILES:
        path = os.path.join(model_dir, name)
        if os.path.lexists(path) and not _is_regular_file(path):
            raise ConfigError(f"{path} is not a regular file, but a run writes its "
                              f"{os.path.basename(name)} there: move it away, or choose another "
                              f"--model_dir")


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # a dangling symlink, a loop
        return False


def read_text(path: str, remedy: str) -> Optional[str]:
    """The text of the regular file at `path`, decoded strictly as UTF-8;
    None if there is nothing there. Anything else (a FIFO, a directory, a
    huge or undecodable file) raises DamagedFileError, which names the file
    and `remedy`, the way out."""
    if not os.path.lexists(path):
        return None
    if not _is_regular_file(path):  # a FIFO would block the read forever
        raise DamagedFileError(f"{path} is not a regular file; {remedy}")
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_READ_BYTES + 1)
    except OSError as e:
        raise DamagedFileError(f"cannot read {path} ({e.strerror}); {remedy}") from None
    if len(raw) > _MAX_READ_BYTES:
        raise DamagedFileError(f"{path} is larger than any file this program writes "
                               f"({_MAX_READ_BYTES:,} bytes); {remedy}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"{path} is damaged (not UTF-8 text at byte {e.start}); "
                               f"{remedy}") from None


def read_json(path: str, fields: Optional[dict] = None,
              remedy: str = "restore an intact copy, or move it away") -> dict:
    """The JSON object in `path`, as this program writes it; {} if there is
    no file. `fields` maps keys the object must have to their type (or a
    tuple of types). Raises DamagedFileError, naming the file, what is wrong
    and `remedy`, if it is anything else."""
    text = read_text(path, remedy)
    if text is None:
        return {}
    data, problem = _parse_record(text, fields or {})
    if problem:
        raise DamagedFileError(f"{path} is damaged ({problem}); {remedy}")
    return data


def read_jsonl(path: str, fields: Optional[dict] = None) -> Tuple[List[dict], Optional[str]]:
    """The records of a JSON-lines file up to its first damaged line, and
    what is wrong with that line (None if nothing is). A last line cut short
    by a killed writer counts as damaged. No file: no records.

    `fields` as for read_json. Raises DamagedFileError only if `path` is
    not a regular file or is too big to be ours."""
    remedy = "move it away, or choose another --model_dir"
    if not os.path.lexists(path):
        return [], None
    if not _is_regular_file(path):
        raise DamagedFileError(f"{path} is not a regular file; {remedy}")
    if os.path.getsize(path) > _MAX_READ_BYTES:
        raise DamagedFileError(f"{path} is larger than any file this program writes; {remedy}")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records, torn = [], lines.pop()  # after the last newline: b"" unless cut short
    for number, line in enumerate(lines, 1):
        try:
            record, problem = _parse_record(line.decode("utf-8"), fields or {})
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        if problem:
            return records, f"line {number} is damaged ({problem})"
        records.append(record)
    if torn:
        return records, "its last line was cut short"
    return records, None


def _parse_record(text: str, fields: dict) -> Tuple[Optional[dict], Optional[str]]:
    """The JSON object in `text` and None, or None and what is wrong."""
    try:
        data = json.loads(text)
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as e:
        return None, f"not JSON: {first_line(e, 80)}"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    for key, kind in fields.items():
        if key not in data:
            return None, f"no {key!r}"
        # JSON has no integers apart from numbers: true is not a step.
        if not isinstance(data[key], kind) or (isinstance(data[key], bool) and kind is not bool):
            return None, f"{key!r} is a {type(data[key]).__name__}"
    return data, None


# CIFAR-10's classes in label order (tensorflow-datasets' and Krizhevsky's).
CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer",
               "dog", "frog", "horse", "ship", "truck")


# What export_model writes into <model_dir>/export/: the model for TF
# Serving and for Keras, the class names, and beside them what the model is
# and what it was trained on, so that whoever uses it (distributed-mpt-predict
# first) can say what its answers are worth (keys as in config.json and
# summary.json).
EXPORT_DIR = "export"  # in model_dir
SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
CLASSES_FILE = "classes.txt"
MODEL_INFO_NAME = "model_info.json"
EXPORT_ENTRIES = (SAVED_MODEL_DIR, KERAS_FILE, CLASSES_FILE, MODEL_INFO_NAME)
# The settings it records, TrainConfig's fields (synthetic_examples only for
# --dataset=synthetic, where it and the seed regenerate the test split).
MODEL_INFO_CONFIG_KEYS = ("model", "model_width", "dataset", "seed", "synthetic_examples")
_MODEL_INFO_SUMMARY_KEYS = (
    "precision", "steps", "epochs", "global_batch_size", "eval_loss", "eval_accuracy",
    "eval_accuracy_without_tta", "eval_examples", "eval_tta", "tensorflow_version",
    "keras_version")


def model_info(config: dict, summary: dict) -> dict:
    """model_info.json's content: the model and its data from a run's
    `config` (TrainConfig's fields, as in config.json), the training and
    its test results from `summary` (summary.json's keys, those known)."""
    info = {key: config[key] for key in MODEL_INFO_CONFIG_KEYS
            if key != "synthetic_examples" or config["dataset"] == "synthetic"}
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
        kind = "a symbolic link" if os.path.islink(path) else _kind_of(path)
        raise ConfigError(f"{path} is {kind}, not an export of this program, and a new "
                          f"export would replace it: move it away, pass --noexport, or choose "
                          f"another --model_dir")
    entries = os.listdir(path)
    # Ours: it has a SavedModel, or is an export with parts deleted.
    if entries and not (os.path.isdir(os.path.join(path, SAVED_MODEL_DIR))
                        or set(entries) <= set(EXPORT_ENTRIES)):
        raise ConfigError(f"{path} holds files that are not an export of this program "
                          f"({', '.join(sorted(entries)[:3])}), and a new export would replace "
                          f"them: move it away, pass --noexport, or choose another "
                          f"--model_dir")


def export_is_whole(model_dir: str) -> bool:
    """Whether `<model_dir>/export` holds every entry an export has (not
    whether each reads back: predict finds that out)."""
    path = os.path.join(model_dir, EXPORT_DIR)
    return (all(os.path.lexists(os.path.join(path, name)) for name in EXPORT_ENTRIES)
            and os.path.isfile(os.path.join(path, SAVED_MODEL_DIR, "saved_model.pb")))


def export_model(model, model_dir: str, info=None, class_names=CLASS_NAMES) -> str:
    """Exports `model` to `<model_dir>/export/`: `saved_model/` for TF Serving,
    `model.keras` for Keras, `classes.txt` (line i names class i) and, given
    `info` (see model_info), `model_info.json`. The new export replaces the
    old one only once it is complete, and never replaces what this package
    did not write (see check_export_destination).

    The SavedModel's serving signature takes `images` (uint8 [N, 32, 32, 3],
    0-255) and returns `probabilities` (float32 [N, classes]); its
    `class_names` attribute holds the class names too.
    """
    # Imported here: it loads TensorFlow (see _export_saved_model).
    from distributed_mpt.training.models import with_keras_layers

    check_export_destination(model_dir)
    final = os.path.join(model_dir, EXPORT_DIR)
    staging = os.path.join(model_dir, f"{EXPORT_STAGING_PREFIX}{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        _export_saved_model(model, os.path.join(staging, SAVED_MODEL_DIR), class_names)
        with_keras_layers(model).save(os.path.join(staging, KERAS_FILE))
        write_text(os.path.join(staging, CLASSES_FILE), "".join(f"{c}\n" for c in class_names))
        if info is not None:
            write_json(os.path.join(staging, MODEL_INFO_NAME), info)
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


def _export_saved_model(model, path: str, class_names) -> None:
    # Imported here: the entry points use this module's other helpers to
    # check flags before TensorFlow's slow start-up.
    import keras
    import tensorflow as tf

    def serve(images):
        # A dict names the output: TF Serving, saved_model_cli and clients
        # see `probabilities` instead of Keras' default `output_0`.
        return {"probabilities": model(images, training=False)}

    archive = keras.export.ExportArchive()
    archive.track(model)
    # The first endpoint also becomes `serving_default`; the argument's name
    # (`images`) names the input.
    archive.add_endpoint("serve", serve, input_signature=[
        tf.TensorSpec([None, *model.input_shape[1:]], tf.uint8, name="images")])
    # Loaded back, `.class_names[0]` is a string tensor: the names travel
    # inside the SavedModel, not only beside it.
    archive.add_variable_collection(
        "class_names", [tf.Variable(list(class_names), trainable=False, name="class_names")])
    archive.write_out(path, verbose=False)
