"""The compiled training step, read from `Trainer.train` down: a
`tf.function` loop of `strategy.run(_train_step)`, one code path for every
`tf.distribute` strategy, then the optimizer's update (optim/optimizer.py,
optim/rules.py). Keras 3's `Model.fit` fails under
MultiWorkerMirroredStrategy, hence this loop; it runs several optimizer
steps per call. Evaluation is eval_views.py's; the loop that paces the
calls, and the run around it, are training/'s.
"""

import dataclasses
from typing import Optional, Sequence, Tuple

import keras
import tensorflow as tf

from distributed_mpt.core import pipeline
from distributed_mpt.core.augmentation import Augmentation
from distributed_mpt.core.data import ImageSplit
from distributed_mpt.core.eval_views import EvalViews, Evaluator, drain, is_correct, sum_accumulator
from distributed_mpt.core.optim.lookahead import Lookahead


@dataclasses.dataclass(frozen=True)
class LoopTotals:
    """What one call of the training loop all-reduces, in the order of the
    vector it travels in: the first PER_STEP fields are summed at every step
    (`Trainer._train_sums`); the last three are added once per call."""

    loss_sum: float
    correct: float
    examples: float
    nonfinite_steps: float   # fractional when only some replicas saw one
    stop_requests: float     # > 0: the call stopped early, on every worker alike
    model_dir_lost: float    # > 0: the stop was the chief's, which lost its --model_dir
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
                          other.stop_requests, other.model_dir_lost, other.seconds_per_step)


NO_TOTALS = LoopTotals(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class StepRules:
    """What a training step does around the model's forward and backward pass.

    global_batch_size: the loss is averaged over it, so that the all-reduced
    sum of replica gradients is the global batch's gradient (evaluation
    batches are as large); num_workers: workers that must stop at the same
    step; label_smoothing: of the training loss's one-hot targets;
    loss_scaling: replicas agree on skipping a non-finite step; xla:
    compile the forward and backward pass; jitter_split: for color jitter
    (the batches then end with it), the model's normalization layer and the
    rest of the model (models.split_at_normalization); frozen: pairs (steps,
    variables) of trainable variables that train for the first `steps` steps
    only (a parameter group's `train_steps`): from that step on the loop
    does not compute their gradient and passes zeros, which their group
    ignores or lets its momentum run out on, as it would any gradient by then.
    """

    global_batch_size: int
    num_workers: int = 1
    label_smoothing: float = 0.0
    loss_scaling: bool = False
    lookahead: Optional[Lookahead] = None
    xla: bool = False
    jitter_split: Optional[tuple] = None
    frozen: Sequence[Tuple[int, Sequence[tf.Variable]]] = ()


@dataclasses.dataclass(frozen=True)
class SplitOnDevice:
    """The training split kept on the device: batches are then indices,
    offsets and flips, gathered and cropped as `augmentation` says."""

    split: ImageSplit
    augmentation: Augmentation


class Trainer:
    """The compiled training loop of `model` (logits out) and `optimizer`
    under `strategy`, as `rules` say. Create the model, the optimizer (built) and
    `step` (an int64 variable: the one step counter of the run, which the
    optimizer's schedule and the lookahead read) in the strategy's scope
    first. `on_device`: train from the split in device memory;
    `eval_views`: evaluate with test-time augmentation (`evaluate`); `users_model`: a
    user's network's --model (Evaluator's)."""

    def __init__(self, model: keras.Model, optimizer, strategy: tf.distribute.Strategy,
                 step: tf.Variable, rules: StepRules, *,
                 on_device: Optional[SplitOnDevice] = None,
                 eval_views: EvalViews = EvalViews(), users_model: Optional[str] = None):
        self.model, self.optimizer, self.step = model, optimizer, step
        self.strategy, self._rules, self._on_device = strategy, rules, on_device
        index = {id(v): i for i, v in enumerate(model.trainable_variables)}
        # (step, indices into model.trainable_variables), by step.
        self._freezes = sorted((steps, tuple(index[id(v)] for v in variables))
                               for steps, variables in rules.frozen)
        with strategy.scope():
            self._train_sums = sum_accumulator(LoopTotals.PER_STEP)
            # A copy per device, made once; the input pipeline then carries
            # only indices and augmentation parameters.
            self._device_split = None if on_device is None else (
                tf.Variable(on_device.split.images, trainable=False),
                tf.Variable(on_device.split.labels, trainable=False))
        self._train_loss = keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=rules.label_smoothing, reduction=None)
        # Only the forward and backward pass under XLA: the gradient all-reduce
        # and the update stay outside it, where every strategy supports them.
        self._gradients = (tf.function(self._compute_gradients, jit_compile=True) if rules.xla
                           else self._compute_gradients)
        # Set from the stop-signal thread while a loop call runs (see
        # request_stop); outside the strategy's scope: one value per process.
        self._stop_requested = tf.Variable(False, trainable=False, name="stop_requested")
        self._model_dir_lost = tf.Variable(False, trainable=False, name="model_dir_lost")
        # Autograph rewrites each Python function a traced loop calls, in every
        # process, at 0.1-0.5 s of CPU each: about 1.5 CPU-s of a run's start on
        # 2 cores of an AMD EPYC (Zen 3, AVX2 only).
        # Only the loops (`for` over `tf.range`, `break` on a tensor) and the
        # lookahead's `if step % 5` need it; the steps they call branch on
        # Python values only and are marked `do_not_convert`.
        self._train_loop = tf.function(self._train_loop_fn)
        self._evaluator = Evaluator(model, strategy, rules.global_batch_size, eval_views,
                                    users_model)

    @property
    def images_on_device(self) -> bool:
        """Whether the training input is indices into the device's copy."""
        return self._device_split is not None

    def request_stop(self, model_dir_lost: bool = False) -> None:
        """Makes the loop call under way, or the next, stop at the next step
        boundary (every worker at the same one). Safe from any thread.
        `model_dir_lost`: the chief's reason, which every worker learns with
        the stop (`LoopTotals.model_dir_lost`)."""
        if model_dir_lost:
            self._model_dir_lost.assign(True)
        self._stop_requested.assign(True)

    def evaluate(self, split: ImageSplit) -> dict:
        """`split` scored as `eval_views.Evaluator.evaluate` says."""
        return self._evaluator.evaluate(split)

    def train(self, iterator, num_steps: int, seconds_per_step: float = 0.0,
              crop_size: Optional[int] = None) -> LoopTotals:
        """Runs `num_steps` optimizer steps, fewer if a stop was requested
        (`stop_requests` > 0; `step` says where it stopped). This worker's
        `seconds_per_step` in the previous call travels with the metrics, so
        that every worker gets the same totals back. A call that crosses a
        step where variables freeze is two loop calls, one on each side.
        `crop_size`: the side of the iterator's crops (None: whole images),
        which a split on the device is cut to."""
        totals, step = NO_TOTALS, int(self.step.numpy())
        for steps, frozen in self._segments(step, step + num_steps):
            vector = self._train_loop(iterator, tf.constant(steps), tf.constant(seconds_per_step),
                                      frozen=frozen, crop_size=crop_size)
            totals += LoopTotals.all_reduced(vector.numpy(), self.strategy.num_replicas_in_sync)
            if totals.stop_requests:
                break
        return totals

    def _segments(self, start: int, end: int):
        """The steps start .. end - 1 as runs of (count, frozen indices):
        a new run at each step where variables freeze."""
        bounds = sorted({start, end, *(s for s, _ in self._freezes if start < s < end)})
        bounds = bounds if len(bounds) > 1 else [start, start]  # a call of 0 steps
        for first, last in zip(bounds, bounds[1:]):
            frozen = tuple(sorted(i for s, indices in self._freezes if s <= first for i in indices))
            yield last - first, frozen

    def _train_loop_fn(self, iterator, num_steps, seconds_per_step, frozen=(), crop_size=None):
        stop = tf.zeros([2])
        for _ in tf.range(num_steps):
            # Looked at before every step, so that a stop waits for the step
            # under way only, however slow a step is.
            stop = self._stop_agreed()
            if stop[0] > 0:
                break
            self.strategy.run(self._train_step, args=next(iterator),
                              kwargs={"frozen": frozen, "crop_size": crop_size})
            # Every step counts, applied or skipped: the one counter that the
            # schedule, the lookahead and the groups' training steps read.
            self.step.assign_add(1)
            if self._rules.lookahead:
                self._rules.lookahead.after_step(self.step)
        stop_and_pace = tf.concat([stop, [seconds_per_step]], 0)
        totals = self.strategy.run(drain, args=(self._train_sums, stop_and_pace))
        return self.strategy.reduce("SUM", totals, axis=None)

    @tf.autograph.experimental.do_not_convert
    def _stop_agreed(self):
        """(workers asked to stop, of them the chief that lost --model_dir).
        Workers are signalled at different moments (or only one is), but must
        leave the loop at the same step, knowing why: the next collective
        would wait for the one that left, or fail on a lost peer. Within one
        process a variable read is enough; across workers it costs one
        all-reduce of two numbers per step."""
        def requests():
            return tf.cast(tf.stack([self._stop_requested, self._model_dir_lost]), tf.float32)

        if self._rules.num_workers == 1:
            return requests()
        return self.strategy.reduce("SUM", self.strategy.run(requests), axis=None)

    @tf.autograph.experimental.do_not_convert
    def _train_step(self, *batch, frozen=(), crop_size=None):
        if self._device_split is not None:  # batch: indices, crop offsets, flips[, jitter]
            images, labels = pipeline.gather_and_augment(*self._device_split, *batch[:3],
                                                         self._on_device.augmentation.crop_padding,
                                                         crop_size)
            jitter = batch[3:]
        else:  # images, labels[, jitter]
            images, labels, *jitter = batch
        gradients, loss, loss_sum, correct = self._gradients(images, labels, *jitter,
                                                             frozen=frozen)
        context = tf.distribute.get_replica_context()
        if self._rules.loss_scaling:
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
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        count = tf.cast(tf.shape(labels)[0], tf.float32)
        sums = tf.where(tf.math.is_finite(loss), tf.stack([loss_sum, correct, count]), tf.zeros(3))
        # Summed over replicas: one per global step that was not finite.
        skipped = nonfinite / context.num_replicas_in_sync
        self._train_sums.assign_add(tf.concat([sums, [skipped]], 0))

    def _compute_gradients(self, images, labels, jitter=None, frozen=()):
        model = self.model
        variables = model.trainable_variables
        sources = [v for i, v in enumerate(variables) if i not in frozen]
        # Frozen variables are not watched, so that the backward pass that
        # only they need is never built (airbench's whitening bias: the first
        # convolution's input gradient and the whitening activation's). They
        # get zeros instead.
        with tf.GradientTape(watch_accessed_variables=not frozen) as tape:
            if frozen:
                tape.watch([v.value for v in sources])  # Keras' variables hold TensorFlow's
            if jitter is None:
                logits = model(images, training=True)
            else:  # the same variables, the jitter between normalization and the rest
                normalize, rest = self._rules.jitter_split
                logits = rest(pipeline.jitter_colors(normalize(images), jitter), training=True)
            logits = tf.cast(logits, tf.float32)
            losses = self._train_loss(tf.one_hot(labels, logits.shape[-1]), logits)
            # Averaged over the global batch, so that the all-reduced sum of
            # replica gradients is the gradient of the global batch.
            loss = tf.nn.compute_average_loss(losses, global_batch_size=self._rules.global_batch_size)
            if model.losses:  # a user's model may carry regularizers of its own
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled_loss = self.optimizer.scale_loss(loss)
        computed = iter(tape.gradient(scaled_loss, sources))
        gradients = [tf.zeros_like(v) if i in frozen else next(computed)
                     for i, v in enumerate(variables)]
        return gradients, loss, tf.reduce_sum(losses), tf.reduce_sum(is_correct(labels, logits))
