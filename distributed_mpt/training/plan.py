"""The numbers a run derives from its config, data and strategy: the global
batch, the steps, the peak learning rate and its warmup, the precision."""

import dataclasses
import math
from typing import List, Optional, Tuple

from distributed_mpt.config import TrainConfig
from distributed_mpt.core import pipeline, precision
from distributed_mpt.core.optim.schedules import (linear_rule_limit, linear_rule_warning,
                                                  scaled_learning_rate)
from distributed_mpt.errors import ConfigError


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

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling: float16 underflows small gradients."""
        return self.policy == "mixed_float16"


def plan_run(config: TrainConfig, num_replicas: int, num_workers: int,
             num_train_examples: int) -> RunPlan:
    """Scales batch and learning rate to the replicas; raises ConfigError if
    the global batch does not fit the training split."""
    global_batch = config.per_replica_batch_size * num_replicas
    epoch_steps = pipeline.steps_per_epoch(num_train_examples, global_batch)
    if epoch_steps == 0:
        raise ConfigError(
            f"the global batch of {global_batch} ({config.per_replica_batch_size} x {num_replicas} "
            f"replicas) exceeds the {num_train_examples} training examples; "
            f"lower --per_replica_batch_size")
    # A fraction of an epoch counts its steps, rounded up (airbench's 9.9).
    total_steps = config.train_steps or math.ceil(round(config.epochs * epoch_steps, 6))
    return RunPlan(
        policy=precision.resolve_precision(config.precision), num_workers=num_workers,
        num_replicas=num_replicas, global_batch_size=global_batch, steps_per_epoch=epoch_steps,
        total_steps=total_steps,
        learning_rate=scaled_learning_rate(config.learning_rate, global_batch,
                                           config.max_learning_rate),
        # Capped here as the schedule caps it, so that config.json says what ran.
        warmup_steps=min(round(config.warmup_epochs * epoch_steps), total_steps // 2))


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
    """What to say of a run whose --epochs come to fewer than SHORT_EPOCH_STEPS
    steps an epoch or SHORT_RUN_STEPS steps in all, with a per-replica batch
    (a power of two) that gives at least SHORT_EPOCH_STEPS an epoch, and the
    epochs that then give SHORT_RUN_STEPS; "" for any other run, and for one
    whose --train_steps says how many steps it takes. With it, the batch it
    suggests (None where it suggests none)."""
    if config.train_steps or (plan.steps_per_epoch >= SHORT_EPOCH_STEPS
                              and plan.total_steps >= SHORT_RUN_STEPS):
        return "", None
    said = (f"this run trains {plan.total_steps} step{'s' * (plan.total_steps != 1)} "
            f"({plan.steps_per_epoch} per epoch: {num_train_examples:,} training images in "
            f"global batches of {plan.global_batch_size}), too few to learn much")
    replicas = plan.num_replicas
    fitting = num_train_examples // (SHORT_EPOCH_STEPS * replicas)
    if not fitting:  # fewer images than SHORT_EPOCH_STEPS per replica: no batch is small enough
        return f"{said}; more training images would give more steps per epoch", None
    batch = min(config.per_replica_batch_size, 2 ** int(math.log2(fitting)))
    epoch_steps = pipeline.steps_per_epoch(num_train_examples, batch * replicas)
    steps = math.ceil(round(config.epochs * epoch_steps, 6))
    advice = [f"--per_replica_batch_size={batch}"] if batch < config.per_replica_batch_size else []
    if steps < SHORT_RUN_STEPS:
        epochs = math.ceil(SHORT_RUN_STEPS / epoch_steps)
        advice.append(f"--epochs={epochs}")
        steps = epochs * epoch_steps
    return f"{said}; {' and '.join(advice)} would train {steps} ({epoch_steps} per epoch)", batch
