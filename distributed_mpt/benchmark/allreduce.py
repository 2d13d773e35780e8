"""All-reduce timed with the package's own MultiWorkerMirroredStrategy
(`cluster/strategy.py`: `create_strategy`): one set of worker processes
times every tensor size, and a model's gradients in packs of each
`bytes_per_pack`, so that TensorFlow's start-up (5-10 s a worker) is paid
once per set.

`cells.run_cell(AllReduce(...))` starts the workers on 127.0.0.1 (as the
launcher does) and returns the chief's timings; each worker is `python -m
distributed_mpt.benchmark.allreduce AllReduce SPEC_JSON` with its TF_CONFIG,
which is also how tests/benchmark/test_scaling.py starts them in network
namespaces. `fit` turns timings into the ring's latency and bandwidth
(docs/scaling.md, section 1).
"""

import dataclasses
import os
import statistics
import time
from typing import Dict, Sequence, Tuple

from distributed_mpt.benchmark import cells

# A timed block is `calls` all-reduces back to back, inside one tf.function
# call, so that a small tensor's time is not the Python call's: as many as
# carry about this many bytes, within these bounds.
BLOCK_BYTES = 4 * 2**20
MAX_CALLS = 64


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """What one set of workers times: float32 tensors of `sizes` bytes each,
    then, if `gradients` (tensor sizes in bytes, a model's), all of them at
    once in packs of each of `bytes_per_pack` (TensorFlow's
    CommunicationOptions; 0: one pack, the package's default). Each is timed
    `repeats` times."""

    workers: int
    sizes: Tuple[int, ...]
    communication: str = "ring"
    repeats: int = 5
    gradients: Tuple[int, ...] = ()
    bytes_per_pack: Tuple[int, ...] = ()

    module = "distributed_mpt.benchmark.allreduce"  # whose process times it (cells.run_cell)

    def describe(self) -> str:
        """The measurement in a few words, for errors."""
        return f"all-reduce over {self.workers} workers ({self.communication})"


def calls_per_block(size: int) -> int:
    """All-reduces per timed block for a tensor of `size` bytes."""
    return max(1, min(MAX_CALLS, BLOCK_BYTES // max(size, 1)))


def packs(tensor_bytes: Sequence[int], bytes_per_pack: int) -> int:
    """How many all-reduces TensorFlow makes of tensors of `tensor_bytes`
    (gradients, in the order it reduces them) with `bytes_per_pack`: its
    rule (cross_device_utils.group_by_size) starts a pack when the last one
    exceeds the hint; 0 is one pack of everything."""
    if bytes_per_pack == 0:
        return 1
    count, last = 0, None
    for size in tensor_bytes:
        if last is None or last > bytes_per_pack:
            count, last = count + 1, 0
        last += size
    return count


def time_in_this_worker(spec: AllReduce) -> dict:
    """In a worker process with TF_CONFIG set: creates the strategy (before
    any other TensorFlow op), then times each size and each packing. Returns
    {"sizes": [{"bytes", "calls", "seconds": per call, per repeat}],
    "packed": [{"bytes_per_pack", "packs", "seconds"}], "workers"}."""
    import tensorflow as tf

    from distributed_mpt.cluster.environment import resolve_cluster
    from distributed_mpt.cluster.strategy import barrier, create_strategy

    strategy = create_strategy("multi_worker", communication=spec.communication, cluster=resolve_cluster())

    def timed(values, calls: int, bytes_per_pack: int = 0) -> list:
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
        context = tf.distribute.get_replica_context

        # MEAN, not SUM: the values stay the same however many calls, and a
        # gradient all-reduce is a sum and a division as well.
        @tf.function(autograph=False)
        def block(values):
            def body(i, values):
                # An identity made on the replica's device: a value from
                # outside has none, and all_reduce needs one to send it to.
                reduced = strategy.run(lambda v: context().all_reduce(
                    "MEAN", tf.nest.map_structure(tf.identity, v), options=options), args=(values,))
                return i + 1, reduced
            return tf.while_loop(lambda i, _: i < calls, body, (tf.constant(0), values))[1]

        all_here = barrier(strategy)  # every worker starts the block together
        block(values)  # traces, and sets up the collective's group
        seconds = []
        for _ in range(spec.repeats):
            all_here().numpy()
            started = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), block(values))
            seconds.append((time.perf_counter() - started) / calls)
        return seconds

    def ones(size: int):
        return tf.ones([max(size // 4, 1)], tf.float32)

    sizes = [{"bytes": size, "calls": calls_per_block(size),
              "seconds": timed(ones(size), calls_per_block(size))} for size in spec.sizes]
    packed = []
    if spec.gradients:
        values = [ones(size) for size in spec.gradients]
        calls = calls_per_block(sum(spec.gradients))
        # TensorFlow reduces the gradients last first (so that those the
        # backward pass makes first go first): count the packs that way.
        ordered = list(reversed(spec.gradients))
        packed = [{"bytes_per_pack": p, "packs": packs(ordered, p), "calls": calls,
                   "seconds": timed(values, calls, p)} for p in spec.bytes_per_pack]
    return {"workers": strategy.num_replicas_in_sync, "sizes": sizes, "packed": packed}


def sweep(workers: Sequence[int], communications: Sequence[str], **spec) -> list:
    """`cells.run_cell` for each number of workers and communication (`spec`:
    the rest of AllReduce), each result with its `workers` and `communication`."""
    return [{**cells.run_cell(AllReduce(n, communication=communication, **spec)),
             "communication": communication}
            for n in workers for communication in communications]


def median_seconds(timing: dict) -> float:
    """The median of a size's or a packing's repeats."""
    return statistics.median(timing["seconds"])


def fit(measurements: Sequence[dict], cores: int) -> Tuple[float, float, Dict[int, Tuple[float, float]]]:
    """The ring's (latency per step, seconds per byte) fitted to the loopback
    `measurements` (allreduce.sweep's), and per worker count the median and
    largest relative error of the fit. The model: 2(n-1) steps of latency,
    and 2(n-1)/n of the bytes per worker, slowed by n/cores when n workers
    share fewer cores (CPU contention, not bandwidth). Least squares on the
    relative error: the times span four decades."""
    import numpy as np

    rows, times, workers = [], [], []
    for result in measurements:
        n = result["workers"]
        for timing in result["sizes"]:
            rows.append(ring_features(n, timing["bytes"], cores))
            times.append(median_seconds(timing))
            workers.append(n)
    rows, times = np.array(rows), np.array(times)
    (latency, per_byte), *_ = np.linalg.lstsq(rows / times[:, None], np.ones(len(times)), rcond=None)
    errors = np.abs(rows @ [latency, per_byte] / times - 1)
    by_workers = {n: (float(np.median(errors[np.array(workers) == n])),
                      float(np.max(errors[np.array(workers) == n]))) for n in sorted(set(workers))}
    return float(latency), float(per_byte), by_workers


def ring_features(workers: int, size: int, cores: int) -> Tuple[float, float]:
    """(latency steps, bytes per worker x contention) of one ring all-reduce."""
    steps = 2 * (workers - 1)
    return steps, steps / workers * size * max(1.0, workers / cores)


def ring_seconds(latency: float, per_byte: float, workers: int, size: int, cores: int) -> float:
    """What the fitted ring predicts for `workers` and `size` bytes."""
    steps, traffic = ring_features(workers, size, cores)
    return steps * latency + traffic * per_byte


def measure_and_fit(workers=(2, 3), repeats: int = 3) -> Tuple[float, float, str]:
    """Times the ring here over loopback (`sweep`: 1 KiB to 64 MiB) and fits
    it; returns the latency per step, the seconds per byte and a report."""
    cores = len(os.sched_getaffinity(0))
    measured = sweep(workers, ["ring"], sizes=tuple(4**k for k in range(5, 14)), repeats=repeats)
    latency, per_byte, errors = fit(measured, cores)
    lines = [f"the ring, measured here over loopback ({cores} cores): median ms per all-reduce"]
    for result in measured:
        lines.append(f"  {result['workers']} workers: " + "  ".join(
            f"{t['bytes'] / 1024:g}K {1e3 * median_seconds(t):.2f}" for t in result["sizes"]))
    lines.append(f"fit: {latency * 1e3:.2f} ms a ring step, {1 / per_byte / 1e6:.0f} MB/s a worker; "
                 f"relative error (median, largest) by workers: " + ", ".join(
                     f"{n}: {m:.0%}, {x:.0%}" for n, (m, x) in errors.items()))
    return latency, per_byte, "\n".join(lines)


if __name__ == "__main__":
    from distributed_mpt.process import stopping
    stopping.exit_now(cells.main([(AllReduce, time_in_this_worker)]))
