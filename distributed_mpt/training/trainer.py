"""The compiled steps of a run: its model, its optimizer, and the
`tf.function` loops that train and evaluate them, one code path for every
`tf.distribute` strategy.

Keras 3's `Model.fit` fails under MultiWorkerMirroredStrategy, so training is
a loop of `strategy.run(train_step)` inside a `tf.function` that runs several
optimizer steps per call; it serves the default strategy, OneDeviceStrategy,
MirroredStrategy and MultiWorkerMirroredStrategy alike. The loop that paces
the calls is loop.py; the run around it, run.py.
"""

import dataclasses
import hashlib

import keras
import tensorflow as tf

from distributed_mpt import config as config_lib
from distributed_mpt.training import datasets, input_pipeline, optimization
from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import ClusterError
from distributed_mpt.training.models import (build_model, convolution_filters, fast_biases,
                                   initialize_from_data, whitening_bias)
from distributed_mpt.training.plan import RunPlan


def _sum_accumulator(size: int) -> tf.Variable:
    """Per-replica running sums, read and reset once per loop call."""
    return tf.Variable(tf.zeros([size]), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)


@dataclasses.dataclass(frozen=True)
class LoopTotals:
    """What one call of the training loop all-reduces, in the order of the
    vector it travels in: the first PER_STEP fields are summed at every step
    (`Trainer._train_sums`); the last two are added once per call."""

    loss_sum: float
    correct: float
    examples: float
    nonfinite_steps: float   # fractional when only some replicas saw one
    stop_requests: float     # > 0: the call stopped early, on every worker alike
    seconds_per_step: float  # the previous call's, averaged over the replicas

    PER_STEP = 4

    @classmethod
    def all_reduced(cls, vector, num_replicas: int) -> "LoopTotals":
        """The totals from the all-reduced vector of a call: the pace was
        summed over the replicas, and becomes their mean."""
        values = [float(x) for x in vector]
        return cls(*values[:-1], seconds_per_step=values[-1] / num_replicas)

    def __add__(self, other: "LoopTotals") -> "LoopTotals":
        """The sums of both; the stop and the pace are `other`'s, the newer
        call's."""
        return LoopTotals(self.loss_sum + other.loss_sum, self.correct + other.correct,
                          self.examples + other.examples,
                          self.nonfinite_steps + other.nonfinite_steps,
                          other.stop_requests, other.seconds_per_step)


NO_TOTALS = LoopTotals(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


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
            muon = config.optimizer == "muon"
            self.model = build_model(config.model, config.model_width, config.weight_decay,
                                     config.shift_lr_multiplier, muon=muon,
                                     identity_init=config.identity_init)
            initialize_from_data(self.model, train_split.images)
            # The logits, for test-time augmentation to average.
            self._logits = keras.Model(self.model.inputs, self.model.get_layer("logits").output)
            self._lookahead = (optimization.Lookahead(self.model, plan.total_steps)
                               if config.lookahead else None)
            self.optimizer = optimization.make_optimizer(
                schedule, config.momentum, loss_scaling=plan.loss_scaling,
                muon_variables=convolution_filters(self.model) if muon else (),
                muon_rate_ratio=config.muon_learning_rate / plan.learning_rate,
                muon_momentum=config.muon_momentum)
            # Built here, not lazily in the first step: MirroredStrategy
            # cannot create slot variables inside the traced step.
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.trained_global_batch = tf.Variable(plan.global_batch_size, dtype=tf.int64,
                                                    trainable=False)
            self._train_sums = _sum_accumulator(LoopTotals.PER_STEP)
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
        fast = {id(v) for v in fast_biases(self.model, muon)}
        self._gradient_scales = [config.shift_lr_multiplier if id(v) in fast else 1.0
                                 for v in self.model.trainable_variables]
        bias = whitening_bias(self.model)
        self._whiten_bias_index = next((i for i, v in enumerate(self.model.trainable_variables)
                                        if v is bias), None)
        self._whiten_bias_steps = round(config.whiten_bias_epochs * plan.steps_per_epoch)
        # airbench94_muon's whitening bias: its own rate, falling linearly
        # from the peak to 0 over its steps, whatever --lr_schedule does.
        self._whiten_bias_rate = (optimization.learning_rate_schedule(
            plan.learning_rate, self._whiten_bias_steps, 0, "linear") if muon else None)
        self._schedule = schedule
        # Set from the stop-signal thread while a loop call runs (see
        # request_stop); outside the strategy's scope: one value per process.
        self._stop_requested = tf.Variable(False, trainable=False, name="stop_requested")
        # Autograph rewrites each Python function a traced loop calls, in every
        # process, at 0.1-0.5 s of CPU each: about 1.5 CPU-s of a run's start on
        # 2 cores of an AMD EPYC (Zen 3, AVX2 only).
        # Only the loops (`for` over `tf.range`, `break` on a tensor) and the
        # lookahead's `if step % 5` need it; the steps they call branch on
        # Python values only and are marked `do_not_convert`.
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
        return LoopTotals.all_reduced(totals.numpy(), self.plan.num_replicas)

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

    @tf.autograph.experimental.do_not_convert
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
            factor = tf.cast(self.step < self._whiten_bias_steps, tf.float32)
            if self._whiten_bias_rate is not None:  # its rate over the schedule's
                factor *= tf.math.divide_no_nan(self._whiten_bias_rate(self.step),
                                                self._schedule(self.step))
            gradients[i] *= tf.cast(factor, gradients[i].dtype)
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

    @tf.autograph.experimental.do_not_convert
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

    @tf.autograph.experimental.do_not_convert
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


@tf.autograph.experimental.do_not_convert
def _drain(accumulator, extra):
    """This replica's sums (with `extra` appended); zeros the accumulator."""
    totals = tf.concat([accumulator.read_value(), extra], 0)
    with tf.control_dependencies([totals]):
        accumulator.assign(tf.zeros_like(accumulator))
    return totals
