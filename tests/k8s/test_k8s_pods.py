"""The pods of every multi-worker variant, run: each rendered pod's container
command starts as a process in a network namespace of its own, under the
pod's hostname, with the environment its controllers give it and the job's
DNS names in its hosts file (tests/support/k8s_pods.py, tests/support/netns.py). The two
workers of every variant train on synthetic data to the end, on ports the
job's NetworkPolicy admits. In one variant a worker is also killed: the exit
codes must be ones the manifest's failure policy retries, and the restarted
group must resume from the checkpoint on the shared volume (here a host
directory) and finish. What differs between variants is what a pod is
given (command, environment, names), which every run exercises; the loss
and the resume are the workers' own, the same under every variant, and
every variant's policy is checked against every exit code offline
(test_k8s.py).

The recipe's flags are overridden the way a user would, by flags appended
to the command: a tiny airbench on synthetic data, on CPUs, for a few steps.
Needs root (network namespaces); skipped elsewhere, with the reason.
"""

import json
import signal
import subprocess
import time
from datetime import datetime

import jsonschema
import pytest

from distributed_mpt import errors
from support import netns
from support.k8s_pods import render, training_job, training_pods
from support.netns import PEER_TIMEOUT_SECONDS, TRAIN_STEPS, Groups, checkpointed_step
from support.status_server import StatusServer, trainer_status_schema

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))]

def listening_ports(network, pod: int) -> set:
    ss = subprocess.run(["ip", "netns", "exec", network.namespaces[pod], "ss", "-Hltn"],
                        capture_output=True, text=True, check=True)
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in ss.stdout.splitlines()}


def admitted_ports(docs) -> set:
    """The TCP ports the job's NetworkPolicy admits between its pods (the
    port range as its first port: a stand-in for the range)."""
    job = training_job(docs)
    (policy,) = [p for p in docs if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == job["metadata"]["name"]]
    return {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}


def _job(variant, tmp_path):
    """The rendered documents of `variant`, its two training pods, the run's
    model_dir (on the shared volume) and the pods' scratch directory."""
    docs = render(variant)
    pods = training_pods(docs)
    assert len(pods) == 2, f"{variant}: the test expects the default 2 workers (k8s/settings)"
    return docs, pods, tmp_path / "data" / "run", tmp_path / "pods"


# The timeouts below only bound a hung run: on a 2-core machine shared with
# other training runs, one group of this test has taken several minutes.
def _wait_for_a_checkpoint(network, pods, docs, group, model_dir) -> None:
    """Waits for the run's first checkpoint, then checks that what each pod
    serves on is a port its NetworkPolicy admits."""
    deadline = time.monotonic() + 900
    while checkpointed_step(model_dir) == 0:
        assert time.monotonic() < deadline and all(p.poll() is None for p in group.processes), \
            f"no checkpoint:\n{group.output()}"
        time.sleep(0.1)
    for i in range(len(pods)):
        assert listening_ports(network, i) & admitted_ports(docs), f"{pods[i].hostname}:\n{group.output()}"


def assert_a_clean_end(output: str) -> None:
    """A job that succeeded logs no abort or crash: workers leave together,
    after the chief's export (training/plan.py)."""
    for word in ("StartAbort", "crashed", "unhealthy"):
        assert word not in output, output


def _finished(model_dir) -> dict:
    summary = json.loads((model_dir / "summary.json").read_text())
    assert (summary["num_workers"], summary["steps"]) == (2, TRAIN_STEPS)
    assert summary["eval_accuracy"] > 0.5
    return summary


@pytest.mark.parametrize("variant", ["indexed-job", "trainjob"])
def test_pods_train_to_the_end_on_admitted_ports(variant, tmp_path):
    docs, pods, model_dir, scratch = _job(variant, tmp_path)
    (tmp_path / "controller").mkdir()
    with netns.Network([pod.names for pod in pods]) as network, Groups() as groups, \
            StatusServer(network.host_address(), tmp_path / "controller") as status:
        if variant == "trainjob":  # what Trainer v2's controller injects into its pods
            for pod in pods:
                pod.env.update(status.env)
        group = groups.start(network, pods, model_dir, scratch)
        _wait_for_a_checkpoint(network, pods, docs, group, model_dir)
        assert group.exit_codes(timeout=900) == [0, 0], group.output()
        assert "warning: TrainJob progress" not in group.output()
        assert_a_clean_end(group.own_output())
    assert _finished(model_dir)["resumed_from_step"] == 0
    if variant == "trainjob":
        _assert_progress_reports(status.requests)
    else:
        assert not status.requests, "no report where the controller offered no endpoint"


def _assert_progress_reports(requests):
    """The chief's reports, in the API's own schema, at most every 5 s, the
    last at 100%."""
    assert requests, "the chief reported its progress"
    schema = trainer_status_schema()
    for _, headers, body in requests:
        assert headers["Authorization"] == f"Bearer {StatusServer.TOKEN}"
        report = json.loads(body)
        assert list(report) == ["trainerStatus"]
        jsonschema.validate(report["trainerStatus"], schema)
        datetime.fromisoformat(report["trainerStatus"]["lastUpdatedTime"].replace("Z", "+00:00"))
    arrivals = [arrival for arrival, _, _ in requests]
    assert all(b - a >= 4.5 for a, b in zip(arrivals, arrivals[1:])), arrivals
    last = json.loads(requests[-1][2])["trainerStatus"]
    assert last["progressPercentage"] == 100
    names = {m["name"] for m in last["metrics"]}
    assert {"eval_loss", "eval_accuracy"} <= names or {"loss", "accuracy"} <= names, names


def test_pods_train_survive_a_lost_worker_and_resume(tmp_path):
    variant = "jobset"  # the one k8s/README.md walks through
    docs, pods, model_dir, scratch = _job(variant, tmp_path)
    with netns.Network([pod.names for pod in pods]) as network, Groups() as groups:
        # A worker is lost once the run has a checkpoint to resume from.
        group = groups.start(network, pods, model_dir, scratch)
        _wait_for_a_checkpoint(network, pods, docs, group, model_dir)
        group.processes[1].send_signal(signal.SIGKILL)
        codes = group.exit_codes(timeout=PEER_TIMEOUT_SECONDS + 60)
        assert codes[1] == 128 + signal.SIGKILL
        assert codes[0] in (errors.ExitCode.PEER_LOST, errors.ExitCode.PEER_TIMEOUT), group.output()
        assert all(pod.retried(code) for pod, code in zip(pods, codes)), \
            f"exit codes {codes} are not retried by the {variant} failure policy"
        lost_at = checkpointed_step(model_dir)
        assert 0 < lost_at < TRAIN_STEPS, "the run ended before a worker was lost"

        # The controller's restart: the same pods, the same shared volume.
        group = groups.start(network, pods, model_dir, scratch)
        assert group.exit_codes(timeout=900) == [0, 0], group.output()
        assert_a_clean_end(group.own_output())
    assert _finished(model_dir)["resumed_from_step"] == lost_at
