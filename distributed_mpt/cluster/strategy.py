"""One function from a strategy name to a `tf.distribute.Strategy`.

Call `create_strategy` before any other TensorFlow op: logical CPU devices
can only be configured, and MultiWorkerMirroredStrategy only created, before
the runtime starts.
"""

import os
import re
import resource
import sys
from typing import Optional

import tensorflow as tf

from distributed_mpt.errors import ClusterError, ConfigError
from distributed_mpt.cluster.environment import Cluster

# What TensorFlow raises on the survivors when a peer of a multi-worker job
# is lost.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
               tf.errors.DeadlineExceededError, tf.errors.CancelledError)
# Where the message of a failed collective names the task at its other end
# ("Additional GRPC error information from remote target
# /job:worker/replica:0/task:0 while calling ..."); or only its address
# ("failed to connect to all addresses; ... ipv4:127.0.0.1:59015: ...").
_TASK_NAMED = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
# What TensorFlow raises, at start-up, when the workers' TF_CONFIGs list
# other clusters: a collective group of another size, or a task the
# coordination service (the first task's) does not list. Matched by type and
# words, so that a lost peer keeps its retryable exit.
_CLUSTER_MISMATCHES = (
    (tf.errors.InternalError, re.compile(r"joining a group with size ?(\d+), but that group "
                                         r"has size ?(\d+)"), "one lists {} tasks, another {}"),
    (tf.errors.InvalidArgumentError, re.compile(r"Unexpected task registered with task_name="
                                                r"(\S+)"), "the first task's does not list {}"))

def resolve_strategy_name(name: str, cluster: Optional[Cluster], cpu_replicas: int) -> str:
    """Turns `auto` into a concrete strategy for this process and its devices
    (a strategy of one worker over several: ClusterOptions.check_for_workers)."""
    if name == "multi_worker" and cluster is None:
        raise ConfigError("--strategy=multi_worker needs a cluster: set TF_CONFIG, run as a "
                          "Kubernetes indexed Job, under SLURM, or use distributed-mpt-launch")
    if name != "auto":
        return name
    if cluster is not None and cluster.num_workers > 1:
        return "multi_worker"
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    if num_gpus > 1 or cpu_replicas > 1:
        return "mirrored"
    return "one_device" if num_gpus == 1 else "default"


def create_strategy(name: str, cpu_replicas: int = 0, communication: str = "auto",
                    cluster: Optional[Cluster] = None) -> tf.distribute.Strategy:
    """Creates strategy `name` (already resolved, not `auto`).

    mirrored: every local GPU, or `cpu_replicas` logical CPU devices when set.
    multi_worker: MultiWorkerMirroredStrategy over `cluster`, once every
    peer has joined. Without a deadline a worker whose peers never start
    waits for an hour (the coordination service's timeout), silently, and
    deaf to SIGTERM: run it under startup_watchdog.StartupWatchdog.
    """
    if cpu_replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(cpu_replicas)])
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        if not tf.config.list_physical_devices("GPU"):
            print("--strategy=one_device: TensorFlow sees no GPU, so this run trains on the CPU",
                  flush=True)
            return tf.distribute.OneDeviceStrategy("/cpu:0")
        return tf.distribute.OneDeviceStrategy("/gpu:0")
    if name == "mirrored":  # devices None: every local GPU
        return tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(cpu_replicas)] if cpu_replicas else None)
    assert name == "multi_worker", name  # resolve_strategy_name returns no other
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.tf_config["cluster"]), task_type=cluster.task_type,
        task_id=cluster.task_index, rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions(implementation=getattr(
        tf.distribute.experimental.CommunicationImplementation, communication.upper()))
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            resolver, communication_options=options)
        barrier(strategy)()  # every peer has joined
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in str(e):
            raise
        # TensorFlow's words are kept: the launcher looks for them.
        raise ClusterError(
            f"Could not start gRPC server on port {cluster.own_address.rpartition(':')[2]} "
            f"({cluster.own_address}): the port is taken on some address of this host "
            f"(see `ss -ltnp`)") from None
    except (tf.errors.InternalError, tf.errors.InvalidArgumentError) as e:
        found = [what.format(*match.groups()) for kind, pattern, what in _CLUSTER_MISMATCHES
                 for match in [pattern.search(e.message)] if isinstance(e, kind) and match]
        if not found:
            raise
        raise ClusterError(
            f"the workers were started with different cluster descriptions (TF_CONFIG): "
            f"{found[0]} (this worker's: {cluster.num_workers} tasks, it is "
            f"{cluster.task_type} {cluster.task_index}): give every worker the same cluster, "
            f"each its own task") from None
    return strategy


def barrier(strategy: tf.distribute.Strategy, values=(1.0,)):
    """A function that returns once every worker of `strategy` has called
    it (a collective completes only when every peer takes part): the sum of
    `values` (floats) over every replica, each one's own: in float64, exact for the
    integers below 2^53 that plan.check_workers_agree sums."""

    # Not converted by AutoGraph: there is nothing to convert.
    @tf.function(autograph=False)
    def all_here():
        return strategy.reduce("SUM", strategy.run(lambda: tf.constant(values, tf.float64)),
                               axis=None)

    return all_here


def describe_devices() -> str:
    """What this worker trains on, for a run's summary: its GPUs' names, or
    its CPU's model and core count."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        # The cores this process may use (a container's share), not the host's.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return f"{_cpu_model()}, {cores} cores"
    names = [tf.config.experimental.get_device_details(g).get("device_name", "GPU") for g in gpus]
    return ", ".join(f"{names.count(name)} x {name}" for name in sorted(set(names)))


def peak_resident_bytes() -> int:
    """The largest resident set size this process has had since it started
    (getrusage's ru_maxrss: host memory, its threads included, its child
    processes not; a GPU's memory is not in it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB on Linux


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "CPU"


def peer_named(error: Exception, cluster: Cluster) -> Optional[str]:
    """The peer ("worker 0", as the launcher prefixes its lines) whose loss
    TensorFlow's `error` names, other than this task; None unless it names
    exactly one. Not always the one that stopped: a live peer that passed the
    abort on ("remote target .../task:1 while calling RecvBuf") is named too."""
    text = str(error)
    named = {f"{job} {task}" for job, task in _TASK_NAMED.findall(text)}
    named.update(f"{job} {task}" for job, addresses in cluster.tf_config["cluster"].items()
                 for task, address in enumerate(addresses)
                 # Whole: not :2222 in :22220, nor 10.0.0.1 in 110.0.0.1.
                 if re.search(r"(?<![\w.-])" + re.escape(address) + r"(?![\w.-])", text))
    named.discard(f"{cluster.task_type} {cluster.task_index}")
    return named.pop() if len(named) == 1 else None
