"""Evaluation with test-time augmentation: the views of a test image that are
classified together, and how their answers combine. Training's `Evaluator`
averages the views' logits in a compiled loop, one code path for every
strategy (its per-replica sums and correct counts are steps.py's too); a
model that gives only probabilities (an export) is classified alike by
`class_probabilities`."""

import dataclasses
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from distributed_mpt.core import pipeline
from distributed_mpt.core.data import ImageSplit
from distributed_mpt.core.models.contract import CHANGED, users_code


@dataclasses.dataclass(frozen=True)
class EvalViews:
    """Test-time augmentation: evaluation's views (one of
    augmentation.TTA_VIEWS) and the fraction of the test images, the least
    confident, that get them (see `Evaluator.evaluate`)."""

    views: str = "none"
    fraction: float = 1.0


def views_of(images: tf.Tensor, views: str) -> list:
    """The views of a batch of test `images` (uint8 [B, H, W, C]) that
    test-time augmentation averages, as (weight, images) pairs whose weights
    sum to 1; `views` is one of augmentation.TTA_VIEWS, as --eval_tta's
    help says (the shifts reflect-padded)."""
    if views == "none":
        return [(1.0, images)]
    if views == "flip_translate_mean":
        return [(1 / 6, view) for _, view in views_of(images, "flip_translate")]
    pairs = [(1.0, images)]  # (weight of the view and its mirror image, the view)
    if views == "flip_translate":
        height, width = images.shape[1:3]
        padded = tf.pad(images, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
        pairs = [(0.5, images), (0.25, padded[:, :height, :width]), (0.25, padded[:, 2:, 2:])]
    return [(weight / 2, view) for weight, image in pairs
            for view in (image, tf.reverse(image, axis=[2]))]


def least_confident(confidence: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the int(N x `fraction`) images of lowest `confidence` (top
    softmax probability of the plain view; ties by index): those that
    selective test-time augmentation (the 2025 record's) augments."""
    return np.argsort(confidence, kind="stable")[:int(len(confidence) * fraction)]


# Evaluation keeps nothing for a backward pass, so a batch as large as
# training's buys little and costs memory: evaluating airbench (bfloat16) at
# batch 1536 added 120 MB to what training left, at 512 53 MB (Xeon AMX,
# 12-step cpu_cnn94_muon runs).
EVAL_BATCH_PER_REPLICA = 512


# What running out of memory raises: TensorFlow's allocator, Python's.
OUT_OF_MEMORY = (tf.errors.ResourceExhaustedError, MemoryError)
# What a user's model's inference call raises (in an evaluation, in predict) that says
# nothing of the model: a lost peer's errors, the device's or runtime's, the memory's.
NOT_THE_MODELS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                  tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                  tf.errors.InternalError, tf.errors.UnknownError, tf.errors.DataLossError,
                  *OUT_OF_MEMORY)


class Evaluator:
    """Scores `model` (logits out) under `strategy` in batches of
    `global_batch_size` (at most EVAL_BATCH_PER_REPLICA a replica), with the
    test-time `views`; create the model in the strategy's scope first.
    `users_model`: the --model of a user's network, blamed for what its code raises."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy,
                 global_batch_size: int, views: EvalViews = EvalViews(),
                 users_model: Optional[str] = None):
        self.model, self.strategy, self._views = model, strategy, views
        self._users_model = users_model
        self._batch = min(global_batch_size,
                          EVAL_BATCH_PER_REPLICA * strategy.num_replicas_in_sync)
        with strategy.scope():
            # loss sum, correct, examples, correct without test-time augmentation
            self._sums = sum_accumulator(4)
        self._loss = keras.losses.CategoricalCrossentropy(from_logits=True, reduction=None)
        self._loop = tf.function(self._loop_fn)
        self._predict_step = tf.function(self._predict_step_fn)

    def evaluate(self, split: ImageSplit) -> dict:
        """`eval_loss`, `eval_accuracy` and `eval_examples` over the whole of
        `split`, each example counted once across all workers. With test-time
        augmentation, also `eval_accuracy_without_tta`, so that every run
        shows what it buys. With `views.fraction` below 1, only the
        int(N x fraction) images whose plain view is least confident (lowest
        top softmax probability; ties by index) are augmented, as the 2025
        record does; the others are scored by their plain view.
        A user's model that fails in it is one ModelError naming it: its inference call is
        first traced and run here, at the evaluation's batch (an assertion or Python code of
        its training=False branch was a traceback, exit 1). Its checkpoints stay: a run
        again with --noevaluate goes on."""
        if self._users_model is None:
            return self._evaluate(split)
        with users_code(self._users_model, "failed in an evaluation on the test images; its "
                        f"checkpoints are kept: run again with --noevaluate to go on ({CHANGED})",
                        NOT_THE_MODELS):
            return self._evaluate(split)

    def _evaluate(self, split: ImageSplit) -> dict:
        if self._views.views != "none" and self._views.fraction < 1:
            return self._evaluate_selectively(split, self._views.fraction)
        loss_sum, correct, examples, plain_correct = self._sums_over(split)
        result = {"eval_loss": loss_sum / examples, "eval_accuracy": correct / examples,
                  "eval_examples": int(round(examples))}
        if self._views.views != "none":
            result["eval_accuracy_without_tta"] = plain_correct / examples
        return result

    def _sums_over(self, split: ImageSplit) -> tuple:
        """The loss sum, correct count (with test-time augmentation), example
        count and correct count of the plain view, over all of `split`."""
        iterator = iter(self.strategy.distribute_datasets_from_function(
            pipeline.eval_input_fn(split, self._batch)))
        return tuple(float(x) for x in self._loop(
            iterator, tf.constant(pipeline.eval_steps(len(split), self._batch))).numpy())

    def _evaluate_selectively(self, split: ImageSplit, fraction: float) -> dict:
        """`evaluate` in two passes: the plain view of every image (its
        per-image results gathered from all replicas, so that every worker
        chooses alike), then every view of the chosen ones."""
        plain = self._plain_predictions(split)
        chosen = least_confident(plain["confidence"], fraction)
        others = np.ones(len(split), bool)
        others[chosen] = False
        loss_sum, correct = 0.0, 0.0
        if len(chosen):
            loss_sum, correct, _, _ = self._sums_over(
                ImageSplit(split.images[chosen], split.labels[chosen]))
        count = len(split)
        return {"eval_loss": (loss_sum + float(plain["loss"][others].sum())) / count,
                "eval_accuracy": (correct + float(plain["correct"][others].sum())) / count,
                "eval_examples": count,
                "eval_accuracy_without_tta": float(plain["correct"].sum()) / count}

    def _plain_predictions(self, split: ImageSplit) -> dict:
        """Per image of `split`, in its order, the plain view's `confidence`
        (top softmax probability), `correct` (1 or 0) and `loss`, as NumPy
        arrays; each image computed once across all workers."""
        dataset = self.strategy.distribute_datasets_from_function(
            pipeline.eval_input_fn(split, self._batch, with_indices=True))
        results = {name: np.zeros(len(split), np.float32)
                   for name in ("confidence", "correct", "loss")}
        seen = np.zeros(len(split), bool)
        for batch in dataset:
            index, weight, *values = (x.numpy() for x in self._predict_step(*batch))
            real = weight > 0  # padding repeats the last image, at weight 0
            for name, value in zip(results, values):
                results[name][index[real]] = value[real]
            seen[index[real]] = True
        if not seen.all():  # a broken promise of eval_input_fn, not bad input
            raise RuntimeError(f"the plain predictions missed {int((~seen).sum())} images")
        return results

    @tf.autograph.experimental.do_not_convert
    def _predict_step_fn(self, images, labels, weights, indices):
        """The plain view's per-image results of one global batch, gathered
        from every replica: indices, weights, confidence, correct, loss."""
        def per_replica(images, labels, weights, indices):
            logits = tf.cast(self.model(images, training=False), tf.float32)
            return (indices, weights, tf.reduce_max(tf.nn.softmax(logits), axis=-1),
                    is_correct(labels, logits), self._losses(labels, logits))
        outputs = self.strategy.run(per_replica, args=(images, labels, weights, indices))
        return [self.strategy.gather(x, axis=0) for x in outputs]

    def _losses(self, labels, logits):
        return self._loss(tf.one_hot(labels, logits.shape[-1]), logits)

    @tf.autograph.experimental.do_not_convert
    def _step(self, images, labels, weights):
        # CIFAR-10's classes are symmetric under a horizontal flip and small
        # shifts, and the model was trained on such views: averaging their
        # logits removes part of the model's variance.
        views = views_of(images, self._views.views)
        view_logits = [tf.cast(self.model(view, training=False), tf.float32) for _, view in views]
        logits = tf.add_n([weight * l for (weight, _), l in zip(views, view_logits)])
        plain_correct = is_correct(labels, view_logits[0])
        losses = self._losses(labels, logits)
        self._sums.assign_add(tf.stack([tf.reduce_sum(losses * weights),
                                        tf.reduce_sum(is_correct(labels, logits) * weights),
                                        tf.reduce_sum(weights),
                                        tf.reduce_sum(plain_correct * weights)]))

    def _loop_fn(self, iterator, num_steps):  # autograph's only: see steps.Trainer
        for _ in tf.range(num_steps):
            self.strategy.run(self._step, args=next(iterator))
        totals = self.strategy.run(drain, args=(self._sums, tf.zeros([0])))
        return self.strategy.reduce("SUM", totals, axis=None)


def class_probabilities(probabilities, some_images: np.ndarray, views: str = "none",
                        fraction: float = 1.0, *, batch_size: int) -> np.ndarray:
    """`probabilities` (uint8 images -> float32 [N, classes]) of all
    `some_images`, `batch_size` at a time (which bounds memory, not the
    answer). With test-time `views` (augmentation.TTA_VIEWS), the
    int(N x `fraction`) images whose plain view is least confident (ties by
    index) are classified as training's evaluation does (`Evaluator`): by the
    weighted mean of their views' logits."""
    def batched(function, inputs):
        return np.concatenate([function(inputs[start:start + batch_size])
                               for start in range(0, len(inputs), batch_size)])

    plain = batched(probabilities, some_images)
    if views == "none":
        return plain

    def augmented(batch):
        # A view's log-probabilities are its logits less one number per
        # image, and the weights sum to 1: the softmax of their weighted sum
        # is the softmax of the weighted sum of the logits. (Where a
        # probability underflowed to 0, its logit was ~87 below the best.)
        log_mean = sum(weight * np.log(np.maximum(probabilities(view.numpy()),
                                                  np.finfo(np.float32).tiny))
                       for weight, view in views_of(tf.constant(batch), views))
        return tf.nn.softmax(log_mean.astype(np.float32)).numpy()

    chosen = least_confident(plain.max(axis=1), fraction)
    result = plain.copy()
    if len(chosen):
        result[chosen] = batched(augmented, some_images[chosen])
    return result


def is_correct(labels, logits):
    """1.0 where the highest-scoring class is the label, per example."""
    predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cast(predictions == labels, tf.float32)


def sum_accumulator(size: int) -> tf.Variable:
    """Per-replica running sums, read and reset once per loop call (`drain`);
    create it in the strategy's scope."""
    return tf.Variable(tf.zeros([size]), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)


@tf.autograph.experimental.do_not_convert
def drain(accumulator, extra):
    """This replica's sums (with `extra` appended); zeros the accumulator."""
    totals = tf.concat([accumulator.read_value(), extra], 0)
    with tf.control_dependencies([totals]):
        accumulator.assign(tf.zeros_like(accumulator))
    return totals


def loss_and_accuracy(p: np.ndarray, labels: np.ndarray) -> dict:
    """Mean cross-entropy and accuracy of class probabilities `p` [N,
    classes] (`class_probabilities`) for `labels` (predict's --evaluate)."""
    loss = -float(np.log(np.maximum(p[np.arange(len(labels)), labels], 1e-7)).sum())  # Keras' clip
    correct = int((p.argmax(axis=1) == labels).sum())
    return {"loss": loss / len(labels), "accuracy": correct / len(labels), "examples": len(labels)}
