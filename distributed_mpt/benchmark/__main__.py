"""`python -m distributed_mpt.benchmark`: the benchmark (see the package docstring)."""

from distributed_mpt.benchmark import run

if __name__ == "__main__":
    run()
