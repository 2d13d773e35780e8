"""One training process from a validated config to its exit code: the
cluster, the lock on --model_dir, the strategy, the training, and what each
way of ending means to a launcher or to Kubernetes (see errors.py)."""

import os
import sys

from distributed_mpt import log_filter
from distributed_mpt.peer_watchdog import hold_stop_signals
from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import EXIT_ABORTED, EXIT_PEER_LOST, EXIT_USAGE, Preempted, UserError


def run(config: TrainConfig) -> int:
    """Trains as `config` says, in this process; returns the exit code."""
    with log_filter.filtering():
        return _run(config)


def _run(config: TrainConfig) -> int:
    lock, new_model_dir = None, None
    try:
        # Until the strategy exists, stop signals wait (see hold_stop_signals):
        # held before TensorFlow's first thread starts.
        with hold_stop_signals():
            from distributed_mpt.cluster import resolve_cluster
            cluster = resolve_cluster(os.environ)
            # TensorFlow is imported only now, behind the log filter, and
            # after the cheap checks.
            from distributed_mpt import distribution, outputs, run_lock, trainer
            strategy_name = distribution.resolve_strategy_name(
                config.strategy, cluster, config.cpu_replicas)
            if cluster is None or cluster.is_chief:
                if not os.path.exists(config.model_dir):
                    new_model_dir = config.model_dir
                # One run per model_dir, held until the end (the OS drops it
                # if the process dies); only the holder may clear debris.
                outputs.check_writable(config.model_dir)
                lock = run_lock.RunLock(config.model_dir)
                removed = lock.remove_debris()
                if removed:
                    print(f"removed what a killed run left: {', '.join(removed)}", flush=True)
            try:
                strategy = distribution.create_strategy(
                    strategy_name, config.cpu_replicas, config.communication, cluster,
                    config.peer_timeout_seconds)
            except distribution.PEER_ERRORS as e:
                return _lost_a_peer(e, cluster)
        try:
            trainer.train_and_evaluate(config, strategy, strategy_name, cluster)
        except distribution.PEER_ERRORS as e:
            return _lost_a_peer(e, cluster)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Preempted as e:
        print(f"{e}; exiting with {e.exit_code} so that a restart resumes", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        # During training Ctrl-C stops after a checkpoint (trainer.StopSignals);
        # this is before training started, or after the run was complete.
        print("interrupted: no training step was lost", file=sys.stderr)
        return EXIT_ABORTED
    except Exception as e:  # noqa: BLE001 - only a full disk is handled; the rest re-raised
        from distributed_mpt import outputs
        if not outputs.is_disk_full(e):
            raise
        # Checkpoints say this themselves; this is for the other files
        # (metrics, summary, export), each written whole or not at all.
        where = getattr(e, "filename", None) or config.model_dir
        print(f"error: no space left for {where}: free space in --model_dir={config.model_dir} "
              f"(see the README's \"Disk space\") and run the same command again to resume",
              file=sys.stderr, flush=True)
        return EXIT_USAGE
    finally:
        if lock is not None:
            # A run refused before it wrote anything leaves no trace.
            lock.release(remove_model_dir_if_unused=bool(new_model_dir))
    return 0


def _lost_a_peer(error: Exception, cluster) -> int:
    """A peer died (its node was lost, it was OOM-killed) and the collectives
    failed on this survivor: a retryable exit lets the launcher or Kubernetes
    restart the group from the latest checkpoint. Without a cluster the error
    is not about peers: it is raised again."""
    if cluster is None:
        raise error
    print(f"error: lost a peer of the multi-worker job ({type(error).__name__}: "
          f"{str(error).splitlines()[0][:200]}); exiting with {EXIT_PEER_LOST} so that "
          f"the group restarts from the latest checkpoint", file=sys.stderr, flush=True)
    return EXIT_PEER_LOST
