"""The command line: flags, their parsing into a `BenchConfig`, running the
chosen sections (`run_benchmark`), and the entry points `main` and `run`."""

import dataclasses
import json
import os
import subprocess
import sys
import time

from absl import flags

from distributed_mpt import config as config_lib
from distributed_mpt import outputs
from distributed_mpt.benchmark.machine_limit import bench_machine_limit
from distributed_mpt.benchmark.measure import AUTO_STEP_FLOPS, MAX_STEPS, MIN_STEPS, machine_info
from distributed_mpt.benchmark.memory import PROBES, bench_memory, memory_probe
from distributed_mpt.benchmark.pipeline import bench_input_pipeline
from distributed_mpt.benchmark.report import format_table
from distributed_mpt.benchmark.scaling import bench_scaling
from distributed_mpt.benchmark.settings import PIPELINE_IMAGES, SECTIONS, BenchConfig
from distributed_mpt.benchmark.startup import bench_startup
from distributed_mpt.benchmark.training import bench_training
from distributed_mpt.errors import ConfigError, UserError


def _define_flags(fv: flags.FlagValues) -> None:
    d = BenchConfig()
    flags.DEFINE_string("output", None, "Also write the figures as JSON to this path.",
                        flag_values=fv)
    flags.DEFINE_integer("repeats", d.repeats, "Repeats of each measurement; the median is "
                         "reported.", flag_values=fv)
    flags.DEFINE_integer("steps", d.steps, "Timed optimizer steps per training measurement; "
                         f"0: enough for about {AUTO_STEP_FLOPS:.0e} FLOP, "
                         f"{MIN_STEPS} to {MAX_STEPS}.", flag_values=fv)
    flags.DEFINE_list("models", list(d.models), f"Models, of {', '.join(config_lib.MODELS)}. "
                      "memory uses the first, scaling and startup the first too.", flag_values=fv)
    flags.DEFINE_integer("model_width", d.model_width, "Channels of resnet9's first stage.",
                         flag_values=fv)
    flags.DEFINE_list("batch_sizes", [str(b) for b in d.batch_sizes],
                      "Global batch sizes; steps_per_loop=1 and XLA are measured at the "
                      "smallest, memory and scaling at the largest.", flag_values=fv)
    flags.DEFINE_list("precisions", list(d.precisions), "Precision policies, of "
                      f"{', '.join(config_lib.PRECISIONS)}; auto adds mixed_float16 on GPUs of "
                      "compute capability 7.0+, with its speedup over float32.", flag_values=fv)
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
        pipeline_images=2048 if fv["tiny"].value else PIPELINE_IMAGES,
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


def _check_output_writable(path: str) -> None:
    """Fails now, not after ten minutes of measuring, if `path` cannot be written."""
    outputs.check_writable(os.path.dirname(os.path.abspath(path)), flag="--output")


def main(argv=None) -> int:
    """Runs the benchmark from command-line flags; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help", "--helpfull"} & set(argv):
        from distributed_mpt import benchmark  # its docstring is the help

        print(benchmark.__doc__ + "\nFlags:\n" + _flag_values().get_help())
        return 0
    try:
        config, probe = parse_config(argv)
        if probe:
            print(json.dumps(memory_probe(config, probe)), flush=True)
            return 0
        if config.output:
            _check_output_writable(config.output)
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
