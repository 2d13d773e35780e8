"""The startup section: wall time of a 1-step training run, process start to
exit, against that of `import tensorflow`."""

import shutil
import sys
import tempfile
import time

from distributed_mpt.benchmark.measure import interleaved
from distributed_mpt.benchmark.processes import last_line, run_command
from distributed_mpt.benchmark.settings import BenchConfig


def bench_startup(config: BenchConfig) -> dict:
    model, batch = config.models[0], min(config.batch_sizes)

    def timed(command):
        started = time.perf_counter()
        result = run_command(command)
        elapsed = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[1:4])} ...` exited {result.returncode}: "
                               f"{last_line(result.stderr)}")
        return elapsed

    def one_step():
        model_dir = tempfile.mkdtemp(prefix="distributed-mpt-bench-")
        try:
            return timed([sys.executable, "-m", "distributed_mpt.train", "--dataset=synthetic",
                          f"--synthetic_examples={config.train_examples}", f"--model={model}",
                          f"--model_width={config.model_width}",
                          f"--precision={config.precisions[0]}", "--strategy=default",
                          f"--per_replica_batch_size={batch}", "--train_steps=1",
                          "--noevaluate", "--noexport", f"--model_dir={model_dir}"])
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    figures = interleaved({
        "import_tensorflow": lambda: timed([sys.executable, "-c", "import tensorflow"]),
        "one_step_run": one_step}, config.repeats, "startup seconds")
    tf_import, run = figures["import_tensorflow"]["median"], figures["one_step_run"]["median"]
    return {"model": model, "batch_size": batch, "train_examples": config.train_examples,
            "import_tensorflow_seconds": tf_import, "one_step_run_seconds": run,
            "import_share": tf_import / run,
            "runs": {name: f["runs"] for name, f in figures.items()},
            "note": "one_step_run: wall time of `python -m distributed_mpt.train --train_steps=1` "
                    "from process start to exit (import, synthetic data, model, tracing, one "
                    "step, final checkpoint); import_tensorflow: `python -c 'import tensorflow'`."}
