"""The numbers a run derives from its config, data and strategy: the global
batch, the steps, the peak learning rate and its warmup, the precision."""

import dataclasses
import math

from distributed_mpt.config import TrainConfig
from distributed_mpt.core import pipeline, precision
from distributed_mpt.core.optim.schedules import scaled_learning_rate
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


def short_run_warning(config: TrainConfig, plan: RunPlan, num_train_examples: int) -> str:
    """What to say of a run whose --epochs come to fewer than SHORT_EPOCH_STEPS
    steps an epoch or SHORT_RUN_STEPS steps in all, with a per-replica batch
    (a power of two) that gives at least SHORT_EPOCH_STEPS an epoch, and the
    epochs that then give SHORT_RUN_STEPS; "" for any other run, and for one
    whose --train_steps says how many steps it takes."""
    if config.train_steps or (plan.steps_per_epoch >= SHORT_EPOCH_STEPS
                              and plan.total_steps >= SHORT_RUN_STEPS):
        return ""
    replicas = plan.num_replicas
    fitting = max(1, num_train_examples // (SHORT_EPOCH_STEPS * replicas))
    batch = min(config.per_replica_batch_size, 2 ** int(math.log2(fitting)))
    epoch_steps = pipeline.steps_per_epoch(num_train_examples, batch * replicas)
    steps = math.ceil(round(config.epochs * epoch_steps, 6))
    advice = [f"--per_replica_batch_size={batch}"] if batch < config.per_replica_batch_size else []
    if steps < SHORT_RUN_STEPS:
        epochs = math.ceil(SHORT_RUN_STEPS / epoch_steps)
        advice.append(f"--epochs={epochs}")
        steps = epochs * epoch_steps
    said = (f"this run trains {plan.total_steps} steps ({plan.steps_per_epoch} per epoch: "
            f"{num_train_examples:,} training images in global batches of "
            f"{plan.global_batch_size}), too few to learn much")
    if not advice:  # fewer images than SHORT_EPOCH_STEPS per replica: no batch is small enough
        return f"{said}; more training images would give more steps per epoch"
    return f"{said}; {' and '.join(advice)} would train {steps} ({epoch_steps} per epoch)"
