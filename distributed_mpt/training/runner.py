"""One training process from a validated config to its exit code: the
cluster, the lock on --model_dir, the strategy, the training, and what each
way of ending means to a launcher or to Kubernetes (see errors.py). How a
signal stops it, in each phase, is stopping.py's."""

import os
import sys

from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import (EXIT_PEER_LOST, EXIT_USAGE, ExitCode, Preempted, UserError,
                                    first_line)
from distributed_mpt.process import log_filter, stopping


def run(config: TrainConfig) -> int:
    """Trains as `config` says, in this process; returns the exit code."""
    with log_filter.filtering():
        with stopping.owning_stops():
            code = _run(config)
            stopped = stopping.requested()
    if stopped:
        # Saved, flushed and unlocked: all a stop asked for is done, and
        # TensorFlow's teardown at the interpreter's exit would only delay
        # the exit (by a minute, on a loaded machine).
        stopping.exit_now(code)
    return code


def _run(config: TrainConfig) -> int:
    lock, new_model_dir = None, None
    try:
        # The cheap checks first, without TensorFlow.
        from distributed_mpt import files
        from distributed_mpt.process import run_lock
        from distributed_mpt.process.cluster import resolve_cluster
        from distributed_mpt.process.startup_watchdog import StartupWatchdog
        from distributed_mpt.training import outputs
        cluster = resolve_cluster(os.environ)
        # A user's file where the run keeps a directory of its own (or the
        # reverse), a user's `export` that an export would replace, or a
        # directory of the user's files, is refused now, not after hours of
        # training; nothing of it is touched.
        outputs.check_layout(config.model_dir, export=config.export)
        if cluster is None or cluster.is_chief:
            outputs.check_ours(config.model_dir, adopt=config.adopt_model_dir)
            if not os.path.exists(config.model_dir):
                new_model_dir = config.model_dir
                # A stop before the lock: the directory goes if still empty.
                stopping.on_stop_before_training(lambda: os.rmdir(new_model_dir))
            # One run per model_dir, held until the end (the OS drops it if
            # the process dies); only the holder may mark it or clear debris.
            files.check_writable(config.model_dir)
            lock = run_lock.RunLock(config.model_dir)
            if new_model_dir:  # a stop before training leaves nothing new
                stopping.on_stop_before_training(lambda: lock.release(
                    remove_model_dir_if_unused=True, own_files=outputs.BEFORE_TRAINING))
            removed = outputs.remove_debris(config.model_dir, lock.previous_tags)
            if removed:
                print(f"removed what a killed run left: {', '.join(removed)}", flush=True)
            outputs.mark(config.model_dir)
        # Only TensorFlow's start-up runs with the stop signals held: no
        # handler of ours could interrupt it, so the start-up watchdog acts on
        # a stop in its place, and bounds the wait for the peers.
        peers = [a for a in cluster.addresses if a != cluster.own_address] if cluster else []
        deadline = config.peer_timeout_seconds if cluster else None
        watchdog = StartupWatchdog(deadline, peers, new_model_dir, outputs.BEFORE_TRAINING)
        with stopping.tensorflow_starting(), watchdog:
            # TensorFlow is imported only now, behind the log filter.
            from distributed_mpt.process import distribution
            from distributed_mpt.training.run import train_and_evaluate
            strategy_name = distribution.resolve_strategy_name(
                config.strategy, cluster, config.cpu_replicas)
            try:
                strategy = distribution.create_strategy(
                    strategy_name, config.cpu_replicas, config.communication, cluster)
            except distribution.PEER_ERRORS as e:
                return _lost_a_peer(e, cluster)
        stopping.enter(stopping.Phase.PREPARING)
        try:
            train_and_evaluate(config, strategy, strategy_name, cluster)
        except distribution.PEER_ERRORS as e:
            return _lost_a_peer(e, cluster)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Preempted as e:
        print(f"{e}; exiting with {e.exit_code:d} so that a restart resumes", file=sys.stderr)
        # Its traceback holds the training's TensorFlow objects: freeing them
        # is the teardown that stopping.exit_now skips.
        stopping.keep_until_exit(e)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - only a full disk is handled; the rest re-raised
        from distributed_mpt import files
        if not files.is_disk_full(e):
            raise
        # Checkpoints say this themselves; this is for the other files
        # (metrics, summary, export), each written whole or not at all.
        where = getattr(e, "filename", None) or config.model_dir
        print(f"error: no space left for {where}: free space in --model_dir={config.model_dir} "
              f"(docs/reliability.md, \"Disk space\") and run the same command again to resume",
              file=sys.stderr, flush=True)
        return EXIT_USAGE
    finally:
        if lock is not None:
            # A run refused before it wrote anything leaves no trace.
            from distributed_mpt.training.outputs import MARKER
            lock.release(remove_model_dir_if_unused=bool(new_model_dir), own_files=(MARKER,))
    return ExitCode.OK


def _lost_a_peer(error: Exception, cluster) -> int:
    """A peer died (its node was lost, it was OOM-killed) and the collectives
    failed on this survivor: a retryable exit lets the launcher or Kubernetes
    restart the group from the latest checkpoint. Without a cluster the error
    is not about peers: it is raised again."""
    if cluster is None:
        raise error
    print(f"error: lost a peer of the multi-worker job ({type(error).__name__}: "
          f"{first_line(error).rstrip(' :')}); exiting with {EXIT_PEER_LOST:d} so that "
          f"the group restarts from the latest checkpoint", file=sys.stderr, flush=True)
    return EXIT_PEER_LOST
