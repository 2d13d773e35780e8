"""What a run leaves in --model_dir, and the rule that it touches nothing else: a
directory is the package's once its marker file is in it, and a run refuses a directory
that holds files without that marker (unless told to adopt it), so that a typo in
--model_dir cannot overwrite a user's config.json or delete their `.tmp-notes`.

    <model_dir>/
      .distributed_mpt   the marker: this directory holds runs of this package
      .lock              one run at a time (process/run_lock.py)
      config.json summary.json metrics.jsonl checkpoints/ tensorboard/
      export/            the model for TF Serving and for Keras, its class
                         names, and what it is and was trained on

The layout is checked before TensorFlow starts and anything is written: a
refusal costs nothing and changes nothing. The export says what it is, so
that whoever uses it (distributed-mpt-predict first) can say what its answers
are worth; it is written whole, then moved into place: a reader never sees half.
"""

import contextlib
import glob
import json
import os
import re
import shutil
import uuid
from typing import List, Sequence

from distributed_mpt import files
from distributed_mpt.core.data import DATASETS
from distributed_mpt.core.models import MODELS, contract
from distributed_mpt.errors import ConfigError, quoted
from distributed_mpt.json_lines import JsonLines
from distributed_mpt.process.run_lock import LOCK_NAME

MARKER = ".distributed_mpt"
# What a run keeps, by kind. A user's file where a directory belongs, or a
# directory or FIFO where a file belongs, is refused before training, not
# found after hours of it.
DIRECTORIES = ("checkpoints", "tensorboard")  # and export/: check_export_destination
# What a run writes into a new directory before its first step: all that a
# stop there removes again (the lock file aside).
BEFORE_TRAINING = (MARKER, "config.json", "metrics.jsonl", "tensorboard")
FILES = ("config.json", "summary.json", "metrics.jsonl", "checkpoints/model.json",
         "checkpoints/checkpoint")
# What a killed run leaves: temporary names that carry its owner tag (files.owner_tag), which
# the lock file recorded while it held the directory; tempfile adds 8 characters, the export's
# staging 8 hex digits. A user's `.tmp-notes` or `.export-backup` carries no tag: never taken.
_TAG = r"\d+-[0-9a-f]{8}"
_TEMPFILE = r"[a-z0-9_]{8}"
# What TensorFlow leaves of a checkpoint save cut short, in the run's own
# checkpoints/: its names, which cannot carry a tag.
CHECKPOINT_DEBRIS = (re.compile(r"ckpt-\d+_temp.*"),        # SaveV2 writes shards here, then merges
                     re.compile(r"ckpt-\d+\..*\.tempstate\d+"),  # a file not yet renamed
                     re.compile(r"checkpoint\.tmp[0-9a-f]{32}"))  # the index: uuid4().hex


def debris(tags) -> dict:
    """Patterns of what runs that wrote under `tags` (owner tags) leave, by
    folder of the model directory."""
    tag = f"({'|'.join(re.escape(t) for t in tags)})" if tags else "(?!)"
    temporary = re.compile(re.escape(files.TEMPORARY_PREFIX) + tag + "-" + _TEMPFILE)
    return {"": (temporary,
                 re.compile(re.escape(files.WRITE_TEST_PREFIX) + tag + "-" + _TEMPFILE),
                 re.compile(re.escape(STAGING_PREFIX) + tag + r"-[0-9a-f]{8}(-old)?")),
            "checkpoints": (temporary, *CHECKPOINT_DEBRIS)}  # model.json's, the index's


# What a run writes before its marker, of any run: another run started at
# that moment goes on to the lock, which decides.
_STARTING = (re.compile(re.escape(files.TEMPORARY_PREFIX) + _TAG + "-" + _TEMPFILE),
             re.compile(re.escape(files.WRITE_TEST_PREFIX) + _TAG + "-" + _TEMPFILE))


def check_layout(model_dir: str, export: bool = True) -> None:
    """Raises ConfigError if something in `model_dir` is not the kind of
    thing a run keeps under its name (and with `export`, anything at export/
    that is not an export of this program). Nothing is moved or deleted."""
    if export:
        check_export_destination(model_dir)
    for name in DIRECTORIES:
        path = os.path.join(model_dir, name)
        if os.path.islink(path):
            # A run removes what its killed runs left in its folders, by the
            # names TensorFlow gives them: where a link leads, those names
            # may be another's files (a user's `checkpoint.tmp42` was).
            raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, and a run writes and "
                              f"removes files in its {name} folder: make it a directory of its "
                              f"own, or point --model_dir itself at the other file system")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not a directory, but a run "
                              f"keeps its {name} there: move it away, or choose another --model_dir")
    for name in (*FILES, LOCK_NAME):
        path = os.path.join(model_dir, name)
        if os.path.lexists(path) and (os.path.islink(path) or not files.is_regular_file(path)):
            raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not a regular file, but "
                              f"a run writes its {os.path.basename(name)} there: move it away, or "
                              f"choose another --model_dir")


def check_parts_writable(model_dir: str, export: bool = True) -> None:
    """Raises ConfigError if a part of `model_dir` a run writes in place
    exists and this user cannot write it (another user's, a read-only
    mount): found before TensorFlow starts, not after the steps before a
    checkpoint, or the export. With `export`, every folder of export/."""
    parts = [(os.path.join(model_dir, name), f"a run writes its {name} there", False)
             for name in DIRECTORIES]
    parts.append((os.path.join(model_dir, "metrics.jsonl"), "a run appends to it", False))
    if export:  # replaced whole: the old one is listed and removed, folder by folder
        top = os.path.join(model_dir, EXPORT_DIR)
        parts += [(path, _REPLACES_EXPORT, True) for path in
                  [top, *(os.path.join(root, d) for root, ds, _ in os.walk(top) for d in ds)]]
    for path, what, listed in parts:
        if os.path.exists(path):
            _refuse_unwritable(path, what, listed)


def _refuse_unwritable(path: str, what: str, listed: bool) -> None:
    """ConfigError if this user may not write the existing `path` (nor, if `listed`,
    list it), where `what` says why a run must: the way out is to make it so."""
    why = files.why_no_access(path, os.R_OK | os.X_OK) if listed else None
    lacks = "cannot be listed" if why else "is not writable"
    why = why or files.why_no_access(path, os.W_OK | os.X_OK * os.path.isdir(path))
    if why:
        raise ConfigError(f"{quoted(path)} {lacks} ({why}), and {what}: make it "
                          f"{'readable and ' if listed else ''}writable for this user, "
                          f"{'pass --noexport, ' if listed else ''}or choose another --model_dir")


def check_ours(model_dir: str, adopt: bool = False) -> None:
    """Raises ConfigError if `model_dir` holds files and no marker of this
    package (nor, from before the marker existed, a run's checkpoints/
    model.json), naming some of them; `adopt` (--adopt_model_dir) accepts it."""
    if adopt or not os.path.isdir(model_dir) or is_ours(model_dir):
        return
    # Not what a run writes before its marker: the lock file, and, by their exact shapes,
    # the write test and the marker's temporary file. A second run started then (or after a
    # run killed in between) must go on to the lock: to be told it is busy, or to take over.
    entries = sorted(name for name in os.listdir(model_dir)
                     if name != LOCK_NAME and not any(p.fullmatch(name) for p in _STARTING))
    if entries:
        raise ConfigError(
            f"--model_dir={quoted(model_dir)} holds files this program did not write "
            f"({quoted(', '.join(entries[:5]))}{', ...' if len(entries) > 5 else ''}): "
            f"choose a new or empty directory, or pass --adopt_model_dir to train there (a run "
            f"then writes {', '.join(FILES[:3])}, checkpoints/, tensorboard/ and export/)")


def is_ours(model_dir: str) -> bool:
    """Whether `model_dir` carries this package's marker, or the identity
    record a run of it wrote beside its checkpoints before markers existed."""
    if files.is_regular_file(os.path.join(model_dir, MARKER)):
        return True
    try:
        record = files.read_json(os.path.join(model_dir, "checkpoints", "model.json"))
    except files.DamagedFileError:
        return False
    return {"model", "precision", "variable_shapes"} <= set(record)


def mark(model_dir: str) -> None:
    """Puts the marker into `model_dir` (the chief, holding the lock)."""
    path = os.path.join(model_dir, MARKER)
    if not files.is_regular_file(path):
        files.write_text(path, json.dumps({"written_by": "distributed_mpt"}) + "\n")


# What every record of metrics.jsonl holds; a line without them is damaged.
METRICS_FIELDS = {"step": int, "elapsed_seconds": (int, float)}


def keep_metrics(path: str, kept) -> float:
    """Keeps the records of a run's metrics.jsonl at `path` for which `kept(record)` holds,
    and no damaged line (said in a warning); returns the seconds of the earlier runs it records.
    A line at a time, however long the log (one of 1.3 M records, of --log_every_steps=1, was
    too large to read whole: the run could not resume); rewritten only if a line goes, or made."""
    log = JsonLines(path, METRICS_FIELDS)
    # The earlier runs' time counts whole: that of the records dropped was spent too, if
    # on steps now redone. A new run's log is made before its first step.
    seconds, records, rewrite = 0.0, 0, not os.path.lexists(path)
    for record, _ in log:
        seconds, records = max(seconds, record["elapsed_seconds"]), records + 1
        rewrite = rewrite or not kept(record)
    if log.problems:  # a damaged line costs that line only
        files.warn(f"{quoted(path)}: {'; '.join(log.problems)}; rewritten without "
                   f"{'it' if len(log.problems) == 1 else 'them'} ({records} records kept)")
    if log.problems or rewrite:
        with files.replacing(path) as rewritten:
            for record, line in log:
                if kept(record):
                    rewritten.write(line)
    return seconds


def remove_debris(model_dir: str, tags=()) -> List[str]:
    """Removes what a killed run of this package left in the marked `model_dir`: its
    temporary names, which carry one of `tags` (the owner tags the lock file recorded:
    RunLock.previous_tags), and TensorFlow's in checkpoints/ (`debris`); returns the paths
    removed. Only under the run lock: a running run's temporary files look the same."""
    if not is_ours(model_dir):
        return []
    return [path for folder, patterns in debris(tags).items()
            for path in remove_matching(os.path.join(model_dir, folder), patterns)]


def remove_matching(directory: str, patterns) -> List[str]:
    """Removes the entries of `directory` whose names match one of the compiled
    `patterns` (symlinks removed, never followed); returns their paths."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        if not any(p.fullmatch(name) for p in patterns):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(path)
    return removed


# The export: what a run trained, for whoever uses it.
EXPORT_DIR = "export"  # in model_dir
SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
CLASSES_FILE = "classes.txt"
MODEL_INFO_NAME = "model_info.json"
EXPORT_ENTRIES = (SAVED_MODEL_DIR, KERAS_FILE, CLASSES_FILE, MODEL_INFO_NAME)
# Staging, and a retired export, beside the export: what a killed export leaves.
STAGING_PREFIX = ".export-"
_REPLACES_EXPORT = "a new export removes the old one"  # why a run must list and write export/
# The settings model_info.json records, TrainConfig's fields: what the model
# is and its data, from which predict --evaluate rebuilds the test split (the
# seed draws synthetic data and a held-out split; each dataset's own options,
# DatasetSpec.reads, only for that dataset).
_DATASETS_OPTIONS = tuple(dict.fromkeys(option for spec in DATASETS.values() for option in spec.reads))
DATA_INFO_KEYS = ("dataset", "seed", *_DATASETS_OPTIONS)
MODEL_INFO_CONFIG_KEYS = ("model", "model_width", *DATA_INFO_KEYS)
_MODEL_INFO_SUMMARY_KEYS = (
    "precision", "steps", "epochs", "global_batch_size", "eval_loss", "eval_accuracy",
    "eval_accuracy_without_tta", "eval_examples", "eval_tta", "tensorflow_version",
    "keras_version")


def model_info(config: dict, summary: dict, data_fingerprint=None) -> dict:
    """model_info.json's content: the model and its data from a run's
    `config` (the flags by name: TrainConfig.flags(), or a config.json read back with
    config.flat_record), the training and its test results from `summary` (summary.json's
    keys, those known), and the `data_fingerprint` it trained on (core/data's Dataset's;
    predict --evaluate draws a held-out test split again only from the same files)."""
    spec = DATASETS.get(config.get("dataset"))
    others = set(_DATASETS_OPTIONS) - set(spec.reads if spec else ())
    info = {key: config[key] for key in MODEL_INFO_CONFIG_KEYS if key in config and key not in others}
    info.update((key, summary[key]) for key in _MODEL_INFO_SUMMARY_KEYS if key in summary)
    return {**info, "data_fingerprint": data_fingerprint} if data_fingerprint else info


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
    try:
        entries = os.listdir(path)
    except PermissionError:  # was reported as a write that failed, "make it writable"
        _refuse_unwritable(path, _REPLACES_EXPORT, listed=True)
        raise
    # Ours: its entries are all an export's (some may be missing).
    others = sorted(set(entries) - set(EXPORT_ENTRIES))
    if others:
        raise ConfigError(f"{quoted(path)} holds files that are not an export of this program "
                          f"({quoted(', '.join(others[:3]))}), and a new export would replace "
                          f"them: move it away, pass --noexport, or choose another --model_dir")


def export_is_whole(model_dir: str) -> bool:
    """Whether `<model_dir>/export` holds every entry an export has, its SavedModel's graph,
    variables' index and data, and a fingerprint that reads back (the rest, predict finds out)."""
    saved_model = os.path.join(model_dir, EXPORT_DIR, SAVED_MODEL_DIR)
    variables = os.path.join(saved_model, "variables")
    data = glob.glob(os.path.join(glob.escape(variables), "variables.data-*"))
    return (all(os.path.lexists(os.path.join(model_dir, EXPORT_DIR, n)) for n in EXPORT_ENTRIES)
            and bool(data) and all(os.path.isfile(p) for p in (
                os.path.join(saved_model, "saved_model.pb"), f"{variables}/variables.index", *data))
            and not fingerprint_is_damaged(saved_model))


def fingerprint_is_damaged(saved_model: str) -> bool:
    """Whether the SavedModel folder `saved_model` holds a fingerprint.pb
    that does not read back or holds no checksum (none, as TensorFlow before
    2.12 wrote, is no damage): TensorFlow loads past it, under a traceback."""
    import tensorflow as tf

    path = os.path.join(saved_model, "fingerprint.pb")
    # TensorFlow reads it whole: a real one (95 bytes) padded to 2 GB took 60 s and 6 GB
    # (2 cores of a Zen 5 AMD EPYC), and passed. A FIFO would hang the read.
    try:
        if not files.is_regular_file(path) or os.path.getsize(path) > 64 << 10:  # new fields' room
            return os.path.lexists(path)
    except FileNotFoundError:  # gone meanwhile: missing, not damaged
        return False
    with contextlib.suppress(RuntimeError, FileNotFoundError):
        return not tf.saved_model.experimental.read_fingerprint(saved_model).saved_model_checksum
    return True


def export_model(model, model_dir: str, class_names: Sequence[str], image_shape,
                 info=None, check_held=lambda: None) -> str:
    """Exports `model` (logits out) to `<model_dir>/export/`: `saved_model/` for TF Serving,
    `model.keras` for Keras (its output the probabilities, without this package's layers),
    `classes.txt` (line i names class i) and, given `info` (see model_info), `model_info.json`.
    It replaces the old export only once complete, if `check_held()` finds --model_dir still
    this run's, and never what this package did not write (check_export_destination). The
    SavedModel's serving signature takes `images` (uint8 [N, *image_shape], 0-255) and returns
    `probabilities` (float32 [N, classes]); its `class_names` attribute holds the names too."""
    import tensorflow as tf  # for its errors, which are a write's: not the model's
    check_export_destination(model_dir)
    check_held()  # a finished run on a read-only mount, its export missing: that is said
    final, name = os.path.join(model_dir, EXPORT_DIR), (info or {}).get("model")
    staging = os.path.join(model_dir,
                           f"{STAGING_PREFIX}{files.owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)  # not makedirs: a --model_dir taken away is not made again
    try:  # a user's model's code failing here (a get_config() raising again): one line
        with (contract.users_code(name, "failed in the export, after training; run again "
                                  f"with --noexport to finish ({contract.CHANGED})",
                                  (OSError, MemoryError, tf.errors.OpError))
              if name and name not in MODELS else contextlib.nullcontext()):
            _export_saved_model(model, os.path.join(staging, SAVED_MODEL_DIR), class_names,
                                image_shape)
            _keras_model_with_probabilities(model, image_shape).save(f"{staging}/{KERAS_FILE}")
        files.write_text(os.path.join(staging, CLASSES_FILE),
                         "".join(f"{c}\n" for c in class_names))
        if info is not None:
            files.write_json(os.path.join(staging, MODEL_INFO_NAME), info)
        for folder in [os.path.join(root, d) for root, ds, _ in os.walk(staging) for d in ds]:
            os.chmod(folder, 0o777 & ~files.umask())  # not TensorFlow's 755: a team's to replace
        check_held()
        if os.path.exists(final):
            os.replace(final, f"{staging}-old")
            os.replace(staging, final)
            shutil.rmtree(f"{staging}-old")
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
    # A name none of its layers has: a user's last layer named "probabilities" (a Dense
    # with a softmax, dropped for training) failed the export after training, "used 2 times".
    taken = {plain.name, *(layer.name for layer in plain.layers)}
    names = ["probabilities", *(f"probabilities_{i}" for i in range(1, len(taken) + 1))]
    softmax = keras.layers.Activation("softmax", dtype="float32",
                                      name=next(name for name in names if name not in taken))
    if isinstance(getattr(plain, "outputs", None), list):  # functional
        return keras.Model(plain.inputs, softmax(plain.outputs[0]), name=plain.name)
    # Subclassed: given its input, so that Keras saves a built model.
    return keras.Sequential([keras.Input(image_shape, dtype="uint8"), plain, softmax],
                            name=plain.name)


def _export_saved_model(model, path: str, class_names, image_shape) -> None:
    # Imported here: the entry points check flags before TensorFlow's slow start-up.
    import keras
    import tensorflow as tf

    def serve(images):
        # A dict names the output: TF Serving, saved_model_cli and clients
        # see `probabilities` instead of Keras' default `output_0`.
        logits = tf.cast(model(images, training=False), tf.float32)
        return {"probabilities": tf.nn.softmax(logits)}

    archive = keras.export.ExportArchive()
    archive.track(model)
    # The first endpoint is also `serving_default`; its argument's name, `images`, names the input.
    archive.add_endpoint("serve", serve, input_signature=[
        tf.TensorSpec([None, *image_shape], tf.uint8, name="images")])
    # Loaded back, `.class_names[0]` is a string tensor: the names travel
    # inside the SavedModel, not only beside it.
    archive.add_variable_collection(
        "class_names", [tf.Variable(list(class_names), trainable=False, name="class_names")])
    archive.write_out(path, verbose=False)
