"""What a run learns from its cluster and tells it: where this process sits
among the workers (environment.py: TF_CONFIG, JobSet, an indexed Job,
SLURM), the `tf.distribute` strategy over them (strategy.py), and the
progress a Kubeflow TrainJob shows (trainjob_progress.py). It imports only
itself and the leaves (errors.py, files.py): it knows nothing of models or
training."""

import dataclasses

from distributed_mpt.options import Options, option, require, require_at_most, require_positive

_MAX_CPU_REPLICAS = 64  # logical devices: TensorFlow stalls creating 100,000
_MAX_PEER_TIMEOUT_SECONDS = 7 * 24 * 3600  # peers not up in a week: waiting for nothing


@dataclasses.dataclass(frozen=True)
class ClusterOptions(Options):
    """Which strategy a run takes over its devices and workers, and how long
    it waits for its peers."""

    strategy: str = option("auto", "auto picks multi_worker for a cluster, mirrored for "
                           "several GPUs or --cpu_replicas, one_device for one GPU, else "
                           "default.", ("auto", "default", "one_device", "mirrored", "multi_worker"))
    cpu_replicas: int = option(0, "Split the CPU into N logical devices so that mirrored runs "
                               "N replicas without GPUs (for tests and experiments); 0: off.")
    communication: str = option("auto", "Collective implementation for multi_worker: nccl on "
                                "GPUs (needs a large /dev/shm in containers), ring (gRPC) on "
                                "CPUs.", ("auto", "ring", "nccl"))
    peer_timeout_seconds: int = option(300, "multi_worker: give up if the peers are not all up "
                                       "after this long.")

    def check(self) -> None:
        require_positive(self, "peer_timeout_seconds")
        require_at_most(self, _MAX_CPU_REPLICAS, "cpu_replicas")
        require_at_most(self, _MAX_PEER_TIMEOUT_SECONDS, "peer_timeout_seconds")
        require(self.cpu_replicas >= 0,
                f"--cpu_replicas={self.cpu_replicas} must be >= 0 (0: do not split the CPU)")
        require(self.cpu_replicas == 0 or self.strategy in ("auto", "mirrored"),
                f"--cpu_replicas={self.cpu_replicas} needs --strategy=mirrored (or auto); "
                f"--strategy={self.strategy} runs one replica per worker")

    def check_for_workers(self, num_workers: int) -> None:
        """Raises ConfigError for what a job of `num_workers` cannot do: of
        several, a strategy of one worker (each would train a model of its
        own), or --cpu_replicas (auto is multi_worker there, one replica a
        worker on its whole CPU: the split was ignored, the start line
        counting one replica a worker). Here, not at the strategy's
        creation, so that the launcher refuses it before any worker starts."""
        require(num_workers < 2 or self.strategy in ("auto", "multi_worker"),
                f"--strategy={self.strategy} in a job of {num_workers} workers would train "
                f"{num_workers} separate models: use --strategy=multi_worker (or auto); for "
                f"one process, start one worker (--num_workers=1, or no cluster in the "
                f"environment)")
        require(num_workers < 2 or not self.cpu_replicas,
                f"--cpu_replicas={self.cpu_replicas} in a job of {num_workers} workers: "
                f"multi_worker trains one replica a worker, on its whole CPU; drop "
                f"--cpu_replicas (for more replicas, start more workers)")

    def startup_deadline(self, cluster):
        """How long TensorFlow's start-up may wait for the peers of `cluster` (None: none)."""
        return self.peer_timeout_seconds if cluster else None

    def create_strategy(self, cluster):
        """(the strategy's name, `auto` resolved for this process, the strategy);
        strategy.py's errors as there."""
        from distributed_mpt.cluster.strategy import create_strategy, resolve_strategy_name

        self.check_for_workers(cluster.num_workers if cluster else 1)
        name = resolve_strategy_name(self.strategy, cluster, self.cpu_replicas)
        return name, create_strategy(name, self.cpu_replicas, self.communication, cluster)
