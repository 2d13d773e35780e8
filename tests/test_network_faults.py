"""Faults between hosts: two workers of the indexed Job, each in a network
namespace of its own, joined by a bridge (tests/netns.py), while they train.

- A slow, lossy link (50 ms each way, 1% loss; tc netem, where the kernel
  has it) and a narrow one (1 Mbit/s each way; tc tbf) slow training and
  lose nothing: the run finishes without a restart.
- A cut link ends both workers with a retryable code (141, a peer lost, or
  142, peers not up) within the documented deadline (docs/clusters.md:
  about 20 s; bounded generously here), each naming the cause in its
  error line, and the group restarted on the restored link resumes from
  the checkpoint and finishes with exactly the requested steps.

The model is airbench at width 4 (about 35 KB of gradients a step; the
MLP's 49 MB would take a lossy link of 100 ms minutes to carry). Needs
root; skipped elsewhere, with the reason.
"""

import json
import re
import time

import pytest

import netns
from distributed_mpt import errors
from k8s_pods import render, training_pods
from netns import TRAIN_STEPS, Groups, checkpointed_step

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

# docs/clusters.md promises an end within about 20 s of a cut (8 s measured
# here); a loaded CI machine gets three times that.
CUT_DEADLINE_SECONDS = 60
RETRYABLE = (errors.EXIT_PEER_LOST, errors.EXIT_PEER_TIMEOUT)


@pytest.fixture
def job(tmp_path):
    """(network, the pods of k8s/indexed-job, groups, model_dir, scratch)."""
    pods = training_pods(render("indexed-job"))
    with netns.Network([pod.names for pod in pods]) as network, Groups() as groups:
        yield network, pods, groups, tmp_path / "data" / "run", tmp_path / "pods"


def wait_for_checkpoint(group, model_dir, after: int = 0, timeout: float = 900) -> int:
    deadline = time.monotonic() + timeout
    while checkpointed_step(model_dir) <= after:
        assert time.monotonic() < deadline and all(p.poll() is None for p in group.processes), \
            f"no checkpoint after step {after}:\n{group.output()}"
        time.sleep(0.1)
    return checkpointed_step(model_dir)


def summary(model_dir) -> dict:
    return json.loads((model_dir / "summary.json").read_text())


@pytest.mark.parametrize("fault", ["latency and loss", "narrow"])
def test_a_slow_link_loses_nothing(job, fault):
    if fault == "latency and loss" and netns.netem_unavailable():
        pytest.skip(netns.netem_unavailable())
    network, pods, groups, model_dir, scratch = job
    group = groups.start(network, pods, model_dir, scratch)
    step = wait_for_checkpoint(group, model_dir)
    if fault == "narrow":
        network.throttle(1, kbit_per_second=1000)
    else:
        network.degrade(1, delay_ms=50, loss_percent=1)
    wait_for_checkpoint(group, model_dir, after=step)  # trains on through it
    network.restore(1)
    assert group.exit_codes(timeout=900) == [0, 0], group.output()
    assert (summary(model_dir)["steps"], summary(model_dir)["resumed_from_step"]) == (TRAIN_STEPS, 0)


def test_a_cut_link_ends_both_workers_retryably_and_the_group_resumes(job):
    network, pods, groups, model_dir, scratch = job
    group = groups.start(network, pods, model_dir, scratch)
    wait_for_checkpoint(group, model_dir)
    network.cut(1)
    cut_at = time.monotonic()
    codes = group.exit_codes(timeout=CUT_DEADLINE_SECONDS)
    ended_after = time.monotonic() - cut_at
    assert all(code in RETRYABLE for code in codes), f"{codes}:\n{group.output()}"
    assert all(pod.retried(code) for pod, code in zip(pods, codes))
    causes = re.findall(r"error: lost a peer of the multi-worker job \(\w+: (.*)\); exiting",
                        group.output())
    assert len(causes) == codes.count(errors.EXIT_PEER_LOST), group.output()
    for cause in causes:  # what TensorFlow says first is no cause
        assert not re.match(r"Graph execution error|\d+ root error", cause), cause
    lost_at = checkpointed_step(model_dir)

    network.restore(1)
    group = groups.start(network, pods, model_dir, scratch)
    assert group.exit_codes(timeout=900) == [0, 0], group.output()
    assert (summary(model_dir)["steps"], summary(model_dir)["resumed_from_step"]) == (TRAIN_STEPS, lost_at)
    print(f"both workers ended {ended_after:.1f} s after the cut, with {codes}")
