"""`python -m distributed_mpt.benchmark`: runs the benchmark (see the package
docstring); the memory section also starts its probes this way."""

from distributed_mpt.benchmark.cli import run

if __name__ == "__main__":
    run()
