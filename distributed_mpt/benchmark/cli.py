"""What to expect from training on this machine, measured with the package's
own training loop and input pipeline on CIFAR-shaped synthetic data (no
network): the machine's compute roof per precision, examples/s per model x
precision x batch x strategy, peak memory, the speedup mixed precision gives,
the fraction of the roof training reaches, whether the input pipeline keeps
up, and how training scales over replicas and workers.

Each measurement trains in a fresh process, so that its peak memory is its
own: a warm-up call of the loop, then --repeats timed calls of about 2 s, of
which the fastest is reported; the roof of each precision is timed the same
way, in a process of its own (the least disturbed by other processes, as
timeit reports). A section that fails is reported as FAILED with its reason,
the others still run, and the exit status is 1.

  Everything, in float32 and the precision training picks here (10 minutes
  on 2 cores of an AVX2-only AMD EPYC, docs/performance.md):
      distributed-mpt-benchmark --output=bench.json
  One model and batch:
      distributed-mpt-benchmark --models=resnet9 --batch_sizes=128
  How close the CPU recipe's training comes to the roof, in the precision
  training picks here:
      distributed-mpt-benchmark --models=airbench --batch_sizes=512 \\
          --precisions=auto --sections=roof,compute
  A smoke run, for tests:
      distributed-mpt-benchmark --tiny --output=/tmp/bench.json
"""
# This module: the command line: flags into `BenchmarkOptions`, the run, the report,
# the JSON file and the exit status (0; 1 if a section failed; 2 for bad flags).

import contextlib
import errno
import os
import sys
import textwrap
from typing import Optional

from absl import flags

from distributed_mpt import cli, files
from distributed_mpt import config as config_lib
from distributed_mpt.benchmark.cells import MAX_REPEATS
from distributed_mpt.benchmark.sections import (SECTIONS, BenchmarkOptions, format_report,
                                                run_benchmark)
from distributed_mpt.core import models
from distributed_mpt.errors import ConfigError, ExitCode, UserError, quoted, too_long_to_open
from distributed_mpt.process import log_filter

# What --tiny sets, unless a flag says otherwise: a smoke run for tests.
# Every section measured, the mixed policy included (emulated, but small).
_TINY = dict(models=("mlp",), batch_sizes=(32,), precisions=("float32", "mixed"), model_width=8,
             repeats=1, seconds=0.05, examples=1024, roof_batch_size=8)
_PRECISIONS = ("float32", "auto", "mixed", "mixed_float16", "mixed_bfloat16")


def _flag_values() -> flags.FlagValues:
    fv, d = flags.FlagValues(), BenchmarkOptions()
    flags.DEFINE_string("output", None, "Also write every figure as JSON to this file (in an "
                        "existing directory).", flag_values=fv)
    # Checked before any measuring, not found after it.
    flags.register_validator("output", _regular_file_or_absent, flag_values=fv)
    flags.register_validator(
        "output", lambda path: path is None or os.path.isdir(
            os.path.dirname(os.path.abspath(config_lib.user_path(path)))),
        "is in a directory that does not exist; create it first", flag_values=fv)
    flags.DEFINE_list("sections", list(d.sections), f"Of {', '.join(SECTIONS)}.", flag_values=fv)
    flags.DEFINE_list("models", list(d.models), f"Of {', '.join(models.MODELS)}.",
                      flag_values=fv)
    flags.DEFINE_list("batch_sizes", [str(b) for b in d.batch_sizes], "Global batch sizes; "
                      "scaling uses the largest.", flag_values=fv)
    flags.DEFINE_list("precisions", list(d.precisions), f"Of {', '.join(_PRECISIONS)}; auto: "
                      "what training's --precision=auto picks here (float32 on CPUs without "
                      "bfloat16 instructions); mixed: mixed_float16 on GPUs, mixed_bfloat16 on "
                      "CPUs, emulated on those. scaling uses the first.", flag_values=fv)
    cli.define_integer(fv, "model_width", d.model_width, "Channels of the first stage of "
                       "resnet9 or airbench.", lower=1, upper=1024)
    cli.define_integer(fv, "repeats", d.repeats, "Timed loop calls per measurement (about "
                       f"{d.seconds:g} s each); the fastest is reported.", lower=1,
                       upper=MAX_REPEATS)
    flags.DEFINE_bool("tiny", False, "A smoke run for tests: the MLP of "
                      "width 8, batch 32, one short repeat, a 1,024-image split (flags given "
                      "explicitly still win).", flag_values=fv)
    return fv


def output_kind(path: str) -> Optional[str]:
    """What `path` is, in words, when it is there and neither a regular file
    nor a link to one: the JSON is renamed over the file, which would put a
    regular file in place of a device node (as root, --output=/dev/null would
    replace the system's), a FIFO or a socket; or this program's standard
    output or error, even where that is a regular file."""
    if not os.path.lexists(path):
        return None
    if files.is_regular_file(path):
        # --output=/dev/stdout with `>> run.log`: renamed over the log, it
        # would take the log's earlier lines, and the report after it.
        target = os.stat(path)
        for name, stream in (("standard output", sys.stdout), ("standard error", sys.stderr)):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                opened = os.fstat(stream.fileno())
                if (opened.st_dev, opened.st_ino) == (target.st_dev, target.st_ino):
                    return f"this program's {name}"
        return None
    return files.kind_of(os.path.realpath(path) if os.path.exists(path) else path)


def _regular_file_or_absent(path: Optional[str]) -> bool:
    kind = path and output_kind(config_lib.user_path(path))
    if kind and kind.startswith("this program's"):
        raise flags.ValidationError(f"is {kind}, which the report goes to: name a file of its "
                                    f"own for the JSON")
    if kind:
        raise flags.ValidationError(f"is {kind}, not a regular file: name a file to write")
    return True


def parse_options(fv: flags.FlagValues, argv) -> BenchmarkOptions:
    """Flags (without the program name) into BenchmarkOptions; raises ConfigError."""
    cli.parse("distributed-mpt-benchmark", fv, argv)
    cli.check_path_flags(fv, "output")
    if not all(cli.is_decimal_integer(b) for b in fv.batch_sizes):  # not `0x10`, `1_000`
        raise ConfigError(f"--batch_sizes={quoted(','.join(fv.batch_sizes))} must be whole "
                          f"numbers in decimal digits")
    # Once each: a value given twice measured and reported its rows twice.
    batch_sizes = tuple(dict.fromkeys(int(b) for b in fv.batch_sizes))
    given = dict(output=config_lib.user_path(fv.output), model_width=fv.model_width,
                 repeats=fv.repeats, batch_sizes=batch_sizes,
                 **{name: tuple(dict.fromkeys(fv[name].value))
                    for name in ("sections", "models", "precisions")})
    if fv.tiny:
        given.update({k: v for k, v in _TINY.items() if k not in fv or not fv[k].present})
    options = BenchmarkOptions(**given)
    for name, choices in (("sections", SECTIONS), ("models", models.MODELS),
                          ("precisions", _PRECISIONS)):
        values = getattr(options, name)
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise ConfigError(f"--{name}: {', '.join(bad) or 'nothing'} given; choose from "
                              f"{', '.join(choices)}")
    if not (batch_sizes and all(0 < b <= options.examples for b in batch_sizes)):
        raise ConfigError(f"--batch_sizes={','.join(fv.batch_sizes)} must be in "
                          f"1..{options.examples}")
    return options


def main(argv=None) -> int:
    """Runs the benchmark from command-line flags; returns the exit status."""
    about = "\n".join(textwrap.fill(f"{name}: {s.about}.", 79, initial_indent="  ",
                                    subsequent_indent="      ") for name, s in SECTIONS.items())
    return cli.run_main(f"{__doc__}\nSections:\n{about}\n", _flag_values(), _measure, argv,
                        on_interrupt="nothing written")


def _measure(fv: flags.FlagValues, argv) -> int:
    """Parses `argv` into `fv`, measures, prints the report and writes --output."""
    options = parse_options(fv, argv)
    if options.output:  # now, not after minutes of measuring (it exists: a validator said so)
        files.check_writable(os.path.dirname(os.path.realpath(options.output)), "--output")
        _check_name(options.output)
    with log_filter.filtering():  # TensorFlow's C++ start-up lines, off the report
        results = run_benchmark(options)
    # The file first: the report's console may fail (console.py), the file must not.
    unwritten = options.output and _write(options.output, results)
    try:
        print(format_report(results), flush=True)
        if unwritten:
            print(f"error: {unwritten}", file=sys.stderr, flush=True)
            return ExitCode.USAGE
        if options.output:
            print(f"wrote {options.output}", flush=True)
        failed = {name: s["failed"] for name, s in results["sections"].items() if "failed" in s}
        for name, reason in failed.items():
            print(f"error: section {name} FAILED: {reason}", file=sys.stderr)
        return ExitCode.CRASHED if failed else ExitCode.OK
    except KeyboardInterrupt as stop:  # a stop now: main's "nothing written" is no longer so
        if not options.output or unwritten:
            raise
        return cli.interrupted(stop, f"wrote {options.output}")


def _check_name(output: str) -> None:
    """Raises ConfigError if the file system refuses the name --output gives
    (too long, a loop of links): found by the write, it came after minutes
    of measuring, whose figures were then only on the console."""
    try:
        os.lstat(output)
    except FileNotFoundError:  # to be written: its folder is there and writable
        return
    except OSError as e:
        shown = too_long_to_open(output) if e.errno == errno.ENAMETOOLONG else quoted(output)
        raise ConfigError(f"--output={shown} cannot be written ({e.strerror}): name another "
                          f"file") from None


def _write(output: str, results: dict) -> Optional[str]:
    """Writes `results` to --output; None, or why it could not (the error line)."""
    kind = output_kind(output)
    if kind:  # it became one while we measured: left as it is
        return f"--output={output} is now {kind}: not replaced; the report above is all there is"
    try:  # a link's target: the file it names is replaced, and the link stays a link
        files.write_json(os.path.realpath(output), results)
    except OSError as e:  # the disk filled, or the directory went, while it measured
        return f"cannot write --output={output} ({e.strerror}): the report above is all there is"
    except UserError as e:  # it became a link to a link that is no file, meanwhile
        return f"{e}; the report above is all there is"
    return None
