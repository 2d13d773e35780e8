"""Cluster discovery from TF_CONFIG, a Kubernetes indexed Job and SLURM."""

import json

import pytest

from distributed_mpt.cluster import resolve_cluster
from distributed_mpt.errors import ClusterError

KUBEFLOW_CHIEF_AND_WORKERS = {
    "cluster": {"chief": ["cifar-chief-0.default.svc:2222"],
                "worker": ["cifar-worker-0.default.svc:2222", "cifar-worker-1.default.svc:2222"]},
    "task": {"type": "worker", "index": 1}, "environment": "cloud"}


def tf_config(config):
    return {"TF_CONFIG": json.dumps(config)}


def test_no_cluster_is_a_single_process():
    assert resolve_cluster({}) is None


def test_kubeflow_chief_and_workers():
    cluster = resolve_cluster(tf_config(KUBEFLOW_CHIEF_AND_WORKERS))
    assert cluster.addresses == ("cifar-chief-0.default.svc:2222", "cifar-worker-0.default.svc:2222",
                                 "cifar-worker-1.default.svc:2222")
    assert cluster.addresses[0] == "cifar-chief-0.default.svc:2222"
    assert (cluster.task_type, cluster.task_index, cluster.is_chief) == ("worker", 1, False)
    assert cluster.own_address == "cifar-worker-1.default.svc:2222"
    chief = dict(KUBEFLOW_CHIEF_AND_WORKERS, task={"type": "chief", "index": 0})
    assert resolve_cluster(tf_config(chief)).is_chief
    worker0 = dict(KUBEFLOW_CHIEF_AND_WORKERS, task={"type": "worker", "index": 0})
    assert not resolve_cluster(tf_config(worker0)).is_chief, "with a chief task, worker 0 is not chief"


def test_workers_only_worker_zero_is_chief():
    workers = ["w-0.svc:2222", "w-1.svc:2222"]
    chiefs = [resolve_cluster(tf_config({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": i}})).is_chief
              for i in range(2)]
    assert chiefs == [True, False]


def test_indexed_job():
    env = {"JOB_COMPLETION_INDEX": "2", "DMPT_NUM_WORKERS": "3", "DMPT_JOB_NAME": "cifar",
           "DMPT_SERVICE_NAME": "cifar-workers"}
    cluster = resolve_cluster(env)
    assert cluster.addresses == tuple(f"cifar-{i}.cifar-workers:2222" for i in range(3))
    assert (cluster.task_index, cluster.is_chief) == (2, False)
    assert resolve_cluster(dict(env, JOB_COMPLETION_INDEX="0", DMPT_PORT="3000")).addresses[0] == \
        "cifar-0.cifar-workers:3000"


def test_tf_config_wins_over_indexed_job():
    env = dict(tf_config({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}),
               JOB_COMPLETION_INDEX="0", DMPT_NUM_WORKERS="5", DMPT_JOB_NAME="j", DMPT_SERVICE_NAME="s")
    assert resolve_cluster(env).addresses == ("a:1", "b:2")


def test_slurm():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
           "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    monkey = pytest.MonkeyPatch()
    for key, value in env.items():
        monkey.setenv(key, value)  # the resolver reads os.environ itself
    try:
        cluster = resolve_cluster(env)
    finally:
        monkey.undo()
    assert cluster.addresses == ("node1:2222", "node2:2222")
    assert (cluster.task_index, cluster.is_chief) == (1, False)


@pytest.mark.parametrize("environ, fragment", [
    ({"TF_CONFIG": "{not json"}, "not valid JSON"),
    (tf_config({"cluster": {"worker": ["a:1"]}}), "no \"task\""),
    (tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}), "out of range"),
    (tf_config({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}), "ps"),
    (tf_config({"cluster": {"master": ["m:1"]}, "task": {"type": "master", "index": 0}}), "master"),
    (tf_config({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}), "more than once"),
    (tf_config({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}), "host:port"),
    (tf_config({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}), "at most one"),
    ({"JOB_COMPLETION_INDEX": "4", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
     "out of range"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2"}, "DMPT_JOB_NAME"),
    # Accepted before, and then ended in a traceback or a retryable timeout.
    (tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": True}}),
     "task index True is out of range"),
    (tf_config({"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}),
     "port 99999, outside 1-65535"),
    (tf_config({"cluster": {"worker": ["a:0"]}, "task": {"type": "worker", "index": 0}}), "port 0"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j",
      "DMPT_SERVICE_NAME": "s", "DMPT_PORT": "70000"}, "port 70000"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc' must be set to an integer"),
])
def test_malformed_cluster_is_one_clear_error(environ, fragment):
    with pytest.raises(ClusterError) as error:
        resolve_cluster(environ)
    assert fragment in str(error.value) and "\n" not in str(error.value)
