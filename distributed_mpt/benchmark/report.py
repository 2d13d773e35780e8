"""The console table: one row per comparison (A, B and A/B), from the figures
`cli.run_benchmark` returns."""

from typing import List, Optional

from distributed_mpt.benchmark.settings import SECTIONS


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
    for r in results.get("training", {}).get("mixed_precision_speedups", []):
        add("training", f"{r['model']} b{r['batch_size']}: {r['precision']} / float32",
            _rate(r["examples_per_second"], "ex/s"), _rate(r["float32_examples_per_second"], "ex/s"),
            r["speedup_over_float32"])
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
