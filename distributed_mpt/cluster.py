"""Where this process sits in a multi-worker cluster, from whatever describes it.

Three sources, tried in order:
1. `TF_CONFIG`, as Kubeflow's training operator and the launcher write it.
2. A Kubernetes indexed Job: `JOB_COMPLETION_INDEX` (set by Kubernetes) with
   `DMPT_NUM_WORKERS`, `DMPT_JOB_NAME`, `DMPT_SERVICE_NAME` and optionally
   `DMPT_PORT` (set by the manifest); pods resolve as `<job>-<i>.<service>`.
3. SLURM (`SLURM_JOB_ID` with more than one task), through TensorFlow's
   `SlurmClusterResolver`.
Everything is reduced to one `Cluster`, whose `tf_config` is what
`MultiWorkerMirroredStrategy` is given.
"""

import dataclasses
import json
import os
from typing import Mapping, Optional, Tuple

from distributed_mpt.errors import ClusterError

TASK_TYPES = ("chief", "worker")
DEFAULT_PORT = 2222


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's task and the addresses of all tasks (chief first)."""

    task_type: str
    task_index: int
    addresses: Tuple[str, ...]
    is_chief: bool
    tf_config: dict

    @property
    def num_workers(self) -> int:
        return len(self.addresses)

    @property
    def own_address(self) -> str:
        return self.tf_config["cluster"][self.task_type][self.task_index]


def resolve_cluster(environ: Mapping[str, str] = os.environ) -> Optional[Cluster]:
    """The cluster described by `environ`, or None for a single process.

    Raises ClusterError, naming what is wrong, for a malformed description.
    """
    if environ.get("TF_CONFIG", "").strip():
        return _from_tf_config(environ["TF_CONFIG"])
    if "JOB_COMPLETION_INDEX" in environ and "DMPT_NUM_WORKERS" in environ:
        return _from_indexed_job(environ)
    if "SLURM_JOB_ID" in environ and _int_env({"SLURM_NTASKS": environ.get("SLURM_NTASKS") or "1"},
                                              "SLURM_NTASKS") > 1:
        return _from_slurm(environ)
    return None


def _from_tf_config(text: str) -> Cluster:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterError('TF_CONFIG has no "cluster" object: expected {"cluster": {"worker": [...]}, "task": {...}}')
    cluster = config["cluster"]
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(f"TF_CONFIG has task type(s) {unknown}: this trainer runs "
                           f"MultiWorkerMirroredStrategy, which takes only {list(TASK_TYPES)}")
    for task_type, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
            raise ClusterError(f'TF_CONFIG cluster "{task_type}" must be a list of "host:port" strings')
    if len(cluster.get("chief", [])) > 1:
        raise ClusterError(f"TF_CONFIG lists {len(cluster['chief'])} chiefs; there can be at most one")
    if not cluster.get("worker") and not cluster.get("chief"):
        raise ClusterError("TF_CONFIG cluster lists no workers")
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError('TF_CONFIG has no "task" with "type" and "index": which worker is this process?')
    task_type, task_index = task["type"], task["index"]
    if task_type not in cluster:
        raise ClusterError(f'TF_CONFIG task type "{task_type}" is not in its cluster ({sorted(cluster)})')
    # bool is an int in Python: "index": true must not pass as worker 1.
    if isinstance(task_index, bool) or not isinstance(task_index, int) or \
            not 0 <= task_index < len(cluster[task_type]):
        raise ClusterError(f'TF_CONFIG task index {task_index!r} is out of range: cluster "{task_type}" '
                           f"has {len(cluster[task_type])} task(s)")
    return _make_cluster({t: list(cluster[t]) for t in TASK_TYPES if cluster.get(t)},
                         task_type, task_index)


def _make_cluster(cluster: dict, task_type: str, task_index: int) -> Cluster:
    addresses = tuple(cluster.get("chief", []) + cluster.get("worker", []))
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterError(f'cluster address "{address}" is not of the form host:port')
        if not 1 <= int(port) <= 65535:
            raise ClusterError(f'cluster address "{address}" has port {port}, outside 1-65535')
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ClusterError(f"cluster lists {', '.join(duplicates)} more than once; every task needs its own host:port")
    # The chief task if there is one, else worker 0, writes every file.
    chief_type = "chief" if "chief" in cluster else "worker"
    return Cluster(
        task_type=task_type, task_index=task_index, addresses=addresses,
        is_chief=(task_type == chief_type and task_index == 0),
        tf_config={"cluster": cluster, "task": {"type": task_type, "index": task_index}})


def _int_env(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        raise ClusterError(f"{name}={environ.get(name)!r} must be set to an integer") from None


def _from_indexed_job(environ: Mapping[str, str]) -> Cluster:
    num_workers = _int_env(environ, "DMPT_NUM_WORKERS")
    index = _int_env(environ, "JOB_COMPLETION_INDEX")
    port = _int_env({"DMPT_PORT": environ.get("DMPT_PORT", str(DEFAULT_PORT))}, "DMPT_PORT")
    job, service = environ.get("DMPT_JOB_NAME"), environ.get("DMPT_SERVICE_NAME")
    if not job or not service:
        raise ClusterError("an indexed Job needs DMPT_JOB_NAME and DMPT_SERVICE_NAME "
                           "(the Job's name and its headless Service's name)")
    if num_workers < 1 or not 0 <= index < num_workers:
        raise ClusterError(f"JOB_COMPLETION_INDEX={index} is out of range for DMPT_NUM_WORKERS={num_workers}")
    workers = [f"{job}-{i}.{service}:{port}" for i in range(num_workers)]
    return _make_cluster({"worker": workers}, "worker", index)


def _from_slurm(environ: Mapping[str, str]) -> Cluster:
    import tensorflow as tf  # only SLURM users pay for the import here

    port = _int_env({"DMPT_PORT": environ.get("DMPT_PORT", str(DEFAULT_PORT))}, "DMPT_PORT")
    try:
        # The resolver lists one task per GPU slot it is told of, and runs
        # nvidia-smi when not told. Giving every task one nominal slot lists
        # all tasks; GPU visibility stays with SLURM (auto_set_gpu=False).
        num_tasks = _int_env(environ, "SLURM_NTASKS")
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port, gpus_per_node=num_tasks, gpus_per_task=1, auto_set_gpu=False)
        spec = resolver.cluster_spec().as_dict()
        task_type, task_index = resolver.get_task_info()
    except Exception as e:  # the resolver raises bare RuntimeError/KeyError on odd environments
        raise ClusterError(f"cannot read the SLURM allocation: {e}") from None
    return _make_cluster({"worker": list(spec.get(task_type, []))}, "worker", task_index)
