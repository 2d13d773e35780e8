"""The benchmark: what to expect from training on this machine (`python -m
distributed_mpt.benchmark --help`, or cli.py's docstring)."""

import os

# Keeps most of TensorFlow's C++ start-up lines out of the report; the
# cells' processes inherit it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run() -> None:
    """The console script (setup.py), ended at once when done, every output
    written (see `stopping.exit_now`). The command line is imported here, not
    with the package: `python -m distributed_mpt.benchmark.cells` (a cell's
    process) found its module imported already, and Python warned of it."""
    from distributed_mpt import cli
    from distributed_mpt.benchmark.cli import main

    cli.console_script(main)
