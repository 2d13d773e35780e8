"""Measure what the package buys, side by side, on this machine.

Every comparison is a ratio of two figures measured in this same run,
interleaved (A, B, A, B, ...), each after a warm-up, as the median of
`--repeats` repeats. Needs no network: the data is CIFAR-shaped synthetic
(`data.make_synthetic`).

Sections (`--sections`, JSON keys of `--output`):

  input_pipeline  images/s of the package's input pipeline (batched gather
                  and augmentation of uint8 arrays) against the per-example
                  `map` pipeline most CIFAR examples use; and how many times
                  faster than the training step it delivers.
  training        examples/s of the package's training loop (the real
                  `trainer.train_and_evaluate`) against the original
                  notebook's way (`model.fit` on a float copy of the images),
                  same model, batch, precision and optimizer; plus what
                  `--steps_per_loop` and `--xla` buy.
  machine_limit   achieved FLOP/s of the training loop over the rate of a
                  large matmul in the same dtype: the fraction of peak.
  memory          peak resident memory of training on a 50,000-image split
                  with the package against the notebook (each in its own
                  process: peak RSS is per process).
  scaling         `mirrored` with 2 replicas against 1 at the same global
                  batch, and 2 local workers (`distributed_mpt.launch`,
                  MultiWorkerMirroredStrategy) against 1, as subprocesses of
                  the real entry points.
  startup         wall time of a 1-step training run (process start to exit)
                  against that of `import tensorflow`.

Recipes:

  Everything, about 10 minutes on 2 CPU cores:
      distributed-mpt-benchmark --output=bench.json
  One section, one model:
      distributed-mpt-benchmark --sections=training --models=resnet9 --batch_sizes=128
  On GPUs, per precision (the figures for each come from this flag):
      distributed-mpt-benchmark --precisions=float32,mixed_float16 --batch_sizes=256,512
  Seconds, for tests:
      distributed-mpt-benchmark --tiny --output=/tmp/bench.json

The default precision is float32: on CPUs float16 is emulated and slow. On a
machine with GPUs pass `--precisions`; every training figure is reported per
precision.
"""

import contextlib
import dataclasses
import gc
import io
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

# As in train.py: keep TensorFlow's C++ start-up chatter out of the table.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from distributed_mpt import config as config_lib  # noqa: E402
from distributed_mpt.errors import ConfigError, UserError  # noqa: E402

SECTIONS = ("input_pipeline", "training", "machine_limit", "memory", "scaling", "startup")
PROBES = ("package", "notebook", "baseline")

# Steps per measurement when --steps=0: enough to cover about this many
# floating-point operations (about 5 s for resnet9 on 2 CPU cores), at least
# _MIN_STEPS and at most _MAX_STEPS (the package's default --steps_per_loop).
_AUTO_STEP_FLOPS = 1e12
_MIN_STEPS, _MAX_STEPS = 3, 50
# model.fit has no separate tracing call: its first steps are the warm-up.
_FIT_WARMUP_STEPS = 3
# The notebook used Keras' SGD default of 0.01; both sides use it (stated at
# the reference batch and scaled like the package does), with the package's
# Nesterov momentum, and no weight decay, so only the loop and input differ.
_LEARNING_RATE = 0.01
_MOMENTUM = 0.9
# The input pipelines are timed over this many images after _PIPELINE_WARMUP
# batches (the per-example pipeline first fills its 50,000-image shuffle buffer).
_PIPELINE_IMAGES = 40_000
_PIPELINE_WARMUP = 5
_TRAIN_SPLIT = 50_000  # CIFAR-10's train split
# A large square matmul, chained so that nothing can be hoisted or folded.
_MATMUL_SIZE, _MATMUL_CHAIN = 2048, 8
_MATMUL_SECONDS = 1.0
_PROBE_STEPS = 5
# Each scaling run is a fresh process (about 5 s of start-up); fewer steps
# than in-process keep the section within a couple of minutes.
_SCALING_MAX_STEPS = 20
_SUBPROCESS_TIMEOUT = 900
_COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16",
                   "mixed_bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure; see the flags."""

    output: Optional[str] = None
    repeats: int = 3
    steps: int = 0
    models: tuple = ("mlp", "resnet9")
    model_width: int = 64
    batch_sizes: tuple = (32, 256)
    precisions: tuple = ("float32",)
    sections: tuple = SECTIONS
    train_examples: int = _TRAIN_SPLIT
    pipeline_images: int = _PIPELINE_IMAGES
    seed: int = 0
    tiny: bool = False


def _define_flags(fv: flags.FlagValues) -> None:
    d = BenchConfig()
    flags.DEFINE_string("output", None, "Also write the figures as JSON to this path.",
                        flag_values=fv)
    flags.DEFINE_integer("repeats", d.repeats, "Repeats of each measurement; the median is "
                         "reported.", flag_values=fv)
    flags.DEFINE_integer("steps", d.steps, "Timed optimizer steps per training measurement; "
                         f"0: enough for about {_AUTO_STEP_FLOPS:.0e} FLOP, "
                         f"{_MIN_STEPS} to {_MAX_STEPS}.", flag_values=fv)
    flags.DEFINE_list("models", list(d.models), f"Models, of {', '.join(config_lib.MODELS)}. "
                      "memory uses the first, scaling and startup the first too.", flag_values=fv)
    flags.DEFINE_integer("model_width", d.model_width, "Channels of resnet9's first stage.",
                         flag_values=fv)
    flags.DEFINE_list("batch_sizes", [str(b) for b in d.batch_sizes],
                      "Global batch sizes; steps_per_loop=1 and XLA are measured at the "
                      "smallest, memory and scaling at the largest.", flag_values=fv)
    flags.DEFINE_list("precisions", list(d.precisions), "Precision policies, of "
                      f"{', '.join(config_lib.PRECISIONS)}.", flag_values=fv)
    flags.DEFINE_list("sections", list(SECTIONS), "Sections to run, of "
                      f"{', '.join(SECTIONS)}.", flag_values=fv)
    flags.DEFINE_integer("train_examples", d.train_examples,
                         "Synthetic train split for the input pipelines and memory.",
                         flag_values=fv)
    flags.DEFINE_integer("seed", d.seed, "Seed of the data and the models.", flag_values=fv)
    flags.DEFINE_bool("tiny", False, "A configuration for tests, in seconds: resnet9 of width "
                      "8, batch 32, 3 steps, one repeat, a small split (flags given "
                      "explicitly still win).", flag_values=fv)
    flags.DEFINE_enum("_memory_probe", None, PROBES, "Internal: report the peak memory of one "
                      "side of the memory section and exit.", flag_values=fv)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    _define_flags(fv)
    return fv


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def parse_config(argv):
    """Parses flags (without the program name) into (BenchConfig, probe or None)."""
    fv = _flag_values()
    try:
        rest = fv(["distributed-mpt-benchmark", *argv])
    except flags.Error as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    _require(len(rest) == 1, f"unexpected argument(s) {' '.join(rest[1:])}: all options are --flags")

    def given(name, value, tiny_value):
        return tiny_value if fv["tiny"].value and not fv[name].present else value

    try:
        batch_sizes = tuple(int(b) for b in fv["batch_sizes"].value)
    except ValueError:
        raise ConfigError(f"--batch_sizes={','.join(fv['batch_sizes'].value)} must be "
                          f"integers") from None
    config = BenchConfig(
        output=fv["output"].value,
        repeats=given("repeats", fv["repeats"].value, 1),
        steps=given("steps", fv["steps"].value, 3),
        models=given("models", tuple(fv["models"].value), ("resnet9",)),
        model_width=given("model_width", fv["model_width"].value, 8),
        batch_sizes=given("batch_sizes", batch_sizes, (32,)),
        precisions=tuple(fv["precisions"].value),
        sections=tuple(fv["sections"].value),
        train_examples=given("train_examples", fv["train_examples"].value, 2048),
        pipeline_images=2048 if fv["tiny"].value else _PIPELINE_IMAGES,
        seed=fv["seed"].value, tiny=fv["tiny"].value)
    _require(config.repeats > 0, f"--repeats={config.repeats} must be positive")
    _require(config.steps >= 0, f"--steps={config.steps} must be >= 0 (0: automatic)")
    _require(config.model_width > 0, f"--model_width={config.model_width} must be positive")
    _require(config.train_examples > 0, f"--train_examples={config.train_examples} must be positive")
    for name, values, choices in (("models", config.models, config_lib.MODELS),
                                  ("precisions", config.precisions, config_lib.PRECISIONS),
                                  ("sections", config.sections, SECTIONS)):
        _require(bool(values), f"--{name} is empty; choose from {', '.join(choices)}")
        bad = [v for v in values if v not in choices]
        _require(not bad, f"--{name}: {', '.join(bad)} not one of {', '.join(choices)}")
    _require(bool(batch_sizes) and all(b > 0 for b in config.batch_sizes),
             f"--batch_sizes={','.join(map(str, config.batch_sizes))} must be positive integers")
    _require(max(config.batch_sizes) <= config.train_examples,
             f"--batch_sizes: {max(config.batch_sizes)} exceeds --train_examples="
             f"{config.train_examples}")
    return config, fv["_memory_probe"].value


# ---------------------------------------------------------------------------
# Measuring


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _interleaved(measures: Dict[str, Callable[[], float]], repeats: int, label: str) -> dict:
    """Runs every measure once per round, `repeats` rounds (A, B, A, B, ...);
    returns {name: {"median": m, "runs": [...]}}."""
    runs = {name: [] for name in measures}
    for round_index in range(repeats):
        for name, measure in measures.items():
            value = measure()
            runs[name].append(value)
            _progress(f"{label} [{round_index + 1}/{repeats}] {name}: {value:,.4g}")
    return {name: {"median": _median(values), "runs": values} for name, values in runs.items()}


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


# ---------------------------------------------------------------------------
# The machine


def machine_info() -> dict:
    """What ran the benchmark."""
    import keras
    import tensorflow as tf

    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append({"name": gpu.name, "model": details.get("device_name"),
                     "compute_capability": details.get("compute_capability")})
    return {"cpu_model": cpu_model, "cpu_cores": os.cpu_count(), "usable_cores": usable,
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "python": platform.python_version(), "gpus": gpus}


# ---------------------------------------------------------------------------
# Models: FLOPs and the notebook's float-input twin


def training_flops_per_example(model) -> int:
    """Floating-point operations to train on one example: the multiply-adds of
    every Dense and Conv2D layer, x2, and x3 for forward plus backward
    (normalization, activations and the update are left out)."""
    import keras

    forward = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            kernel_h, kernel_w, channels_in, channels_out = layer.kernel.shape
            positions = math.prod(layer.output.shape[1:-1])
            forward += 2 * positions * kernel_h * kernel_w * channels_in * channels_out
        elif isinstance(layer, keras.layers.Dense):
            units_in, units_out = layer.kernel.shape
            forward += 2 * math.prod(layer.output.shape[1:-1]) * units_in * units_out
    return 3 * forward


def _flops_per_example(model_name: str, width: int) -> int:
    import keras

    from distributed_mpt.models import build_model

    flops = training_flops_per_example(build_model(model_name, width))
    keras.utils.clear_session()
    return flops


def notebook_model(model_name: str, width: int):
    """The package's model with a float32 input, as the notebook fed it: the
    same layers, cloned onto `keras.Input(dtype="float32")`."""
    import keras

    from distributed_mpt.data import IMAGE_SHAPE
    from distributed_mpt.models import build_model

    return keras.models.clone_model(build_model(model_name, width),
                                    input_tensors=keras.Input(IMAGE_SHAPE, dtype="float32"))


# ---------------------------------------------------------------------------
# Input pipelines


def package_pipeline(split, batch_size: int, seed: int, num_steps: int):
    """The package's training pipeline on one host, as the trainer builds it."""
    import tensorflow as tf

    from distributed_mpt import data

    return data.train_input_fn(split, batch_size, seed, 0, num_steps)(tf.distribute.InputContext())


def per_example_pipeline(split, batch_size: int, seed: int, repeat: bool = True):
    """The pipeline of most CIFAR examples: slices of the arrays, shuffled,
    each image padded, cropped and flipped on its own, then batched. The same
    augmentation as the package (4-pixel reflect padding, random 32x32 crop,
    random horizontal flip), on uint8; parallel `map`, so not a straw man."""
    import tensorflow as tf

    from distributed_mpt.data import CROP_PADDING, IMAGE_SHAPE

    def augment(image, label):
        image = tf.pad(image, [[CROP_PADDING] * 2, [CROP_PADDING] * 2, [0, 0]], mode="REFLECT")
        image = tf.image.random_crop(image, IMAGE_SHAPE)
        return tf.image.random_flip_left_right(image), label

    dataset = tf.data.Dataset.from_tensor_slices((split.images, split.labels))
    dataset = dataset.shuffle(len(split), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    return (dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch_size, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))


def _pipeline_rate(make_dataset: Callable, batch_size: int, timed_batches: int) -> float:
    """Images/s delivered by a fresh pipeline after _PIPELINE_WARMUP batches."""
    iterator = iter(make_dataset())
    for _ in range(_PIPELINE_WARMUP):
        next(iterator)
    started = time.perf_counter()
    for _ in range(timed_batches):
        next(iterator)
    elapsed = time.perf_counter() - started
    del iterator
    gc.collect()
    return timed_batches * batch_size / elapsed


def bench_input_pipeline(config: BenchConfig, training: Optional[dict]) -> dict:
    from distributed_mpt import data, precision

    split, _ = data.make_synthetic(config.train_examples, 1, config.seed)
    training_policy = precision.resolve_precision(config.precisions[0])
    results = []
    for batch in config.batch_sizes:
        timed = max(config.pipeline_images // batch, 3)
        steps = timed + _PIPELINE_WARMUP
        figures = _interleaved({
            "package": lambda: _pipeline_rate(
                lambda: package_pipeline(split, batch, config.seed, steps), batch, timed),
            "per_example": lambda: _pipeline_rate(
                lambda: per_example_pipeline(split, batch, config.seed), batch, timed),
        }, config.repeats, f"input_pipeline batch {batch}")
        package_rate = figures["package"]["median"]
        step_rates = {row["model"]: row["package_examples_per_second"]
                      for row in (training or {}).get("results", [])
                      if row["batch_size"] == batch and row["precision"] == training_policy}
        results.append({
            "batch_size": batch, "images_timed": timed * batch,
            "package_images_per_second": package_rate,
            "per_example_images_per_second": figures["per_example"]["median"],
            "speedup": _ratio(package_rate, figures["per_example"]["median"]),
            "training_examples_per_second": step_rates,
            "package_over_training_step": {model: _ratio(package_rate, rate)
                                           for model, rate in step_rates.items()},
            "runs": {name: f["runs"] for name, f in figures.items()}})
    return {"train_examples": config.train_examples, "results": results,
            "note": "package_over_training_step: how many times faster the package pipeline "
                    "delivers images than its training step (precision "
                    f"{config.precisions[0]}) consumes them; above 1 the input is not the "
                    "bottleneck."}


# ---------------------------------------------------------------------------
# Training: the package's loop against model.fit


def _auto_steps(config: BenchConfig, flops_per_example: int, batch: int) -> int:
    if config.steps:
        return config.steps
    steps = round(_AUTO_STEP_FLOPS / (flops_per_example * batch))
    return min(max(steps, _MIN_STEPS), _MAX_STEPS)


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
            model_dir=model_dir, dataset="synthetic", synthetic_examples=_examples_for(batch, total),
            model=model, model_width=config.model_width, precision=policy, strategy="default",
            per_replica_batch_size=batch, train_steps=total, steps_per_loop=steps_per_loop,
            # One log line and one checkpoint, at the end: no extra loop boundaries.
            log_every_steps=total, checkpoint_every_steps=total,
            learning_rate=_LEARNING_RATE, warmup_epochs=0, momentum=_MOMENTUM,
            weight_decay=0.0, seed=config.seed, xla=xla, evaluate=False, export=False)
        with contextlib.redirect_stdout(io.StringIO()):
            summary = trainer.train_and_evaluate(
                train_config, tf.distribute.get_strategy(), "default", None)
        return float(summary["examples_per_second"])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        keras.utils.clear_session()
        gc.collect()


def _examples_for(batch: int, steps: int) -> int:
    return max(steps * batch, 2048)


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

    train, _ = data.make_synthetic(_examples_for(batch, _FIT_WARMUP_STEPS + steps), 1, config.seed)
    images = train.images.astype("float32") / 255
    labels = keras.utils.to_categorical(train.labels, data.NUM_CLASSES)
    try:
        precision.set_precision(policy)
        keras.utils.set_random_seed(config.seed)
        network = notebook_model(model, config.model_width)
        # Under mixed_float16, compile() wraps the optimizer for loss scaling.
        network.compile(
            optimizer=keras.optimizers.SGD(
                optimization.scaled_learning_rate(_LEARNING_RATE, batch), momentum=_MOMENTUM,
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
    for requested in config.precisions:
        policy = precision.resolve_precision(requested)
        for model in config.models:
            flops = _flops_per_example(model, config.model_width)
            for batch in config.batch_sizes:
                steps = _auto_steps(config, flops, batch)
                loop = min(steps, _MAX_STEPS)
                measures = {
                    "package": lambda: package_training_rate(config, model, batch, policy,
                                                             steps, loop),
                    "model_fit": lambda: notebook_training_rate(config, model, batch, policy,
                                                                steps),
                    # The machine_limit section's peak, measured under the same load.
                    "matmul": lambda: matmul_flops_per_second(_COMPUTE_DTYPES[policy])}
                if batch == smallest:
                    measures["steps_per_loop_1"] = lambda: package_training_rate(
                        config, model, batch, policy, steps, 1)
                    measures["xla"] = lambda: package_training_rate(
                        config, model, batch, policy, steps, loop, xla=True)
                figures = _interleaved(measures, config.repeats,
                                       f"training {model} batch {batch} {policy}")
                medians = {name: f["median"] for name, f in figures.items()}
                row = {"model": model, "batch_size": batch, "precision": policy,
                       "steps": steps, "steps_per_loop": loop,
                       "flops_per_example": flops,
                       "package_examples_per_second": medians["package"],
                       "model_fit_examples_per_second": medians["model_fit"],
                       "speedup_over_model_fit": _ratio(medians["package"], medians["model_fit"]),
                       "matmul_flops_per_second": medians["matmul"],
                       "runs": {name: f["runs"] for name, f in figures.items()}}
                if "xla" in medians:
                    row.update(
                        steps_per_loop_1_examples_per_second=medians["steps_per_loop_1"],
                        speedup_of_steps_per_loop=_ratio(medians["package"],
                                                         medians["steps_per_loop_1"]),
                        xla_examples_per_second=medians["xla"],
                        speedup_of_xla=_ratio(medians["xla"], medians["package"]))
                results.append(row)
    return {"results": results, "model_width": config.model_width,
            "note": "package: trainer.train_and_evaluate on the default strategy, rate of the "
                    "loop calls after the first; model_fit: Keras model.fit on float32 arrays "
                    "(x / 255), after its first steps. Both SGD with Nesterov momentum, no "
                    "weight decay. steps_per_loop_1 and xla are measured at the smallest "
                    "batch."}


# ---------------------------------------------------------------------------
# Machine limit


_MATMUL_CHAINS = {}


def matmul_flops_per_second(dtype: str) -> float:
    """FLOP/s of chained large square matmuls in `dtype`, run for at least
    _MATMUL_SECONDS (traced and warmed up on the first call per dtype)."""
    import tensorflow as tf

    if dtype not in _MATMUL_CHAINS:
        size = _MATMUL_SIZE
        a = tf.cast(tf.random.normal([size, size]), dtype)
        b = tf.cast(tf.random.normal([size, size]) / math.sqrt(size), dtype)

        @tf.function
        def chain(x, y):
            for _ in range(_MATMUL_CHAIN):  # each depends on the last: nothing to fold
                x = tf.matmul(x, y)
            return tf.reduce_sum(tf.cast(x[:1, :1], tf.float32))

        chain(a, b).numpy()
        _MATMUL_CHAINS[dtype] = lambda: chain(a, b).numpy()
    run_chain = _MATMUL_CHAINS[dtype]
    calls, started = 0, time.perf_counter()
    while True:
        run_chain()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= _MATMUL_SECONDS:
            return calls * _MATMUL_CHAIN * 2 * _MATMUL_SIZE ** 3 / elapsed


def bench_machine_limit(config: BenchConfig, training: Optional[dict]) -> dict:
    """Achieved FLOP/s over the matmul rate measured interleaved with it (in
    the training section's rounds, or here if that section did not run)."""
    from distributed_mpt import precision

    rows = (training or {}).get("results")
    if not rows:
        rows = []
        for requested in config.precisions:
            policy = precision.resolve_precision(requested)
            for model in config.models:
                flops = _flops_per_example(model, config.model_width)
                for batch in config.batch_sizes:
                    steps = _auto_steps(config, flops, batch)
                    figures = _interleaved({
                        "package": lambda: package_training_rate(
                            config, model, batch, policy, steps, min(steps, _MAX_STEPS)),
                        "matmul": lambda: matmul_flops_per_second(_COMPUTE_DTYPES[policy])},
                        config.repeats, f"machine_limit {model} batch {batch} {policy}")
                    rows.append({"model": model, "batch_size": batch, "precision": policy,
                                 "flops_per_example": flops,
                                 "package_examples_per_second": figures["package"]["median"],
                                 "matmul_flops_per_second": figures["matmul"]["median"]})
    results = []
    for row in rows:
        achieved = row["flops_per_example"] * row["package_examples_per_second"]
        results.append({"model": row["model"], "batch_size": row["batch_size"],
                        "precision": row["precision"],
                        "flops_per_example": row["flops_per_example"],
                        "achieved_flops_per_second": achieved,
                        "matmul_flops_per_second": row["matmul_flops_per_second"],
                        "fraction_of_peak": achieved / row["matmul_flops_per_second"]})
    return {"matmul": {"size": _MATMUL_SIZE, "chain": _MATMUL_CHAIN,
                       "seconds_per_measurement": _MATMUL_SECONDS},
            "results": results,
            "note": "FLOPs per example: 2 x multiply-adds of Dense and Conv2D layers, x3 for "
                    f"forward and backward; peak: chained {_MATMUL_SIZE}x{_MATMUL_SIZE} matmuls "
                    "in the compute dtype, measured in the same rounds as the training rate "
                    "(so under the same load). Above 1 means the kernels do fewer operations "
                    "than counted (e.g. Winograd convolutions) or the matmul is not this "
                    "library's best kernel."}


# ---------------------------------------------------------------------------
# Memory: each side in its own process


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def memory_probe(config: BenchConfig, side: str) -> dict:
    """Trains a few steps on a `train_examples` split, as `side` does, and
    returns the peak RSS. package: the trainer on uint8 arrays. notebook: the
    float copy `x / 255.0` (float64 in NumPy, as the notebook's division
    made) of train and test images, then `model.fit`. baseline: the package
    on a split of one batch, the cost of TensorFlow, the model and a step."""
    model, batch, policy = config.models[0], max(config.batch_sizes), config.precisions[0]
    if side in ("package", "baseline"):
        examples = config.train_examples if side == "package" else batch
        model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
        try:
            from distributed_mpt import trainer
            import tensorflow as tf

            train_config = config_lib.TrainConfig(
                model_dir=model_dir, dataset="synthetic", synthetic_examples=examples,
                model=model, model_width=config.model_width, precision=policy,
                strategy="default", per_replica_batch_size=batch, train_steps=_PROBE_STEPS,
                steps_per_loop=_PROBE_STEPS, learning_rate=_LEARNING_RATE, weight_decay=0.0,
                evaluate=False, export=False, seed=config.seed)
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.train_and_evaluate(train_config, tf.distribute.get_strategy(), "default",
                                           None)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
    else:
        import keras

        from distributed_mpt import data, precision

        precision.set_precision(precision.resolve_precision(policy))
        train, test = data.make_synthetic(config.train_examples,
                                          max(config.train_examples // 5, 1), config.seed)
        x_train, x_test = train.images / 255.0, test.images / 255.0
        y_train = keras.utils.to_categorical(train.labels, data.NUM_CLASSES)
        network = notebook_model(model, config.model_width)
        # The package's optimizer, so that both hold the same momentum slots.
        network.compile(optimizer=keras.optimizers.SGD(_LEARNING_RATE, momentum=_MOMENTUM,
                                                       nesterov=True),
                        loss="categorical_crossentropy", metrics=["accuracy"])
        network.fit(x_train, y_train, batch_size=batch, epochs=1, steps_per_epoch=_PROBE_STEPS,
                    verbose=0)
        del x_test
    return {"side": side, "peak_rss_bytes": peak_rss_bytes()}


def _probe_command(config: BenchConfig, side: str) -> List[str]:
    return [sys.executable, "-m", "distributed_mpt.benchmark", f"--_memory_probe={side}",
            f"--models={config.models[0]}", f"--model_width={config.model_width}",
            f"--batch_sizes={max(config.batch_sizes)}", f"--precisions={config.precisions[0]}",
            f"--train_examples={config.train_examples}", f"--seed={config.seed}"]


def _run_probes(config: BenchConfig) -> Dict[str, int]:
    """Peak RSS of every side, the probes running at the same time: a peak
    does not depend on speed, and this saves two process start-ups."""
    processes = {side: subprocess.Popen(_probe_command(config, side), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=_environment())
                 for side in PROBES}
    peaks, failures = {}, []
    for side, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=_SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"{side} exited {process.returncode}: {_last_line(stderr)}")
            continue
        peaks[side] = int(json.loads(stdout.strip().splitlines()[-1])["peak_rss_bytes"])
    if failures:
        raise RuntimeError("memory probe " + "; ".join(failures))
    return peaks


def bench_memory(config: BenchConfig) -> dict:
    runs = {side: [] for side in PROBES}
    for round_index in range(config.repeats):
        for side, peak in _run_probes(config).items():
            runs[side].append(peak)
            _progress(f"memory [{round_index + 1}/{config.repeats}] {side}: "
                      f"{peak / 2 ** 20:,.0f} MiB peak RSS")
    package, notebook, baseline = (_median(runs[side]) for side in PROBES)
    return {"model": config.models[0], "batch_size": max(config.batch_sizes),
            "train_examples": config.train_examples,
            "package_peak_bytes": package, "notebook_peak_bytes": notebook,
            "baseline_peak_bytes": baseline,
            "package_over_notebook": package / notebook,
            "data_package_over_notebook": _ratio(package - baseline, notebook - baseline)
            if package > baseline and notebook > baseline else None,
            "runs": runs,
            "note": "peak RSS (VmHWM) of a process training "
                    f"{_PROBE_STEPS} steps; baseline: the package on one batch of data, i.e. "
                    "TensorFlow, the model and a step; data_package_over_notebook compares "
                    "what each side adds above that baseline. Goal: package at most a quarter."}


# ---------------------------------------------------------------------------
# Scaling and startup: the real entry points as subprocesses


def _environment() -> dict:
    environment = dict(os.environ)
    environment.pop("TF_CONFIG", None)  # each run is its own single- or multi-worker job
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    return environment


def _run(command: List[str], timeout: float = _SUBPROCESS_TIMEOUT):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=_environment())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _train_flags(config: BenchConfig, model: str, global_batch: int, parts: int, steps: int,
                 model_dir: str) -> List[str]:
    """Flags of the training entry point for `steps` timed steps after as many
    untimed ones, the global batch split over `parts` replicas or workers."""
    return ["--dataset=synthetic", f"--synthetic_examples={_examples_for(global_batch, 2 * steps)}",
            f"--model={model}", f"--model_width={config.model_width}",
            f"--precision={config.precisions[0]}",
            f"--per_replica_batch_size={global_batch // parts}",
            f"--train_steps={2 * steps}", f"--steps_per_loop={steps}",
            f"--log_every_steps={2 * steps}", f"--checkpoint_every_steps={2 * steps}",
            f"--learning_rate={_LEARNING_RATE}", "--warmup_epochs=0", "--weight_decay=0",
            f"--seed={config.seed}", "--noevaluate", "--noexport", f"--model_dir={model_dir}"]


def _entry_point_rate(command_prefix: List[str], train_flags: List[str], model_dir: str) -> float:
    try:
        result = _run([*command_prefix, *train_flags])
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command_prefix[1:])}` exited {result.returncode}: "
                               f"{_last_line(result.stderr)}")
        with open(os.path.join(model_dir, "summary.json")) as f:
            return float(json.load(f)["examples_per_second"])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def bench_scaling(config: BenchConfig) -> dict:
    model, batch = config.models[0], max(config.batch_sizes)
    steps = min(_auto_steps(config, _flops_per_example(model, config.model_width), batch),
                _SCALING_MAX_STEPS)
    train = [sys.executable, "-m", "distributed_mpt.train"]

    def mirrored(replicas):
        model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
        return _entry_point_rate(
            train, [*_train_flags(config, model, batch, replicas, steps, model_dir),
                    "--strategy=mirrored", f"--cpu_replicas={replicas}"], model_dir)

    def workers(count):
        model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
        launch = [sys.executable, "-m", "distributed_mpt.launch", f"--num_workers={count}",
                  "--max_restarts=0", "--"]
        return _entry_point_rate(
            launch, [*_train_flags(config, model, batch, count, steps, model_dir),
                     "--strategy=multi_worker"], model_dir)

    common = {"model": model, "global_batch_size": batch, "steps": steps}
    out = {}
    if batch % 2:
        out["mirrored"] = {"skipped": f"global batch {batch} does not split over 2 replicas"}
    else:
        figures = _interleaved({"1": lambda: mirrored(1), "2": lambda: mirrored(2)},
                               config.repeats, "scaling mirrored replicas")
        out["mirrored"] = _scaling_row(common, figures, "replicas")
    out["multi_worker"] = _multi_worker_scaling(config, common, batch, workers)
    out["note"] = ("efficiency = rate with 2 / rate with 1 at the same global batch. On a CPU "
                   "host the 2 replicas (or workers) share the same cores, so each gets about "
                   "half the compute, and the all-reduce of every gradient (in-process copies "
                   "for mirrored, gRPC ring over loopback for multi_worker) is added on top: "
                   "expect below 1. On separate GPUs or nodes the compute is not shared.")
    return out


def _multi_worker_scaling(config, common, batch, workers) -> dict:
    import importlib.util

    if batch % 2:
        return {"skipped": f"global batch {batch} does not split over 2 workers"}
    if importlib.util.find_spec("distributed_mpt.launch") is None:
        return {"skipped": "distributed_mpt.launch is not installed (python -m "
                           "distributed_mpt.launch not found)"}
    try:
        figures = _interleaved({"1": lambda: workers(1), "2": lambda: workers(2)},
                               config.repeats, "scaling multi_worker workers")
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
        return {"skipped": f"the launcher failed: {e}"}
    return _scaling_row(common, figures, "workers")


def _scaling_row(common: dict, figures: dict, unit: str) -> dict:
    one, two = figures["1"]["median"], figures["2"]["median"]
    return {**common, f"examples_per_second_1_{unit}": one,
            f"examples_per_second_2_{unit}": two, "efficiency": two / one,
            "runs": {f"{k}_{unit}": f["runs"] for k, f in figures.items()}}


def bench_startup(config: BenchConfig) -> dict:
    model, batch = config.models[0], min(config.batch_sizes)

    def timed(command):
        started = time.perf_counter()
        result = _run(command)
        elapsed = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[1:4])} ...` exited {result.returncode}: "
                               f"{_last_line(result.stderr)}")
        return elapsed

    def one_step():
        model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
        try:
            return timed([sys.executable, "-m", "distributed_mpt.train", "--dataset=synthetic",
                          f"--synthetic_examples={config.train_examples}", f"--model={model}",
                          f"--model_width={config.model_width}",
                          f"--precision={config.precisions[0]}", "--strategy=default",
                          f"--per_replica_batch_size={batch}", "--train_steps=1",
                          "--noevaluate", "--noexport", f"--model_dir={model_dir}"])
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    figures = _interleaved({
        "import_tensorflow": lambda: timed([sys.executable, "-c", "import tensorflow"]),
        "one_step_run": one_step}, config.repeats, "startup seconds")
    tf_import, run = figures["import_tensorflow"]["median"], figures["one_step_run"]["median"]
    return {"model": model, "batch_size": batch, "train_examples": config.train_examples,
            "import_tensorflow_seconds": tf_import, "one_step_run_seconds": run,
            "import_share": tf_import / run,
            "runs": {name: f["runs"] for name, f in figures.items()},
            "note": "one_step_run: wall time of `python -m distributed_mpt.train --train_steps=1` "
                    "from process start to exit (import, synthetic data, model, tracing, one "
                    "step, final checkpoint); import_tensorflow: `python -c 'import tensorflow'`."}


# ---------------------------------------------------------------------------
# The table


def _rate(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return f"{value / 2 ** 20:,.0f} MiB"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "FLOP/s":
        return f"{value / 1e9:,.1f} GFLOP/s"
    return f"{value:,.0f} {unit}"


def table_rows(results: dict) -> List[tuple]:
    """(section, comparison, A, B, ratio) per comparison, as printable strings."""
    results = {name: value for name, value in results.items()
               if not (isinstance(value, dict) and "failed" in value)}
    rows = []

    def add(section, what, a, b, ratio, note=""):
        rows.append((section, what, a, b, "-" if ratio is None else f"{ratio:.2f}x{note}"))

    for r in results.get("input_pipeline", {}).get("results", []):
        add("input_pipeline", f"batch {r['batch_size']}: package / per-example map",
            _rate(r["package_images_per_second"], "img/s"),
            _rate(r["per_example_images_per_second"], "img/s"), r["speedup"])
        for model, headroom in r["package_over_training_step"].items():
            add("input_pipeline", f"batch {r['batch_size']}: package pipeline / {model} step",
                _rate(r["package_images_per_second"], "img/s"),
                _rate(r["training_examples_per_second"][model], "ex/s"), headroom)
    for r in results.get("training", {}).get("results", []):
        name = f"{r['model']} b{r['batch_size']} {r['precision']}"
        add("training", f"{name}: package loop / model.fit",
            _rate(r["package_examples_per_second"], "ex/s"),
            _rate(r["model_fit_examples_per_second"], "ex/s"), r["speedup_over_model_fit"])
        if "xla_examples_per_second" in r:
            add("training", f"{name}: steps_per_loop={r['steps_per_loop']} / 1",
                _rate(r["package_examples_per_second"], "ex/s"),
                _rate(r["steps_per_loop_1_examples_per_second"], "ex/s"),
                r["speedup_of_steps_per_loop"])
            add("training", f"{name}: xla / no xla", _rate(r["xla_examples_per_second"], "ex/s"),
                _rate(r["package_examples_per_second"], "ex/s"), r["speedup_of_xla"])
    for r in results.get("machine_limit", {}).get("results", []):
        add("machine_limit", f"{r['model']} b{r['batch_size']} {r['precision']}: achieved / matmul",
            _rate(r["achieved_flops_per_second"], "FLOP/s"),
            _rate(r["matmul_flops_per_second"], "FLOP/s"), r["fraction_of_peak"])
    memory = results.get("memory")
    if memory:
        add("memory", f"peak RSS {memory['model']}, {memory['train_examples']:,} images: "
            "package / notebook", _rate(memory["package_peak_bytes"], "B"),
            _rate(memory["notebook_peak_bytes"], "B"), memory["package_over_notebook"])
        add("memory", f"  the same above baseline ({_rate(memory['baseline_peak_bytes'], 'B')})",
            _rate(memory["package_peak_bytes"] - memory["baseline_peak_bytes"], "B"),
            _rate(memory["notebook_peak_bytes"] - memory["baseline_peak_bytes"], "B"),
            memory["data_package_over_notebook"])
    scaling = results.get("scaling", {})
    for kind, unit in (("mirrored", "replicas"), ("multi_worker", "workers")):
        r = scaling.get(kind)
        if r is None:
            continue
        if "skipped" in r:
            rows.append(("scaling", f"{kind}: 2 / 1 {unit}", "skipped", "", r["skipped"]))
            continue
        add("scaling", f"{kind} {r['model']} global batch {r['global_batch_size']}: 2 / 1 {unit}",
            _rate(r[f"examples_per_second_2_{unit}"], "ex/s"),
            _rate(r[f"examples_per_second_1_{unit}"], "ex/s"), r["efficiency"])
    startup = results.get("startup")
    if startup:
        add("startup", "import tensorflow / 1-step training run",
            _rate(startup["import_tensorflow_seconds"], "s"),
            _rate(startup["one_step_run_seconds"], "s"), startup["import_share"])
    return rows


def format_table(results: dict) -> str:
    header = ("section", "comparison (A / B)", "A", "B", "A/B")
    rows = [header, *table_rows(results)]
    rows += [(name, "failed", "", "", results[name]["failed"]) for name in SECTIONS
             if "failed" in results.get(name, {})]
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))
                     + "  " + str(row[4]))
        if index == 0:
            lines.append("-" * (sum(widths) + 2 * len(widths) + 6))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Entry point


def run_benchmark(config: BenchConfig) -> dict:
    """Runs the sections `config` asks for; returns every figure."""
    import tensorflow as tf

    # Each measurement builds a fresh trainer, so tf.function warns of retracing.
    tf.get_logger().setLevel("ERROR")
    results = {"machine": machine_info(), "config": dataclasses.asdict(config),
               "section_seconds": {}}
    # Training first: the input pipeline and the machine limit relate to its rates.
    runners = {
        "training": lambda: bench_training(config),
        "input_pipeline": lambda: bench_input_pipeline(config, results.get("training")),
        "machine_limit": lambda: bench_machine_limit(config, results.get("training")),
        "memory": lambda: bench_memory(config),
        "scaling": lambda: bench_scaling(config),
        "startup": lambda: bench_startup(config),
    }
    for name, runner in runners.items():
        if name in config.sections:
            started = time.perf_counter()
            try:
                results[name] = runner()
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                # One broken section (a subprocess that failed) should not
                # throw away the figures of the others.
                results[name] = {"failed": str(e)}
            results["section_seconds"][name] = time.perf_counter() - started
    return results


def _check_writable(path: str) -> None:
    """Fails now, not after ten minutes of measuring, if `path` cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"--output={path}: cannot write into {directory} ({e.strerror}); "
                          f"choose a writable path") from None


def main(argv=None) -> int:
    """Runs the benchmark from command-line flags; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help", "--helpfull"} & set(argv):
        print(__doc__ + "\nFlags:\n" + _flag_values().get_help())
        return 0
    try:
        config, probe = parse_config(argv)
        if probe:
            print(json.dumps(memory_probe(config, probe)), flush=True)
            return 0
        if config.output:
            _check_writable(config.output)
        started = time.perf_counter()
        results = run_benchmark(config)
        results["seconds"] = time.perf_counter() - started
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    print(format_table(results), flush=True)
    if config.output:
        from distributed_mpt import outputs

        outputs.write_json(config.output, results)
        print(f"wrote {config.output}", flush=True)
    failed = [name for name in SECTIONS if "failed" in results.get(name, {})]
    for name in failed:
        print(f"error: section {name} failed: {results[name]['failed']}", file=sys.stderr)
    return 1 if failed else 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
