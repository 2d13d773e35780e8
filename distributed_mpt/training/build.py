"""Where a run's config meets the core: the model, its parameter groups, the
optimizer, the lookahead and the compiled steps, built from the flags in the
strategy's scope, the input pipeline that feeds them, batch norm's
recalibration after the last step, and what a model that diverged tells."""

import contextlib
import dataclasses
import math
from typing import Optional

import tensorflow as tf

from distributed_mpt.config import TrainConfig
from distributed_mpt.core import batch_norm, models, pipeline
from distributed_mpt.core.augmentation import Augmentation
from distributed_mpt.core.data import Dataset, ImageSplit
from distributed_mpt.core.eval_views import EvalViews
from distributed_mpt.core.models import blame
from distributed_mpt.core.models.contract import CHANGED, ModelError, check_servable, users_code
from distributed_mpt.core.optim import groups
from distributed_mpt.core.optim.optimizer import make_optimizer
from distributed_mpt.core.steps import SplitOnDevice, StepRules, Trainer
from distributed_mpt.core.optim.schedules import REFERENCE_BATCH_SIZE
from distributed_mpt.errors import ConfigError, DivergedError, quoted
from distributed_mpt.process import memory
from distributed_mpt.training import outputs
from distributed_mpt.training.checkpoints import RANDOM_STATE
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
        draws = random_state(trainer.model)
        if draws:  # a resume then draws the masks an uninterrupted run would
            state[RANDOM_STATE] = draws
        return state


def random_state(model) -> list:
    """The state of `model`'s random draws (Dropout's masks, Keras' random
    augmentations): its variables that are not weights, Keras' seed
    generators. Keras checkpoints a model's weights alone."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def build(config: TrainConfig, plan: RunPlan, strategy: tf.distribute.Strategy,
          dataset: Dataset) -> Built:
    """The run's trainer under `strategy`; create it after the precision
    policy is set and the random seed is fixed. Raises ModelError for a
    user's model that breaks the contract, ConfigError for --xla with a
    model that synchronizes replicas inside its forward pass."""
    run, spec = config.run, config.model.spec
    replicas = _replicas_in_host_memory(strategy)
    # Before any weight exists: a model too large is one line, not the OOM
    # killer mid-build. A user's network is counted as it is built, and
    # once built, before the optimizer's copies and the data's.
    _check_memory(config.model.parameter_count(dataset.info, config.airbench), config, replicas)
    schedule = config.schedule.schedule(plan.learning_rate, plan.total_steps, plan.warmup_steps)
    with strategy.scope():
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        notes = []
        with (_counted_as_built(config, replicas) if spec.is_users
              else contextlib.nullcontext()) as headroom:
            model = config.model.build(dataset.info, config.airbench, notes,
                                       plan.global_batch_size // plan.num_replicas)
        if run.xla and plan.num_replicas > 1 and models.has_batch_norm(model):
            raise ConfigError(
                f"--xla compiles each replica's forward and backward pass, which cannot hold "
                f"{spec.name}'s batch norm synchronized over {plan.num_replicas} replicas: "
                f"drop --xla, or use it with one replica")
        if run.export:
            check_exportable(model, spec.name)
            if spec.is_users:  # its call() is code
                check_servable(spec.name, model, dataset.info.image_shape)
        if spec.is_users:  # all of them now, against the memory there was before
            _check_memory(sum(int(tf.size(v)) for v in model.weights), config, replicas,
                          headroom)
        models.initialize_from_data(model, dataset.train.images, spec.name)
        jitter_split = (models.split_at_normalization(model, spec.name)
                        if config.augmentation.jitters_colors else None)
        if plan.early_crop_steps:
            models.take_crops(model, plan.early_crop_size, dataset.info.image_shape, spec.name,
                              parts=jitter_split[1:] if jitter_split else ())
        lookahead = config.optimizer.make_lookahead(model, plan.total_steps)
        # A user's model may name its variables' groups: its hook is code.
        with (users_code(spec.name, "failed to say which parameter group its variables "
                         "train in") if spec.is_users else contextlib.nullcontext()):
            parameter_groups = groups.parameter_groups(model, groups.Settings(
                config.optimizer, plan.learning_rate, config.muon, plan.steps_per_epoch,
                plan.total_steps))
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
                      label_smoothing=config.optimizer.label_smoothing,
                      loss_scaling=plan.loss_scaling, lookahead=lookahead, xla=run.xla,
                      jitter_split=jitter_split, frozen=groups.freezes(parameter_groups))
    on_device = (SplitOnDevice(dataset.train, config.augmentation)
                 if run.data_on_device else None)
    evaluation = config.evaluation
    trainer = Trainer(model, optimizer, strategy, step, rules, on_device=on_device,
                      eval_views=EvalViews(evaluation.eval_tta, evaluation.eval_tta_fraction),
                      users_model=spec.name if spec.is_users else None)
    return Built(trainer, trained_global_batch, lookahead, tuple(notes))


def check_exportable(model, name: str) -> None:
    """Raises ModelError if `model` (--model=`name`) cannot be written as the
    export's `.keras` file: a subclassed model, or a layer whose `__init__`
    took a value Keras cannot serialize, without a `get_config()`. Said
    before training, not after it."""
    import keras

    try:
        keras.saving.serialize_keras_object(model)
    except Exception as e:  # noqa: BLE001 - the user's get_config() may raise anything
        # Keras' message is a paragraph, then an example of get_config().
        said = " ".join(str(e).split("Example:")[0].split()) or type(e).__name__
        raise ModelError(
            f"--model={quoted(name)} cannot be saved as the export's {outputs.KERAS_FILE} "
            f"({type(e).__name__}: {quoted(said, limit=400)}): implement get_config(), returning "
            f"the arguments of its __init__ as numbers, strings and lists (docs/extending.md, "
            f"\"A subclassed model\"); or pass --noexport") from None


# Copies of every weight a run holds at its peak, the export: the weights,
# the gradient, the momentum, the lookahead's average, and the export's. A
# user's network of 922 million weights, let through at 5, peaked at 22.5 GB
# as it exported (6.1 copies) and met the OOM killer (2 cores of an AVX2-only
# AMD EPYC, Zen 3, 24 GB).
_COPIES_PER_WEIGHT = 7


def _replicas_in_host_memory(strategy: tf.distribute.Strategy) -> int:
    """This process's replicas on CPUs, each with its copy of the model in
    host memory (--cpu_replicas), at least one."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # TensorFlow's default strategy: one device, says none
        return 1
    return max(1, sum(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices))


def _check_memory(parameters, config: TrainConfig, replicas: int,
                  headroom: Optional[memory.Headroom] = None, so_far: bool = False) -> None:
    """Raises ConfigError if training a model of `parameters` weights (None:
    not known yet; `so_far`: at least that many), held `replicas` times in
    host memory (once per logical CPU device of --cpu_replicas: resnet9 at
    --model_width=128 peaked at 3.7 GB on 4, 1.3 GB on 1, on that EPYC; a
    GPU holds its own), cannot fit in what this process may still take, `headroom` or
    else as read now: the host's available memory or, in a container, a pod
    or a SLURM job, its cgroup's limit (process/memory.py). A width of
    1,024 is one line at the start, not the OOM killer's exit 137 (which
    restart policies retry) without a word."""
    short = memory_shortfall(parameters or 0, _COPIES_PER_WEIGHT * replicas, headroom)
    if short:
        needed, headroom = short
        what, smaller = config.model.too_large()
        count = f"at least {parameters:,} parameters (counted as it was built)" if so_far \
            else f"{parameters:,} parameters"
        on, fewer = ((f" on {replicas} replicas in this host's memory", ", fewer --cpu_replicas")
                     if replicas > 1 else ("", ""))
        raise ConfigError(
            f"{what} has {count}: training it{on} needs {'at least' if so_far else 'about'} "
            f"{needed / 1e9:.1f} GB, more than the {headroom.describe()}; use {smaller}{fewer}, "
            f"or give the run more memory")


def memory_shortfall(parameters: int, copies: int,
                     headroom: Optional[memory.Headroom] = None) -> Optional[tuple]:
    """(bytes needed, the headroom they exceed) if `copies` of `parameters`
    weights do not fit in `headroom` (else as read now); None if they fit, or
    where nothing can be read. Training counts _COPIES_PER_WEIGHT a replica;
    predict, which holds fewer, counts its own."""
    headroom = headroom or memory.headroom()
    needed = copies * 4 * parameters  # float32 variables, in any policy
    return (needed, headroom) if headroom and needed > headroom.bytes else None


@contextlib.contextmanager
def _counted_as_built(config: TrainConfig, replicas: int):
    """Counts a user's network as its variables are made, and stops its
    build at the one that takes it past what the memory holds
    (_check_memory): its size is not known before, and one far too large
    met the OOM killer halfway through its weights. Memory is read once,
    before the first weight, and yielded for the count of the whole. A
    single variable larger than the memory is still made first (its
    initializer runs inside TensorFlow)."""
    headroom = memory.headroom()
    made = 0
    refusal = None

    def count(next_creator, **kwargs):
        nonlocal made, refusal
        variable = next_creator(**kwargs)
        made += variable.shape.num_elements() or 0
        try:
            _check_memory(made, config, replicas, headroom, so_far=True)
        except ConfigError as e:
            refusal = e
            raise
        return variable

    try:
        with tf.variable_creator_scope(count):
            yield headroom
    except BaseException:
        if refusal is None:
            raise
        # As raised: Keras may have rewrapped it in a layer's call.
        raise refusal from None
    if refusal is not None:  # the user's code caught it, and built on
        raise refusal


def train_input(trainer: Trainer, config: TrainConfig, plan: RunPlan, split: ImageSplit,
                start_step: int, end_step: int, crop_size: Optional[int]):
    """The distributed training input of steps `start_step` .. `end_step` - 1
    (one of `plan.input_phase`'s): images and labels, crops of `crop_size`
    if not None, or with the split on the device, what to gather."""
    return trainer.strategy.distribute_datasets_from_function(pipeline.train_input_fn(
        split, plan.global_batch_size, config.run.seed, start_step, end_step - start_step,
        images_on_device=trainer.images_on_device, augmentation=config.augmentation,
        crop_size=crop_size))


def recalibrate_batch_norm(trainer: Trainer, config: TrainConfig, plan: RunPlan,
                           train_split: ImageSplit, checkpoints, reporter,
                           writes) -> Optional[dict]:
    """Recalibrates batch norm's moving statistics if --bn_recalibration
    says so (core/batch_norm.py), over the first batches of `train_split`
    unaugmented, and saves them into the last checkpoint (through `writes`,
    a run_lock.Writes): a finished run exported again, and predict reading
    the checkpoint, get them too.
    Returns what summary.json says of it (None: not done)."""
    steps = int(trainer.step.numpy())
    layers, why = batch_norm.to_recalibrate(trainer.model, steps,
                                            config.evaluation.bn_recalibration)
    if not layers:
        return None
    batches = batch_norm.recalibration_batches(len(train_split), plan.global_batch_size)
    images = batches * plan.global_batch_size
    activity = (f"recalibrating the moving statistics of {len(layers)} of "
                f"{len(batch_norm.batch_norm_layers(trainer.model))} batch-norm layers over "
                f"{images:,} unaugmented training images")
    reporter.say(f"{activity} ({why})")
    iterator = iter(trainer.strategy.distribute_datasets_from_function(pipeline.train_input_fn(
        train_split, plan.global_batch_size, config.run.seed, 0, batches,
        augmentation=Augmentation(crop_padding=0, flip="none"))))
    spec = config.model.spec  # a user's model's training-mode call fails here as in a step
    with reporter.doing(activity):
        with (blame.named_if_its_own(
                spec.name, trainer.model, "the batch-norm recalibration after training",
                f"the run's checkpoints are kept, the latest of step {steps}: run again with "
                f"--bn_recalibration=off to finish ({CHANGED})") if spec.is_users
              else contextlib.nullcontext()):
            batch_norm.recalibrate(trainer.model, trainer.strategy, iterator, batches, layers)
        writes(checkpoints.save, steps)
    return {"layers": len(layers), "images": images}


def divergence_advice(plan: RunPlan, last_saved: int) -> tuple:
    """(which checkpoint a run that diverged keeps, given `last_saved`, the
    step of its last; what to change)."""
    kept = (f"kept the last good checkpoint (step {last_saved}) untouched"
            if last_saved else "no checkpoint had been written yet")
    # Both shape what is trained: a resume in the same --model_dir refuses them (config.py).
    return kept, (f"lower the peak learning rate {plan.learning_rate:g} (--learning_rate is "
                  f"scaled by the global batch/{REFERENCE_BATCH_SIZE}; or set "
                  f"--max_learning_rate)" +
                  (" or use --precision=float32" if plan.policy != "float32" else "") +
                  " in a new --model_dir (a resume refuses a changed learning rate or precision)")


def check_evaluation(model, plan: RunPlan, result: dict, step: int, last_saved: int) -> None:
    """Raises DivergedError if the evaluation `result` of `model` at `step`
    has a NaN or infinite figure: the training loss being finite (the loop
    checks it), the weights or batch norm's moving statistics are not (no
    later step, recalibration or export mends them), or the model's inference
    arithmetic overflows. Before any write of it: summary.json and
    model_info.json hold no number JSON has not."""
    bad = [key for key, value in result.items()
           if isinstance(value, float) and not math.isfinite(value)]
    if not bad:
        return
    broken = [v.path for v in model.variables if tf.as_dtype(v.dtype).is_floating
              and not bool(tf.reduce_all(tf.math.is_finite(v)))]
    found = (f"{len(broken)} of the model's variables are not finite ({', '.join(broken[:3])}"
             f"{f' and {len(broken) - 3} more' if len(broken) > 3 else ''})" if broken else
             "its variables are finite, its output on the test images is not")
    kept, remedy = divergence_advice(plan, last_saved)
    if not broken:  # no learning rate made them so: the arithmetic of inference overflows
        remedy = ("look for an overflow or a division in the model's inference" +
                  (" or use --precision=float32 in a new --model_dir (a resume refuses a "
                   "changed precision)" if plan.policy != "float32" else ""))
    if last_saved >= step:  # the last step's: what was evaluated
        kept = f"kept the checkpoint of step {step}, exported nothing"
    raise DivergedError(f"the evaluation at step {step} gave a NaN or infinite "
                        f"{' and '.join(bad)}, though the training loss was finite: {found}; "
                        f"{kept}: {remedy}")
