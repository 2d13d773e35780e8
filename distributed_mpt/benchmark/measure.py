"""How figures are measured and compared: interleaved rounds and their medians,
ratios, progress lines, the machine's description, step counts, FLOPs per
example and the rate of a large matmul (the machine's peak)."""

import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, Optional, Sequence

from distributed_mpt.benchmark.settings import BenchConfig


# Steps per measurement when --steps=0: enough to cover about this many
# floating-point operations (about 5 s for resnet9 on 2 CPU cores), at least
# MIN_STEPS and at most MAX_STEPS (the package's default --steps_per_loop).
AUTO_STEP_FLOPS = 1e12
MIN_STEPS, MAX_STEPS = 3, 50
# A large square matmul, chained so that nothing can be hoisted or folded.
MATMUL_SIZE, MATMUL_CHAIN = 2048, 8
MATMUL_SECONDS = 1.0
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16",
                   "mixed_bfloat16": "bfloat16"}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def interleaved(measures: Dict[str, Callable[[], float]], repeats: int, label: str) -> dict:
    """Runs every measure once per round, `repeats` rounds (A, B, A, B, ...);
    returns {name: {"median": m, "runs": [...]}}."""
    runs = {name: [] for name in measures}
    for round_index in range(repeats):
        for name, measure in measures.items():
            value = measure()
            runs[name].append(value)
            progress(f"{label} [{round_index + 1}/{repeats}] {name}: {value:,.4g}")
    return {name: {"median": median(values), "runs": values} for name, values in runs.items()}


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def auto_steps(config: BenchConfig, flops_per_example: int, batch: int) -> int:
    if config.steps:
        return config.steps
    steps = round(AUTO_STEP_FLOPS / (flops_per_example * batch))
    return min(max(steps, MIN_STEPS), MAX_STEPS)


def examples_for(batch: int, steps: int) -> int:
    return max(steps * batch, 2048)


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


def model_flops_per_example(model_name: str, width: int) -> int:
    import keras

    from distributed_mpt.models import build_model

    flops = training_flops_per_example(build_model(model_name, width))
    keras.utils.clear_session()
    return flops


_MATMUL_CHAINS = {}


def matmul_flops_per_second(dtype: str) -> float:
    """FLOP/s of chained large square matmuls in `dtype`, run for at least
    MATMUL_SECONDS (traced and warmed up on the first call per dtype)."""
    import tensorflow as tf

    if dtype not in _MATMUL_CHAINS:
        size = MATMUL_SIZE
        a = tf.cast(tf.random.normal([size, size]), dtype)
        b = tf.cast(tf.random.normal([size, size]) / math.sqrt(size), dtype)

        @tf.function
        def chain(x, y):
            for _ in range(MATMUL_CHAIN):  # each depends on the last: nothing to fold
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
        if elapsed >= MATMUL_SECONDS:
            return calls * MATMUL_CHAIN * 2 * MATMUL_SIZE ** 3 / elapsed
