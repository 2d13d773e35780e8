"""The machine_limit section: the training loop's achieved FLOP/s over the
rate of a large matmul in the same dtype, the fraction of peak."""

from typing import Optional

from distributed_mpt.benchmark.measure import (
    COMPUTE_DTYPES, MATMUL_CHAIN, MATMUL_SECONDS, MATMUL_SIZE, MAX_STEPS, auto_steps,
    interleaved, matmul_flops_per_second, model_flops_per_example)
from distributed_mpt.benchmark.settings import BenchConfig
from distributed_mpt.benchmark.training import package_training_rate


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
                flops = model_flops_per_example(model, config.model_width)
                for batch in config.batch_sizes:
                    steps = auto_steps(config, flops, batch)
                    figures = interleaved({
                        "package": lambda: package_training_rate(
                            config, model, batch, policy, steps, min(steps, MAX_STEPS)),
                        "matmul": lambda: matmul_flops_per_second(COMPUTE_DTYPES[policy])},
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
    return {"matmul": {"size": MATMUL_SIZE, "chain": MATMUL_CHAIN,
                       "seconds_per_measurement": MATMUL_SECONDS},
            "results": results,
            "note": "FLOPs per example: 2 x multiply-adds of Dense and Conv2D layers, x3 for "
                    f"forward and backward; peak: chained {MATMUL_SIZE}x{MATMUL_SIZE} matmuls "
                    "in the compute dtype, measured in the same rounds as the training rate "
                    "(so under the same load). Above 1 means the kernels do fewer operations "
                    "than counted (e.g. Winograd convolutions) or the matmul is not this "
                    "library's best kernel."}
