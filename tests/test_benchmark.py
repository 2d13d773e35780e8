"""The benchmark entry point: it runs, and its figures are well-formed.

Correctness only: no test asserts a timing or the value of a ratio, which
depend on the machine and its load.
"""

import collections
import json
import math

import numpy as np

from conftest import assert_ok, run_module

SECTIONS = ("input_pipeline", "training", "machine_limit", "memory", "scaling", "startup")
# The figures each section must carry (medians of rates, seconds or bytes).
REQUIRED = {
    "input_pipeline": ("package_images_per_second", "per_example_images_per_second", "speedup"),
    "training": ("package_examples_per_second", "model_fit_examples_per_second",
                 "speedup_over_model_fit", "steps_per_loop_1_examples_per_second",
                 "xla_examples_per_second"),
    "machine_limit": ("achieved_flops_per_second", "matmul_flops_per_second",
                      "fraction_of_peak"),
    "memory": ("package_peak_bytes", "notebook_peak_bytes", "baseline_peak_bytes",
               "package_over_notebook"),
    "startup": ("import_tensorflow_seconds", "one_step_run_seconds"),
}
SCALING = {"mirrored": ("examples_per_second_1_replicas", "examples_per_second_2_replicas",
                        "efficiency"),
           "multi_worker": ("examples_per_second_1_workers", "examples_per_second_2_workers",
                            "efficiency")}


def _numbers(value, path=""):
    """Every number in a JSON value, with its path (booleans are not numbers)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def _assert_positive_finite(record, keys, where):
    for key in keys:
        value = record.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, \
            f"{where}.{key} = {value!r}"


def test_tiny_run_writes_every_section(tmp_path):
    output = tmp_path / "bench.json"
    result = run_module("distributed_mpt.benchmark", ["--tiny", f"--output={output}"],
                        timeout=240)
    assert_ok(result)
    figures = json.loads(output.read_text())

    assert figures["machine"]["cpu_cores"] > 0 and figures["machine"]["tensorflow"]
    assert isinstance(figures["machine"]["gpus"], list)
    for section in SECTIONS:
        assert section in figures, f"no {section} section"
        numbers = list(_numbers(figures[section], section))
        assert numbers, f"{section} has no figures"
        for path, value in numbers:
            assert math.isfinite(value) and value > 0, f"{path} = {value!r}"
    for section, keys in REQUIRED.items():
        rows = figures[section].get("results", [figures[section]])
        assert rows, f"{section} has no results"
        for index, row in enumerate(rows):
            _assert_positive_finite(row, keys, f"{section}[{index}]")
    assert "resnet9" in figures["input_pipeline"]["results"][0]["package_over_training_step"]
    _assert_positive_finite(figures["input_pipeline"]["results"][0]["package_over_training_step"],
                            ["resnet9"], "input_pipeline.package_over_training_step")
    # Only the multi-worker part may be skipped (it needs distributed_mpt.launch).
    _assert_positive_finite(figures["scaling"]["mirrored"], SCALING["mirrored"], "scaling.mirrored")
    multi_worker = figures["scaling"]["multi_worker"]
    if "skipped" in multi_worker:
        assert isinstance(multi_worker["skipped"], str) and multi_worker["skipped"]
    else:
        _assert_positive_finite(multi_worker, SCALING["multi_worker"], "scaling.multi_worker")

    table = result.stdout
    for section in SECTIONS:
        assert section in table, f"the table does not mention {section}:\n{table}"


def test_bad_flag_is_one_line_and_exit_2(tmp_path):
    result = run_module("distributed_mpt.benchmark",
                        ["--models=vgg", f"--output={tmp_path / 'bench.json'}"], timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --models: vgg not one of mlp, resnet9, airbench"]
    assert not (tmp_path / "bench.json").exists()


def test_reference_pipeline_sees_the_same_examples_as_the_package():
    from distributed_mpt import data
    from distributed_mpt.benchmark import pipeline as benchmark

    batch, steps = 32, 20
    split, _ = data.make_synthetic(batch * steps, 1, seed=3)
    epochs = {
        "package": benchmark.package_pipeline(split, batch, seed=3, num_steps=steps),
        "per_example": benchmark.per_example_pipeline(split, batch, seed=3, repeat=False),
    }
    for name, dataset in epochs.items():
        labels = collections.Counter()
        batches = 0
        for images, batch_labels in dataset:
            assert images.dtype.name == "uint8" and images.shape == (batch, 32, 32, 3), name
            labels.update(np.asarray(batch_labels).tolist())
            batches += 1
        assert batches == steps, name
        assert labels == collections.Counter(split.labels.tolist()), name


def test_mixed_precision_speedup_is_against_float32_of_the_same_model_and_batch():
    from distributed_mpt.benchmark.training import _mixed_precision_speedups

    rows = [{"model": "mlp", "batch_size": 32, "precision": p, "package_examples_per_second": r}
            for p, r in (("float32", 100.0), ("mixed_float16", 250.0))]
    rows.append({"model": "mlp", "batch_size": 256, "precision": "mixed_float16",
                 "package_examples_per_second": 900.0})  # no float32 row to compare with
    (speedup,) = _mixed_precision_speedups(rows)
    assert (speedup["batch_size"], speedup["speedup_over_float32"]) == (32, 2.5)
