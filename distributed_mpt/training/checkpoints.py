"""Checkpoints that make every run resumable, on one worker or many.

Every worker saves (MultiWorkerMirroredStrategy needs all of them to take
part), but only the chief writes into `<model_dir>/checkpoints`; the others
write into a private scratch directory that they delete. Each worker restores
from its --model_dir, the chief's on a shared file system; the workers agree
on the weights they restored (plan.check_workers_agree), so a restarted group
starts from one state.

A run restores the newest checkpoint that reads back whole, found by listing
the files (a crash, a full disk or a user can leave the `checkpoint` index
file garbage), skips damaged newer ones, saying why, and rewrites the index.
When checkpoints exist and none reads back, it stops and changes nothing,
never starting from step 0 over them. `model.json` beside them records the
model they hold: a run of another model refuses the directory instead of
failing deep in TensorFlow or overwriting it.
"""

import contextlib
import dataclasses
import glob
import hashlib
import math
import os
import re
import shutil
import stat
import tempfile
import time
from typing import List, Optional, Tuple

import tensorflow as tf

from distributed_mpt import files
from distributed_mpt.errors import CheckpointMismatchError, UserError, first_line, quoted
from distributed_mpt.training.outputs import debris, remove_matching

MAX_TO_KEEP = 3
RANDOM_STATE = "random_state"  # the random layers' (training.build); absent before 2026-12

_CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(index|data-\d+-of-\d+)$")
# A step is an int64 in TensorFlow: a name with a larger number was not saved
# by a run, and a save can never pass it.
_LARGEST_STEP = 2**63 - 1
# The index file TensorFlow's CheckpointManager keeps (a text protobuf,
# CheckpointState), and the lines of it that this module reads and writes.
_INDEX_FILE = "checkpoint"
_INDEX_LINE = re.compile(r'(model_checkpoint_path|all_model_checkpoint_paths): "(ckpt-\d+)"'
                         r'|(all_model_checkpoint_timestamps|last_preserved_timestamp): '
                         r'[0-9.e+-]+')


class CheckpointDamagedError(UserError):
    """--model_dir holds checkpoints and none of them can be read back."""


class DiskFullError(UserError):
    """A checkpoint did not fit on its file system."""


def model_identity(model, precision: str, name: Optional[str] = None) -> dict:
    """What must match for a checkpoint to be restorable into `model` trained
    under `precision` (mixed_float16 adds loss-scaling state): its `name`
    (default: the model's own), precision and variable shapes."""
    # Shapes in order, not names: Keras numbers layer names per process.
    return {"model": name or model.name, "precision": precision,
            "variable_shapes": [list(v.shape) for v in model.weights]}


def _parameters(identity: dict) -> int:
    return sum(math.prod(shape) for shape in identity.get("variable_shapes", []))


def checkpoint_bytes(**trackables) -> int:
    """Bytes of one checkpoint of `trackables`: every variable they hold,
    optimizer slots included (the files add a few kB of index)."""
    variables = []
    for trackable in trackables.values():
        variables += ([trackable] if isinstance(trackable, tf.Variable) else
                      trackable if isinstance(trackable, list) else trackable.variables)
    # Keras variables give their shape as a tuple and dtype as a name.
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


@dataclasses.dataclass(frozen=True)
class Restored:
    """The checkpoint a run resumed from, and the newer ones it skipped."""

    path: str  # the checkpoint's prefix, `.../ckpt-<step>`
    step: int  # the step it was saved at
    skipped: Tuple[Tuple[str, str], ...] = ()  # (prefix, why), newest first

    def describe(self) -> str:
        """One line for the log: which checkpoint, and why not a newer one."""
        line = f"resuming from step {self.step} (checkpoint {self.path})"
        if self.skipped:
            line += (f"; skipped {len(self.skipped)} newer checkpoint(s) that cannot be read "
                     f"({reasons(self.skipped)}), the steps since are trained again")
        return line


class Checkpoints:
    """Saves and restores the training state of one worker."""

    def __init__(self, model_dir: str, worker: Optional[str], identity: dict,
                 check_held=lambda: None, **trackables):
        """worker: None for the chief, else a name unique in the cluster
        (e.g. 'worker-1'), which names its scratch directory. check_held():
        raises if --model_dir is no longer this run's (a save would recreate it)."""
        self._check_held = check_held
        self._shared_dir = os.path.join(model_dir, "checkpoints")
        self._identity = identity
        self._is_chief = worker is None
        self._own_dir = self._shared_dir if self._is_chief else _scratch_dir(model_dir, worker)
        self._checkpoint = tf.train.Checkpoint(**trackables)
        self._before_random_state = RANDOM_STATE in trackables and tf.train.Checkpoint(
            **{k: v for k, v in trackables.items() if k != RANDOM_STATE})
        self._step = trackables.get("step")  # what a restored checkpoint says it is
        self._bytes = checkpoint_bytes(**trackables)
        # Made at the first save, once restore_latest has checked the index
        # file: the manager reads it when it is created, and fails on garbage.
        self._manager: Optional[tf.train.CheckpointManager] = None
        self._damaged: List[Tuple[int, str]] = []  # skipped at restore, not yet replaced

    def on_disk(self) -> bool:
        """Whether the shared directory holds any checkpoint file."""
        return bool(checkpoints_on_disk(self._shared_dir))

    def check_identity(self) -> None:
        """Raises CheckpointMismatchError if the checkpoints hold another model;
        call before anything is written into the model directory."""
        path = os.path.join(self._shared_dir, "model.json")
        remedy = ("it says which model the checkpoints beside it hold: restore an intact copy, "
                  "or start again in an empty --model_dir")
        stored = files.read_json(path, {"model": str, "precision": str, "variable_shapes": list},
                                 remedy=remedy)
        if not all(isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                   for shape in stored.get("variable_shapes", [])):
            raise files.DamagedFileError(f"{quoted(path)} is damaged (its variable_shapes are not "
                                         f"lists of sizes); {remedy}")
        if not stored:
            if checkpoints_on_disk(self._shared_dir):
                raise CheckpointMismatchError(
                    f"{self._shared_dir} holds checkpoints without model.json; "
                    f"use an empty --model_dir")
            return
        if stored.get("precision") != self._identity["precision"] and \
                {**stored, "precision": None} == {**self._identity, "precision": None}:
            raise CheckpointMismatchError(
                f"{self._shared_dir} holds checkpoints trained with --precision="
                f"{stored.get('precision')}, not {self._identity['precision']}: pass "
                f"--precision={stored.get('precision')} (auto differs between GPU and CPU hosts), "
                f"or use another --model_dir")
        if stored != self._identity:  # named: the same name and size read as a contradiction
            differing = sorted(k for k in {**stored, **self._identity}
                               if stored.get(k) != self._identity.get(k))
            raise CheckpointMismatchError(
                f"{self._shared_dir} holds checkpoints of a different model "
                f"('{stored.get('model')}', {_parameters(stored)} parameters) than this run's "
                f"('{self._identity['model']}', {_parameters(self._identity)}; its model.json "
                f"differs in {quoted(', '.join(differing), 80)}): use another "
                f"--model_dir, or the model of the run that wrote it (its flags, and for a "
                f"--model=file.py:function or module:function its code as it was)")

    def restore_latest(self) -> Optional[Restored]:
        """Restores the newest checkpoint that reads back whole; None if there
        is none at all.

        Raises CheckpointDamagedError, having changed nothing, if checkpoints
        exist and none of them reads back, and CheckpointMismatchError if the
        newest readable one does not fit the tracked objects.
        """
        found = checkpoints_on_disk(self._shared_dir)
        skipped = []
        for step, prefix in found:
            if step > _LARGEST_STEP:
                skipped.append((prefix, "its number is larger than any step"))
                continue
            problem = why_unreadable(prefix)
            if problem:
                _refuse_what_a_save_cannot_replace(step, prefix)
                skipped.append((prefix, problem))
                continue
            checkpoint = self._checkpoint  # or, saved before random layers' state was, without it
            if self._before_random_state and not any(
                    n.startswith(RANDOM_STATE + "/") for n, _ in tf.train.list_variables(prefix)):
                checkpoint = self._before_random_state
                files.warn(f"{prefix} holds no state of the model's random layers (an older "
                           f"version's): they draw other masks than an unstopped run would")
            try:
                checkpoint.restore(prefix).assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.OpError) as e:
                # It reads back whole, so it is not damaged: it holds other state.
                raise CheckpointMismatchError(
                    f"cannot restore {prefix} ({first_line(e)}); use another "
                    f"--model_dir, or the flags of the run that wrote it") from None
            saved_at = int(self._step.numpy()) if self._step is not None else step
            if saved_at != step:
                # Renamed, or copied under another name: resuming from it
                # would take its place as the newest at every restart, and
                # the steps trained since would be trained again and again.
                skipped.append((prefix, f"it holds step {saved_at}, not the step its name says"))
                continue
            if self._is_chief:
                self._damaged = [(n, p) for n, p in found if p in dict(skipped)]
                self._rewrite_index(step, [p for n, p in found if n < step])
            return Restored(prefix, step, tuple(skipped))
        if not found:
            index = os.path.join(self._shared_dir, _INDEX_FILE)
            if self._is_chief and os.path.lexists(index):  # an index naming nothing goes
                files.warn(f"removed {index}: it names checkpoints that are not there")
                os.remove(index)
            return None
        raise CheckpointDamagedError(
            f"{self._shared_dir} holds {len(found)} checkpoint(s) and none can be read "
            f"({reasons(skipped)}); nothing was changed: put back intact copies, or move "
            f"{self._shared_dir} away to start again from step 0")

    def _rewrite_index(self, step: int, older: List[str]) -> None:
        """Makes the index file name the restored checkpoint as the latest and
        the older ones beside it, so that they are rotated out as usual.
        Unchanged if it says so already (a finished run run again changes no file)."""
        path = os.path.join(self._shared_dir, _INDEX_FILE)
        names = [os.path.basename(p) for p in reversed(older)] + [f"ckpt-{step}"]
        listed = _read_index(path)
        if listed == names:
            return
        if listed is None and os.path.lexists(path):
            files.warn(f"{path} was damaged; rewritten from the checkpoints on disk")
        # CheckpointManager deletes only checkpoints newer than the "last
        # preserved" time, so they get now and that time a second before.
        now = time.time()
        files.write_text(path, "".join(
            [f'model_checkpoint_path: "{names[-1]}"\n'] +
            [f'all_model_checkpoint_paths: "{name}"\n' for name in names] +
            [f"all_model_checkpoint_timestamps: {now!r}\n" for _ in names] +
            [f"last_preserved_timestamp: {now - 1!r}\n"]))

    def save(self, step: int) -> None:
        """Saves the state at `step` (every worker at the same step; no collective,
        as no checkpointed variable is synchronized on read, so a chief that lost its
        lock skips it: run_lock.Writes); raises DiskFullError, having removed the
        partial checkpoint, if it does not fit."""
        self._check_held()
        try:
            if self._is_chief and not os.path.exists(os.path.join(self._shared_dir, "model.json")):
                os.makedirs(self._shared_dir, exist_ok=True)
                files.write_json(os.path.join(self._shared_dir, "model.json"), self._identity)
            if self._manager is None:
                # It learns the checkpoints to rotate from the index file, once.
                self._manager = tf.train.CheckpointManager(self._checkpoint, self._own_dir,
                                                           max_to_keep=MAX_TO_KEEP)
            self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            why = files.why_unwritable(e)
            if why is None:
                raise
            with contextlib.suppress(OSError):  # on a read-only mount, nothing was written
                self._remove_partial(step)
            if not files.is_disk_full(e):
                raise UserError(f"cannot write the checkpoint of step {step} in {self._own_dir} "
                                f"({why}): make it writable for this user (a directory another "
                                f"user made, a read-only mount) and run the same command again "
                                f"to resume") from None
            raise DiskFullError(
                f"no space left in {self._own_dir} for the checkpoint of step {step}: a run "
                f"needs {_megabytes((MAX_TO_KEEP + 1) * self._bytes)} there ({MAX_TO_KEEP + 1} "
                f"checkpoints of {_megabytes(self._bytes)}: {MAX_TO_KEEP} kept, one being "
                f"written); free space "
                f"and run the same command again to resume") from None
        # A damaged checkpoint skipped at restore is now either overwritten
        # (same step) or superseded by an intact newer one: drop it.
        for number, prefix in self._damaged:
            if number < step:
                remove_matching(os.path.dirname(prefix),
                                [re.compile(re.escape(os.path.basename(prefix)) + r"\..*")])
        self._damaged = [(n, p) for n, p in self._damaged if n > step]

    def _remove_partial(self, step: int) -> None:
        """Removes what a failed save of `step` wrote (its data files count
        only once its index, written last, exists)."""
        remove_matching(self._own_dir, debris([files.owner_tag()])["checkpoints"])
        prefix = os.path.join(self._own_dir, f"ckpt-{step}")
        if not os.path.exists(prefix + ".index"):
            remove_matching(self._own_dir, [re.compile(rf"ckpt-{step}\.data-.*")])

    def close(self) -> None:
        """Removes a non-chief worker's scratch directory."""
        if not self._is_chief:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def checkpoints_on_disk(directory: str) -> List[Tuple[int, str]]:
    """(step, prefix) of every checkpoint with a file in `directory`, newest
    first, whatever the index file says. The newest that reads back:
    `next(p for _, p in checkpoints_on_disk(d) if not why_unreadable(p))`."""
    steps = set()
    for path in glob.glob(os.path.join(glob.escape(directory), "ckpt-*")):
        match = _CHECKPOINT_FILE.match(os.path.basename(path))
        if match:
            steps.add(int(match.group(1)))
    return [(step, os.path.join(directory, f"ckpt-{step}")) for step in sorted(steps, reverse=True)]


def reasons(skipped) -> str:
    """(prefix, why) pairs of checkpoints passed over, for a message:
    `ckpt-20: why; ckpt-10: why`."""
    return "; ".join(f"{os.path.basename(prefix)}: {why}" for prefix, why in skipped)


def _read_index(path: str) -> Optional[List[str]]:
    """The checkpoints the index file at `path` lists, oldest first; None if
    there is none, or if it is not what CheckpointManager writes (then it is
    rebuilt, never trusted)."""
    with contextlib.suppress(files.DamagedFileError):
        text = files.read_text(path, remedy="")
        lines = [_INDEX_LINE.fullmatch(line.strip()) for line in (text or "").splitlines()]
        if text is not None and all(lines):
            return [m.group(2) for m in lines if m.group(1) == "all_model_checkpoint_paths"]
    return None


def why_unreadable(prefix: str) -> Optional[str]:
    """Why the checkpoint at `prefix` cannot be read back whole, or None.

    Reads every tensor: the index must parse and each value must match the
    checksum stored beside it, so a truncated, emptied or bit-flipped file
    shows here rather than half-way through a restore.
    """
    # Checked before TensorFlow opens them: a FIFO would block the read
    # forever, a link to /dev/zero never end it.
    if path := _not_a_file(prefix):
        return f"{os.path.basename(path)} is {files.kind_of(path)}, not a file"
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - a damaged file raises OpError, IndexError, ...
        return first_line(e, 160)
    return None


def _refuse_what_a_save_cannot_replace(step: int, prefix: str) -> None:
    """Raises CheckpointDamagedError if a file of the checkpoint at `prefix`
    is not a file (a directory, a FIFO): the run would resume from an older
    checkpoint, fail to save this one's step, and do so again at every
    restart, a crash loop that restart policies feed. Once, before training."""
    if path := _not_a_file(prefix):
        raise CheckpointDamagedError(
            f"{quoted(path)} is {files.kind_of(path)}, not a checkpoint file, and this run "
            f"would write one there at step {step}: move it away, and run the "
            f"same command again to resume")


def _not_a_file(prefix: str) -> Optional[str]:
    """The first of the checkpoint's files that is not a regular file, or None."""
    return next((p for p in sorted(glob.glob(glob.escape(prefix) + ".*"))
                 if not stat.S_ISREG(os.lstat(p).st_mode)), None)


def _megabytes(size: int) -> str:
    return f"{math.ceil(size / 1e6)} MB"


def _scratch_dir(model_dir: str, worker: str) -> str:
    """A new private (0700) directory for a non-chief worker's checkpoints.

    Its name is fixed per user, run and worker, so that the successor of a
    killed worker removes what it left. The temporary directory is shared
    with other users, who could plant a symlink or a directory of theirs
    under that name: what is there is removed only if it is a real
    directory of ours, the new one is made with mkdir (which never follows
    a symlink), and if the name is taken we fall back to a random one.
    """
    run_id = hashlib.sha1(os.path.abspath(model_dir).encode()).hexdigest()[:10]
    fixed = os.path.join(tempfile.gettempdir(), f"dmpt-{os.getuid()}-{run_id}-{worker}")
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(fixed)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(fixed)  # a killed predecessor's; rmtree does not follow symlinks
    try:
        os.mkdir(fixed, 0o700)
    except FileExistsError:  # a symlink, a file, another user's directory
        return tempfile.mkdtemp(prefix=f"dmpt-{os.getuid()}-{run_id}-{worker}-")
    return fixed
