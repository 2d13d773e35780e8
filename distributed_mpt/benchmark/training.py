"""The training section: the package's loop (`trainer.train_and_evaluate`)
against the original notebook's `model.fit` on a float copy of the images,
plus what `--steps_per_loop` and `--xla` buy."""

import contextlib
import gc
import io
import shutil
import tempfile
import time

from distributed_mpt import config as config_lib
from distributed_mpt.benchmark.measure import (
    COMPUTE_DTYPES, MAX_STEPS, auto_steps, examples_for, interleaved, matmul_flops_per_second,
    model_flops_per_example, ratio)
from distributed_mpt.benchmark.settings import LEARNING_RATE, MOMENTUM, BenchConfig


# model.fit has no separate tracing call: its first steps are the warm-up.
_FIT_WARMUP_STEPS = 3


def notebook_model(model_name: str, width: int):
    """The package's model with a float32 input, as the notebook fed it: the
    same layers, cloned onto `keras.Input(dtype="float32")`."""
    import keras

    from distributed_mpt.data import IMAGE_SHAPE
    from distributed_mpt.models import build_model

    return keras.models.clone_model(build_model(model_name, width),
                                    input_tensors=keras.Input(IMAGE_SHAPE, dtype="float32"))


def package_training_rate(config: BenchConfig, model: str, batch: int, policy: str,
                          steps: int, steps_per_loop: int, xla: bool = False) -> float:
    """Examples/s of `trainer.train_and_evaluate` over `steps` steps, after a
    first loop call of `steps_per_loop` steps (tracing, warm-up) that the
    trainer itself leaves out of its `examples_per_second`."""
    import keras
    import tensorflow as tf

    from distributed_mpt import trainer

    total = steps_per_loop + steps
    model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
    try:
        train_config = config_lib.TrainConfig(
            model_dir=model_dir, dataset="synthetic", synthetic_examples=examples_for(batch, total),
            model=model, model_width=config.model_width, precision=policy, strategy="default",
            per_replica_batch_size=batch, train_steps=total, steps_per_loop=steps_per_loop,
            # One log line and one checkpoint, at the end: no extra loop boundaries.
            log_every_steps=total, checkpoint_every_steps=total,
            learning_rate=LEARNING_RATE, warmup_epochs=0, momentum=MOMENTUM,
            weight_decay=0.0, seed=config.seed, xla=xla, evaluate=False, export=False)
        with contextlib.redirect_stdout(io.StringIO()):
            summary = trainer.train_and_evaluate(
                train_config, tf.distribute.get_strategy(), "default", None)
        return float(summary["examples_per_second"])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        keras.utils.clear_session()
        gc.collect()


def _batch_clock():
    """A Keras callback that notes the time at the end of every training batch."""
    import keras

    class BatchClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    return BatchClock()


def notebook_training_rate(config: BenchConfig, model: str, batch: int, policy: str,
                           steps: int) -> float:
    """Examples/s of the notebook's way: the uint8 images copied as
    `astype('float32') / 255`, one-hot labels, `model.fit` with SGD, the same
    model, batch and precision; timed over the `steps` steps after
    _FIT_WARMUP_STEPS (the first traces the step)."""
    import keras

    from distributed_mpt import data, optimization, precision

    train, _ = data.make_synthetic(examples_for(batch, _FIT_WARMUP_STEPS + steps), 1, config.seed)
    images = train.images.astype("float32") / 255
    labels = keras.utils.to_categorical(train.labels, data.NUM_CLASSES)
    try:
        precision.set_precision(policy)
        keras.utils.set_random_seed(config.seed)
        network = notebook_model(model, config.model_width)
        # Under mixed_float16, compile() wraps the optimizer for loss scaling.
        network.compile(
            optimizer=keras.optimizers.SGD(
                optimization.scaled_learning_rate(LEARNING_RATE, batch), momentum=MOMENTUM,
                nesterov=True),
            loss="categorical_crossentropy", metrics=["accuracy"])
        clock = _batch_clock()
        network.fit(images, labels, batch_size=batch, epochs=1, shuffle=True, verbose=0,
                    steps_per_epoch=_FIT_WARMUP_STEPS + steps, callbacks=[clock])
        times = clock.times
        return steps * batch / (times[-1] - times[_FIT_WARMUP_STEPS - 1])
    finally:
        keras.utils.clear_session()
        gc.collect()


def bench_training(config: BenchConfig) -> dict:
    from distributed_mpt import precision

    smallest = min(config.batch_sizes)
    results = []
    policies = list(dict.fromkeys(precision.resolve_precision(p) for p in config.precisions))
    for policy in policies:
        for model in config.models:
            flops = model_flops_per_example(model, config.model_width)
            for batch in config.batch_sizes:
                steps = auto_steps(config, flops, batch)
                loop = min(steps, MAX_STEPS)
                measures = {
                    "package": lambda: package_training_rate(config, model, batch, policy,
                                                             steps, loop),
                    "model_fit": lambda: notebook_training_rate(config, model, batch, policy,
                                                                steps),
                    # The machine_limit section's peak, measured under the same load.
                    "matmul": lambda: matmul_flops_per_second(COMPUTE_DTYPES[policy])}
                if batch == smallest:
                    measures["steps_per_loop_1"] = lambda: package_training_rate(
                        config, model, batch, policy, steps, 1)
                    measures["xla"] = lambda: package_training_rate(
                        config, model, batch, policy, steps, loop, xla=True)
                figures = interleaved(measures, config.repeats,
                                       f"training {model} batch {batch} {policy}")
                medians = {name: f["median"] for name, f in figures.items()}
                row = {"model": model, "batch_size": batch, "precision": policy,
                       "steps": steps, "steps_per_loop": loop,
                       "flops_per_example": flops,
                       "package_examples_per_second": medians["package"],
                       "model_fit_examples_per_second": medians["model_fit"],
                       "speedup_over_model_fit": ratio(medians["package"], medians["model_fit"]),
                       "matmul_flops_per_second": medians["matmul"],
                       "runs": {name: f["runs"] for name, f in figures.items()}}
                if "xla" in medians:
                    row.update(
                        steps_per_loop_1_examples_per_second=medians["steps_per_loop_1"],
                        speedup_of_steps_per_loop=ratio(medians["package"],
                                                         medians["steps_per_loop_1"]),
                        xla_examples_per_second=medians["xla"],
                        speedup_of_xla=ratio(medians["xla"], medians["package"]))
                results.append(row)
    return {"results": results, "model_width": config.model_width,
            "mixed_precision_speedups": _mixed_precision_speedups(results),
            "note": "package: trainer.train_and_evaluate on the default strategy, rate of the "
                    "loop calls after the first; model_fit: Keras model.fit on float32 arrays "
                    "(x / 255), after its first steps. Both SGD with Nesterov momentum, no "
                    "weight decay. steps_per_loop_1 and xla are measured at the smallest "
                    "batch."}


def _mixed_precision_speedups(results: list) -> list:
    """The package loop's rate under each mixed policy over its float32 rate,
    per model and batch (on GPUs, the point of mixed precision)."""
    float32 = {(r["model"], r["batch_size"]): r["package_examples_per_second"]
               for r in results if r["precision"] == "float32"}
    return [{"model": r["model"], "batch_size": r["batch_size"], "precision": r["precision"],
             "examples_per_second": r["package_examples_per_second"],
             "float32_examples_per_second": float32[(r["model"], r["batch_size"])],
             "speedup_over_float32": ratio(r["package_examples_per_second"],
                                           float32[(r["model"], r["batch_size"])])}
            for r in results
            if r["precision"] != "float32" and (r["model"], r["batch_size"]) in float32]
