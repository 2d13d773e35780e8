"""The scaling model (docs/scaling.md): the ring's fit predicts a worker
count and a size it was not fitted on; the projection prints its table and
its plot; a run above the batch where the linear rule is known to fail says
so; and, in network namespaces (slow, root), the fitted bandwidth and
latency are the link's.

Every figure is printed; the tolerances are a loaded machine's, never a
speed."""

import dataclasses
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest

from conftest import SMOKE_FLAGS, assert_ok, assert_one_error_line, run_module, subprocess_env, train
from distributed_mpt.benchmark import allreduce, cells, scaling
from distributed_mpt.core.optim import schedules
from support import netns

# The fit's sizes (latency to bandwidth), and the size it must predict for
# one worker more. On 2 cores of an AMD EPYC beside 7 other jobs (load 9-17)
# the ring's times moved by up to 1.5x between repeats and sets, and the
# prediction was 1.44x the measurement once (at load 16); the model that
# ignores the worker count (2 workers' time) was 1.6-1.9x off at 16 MiB.
FIT_SIZES = (1024, 64 * 1024, 2**20, 4 * 2**20)
HELD_OUT = 16 * 2**20
TOLERANCE = 2.0
TRIES = 3
needs_netns = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
needs_tun = pytest.mark.skipif(netns.tun_unavailable() is not None, reason=str(netns.tun_unavailable()))


def test_the_ring_fitted_on_two_workers_predicts_three_at_a_size_it_did_not_see():
    # A try measures the fit and the held-out size one right after the other,
    # so both see the same load. A burst of load during one half of a try put
    # a good fit 2.005x off once (fresh-clone CI, Zen 5, 2026-12-06); a model
    # wrong in kind misses every try, so a second and third try are given. A
    # try whose job failed counts too: once a 3-worker job of this test lost a
    # peer ("Socket closed", fresh-clone CI beside other multi-worker tests),
    # which is not what it measures; every try failing still fails it.
    cores = len(os.sched_getaffinity(0))
    ratios, failures = [], []
    while (len(ratios) + len(failures) < TRIES
           and not any(1 / TOLERANCE < r < TOLERANCE for r in ratios)):
        try:
            two = cells.run_cell(allreduce.AllReduce(2, FIT_SIZES, repeats=5))
            three = cells.run_cell(allreduce.AllReduce(3, (HELD_OUT,), repeats=5))
        except RuntimeError as e:
            failures.append(str(e))
            print(f"try {len(ratios) + len(failures)} failed: {e}")
            continue
        latency, per_byte, errors = allreduce.fit([two], cores)
        assert latency > 0 and per_byte > 0
        predicted = allreduce.ring_seconds(latency, per_byte, 3, HELD_OUT, cores)
        measured = allreduce.median_seconds(three["sizes"][0])
        ratios.append(predicted / measured)
        fitted_on = ", ".join(f"{t['bytes']} B {allreduce.median_seconds(t) * 1e3:.2f} ms" for t in two["sizes"])
        print(f"try {len(ratios) + len(failures)}: fit on 2 workers ({fitted_on}): "
              f"{latency * 1e3:.2f} ms a ring step, {1 / per_byte / 1e6:.0f} MB/s a worker, errors "
              f"{errors}; 3 workers at {HELD_OUT} B: predicted {predicted * 1e3:.1f} ms, measured "
              f"{measured * 1e3:.1f} ms (repeats {[round(s * 1e3, 1) for s in three['sizes'][0]['seconds']]})")
    assert any(1 / TOLERANCE < r < TOLERANCE for r in ratios), (ratios, failures)


def test_packs_are_counted_as_tensorflow_groups_gradients():
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_utils

    sizes = [6912, 256, 294912, 512, 4718592, 2048, 9437184, 20480]
    specs = [tf.TensorSpec([size // 4], tf.float32) for size in sizes]
    for bytes_per_pack in (0, 1, 4096, 2**20, 4 * 2**20, 2**30):
        assert allreduce.packs(sizes, bytes_per_pack) == len(
            cross_device_utils.group_by_size(specs, bytes_per_pack)), bytes_per_pack


def test_the_projection_prints_its_table_and_draws_its_plot(tmp_path):
    plot = tmp_path / "scaling.svg"
    result = run_module("distributed_mpt.benchmark.scaling",
                        [f"--svg={plot}", "--params=25557032", "--step_ms=103.6", "--batch=256"])
    assert_ok(result)
    printed, wrote = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert wrote == f"wrote {plot}"
    tables = printed.split("\n\n")
    assert [t.split(" on ")[0] for t in tables] == ["airbench", "resnet9", "25,557,032 parameters"]
    for table in tables:
        rows = [line.split() for line in table.splitlines()[3:]]
        assert [(int(r[0]), int(r[2])) for r in rows] == [
            (n, g) for n in scaling.NODES for g in scaling.DEVICES_PER_NODE]
        assert rows[0][-3:] in (["1.00", "1.00", "1.00"], ["-", "1.00", "1.00"])  # one device
        efficiencies = [float(e) for r in rows for e in r[5:] if re.fullmatch(r"[01]\.\d\d", e)]
        assert efficiencies and all(0 < e <= 1 for e in efficiencies)
    print(tables[1])
    drawn = ElementTree.parse(plot).getroot()
    assert drawn.tag.endswith("svg") and len(drawn.findall("{*}polyline")) == 3 * 3 * 2


def test_the_gradient_counts_are_those_of_the_models_the_package_builds():
    import keras

    from distributed_mpt.core import models
    from distributed_mpt.core.data import cifar10

    for name, sizes in scaling.GRADIENT_TENSORS.items():
        model = models.build_model(models.model_spec(name), cifar10.INFO, 64)
        assert tuple(int(v.numpy().size) * 4 for v in model.trainable_variables) == sizes, name
        assert sum(isinstance(layer, keras.layers.BatchNormalization)
                   for layer in model._flatten_layers(include_self=False)) == scaling.BATCH_NORMS[name]


def test_the_projection_refuses_half_a_model_of_ones_own(tmp_path):
    assert_one_error_line(run_module("distributed_mpt.benchmark.scaling", ["--params=1e6"]),
                          "needs all of --params, --step_ms and --batch")


def test_half_a_model_is_refused_before_the_ring_is_timed(capsys, monkeypatch):
    def measure_and_fit():
        raise AssertionError("the ring was timed (minutes) before the flags were checked")

    monkeypatch.setattr(allreduce, "measure_and_fit", measure_and_fit)
    assert scaling.main(["--measure", "--communication=ring", "--params=1e6"]) == 2
    assert "needs all of --params, --step_ms and --batch" in capsys.readouterr().err


YOURS = {"params": "25557032", "step_ms": "103.6", "batch": "256"}


@pytest.mark.parametrize("flag, value", [("params", "inf"), ("params", "1e400"), ("step_ms", "nan"),
                                         ("learning_rate", "nan"), ("batch", "1" + "0" * 400),
                                         ("batch_norms", "1" + "0" * 400), ("params", "0x10")])
def test_a_number_flag_out_of_its_domain_is_one_error_line(capsys, flag, value):
    """Not an OverflowError, nor tables of nan: the flags parse as every
    entry point's numbers do (cli.define_float, cli.define_integer)."""
    argv = [f"--{name}={given}" for name, given in {**YOURS, flag: value}.items()]
    code = scaling.main(["--models=", *argv])
    out, err = capsys.readouterr()
    print(err)
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out)
    assert err.startswith(f"error: flag --{flag}="), err


def test_a_failed_or_interrupted_measurement_is_one_line(capsys, monkeypatch, tmp_path):
    """--measure times the ring in worker processes (minutes): a worker that
    fails is its reason, Ctrl-C is `interrupted`, without a traceback, and
    the plot is not drawn."""
    plot = tmp_path / "scaling.svg"
    for raised, code, line in ((RuntimeError("AllReduce(2 workers): exited 1: error: OSError: no port"),
                                1, "error: --measure: the ring could not be timed here: AllReduce(2 workers): "
                                   "exited 1: error: OSError: no port"),
                               (KeyboardInterrupt(), scaling.ExitCode.ABORTED, "interrupted: nothing written")):
        def measure_and_fit(raised=raised):
            raise raised
        monkeypatch.setattr(allreduce, "measure_and_fit", measure_and_fit)
        assert scaling.main(["--measure", "--communication=ring", f"--svg={plot}"]) == code
        out, err = capsys.readouterr()
        assert (out, err) == ("", line + "\n") and not plot.exists()


def test_the_plot_of_cpus_draws_a_line_through_every_node_count(tmp_path):
    """CPU nodes have one device each: every row is a point of the plot (it
    kept only the rows of 8 devices a node, none, and drew nothing)."""
    plot = tmp_path / "scaling.svg"
    assert scaling.main(["--device=cpu", "--communication=ring", f"--svg={plot}"]) == 0
    lines = ElementTree.parse(plot).getroot().findall("{*}polyline")
    assert len(lines) == 2 * 3 * 2  # two models, three links, pack and overlap
    for line in lines:
        assert len(line.get("points").split()) == len(scaling.NODES), line.get("points")


def test_the_overlap_what_if_never_beats_compute_and_packing_beats_a_collective_a_tensor():
    work = scaling.Workload("w", 512, 0.016, "test", 26 * 2**20, tuple([2**20] * 26), 41, 0.1)
    for nodes in (2, 64):
        cost = scaling.link("nccl", scaling.DEVICES["A100"], nodes, 8, 25)
        tensor, pack, overlap = (scaling.step_seconds(work, cost, v) for v in scaling.VARIANTS)
        assert work.step < overlap <= pack < tensor, (nodes, tensor, pack, overlap)


@pytest.mark.parametrize("batch, warns", [(128, True), (64, False)])
def test_a_run_warns_once_above_the_batch_where_the_linear_rule_fails(tmp_path, batch, warns):
    # 1,024 synthetic images: 10% is 102 (Keskar et al.'s large batch).
    assert schedules.linear_rule_limit(1024) == 102
    result = train([*SMOKE_FLAGS, f"--per_replica_batch_size={batch}", "--train_steps=2",
                    "--noevaluate", f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    print(warnings)
    assert [("linear learning-rate rule" in w and f"batch of {batch} is above 102" in w)
            for w in warnings] == ([True] if warns else [])


def test_the_rule_at_scale_on_cifar10():
    assert schedules.linear_rule_limit(scaling.CIFAR10_TRAIN_EXAMPLES) == 5000
    assert [scaling.batch_rule(b) for b in (1024, 5000, 5001, 50_000, 50_001)] == [
        "ok", "ok", "warns", "warns", "refused"]
    assert schedules.linear_rule_limit(1_281_167) == schedules.LINEAR_RULE_LIMIT  # ImageNet
    # A folder of 9 images: a batch of 1 was "above 0", advice none could follow.
    assert schedules.linear_rule_limit(9) == 1 and not schedules.linear_rule_warning(1, 9)


# ------------------------------------------ the link-limited regime (netns)

RATE_KBIT = 40_000  # a link far narrower than the ring's loopback rate here (~1 Gb/s)
DELAY_MS = 20


def allreduce_in_pods(network, spec: allreduce.AllReduce) -> dict:
    """`spec` run as worker processes in the first `spec.workers` pods of
    `network`, as cells.run_cell runs them on 127.0.0.1; the chief's timings."""
    from distributed_mpt.process.stopping import helper_command

    addresses = [f"{address}:2222" for address in network.addresses[:spec.workers]]
    command = helper_command(spec.module, type(spec).__name__, json.dumps(dataclasses.asdict(spec)))
    processes = [network.popen(i, command, subprocess_env(TF_CONFIG=json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(spec.workers)]
    try:
        outputs = [p.communicate(timeout=900) for p in processes]
    finally:
        for process in processes:
            process.kill()
    assert all(p.returncode == 0 for p in processes), [err[-2000:] for _, err in outputs]
    return json.loads(outputs[0][0].strip().splitlines()[-1])


@pytest.mark.slow
@needs_netns
def test_over_a_narrow_link_the_fitted_bandwidth_is_the_links():
    sizes = (1024, 256 * 1024, 2**20, 4 * 2**20)
    with netns.Network([["w0"], ["w1"], ["w2"]]) as network:
        for pod in range(3):
            network.throttle(pod, kbit_per_second=RATE_KBIT)
        measured = [allreduce_in_pods(network, allreduce.AllReduce(n, sizes, repeats=3))
                    for n in (2, 3)]
    # Each pod's own link is the bottleneck, not CPUs shared: no contention term.
    latency, per_byte, errors = allreduce.fit(measured, cores=3)
    link_bytes = RATE_KBIT * 1000 / 8
    for result in measured:
        print(f"{result['workers']} workers over {RATE_KBIT / 1000:g} Mbit/s: " + ", ".join(
            f"{t['bytes']} B {allreduce.median_seconds(t) * 1e3:.1f} ms" for t in result["sizes"]))
    print(f"fit: {latency * 1e3:.2f} ms a ring step, {1 / per_byte / 1e6:.2f} MB/s a worker "
          f"({per_byte * link_bytes:.2f}x the link's time a byte); errors {errors}")
    assert 0.9 < per_byte * link_bytes < 2.0  # never faster than the link; gRPC's overhead on top


@pytest.mark.slow
@needs_netns
@needs_tun
def test_over_a_delayed_link_each_all_reduce_waits_its_round_trips():
    sizes = (1024, 16 * 1024)
    seconds = {}
    for delay in (0, DELAY_MS):
        with netns.Network([["w0"], ["w1"]]) as network:
            network.lossy_link(delay_ms=delay, loss=0)
            result = allreduce_in_pods(network, allreduce.AllReduce(2, sizes, repeats=5))
        seconds[delay] = [allreduce.median_seconds(t) for t in result["sizes"]]
    round_trips = [(slow - fast) / (2 * DELAY_MS / 1000) for fast, slow in zip(seconds[0], seconds[DELAY_MS])]
    print(f"2 workers, all-reduce of {sizes} B: {[round(s * 1e3, 1) for s in seconds[0]]} ms "
          f"through the forwarder, {[round(s * 1e3, 1) for s in seconds[DELAY_MS]]} ms with "
          f"{DELAY_MS} ms each way: {[round(r, 2) for r in round_trips]} round trips each")
    assert all(0.9 < r < 6 for r in round_trips)
