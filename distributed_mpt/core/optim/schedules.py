"""How the learning rate follows the global batch and the steps of a run.

The learning rate scales linearly with the global batch (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"), warms up linearly, and then decays: by a
cosine to zero, or linearly to a floor as airbench94 does.
"""

import dataclasses
import math
from typing import Optional

from distributed_mpt.options import MAX_STEPS, Options, option, require, require_at_most

SCHEDULES = ("cosine", "linear", "piecewise_linear")

# The batch at which --learning_rate is stated. 128 with lr 0.1 and SGD
# momentum 0.9 is the classic CIFAR ResNet recipe (He et al. 2016, sec. 4.2).
REFERENCE_BATCH_SIZE = 128

# Where the linear rule is known to fail (docs/scaling.md, "The rules at
# scale"). Goyal et al. 2017 (arXiv:1706.02677) kept ImageNet accuracy with
# it and a warmup up to a global batch of 8192, and lost it above; Keskar et
# al. 2017 (arXiv:1609.04836) measured a generalization gap on CIFAR-10 at
# batches of 10% of the training split. Above either, a run warns.
LINEAR_RULE_LIMIT = 8192
LARGE_BATCH_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class ScheduleOptions(Options):
    """How long a run trains, and how its learning rate moves over the steps."""

    epochs: float = option(24, "Epochs to train (a fraction of one counts its steps, rounded up).")
    train_steps: int = option(0, "Optimizer steps to train; overrides --epochs when > 0.")
    # None: the model's default (its spec's `defaults` in core/models).
    warmup_epochs: Optional[float] = option(
        None, "Epochs of the learning-rate warmup (see --lr_schedule); at most half of the run.")
    lr_schedule: str = option(
        "cosine", "cosine: linear warmup from 0 to the peak, then cosine decay to 0. linear: "
        "the same warmup, then linearly to 0. piecewise_linear (airbench94's): linear from 0.2x the peak to the peak over the "
        "warmup, then linear to 0.07x the peak at the last step.", SCHEDULES)

    def check(self) -> None:
        # Negative even beside --train_steps, which overrides it: else the typo
        # trains, and is recorded in config.json.
        require(self.epochs > 0 or (self.epochs == 0 and self.train_steps > 0),
                f"--epochs={self.epochs} must be a positive number (or set --train_steps)")
        require_at_most(self, MAX_STEPS, "train_steps", "epochs", "warmup_epochs")
        require(self.train_steps >= 0,
                f"--train_steps={self.train_steps} must be >= 0 (0 means: use --epochs)")
        require(self.warmup_epochs >= 0, f"--warmup_epochs={self.warmup_epochs} must be >= 0")

    @property
    def fixed_length(self) -> bool:
        """Whether --train_steps, not --epochs, says how long the run is."""
        return self.train_steps > 0

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's steps; a fraction of an epoch counts its steps, rounded up (airbench's 9.9)."""
        # At least one: --epochs=1e-9 made a run of 0 steps, which exported a model never trained.
        return self.train_steps or max(1, math.ceil(round(self.epochs * steps_per_epoch, 6)))

    def warmup_steps(self, steps_per_epoch: int, total_steps: int) -> int:
        """Capped here as the schedule caps it, so that config.json says what ran."""
        return min(round(self.warmup_epochs * steps_per_epoch), total_steps // 2)

    def schedule(self, peak: float, total_steps: int, warmup_steps: int):
        """The learning rate of each step (learning_rate_schedule)."""
        return learning_rate_schedule(peak, total_steps, warmup_steps, self.lr_schedule)

    def describe(self, warmup_steps: int) -> str:
        return f"{self.lr_schedule} schedule with {warmup_steps} warmup steps"


def scaled_learning_rate(base_learning_rate: float, global_batch_size: int,
                         ceiling: float = 0.0) -> float:
    """The peak learning rate for `global_batch_size` (linear scaling rule),
    at most `ceiling` (0: none).

    Linear scaling keeps the noise of a step constant; it cannot move the
    curvature limit (a rate above ~2/curvature diverges at any batch), which
    a network without normalization layers, like the MLP, reaches at large
    batches.
    """
    rate = base_learning_rate * global_batch_size / REFERENCE_BATCH_SIZE
    return min(rate, ceiling) if ceiling > 0 else rate


def linear_rule_limit(train_examples: int) -> int:
    """The largest global batch at which the linear rule is known to hold
    for a training split of `train_examples` (one image, at the least: a
    folder of 9 warned that a batch of 1 was above 0)."""
    return min(LINEAR_RULE_LIMIT, max(1, int(LARGE_BATCH_FRACTION * train_examples)))


def linear_rule_warning(global_batch_size: int, train_examples: int) -> str:
    """Why `global_batch_size` is beyond where the linear rule is known to
    hold, for a `warning:` line; empty when it is not."""
    limit = linear_rule_limit(train_examples)
    if global_batch_size <= limit:
        return ""
    return (f"a global batch of {global_batch_size} is above {limit}, where the linear "
            f"learning-rate rule is known to fail (ImageNet above 8192, Goyal et al. 2017; "
            f"CIFAR-10 at 10% of its training split, Keskar et al. 2017): expect lower "
            f"accuracy than at a smaller batch; lower --per_replica_batch_size, and see "
            f"docs/scaling.md (the package has no layer-wise rule such as LARS or LAMB)")


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int,
                           kind: str = "cosine"):
    """The learning rate of each step (a callable of the step, a tensor or
    a number), of `kind` (one of SCHEDULES, as --lr_schedule's help says).
    The warmup takes at most half of the run, so that a short run (a smoke
    test, --train_steps) still decays instead of ending at its peak."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose from {SCHEDULES}")
    warmup_steps = min(warmup_steps, total_steps // 2)
    if kind == "cosine":
        return Cosine(peak, total_steps, warmup_steps)
    if kind == "linear":
        return PiecewiseLinear(peak, total_steps, warmup_steps, start=0.0, end=0.0)
    return PiecewiseLinear(peak, total_steps, warmup_steps)


class PiecewiseLinear:
    """A linear rise from `start` x peak to the peak over `warmup_steps`, then
    a linear fall to `end` x peak at `total_steps`; airbench94's by default."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int, start: float = 0.2,
                 end: float = 0.07):
        self.peak, self.total_steps, self.warmup_steps = peak, total_steps, warmup_steps
        self.start, self.end = start, end

    def __call__(self, step):
        import tensorflow as tf

        step = tf.cast(step, tf.float32)
        rising = self.start + (1 - self.start) * step / max(self.warmup_steps, 1)
        falling = 1 - (1 - self.end) * (step - self.warmup_steps) / max(
            self.total_steps - self.warmup_steps, 1)
        return self.peak * tf.where(step < self.warmup_steps, rising, falling)


class Cosine:
    """A linear rise from 0 to the peak over `warmup_steps` (none if 0),
    then half a cosine down to 0 at `total_steps`: the arithmetic of Keras'
    CosineDecay with `warmup_target`."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int):
        self.peak, self.total_steps, self.warmup_steps = peak, total_steps, warmup_steps

    def __call__(self, step):
        import tensorflow as tf

        step = tf.cast(step, tf.float32)
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = tf.minimum(step - self.warmup_steps, decay_steps) / decay_steps
        decayed = self.peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.warmup_steps == 0:
            return decayed
        return tf.where(step < self.warmup_steps, self.peak * step / self.warmup_steps, decayed)
