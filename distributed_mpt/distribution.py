"""One function from a strategy name to a `tf.distribute.Strategy`.

Call `create_strategy` before any other TensorFlow op: logical CPU devices
can only be configured, and MultiWorkerMirroredStrategy only created, before
the runtime starts.
"""

import os
import subprocess
import sys
from typing import Optional

import tensorflow as tf

from distributed_mpt.cluster import Cluster
from distributed_mpt.errors import ConfigError

_COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def resolve_strategy_name(name: str, cluster: Optional[Cluster], cpu_replicas: int) -> str:
    """Turns `auto` into a concrete strategy for this process and its devices."""
    if name == "multi_worker" and cluster is None:
        raise ConfigError("--strategy=multi_worker needs a cluster: set TF_CONFIG, run as a "
                          "Kubernetes indexed Job, under SLURM, or use distributed-mpt-launch")
    if cluster is not None and cluster.num_workers > 1 and name not in ("auto", "multi_worker"):
        raise ConfigError(f"--strategy={name} with a cluster of {cluster.num_workers} workers "
                          f"would train {cluster.num_workers} separate models: use "
                          f"--strategy=multi_worker (or auto), or unset TF_CONFIG")
    if name != "auto":
        return name
    if cluster is not None and cluster.num_workers > 1:
        return "multi_worker"
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    if num_gpus > 1 or cpu_replicas > 1:
        return "mirrored"
    return "one_device" if num_gpus == 1 else "default"


def create_strategy(name: str, cpu_replicas: int = 0, communication: str = "auto",
                    cluster: Optional[Cluster] = None,
                    peer_timeout_seconds: int = 300) -> tf.distribute.Strategy:
    """Creates strategy `name` (already resolved, not `auto`).

    mirrored: every local GPU, or `cpu_replicas` logical CPU devices when set.
    multi_worker: MultiWorkerMirroredStrategy over `cluster`; exits with a
    message naming the unreachable peers if they are not all up within
    `peer_timeout_seconds`.
    """
    if cpu_replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(cpu_replicas)])
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_physical_devices("GPU")
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
    if name == "mirrored":
        if cpu_replicas:
            return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(cpu_replicas)])
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        return _multi_worker(cluster, communication, peer_timeout_seconds)
    raise ConfigError(f"unknown strategy {name!r}")


def _multi_worker(cluster: Cluster, communication: str, peer_timeout_seconds: int):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.tf_config["cluster"]), task_type=cluster.task_type,
        task_id=cluster.task_index, rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=_COMMUNICATION[communication])
    # Without a deadline a worker whose peers never start waits for an hour
    # (the coordination service's timeout), silently. The watchdog is a
    # separate process because this one blocks inside TensorFlow's C++ code,
    # where no Python thread or signal handler gets to run.
    others = [a for a in cluster.addresses if a != cluster.own_address]
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()),
                                 str(peer_timeout_seconds), *others])
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(resolver, communication_options=options)
        # The first collective completes only once every peer has joined.
        tf.function(lambda: strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None))()
    finally:
        watchdog.kill()
        watchdog.wait()
    return strategy


# Run by a child process: after the timeout, name the peers that do not
# accept connections and end the parent with SIGALRM, whose default action
# terminates it (exit status 142 = 128 + SIGALRM, retryable).
_WATCHDOG = r"""
import os, signal, socket, sys, time
parent, timeout, peers = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    if os.getppid() != parent:
        sys.exit(0)
    time.sleep(0.25)
def up(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False
missing = [p for p in peers if not up(p)] or peers
print(f"error: peers not up after {timeout:g}s (--peer_timeout_seconds): waited for "
      f"{', '.join(missing)}; check that every worker was started with the same cluster",
      file=sys.stderr, flush=True)
os.kill(parent, signal.SIGALRM)
"""


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "CPU"
