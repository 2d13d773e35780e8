"""The sections: what each measures and the figures it reports (`SECTIONS`,
the one place that names them; the report and the tests read it), how each
is measured, and the report.

Every training figure comes from cells (`cells.py`), measured once each and
shared: the mixed-precision speedup, the input pipeline's headroom, the
fraction of the compute roof and the scaling efficiency are ratios of cells
the training section also reports.
"""

import dataclasses
import itertools
import os
import platform
import sys
import textwrap
import time
from typing import Dict, Optional, Tuple

from distributed_mpt.benchmark.cells import Cell, run_cell
from distributed_mpt.benchmark.roof import Roof, best_rate
from distributed_mpt.errors import first_line


@dataclasses.dataclass(frozen=True)
class Section:
    """A section: what it tells a user, the columns that name a row, and its
    figures with their units (ex/s, img/s, FLOP/s, B for bytes, x for a ratio)."""

    about: str
    keys: Tuple[str, ...]
    figures: Dict[str, str]


SECTIONS = {
    "roof": Section(
        "the compute roof: FLOP/s of a large matmul and of 3x3 convolutions at a CIFAR "
        "network's sizes, timed alone, in each compute dtype of --precisions; the best of a "
        "dtype is its roof",
        ("precision", "kernel"), {"flops_per_second": "FLOP/s"}),
    "training": Section(
        "examples/s of the training loop (the package's Trainer, one replica) and the peak "
        "memory of its process (of GPU:0 on GPUs), per model x precision x global batch",
        ("model", "precision", "batch_size", "strategy"),
        {"examples_per_second": "ex/s", "peak_memory_bytes": "B"}),
    "mixed_precision": Section(
        "examples/s under mixed precision over float32, same model and batch: mixed_float16 "
        "on GPUs, mixed_bfloat16 on CPUs (emulated, so below 1, without AVX512_BF16 or AMX); "
        "measured when --precisions has it",
        ("model", "precision", "batch_size"), {"speedup_over_float32": "x"}),
    "compute": Section(
        "FLOP/s the training step reaches (the model's convolution and dense FLOPs, forward "
        "+ backward = 3x forward, times its examples/s), and its fraction of the roof of its "
        "compute dtype",
        ("model", "precision", "batch_size"),
        {"flops_per_second": "FLOP/s", "fraction_of_roof": "x"}),
    "input_pipeline": Section(
        "images/s the input pipeline delivers alone, and how many times what the training "
        "step consumes (headroom); below 1 the input is the bottleneck",
        ("model", "precision", "batch_size"), {"images_per_second": "img/s", "headroom": "x"}),
    "scaling": Section(
        "examples/s with the global batch split over replicas (mirrored: every GPU, or 2 CPU "
        "replicas) or local workers (multi_worker), and efficiency over one replica at the "
        "same global batch; on one host the parts share its cores",
        ("model", "precision", "batch_size", "strategy", "replicas"),
        {"examples_per_second": "ex/s", "efficiency": "x"}),
}


@dataclasses.dataclass(frozen=True)
class BenchmarkOptions:
    """What to measure; set from the flags by `cli.parse_options`."""

    output: Optional[str] = None
    sections: tuple = tuple(SECTIONS)
    models: tuple = ("mlp", "resnet9")
    batch_sizes: tuple = (32, 256)
    # Not mixed: emulated on CPUs without bfloat16 instructions, for minutes a cell.
    precisions: tuple = ("float32", "auto")
    model_width: int = Cell.model_width
    repeats: int = Cell.repeats
    seconds: float = Cell.seconds  # per timed loop call
    examples: int = Cell.examples
    roof_batch_size: int = Roof.batch_size


class Benchmark:
    """Runs sections for `options`, measuring each cell once."""

    def __init__(self, options: BenchmarkOptions):
        import tensorflow as tf

        from distributed_mpt.core import precision

        self.options = options
        gpus = len(tf.config.list_physical_devices("GPU"))
        self.mixed_policy = "mixed_float16" if gpus else "mixed_bfloat16"
        self.auto_policy = precision.resolve_precision("auto")
        self._auto_reason = precision.describe_precision_choice("auto")  # "float32: this CPU ..."
        named = {"mixed": self.mixed_policy, "auto": self.auto_policy}
        self.precisions = tuple(dict.fromkeys(named.get(p, p) for p in options.precisions))
        self.replicas = gpus if gpus > 1 else 2
        self._cells = {}

    def cell(self, model: str, precision: str, batch_size: int, **parallel) -> dict:
        """The figures of one cell; a failure is kept and raised again to
        every section that needs the cell."""
        o = self.options
        return self._measured(Cell(model, precision, batch_size, model_width=o.model_width,
                                   examples=o.examples, repeats=o.repeats, seconds=o.seconds,
                                   **parallel))

    def roof_rows(self, dtype: str) -> list:
        """The roof's kernels in compute dtype `dtype`, measured once."""
        o = self.options
        # Half a training call's window: a lone kernel settles at once.
        return self._measured(Roof(dtype, o.roof_batch_size, o.repeats, o.seconds / 2))["rows"]

    def _measured(self, cell) -> dict:
        if cell not in self._cells:
            try:
                figures = self._cells[cell] = run_cell(cell)
                _progress(f"{cell.describe()}: " + (
                    f"{figures['examples_per_second']:,.1f} ex/s" if "rows" not in figures else
                    f"{max(r['flops_per_second'] for r in figures['rows']) / 1e9:,.1f} GFLOP/s"))
            except Exception as e:  # noqa: BLE001 — reported by the sections that need it
                self._cells[cell] = e
        if isinstance(self._cells[cell], Exception):
            raise self._cells[cell]
        return self._cells[cell]

    def grid(self):
        """(model, precision, batch) of every single-replica cell; the
        precisions of a model and batch one after another, so that the load
        of a shared machine changes little between the two of a speedup."""
        return ((model, policy, batch) for model, batch, policy in itertools.product(
            self.options.models, self.options.batch_sizes, self.precisions))

    def roof(self) -> list:
        """Every kernel in the compute dtype of each precision."""
        dtypes = dict.fromkeys(map(_compute_dtype, self.precisions))
        return [{"precision": dtype, **row} for dtype in dtypes for row in self.roof_rows(dtype)]

    def training(self) -> list:
        """The training section's rows: every cell of the grid."""
        return [{"model": m, "precision": p, "batch_size": b, "strategy": "default",
                 **self.cell(m, p, b)} for m, p, b in self.grid()]

    def mixed_precision(self) -> list:
        """Per model and batch, when --precisions has the mixed policy: on a
        CPU without bfloat16 instructions the default measures none (there
        its emulated cells take many minutes each, for a figure below 1)."""
        if self.mixed_policy not in self.precisions:
            raise NotMeasured(f"--precisions has no {self.mixed_policy} (auto here: "
                              f"{self._auto_reason}); --precisions=float32,mixed measures it")
        rows = []
        for model, batch in itertools.product(self.options.models, self.options.batch_sizes):
            float32 = self.cell(model, "float32", batch)["examples_per_second"]
            mixed = self.cell(model, self.mixed_policy, batch)["examples_per_second"]
            rows.append({"model": model, "precision": self.mixed_policy, "batch_size": batch,
                         "speedup_over_float32": mixed / float32})
        return rows

    def compute(self) -> list:
        """Every cell of the grid against the roof of its compute dtype."""
        rows = []
        for model, policy, batch in self.grid():
            figures = self.cell(model, policy, batch)
            flops = figures["examples_per_second"] * figures["training_flops_per_example"]
            roof = max(r["flops_per_second"] for r in self.roof_rows(_compute_dtype(policy)))
            rows.append({"model": model, "precision": policy, "batch_size": batch,
                         "flops_per_second": flops, "fraction_of_roof": flops / roof})
        return rows

    def input_pipeline(self) -> list:
        """The pipeline's rate per batch over each cell of the grid."""
        delivered = {b: pipeline_images_per_second(b, self.options)
                     for b in self.options.batch_sizes}
        return [{"model": m, "precision": p, "batch_size": b, "images_per_second": delivered[b],
                 "headroom": delivered[b] / self.cell(m, p, b)["examples_per_second"]}
                for m, p, b in self.grid()]

    def scaling(self) -> list:
        """At the largest batch and the first precision, for every model."""
        batch, policy, rows = max(self.options.batch_sizes), self.precisions[0], []
        for model in self.options.models:
            # One replica again, just before the others and with the same
            # steps per call: the same work, timed under the same load.
            steps = self.cell(model, policy, batch)["steps"]
            one = self.cell(model, policy, batch, steps=steps)
            for strategy, parts in (("mirrored", self.replicas), ("multi_worker", 2)):
                many = self.cell(model, policy, batch, strategy=strategy, replicas=parts,
                                 steps=steps)
                rows.append({"model": model, "precision": policy, "batch_size": batch,
                             "strategy": strategy, "replicas": many["replicas"],
                             "examples_per_second": many["examples_per_second"],
                             "efficiency": many["examples_per_second"] / one["examples_per_second"]})
        return rows


class NotMeasured(Exception):
    """A section that the options leave nothing to measure; why, in one line."""


def _compute_dtype(policy: str) -> str:
    import keras

    return keras.DTypePolicy(policy).compute_dtype


def pipeline_images_per_second(batch_size: int, options: BenchmarkOptions) -> float:
    """Images/s of the trainer's input pipeline (`pipeline.train_input_fn`, one
    host) with nothing consuming them: the best of `repeats` windows."""
    import tensorflow as tf

    from distributed_mpt.core import data, pipeline

    split = data.DataOptions("synthetic", synthetic_examples=options.examples).load(
        seed=0, splits=("train",)).train
    batches = iter(pipeline.train_input_fn(split, batch_size, 0, 0, 10**9)(
        tf.distribute.InputContext()))
    next(batches)  # builds the pipeline
    return best_rate(lambda: next(batches), batch_size, options.repeats, options.seconds)


def run_benchmark(options: BenchmarkOptions) -> dict:
    """Runs the chosen sections; a section that fails is recorded as
    {"failed": reason}, and the others still run."""
    import keras
    import tensorflow as tf

    from distributed_mpt.cluster.strategy import describe_devices

    started = time.perf_counter()
    benchmark = Benchmark(options)
    results = {"machine": {"devices": describe_devices(),
                           "mixed_policy": benchmark.mixed_policy,
                           "auto_policy": benchmark.auto_policy, "tensorflow": tf.__version__,
                           "keras": keras.__version__, "python": platform.python_version(),
                           # Which CPU kernels ran (distributed_mpt/__init__.py).
                           "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")},
               "options": dataclasses.asdict(options), "sections": {}}
    for name in (name for name in SECTIONS if name in options.sections):  # SECTIONS' order
        _progress(f"[{name}]")
        section_started = time.perf_counter()
        try:
            section = {"rows": getattr(benchmark, name)()}
        except NotMeasured as e:
            section = {"not_measured": str(e)}
        except Exception as e:  # noqa: BLE001 — one broken section must not lose the others
            section = {"failed": first_line(e, limit=1000)}
        results["sections"][name] = {**section, "seconds": time.perf_counter() - section_started}
    results["seconds"] = time.perf_counter() - started
    return results


def _format(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 2**20:,.0f} MiB"
    if unit == "FLOP/s":
        return f"{value / 1e9:,.1f} G"
    return f"{value:.2f}x" if unit == "x" else f"{value:,.1f}"


def format_report(results: dict) -> str:
    """One table per section; FAILED and the reason for a section that failed."""
    machine = results["machine"]
    lines = [f"{machine['devices']}; TensorFlow {machine['tensorflow']}; "
             f"TF_ENABLE_ONEDNN_OPTS={machine['tf_enable_onednn_opts']}"]
    for name, section in results["sections"].items():
        spec = SECTIONS[name]
        lines += ["", *textwrap.wrap(f"{name}: {spec.about}", 100)]
        if "failed" in section:
            lines.append(f"  FAILED: {section['failed']}")
            continue
        if "not_measured" in section:
            lines.append(f"  not measured: {section['not_measured']}")
            continue
        header = [*spec.keys, *(f"{f} ({u})" for f, u in spec.figures.items())]
        table = [header] + [[str(row[k]) for k in spec.keys] +
                            [_format(row[f], u) for f, u in spec.figures.items()]
                            for row in section["rows"]]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in table]
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)
