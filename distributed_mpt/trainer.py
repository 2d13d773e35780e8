"""The training loop: one code path for every `tf.distribute` strategy.

Keras 3's `Model.fit` fails under MultiWorkerMirroredStrategy, so training is
a custom loop of `strategy.run(train_step)` inside a `tf.function` that runs
several optimizer steps per call (about a second's worth, at most
`steps_per_loop`); it serves the default strategy, OneDeviceStrategy,
MirroredStrategy and MultiWorkerMirroredStrategy alike.
"""

import dataclasses
import hashlib
import math
import os
import time
from typing import Optional

import keras
import tensorflow as tf

from distributed_mpt import datasets, distribution, input_pipeline, optimization, outputs, precision, stopping
from distributed_mpt.checkpointing import Checkpoints, model_identity
from distributed_mpt.cluster import Cluster
from distributed_mpt import config as config_lib
from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import ClusterError, ConfigError, DivergedError, Preempted
from distributed_mpt.models import (batch_norm_shifts, build_model, convolution_filters,
                                   initialize_from_data, synchronizes_replicas, whitening_bias)
from distributed_mpt.reporting import Reporter

# With dynamic loss scaling, overflowing steps are skipped and the scale
# halves; this many in a row means the loss itself is not finite.
_NONFINITE_STEPS_WITH_LOSS_SCALING = 100


def _sum_accumulator(size: int) -> tf.Variable:
    """Per-replica running sums, read and reset once per loop call."""
    return tf.Variable(tf.zeros([size]), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)


@dataclasses.dataclass(frozen=True)
class LoopTotals:
    """What one call of the training loop sums over all replicas."""

    loss_sum: float
    correct: float
    examples: float
    nonfinite_steps: float   # fractional when only some replicas saw one
    stop_requests: float     # > 0: the call stopped early, on every worker alike
    seconds_per_step: float  # the previous call's, averaged over the replicas

    def __add__(self, other: "LoopTotals") -> "LoopTotals":
        """The sums of both; the stop and the pace are `other`'s, the newer
        call's."""
        return LoopTotals(self.loss_sum + other.loss_sum, self.correct + other.correct,
                          self.examples + other.examples,
                          self.nonfinite_steps + other.nonfinite_steps,
                          other.stop_requests, other.seconds_per_step)


NO_TOTALS = LoopTotals(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


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
    epoch_steps = input_pipeline.steps_per_epoch(num_train_examples, global_batch)
    if config.xla and num_replicas > 1 and synchronizes_replicas(config.model):
        raise ConfigError(
            f"--xla compiles each replica's forward and backward pass, which cannot hold "
            f"{config.model}'s batch norm synchronized over {num_replicas} replicas: drop --xla, "
            f"or use it with one replica")
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
        learning_rate=optimization.scaled_learning_rate(config.learning_rate, global_batch,
                                                        config.max_learning_rate),
        # Capped here as the schedule caps it, so that config.json says what ran.
        warmup_steps=min(round(config.warmup_epochs * epoch_steps), total_steps // 2))


class Trainer:
    """The model, optimizer and compiled loops of one run under one strategy.

    Create it after the precision policy is set. All state lives in the
    strategy's scope; `checkpointables` is what a checkpoint must hold.
    """

    def __init__(self, config: TrainConfig, plan: RunPlan, strategy: tf.distribute.Strategy,
                 train_split: datasets.ImageSplit):
        self.config, self.plan, self._strategy = config, plan, strategy
        schedule = optimization.learning_rate_schedule(
            plan.learning_rate, plan.total_steps, plan.warmup_steps, config.lr_schedule)
        with strategy.scope():
            self.model = build_model(config.model, config.model_width, config.weight_decay,
                                     config.shift_lr_multiplier)
            initialize_from_data(self.model, train_split.images)
            # The logits, for test-time augmentation to average.
            self._logits = keras.Model(self.model.inputs, self.model.get_layer("logits").output)
            self._lookahead = (optimization.Lookahead(self.model, plan.total_steps)
                               if config.lookahead else None)
            self.optimizer = optimization.make_optimizer(
                schedule, config.momentum, loss_scaling=plan.loss_scaling,
                muon_variables=convolution_filters(self.model) if config.optimizer == "muon" else (),
                muon_rate_ratio=config.muon_learning_rate / plan.learning_rate,
                muon_momentum=config.muon_momentum)
            # Built here, not lazily in the first step: MirroredStrategy
            # cannot create slot variables inside the traced step.
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.trained_global_batch = tf.Variable(plan.global_batch_size, dtype=tf.int64,
                                                    trainable=False)
            self._train_sums = _sum_accumulator(4)  # loss sum, correct, examples, skipped steps
            # loss sum, correct, examples, correct without test-time augmentation
            self._eval_sums = _sum_accumulator(4)
            self._device_split = None
            if config.data_on_device:
                # A copy per device, made once; the input pipeline then
                # carries only indices and augmentation parameters.
                self._device_split = (tf.Variable(train_split.images, trainable=False),
                                      tf.Variable(train_split.labels, trainable=False))
        self._train_loss = keras.losses.CategoricalCrossentropy(
            label_smoothing=config.label_smoothing, reduction=None)
        self._eval_loss = keras.losses.CategoricalCrossentropy(reduction=None)
        self._gradients = self._compute_gradients
        if config.xla:
            # Only the forward and backward pass: the gradient all-reduce and
            # the update stay outside XLA, where every strategy supports them.
            self._gradients = tf.function(self._compute_gradients, jit_compile=True)
        self._gradient_scales = _gradient_scales(self.model, config.shift_lr_multiplier)
        bias = whitening_bias(self.model)
        self._whiten_bias_index = next((i for i, v in enumerate(self.model.trainable_variables)
                                        if v is bias), None)
        self._whiten_bias_steps = round(config.whiten_bias_epochs * plan.steps_per_epoch)
        # Set from the stop-signal thread while a loop call runs (see
        # request_stop); outside the strategy's scope: one value per process.
        self._stop_requested = tf.Variable(False, trainable=False, name="stop_requested")
        self._train_loop = tf.function(self._train_loop_fn)
        self._eval_loop = tf.function(self._eval_loop_fn)

    @property
    def checkpointables(self) -> dict:
        state = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                 "global_batch_size": self.trained_global_batch}
        if self._lookahead:
            state["lookahead"] = self._lookahead.state
        return state

    def check_workers_agree(self, facts: dict, flags: dict) -> None:
        """Raises ClusterError on every worker unless all of them passed the
        same `facts` (numbers) and `flags` (flag name: value), naming what
        differs. A worker that resumes from another step (no shared
        --model_dir), finds another split, or resolves another precision
        would call the collectives differently: a hang. One started with
        another seed, rate or weight decay trains a silently different run,
        which the chief's config.json would not show."""
        # Workers exchange only numbers: each flag travels as 32 bits of its
        # value's hash, which a float64 holds, and the sum over workers too.
        digests = [int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:4], "big")
                   for v in flags.values()]
        values = tf.constant([float(v) for v in [*facts.values(), *digests]], tf.float64)
        strategy = self._strategy

        @tf.function(autograph=False)
        def workers_differing():
            # Per entry: if all are equal, each equals the mean; if not, some
            # do not. The sum counts the workers that differ from the mean.
            mean = strategy.reduce("MEAN", strategy.run(lambda: tf.identity(values)), axis=None)
            differs = strategy.run(lambda: tf.cast(values != mean, tf.float64))
            return strategy.reduce("SUM", differs, axis=None)

        names = [*facts, *(f"--{name}" for name in flags)]
        differing = [name for name, count in zip(names, workers_differing().numpy()) if count > 0]
        differing_flags = [name for name in differing if name.startswith("--")]
        if differing_flags:
            mine = " ".join(f"{name}={flags[name[2:]]}" for name in differing_flags)
            raise ClusterError(
                f"the workers of this job were started with different {', '.join(differing_flags)} "
                f"(this worker: {mine}): give every worker the same flags")
        if differing:
            mine = ", ".join(f"{name} {value:g}" for name, value in facts.items())
            raise ClusterError(
                f"the workers of this job see different runs ({', '.join(differing)} differ; this "
                f"worker: {mine}; precision is an index into {'/'.join(config_lib.PRECISIONS)}): "
                f"give every worker the same --model_dir on one shared file system, the same data "
                f"and flags, and an explicit --precision")

    def train_dataset(self, split: datasets.ImageSplit, start_step: int):
        """The distributed training input from `start_step` to the last step."""
        return self._strategy.distribute_datasets_from_function(input_pipeline.train_input_fn(
            split, self.plan.global_batch_size, self.config.seed, start_step,
            self.plan.total_steps - start_step, images_on_device=self._device_split is not None,
            augmentation=input_pipeline.Augmentation(self.config.crop_padding, self.config.flip)))

    def request_stop(self) -> None:
        """Makes the loop call under way, or the next, stop at the next step
        boundary (every worker at the same one). Safe from any thread."""
        self._stop_requested.assign(True)

    def train(self, iterator, num_steps: int, seconds_per_step: float = 0.0) -> LoopTotals:
        """Runs `num_steps` optimizer steps, fewer if a stop was requested
        (`stop_requests` > 0; `step` says where it stopped). This worker's
        `seconds_per_step` in the previous call travels with the metrics, so
        that every worker gets the same totals back."""
        totals = self._train_loop(iterator, tf.constant(num_steps), tf.constant(seconds_per_step))
        totals = [float(x) for x in totals.numpy()]
        return LoopTotals(*totals[:5], seconds_per_step=totals[5] / self.plan.num_replicas)

    def evaluate(self, split: datasets.ImageSplit) -> dict:
        """`eval_loss`, `eval_accuracy` and `eval_examples` over the whole of
        `split`, each example counted once across all workers. With test-time
        augmentation, also `eval_accuracy_without_tta`, so that every run
        shows what it buys."""
        batch = self.plan.global_batch_size
        iterator = iter(self._strategy.distribute_datasets_from_function(
            input_pipeline.eval_input_fn(split, batch)))
        loss_sum, correct, examples, plain_correct = (float(x) for x in self._eval_loop(
            iterator, tf.constant(input_pipeline.eval_steps(len(split), batch))).numpy())
        result = {"eval_loss": loss_sum / examples, "eval_accuracy": correct / examples,
                  "eval_examples": int(round(examples))}
        if self.config.eval_tta != "none":
            result["eval_accuracy_without_tta"] = plain_correct / examples
        return result

    def _per_example_loss(self, loss_fn, labels, probabilities):
        return loss_fn(tf.one_hot(labels, datasets.NUM_CLASSES), probabilities)

    def _compute_gradients(self, images, labels):
        model = self.model
        with tf.GradientTape() as tape:
            probabilities = model(images, training=True)
            losses = self._per_example_loss(self._train_loss, labels, probabilities)
            # Averaged over the global batch, so that the all-reduced sum of
            # replica gradients is the gradient of the global batch.
            loss = tf.nn.compute_average_loss(losses, global_batch_size=self.plan.global_batch_size)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled_loss = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled_loss, model.trainable_variables)
        return gradients, loss, tf.reduce_sum(losses), tf.reduce_sum(_is_correct(labels, probabilities))

    def _train_step(self, *batch):
        if self._device_split is not None:  # batch: indices, crop offsets, flips
            images, labels = input_pipeline.gather_and_augment(*self._device_split, *batch,
                                                     self.config.crop_padding)
        else:
            images, labels = batch
        gradients, loss, loss_sum, correct = self._gradients(images, labels)
        context = tf.distribute.get_replica_context()
        if self.plan.loss_scaling:
            # Keras' LossScaleOptimizer decides to skip a step from each
            # replica's own gradients (it assumes they were summed already),
            # so replicas could disagree: some apply an inf, or workers fall
            # out of step. All replicas agree here instead, and one
            # non-finite gradient makes every replica skip.
            locally_finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in gradients])
            overflowed = context.all_reduce("SUM", 1.0 - tf.cast(locally_finite, tf.float32))
            all_finite = tf.cast(overflowed == 0.0, tf.float32)
            gradients = [*gradients[:-1], gradients[-1] / all_finite]  # x/0: inf or nan
            nonfinite = 1.0 - all_finite
        else:
            # No skipping without loss scaling: a non-finite loss is fatal,
            # and its count needs no extra pass over the gradients.
            nonfinite = 1.0 - tf.cast(tf.math.is_finite(loss), tf.float32)
        gradients = [g * scale if scale != 1 else g
                     for g, scale in zip(gradients, self._gradient_scales)]
        if self._whiten_bias_index is not None:
            # Frozen after its epochs: a zero gradient (and momentum decaying).
            i = self._whiten_bias_index
            gradients[i] *= tf.cast(self.step < self._whiten_bias_steps, gradients[i].dtype)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        count = tf.cast(tf.shape(labels)[0], tf.float32)
        sums = tf.where(tf.math.is_finite(loss), tf.stack([loss_sum, correct, count]), tf.zeros([3]))
        # Summed over replicas: one per global step that was not finite.
        skipped = nonfinite / context.num_replicas_in_sync
        self._train_sums.assign_add(tf.concat([sums, [skipped]], 0))

    def _train_loop_fn(self, iterator, num_steps, seconds_per_step):
        stop = tf.constant(False)
        for _ in tf.range(num_steps):
            # Looked at before every step, so that a stop waits for the step
            # under way only, however slow a step is.
            stop = self._stop_agreed()
            if stop:
                break
            self._strategy.run(self._train_step, args=next(iterator))
            self.step.assign_add(1)
            if self._lookahead:
                self._lookahead.after_step(self.step)
        travelling = tf.stack([tf.cast(stop, tf.float32), seconds_per_step])
        totals = self._strategy.run(_drain, args=(self._train_sums, travelling))
        return self._strategy.reduce("SUM", totals, axis=None)

    def _stop_agreed(self):
        """Whether any worker was asked to stop. Workers are signalled at
        different moments (or only one is), but must leave the loop at the
        same step: the next collective would wait forever for the one that
        left. Within one process a variable read is enough; across workers
        it costs one all-reduce of a scalar per step."""
        if self.plan.num_workers == 1:
            return self._stop_requested.read_value()
        requests = self._strategy.run(lambda: tf.cast(self._stop_requested, tf.float32))
        return self._strategy.reduce("SUM", requests, axis=None) > 0

    def _eval_step(self, images, labels, weights):
        # CIFAR-10's classes are symmetric under a horizontal flip and small
        # shifts, and the model was trained on such views: averaging their
        # logits removes part of the model's variance.
        views = input_pipeline.test_time_views(images, self.config.eval_tta)
        view_logits = [tf.cast(self._logits(view, training=False), tf.float32) for _, view in views]
        logits = tf.add_n([weight * l for (weight, _), l in zip(views, view_logits)])
        probabilities = tf.nn.softmax(logits)
        plain_correct = _is_correct(labels, view_logits[0])
        losses = self._per_example_loss(self._eval_loss, labels, probabilities)
        self._eval_sums.assign_add(tf.stack([tf.reduce_sum(losses * weights),
                                             tf.reduce_sum(_is_correct(labels, probabilities) * weights),
                                             tf.reduce_sum(weights),
                                             tf.reduce_sum(plain_correct * weights)]))

    def _eval_loop_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            self._strategy.run(self._eval_step, args=next(iterator))
        totals = self._strategy.run(_drain, args=(self._eval_sums, tf.zeros([0])))
        return self._strategy.reduce("SUM", totals, axis=None)


def _is_correct(labels, scores):
    """1.0 where the highest-scoring class (probabilities or logits) is the
    label, per example."""
    predictions = tf.argmax(scores, axis=-1, output_type=tf.int32)
    return tf.cast(predictions == labels, tf.float32)


def _gradient_scales(model: keras.Model, shift_lr_multiplier: float) -> list:
    """Per trainable variable, what its gradient is multiplied by:
    `shift_lr_multiplier` for batch-norm shifts, 1 for the rest."""
    shifts = {id(v) for v in batch_norm_shifts(model)}
    return [shift_lr_multiplier if id(v) in shifts else 1.0 for v in model.trainable_variables]


def _drain(accumulator, extra):
    """This replica's sums (with `extra` appended); zeros the accumulator."""
    totals = tf.concat([accumulator.read_value(), extra], 0)
    with tf.control_dependencies([totals]):
        accumulator.assign(tf.zeros_like(accumulator))
    return totals


def train_and_evaluate(config: TrainConfig, strategy: tf.distribute.Strategy,
                       strategy_name: str, cluster: Optional[Cluster]) -> dict:
    """Trains, evaluates and exports as `config` says; returns the summary.

    Writes checkpoints, logs, metrics, `summary.json` and the export into
    `config.model_dir` (chief only; other workers use scratch directories).
    """
    started = time.monotonic()
    is_chief = cluster is None or cluster.is_chief
    train_split, test_split = datasets.load_dataset(
        config.dataset, config.data_dir, config.download, config.synthetic_examples, config.seed)
    plan = plan_run(config, strategy.num_replicas_in_sync,
                    cluster.num_workers if cluster else 1, len(train_split))
    precision.set_precision(plan.policy)
    keras.utils.set_random_seed(config.seed)
    trainer = Trainer(config, plan, strategy, train_split)

    worker = None if is_chief else f"{cluster.task_type}-{cluster.task_index}"
    checkpoints = Checkpoints(config.model_dir, worker, model_identity(trainer.model, plan.policy),
                              **trainer.checkpointables)
    checkpoints.check_identity()  # before anything is written into model_dir
    restored = checkpoints.restore_latest()  # the newest that reads back; None: a fresh run
    start_step = int(trainer.step.numpy())
    previous_config, finished = {}, {}
    if restored:
        previous_config = outputs.read_json(
            os.path.join(config.model_dir, "config.json"),
            {"dataset": str, "seed": int, "resolved": dict},
            remedy="it records the flags of the run that wrote the checkpoints: restore an intact "
                   "copy, or remove it to resume without comparing them")
    if restored and start_step >= plan.total_steps:  # else it is rewritten at the end
        finished = outputs.read_json(
            os.path.join(config.model_dir, "summary.json"), {"steps": int},
            remedy="remove it, and the run evaluates again and writes a new one")
    is_finished = bool(restored and start_step >= plan.total_steps and finished)
    if plan.num_workers > 1:
        trainer.check_workers_agree({
            "start step": start_step, "finished": is_finished,
            "precision": config_lib.PRECISIONS.index(plan.policy),
            "total steps": plan.total_steps, "steps per epoch": plan.steps_per_epoch},
            config_lib.shared_flags(config))
    if is_finished:
        # A finished run started again: its results stay exactly as they are.
        if is_chief:
            print(f"{config.model_dir} holds a finished run of {start_step} steps (see "
                  f"summary.json); nothing to do. To train longer, pass a larger --epochs or "
                  f"--train_steps.", flush=True)
        checkpoints.close()
        return finished
    # Resuming on other data or another seed would mix two runs in one model.
    changed = [f"--{name}={previous_config[name]}" for name in ("dataset", "seed")
               if previous_config and previous_config[name] != getattr(config, name)]
    if changed:
        checkpoints.close()
        raise ConfigError(
            f"--model_dir={config.model_dir} holds a run with {' '.join(changed)}, which this run "
            f"changes: pass {' '.join(changed)} to resume it, or choose another --model_dir")
    reporter = Reporter(config.model_dir, is_chief, plan.total_steps, start_step, started)
    if is_chief:  # written first, so that even a run that crashes says what it was
        outputs.write_json(f"{config.model_dir}/config.json", {
            **dataclasses.asdict(config),
            # What `auto` and the per-model defaults became on this machine.
            "resolved": {"precision": plan.policy, "strategy": strategy_name,
                         "num_workers": plan.num_workers, "num_replicas": plan.num_replicas,
                         "global_batch_size": plan.global_batch_size,
                         "peak_learning_rate": plan.learning_rate, "total_steps": plan.total_steps,
                         "warmup_steps": plan.warmup_steps}})
    scaled = optimization.scaled_learning_rate(config.learning_rate, plan.global_batch_size)
    rate_rule = (f"{config.learning_rate:g} x {plan.global_batch_size}/"
                 f"{optimization.REFERENCE_BATCH_SIZE}")
    if plan.learning_rate < scaled:
        rate_rule += f" = {scaled:g}, capped at --max_learning_rate={config.max_learning_rate:g}"
    reporter.say(f"{config.model} on {config.dataset}: "
                 f"{precision.describe_precision_choice(config.precision)}; {strategy_name} "
                 f"strategy, {plan.num_workers} worker(s), {plan.num_replicas} replica(s); global "
                 f"batch {plan.global_batch_size} = {config.per_replica_batch_size} per replica x "
                 f"{plan.num_replicas}; peak learning rate {plan.learning_rate:g} = {rate_rule}, "
                 f"{config.lr_schedule} schedule with {plan.warmup_steps} warmup steps; "
                 f"{plan.total_steps} steps ({plan.steps_per_epoch} per epoch)")
    if restored:
        reporter.say(restored.describe())
        previous = previous_config.get("resolved", {})
        planned = previous.get("total_steps")
        if planned and planned != plan.total_steps:
            reporter.say(f"the run was planned for {planned} steps and now has {plan.total_steps}: "
                         f"the learning-rate schedule is re-planned over the new length")
        previous_batch = int(trainer.trained_global_batch.numpy())
        if previous_batch != plan.global_batch_size:
            previous_rate = previous.get("peak_learning_rate")
            rate = f" (was {previous_rate:g})" if isinstance(previous_rate, (int, float)) else ""
            reporter.say(f"the checkpoint was trained at global batch {previous_batch}; continuing "
                         f"at global batch {plan.global_batch_size}: the peak learning rate is "
                         f"rescaled to {plan.learning_rate:g}{rate} and the schedule re-planned "
                         f"over {plan.total_steps} steps of {plan.steps_per_epoch} per epoch")
            trainer.trained_global_batch.assign(plan.global_batch_size)

    stopping.enter(stopping.Phase.TRAINING, on_request=trainer.request_stop)
    try:
        loop = _TrainingLoop(trainer, checkpoints, reporter)
        train_metrics, throughput = loop.run(train_split, test_split, start_step)
        # A stop requested from here on lets the run finish: what is left
        # (evaluation, export) is what makes it complete.
        stopping.enter(stopping.Phase.FINISHING)
        summary = _summary(trainer, strategy_name, start_step, train_metrics, throughput)
        _evaluate_and_export(trainer, test_split, reporter, summary, export=is_chief)
        summary["wall_seconds"] = time.monotonic() - started  # the export included
        if is_chief:
            outputs.write_json(f"{config.model_dir}/summary.json", summary)
    finally:
        checkpoints.close()  # a non-chief's scratch directory goes, even on a stop
        reporter.close()
    return summary


def _summary(trainer: Trainer, strategy_name: str, start_step: int, train_metrics: dict,
             throughput: Optional[float]) -> dict:
    """What summary.json says of a run, before its evaluation."""
    config, plan = trainer.config, trainer.plan
    steps = int(trainer.step.numpy())
    summary = {
        "strategy": strategy_name, "num_workers": plan.num_workers,
        "num_replicas": plan.num_replicas, "per_replica_batch_size": config.per_replica_batch_size,
        "global_batch_size": plan.global_batch_size, "precision": plan.policy,
        "model": config.model, "dataset": config.dataset, "steps": steps,
        "epochs": steps / plan.steps_per_epoch, "learning_rate": plan.learning_rate,
        "reference_batch_size": optimization.REFERENCE_BATCH_SIZE,
        "train_loss": train_metrics.get("loss"), "train_accuracy": train_metrics.get("accuracy"),
        "examples_per_second": throughput, "resumed_from_step": start_step,
        "eval_loss": None, "eval_accuracy": None, "eval_examples": 0, "eval_tta": config.eval_tta,
        "device": distribution.describe_devices(),
        "tensorflow_version": tf.__version__, "keras_version": keras.__version__,
    }
    return summary


def _evaluate_and_export(trainer: Trainer, test_split, reporter: Reporter, summary: dict,
                         export: bool) -> None:
    """Evaluates the trained model into `summary`, and exports it if
    `export` (the chief) and the config say so."""
    config, steps = trainer.config, summary["steps"]
    if config.evaluate:
        reporter.say(f"evaluating on the {len(test_split)} test images")
        result = trainer.evaluate(test_split)
        summary.update(result)
        # Logged like the evaluations during training, so that the accuracy
        # curve ends where the run ends.
        reporter.log(steps, {"epoch": summary["epochs"], **result})
    if export and config.export:
        # The export says what it learned, so that its users can tell a
        # smoke test's model from a real one (distributed-mpt-predict does).
        info = outputs.model_info(dataclasses.asdict(config), summary)
        reporter.say(f"exported to {outputs.export_model(trainer.model, config.model_dir, info)}")


# A loop call's target length: a progress line waits for the call under way
# (a stop request only for the step under way), so calls are kept this short (up to --steps_per_loop
# steps each), whatever the model or device.
_CALL_SECONDS = 1.0


class _TrainingLoop:
    """Trains from a step to the last one: logging, evaluating every
    `eval_every_epochs`, checkpointing, and watching for divergence and
    stop requests."""

    def __init__(self, trainer: Trainer, checkpoints: Checkpoints, reporter: Reporter):
        self._trainer, self._checkpoints, self._reporter = trainer, checkpoints, reporter

    def run(self, train_split, test_split, start_step: int):
        """Returns the last interval's metrics and the throughput in examples
        per second (the first call excluded, as it includes tracing, unless
        it was the only one)."""
        trainer, config, plan = self._trainer, self._trainer.config, self._trainer.plan
        if start_step >= plan.total_steps:
            # Trained before, but stopped before its summary was written
            # (SIGKILL during the export): the log has the training figures.
            last = self._reporter.last_logged("loss")
            return last, last.get("examples_per_second")
        iterator = iter(trainer.train_dataset(train_split, start_step))
        self._nonfinite_run, self._last_saved = 0, start_step
        interval, interval_start = NO_TOTALS, time.perf_counter()
        timed_examples, timed_seconds, metrics, lines = 0, 0.0, {}, 0
        # The wall clock of the last line, evaluations and checkpoints
        # included: the promise of a line every PROGRESS_SECONDS is kept in it.
        last_line = time.perf_counter()
        # This worker's pace in the last call, sent with the next one; and
        # every worker's mean, which comes back the same to all of them.
        seconds_per_step = agreed_seconds_per_step = 0.0
        current = start_step
        # Evaluation at the end is train_and_evaluate's; this is for the curve.
        eval_every_steps = config.eval_every_epochs * plan.steps_per_epoch or plan.total_steps
        boundaries = (config.log_every_steps, config.checkpoint_every_steps, eval_every_steps,
                      plan.steps_per_epoch)
        first_call = None
        while current < plan.total_steps:
            num_steps = min(plan.total_steps, current + _steps_per_call(agreed_seconds_per_step,
                                                                        config.steps_per_loop),
                            *(_next_multiple(current, b) for b in boundaries)) - current
            call_started = time.perf_counter()
            totals = trainer.train(iterator, num_steps, seconds_per_step)
            if totals.stop_requests > 0:  # agreed by every worker, at a step boundary
                self._stop(totals, int(trainer.step.numpy()), current)
            call_seconds = time.perf_counter() - call_started
            seconds_per_step = call_seconds / num_steps
            agreed_seconds_per_step = totals.seconds_per_step
            if first_call is None:
                first_call = (num_steps * plan.global_batch_size, call_seconds)
            else:
                timed_examples += num_steps * plan.global_batch_size
                timed_seconds += call_seconds
            current += num_steps
            interval += totals
            self._check_finite(totals, num_steps, current)

            interval_seconds = time.perf_counter() - interval_start
            # A line now if the next call, about as long as this one, would
            # end past the promised interval.
            due = time.perf_counter() - last_line + call_seconds >= config_lib.PROGRESS_SECONDS
            if (current % config.log_every_steps == 0 or current % plan.steps_per_epoch == 0 or
                    current == plan.total_steps or due or not lines):
                # The first line comes after the first call, so that a slow
                # start (tracing) shows; it has no ETA, as tracing is in it.
                metrics = self._log(current, interval, interval_seconds, with_eta=lines > 0)
                lines += 1
                interval, interval_start = NO_TOTALS, time.perf_counter()
                last_line = interval_start
            else:
                self._reporter.live(current)

            if current % eval_every_steps == 0 and current < plan.total_steps:
                eval_started = time.perf_counter()
                self._reporter.say(f"evaluating on the {len(test_split)} test images")
                self._reporter.log(current, {"epoch": current / plan.steps_per_epoch,
                                             **trainer.evaluate(test_split)})
                interval_start += time.perf_counter() - eval_started  # not training time

            if current % config.checkpoint_every_steps == 0 or current == plan.total_steps:
                save_started = time.perf_counter()
                self._checkpoints.save(current)
                self._last_saved = current
                interval_start += time.perf_counter() - save_started  # not training time
        if not timed_seconds:
            timed_examples, timed_seconds = first_call
        return metrics, timed_examples / timed_seconds

    def _stop(self, totals: LoopTotals, reached: int, call_start: int) -> None:
        """Saves the step `reached` (a stop cut the call that began at
        `call_start` short) and raises Preempted. The steps since the last
        progress line go unlogged; the resumed run logs from `reached` on."""
        self._check_finite(totals, reached - call_start, reached)  # never a NaN checkpoint
        self._checkpoints.save(reached)
        self._reporter.say(f"stopped by a signal at step {reached}; checkpoint saved: "
                           f"run the same command again to resume")
        raise Preempted(f"stopped at step {reached} after a checkpoint")

    def _check_finite(self, totals: LoopTotals, num_steps: int, current: int) -> None:
        """Raises DivergedError on a non-finite loss (without loss scaling) or
        too many skipped steps in a row (with it)."""
        plan = self._trainer.plan
        self._nonfinite_run = (self._nonfinite_run + num_steps
                               if round(totals.nonfinite_steps) == num_steps else 0)
        if (totals.nonfinite_steps > 0 and not plan.loss_scaling) or \
                self._nonfinite_run >= _NONFINITE_STEPS_WITH_LOSS_SCALING:
            kept = (f"kept the last good checkpoint (step {self._last_saved}) untouched"
                    if self._last_saved else "no checkpoint had been written yet")
            remedy = (f"lower the peak learning rate {plan.learning_rate:g} (--learning_rate is "
                      f"scaled by the global batch/{optimization.REFERENCE_BATCH_SIZE}; or set "
                      f"--max_learning_rate)" +
                      (" or use --precision=float32" if plan.policy != "float32" else ""))
            raise DivergedError(f"the loss became NaN or infinite by step {current}; {kept}: {remedy}")

    def _log(self, step: int, interval: LoopTotals, seconds: float, with_eta: bool) -> dict:
        """Reports the interval's metrics; returns them."""
        plan, optimizer = self._trainer.plan, self._trainer.optimizer
        examples = interval.examples
        metrics = {"epoch": step / plan.steps_per_epoch,
                   "loss": interval.loss_sum / examples if examples else math.nan,
                   "accuracy": interval.correct / examples if examples else math.nan,
                   "learning_rate": float(optimizer.learning_rate),
                   "examples_per_second": examples / seconds if seconds else 0.0,
                   "skipped_steps": round(interval.nonfinite_steps)}
        if plan.loss_scaling:  # float32 and bfloat16 have no scale to show
            metrics["loss_scale"] = precision.loss_scale(optimizer)
        eta = None
        if with_eta and examples and seconds:
            eta = (plan.total_steps - step) * plan.global_batch_size / metrics["examples_per_second"]
        self._reporter.log(step, metrics, eta_seconds=eta)
        return metrics


def _steps_per_call(seconds_per_step: float, steps_per_loop: int) -> int:
    """Steps for a call of about _CALL_SECONDS at `seconds_per_step` (the
    same on every worker, so that they all call the loop alike); one while
    the pace is not known yet."""
    if seconds_per_step <= 0:
        return 1
    return max(1, min(steps_per_loop, int(_CALL_SECONDS / seconds_per_step)))


def _next_multiple(value: int, multiple: int) -> int:
    return (value // multiple + 1) * multiple
