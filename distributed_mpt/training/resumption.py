"""Resuming a run from its --model_dir: what the checkpoints and the files
beside them say of the run before, whether it is finished, and what this
run may change of it (its length and batch, not its data or seed)."""

import dataclasses
import os
from typing import List, Optional

from distributed_mpt import config as config_lib
from distributed_mpt import files
from distributed_mpt.config import TrainConfig
from distributed_mpt.core import models
from distributed_mpt.core.models.signature import refuse_another_model
from distributed_mpt.errors import ConfigError, quoted
from distributed_mpt.training.checkpoints import Checkpoints, Restored
from distributed_mpt.training.plan import RunPlan


@dataclasses.dataclass(frozen=True)
class Resumption:
    """Where a run starts: step 0 of a fresh run, or the step of the
    checkpoint `restored` (None: a fresh run), with the config.json of the
    run that wrote it and, if that run finished, its summary.json."""

    start_step: int
    restored: Optional[Restored] = None
    previous_config: dict = dataclasses.field(default_factory=dict)
    finished_summary: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """The run was trained to its last step and summarized: nothing to train."""
        return bool(self.finished_summary)

    def agreement(self, plan: RunPlan) -> dict:
        """The numbers every worker of a job must agree on before training."""
        return {"start step": self.start_step, "finished": self.finished,
                "precision": config_lib.PRECISIONS.index(plan.policy),
                "total steps": plan.total_steps, "steps per epoch": plan.steps_per_epoch}


def resume(checkpoints: Checkpoints, step, model_dir: str, total_steps: int) -> Resumption:
    """Restores the newest checkpoint that reads back (into the variables
    `checkpoints` holds; `step` is the step variable among them) and reads
    what the run before wrote beside it."""
    checkpoints.check_identity()  # before anything is written into model_dir
    restored = checkpoints.restore_latest()
    if not restored:
        return Resumption(start_step=0)
    start_step = int(step.numpy())
    previous_config = _previous_config(model_dir)
    finished = {}
    if start_step >= total_steps:  # else summary.json is rewritten at the end
        finished = files.read_json(
            os.path.join(model_dir, "summary.json"), {"steps": int},
            remedy="remove it, and the run evaluates again and writes a new one")
    return Resumption(start_step, restored, previous_config, finished)


def _previous_config(model_dir: str) -> dict:
    """The config.json of the run that wrote the checkpoints in `model_dir`
    ({} if there is none)."""
    config_path = os.path.join(model_dir, "config.json")
    remedy = ("it records the flags of the run that wrote the checkpoints: restore an intact "
              "copy, or remove it to resume without comparing them")
    previous_config = files.read_json(
        config_path, {"dataset": str, "seed": int, "resolved": dict}, remedy=remedy)
    earlier = previous_config.get("earlier", [])  # absent in runs from before it was kept
    if not (isinstance(earlier, list) and all(isinstance(e, dict) for e in earlier)):
        raise files.DamagedFileError(f"{quoted(config_path)} is damaged ('earlier' is not a list "
                                     f"of records); {remedy}")
    return previous_config


def refuse_other_data(checkpoints: Checkpoints, config: TrainConfig,
                      fingerprint: Optional[dict]) -> None:
    """Raises ConfigError if the checkpoints in --model_dir were trained on
    other data than this run's `fingerprint` (core/data's Dataset), naming
    what differs: the classes, the number of files, or only the file list.
    Call before the checkpoints' model is compared: other classes make
    another model, but the data is what to name. A run that recorded none
    (CIFAR-10, synthetic data, a run older than fingerprints) is not
    compared."""
    if fingerprint is None or not checkpoints.on_disk():
        return
    recorded = _previous_config(config.model_dir).get("resolved", {}).get("data_fingerprint")
    if not isinstance(recorded, dict) or recorded == fingerprint:
        return
    raise ConfigError(
        f"--model_dir={quoted(config.model_dir)} holds a run trained on other images than "
        f"--data_dir={quoted(config.data_dir)} holds: {_data_difference(recorded, fingerprint)}. "
        f"Resume it on the images it was trained on, or choose another --model_dir")


def _data_difference(before: dict, now: dict, shown: int = 5) -> str:
    """What differs between two fingerprints, in words."""
    def names(classes):
        more = f" and {len(classes) - shown} more" if len(classes) > shown else ""
        return quoted(", ".join(map(str, classes[:shown]))) + more

    def field(fingerprint, name, kind):  # config.json is read, not trusted: any shape
        value = fingerprint.get(name)
        return value if isinstance(value, kind) else kind()

    old, new = field(before, "classes", list), field(now, "classes", list)
    removed, added = [c for c in old if c not in new], [c for c in new if c not in old]
    parts = []
    if removed:
        parts.append(f"class(es) {names(removed)} gone")
    if added:
        parts.append(f"class(es) {names(added)} new")
    if old != new and not parts:
        parts.append(f"the classes in another order ({names(new)}, was {names(old)})")
    counted_before, counted = field(before, "files", dict), field(now, "files", dict)
    for split in sorted(set(counted_before) | set(counted)):
        if counted_before.get(split) != counted.get(split):
            parts.append(f"{split}/ holds {counted.get(split, 0)} files (was "
                         f"{counted_before.get(split, 0)})")
    return "; ".join(parts) or ("the same classes and numbers of files, but other file names "
                                "or sizes (the SHA-256 of the list of files and sizes differs)")


def refuse_other_training(resumption: Resumption, config: TrainConfig, signature: dict) -> None:
    """Raises ConfigError if this run would continue the checkpoints with
    other training settings (rate, decay, smoothing, momentum, schedule,
    optimizer, augmentation, data, seed: config.training_flags), naming each
    flag with the run's value and this one's, and ModelChangedError if with
    another network than the run's (`signature`: this one's, from
    signature.model_signature): two runs mixed into one model, silently,
    and a config.json that would say only the second."""
    previous = resumption.previous_config
    if not previous:
        return
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    changed = [(name, previous.get(name, defaults[name]), value)
               for name, value in config_lib.training_flags(config).items()
               if previous.get(name, defaults[name]) != value]
    if changed:
        theirs = " ".join(f"--{name}={quoted(old, 60)}" for name, old, _ in changed)
        mine = ", ".join(f"--{name}={quoted(old, 40)} to {quoted(new, 40)}"
                         for name, old, new in changed)
        raise ConfigError(
            f"--model_dir={quoted(config.model_dir)} holds a run trained otherwise: this run "
            f"changes {mine}. Pass {theirs} to resume it (only its length, batch, evaluation "
            f"and where it runs may change), or choose another --model_dir")
    refuse_another_model(previous.get("resolved", {}), signature, models.model_spec(config.model),
                         f"the run in --model_dir={quoted(config.model_dir)}",
                         "restore what differs to resume, or choose another --model_dir")


def continue_with(resumption: Resumption, plan: RunPlan, trained_global_batch) -> List[str]:
    """Adopts this run's plan for the restored checkpoint (the global batch
    it trains at, in `trained_global_batch`); returns what a user must be
    told of it: where it resumes, and what changed."""
    if not resumption.restored:
        return []
    notes = [resumption.restored.describe()]
    if resumption.start_step >= plan.total_steps:  # stopped at its end, or given fewer steps
        notes.append(f"the checkpoint is at step {resumption.start_step} and this run has "
                     f"{plan.total_steps} steps: nothing is left to train; the model of step "
                     f"{resumption.start_step} is evaluated and exported")
    previous = resumption.previous_config.get("resolved", {})
    planned = previous.get("total_steps")
    if planned and planned != plan.total_steps:
        notes.append(f"the run was planned for {planned} steps and now has {plan.total_steps}: "
                     f"the learning-rate schedule is re-planned over the new length")
    previous_batch = int(trained_global_batch.numpy())
    if previous_batch != plan.global_batch_size:
        previous_rate = previous.get("peak_learning_rate")
        if previous_rate == plan.learning_rate:  # e.g. --max_learning_rate caps both
            rate = f"stays {plan.learning_rate:g}"
        else:
            was = f" (was {previous_rate:g})" if isinstance(previous_rate, (int, float)) else ""
            rate = f"is rescaled to {plan.learning_rate:g}{was}"
        notes.append(f"the checkpoint was trained at global batch {previous_batch}; continuing at "
                     f"global batch {plan.global_batch_size}: the peak learning rate {rate} and "
                     f"the schedule re-planned over {plan.total_steps} steps of "
                     f"{plan.steps_per_epoch} per epoch")
        trained_global_batch.assign(plan.global_batch_size)
    return notes
