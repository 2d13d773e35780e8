"""The scaling section: `mirrored` with 2 replicas against 1, and 2 local
workers (`distributed_mpt.launch`) against 1, each a run of the real
training entry point in a child process."""

import json
import os
import subprocess
import sys
import shutil
import tempfile
from typing import List

from distributed_mpt.benchmark.measure import (
    auto_steps, examples_for, interleaved, model_flops_per_example)
from distributed_mpt.benchmark.processes import last_line, run_command
from distributed_mpt.benchmark.settings import LEARNING_RATE, BenchConfig


# Each scaling run is a fresh process (about 5 s of start-up); fewer steps
# than in-process keep the section within a couple of minutes.
_SCALING_MAX_STEPS = 20


def _train_flags(config: BenchConfig, model: str, global_batch: int, parts: int, steps: int,
                 model_dir: str) -> List[str]:
    """Flags of the training entry point for `steps` timed steps after as many
    untimed ones, the global batch split over `parts` replicas or workers."""
    return ["--dataset=synthetic", f"--synthetic_examples={examples_for(global_batch, 2 * steps)}",
            f"--model={model}", f"--model_width={config.model_width}",
            f"--precision={config.precisions[0]}",
            f"--per_replica_batch_size={global_batch // parts}",
            f"--train_steps={2 * steps}", f"--steps_per_loop={steps}",
            f"--log_every_steps={2 * steps}", f"--checkpoint_every_steps={2 * steps}",
            f"--learning_rate={LEARNING_RATE}", "--warmup_epochs=0", "--weight_decay=0",
            f"--seed={config.seed}", "--noevaluate", "--noexport", f"--model_dir={model_dir}"]


def _entry_point_rate(command_prefix: List[str], train_flags: List[str], model_dir: str) -> float:
    try:
        result = run_command([*command_prefix, *train_flags])
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command_prefix[1:])}` exited {result.returncode}: "
                               f"{last_line(result.stderr)}")
        with open(os.path.join(model_dir, "summary.json")) as f:
            return float(json.load(f)["examples_per_second"])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def bench_scaling(config: BenchConfig) -> dict:
    model, batch = config.models[0], max(config.batch_sizes)
    steps = min(auto_steps(config, model_flops_per_example(model, config.model_width), batch),
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
        figures = interleaved({"1": lambda: mirrored(1), "2": lambda: mirrored(2)},
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
        figures = interleaved({"1": lambda: workers(1), "2": lambda: workers(2)},
                               config.repeats, "scaling multi_worker workers")
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
        return {"skipped": f"the launcher failed: {e}"}
    return _scaling_row(common, figures, "workers")


def _scaling_row(common: dict, figures: dict, unit: str) -> dict:
    one, two = figures["1"]["median"], figures["2"]["median"]
    return {**common, f"examples_per_second_1_{unit}": one,
            f"examples_per_second_2_{unit}": two, "efficiency": two / one,
            "runs": {f"{k}_{unit}": f["runs"] for k, f in figures.items()}}
