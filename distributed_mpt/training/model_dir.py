"""What a run keeps in --model_dir, and the rule that it touches nothing
else: a directory is the package's once its marker file is in it, and a
run refuses a directory that holds files without that marker (unless told
to adopt it), so that a typo in --model_dir cannot overwrite a user's
config.json or delete their `.tmp-notes`.

    <model_dir>/
      .distributed_mpt   the marker: this directory holds runs of this package
      .lock              one run at a time (process/run_lock.py)
      config.json summary.json metrics.jsonl checkpoints/ tensorboard/ export/

Everything here is checked before TensorFlow starts and before anything is
written, so a refusal costs nothing and changes nothing.
"""

import json
import os
import re
import shutil
from typing import List

from distributed_mpt import files
from distributed_mpt.errors import ConfigError, quoted
from distributed_mpt.process.run_lock import LOCK_NAME
from distributed_mpt.training.export import EXPORT_DIR, STAGING_PREFIX, check_export_destination

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
# What a killed run leaves: temporary names that carry its owner tag
# (files.owner_tag), which the lock file recorded while it held the
# directory; tempfile adds 8 characters, the export's staging 8 hex digits.
# A user's `.tmp-notes` or `.export-backup` carries no tag: never taken.
_TAG = r"\d+-[0-9a-f]{8}"
_TEMPFILE = r"[a-z0-9_]{8}"
# What TensorFlow leaves of a checkpoint save cut short, in the run's own
# checkpoints/: its names, which cannot carry a tag.
CHECKPOINT_DEBRIS = (re.compile(r"ckpt-\d+_temp.*"),        # SaveV2 writes shards here, then merges
                     re.compile(r"ckpt-\d+\..*\.tempstate\d+"),  # a file not yet renamed
                     re.compile(r"checkpoint\.tmp[0-9a-f]+"))   # the index, not yet renamed


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
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not a directory, but a "
                              f"run keeps its {name} there: move it away, or choose another "
                              f"--model_dir")
    for name in (*FILES, LOCK_NAME):
        path = os.path.join(model_dir, name)
        if os.path.lexists(path) and (os.path.islink(path) or not files.is_regular_file(path)):
            raise ConfigError(f"{quoted(path)} is {files.kind_of(path)}, not a regular file, but "
                              f"a run writes its {os.path.basename(name)} there: move it away, or "
                              f"choose another --model_dir")


def check_ours(model_dir: str, adopt: bool = False) -> None:
    """Raises ConfigError if `model_dir` holds files and no marker of this
    package (nor, from before the marker existed, a run's checkpoints/
    model.json), naming some of them; `adopt` (--adopt_model_dir) accepts it."""
    if adopt or not os.path.isdir(model_dir) or is_ours(model_dir):
        return
    # Not what a run of this package writes before its marker: the lock file,
    # and, by their exact shapes, the write test and the marker's temporary
    # file. A second run started at that moment (or after a run killed in
    # between) must go on to the lock, to be told the directory is busy or
    # to take it over, as the lock decides.
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


def remove_debris(model_dir: str, tags=()) -> List[str]:
    """Removes what a killed run of this package left in the marked
    `model_dir`: its temporary names, which carry one of `tags` (the owner
    tags the lock file recorded: RunLock.previous_tags), and TensorFlow's in
    checkpoints/ (`debris`); returns the paths removed. Only under the run
    lock: a running run's temporary files look the same."""
    if not is_ours(model_dir):
        return []
    removed = []
    for folder, patterns in debris(tags).items():
        removed += remove_matching(os.path.join(model_dir, folder), patterns)
    return removed


def remove_matching(directory: str, patterns) -> List[str]:
    """Removes the entries of `directory` whose names match one of the
    compiled `patterns` (symlinks are removed, never followed); returns
    their paths."""
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
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        removed.append(path)
    return removed


__all__ = ["BEFORE_TRAINING", "CHECKPOINT_DEBRIS", "DIRECTORIES", "EXPORT_DIR", "FILES", "MARKER", "check_layout", "check_ours",
           "debris", "is_ours", "mark", "remove_debris", "remove_matching"]
