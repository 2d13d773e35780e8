"""The benchmark: what to expect from training on this machine (`python -m
distributed_mpt.benchmark --help`, or cli.py's docstring)."""

import os

# Keeps most of TensorFlow's C++ start-up lines out of the report; the
# cells' processes inherit it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from distributed_mpt.benchmark.cli import main, run  # noqa: E402

__all__ = ["main", "run"]
