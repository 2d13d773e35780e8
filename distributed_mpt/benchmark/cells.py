"""One measurement of the real training loop: a *cell* (model x precision x
global batch x strategy) trained by the package's `Trainer` in a fresh
process, so that its peak memory is its own and a strategy can set up devices
before TensorFlow starts. `run_cell` starts `python -m
distributed_mpt.benchmark.cells KIND CELL_JSON` (one per worker for
multi_worker), which prints the cell's figures as one JSON line. A `roof.Roof`
measurement runs the same way."""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from distributed_mpt import cli, launch  # launch: ports and TF_CONFIGs, made as the launcher does
from distributed_mpt.benchmark import roof
from distributed_mpt.errors import ExitCode, first_line
from distributed_mpt.process.stopping import helper_command

# Steps of the first loop call, which traces the loop: never timed.
WARMUP_STEPS = 2
# Timed steps per loop call when a cell does not fix them: as many as fit in
# `Cell.seconds`, judged from one short call, within these bounds.
MIN_STEPS, MAX_STEPS = 2, 100
CHILD_TIMEOUT_SECONDS = 900
# Timed calls per measurement: 100 of about 2 s (Cell.seconds) take over 3
# minutes, a quarter of the time a cell is given; more would be cut off.
MAX_REPEATS = 100


@dataclasses.dataclass(frozen=True)
class Cell:
    """What one measurement trains, and for how long."""

    model: str
    precision: str
    batch_size: int  # global: split over the replicas
    strategy: str = "default"  # default (one replica), mirrored or multi_worker
    replicas: int = 1  # mirrored: CPU replicas (ignored on GPUs: all of them); multi_worker: workers
    model_width: int = 64
    examples: int = 50_000  # CIFAR-10's train split: a real run's memory
    repeats: int = 3
    seconds: float = 2.0
    steps: int = 0  # timed steps per call; 0: chosen from `seconds`

    def __post_init__(self):
        # Workers must agree on the steps of every call, rather than each
        # judging its own speed.
        if self.strategy == "multi_worker" and not self.steps:
            raise ValueError("a multi_worker cell needs its steps fixed")

    @property
    def workers(self) -> int:
        """The processes of its multi-worker job (cells.run_cell); 0: one, no job."""
        return self.replicas if self.strategy == "multi_worker" else 0

    def describe(self) -> str:
        """The cell in a few words, for progress lines and errors."""
        parallel = f" x{self.replicas}" if self.strategy != "default" else ""
        return f"{self.model} {self.precision} batch {self.batch_size} {self.strategy}{parallel}"


def measure(cell: Cell) -> dict:
    """Trains `cell` in this process with `trainer.Trainer` on its own input
    pipeline: a warm-up call, then `repeats` timed calls of the loop. Returns
    its figures; the peak memory is GPU:0's on GPUs, else this process's."""
    import tensorflow as tf

    from distributed_mpt import config
    from distributed_mpt.cluster.environment import resolve_cluster
    from distributed_mpt.cluster.strategy import create_strategy, peak_resident_bytes
    from distributed_mpt.core import precision
    from distributed_mpt.training.build import build, train_input
    from distributed_mpt.training.plan import plan_run

    gpus = tf.config.list_physical_devices("GPU")
    workers = resolve_cluster() if cell.strategy == "multi_worker" else None
    cpu_replicas = cell.replicas if cell.strategy == "mirrored" and not gpus else 0
    strategy = create_strategy(cell.strategy, cpu_replicas, cluster=workers)
    replicas = strategy.num_replicas_in_sync
    if cell.batch_size % replicas:
        raise ValueError(f"global batch {cell.batch_size} does not split over {replicas} replicas")
    train_config = config.TrainConfig.from_flags(
        # The Trainer writes nothing there; only train_and_evaluate does.
        model_dir=tempfile.gettempdir(), dataset="synthetic", synthetic_examples=cell.examples,
        model=cell.model, model_width=cell.model_width, precision=cell.precision,
        strategy=cell.strategy, cpu_replicas=cpu_replicas,
        per_replica_batch_size=cell.batch_size // replicas,
        train_steps=WARMUP_STEPS + 2 + cell.repeats * (cell.steps or MAX_STEPS),
        evaluate=False, export=False)
    dataset = train_config.data.load(seed=0)
    plan = plan_run(train_config, replicas, workers.num_workers if workers else 1,
                    len(dataset.train))
    precision.set_precision(plan.policy)
    loop = build(train_config, plan, strategy, dataset).trainer
    iterator = iter(train_input(loop, train_config, plan, dataset.train, 0,
                                *plan.input_phase(0)))

    def seconds_of(steps: int) -> float:
        started = time.perf_counter()
        loop.train(iterator, steps)  # returns the totals: the steps are done
        return time.perf_counter() - started

    seconds_of(WARMUP_STEPS)
    steps = cell.steps or min(max(round(cell.seconds * 2 / seconds_of(2)), MIN_STEPS), MAX_STEPS)
    rates = [steps * plan.global_batch_size / seconds_of(steps) for _ in range(cell.repeats)]
    peak = (tf.config.experimental.get_memory_info("GPU:0")["peak"] if gpus
            else peak_resident_bytes())
    return {"examples_per_second": max(rates), "runs": rates, "steps": steps,
            "replicas": replicas, "peak_memory_bytes": peak,
            "training_flops_per_example": roof.TRAINING_FLOPS_PER_FORWARD_FLOP
            * roof.forward_flops(loop.model)}


def run_cell(cell) -> dict:
    """Measures `cell` in fresh processes: one, or its `workers` as a job on
    127.0.0.1. Returns the (chief's) figures; raises RuntimeError naming the
    cell and the failure's last line. A Cell or a roof.Roof runs in this
    module's process; a measurement defined elsewhere names its `module`."""
    # Never a `./distributed_mpt/` of the working directory (helper_command).
    command = helper_command(getattr(cell, "module", "distributed_mpt.benchmark.cells"), type(cell).__name__,
                             json.dumps(dataclasses.asdict(cell)))
    workers = getattr(cell, "workers", 0)
    tf_configs = launch.worker_tf_configs(launch.free_ports(workers)) if workers else [None]
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a child whose pipe fills up would block.
        logs = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                 stack.enter_context(tempfile.TemporaryFile("w+"))) for _ in tf_configs]
        # TensorFlow's C++ log lines off: the failure's last line must be the error.
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        environment.pop("TF_CONFIG", None)  # a cell is its own job, never the caller's
        processes = [subprocess.Popen(command, stdout=out, stderr=err, text=True, env=dict(
            environment, TF_CONFIG=tf_config) if tf_config else environment)
                     for (out, err), tf_config in zip(logs, tf_configs)]
        deadline, stopped_here = time.monotonic() + CHILD_TIMEOUT_SECONDS, set()
        try:  # a worker that fails leaves its peers waiting in a collective: stop all
            while (any(p.poll() is None for p in processes)
                   and not any(p.returncode for p in processes) and time.monotonic() < deadline):
                time.sleep(0.2)
        finally:  # also on Ctrl-C: no child outlives the benchmark
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    stopped_here.add(process)
                process.wait()
        # One that failed on its own, not one stopped here; none: its time ran out.
        failed = [(p.returncode, err) for p, (_, err) in zip(processes, logs)
                  if p.returncode and p not in stopped_here]
        if stopped_here and not failed:
            raise RuntimeError(f"{cell.describe()}: stopped after {CHILD_TIMEOUT_SECONDS} s, "
                               f"its time limit")
        if failed:
            code, err = max(failed, key=lambda f: f[0])
            err.seek(0)
            lines = [line.strip() for line in err.read().splitlines() if line.strip()] or ["?"]
            # A signal's death (the OOM killer's SIGKILL, a SIGSEGV) was told as a time out.
            reason = lines[-1] if code > 0 else _killed_by(-code)
            raise RuntimeError(f"{cell.describe()}: exited {code}: {reason}")
        logs[0][0].seek(0)
        return json.loads(logs[0][0].read().strip().splitlines()[-1])


def _killed_by(number: int) -> str:
    """Why a process that signal `number` ended ended, in words."""
    try:
        name = signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        name = f"signal {number}"
    # The kernel's OOM killer sends SIGKILL, and so does nothing else here.
    return f"killed by {name}" + (" (out of memory?)" if number == signal.SIGKILL else "")


def main(measures=((Cell, measure), (roof.Roof, roof.measure))) -> int:
    """The cell process: measures the cell given as its kind's name and JSON
    (with the function `measures` pairs with its kind), prints its figures;
    returns the exit status."""
    kind, measure_cell = {kind.__name__: (kind, f) for kind, f in measures}[sys.argv[1]]
    cli.libraries_warnings_stay_warnings()
    try:
        figures = measure_cell(kind(**json.loads(sys.argv[2])))
    except Exception as e:  # noqa: BLE001 — any failure is one line for run_cell to report
        print(f"error: {type(e).__name__}: {first_line(e)}", file=sys.stderr, flush=True)
        return ExitCode.CRASHED
    print(json.dumps(figures), flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    from distributed_mpt.process import stopping
    stopping.exit_now(main())  # every output printed: TensorFlow's teardown is skipped
