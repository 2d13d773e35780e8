"""The memory section: peak resident memory of training with the package
against the notebook, each side a probe in its own process
(`python -m distributed_mpt.benchmark --_memory_probe=SIDE`)."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

from distributed_mpt import config as config_lib
from distributed_mpt.benchmark.measure import median, progress, ratio
from distributed_mpt.benchmark.processes import SUBPROCESS_TIMEOUT, last_line, subprocess_environment
from distributed_mpt.benchmark.settings import LEARNING_RATE, MOMENTUM, BenchConfig
from distributed_mpt.benchmark.training import notebook_model


PROBES = ("package", "notebook", "baseline")
_PROBE_STEPS = 5


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
                steps_per_loop=_PROBE_STEPS, learning_rate=LEARNING_RATE, weight_decay=0.0,
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
        network.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM,
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
                                        stderr=subprocess.PIPE, text=True, env=subprocess_environment())
                 for side in PROBES}
    peaks, failures = {}, []
    for side, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"{side} exited {process.returncode}: {last_line(stderr)}")
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
            progress(f"memory [{round_index + 1}/{config.repeats}] {side}: "
                      f"{peak / 2 ** 20:,.0f} MiB peak RSS")
    package, notebook, baseline = (median(runs[side]) for side in PROBES)
    return {"model": config.models[0], "batch_size": max(config.batch_sizes),
            "train_examples": config.train_examples,
            "package_peak_bytes": package, "notebook_peak_bytes": notebook,
            "baseline_peak_bytes": baseline,
            "package_over_notebook": package / notebook,
            "data_package_over_notebook": ratio(package - baseline, notebook - baseline)
            if package > baseline and notebook > baseline else None,
            "runs": runs,
            "note": "peak RSS (VmHWM) of a process training "
                    f"{_PROBE_STEPS} steps; baseline: the package on one batch of data, i.e. "
                    "TensorFlow, the model and a step; data_package_over_notebook compares "
                    "what each side adds above that baseline. Goal: package at most a quarter."}
