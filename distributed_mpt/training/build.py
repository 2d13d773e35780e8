"""Where a run's config meets the core: the model, its parameter groups, the
optimizer, the lookahead and the compiled steps, built from the flags in the
strategy's scope, and the input pipeline that feeds them."""

import contextlib
import dataclasses

import tensorflow as tf

from distributed_mpt.config import TrainConfig
from distributed_mpt.core import models, pipeline
from distributed_mpt.core.augmentation import Augmentation
from distributed_mpt.core.data import Dataset, ImageSplit
from distributed_mpt.core.eval_views import EvalViews
from distributed_mpt.core.models.contract import users_code
from distributed_mpt.core.optim import groups
from distributed_mpt.core.optim.lookahead import Lookahead
from distributed_mpt.core.optim.optimizer import make_optimizer
from distributed_mpt.core.optim.schedules import learning_rate_schedule
from distributed_mpt.core.steps import SplitOnDevice, StepRules, Trainer
from distributed_mpt.errors import ConfigError, quoted
from distributed_mpt.process import memory
from distributed_mpt.training import outputs
from distributed_mpt.training.plan import RunPlan


@dataclasses.dataclass
class Built:
    """A run's trainer, and what it checkpoints beside it."""

    trainer: Trainer
    trained_global_batch: tf.Variable  # the global batch the checkpoint was trained at
    lookahead: object = None
    notes: tuple = ()  # what a user must be told of the model (models.build_model)

    @property
    def checkpointables(self) -> dict:
        """What a checkpoint must hold to resume at the exact step."""
        trainer = self.trainer
        state = {"model": trainer.model, "optimizer": trainer.optimizer, "step": trainer.step,
                 "global_batch_size": self.trained_global_batch}
        if self.lookahead:
            state["lookahead"] = self.lookahead.state
        return state


def build(config: TrainConfig, plan: RunPlan, strategy: tf.distribute.Strategy,
          dataset: Dataset) -> Built:
    """The run's trainer under `strategy`; create it after the precision
    policy is set and the random seed is fixed. Raises ModelError for a
    user's model that breaks the contract, ConfigError for --xla with a
    model that synchronizes replicas inside its forward pass."""
    spec = models.model_spec(config.model)
    options = {name: getattr(config, name) for name in spec.options}
    # Before any weight exists: a model too large is one line, not the OOM
    # killer mid-build. A user's network is counted once built, before the
    # optimizer's copies and the data's.
    _check_memory(models.parameter_count(spec, dataset.info, config.model_width, **options),
                  config)
    schedule = learning_rate_schedule(plan.learning_rate, plan.total_steps, plan.warmup_steps,
                                      config.lr_schedule)
    with strategy.scope():
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        notes = []
        model = models.build_model(spec, dataset.info, config.model_width, notes, **options)
        if config.xla and plan.num_replicas > 1 and models.has_batch_norm(model):
            raise ConfigError(
                f"--xla compiles each replica's forward and backward pass, which cannot hold "
                f"{config.model}'s batch norm synchronized over {plan.num_replicas} replicas: "
                f"drop --xla, or use it with one replica")
        if config.export:
            outputs.check_exportable(model, config.model)
        if spec.is_users:
            _check_memory(sum(int(tf.size(v)) for v in model.weights), config)
        models.initialize_from_data(model, dataset.train.images, config.model)
        jitter_split = (models.split_at_normalization(model, config.model)
                        if _augmentation(config).jitters_colors else None)
        lookahead = Lookahead(model, plan.total_steps) if config.lookahead else None
        # A user's model may name its variables' groups: its hook is code.
        with (users_code(config.model, "failed to say which parameter group its variables "
                         "train in") if spec.is_users else contextlib.nullcontext()):
            parameter_groups = groups.parameter_groups(model, _group_settings(config, plan))
        if spec.is_users:  # which rule trains what, which the user may change (extending.md)
            notes.append(f"parameter groups: {groups.describe(parameter_groups)}")
        optimizer = make_optimizer(parameter_groups, schedule, step,
                                   loss_scaling=plan.loss_scaling)
        # Built here, not lazily in the first step: MirroredStrategy
        # cannot create slot variables inside the traced step.
        optimizer.build(model.trainable_variables)
        trained_global_batch = tf.Variable(plan.global_batch_size, dtype=tf.int64,
                                           trainable=False)
    rules = StepRules(global_batch_size=plan.global_batch_size, num_workers=plan.num_workers,
                      label_smoothing=config.label_smoothing, loss_scaling=plan.loss_scaling,
                      lookahead=lookahead, xla=config.xla, jitter_split=jitter_split,
                      frozen=groups.freezes(parameter_groups))
    on_device = (SplitOnDevice(dataset.train, config.crop_padding) if config.data_on_device
                 else None)
    trainer = Trainer(model, optimizer, strategy, step, rules, on_device=on_device,
                      eval_views=EvalViews(config.eval_tta, config.eval_tta_fraction))
    return Built(trainer, trained_global_batch, lookahead, tuple(notes))


# Copies of every weight a run holds besides the weights: the gradient, the
# momentum, the lookahead's average, and a checkpoint or export in the making.
_COPIES_PER_WEIGHT = 5


def _check_memory(parameters, config: TrainConfig) -> None:
    """Raises ConfigError if training a model of `parameters` weights (None:
    not known yet) cannot fit in what this process may still take: the
    host's available memory or, in a container, a pod or a SLURM job, its
    cgroup's limit (process/memory.py). A width of 1,024 is one line at the
    start, not the OOM killer's exit 137 (which restart policies retry)
    without a word."""
    headroom = memory.headroom()
    needed = _COPIES_PER_WEIGHT * 4 * (parameters or 0)  # float32 variables, in any policy
    if headroom and needed > headroom.bytes:
        users = models.model_spec(config.model).is_users
        what, smaller = ((f"--model={quoted(config.model)}", "a smaller network") if users else
                         (f"--model={config.model} at --model_width={config.model_width}",
                          "a lower --model_width"))
        raise ConfigError(
            f"{what} has {parameters:,} parameters: training it needs about "
            f"{needed / 1e9:.1f} GB, more than the {headroom.describe()}; use {smaller}, or "
            f"give the run more memory")


def _group_settings(config: TrainConfig, plan: RunPlan) -> groups.Settings:
    muon = config.optimizer == "muon"
    return groups.Settings(
        peak_learning_rate=plan.learning_rate, weight_decay=config.weight_decay,
        momentum=config.momentum, momentum_form=config.momentum_form,
        filters_rule=config.optimizer,
        # Muon's rate is its own peak, following the run's schedule.
        filters_rate=config.muon_learning_rate / plan.learning_rate if muon else 1.0,
        filters_momentum=config.muon_momentum, shift_rate=config.shift_lr_multiplier,
        whiten_bias_steps=round(config.whiten_bias_epochs * plan.steps_per_epoch),
        whiten_bias_freeze=config.whiten_bias_freeze,
        muon_weight_decay=config.muon_weight_decay, muon_renormalize=config.muon_renormalize,
        muon_newton_schulz=config.muon_newton_schulz, total_steps=plan.total_steps)


def train_input(trainer: Trainer, config: TrainConfig, plan: RunPlan, split: ImageSplit,
                start_step: int):
    """The distributed training input from `start_step` to the last step:
    images and labels, or with the split on the device, what to gather."""
    return trainer.strategy.distribute_datasets_from_function(pipeline.train_input_fn(
        split, plan.global_batch_size, config.seed, start_step, plan.total_steps - start_step,
        images_on_device=trainer.images_on_device,
        augmentation=_augmentation(config)))


def recalibration_input(trainer: Trainer, config: TrainConfig, plan: RunPlan, split: ImageSplit,
                        batches: int):
    """`batches` global batches of unaugmented training images and labels,
    from the first, for batch norm's recalibration (core/batch_norm.py)."""
    return trainer.strategy.distribute_datasets_from_function(pipeline.train_input_fn(
        split, plan.global_batch_size, config.seed, 0, batches,
        augmentation=Augmentation(crop_padding=0, flip="none")))


def _augmentation(config: TrainConfig) -> Augmentation:
    return Augmentation(config.crop_padding, config.flip, config.brightness_jitter,
                        config.contrast_jitter)
