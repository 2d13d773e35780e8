"""Where this process sits in a multi-worker cluster, from whatever describes it.

Four sources, tried in order:
1. `TF_CONFIG`, as Kubeflow's training operator (v1) and the launcher write it.
2. A JobSet pod, which is also how Kubeflow Trainer v2 runs a TrainJob
   (`JOBSET_NAME` set). JobSet names pod i of job j of replicated job R
   `<jobset>-<R>-<j>-<i>` under the subdomain of its headless Service, and
   labels it with these names; the manifest hands the labels to the process
   through the downward API as `JOBSET_NAME`, `REPLICATED_JOB_NAME` and
   `JOB_INDEX`, with `JOB_COMPLETION_INDEX` from the Job controller, the
   coordinator annotation as `JOBSET_COORDINATOR` (`<host>.<subdomain>`:
   the chief, and the subdomain) and `DMPT_NUM_WORKERS`. The workers are the
   pods of one replicated job (replicas: 1); a replicated job named `chief`
   of one pod, made the coordinator, adds a chief task, and the workers'
   replicated job is then named `worker`.
3. A Kubernetes indexed Job: `JOB_COMPLETION_INDEX` (set by Kubernetes) with
   `DMPT_NUM_WORKERS`, `DMPT_JOB_NAME`, `DMPT_SERVICE_NAME` and optionally
   `DMPT_PORT` (set by the manifest); pods resolve as `<job>-<i>.<service>`.
4. SLURM (`SLURM_JOB_ID` with more than one task), through TensorFlow's
   `SlurmClusterResolver`, whose answer is checked.
Everything is reduced to one `Cluster`, whose `tf_config` is what
`MultiWorkerMirroredStrategy` is given. Every value is checked before it is
used, and sizes are bounded before anything is built from them: a malformed
description is one ClusterError line, never a traceback or a hang.
"""

import collections
import dataclasses
import ipaddress
import json
import os
import re
from typing import Mapping, Optional, Tuple

from distributed_mpt.errors import ClusterError, quoted

TASK_TYPES = ("chief", "worker")
DEFAULT_PORT = 2222
# Far beyond any MultiWorkerMirroredStrategy job (every step all-reduces
# across all tasks); a bound on what a typo or a hostile value can make us build.
MAX_TASKS = 10_000
CHIEF_JOB = "chief"    # JobSet: the replicated job of the chief task, if any
WORKER_JOB = "worker"  # JobSet: the workers' replicated job when there is a chief
_INDEXED_JOB = ("DMPT_NUM_WORKERS", "DMPT_JOB_NAME", "DMPT_SERVICE_NAME")  # the manifest's

_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only: str.isdigit() admits "²" and "٣"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?")


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
    if environ.get("JOBSET_NAME"):
        return _from_jobset(environ)
    # Kubernetes sets JOB_COMPLETION_INDEX in every indexed Job, a sweep of
    # single runs too; any of the manifest's variables makes it a cluster.
    if "JOB_COMPLETION_INDEX" in environ and any(name in environ for name in _INDEXED_JOB):
        return _from_indexed_job(environ)
    if "SLURM_JOB_ID" in environ and max(_int_env(environ, "SLURM_NTASKS", default=1),
                                         _int_env(environ, "SLURM_STEP_NUM_TASKS", default=1)) > 1:
        return _from_slurm(environ)
    return None


# ------------------------------------------------------------------ TF_CONFIG

def _from_tf_config(text: str) -> Cluster:
    try:
        config = json.loads(text, object_pairs_hook=_unique_names)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e.msg} at position {e.pos})") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits; nesting too deep
        raise ClusterError("TF_CONFIG holds a number too long or arrays nested too deep") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterError('TF_CONFIG has no "cluster" object: expected {"cluster": {"worker": [...]}, "task": {...}}')
    cluster = config["cluster"]
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(f"TF_CONFIG has task type(s) {_short(unknown)}: this trainer runs "
                           f"MultiWorkerMirroredStrategy, which takes only {list(TASK_TYPES)}")
    for task_type, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
            raise ClusterError(f'TF_CONFIG cluster "{task_type}" must be a list of "host:port" strings')
        if len(addresses) > MAX_TASKS:
            raise ClusterError(f'TF_CONFIG cluster "{task_type}" lists {len(addresses)} tasks; '
                               f"at most {MAX_TASKS} are supported")
    if len(cluster.get("chief", [])) > 1:
        raise ClusterError(f"TF_CONFIG lists {len(cluster['chief'])} chiefs; there can be at most one")
    if not cluster.get("worker") and not cluster.get("chief"):
        raise ClusterError("TF_CONFIG cluster lists no workers")
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError('TF_CONFIG has no "task" with "type" and "index": which worker is this process?')
    task_type, task_index = task["type"], task["index"]
    if not isinstance(task_type, str) or task_type not in cluster:
        raise ClusterError(f'TF_CONFIG task type {_short(task_type)} is not in its cluster ({sorted(cluster)})')
    # bool is an int in Python: "index": true must not pass as worker 1.
    if isinstance(task_index, bool) or not isinstance(task_index, int) or \
            not 0 <= task_index < len(cluster[task_type]):
        raise ClusterError(f'TF_CONFIG task index {_short(task_index)} is out of range: cluster "{task_type}" '
                           f"has {len(cluster[task_type])} task(s)")
    return _make_cluster({t: list(cluster[t]) for t in TASK_TYPES if cluster.get(t)},
                         task_type, task_index)


def _unique_names(pairs: list) -> dict:
    """A JSON object whose names are unique: json.loads keeps the last of
    two, and a TF_CONFIG with two "task"s trained as the second, unsaid."""
    config = {}
    for name, value in pairs:  # one pass, not a scan of the names before each
        if name in config:
            raise ClusterError(f"TF_CONFIG names {_short(name)} twice in one object: "
                               "which one is meant?")
        config[name] = value
    return config


def _short(value, limit: int = 40) -> str:
    """A value for an error line: its repr (a string's escaped, never its
    newlines), cut to `limit` characters. Not errors.quoted, which shows a
    value's text alone: TF_CONFIG is JSON, and its "index": "0" is refused
    for being a string, which only the repr's quotes ('0') show."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _make_cluster(cluster: dict, task_type: str, task_index: int) -> Cluster:
    addresses = tuple(cluster.get("chief", []) + cluster.get("worker", []))
    # Counted in one pass: a quadratic check of 10,000 addresses takes minutes.
    # As the resolver reads them: host names in any case, ports with leading
    # zeros (localhost:2222 and LOCALHOST:02222 are one task's), IPv6
    # addresses however written ([::1] is [0:0::1]).
    spelled = collections.defaultdict(list)
    for address in addresses:
        _check_address(address)
        host, _, port = address.rpartition(":")
        if host.startswith("["):
            host = str(ipaddress.IPv6Address(host[1:-1]))
        spelled[(host.lower().rstrip("."), int(port))].append(address)
    duplicates = sorted(" and ".join(sorted(set(same))[:2]) for same in spelled.values()
                        if len(same) > 1)
    if duplicates:
        raise ClusterError(f"cluster lists {quoted(', '.join(duplicates[:3]))} more than "
                           "once; every task needs its own host:port")
    # The chief task if there is one, else worker 0, writes every file.
    chief_type = "chief" if "chief" in cluster else "worker"
    return Cluster(
        task_type=task_type, task_index=task_index, addresses=addresses,
        is_chief=(task_type == chief_type and task_index == 0),
        tf_config={"cluster": cluster, "task": {"type": task_type, "index": task_index}})


def _check_address(address: str) -> None:
    """Refuses what gRPC could never connect to: the deadline for peers
    would otherwise be waited out before anyone heard of the typo."""
    host, _, port = address.rpartition(":")
    if not host or not _DIGITS.fullmatch(port):
        raise ClusterError(f"cluster address {_short(address)} is not of the form host:port "
                           "(port in ASCII digits)")
    if not 1 <= int(port) <= 65535:
        raise ClusterError(f"cluster address {_short(address)} has port {port}, outside 1-65535")
    if host.startswith("[") and host.endswith("]"):
        if _parses_as(ipaddress.IPv6Address, host[1:-1]):
            return
    elif len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
        # A name's last label is never all digits (RFC 1123): 999.1.1.1 and
        # 10.0.0.010 are typos of addresses, which gRPC would look up as
        # names, its peers waiting out their deadline.
        if not host.rpartition(".")[2].isdigit() or _parses_as(ipaddress.IPv4Address, host):
            return
        raise ClusterError(f"cluster address {_short(address)} is not an IPv4 address "
                           "(four numbers 0-255, without leading zeros)")
    raise ClusterError(f"cluster address {_short(address)} does not start with a host name, an IPv4 "
                       "address or a bracketed IPv6 address ([::1]:2222)")


def _parses_as(address_type: type, host: str) -> bool:
    try:
        address_type(host)
        return True
    except ValueError:
        return False


# ------------------------------------------------------- environment values

def _int_env(environ: Mapping[str, str], name: str, default: Optional[int] = None,
             low: int = 0, high: int = MAX_TASKS) -> int:
    """The integer `environ[name]`, in [low, high]."""
    text = environ.get(name)
    if not text and default is not None:
        return default
    if text is None or not _DIGITS.fullmatch(text.strip()):
        raise ClusterError(f"{name}={_short(text)} must be set to a whole number in ASCII digits")
    value = int(text)
    if not low <= value <= high:
        raise ClusterError(f"{name}={value} is outside {low}-{high}")
    return value


def _port(environ: Mapping[str, str]) -> int:
    return _int_env(environ, "DMPT_PORT", default=DEFAULT_PORT, low=1, high=65535)


def _dns_label(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not _DNS_LABEL.fullmatch(value):
        raise ClusterError(f"{name}={_short(value)} is not a Kubernetes name (a DNS label: lower-case "
                           "letters, digits and '-', at most 63)")
    return value


# ------------------------------------------------------------------- JobSet

def _from_jobset(environ: Mapping[str, str]) -> Cluster:
    jobset = _dns_label(environ, "JOBSET_NAME")
    replicated_job = _dns_label(environ, "REPLICATED_JOB_NAME")
    job_index = _int_env(environ, "JOB_INDEX")
    if job_index != 0:
        raise ClusterError(f"JOB_INDEX={job_index}: the replicated job {replicated_job} must "
                           "have replicas: 1 (its workers are the pods of one Job; scale with "
                           "parallelism and completions)")
    pod_index = _int_env(environ, "JOB_COMPLETION_INDEX")
    num_workers = _int_env(environ, "DMPT_NUM_WORKERS", low=1)
    port = _port(environ)
    coordinator = environ.get("JOBSET_COORDINATOR", "")
    if coordinator:
        coordinator_host, _, subdomain = coordinator.partition(".")
        coordinator_job = coordinator_host[len(jobset) + 1:-len("-0-0")]
        if not (coordinator_host == f"{jobset}-{coordinator_job}-0-0" and _DNS_LABEL.fullmatch(subdomain)):
            raise ClusterError(f"JOBSET_COORDINATOR={_short(coordinator)} is not pod 0 of job 0 of a "
                               f"replicated job of JobSet {jobset} (<jobset>-<job>-0-0.<subdomain>)")
    else:  # JobSet's default subdomain: the JobSet's name
        coordinator_job, subdomain = replicated_job, jobset
    has_chief = coordinator_job == CHIEF_JOB
    workers_job = WORKER_JOB if replicated_job == CHIEF_JOB else replicated_job
    if replicated_job == CHIEF_JOB and not has_chief:
        raise ClusterError(f"the replicated job {CHIEF_JOB} must be the JobSet's coordinator "
                           "(spec.coordinator.replicatedJob), so that the workers know of it")
    if has_chief and replicated_job not in (CHIEF_JOB, WORKER_JOB):
        raise ClusterError(f"with a chief, the workers' replicated job must be named {WORKER_JOB}, "
                           f"not {replicated_job}")

    def host(job: str, index: int) -> str:
        return f"{jobset}-{job}-0-{index}.{subdomain}:{port}"

    cluster = {"worker": [host(workers_job, i) for i in range(num_workers)]}
    if has_chief:
        cluster = {"chief": [host(CHIEF_JOB, 0)], **cluster}
    task_type, count = ("chief", 1) if replicated_job == CHIEF_JOB else ("worker", num_workers)
    if pod_index >= count:
        raise ClusterError(f"JOB_COMPLETION_INDEX={pod_index} is out of range: the replicated job "
                           f"{replicated_job} has {count} pod(s) (DMPT_NUM_WORKERS={num_workers})")
    own_host = f"{jobset}-{replicated_job}-0-{pod_index}"
    if environ.get("HOSTNAME", own_host) != own_host:
        raise ClusterError(f"HOSTNAME={_short(environ['HOSTNAME'])}, but JobSet names this pod {own_host}: "
                           "are JOBSET_NAME, REPLICATED_JOB_NAME and JOB_INDEX taken from the pod's labels?")
    return _make_cluster(cluster, task_type, pod_index)


# -------------------------------------------------------------- indexed Job

def _from_indexed_job(environ: Mapping[str, str]) -> Cluster:
    # One of them missing: each pod trained alone, as worker 0 of a cluster of one.
    missing = [name for name in _INDEXED_JOB if not environ.get(name)]
    if missing:
        raise ClusterError(f"an indexed Job needs {', '.join(_INDEXED_JOB)} (the number of "
                           f"workers, the Job's name and its headless Service's name); "
                           f"{' and '.join(missing)} not set")
    num_workers = _int_env(environ, "DMPT_NUM_WORKERS", low=1)
    index = _int_env(environ, "JOB_COMPLETION_INDEX")
    port = _port(environ)
    job, service = _dns_label(environ, "DMPT_JOB_NAME"), _dns_label(environ, "DMPT_SERVICE_NAME")
    if index >= num_workers:
        raise ClusterError(f"JOB_COMPLETION_INDEX={index} is out of range for DMPT_NUM_WORKERS={num_workers}")
    workers = [f"{job}-{i}.{service}:{port}" for i in range(num_workers)]
    return _make_cluster({"worker": workers}, "worker", index)


# -------------------------------------------------------------------- SLURM

def _hostlist_length(hostlist: str) -> int:
    """How many hosts a SLURM host list (`n[1-4,7],m5`) names, without
    expanding it: a list of a billion hosts is counted, not built."""
    text = re.sub(r"\[([^[\]]*)\]", lambda m: "[" + m.group(1).replace(",", ";") + "]", hostlist)
    total = 0
    for part in filter(None, text.split(",")):
        ranges = re.search(r"\[([^[\]]*)\]$", part)
        if not ranges:
            total += 1
            continue
        for item in ranges.group(1).split(";"):
            low, _, high = item.partition("-")
            if not _DIGITS.fullmatch(low) or (high and not _DIGITS.fullmatch(high)):
                raise ClusterError(f"SLURM host list {_short(hostlist)} has a range {_short(item)} "
                                   "that is not numbers")
            total += int(high or low) - int(low) + 1
    return total


def _from_slurm(environ: Mapping[str, str]) -> Cluster:
    # The resolver places the tasks of the job *step* (one srun): it reads
    # SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
    # SLURM_STEP_TASKS_PER_NODE. SLURM_NTASKS counts the job's tasks, of which
    # a step may run fewer; a rank checked against it once passed, the
    # resolver answered task None, and the process trained alone as a
    # non-chief that wrote nothing, exiting 0.
    if not environ.get("SLURM_STEP_NUM_TASKS"):
        raise ClusterError(f"SLURM_NTASKS={_int_env(environ, 'SLURM_NTASKS')} but "
                           "SLURM_STEP_NUM_TASKS is not set: this process is not a task of a job "
                           "step; start the tasks with srun (launch/slurm.sbatch does)")
    num_tasks = _int_env(environ, "SLURM_STEP_NUM_TASKS", low=1)
    rank = _int_env(environ, "SLURM_PROCID")
    if rank >= num_tasks:
        raise ClusterError(f"SLURM_PROCID={rank} is out of range for SLURM_STEP_NUM_TASKS={num_tasks} "
                           "(the tasks of this job step, which TensorFlow's SlurmClusterResolver places)")
    port = _port(environ)
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        if environ.get(name) and _hostlist_length(environ[name]) > MAX_TASKS:
            raise ClusterError(f"{name} names more than {MAX_TASKS} hosts")
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        # "3(x2),1": 3 tasks on each of 2 nodes, then 1.
        if sum(int(n) for n in re.findall(r"\(x(\d{1,9})\)", environ.get(name, ""))) > MAX_TASKS:
            raise ClusterError(f"{name}={_short(environ[name])} repeats more than {MAX_TASKS} nodes")

    import tensorflow as tf  # only SLURM users pay for the import here

    try:
        # The resolver lists one task per GPU slot it is told of, and runs
        # nvidia-smi when not told. Giving every task one nominal slot lists
        # all tasks; GPU visibility stays with SLURM (auto_set_gpu=False).
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port, gpus_per_node=num_tasks, gpus_per_task=1, auto_set_gpu=False)
        workers = list(resolver.cluster_spec().as_dict().get("worker", []))
        task_type, task_index = resolver.get_task_info()
    except Exception as e:  # the resolver raises bare RuntimeError/KeyError on odd environments
        raise ClusterError(f"cannot read the SLURM allocation: {quoted(e)}") from None
    if (task_type, task_index) != ("worker", rank) or len(workers) != num_tasks:
        raise ClusterError(f"TensorFlow's SlurmClusterResolver cannot place SLURM task {rank} of "
                           f"{num_tasks} (it answers task {task_type} {task_index} of {len(workers)} "
                           "workers): check SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE")
    _check_placement(environ, rank, workers[rank], port)
    return _make_cluster({"worker": workers}, "worker", rank)


def _check_placement(environ: Mapping[str, str], rank: int, address: str, port: int) -> None:
    """Refuses the `address` of task `rank` if it is not where SLURM started it.

    The resolver sorts the step's nodes by name (node10 before node2) and
    fills each with consecutive ranks; SLURM numbers nodes in its own order
    and may deal ranks out cyclically. Where the two differ, tasks would
    reach each other's servers under the wrong task number."""
    node = environ.get("SLURMD_NODENAME")
    if not node:  # not under srun (a test, a hand-made environment)
        return
    local = _int_env(environ, "SLURM_LOCALID", default=0)
    expected = f"{node}:{port + local}"
    if address != expected:
        raise ClusterError(
            f"TensorFlow's SlurmClusterResolver places SLURM task {rank} at {_short(address)}, "
            f"but SLURM started it on {_short(node)} as local task {local} "
            f"({_short(expected)}): the resolver orders nodes by name and fills them in turn; use "
            "node names that sort in SLURM's order (node01, not node1) and srun's block distribution, "
            "or set TF_CONFIG")
