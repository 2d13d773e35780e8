"""What a run will do, settled before its first step.

- The numbers it derives from its config, data and strategy: the global
  batch, the steps, the peak learning rate and its warmup, the precision.
- Where it starts, resumed from its --model_dir: what its checkpoints and
  files say of the run before, whether it is finished, and what this run may
  change of it (its length and batch, not its data or seed).
- That the workers of one job agree on it (the same run, the same flags),
  and leave together when they are done. A worker that resumes from
  another step (no shared --model_dir), finds another split, or resolves
  another precision would call the collectives differently: a hang. One
  started with another seed, rate, weight decay or network (a model file
  that differs: core/models/signature.py) trains a silently different run,
  which the chief's config.json would not show.
"""

import dataclasses
import hashlib
import math
import os
from typing import List, Optional, Tuple

import tensorflow as tf

from distributed_mpt import __version__, files
from distributed_mpt.cluster.strategy import barrier
from distributed_mpt.config import (DEFAULTS, TrainConfig, compared_flag_problem, flat_record,
                                    section_problem, training_flags, unknown_settings)
from distributed_mpt.core import models, pipeline, precision
from distributed_mpt.core.data.dataset import HELD_OUT_FLAGS, fingerprint_difference, same_examples
from distributed_mpt.core.models.contract import ModelError
from distributed_mpt.core.models.signature import refuse_another_model
from distributed_mpt.core.optim.schedules import linear_rule_limit, linear_rule_warning
from distributed_mpt.errors import ClusterError, ConfigError, UserError, quoted
from distributed_mpt.process.run_lock import ModelDirLostError
from distributed_mpt.training.checkpoints import Checkpoints, Restored

@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The numbers a run derives from its config, data and strategy."""

    policy: str
    num_workers: int
    num_replicas: int
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    learning_rate: float  # the peak, scaled to the global batch
    warmup_steps: int
    early_crop_steps: int = 0  # the first steps train on crops of early_crop_size
    early_crop_size: int = 0

    def input_phase(self, step: int) -> Tuple[int, Optional[int]]:
        """(the step where the training input that serves `step` ends, the
        side of its crops, None for whole images): early crops until
        early_crop_steps, then whole images to the end."""
        if step < self.early_crop_steps:
            return self.early_crop_steps, self.early_crop_size
        return self.total_steps, None

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling: float16 underflows small gradients."""
        return self.policy == "mixed_float16"


def plan_run(config: TrainConfig, num_replicas: int, num_workers: int,
             num_train_examples: int) -> RunPlan:
    """Scales batch and learning rate to the replicas; raises ConfigError if
    the global batch does not fit the training split."""
    per_replica = config.run.per_replica_batch_size
    global_batch = per_replica * num_replicas
    epoch_steps = pipeline.steps_per_epoch(num_train_examples, global_batch)
    if epoch_steps == 0:
        raise ConfigError(
            f"the global batch of {global_batch} ({per_replica} x {num_replicas} "
            f"replicas) exceeds the {num_train_examples} training examples; "
            f"lower --per_replica_batch_size")
    total_steps = config.schedule.total_steps(epoch_steps)
    early_crop_steps, early_crop_size = config.augmentation.early_crops(epoch_steps, total_steps)
    return RunPlan(
        policy=precision.resolve_precision(config.run.precision), num_workers=num_workers,
        num_replicas=num_replicas, global_batch_size=global_batch, steps_per_epoch=epoch_steps,
        total_steps=total_steps, learning_rate=config.optimizer.peak_learning_rate(global_batch),
        warmup_steps=config.schedule.warmup_steps(epoch_steps, total_steps),
        early_crop_steps=early_crop_steps, early_crop_size=early_crop_size)


# Below these a run's length comes out of --epochs too short to learn from
# (the docs' own-images run: 1,414 images at batch 1024, 1 step an epoch,
# 5 steps in all, 16.7%): about 20 steps an epoch, 200 in a run.
SHORT_EPOCH_STEPS = 20
SHORT_RUN_STEPS = 200


def start_warnings(config: TrainConfig, plan: RunPlan, num_train_examples: int) -> List[str]:
    """The warning lines a run starts with: a run too short to learn from
    (short_run), and a global batch beyond where the linear rule is
    known to hold (schedules.linear_rule_warning), unless the batch the
    first line suggests is within it: then one line says what to change."""
    short, suggested_batch = short_run(config, plan, num_train_examples)
    beyond = linear_rule_warning(plan.global_batch_size, num_train_examples)
    if beyond and suggested_batch and (suggested_batch * plan.num_replicas
                                       <= linear_rule_limit(num_train_examples)):
        beyond = ""
    return [warning for warning in (short, beyond) if warning]


def short_run(config: TrainConfig, plan: RunPlan,
              num_train_examples: int) -> Tuple[str, Optional[int]]:
    """(What to say, the batch it suggests or None) of a run whose --epochs come to fewer
    than SHORT_EPOCH_STEPS steps an epoch or SHORT_RUN_STEPS in all: a per-replica batch (a
    power of two) that gives at least SHORT_EPOCH_STEPS an epoch, and the epochs that then
    give SHORT_RUN_STEPS. ("", None) for any other run, and for one whose --train_steps
    fixes its length."""
    if config.schedule.fixed_length or (plan.steps_per_epoch >= SHORT_EPOCH_STEPS
                              and plan.total_steps >= SHORT_RUN_STEPS):
        return "", None
    said = (f"this run trains {plan.total_steps} step{'s' * (plan.total_steps != 1)} "
            f"({plan.steps_per_epoch} per epoch: {num_train_examples:,} training images in "
            f"global batches of {plan.global_batch_size}), too few to learn much")
    fitting = num_train_examples // (SHORT_EPOCH_STEPS * plan.num_replicas)
    if not fitting:  # fewer images than SHORT_EPOCH_STEPS per replica: no batch is small enough
        return f"{said}; more training images would give more steps per epoch", None
    per_replica = config.run.per_replica_batch_size
    batch = min(per_replica, 2 ** int(math.log2(fitting)))
    epoch_steps = pipeline.steps_per_epoch(num_train_examples, batch * plan.num_replicas)
    steps = config.schedule.total_steps(epoch_steps)
    advice = [f"--per_replica_batch_size={batch}"] if batch < per_replica else []
    if steps < SHORT_RUN_STEPS:
        epochs = math.ceil(SHORT_RUN_STEPS / epoch_steps)
        advice.append(f"--epochs={epochs}")
        steps = epochs * epoch_steps
    return f"{said}; {' and '.join(advice)} would train {steps} ({epoch_steps} per epoch)", batch


@dataclasses.dataclass(frozen=True)
class Resumption:
    """Where a run starts: step 0 of a fresh run, or the step of the
    checkpoint `restored` (None: a fresh run), with the config.json of the
    run that wrote it and, if that run finished, its summary.json.
    `started_before`: a fresh run where one started before (its config.json)
    and stopped before its first checkpoint."""

    start_step: int
    restored: Optional[Restored] = None
    previous_config: dict = dataclasses.field(default_factory=dict)
    finished_summary: dict = dataclasses.field(default_factory=dict)
    started_before: bool = False

    @property
    def finished(self) -> bool:
        """The run was trained to its last step and summarized: nothing to train."""
        return bool(self.finished_summary)

    def agreement(self, plan: RunPlan) -> dict:
        """The numbers every worker of a job must agree on before training."""
        return {"start step": self.start_step, "finished": self.finished,
                "precision": precision.PRECISIONS.index(plan.policy),
                "total steps": plan.total_steps, "steps per epoch": plan.steps_per_epoch}


def resume(checkpoints: Checkpoints, step, model_dir: str, total_steps: int) -> Resumption:
    """Restores the newest checkpoint that reads back (into the variables
    `checkpoints` holds; `step` is the step variable among them) and reads
    what the run before wrote beside it."""
    checkpoints.check_identity()  # before anything is written into model_dir
    started_before = False
    if not checkpoints.on_disk():  # before restore_latest removes an index naming none
        started_before = _refuse_a_run_without_checkpoints(model_dir)
    restored = checkpoints.restore_latest()
    if not restored:
        return Resumption(0, started_before=started_before)
    start_step, previous_config = int(step.numpy()), _previous_config(model_dir)
    summary = {} if start_step < total_steps else files.read_json(  # else rewritten at the end
        os.path.join(model_dir, "summary.json"), {"steps": int},
        remedy="remove it, and the run evaluates again and writes a new one")
    # A summary of an earlier step is an earlier end's (a longer run stopped since): the
    # checkpoint's model is still to be evaluated and exported. One of a later step stays
    # (its newest checkpoint was damaged, skipped): its export is of a model no checkpoint holds.
    finished = summary if summary.get("steps", -1) >= start_step else {}
    return Resumption(start_step, restored, previous_config, finished)


def _refuse_a_run_without_checkpoints(model_dir: str) -> bool:
    """Raises ConfigError if `model_dir` holds no checkpoint but the record
    of a run that trained (its summary.json, or a config.json of a segment
    that resumed, or the export only a run's end writes): a run from step 0 would replace
    its files. Returns whether a run started there (stopped before its first checkpoint)."""
    try:  # read, not checked: an adopted directory's own config.json is no run's
        previous = files.read_json(os.path.join(model_dir, "config.json"))
    except files.DamagedFileError:
        previous = {}
    if os.path.lexists(os.path.join(model_dir, "summary.json")):
        what = "a finished run (see summary.json)"
    elif previous.get("from_step") or previous.get("earlier"):
        what = f"a run resumed at step {previous.get('from_step')} (see config.json)"
    elif "resolved" in flat_record(previous) and os.path.lexists(os.path.join(model_dir, "export")):
        what = "the export of a run that trained to its end (see export/)"  # not "stopped before"
    else:  # a run stopped before its first checkpoint (not the adopted directory's own file)
        return "resolved" in flat_record(previous)
    raise ConfigError(
        f"--model_dir={quoted(model_dir)} holds {what} but its checkpoints are gone from "
        f"{quoted(os.path.join(model_dir, 'checkpoints'))}: a run from step 0 would replace its "
        f"files. Restore its checkpoints to resume or extend it, or choose another --model_dir")


def _previous_config(model_dir: str) -> dict:
    """The config.json of the run that wrote the checkpoints in `model_dir`
    ({} if there is none)."""
    config_path = os.path.join(model_dir, "config.json")
    remedy = ("it records the flags of the run that wrote the checkpoints: restore an intact "
              "copy, or remove it to resume without comparing them")
    if not os.path.lexists(config_path):  # removed, as the remedy below offers: not compared
        return {}
    previous_config = files.read_json(config_path, remedy=remedy)
    flags = flat_record(previous_config)
    problem = (section_problem(previous_config) or compared_flag_problem(flags) or
               files.missing_fields(flags, {"dataset": str, "seed": int, "resolved": dict}))
    if problem:
        raise files.DamagedFileError(f"{quoted(config_path)} is damaged ({problem}); {remedy}")
    if unknown := unknown_settings(previous_config):  # resumed without them, it trains otherwise
        raise ConfigError(f"{quoted(config_path)} {unknown}; resume "
                          f"with that version, or choose another --model_dir")
    earlier = previous_config.get("earlier", [])  # absent in runs from before it was kept
    if not (isinstance(earlier, list) and all(isinstance(e, dict) for e in earlier)):
        raise files.DamagedFileError(f"{quoted(config_path)} is damaged ('earlier' is not a list "
                                     f"of records); {remedy}")
    return previous_config


def refuse_other_data(checkpoints: Checkpoints, config: TrainConfig,
                      fingerprint: Optional[dict]) -> None:
    """Raises ConfigError if the checkpoints in --model_dir were trained on other data
    than this run's `fingerprint` (core/data's Dataset), naming what differs, before the
    model is compared: other classes make another model, but the data is what to name. A
    run that recorded none (synthetic data, a run older than fingerprints) is not compared."""
    if fingerprint is None or not checkpoints.on_disk():
        return
    model_dir, previous = config.run.model_dir, _previous_config(config.run.model_dir)
    recorded = previous.get("resolved", {}).get("data_fingerprint")
    before, now = flat_record(previous), config.flags()  # others hold out other pixels:
    pixels = all(before.get(n) == now[n] for n in HELD_OUT_FLAGS)  # refuse_other_training's
    if not isinstance(recorded, dict) or same_examples(recorded, fingerprint, pixels):
        return
    raise ConfigError(
        f"--model_dir={quoted(model_dir)} holds a run trained on other images than --data_dir="
        f"{quoted(config.data.data_dir)} holds: {fingerprint_difference(recorded, fingerprint, pixels)}. "
        f"Resume it on the images it was trained on, or choose another --model_dir")


def refuse_other_training(resumption: Resumption, config: TrainConfig, signature: dict) -> None:
    """Raises ConfigError if this run would continue the checkpoints with other training
    settings (rate, decay, smoothing, momentum, schedule, optimizer, augmentation, data,
    seed: config.training_flags), naming each flag with the run's value and this one's, and
    ModelChangedError if with another network than the run's (`signature`: this one's, from
    signature.model_signature): two runs mixed into one model, silently, and a config.json
    that would say only the second."""
    if not resumption.previous_config:
        return
    previous = flat_record(resumption.previous_config)
    changed = [(name, previous.get(name, DEFAULTS[name]), value)
               for name, value in training_flags(config).items()
               if _compared(name, previous.get(name, DEFAULTS[name])) != _compared(name, value)]
    if changed:
        theirs = " ".join(f"--{name}={quoted(old, 60)}" for name, old, _ in changed)
        # A flag its config.json lacks (an older version's, or edited away) was its default.
        unrecorded = " (the default: its config.json does not record it)"
        # A --learning_rate given sets the ceiling to 0 (config.py), which a user who gave
        # only the rate read as a change of theirs to a ceiling of 0: it says what 0 is.
        uncapped = {("max_learning_rate", 0.0): " (none: a --learning_rate given has no ceiling)"}
        mine = ", ".join(f"--{name}={quoted(old, 40)}{'' if name in previous else unrecorded} to "
                         f"{quoted(new, 40)}{uncapped.get((name, new), '')}"
                         for name, old, new in changed)
        raise ConfigError(
            f"--model_dir={quoted(config.run.model_dir)} holds a run trained otherwise: this run "
            f"changes {mine}. Pass {theirs} to resume it (only its length, batch, evaluation "
            f"and where it runs may change), or choose another --model_dir")
    refuse_another_model(previous.get("resolved", {}), signature, config.model.spec,
                         f"the run in --model_dir={quoted(config.run.model_dir)}",
                         "restore what differs to resume, or choose another --model_dir")


def _compared(name: str, value):
    """A flag's `value` as a resume compares it: a user's --model by its function
    (spec.identity), as its checkpoint names it, not by its path: the same file by an
    absolute path, or from another working directory (a cluster's job), was refused as
    another model. Its code is compared by refuse_another_model."""
    if name != "model" or not isinstance(value, str):
        return value
    try:
        return models.model_spec(value).identity
    except ModelError:  # not a model this program names: compared as it is
        return value


def continue_with(resumption: Resumption, plan: RunPlan, trained_global_batch) -> List[str]:
    """Adopts this run's plan for the restored checkpoint (the global batch
    it trains at, in `trained_global_batch`); returns what a user must be
    told of it: where it resumes, and what changed."""
    if not resumption.restored:  # a group restarted after a lost peer says it resumes
        return ["--model_dir holds no checkpoint of the run started there before (it stopped "
                "before its first): training starts again from step 0"
                ] if resumption.started_before else []
    notes = [resumption.restored.describe()]
    if resumption.start_step >= plan.total_steps:  # stopped at its end, or given fewer steps
        notes.append(f"the checkpoint is at step {resumption.start_step} and this run has "
                     f"{plan.total_steps} steps: nothing is left to train; the model of step "
                     f"{resumption.start_step} is evaluated and exported")
    previous = resumption.previous_config.get("resolved", {})
    if (planned := previous.get("total_steps")) and planned != plan.total_steps:
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


def check_workers_agree(strategy: tf.distribute.Strategy, facts: dict, flags: dict,
                        contents: dict) -> None:
    """Raises ClusterError on every worker unless all of them passed the same `facts`
    (name: a number, or a str such as a digest of the weights it restored), `flags` (flag
    name: value) and `contents` (what each node's own files hold: the model's signature,
    the images' fingerprint), naming what differs. Called with the flags before anything
    builds variables (which calls the collectives: other models or precisions fail there
    with a traceback), and with what is found later."""
    def differ(*values) -> List[bool]:  # exactly: a MEAN of three 0.6 is not 0.6
        mine = agreement_numbers(values)
        return values_differing(mine, barrier(strategy, mine)().numpy(), strategy.num_replicas_in_sync)

    names = [*facts, *(f"--{name}" for name in flags), *contents]
    # First one number whatever the version: a worker with one flag more
    # would meet the others' values in a collective of another length.
    if differ((__version__, names))[0]:
        raise ClusterError("the workers of this job run different versions of distributed_mpt "
                           "(or different flag sets): give every worker the same image")
    differing = {name for name, differs in zip(names, differ(
        *facts.values(), *flags.values(), *contents.values())) if differs}
    if differing_flags := [f"--{name}" for name in flags if f"--{name}" in differing]:
        mine = " ".join(f"{name}={quoted(flags[name[2:]], 80)}" for name in differing_flags)
        raise ClusterError(
            f"the workers of this job were started with different {', '.join(differing_flags)} "
            f"(this worker: {mine}): give every worker the same flags")
    if differing_contents := [name for name in contents if name in differing]:
        raise ClusterError(
            f"the {' and the '.join(differing_contents)} differ between the workers of this "
            f"job: give every node the same copy")
    if differing:
        mine = ", ".join(f"{name} {value}" for name, value in facts.items())  # ints, strs
        index = ("; precision is an index into " + "/".join(precision.PRECISIONS)
                 if "precision" in facts else "")
        raise ClusterError(
            f"the workers of this job see different runs ({', '.join(n for n in facts if n in differing)} "
            f"differ; this worker: {mine}{index}): give every worker the same --model_dir on one "
            f"shared file system, the same data and flags, and an explicit --precision")


def agreement_numbers(values) -> List[float]:
    """What a worker sends in check_workers_agree: per value, two 16-bit pieces p of its
    repr's hash and p*p. Only numbers travel, summed exactly in float64 for up to 2^21
    replicas: sum(p) == n*p and sum(p*p) == n*p*p only if every replica sent p."""
    digests = (hashlib.sha256(repr(value).encode()).digest() for value in values)
    return [float(x) for d in digests for p in (d[0] << 8 | d[1], d[2] << 8 | d[3])
            for x in (p, p * p)]


def values_differing(mine: List[float], sums, num_replicas: int) -> List[bool]:
    """Per value of `mine` (agreement_numbers): whether a replica sent another, given `sums`."""
    return [any(total != num_replicas * x for total, x in zip(sums[i:i + 4], mine[i:i + 4]))
            for i in range(0, len(mine), 4)]


def leave_together(strategy: tf.distribute.Strategy, num_workers: int, writes) -> None:
    """Returns once every worker got here (the others wait for the chief's export) and
    none lost its lock or failed a write after training (run_lock.Writes); else raises on
    every worker, its own error where it has one. A worker that left first would go while
    the chief's coordination service still watched it, which logs it as crashed
    (`StartAbort UNAVAILABLE: ... The tasks have crashed`, tensorflow/tensorflow#58434)
    at the end of a run that succeeded."""
    if num_workers > 1:
        lost, failed = barrier(strategy, (float(bool(writes.lost)), float(bool(writes.failed))))()
        if writes.lost or writes.failed:
            raise writes.lost or writes.failed
        if lost > 0:
            raise ModelDirLostError.of_the_chief()
        if failed > 0:
            raise UserError("the chief failed to finish the run after training (its own error "
                            "line says why): every worker stops with it")
