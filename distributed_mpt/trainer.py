"""The training loop: one code path for every `tf.distribute` strategy.

Keras 3's `Model.fit` fails under MultiWorkerMirroredStrategy, so training is
a custom loop of `strategy.run(train_step)` inside a `tf.function` that runs
`steps_per_loop` optimizer steps per call; it serves the default strategy,
OneDeviceStrategy, MirroredStrategy and MultiWorkerMirroredStrategy alike.
"""

import math
import signal
import time
from typing import Optional

import keras
import tensorflow as tf

from distributed_mpt import data, optimization, outputs, precision
from distributed_mpt.checkpointing import Checkpoints, model_identity
from distributed_mpt.cluster import Cluster
from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import EXIT_PREEMPTED, ConfigError, DivergedError
from distributed_mpt.models import build_model
from distributed_mpt.reporting import Reporter

# With dynamic loss scaling, overflowing steps are skipped and the scale
# halves; this many in a row means the loss itself is not finite.
_NONFINITE_STEPS_WITH_LOSS_SCALING = 100


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    exit_code = EXIT_PREEMPTED


class _StopSignals:
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop.

    The request is all-reduced with the metrics, so every worker stops after
    the same step. A second Ctrl-C interrupts at once.
    """

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _sum_accumulator(size: int) -> tf.Variable:
    """Per-replica running sums, read and reset once per loop call."""
    return tf.Variable(tf.zeros([size]), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)


def train_and_evaluate(config: TrainConfig, strategy: tf.distribute.Strategy,
                       strategy_name: str, cluster: Optional[Cluster]) -> dict:
    """Trains, evaluates and exports as `config` says; returns the summary.

    Writes checkpoints, logs, metrics, `summary.json` and the export into
    `config.model_dir` (chief only; other workers use temporary directories).
    """
    is_chief = cluster is None or cluster.is_chief
    num_workers = cluster.num_workers if cluster else 1
    policy = precision.resolve_precision(config.precision)
    precision.set_precision(policy)
    keras.utils.set_random_seed(config.seed)

    train_split, test_split = data.load_dataset(
        config.dataset, config.data_dir, config.download, config.synthetic_examples, config.seed)
    num_replicas = strategy.num_replicas_in_sync
    global_batch = config.per_replica_batch_size * num_replicas
    epoch_steps = data.steps_per_epoch(len(train_split), global_batch)
    if epoch_steps == 0:
        raise ConfigError(
            f"the global batch of {global_batch} ({config.per_replica_batch_size} x {num_replicas} "
            f"replicas) exceeds the {len(train_split)} training examples; lower --per_replica_batch_size")
    total_steps = config.train_steps or config.epochs * epoch_steps
    learning_rate = optimization.scaled_learning_rate(config.learning_rate, global_batch)
    schedule = optimization.learning_rate_schedule(
        learning_rate, total_steps, round(config.warmup_epochs * epoch_steps))

    with strategy.scope():
        model = build_model(config.model, config.model_width, config.weight_decay)
        optimizer = optimization.make_optimizer(schedule, config.momentum,
                                                loss_scaling=policy == "mixed_float16")
        # Built here, not lazily in the first step: MirroredStrategy cannot
        # create slot variables inside the traced step.
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        trained_global_batch = tf.Variable(global_batch, dtype=tf.int64, trainable=False)
        train_sums = _sum_accumulator(4)  # loss sum, correct, examples, non-finite steps
        eval_sums = _sum_accumulator(3)   # loss sum, correct, examples
        if config.data_on_device:
            # A copy per device, made once; the input pipeline then carries
            # only indices and augmentation parameters.
            device_split = (tf.Variable(train_split.images, trainable=False),
                            tf.Variable(train_split.labels, trainable=False))

    worker = None if is_chief else f"{cluster.task_type}-{cluster.task_index}"
    checkpoints = Checkpoints(config.model_dir, worker, model_identity(model),
                              model=model, optimizer=optimizer, step=step,
                              global_batch_size=trained_global_batch)
    checkpoints.check_identity()
    resumed = checkpoints.restore_latest()
    start_step = int(step.numpy())
    reporter = Reporter(config.model_dir, is_chief, total_steps, start_step)
    reporter.say(f"{config.model} on {config.dataset}: {policy}, {strategy_name} strategy, "
                 f"{num_workers} worker(s), {num_replicas} replica(s); global batch "
                 f"{global_batch} = {config.per_replica_batch_size} per replica x {num_replicas}; "
                 f"learning rate {learning_rate:g} = {config.learning_rate:g} x {global_batch}"
                 f"/{optimization.REFERENCE_BATCH_SIZE}; {total_steps} steps "
                 f"({epoch_steps} per epoch)")
    if resumed:
        previous_batch = int(trained_global_batch.numpy())
        reporter.say(f"resuming from step {start_step} (checkpoint {checkpoints.latest})")
        if previous_batch != global_batch:
            reporter.say(f"the checkpoint was trained at global batch {previous_batch}; "
                         f"continuing at global batch {global_batch}")
            trained_global_batch.assign(global_batch)

    train_loss = keras.losses.CategoricalCrossentropy(
        label_smoothing=config.label_smoothing, reduction=None)
    eval_loss = keras.losses.CategoricalCrossentropy(reduction=None)

    def per_example_loss(loss_fn, labels, probabilities):
        return loss_fn(tf.one_hot(labels, data.NUM_CLASSES), probabilities)

    def compute_gradients(images, labels):
        with tf.GradientTape() as tape:
            probabilities = model(images, training=True)
            losses = per_example_loss(train_loss, labels, probabilities)
            loss = tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled_loss = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled_loss, model.trainable_variables)
        correct = tf.reduce_sum(tf.cast(
            tf.argmax(probabilities, axis=-1, output_type=tf.int32) == labels, tf.float32))
        return gradients, loss, tf.reduce_sum(losses), correct

    if config.xla:
        # Only the forward and backward pass: the gradient all-reduce and the
        # update stay outside XLA, where every strategy supports them.
        compute_gradients = tf.function(compute_gradients, jit_compile=True)

    def train_step(*batch):
        images, labels = data.gather_and_augment(*device_split, *batch) \
            if config.data_on_device else batch
        gradients, loss, loss_sum, correct = compute_gradients(images, labels)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        finite = tf.math.is_finite(loss)
        count = tf.cast(tf.shape(labels)[0], tf.float32)
        train_sums.assign_add(tf.where(finite, tf.stack([loss_sum, correct, count, 0.0]),
                                       tf.constant([0.0, 0.0, 0.0, 1.0])))

    def drain(accumulator, extra):
        """This replica's sums (with `extra` appended), then zeros them."""
        totals = tf.concat([accumulator.read_value(), extra], 0)
        with tf.control_dependencies([totals]):
            accumulator.assign(tf.zeros_like(accumulator))
        return totals

    @tf.function
    def train_loop(iterator, num_steps, stop_requested):
        for _ in tf.range(num_steps):
            strategy.run(train_step, args=next(iterator))
            step.assign_add(1)
        # The stop request travels with the metrics: if any worker was
        # signalled, all of them learn it at this same step.
        totals = strategy.run(drain, args=(train_sums, tf.reshape(stop_requested, [1])))
        return strategy.reduce("SUM", totals, axis=None)

    def eval_step(images, labels, weights):
        probabilities = model(images, training=False)
        losses = per_example_loss(eval_loss, labels, probabilities)
        correct = tf.cast(tf.argmax(probabilities, axis=-1, output_type=tf.int32) == labels, tf.float32)
        eval_sums.assign_add(tf.stack([tf.reduce_sum(losses * weights),
                                       tf.reduce_sum(correct * weights), tf.reduce_sum(weights)]))

    @tf.function
    def eval_loop(iterator, num_steps):
        for _ in tf.range(num_steps):
            strategy.run(eval_step, args=next(iterator))
        return strategy.reduce("SUM", strategy.run(drain, args=(eval_sums, tf.zeros([0]))), axis=None)

    signals = _StopSignals()
    try:
        train_metrics, throughput = _train(
            config, strategy, train_loop, step, optimizer, train_split, global_batch,
            start_step, total_steps, epoch_steps, checkpoints, reporter, signals)
    finally:
        signals.restore()

    summary = {
        "strategy": strategy_name, "num_workers": num_workers, "num_replicas": num_replicas,
        "per_replica_batch_size": config.per_replica_batch_size, "global_batch_size": global_batch,
        "precision": policy, "model": config.model, "dataset": config.dataset,
        "steps": int(step.numpy()), "epochs": int(step.numpy()) / epoch_steps,
        "learning_rate": learning_rate,
        "reference_batch_size": optimization.REFERENCE_BATCH_SIZE,
        "train_loss": train_metrics.get("loss"), "train_accuracy": train_metrics.get("accuracy"),
        "examples_per_second": throughput, "resumed_from_step": start_step,
        "eval_loss": None, "eval_accuracy": None, "eval_examples": 0,
    }
    if config.evaluate:
        eval_iterator = iter(strategy.distribute_datasets_from_function(
            data.eval_input_fn(test_split, global_batch)))
        loss_sum, correct, examples = (float(x) for x in eval_loop(
            eval_iterator, tf.constant(data.eval_steps(len(test_split), global_batch))).numpy())
        summary.update(eval_loss=float(loss_sum / examples), eval_accuracy=float(correct / examples),
                       eval_examples=int(round(examples)))
        reporter.say(f"evaluated {summary['eval_examples']} test images: loss "
                     f"{summary['eval_loss']:.4f}, accuracy {summary['eval_accuracy']:.4f}")
    if is_chief:
        if config.export:
            reporter.say(f"exported to {outputs.export_model(model, config.model_dir)}")
        outputs.write_json(f"{config.model_dir}/summary.json", summary)
        outputs.write_json(f"{config.model_dir}/config.json", config.__dict__)
    checkpoints.close()
    reporter.close()
    return summary


def _train(config, strategy, train_loop, step, optimizer, train_split, global_batch,
           start_step, total_steps, epoch_steps, checkpoints, reporter, signals):
    """Runs the loop from `start_step` to `total_steps`; returns the last
    interval's metrics and the training throughput in examples per second."""
    if start_step >= total_steps:
        return {}, None
    iterator = iter(strategy.distribute_datasets_from_function(data.train_input_fn(
        train_split, global_batch, config.seed, start_step, total_steps - start_step,
        images_on_device=config.data_on_device)))
    loss_scaling = precision.has_loss_scaling(optimizer)
    nonfinite_run = 0
    interval = [0.0, 0.0, 0.0, 0.0]  # sums since the last log line
    interval_start = time.perf_counter()
    timed_examples, timed_seconds, metrics = 0, 0.0, {}
    current = start_step
    last_saved = start_step
    while current < total_steps:
        boundaries = [total_steps, _next_multiple(current, config.log_every_steps),
                      _next_multiple(current, config.checkpoint_every_steps),
                      current + config.steps_per_loop]
        num_steps = min(boundaries) - current
        started = time.perf_counter()
        totals = [float(x) for x in train_loop(iterator, tf.constant(num_steps),
                                               tf.constant(float(signals.requested))).numpy()]
        elapsed = time.perf_counter() - started
        if current > start_step:  # the first call includes tracing
            timed_examples += num_steps * global_batch
            timed_seconds += elapsed
        current += num_steps
        interval = [a + b for a, b in zip(interval, totals[:4])]
        nonfinite_steps = int(totals[3])
        nonfinite_run = nonfinite_run + nonfinite_steps if nonfinite_steps == num_steps else 0
        if nonfinite_steps and (not loss_scaling or nonfinite_run >= _NONFINITE_STEPS_WITH_LOSS_SCALING):
            raise DivergedError(
                f"the loss became NaN or infinite by step {current}; kept the last good checkpoint "
                f"(step {last_saved}) untouched: lower --learning_rate or use --precision=float32")
        if current % config.log_every_steps == 0 or current == total_steps:
            seconds = time.perf_counter() - interval_start
            examples = interval[2]
            metrics = {"epoch": current / epoch_steps,
                       "loss": interval[0] / examples if examples else math.nan,
                       "accuracy": interval[1] / examples if examples else math.nan,
                       "learning_rate": float(optimizer.learning_rate),
                       "loss_scale": float(precision.loss_scale(optimizer)),
                       "examples_per_second": examples / seconds if seconds else 0.0,
                       "skipped_steps": int(interval[3])}
            reporter.log(current, metrics)
            interval, interval_start = [0.0, 0.0, 0.0, 0.0], time.perf_counter()
        stop = totals[4] > 0
        if current % config.checkpoint_every_steps == 0 or current == total_steps or stop:
            checkpoints.save(current)
            last_saved = current
        if stop:
            reporter.say(f"stopped by a signal at step {current}; checkpoint saved: "
                         f"run the same command again to resume")
            raise Preempted(f"stopped at step {current} after a checkpoint")
    throughput = timed_examples / timed_seconds if timed_seconds else None
    return metrics, throughput


def _next_multiple(value: int, multiple: int) -> int:
    return (value // multiple + 1) * multiple
