"""Checkpoints that make every run resumable, on one worker or many.

Every worker saves (MultiWorkerMirroredStrategy needs all of them to take
part), but only the chief writes into `<model_dir>/checkpoints`; the others
write into a temporary directory that they delete. All workers restore from
the chief's directory, so a restarted group starts from one state.

TensorFlow writes a checkpoint's files first and updates the `checkpoint`
index file last, atomically; a checkpoint cut short by a crash is never the
"latest". Beside the checkpoints, `model.json` records which model they hold,
so that a run of another model refuses the directory instead of failing deep
in TensorFlow or, worse, overwriting it.
"""

import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Optional

import tensorflow as tf

from distributed_mpt import outputs
from distributed_mpt.errors import CheckpointMismatchError

MAX_TO_KEEP = 3


def model_identity(model, precision: str) -> dict:
    """What must match for a checkpoint to be restorable into `model` trained
    under `precision` (mixed_float16 adds loss-scaling state)."""
    # Shapes in order, not names: Keras numbers layer names per process.
    return {"model": model.name, "precision": precision,
            "variable_shapes": [list(v.shape) for v in model.weights]}


def _parameters(identity: dict) -> int:
    return sum(math.prod(shape) for shape in identity.get("variable_shapes", []))


class Checkpoints:
    """Saves and restores the training state of one worker."""

    def __init__(self, model_dir: str, worker: Optional[str], identity: dict, **trackables):
        """worker: None for the chief, else a name unique in the cluster
        (e.g. 'worker-1'), which names its scratch directory."""
        self._shared_dir = os.path.join(model_dir, "checkpoints")
        self._identity = identity
        self._is_chief = worker is None
        if self._is_chief:
            own_dir = self._shared_dir
        else:
            # A fixed name per run and worker: a worker that was killed could
            # not clean up, so its successor does.
            run_id = hashlib.sha1(os.path.abspath(model_dir).encode()).hexdigest()[:10]
            own_dir = os.path.join(tempfile.gettempdir(), f"dmpt-{run_id}-{worker}")
            shutil.rmtree(own_dir, ignore_errors=True)
        self._own_dir = own_dir
        self._checkpoint = tf.train.Checkpoint(**trackables)
        self._manager = tf.train.CheckpointManager(self._checkpoint, own_dir, max_to_keep=MAX_TO_KEEP)

    @property
    def latest(self) -> Optional[str]:
        """Path prefix of the chief's latest checkpoint, if any."""
        return tf.train.latest_checkpoint(self._shared_dir)

    def check_identity(self) -> None:
        """Raises CheckpointMismatchError if the checkpoints hold another model.

        Call before anything is written into the model directory.
        """
        path = os.path.join(self._shared_dir, "model.json")
        if not os.path.exists(path):
            if self.latest:
                raise CheckpointMismatchError(
                    f"{self._shared_dir} holds checkpoints without model.json; "
                    f"use an empty --model_dir")
            return
        with open(path) as f:
            stored = json.load(f)
        if stored.get("precision") != self._identity["precision"] and \
                {k: v for k, v in stored.items() if k != "precision"} == \
                {k: v for k, v in self._identity.items() if k != "precision"}:
            raise CheckpointMismatchError(
                f"{self._shared_dir} holds checkpoints trained with --precision="
                f"{stored.get('precision')}, not {self._identity['precision']}: pass "
                f"--precision={stored.get('precision')} (auto differs between GPU and CPU hosts), "
                f"or use another --model_dir")
        if stored != self._identity:
            ours = self._identity["model"]
            raise CheckpointMismatchError(
                f"{self._shared_dir} holds checkpoints of a different model "
                f"('{stored.get('model')}', {_parameters(stored)} parameters) than this run's "
                f"('{ours}', {_parameters(self._identity)}): use another --model_dir, or the "
                f"model flags of the run that wrote it")

    def restore_latest(self) -> bool:
        """Restores the latest checkpoint into the tracked objects; False if none."""
        latest = self.latest
        if latest is None:
            return False
        try:
            self._checkpoint.restore(latest).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            raise CheckpointMismatchError(
                f"cannot restore {latest} ({str(e).splitlines()[0][:200]}); use another "
                f"--model_dir, or the flags of the run that wrote it") from None
        return True

    def save(self, step: int) -> None:
        """Saves the state at `step` (every worker must call this together)."""
        if self._is_chief and not os.path.exists(os.path.join(self._shared_dir, "model.json")):
            os.makedirs(self._shared_dir, exist_ok=True)
            outputs.write_json(os.path.join(self._shared_dir, "model.json"), self._identity)
        self._manager.save(checkpoint_number=step)

    def close(self) -> None:
        """Removes a non-chief worker's temporary directory."""
        if not self._is_chief:
            shutil.rmtree(self._own_dir, ignore_errors=True)
