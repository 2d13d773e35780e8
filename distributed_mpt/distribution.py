"""One function from a strategy name to a `tf.distribute.Strategy`.

Call `create_strategy` before any other TensorFlow op: logical CPU devices
can only be configured, and MultiWorkerMirroredStrategy only created, before
the runtime starts.
"""

import os
import socket
import sys
import threading
from typing import Optional

import tensorflow as tf

from distributed_mpt.cluster import Cluster
from distributed_mpt.errors import EXIT_PEER_TIMEOUT, ConfigError

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
    gpus = tf.config.list_logical_devices("GPU")
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
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
    # Without a deadline a worker whose peers never start waits forever (the
    # coordination service's own timeout is an hour); this says who is missing.
    watchdog = _PeerWatchdog(cluster, peer_timeout_seconds)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(resolver, communication_options=options)
    # The first collective completes only once every peer has joined.
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    watchdog.cancel()
    return strategy


class _PeerWatchdog:
    """Ends the process with a clear message if peers are not up in time."""

    def __init__(self, cluster: Cluster, timeout_seconds: int):
        self._cluster = cluster
        self._timeout = timeout_seconds
        self._timer = threading.Timer(timeout_seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        others = [a for a in self._cluster.addresses if a != self._cluster.own_address]
        missing = [a for a in others if not _accepts_connections(a)] or others
        print(f"error: peers not up after {self._timeout}s (--peer_timeout_seconds): waited for "
              f"{', '.join(missing)}; check that every worker was started with the same cluster",
              file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_TIMEOUT)  # the main thread is blocked inside TensorFlow


def _accepts_connections(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False
