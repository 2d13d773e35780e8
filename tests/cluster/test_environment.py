"""Cluster discovery from TF_CONFIG, JobSet (and Trainer v2), a Kubernetes
indexed Job and SLURM, and the one-line refusal of every malformed value."""

import json
import os
import time

import pytest

from distributed_mpt.cluster.environment import MAX_TASKS, resolve_cluster
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
    assert (cluster.task_type, cluster.task_index, cluster.is_chief) == ("worker", 1, False)
    assert cluster.own_address == "cifar-worker-1.default.svc:2222"
    chief = dict(KUBEFLOW_CHIEF_AND_WORKERS, task={"type": "chief", "index": 0})
    assert resolve_cluster(tf_config(chief)).is_chief
    worker0 = dict(KUBEFLOW_CHIEF_AND_WORKERS, task={"type": "worker", "index": 0})
    assert not resolve_cluster(tf_config(worker0)).is_chief, "with a chief task, worker 0 is not chief"


def test_workers_only_worker_zero_is_chief():
    workers = ["w-0.svc:2222", "10.0.0.2:2222", "[fd00::3]:2222"]
    chiefs = [resolve_cluster(tf_config({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": i}})).is_chief
              for i in range(3)]
    assert chiefs == [True, False, False]


def test_indexed_job():
    env = {"JOB_COMPLETION_INDEX": "2", "DMPT_NUM_WORKERS": "3", "DMPT_JOB_NAME": "cifar",
           "DMPT_SERVICE_NAME": "cifar-workers"}
    cluster = resolve_cluster(env)
    assert cluster.addresses == tuple(f"cifar-{i}.cifar-workers:2222" for i in range(3))
    assert (cluster.task_index, cluster.is_chief) == (2, False)
    assert resolve_cluster(dict(env, JOB_COMPLETION_INDEX="0", DMPT_PORT="3000")).addresses[0] == \
        "cifar-0.cifar-workers:3000"


# What a pod of JobSet `cifar` sees: the Job controller's JOB_COMPLETION_INDEX,
# the kubelet's HOSTNAME, JobSet's labels and coordinator annotation (through
# the downward API), and the manifest's DMPT_NUM_WORKERS.
def jobset_pod(replicated_job, index, coordinator="cifar-worker-0-0.cifar", workers=3, **extra):
    return {"JOBSET_NAME": "cifar", "REPLICATED_JOB_NAME": replicated_job, "JOB_INDEX": "0",
            "JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"cifar-{replicated_job}-0-{index}",
            "JOBSET_COORDINATOR": coordinator, "DMPT_NUM_WORKERS": str(workers), **extra}


def test_jobset_workers():
    clusters = [resolve_cluster(jobset_pod("worker", i)) for i in range(3)]
    assert {c.addresses for c in clusters} == {tuple(f"cifar-worker-0-{i}.cifar:2222" for i in range(3))}
    assert [(c.task_type, c.task_index, c.is_chief) for c in clusters] == \
        [("worker", 0, True), ("worker", 1, False), ("worker", 2, False)]
    # Without the coordinator annotation: JobSet's default subdomain, the JobSet's name.
    assert resolve_cluster(jobset_pod("worker", 1, coordinator="")).addresses == clusters[1].addresses


def test_jobset_with_a_chief():
    coordinator = "cifar-chief-0-0.cifar-net"
    chief = resolve_cluster(jobset_pod("chief", 0, coordinator, workers=2, DMPT_PORT="3000"))
    worker = resolve_cluster(jobset_pod("worker", 1, coordinator, workers=2, DMPT_PORT="3000"))
    assert chief.addresses == worker.addresses == (
        "cifar-chief-0-0.cifar-net:3000", "cifar-worker-0-0.cifar-net:3000", "cifar-worker-0-1.cifar-net:3000")
    assert (chief.task_type, chief.is_chief, worker.task_type, worker.is_chief) == ("chief", True, "worker", False)


def test_trainjob_nodes():
    """Trainer v2 runs TrainJob `cifar` as JobSet `cifar` with replicated job `node`."""
    cluster = resolve_cluster(jobset_pod("node", 1, coordinator="cifar-node-0-0.cifar", workers=2))
    assert cluster.addresses == ("cifar-node-0-0.cifar:2222", "cifar-node-0-1.cifar:2222")
    assert (cluster.task_index, cluster.is_chief) == (1, False)


def test_tf_config_wins_over_indexed_job():
    env = dict(tf_config({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}),
               JOB_COMPLETION_INDEX="0", DMPT_NUM_WORKERS="5", DMPT_JOB_NAME="j", DMPT_SERVICE_NAME="s")
    assert resolve_cluster(env).addresses == ("a:1", "b:2")


# What srun gives task 1 of launch/slurm.sbatch's step on 2 nodes (one task each).
SLURM = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
         "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
         "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
         "SLURMD_NODENAME": "node2", "SLURM_LOCALID": "0"}


def slurm_task(monkeypatch, environ):
    """`environ` as the process's own: the resolver reads os.environ itself."""
    for key in [k for k in os.environ if k.startswith(("SLURM", "TF_CONFIG"))]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    return environ


def test_slurm(monkeypatch):
    clusters = [resolve_cluster(slurm_task(monkeypatch, dict(SLURM, SLURM_PROCID=str(rank),
                                                            SLURMD_NODENAME=f"node{rank + 1}")))
                for rank in (0, 1)]
    assert {c.addresses for c in clusters} == {("node1:2222", "node2:2222")}
    assert [(c.task_index, c.is_chief) for c in clusters] == [(0, True), (1, False)]


def test_slurm_tasks_are_those_of_the_step_not_of_the_job(monkeypatch):
    """A step (one srun) may run fewer tasks than the job has: TensorFlow's
    resolver places those of the step, and so do we."""
    step = dict(SLURM, SLURM_NTASKS="4", SLURM_PROCID="0", SLURMD_NODENAME="node1")
    cluster = resolve_cluster(slurm_task(monkeypatch, step))
    assert (cluster.addresses, cluster.is_chief) == (("node1:2222", "node2:2222"), True)
    # Several tasks on a node: consecutive ports from DMPT_PORT, by SLURM_LOCALID.
    two_per_node = dict(SLURM, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
                        SLURM_PROCID="3", SLURM_LOCALID="1", DMPT_PORT="3000")
    cluster = resolve_cluster(slurm_task(monkeypatch, two_per_node))
    assert cluster.addresses == ("node1:3000", "node1:3001", "node2:3000", "node2:3001")
    assert cluster.own_address == "node2:3001"


def workers_at(*addresses):
    """The TF_CONFIG of worker 0 of workers at `addresses`."""
    return tf_config({"cluster": {"worker": list(addresses)},
                      "task": {"type": "worker", "index": 0}})


def nested(depth):
    return "[" * depth + "]" * depth


# Every way a scheduler, an operator or a user can hand over a broken
# description, by source; each must be one line, before anything starts.
MALFORMED = [
    # TF_CONFIG: structure
    ({"TF_CONFIG": "{not json"}, "not valid JSON"),
    (tf_config({"cluster": {"worker": ["a:1"]}}), "no \"task\""),
    (tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}), "out of range"),
    (tf_config({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}), "ps"),
    (tf_config({"cluster": {"master": ["m:1"]}, "task": {"type": "master", "index": 0}}), "master"),
    (tf_config({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}), "more than once"),
    # One task, spelled two ways: worker 0 waited for itself until the deadline.
    (tf_config({"cluster": {"worker": ["localhost:2222", "LOCALHOST:02222"]},
                "task": {"type": "worker", "index": 0}}),
     "cluster lists LOCALHOST:02222 and localhost:2222 more than once"),
    (tf_config({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}), "host:port"),
    (tf_config({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}), "at most one"),
    (tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": True}}),
     "task index True is out of range"),
    # json.loads keeps the last of two names: the second task trained, unsaid.
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", '
                   '"index": 0}, "task": {"type": "worker", "index": 1}}'},
     "TF_CONFIG names 'task' twice"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1"], "worker": ["a:1", "b:1"]}, '
                   '"task": {"type": "worker", "index": 0}}'}, "TF_CONFIG names 'worker' twice"),
    # TF_CONFIG: valid JSON, wrong types and sizes
    (tf_config({"cluster": {"worker": ["a:1"]}, "task": {"type": ["worker"], "index": 0}}), "task type ['worker']"),
    (tf_config({"cluster": {"worker": ["a:1"]}, "task": {"type": {"w": 1}, "index": 0}}), "task type {'w': 1}"),
    (tf_config({"cluster": {"worker": [["a:1"]]}, "task": {"type": "worker", "index": 0}}), "list of \"host:port\""),
    (tf_config({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}), "task index '0'"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1' + "0" * 5000 + "}}"},
     "number too long"),
    ({"TF_CONFIG": '{"cluster": {"worker": ' + nested(100_000) + "}}"}, "nested too deep"),
    (tf_config({"cluster": {"worker": [f"w{i}:1" for i in range(MAX_TASKS + 1)]},
                "task": {"type": "worker", "index": 0}}), f"at most {MAX_TASKS}"),
    # TF_CONFIG: ports and hosts
    (tf_config({"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}),
     "port 99999, outside 1-65535"),
    (tf_config({"cluster": {"worker": ["a:0"]}, "task": {"type": "worker", "index": 0}}), "port 0"),
    (tf_config({"cluster": {"worker": ["a:2²"]}, "task": {"type": "worker", "index": 0}}), "ASCII digits"),
    (tf_config({"cluster": {"worker": ["a:٢٢٢٢"]}, "task": {"type": "worker", "index": 0}}), "ASCII digits"),
    (tf_config({"cluster": {"worker": ["my host:2222"]}, "task": {"type": "worker", "index": 0}}), "host name"),
    (tf_config({"cluster": {"worker": ["hôte:2222"]}, "task": {"type": "worker", "index": 0}}), "host name"),
    (tf_config({"cluster": {"worker": ["fd00::1:2222"]}, "task": {"type": "worker", "index": 0}}), "bracketed IPv6"),
    (tf_config({"cluster": {"worker": ["[not-v6]:2222"]}, "task": {"type": "worker", "index": 0}}), "host name"),
    (tf_config({"cluster": {"worker": ["-a.b:2222"]}, "task": {"type": "worker", "index": 0}}), "host name"),
    # Echoed whole once: a newline forged a second line, a long host or
    # thousands of task types made a line of 50,000 characters.
    (workers_at("a\nerror: forged:0"), "cluster address 'a\\nerror: forged:0' has port 0"),
    (workers_at("h" * 5000 + ":70000"), "has port 70000"),
    (tf_config({"cluster": {"worker": ["a:1"], **{f"type{i}": [] for i in range(2000)}},
                "task": {"type": "worker", "index": 0}}), "task type(s) ['type0', 'type1',"),
    (tf_config({"cluster": {"worker": [f"{'h' * 60}.{'x' * 60}.{'y' * 60}:1",
                                       f"{'H' * 60}.{'x' * 60}.{'y' * 60}:1"] * 2},
                "task": {"type": "worker", "index": 0}}), "more than once"),
    # One IPv6 address written two ways; addresses gRPC would look up as names.
    (workers_at("[::1]:2222", "[0:0::1]:2222"),
     "cluster lists [0:0::1]:2222 and [::1]:2222 more than once"),
    (workers_at("999.1.1.1:2222"), "is not an IPv4 address"),
    (workers_at("10.0.0.010:2222"), "without leading zeros"),
    # indexed Job
    ({"JOB_COMPLETION_INDEX": "4", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
     "out of range"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2"},
     "DMPT_JOB_NAME and DMPT_SERVICE_NAME not set"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_SERVICE_NAME": "s", "DMPT_JOB_NAME": "j"},
     "DMPT_NUM_WORKERS not set"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j",
      "DMPT_SERVICE_NAME": "s", "DMPT_PORT": "70000"}, "DMPT_PORT=70000 is outside 1-65535"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "100000", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
     f"DMPT_NUM_WORKERS=100000 is outside 1-{MAX_TASKS}"),
    ({"JOB_COMPLETION_INDEX": "-1", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
     "JOB_COMPLETION_INDEX='-1'"),
    ({"JOB_COMPLETION_INDEX": "٣", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
     "ASCII digits"),
    ({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "J_b", "DMPT_SERVICE_NAME": "s"},
     "DMPT_JOB_NAME='J_b' is not a Kubernetes name"),
    # JobSet and TrainJob
    (jobset_pod("worker", 3), "JOB_COMPLETION_INDEX=3 is out of range"),
    (jobset_pod("worker", 0, JOB_INDEX="1"), "replicas: 1"),
    (jobset_pod("worker", 0, JOB_INDEX=" 1\n"), "JOB_INDEX=1: the replicated job"),
    (jobset_pod("worker", 0, DMPT_NUM_WORKERS="0"), "DMPT_NUM_WORKERS=0 is outside"),
    (jobset_pod("worker", 0, DMPT_NUM_WORKERS="1" + "0" * 5000), "DMPT_NUM_WORKERS='1000"),
    (jobset_pod("worker", 0, coordinator="other-worker-0-0.cifar"), "JOBSET_COORDINATOR"),
    (jobset_pod("worker", 0, coordinator="cifar-worker-0-1.cifar"), "JOBSET_COORDINATOR"),
    (jobset_pod("worker", 0, coordinator="cifar-worker-0-0"), "JOBSET_COORDINATOR"),
    (jobset_pod("chief", 0), "must be the JobSet's coordinator"),
    (jobset_pod("node", 0, coordinator="cifar-chief-0-0.cifar"), "must be named worker"),
    (jobset_pod("worker", 1, HOSTNAME="cifar-worker-0-0"), "JobSet names this pod cifar-worker-0-1"),
    (jobset_pod("worker", 0, JOBSET_NAME="Cifar!"), "JOBSET_NAME='Cifar!'"),
    # SLURM
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc' must be set to a whole number"),
    (dict(SLURM, SLURM_PROCID="5"), "SLURM_PROCID=5 is out of range for SLURM_STEP_NUM_TASKS=2"),
    # Ranks beyond the step's tasks, which the resolver answers with task None
    # (they trained alone, wrote nothing and exited 0).
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "1",
      "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1"},
     "SLURM_PROCID=1 is out of range for SLURM_STEP_NUM_TASKS=1"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2",
      "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2"},
     "SLURM_PROCID=3 is out of range for SLURM_STEP_NUM_TASKS=2"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "start the tasks with srun"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2\n", "SLURM_PROCID": "0"}, "SLURM_NTASKS=2 but"),
    # The step's variables disagree: the resolver's own refusal, in one line.
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE="1"), "cannot read the SLURM allocation"),
    # The resolver sorts nodes by name: node10 before node2, so it puts rank
    # 9 (on node10, in SLURM's order) on node9, and rank 1 on node10.
    (dict(SLURM, SLURM_STEP_NUM_TASKS="10", SLURM_STEP_NODELIST="node[1-10]",
          SLURM_STEP_TASKS_PER_NODE="1(x10)", SLURM_PROCID="9", SLURMD_NODENAME="node10"),
     "places SLURM task 9 at 'node9:2222', but SLURM started it on 'node10'"),
    # srun --distribution=cyclic: rank 1 on the second node, not beside rank 0.
    (dict(SLURM, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_PROCID="1",
          SLURMD_NODENAME="node2", SLURM_LOCALID="0"), "places SLURM task 1 at 'node1:2223'"),
    (dict(SLURM, SLURM_PROCID="-1"), "SLURM_PROCID='-1'"),
    (dict(SLURM, SLURM_STEP_NODELIST="node[1-999999999]"), f"more than {MAX_TASKS} hosts"),
    (dict(SLURM, SLURM_STEP_NODELIST="node[a-b]"), "not numbers"),
    # Counted in linear time (40,000 brackets took 14 s), and the resolver's
    # refusal, which quotes the list, cut.
    (dict(SLURM, SLURM_STEP_NODELIST="node[1-2]" + "[" * 40_000),
     "cannot read the SLURM allocation"),
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE="1(x999999999)"), f"more than {MAX_TASKS} nodes"),
]


@pytest.mark.parametrize("environ, fragment", MALFORMED)
def test_malformed_cluster_is_one_clear_error(environ, fragment, monkeypatch):
    if "SLURM_JOB_ID" in slurm_task(monkeypatch, environ):
        import tensorflow  # noqa: F401 — the resolver's import is not what is timed
    started = time.monotonic()
    with pytest.raises(ClusterError) as error:
        resolve_cluster(environ)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert len(str(error.value)) < 400, "a value is echoed whole"
    # Generous: nothing may be built from a huge count, nor be quadratic.
    seconds = time.monotonic() - started
    print(f"refused in {seconds:.3f} s")
    assert seconds < 5


def test_the_largest_cluster_is_built_promptly():
    started = time.monotonic()
    cluster = resolve_cluster({"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": str(MAX_TASKS),
                               "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"})
    assert cluster.num_workers == MAX_TASKS
    assert time.monotonic() - started < 5, "the duplicate check must not be quadratic"


@pytest.mark.parametrize("environ", [
    tf_config({"cluster": {"worker": ["a:٢٢٢٢", "b:1"]}, "task": {"type": "worker", "index": 0}}),
    dict(SLURM, SLURM_PROCID="5"),
    # The command: it trained, wrote nothing and exited 0.
    {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "1",
     "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1"},
    {"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "100000", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
    jobset_pod("worker", 7),
    workers_at("a\nerror: forged:0"),
    {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}, '
                  '"task": {"type": "worker", "index": 0}}'},
    # The manifest without its worker count: each pod trained alone.
    {"JOB_COMPLETION_INDEX": "1", "DMPT_JOB_NAME": "j", "DMPT_SERVICE_NAME": "s"},
], ids=["tf_config-port", "slurm-rank", "slurm-step-rank", "indexed-job-count", "jobset-index",
        "tf_config-newline", "tf_config-two-tasks", "indexed-job-no-count"])
def test_the_trainer_refuses_a_malformed_cluster_in_one_line(environ, tmp_path):
    """What a user sees: one `error:` line, exit 2, nothing written (a
    process of its own: the environment is the input)."""
    from conftest import SMOKE_FLAGS, assert_one_error_line, subprocess_env, train

    result = train([*SMOKE_FLAGS, "--train_steps=1", f"--model_dir={tmp_path / 'run'}"],
                   env=subprocess_env(**environ))
    assert_one_error_line(result, "")
    assert not (tmp_path / "run").exists()
