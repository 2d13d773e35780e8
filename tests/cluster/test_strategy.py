"""Strategies from names, and multi-worker training with real worker
processes talking gRPC on 127.0.0.1, started by the real launcher: N workers
equal one with N times the batch, a lost worker or a SIGTERM survived, a
start-up that always ends."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import (REPO, SMALL_MODEL, SMOKE_FLAGS, WatchedProcess, assert_ok,
                      assert_same_weights, checkpoint_weights, read_summary, run_module,
                      subprocess_env, train)
from distributed_mpt.cluster.environment import resolve_cluster
from distributed_mpt.cluster.strategy import peer_named, resolve_strategy_name
from distributed_mpt.errors import ConfigError
from distributed_mpt.launch import free_ports, worker_tf_configs
from distributed_mpt.training.plan import agreement_numbers, values_differing

# Every test here starts several workers: the full suite only (README).
pytestmark = pytest.mark.slow

TWO_WORKERS = resolve_cluster({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, '
                                            '"task": {"type": "worker", "index": 0}}'})
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize("name, cluster, cpu_replicas, expected", [
    ("auto", TWO_WORKERS, 0, "multi_worker"),
    ("auto", None, 2, "mirrored"),
    ("auto", None, 0, "one_device" if HAS_GPU else "default"),
    ("mirrored", None, 0, "mirrored"),
    ("one_device", None, 0, "one_device"),
    ("multi_worker", TWO_WORKERS, 0, "multi_worker"),
])
def test_resolve_strategy_name(name, cluster, cpu_replicas, expected):
    assert resolve_strategy_name(name, cluster, cpu_replicas) == expected


@pytest.mark.parametrize("message, named", [
    ("Collective ops is aborted by: Socket closed\nAdditional GRPC error information from "
     "remote target /job:worker/replica:0/task:0 while calling RecvBuf:", "worker 0"),
    ("Collective ops is aborted by: failed to connect to all addresses; last error: UNKNOWN: "
     "ipv4:127.0.0.1:5901: Failed to connect to remote host: Connection refused", "worker 0"),
    ("... ipv4:127.0.0.1:59015: Connection refused", None),  # another port
    ("... /job:worker/replica:0/task:2 ...", None),  # this worker
    ("... /job:worker/replica:0/task:0 ... /job:worker/replica:0/task:1 ...", None),  # which?
    ("Socket closed", None)])
def test_the_peer_a_failed_collective_names(message, named):
    """Both of these messages came from a chief out of disk (its peer's, in
    test_launch.py): the peer's line names it, as the launcher's prefix does."""
    cluster = resolve_cluster({"TF_CONFIG": json.dumps({
        "cluster": {"worker": ["127.0.0.1:5901", "127.0.0.1:5902", "127.0.0.1:5903"]},
        "task": {"type": "worker", "index": 2}})})
    assert peer_named(tf.errors.UnavailableError(None, None, message), cluster) == named


def test_a_peer_is_named_by_its_whole_address():
    """10.0.0.1:2222 is not named by a message naming 110.0.0.1:2222."""
    cluster = resolve_cluster({"TF_CONFIG": json.dumps({
        "cluster": {"worker": ["10.0.0.1:2222", "110.0.0.1:2222", "10.0.0.3:2222"]},
        "task": {"type": "worker", "index": 2}})})
    message = "failed to connect to all addresses; ipv4:110.0.0.1:2222: Connection refused"
    assert peer_named(tf.errors.UnavailableError(None, None, message), cluster) == "worker 1"


def test_multi_worker_without_a_cluster_says_how_to_get_one():
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        resolve_strategy_name("multi_worker", None, 0)


# --- several workers in real processes -------------------------------------------

# The peer timeout bounds TensorFlow's whole start-up, its import included,
# which takes most of a minute on a loaded machine.
MW_FLAGS = [*SMOKE_FLAGS, "--communication=ring", "--per_replica_batch_size=16",
            "--peer_timeout_seconds=300"]


def launch(args, tmp_path, timeout=300):
    """Runs the launcher; worker temp files go to tmp_path/tmp so that the test can see them."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return run_module("distributed_mpt.launch", [str(a) for a in args], timeout=timeout,
                      env=subprocess_env(TMPDIR=str(tmp_path / "tmp")))


def test_two_workers_train_like_one_worker_with_twice_the_batch(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    result = launch(["--num_workers=2", "--max_restarts=0", "--", *MW_FLAGS, "--train_steps=8",
                     "--precision=float32", f"--model_dir={two}"], tmp_path)
    assert_ok(result)
    assert re.search(r"\[worker 0\] step +8/8", result.stdout)
    assert "[worker 1] step" not in result.stdout, "only the chief reports progress"
    summary = read_summary(two)
    assert (summary["strategy"], summary["num_workers"], summary["num_replicas"]) == ("multi_worker", 2, 2)
    assert summary["global_batch_size"] == 32
    assert summary["eval_examples"] == 1024 // 5, "the test split evaluated once across workers"
    assert summary["eval_accuracy"] > 0.5
    assert not list((tmp_path / "tmp").glob("dmpt-*")), "the non-chief worker removed its scratch files"

    assert_ok(train([*MW_FLAGS, "--train_steps=8", "--precision=float32", "--strategy=default",
                     "--per_replica_batch_size=32", f"--model_dir={one}"]))
    assert read_summary(one)["eval_accuracy"] == pytest.approx(summary["eval_accuracy"], abs=0.01)
    a, b = checkpoint_weights(two), checkpoint_weights(one)
    assert_same_weights(a, b, rtol=1e-4, atol=2e-6)

    # The same checkpoint resumed by one worker: a new global batch, and it says so.
    resumed = train([*MW_FLAGS, "--train_steps=12", "--precision=float32", "--strategy=default",
                     "--noexport", f"--model_dir={two}"])
    assert_ok(resumed)
    assert "trained at global batch 32; continuing at global batch 16" in resumed.stdout
    assert read_summary(two)["resumed_from_step"] == 8


def test_group_survives_a_killed_and_a_stopped_worker_and_finishes_every_step(tmp_path):
    """Two faults in one run, each followed by the launcher's restart: a
    worker killed (SIGKILL; the group resumes from the periodic checkpoint)
    and, in the restarted group, a worker sent SIGTERM (both workers stop at
    the step they agree on and save it; the group resumes from there)."""
    model_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    run = WatchedProcess("distributed_mpt.launch", [
        "--num_workers=2", "--max_restarts=2", "--grace_seconds=5", "--", *MW_FLAGS, *SMALL_MODEL,
        "--train_steps=48", "--steps_per_loop=2", "--log_every_steps=4",
        "--checkpoint_every_steps=10", "--noevaluate", f"--model_dir={model_dir}"],
        env=subprocess_env(TMPDIR=str(tmp_path / "tmp")))
    _, started = run.wait_for(r"started worker 1 \(pid (\d+)\)", timeout=180)
    run.wait_for(r"\[worker 0\] step +12/", timeout=180)
    os.kill(int(started.group(1)), signal.SIGKILL)

    run.wait_for(r"restart 1/2", timeout=180)
    _, killed_at = run.wait_for(r"\[worker 0\] resuming from step (\d+)", timeout=180)
    assert int(killed_at.group(1)) in (10, 20, 30, 40), "from the periodic checkpoint"
    restarted = re.findall(r"started worker 1 \(pid (\d+)\)", run.output())[-1]
    run.wait_for(r"\[worker 0\] step +(2[4-9]|3\d)/", timeout=180)  # only the restarted group gets here
    os.kill(int(restarted), signal.SIGTERM)

    assert run.finish(timeout=300) == 0, run.output()[-4000:]
    output = run.output()
    assert "exited with 137" in output  # 128 + SIGKILL
    assert "exited with 143" in output and "restart 2/2" in output
    # Both workers stopped at the step they agreed on and saved it.
    stopped = re.search(r"stopped by a signal at step (\d+); checkpoint saved", output)
    assert stopped, output[-4000:]
    summary = read_summary(model_dir)
    assert summary["steps"] == 48, "exactly the requested number of optimizer steps"
    assert summary["resumed_from_step"] == int(stopped.group(1)) >= 24
    assert not list((tmp_path / "tmp").glob("dmpt-*")), "no scratch checkpoints left behind"


def test_a_survivor_of_a_lost_peer_exits_141_at_once_and_promises_no_checkpoint(tmp_path):
    """A worker that lost its peer has decided its exit (141) with its error line. The
    SIGTERM that the launcher sends it as it sees the peer die (handled after that line,
    in both of two runs before the fix) was acknowledged after it with "stopping after the
    steps under way, with a checkpoint", which a failed collective cannot keep."""
    (tmp_path / "tmp").mkdir()
    flags = [*MW_FLAGS, "--train_steps=100000", "--log_every_steps=5",
             f"--model_dir={tmp_path / 'run'}"]
    workers = [WatchedProcess("distributed_mpt.train", flags, env=subprocess_env(
        TF_CONFIG=tf_config, TMPDIR=str(tmp_path / "tmp"))) for tf_config in worker_tf_configs(
        free_ports(2))]
    try:
        workers[0].wait_for(r"^step +\d+/", timeout=240)
        # As the launcher does: it sees a worker die, and stops the others at once.
        workers[1].process.kill()
        workers[1].process.wait()
        time.sleep(0.2)  # its poll
        workers[0].process.send_signal(signal.SIGTERM)
        assert workers[0].finish(timeout=120) == 141, workers[0].output()[-3000:]
    finally:
        for worker in workers:  # a failed assertion leaves none running
            worker.process.kill()
            worker.process.wait()
    after = workers[0].output().partition("error: lost a peer")[2]
    assert "with a checkpoint" not in after, after


def test_a_launcher_that_gives_up_exits_with_the_failed_workers_status(tmp_path):
    """--max_restarts=0 and worker 1 killed: the launcher stops the group and
    exits 137, the killed worker's status (the chief's is 141), as its --help
    and docs/clusters.md say."""
    (tmp_path / "tmp").mkdir()
    run = WatchedProcess("distributed_mpt.launch", [
        "--num_workers=2", "--max_restarts=0", "--grace_seconds=5", "--", *MW_FLAGS,
        "--train_steps=100000", "--log_every_steps=5", f"--model_dir={tmp_path / 'run'}"],
        env=subprocess_env(TMPDIR=str(tmp_path / "tmp")))
    try:
        _, started = run.wait_for(r"started worker 1 \(pid (\d+)\)", timeout=60)
        run.wait_for(r"\[worker 0\] step +\d+/", timeout=240)
        os.kill(int(started.group(1)), signal.SIGKILL)
        assert run.finish(timeout=120) == 128 + signal.SIGKILL, run.output()[-3000:]
    finally:
        run.process.kill()
    assert "[launch] worker 1 exited with 137; stopping the group" in run.output()
    assert "[launch] giving up after 0 restart(s)" in run.output()


def test_worker_gives_up_on_peers_that_never_come_up(tmp_path):
    tf_config = json.dumps({"cluster": {"worker": ["127.0.0.1:47611", "127.0.0.1:47612"]},
                            "task": {"type": "worker", "index": 0}})
    started = time.monotonic()
    result = run_module("distributed_mpt.train",
                        [*SMOKE_FLAGS, "--peer_timeout_seconds=5", f"--model_dir={tmp_path / 'run'}"],
                        timeout=120, env=subprocess_env(TF_CONFIG=tf_config))
    assert time.monotonic() - started < 90
    assert result.returncode == -signal.SIGALRM, result.stderr[-3000:]  # 142 in a shell
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "127.0.0.1:47612" in errors[0] and "peer_timeout_seconds" in errors[0]


def _blocks_sigterm(pid: int) -> bool:
    """True while the worker waits for its peers (it blocks SIGTERM then)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_sigterm_to_the_group_ends_a_worker_waiting_for_its_peers(tmp_path):
    tf_config = worker_tf_configs(free_ports(2))[0]  # worker 1 is never started
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS,
         "--peer_timeout_seconds=600", f"--model_dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=subprocess_env(TF_CONFIG=tf_config), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _blocks_sigterm(worker.pid):
            assert worker.poll() is None and time.monotonic() < deadline, "never waited for peers"
            time.sleep(0.1)
        time.sleep(1)  # inside TensorFlow's wait, where its own handler would swallow SIGTERM
        signalled = time.monotonic()
        os.killpg(worker.pid, signal.SIGTERM)  # as the launcher or a terminal does
        _, stderr = worker.communicate(timeout=30)
    finally:
        worker.kill()
    assert time.monotonic() - signalled < 10, "the worker ends within seconds, not at the deadline"
    assert worker.returncode == -signal.SIGKILL, stderr[-3000:]  # 137: retryable
    assert "SIGTERM while TensorFlow started: stopping (nothing trained yet" in stderr


def _refused_together(workers, *says):
    """Every worker exits 2 with one error: line that `says` all of it, no traceback."""
    for worker in workers:
        started = time.monotonic()
        assert worker.finish(timeout=240) == 2, worker.output()[-3000:]
        errors = [line for line in worker.output().splitlines() if line.startswith("error:")]
        print(f"ended {time.monotonic() - started:.0f} s after the worker before: {errors}")
        assert len(errors) == 1 and all(s in errors[0] for s in says), worker.output()[-3000:]
        assert "Traceback" not in worker.output(), worker.output()[-3000:]
    return errors[0]


def _two_workers(differing, env=({}, {})):
    """Two workers of one job, each with the flags MW_FLAGS, `differing` its own."""
    configs = worker_tf_configs(free_ports(2))
    return [WatchedProcess("distributed_mpt.train", [*MW_FLAGS, "--train_steps=16", *flags],
                           env=subprocess_env(TF_CONFIG=config, **extra))
            for flags, config, extra in zip(differing, configs, env)]


def test_workers_that_would_resume_from_different_steps_refuse_together(tmp_path):
    """Without one shared --model_dir, the chief resumes and the other worker
    does not: both say so, instead of calling the collectives differently."""
    assert_ok(train([*MW_FLAGS, "--precision=float32", "--train_steps=8",
                     "--per_replica_batch_size=32", f"--model_dir={tmp_path / 'shared'}"]))
    _refused_together(_two_workers([
        ["--precision=float32", f"--model_dir={tmp_path / name}"]
        for name in ["shared", "elsewhere"]]), "the workers of this job see different runs")


def test_workers_that_restore_other_checkpoints_of_the_same_step_refuse_together(tmp_path):
    """Each worker restored its own --model_dir, both at step 8, with other
    weights: both trained on, exit 0, a model that no run of one state made."""
    for name, batch in [("a", 32), ("b", 16)]:
        assert_ok(train([*MW_FLAGS, "--precision=float32", "--train_steps=8",
                         f"--per_replica_batch_size={batch}", f"--model_dir={tmp_path / name}"]))
    said = _refused_together(_two_workers([
        ["--precision=float32", f"--model_dir={tmp_path / name}"] for name in "ab"]),
        "the workers of this job see different runs (restored weights differ")
    assert "start step 8" in said and "--model_dir on one shared file system" in said


def test_a_worker_that_refuses_its_model_dir_stops_the_others_with_it(tmp_path):
    """The chief refused its --model_dir (a run of another precision): the
    other worker exited 141, 'lost a peer', which a launcher restarts."""
    assert_ok(train([*MW_FLAGS, "--precision=float32", "--train_steps=8",
                     f"--model_dir={tmp_path / 'a'}"]))
    workers = _two_workers([["--precision=mixed_float16", f"--model_dir={tmp_path / name}"]
                            for name in "ab"])
    _refused_together(workers[:1], "holds checkpoints trained with --precision=float32")
    _refused_together(workers[1:], "see different runs (refused --model_dir differ")


@pytest.mark.parametrize("differing, says", [
    # Were: a line blaming the model, and a traceback with 'lost a peer' (141: restarted).
    ([["--model=airbench", "--model_width=4", "--lookahead"], []],
     ["were started with different --", "--model_width", "--lookahead", "--model="]),
    # Were: tracebacks on both (docs/clusters.md promised this line).
    ([["--precision=float32"], ["--precision=mixed_float16"]],
     ["see different runs (resolved precision differ"]),
])
def test_workers_whose_flags_build_other_variables_refuse_together(tmp_path, differing, says):
    _refused_together(_two_workers([[*flags, f"--model_dir={tmp_path / 'run'}"]
                                              for flags in differing]), *says)
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training"


@pytest.mark.parametrize("num_workers", [3, 5, 6, 7])
def test_the_workers_agreement_is_exact_for_any_number_of_workers(num_workers):
    """A MEAN over 3 workers of 0.6 was not 0.6: a 3-worker job with default
    flags refused to start, naming --bn_momentum and --muon_momentum."""
    values = [0.1, 0.6, 0.7, 1e-300, "mlp", True, 3, None]
    for odd_one in [None, *range(len(values))]:
        others = [*values]
        if odd_one is not None:  # the last worker's value differs from the others'
            others[odd_one] = {0.1: 0.1 + 2 ** -56, 3: 3.0}.get(others[odd_one], "other")
        sent = [agreement_numbers(values)] * (num_workers - 1) + [agreement_numbers(others)]
        sums = np.sum(np.array(sent, np.float64), axis=0)
        for mine in sent:  # every worker names the same values
            assert values_differing(mine, sums, num_workers) == [
                i == odd_one for i in range(len(values))], (num_workers, odd_one)


def test_a_worker_of_a_newer_version_with_another_flag_refuses_with_the_others(tmp_path):
    """A worker whose image has one flag more made the agreement itself fail:
    'Shape mismatch ... [57] ... [56]', tracebacks on both. (PYTHONSAFEPATH:
    not the repository's package from the working directory.)"""
    newer = tmp_path / "newer"
    shutil.copytree(REPO / "distributed_mpt", newer / "distributed_mpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    groups = newer / "distributed_mpt" / "core" / "optim" / "groups.py"
    text = groups.read_text()
    assert "    lookahead: bool = option(" in text
    groups.write_text(text.replace("    lookahead: bool = option(", "    gradient_clip: float = "
                                   "option(0.0, 'a newer flag')\n    lookahead: bool = option(", 1))
    _refused_together(_two_workers([[f"--model_dir={tmp_path / 'run'}"]] * 2,
                                   env=({}, {"PYTHONPATH": str(newer), "PYTHONSAFEPATH": "1"})),
                      "the workers of this job run different versions of distributed_mpt")


def _worker_pair(tf_configs, model_dir):
    return [WatchedProcess("distributed_mpt.train", [*MW_FLAGS, f"--model_dir={model_dir}"],
                           env=subprocess_env(TF_CONFIG=json.dumps(config)))
            for config in tf_configs]


def _assert_refused_for_their_cluster(worker):
    assert worker.finish(timeout=180) == 2, worker.output()[-3000:]
    errors = [line for line in worker.output().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in worker.output(), worker.output()[-3000:]
    assert "were started with different cluster descriptions (TF_CONFIG)" in errors[0], errors[0]
    return errors[0]


def test_workers_given_clusters_of_different_sizes_refuse_together(tmp_path):
    """Worker 1's TF_CONFIG listed a third worker: both ended in a
    TensorFlow traceback, exit 1 ("joining a group with size3")."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]  # nobody at the third
    workers = _worker_pair([{"cluster": {"worker": addresses[:2 + index]},
                             "task": {"type": "worker", "index": index}} for index in (0, 1)],
                           tmp_path / "run")
    for worker, mine in zip(workers, ["this worker's: 2 tasks", "this worker's: 3 tasks"]):
        error = _assert_refused_for_their_cluster(worker)
        # In the order TensorFlow met them: which worker joined the group first.
        assert ("one lists 3 tasks, another 2" in error or "one lists 2 tasks, another 3" in error
                ) and mine in error, error


def test_a_worker_unknown_to_the_chiefs_cluster_refuses_in_one_line(tmp_path):
    """The chief's TF_CONFIG says chief + worker, the other's two workers:
    the other ended in a 55-line traceback, exit 1."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    chief, worker = _worker_pair(
        [{"cluster": {"chief": addresses[:1], "worker": addresses[1:]},
          "task": {"type": "chief", "index": 0}},
         {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": 1}}],
        tmp_path / "run")
    try:
        error = _assert_refused_for_their_cluster(worker)
        assert "the first task's does not list /job:worker/replica:0/task:1" in error, error
    finally:
        chief.process.kill()  # it waits for a peer that left: the peer timeout's case
        chief.finish(timeout=30)
