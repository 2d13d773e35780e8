"""One training process, from a validated config to its exit code, and the
run it trains.

`run`: the cluster, the lock on --model_dir, the strategy, the training, and
what each way of ending means to a launcher or to Kubernetes (see
errors.py). How a signal stops it, in each phase, is stopping.py's.

`train_and_evaluate`: load, plan, build, restore, train, evaluate, export.
Writes checkpoints, logs, metrics, `summary.json` and the export into
--model_dir (the chief; other workers use scratch directories).

The directory is checked and locked before TensorFlow starts: a refusal costs nothing, and
MultiWorkerMirroredStrategy must be created before any other TensorFlow op. So this module
imports TensorFlow, and the modules of the package that import it, only inside its functions
(tests/product/test_layout.py checks that importing it imports neither TensorFlow nor Keras).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import sys
import time
from typing import TYPE_CHECKING, Optional

from distributed_mpt import config as config_lib
from distributed_mpt import files
from distributed_mpt.cluster.environment import Cluster, resolve_cluster
from distributed_mpt.config import TrainConfig
from distributed_mpt.core import data, precision
from distributed_mpt.core.models.contract import FirstStepError
from distributed_mpt.core.models.signature import fingerprint, model_signature
from distributed_mpt.core.optim.schedules import REFERENCE_BATCH_SIZE
from distributed_mpt.errors import (ClusterError, ExitCode, Preempted, UserError, first_line,
                                    quoted)
from distributed_mpt.json_lines import finite_values
from distributed_mpt.process import console, log_filter, memory, run_lock, stopping
from distributed_mpt.process.startup_watchdog import StartupWatchdog
from distributed_mpt.training import PROGRESS_SECONDS, outputs

if TYPE_CHECKING:  # for the annotations only: at run time, imported where they are used
    import tensorflow as tf

    from distributed_mpt.training.build import Built
    from distributed_mpt.training.loop import Reporter
    from distributed_mpt.training.plan import RunPlan


def run(config: TrainConfig) -> int:
    """Trains as `config` says, in this process; returns the exit code."""
    with log_filter.filtering():
        with stopping.owning_stops():
            code = _run(config)
            stopped = stopping.requested()
    if stopped or code == ExitCode.PEER_LOST:
        # Saved, flushed and unlocked: all a stop asked for is done, and TensorFlow's
        # teardown at the interpreter's exit would only delay it (a minute, loaded).
        # A lost peer's survivor no longer heeds the launcher's SIGTERM (say_decided_error),
        # which ended it at once before: without this the launcher's grace ran out first.
        stopping.exit_now(code)
    return code


def _run(config: TrainConfig) -> int:
    lock, new_model_dir = None, None
    undone = (outputs.MARKER,)  # what of a new --model_dir a refusal removes
    try:
        # The cheap checks first, without TensorFlow.
        cluster = resolve_cluster(os.environ)
        # A user's file where a run keeps its own (outputs.check_layout), or a directory of
        # the user's files (check_ours), is refused now, not after hours of training; untouched.
        outputs.check_layout(config.run.model_dir, export=config.run.export)
        if cluster is None or cluster.is_chief:
            outputs.check_ours(config.run.model_dir, adopt=config.run.adopt_model_dir)
            if not os.path.exists(config.run.model_dir):
                new_model_dir = config.run.model_dir
                # A stop before the lock: the directory goes if still empty.
                stopping.on_stop_before_training(lambda: os.rmdir(new_model_dir))
            # One run per model_dir, held until the end (the OS drops it if
            # the process dies); only the holder may mark it or clear debris.
            if not (lock := run_lock.finished_read_only(config.run.model_dir, "summary.json")):
                files.check_writable(config.run.model_dir)
                outputs.check_parts_writable(config.run.model_dir, export=config.run.export)
                lock = run_lock.RunLock(config.run.model_dir)
                if new_model_dir:  # a stop before training leaves nothing new
                    stopping.on_stop_before_training(lambda: lock.release(
                        remove_model_dir_if_unused=True, own_files=outputs.BEFORE_TRAINING))
                if removed := outputs.remove_debris(config.run.model_dir, lock.previous_tags):
                    print(f"removed what a killed run left: {', '.join(removed)}", flush=True)
                outputs.mark(config.run.model_dir)
        # Only TensorFlow's start-up runs with the stop signals held: no handler of ours could
        # interrupt it: the start-up watchdog acts on a stop instead, and bounds the wait for peers.
        peers = [a for a in cluster.addresses if a != cluster.own_address] if cluster else []
        watchdog = StartupWatchdog(config.cluster.startup_deadline(cluster), peers, new_model_dir,
                                   outputs.BEFORE_TRAINING)
        with stopping.tensorflow_starting(), watchdog:
            # TensorFlow is imported only now, behind the log filter.
            from distributed_mpt.cluster.strategy import PEER_ERRORS
            try:
                strategy_name, strategy = config.cluster.create_strategy(cluster)
            except PEER_ERRORS as e:
                return _lost_a_peer(e, cluster)
        stopping.enter(stopping.Phase.PREPARING)
        check_held = lock.check_still_held if lock else lambda: None
        try:
            train_and_evaluate(config, strategy, strategy_name, cluster, check_held)
        except PEER_ERRORS as e:
            return _lost_a_peer(e, cluster)
        except Exception:  # a write that failed as --model_dir was taken away says so
            if lock is not None and not lock.is_in_place():
                check_held()
            raise
    except UserError as e:
        stopping.say_decided_error(e)
        if isinstance(e, FirstStepError):  # nothing trained: a new --model_dir goes
            undone = outputs.BEFORE_TRAINING
        return e.exit_code
    except Preempted as e:
        print(f"{e}; exiting with {e.exit_code:d} so that a restart resumes", file=sys.stderr)
        # Its traceback holds the training's TensorFlow objects: freeing them
        # is the teardown that stopping.exit_now skips.
        stopping.keep_until_exit(e)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - only a write that cannot succeed; the rest re-raised
        # Checkpoints say this themselves; this is for the other files (metrics, summary,
        # export), each written whole or not at all. A rename names the file it replaces second.
        where = getattr(e, "filename2", None) or getattr(e, "filename", None)
        ours = isinstance(e, OSError) and where and os.path.realpath(str(where)).startswith(
            os.path.join(os.path.realpath(config.run.model_dir), ""))
        why = files.why_unwritable(e)
        if why is None or not (files.is_disk_full(e) or ours):
            raise
        where = where or config.run.model_dir
        problem, fix = ((f"no space left for {where}", f"free space in --model_dir="
                         f"{config.run.model_dir} (docs/reliability.md, \"Disk space\")")
                        if files.is_disk_full(e) else
                        (f"cannot write {where} ({why})", "free it of what holds it (a mount)"
                         if e.errno == errno.EBUSY else "make it writable for this user"))
        stopping.say_decided_error(f"{problem}: {fix} and run the same command again to resume")
        return ExitCode.USAGE
    finally:
        if lock is not None:
            # A run refused before it wrote anything leaves no trace; nor
            # does a user's model that failed in a new run's first step.
            lock.release(remove_model_dir_if_unused=bool(new_model_dir), own_files=undone)
    return ExitCode.OK


def _lost_a_peer(error: Exception, cluster) -> int:
    """A peer died (its node lost, OOM-killed) and the collectives failed on this survivor:
    a retryable exit lets the launcher or Kubernetes restart the group from the latest
    checkpoint. Without a cluster the error is not about peers: it is raised again."""
    if cluster is None:
        raise error
    from distributed_mpt.cluster.strategy import peer_named
    where = "".join(f" {quoted(first_line(note))}"  # one line, whoever added the note
                    for note in getattr(error, "__notes__", ()))
    if peer := peer_named(error, cluster):  # it may have failed on its own: 141 is not the why
        where += f": TensorFlow's error names {peer} as the peer cut off (its output says more)"
    stopping.say_decided_error(
        f"lost a peer of the multi-worker job ({type(error).__name__}: "
        f"{first_line(error).rstrip(' :')}){where}; exiting with {ExitCode.PEER_LOST:d} so that a "
        f"restart of the group resumes from its latest checkpoint (from step 0 if none was saved)")
    return ExitCode.PEER_LOST


def train_and_evaluate(config: TrainConfig, strategy: tf.distribute.Strategy, strategy_name: str,
                       cluster: Optional[Cluster], check_held=lambda: None) -> dict:
    """Trains, evaluates and exports as `config` says; returns the summary.
    check_held() raises if --model_dir is no longer this run's (RunLock)."""
    import keras

    from distributed_mpt.cluster.strategy import peak_resident_bytes
    from distributed_mpt.training.build import build, recalibrate_batch_norm, train_input
    from distributed_mpt.training.checkpoints import Checkpoints, model_identity
    from distributed_mpt.training.loop import Reporter, TrainingLoop
    from distributed_mpt.training.plan import (Resumption, check_workers_agree, continue_with,
                                               leave_together, plan_run, refuse_other_data,
                                               refuse_other_training, resume, start_warnings)
    started = time.monotonic()
    is_chief = cluster is None or cluster.is_chief
    if cluster and cluster.num_workers > 1:  # before building, which calls the collectives
        check_workers_agree(strategy, {"resolved precision": precision.resolve_precision(
            config.run.precision)}, config_lib.shared_flags(config), {})
    reading = f"reading --dataset={config.data.dataset}"  # 100,000 images: minutes
    with console.lines_while(reading, PROGRESS_SECONDS, say=is_chief):
        dataset = config.data.load(config.run.seed, headroom=memory.headroom())
    plan = plan_run(config, strategy.num_replicas_in_sync,
                    cluster.num_workers if cluster else 1, len(dataset.train))
    precision.set_precision(plan.policy)
    keras.utils.set_random_seed(config.run.seed)
    built = build(config, plan, strategy, dataset)
    trainer = built.trainer

    worker = None if is_chief else f"{cluster.task_type}-{cluster.task_index}"
    identity = model_identity(trainer.model, plan.policy, config.model.spec.identity)
    signature = model_signature(config.model.spec, trainer.model)
    checkpoints = Checkpoints(config.run.model_dir, worker, identity, check_held,
                              **built.checkpointables)
    try:  # a non-chief's scratch directory goes, however the run ends
        # This worker's refusal of its --model_dir is said after the agreement:
        # the others would wait there for it, and exit 141 as if it were lost.
        refusal = None
        try:
            refuse_other_data(checkpoints, config, dataset.fingerprint)
            if is_chief and checkpoints.on_disk():
                print(f"restoring the newest intact checkpoint of {config.run.model_dir}",
                      flush=True)
            resumed = resume(checkpoints, trainer.step, config.run.model_dir, plan.total_steps)
        except UserError as e:
            if plan.num_workers == 1:
                raise
            refusal, resumed = e, Resumption(start_step=0)
        if plan.num_workers > 1:  # before any of them acts on what it found
            # Each worker restores its own --model_dir: one that is not the
            # chief's may hold another checkpoint of the same step.
            weights = hashlib.sha256()  # a weight at a time: no second copy of the model
            for w in trainer.model.weights if resumed.restored else ():
                weights.update(w.numpy().reshape(-1).view("uint8"))  # any dtype's bytes
            facts = {**resumed.agreement(plan), "restored weights": resumed.restored and
                     weights.hexdigest()[:8] or "none", "refused --model_dir": refusal is not None}
            try:
                check_workers_agree(strategy, facts, {}, {"model file (and the modules it imports)":
                                    fingerprint(signature), "images": dataset.fingerprint})
            except ClusterError as disagreement:
                raise refusal or disagreement
        if refusal:
            raise refusal
        refuse_other_training(resumed, config, signature)  # finished or not: never silently
        writes = run_lock.Writes(check_held, plan.num_workers == 1, trainer.request_stop)
        writes.finishing = resumed.finished  # no step to train: what is left finishes the run
        if resumed.finished:
            if is_chief:
                _finished_again(config, resumed, built, dataset.info, writes)
            leave_together(strategy, plan.num_workers, writes)
            return resumed.finished_summary
        check_held()  # before any write: a run on a read-only mount stops here (run_lock.ReadOnly)
        reporter = Reporter(config.run.model_dir, is_chief, plan.total_steps, resumed.start_step,
                            started, config.evaluation.evaluate, check_held)
        completed = False
        try:
            if is_chief:  # written first, so that even a run that crashes says what it was
                # (in a new --model_dir, a user's model refused in the first step takes it along)
                files.write_json(f"{config.run.model_dir}/config.json", _config_record(
                    config, plan, strategy_name, dataset, resumed, signature))
                reporter.say(_start_line(config, plan, strategy_name))
                for warning in start_warnings(config, plan, len(dataset.train)):
                    files.warn(warning)
            for note in (*built.notes, *continue_with(resumed, plan, built.trained_global_batch)):
                reporter.say(note)

            stopping.enter(stopping.Phase.TRAINING, on_request=trainer.request_stop)
            loop = TrainingLoop(trainer, config, plan, checkpoints, reporter,
                                lambda *phase: train_input(trainer, config, plan, *phase), writes)
            train_metrics, throughput = loop.run(dataset.train, dataset.test, resumed.start_step)
            # A stop requested from here on lets the run finish: what is left
            # (evaluation, export) is what makes it complete.
            stopping.enter(stopping.Phase.FINISHING)
            writes.finishing = True
            summary = _summary(built, config, plan, strategy_name, resumed.start_step,
                               train_metrics, throughput)  # recalibrating changes none of it
            summary["bn_recalibration"] = recalibrate_batch_norm(
                trainer, config, plan, dataset.train, checkpoints, reporter, writes)
            # The train split (150 MB for CIFAR-10, shared with its pipeline) is done with:
            # evaluation and the export grow from what is left (--data_on_device keeps its copy).
            dataset = dataclasses.replace(dataset, splits={"test": dataset.test})
            _evaluate_and_export(built, config, dataset, reporter, summary, is_chief, writes,
                                 loop.check_evaluation)
            summary["wall_seconds"] = time.monotonic() - started  # the export included
            # This process's, from its start to the end of the export (this
            # segment only, where the run resumed; the chief's, of several workers).
            summary["peak_memory_bytes"] = peak_resident_bytes()
            if is_chief:  # a loss that overflowed is null, not a file no reader takes
                writes(files.write_json, f"{config.run.model_dir}/summary.json",
                       finite_values(summary))
            leave_together(strategy, plan.num_workers, writes)
            completed = True
            return summary
        finally:
            # A run stopped (even while it finished) or failed: its pod's grace period
            # is for the checkpoint, not the final progress report (docs/clusters.md).
            reporter.close(early=not completed or stopping.requested())
    finally:
        checkpoints.close()


def _finished_again(config: TrainConfig, resumed, built: Built, info, writes) -> None:
    """A finished run started again: its results stay exactly as they are,
    but an export that was lost is made again."""
    print(f"{config.run.model_dir} holds a finished run of {resumed.start_step} steps (see "
          f"summary.json); nothing to train. To train longer, pass a larger --epochs or "
          f"--train_steps.", flush=True)
    previous, asked = config_lib.flat_record(resumed.previous_config), config.evaluation
    tta, fraction = (previous.get(name, config_lib.DEFAULTS[name])
                     for name in ("eval_tta", "eval_tta_fraction"))
    if asked.evaluate and (tta, fraction) != (asked.eval_tta, asked.eval_tta_fraction):
        # Other test-time views asked of a finished run: say what does it.
        print(f"Its test results are with --eval_tta={tta} --eval_tta_fraction={fraction}; to "
              f"score it with others: distributed-mpt-predict --model_dir={config.run.model_dir} "
              f"--evaluate --tta={asked.eval_tta} --tta_fraction={asked.eval_tta_fraction}",
              flush=True)
    if config.run.export and not outputs.export_is_whole(config.run.model_dir):
        stopping.enter(stopping.Phase.FINISHING)  # as any export: it completes
        # What the run trained on, not what this command line says (nor what the folder
        # holds now: a run from before fingerprints was not compared on this resume).
        resolved = previous.get("resolved") if isinstance(previous.get("resolved"), dict) else {}
        record = outputs.model_info({**config.flags(), **previous}, resumed.finished_summary,
                                    resolved.get("data_fingerprint"))
        path = writes(outputs.export_model, built.trainer.model, config.run.model_dir,
                      info.class_names, info.image_shape, record, writes.check_held)
        if path:  # not if the chief lost its lock (run_lock.Writes)
            print(f"its export was missing or incomplete: exported again to {path}", flush=True)


def _config_record(config: TrainConfig, plan: RunPlan, strategy_name: str,
                   dataset: data.Dataset, resumed, signature: dict) -> dict:
    """config.json: the flags by section (config.flat_record reads them back by name, as
    it reads a flat file of before), the step this segment of the run starts at, and under
    "resolved" what `auto` and the per-model defaults became on this machine, what the model
    was built for (predict rebuilds it from a checkpoint with it, and checks it is the
    network `signature` records) and the data's fingerprint (a resume compares it). Under
    "earlier", the records of the segments before, oldest first: a resume may change the
    run's length, batch or evaluation, and the file says what every step was trained with."""
    previous = dict(resumed.previous_config)
    earlier = previous.pop("earlier", []) + ([previous] if previous else [])
    return {**dataclasses.asdict(config), "from_step": resumed.start_step, "earlier": earlier,
            "resolved": {"precision": plan.policy, "strategy": strategy_name,
                         "num_workers": plan.num_workers, "num_replicas": plan.num_replicas,
                         "global_batch_size": plan.global_batch_size,
                         "peak_learning_rate": plan.learning_rate, "total_steps": plan.total_steps,
                         "warmup_steps": plan.warmup_steps,
                         "dataset_info": dataclasses.asdict(dataset.info),
                         "data_fingerprint": dataset.fingerprint, "model_signature": signature}}


def _start_line(config: TrainConfig, plan: RunPlan, strategy_name: str) -> str:
    """What the run will do, and why: the precision and what decided it, the
    strategy, the global batch, and the learning rate with its rule."""
    rate_rule = config.optimizer.describe_rate(plan.global_batch_size, plan.learning_rate)
    return (f"{config.model.spec.name} on {config.data.dataset}: "
            f"{precision.describe_precision_choice(config.run.precision)}; {strategy_name} strategy, "
            f"{plan.num_workers} worker(s), {plan.num_replicas} replica(s); global batch "
            f"{plan.global_batch_size} = {config.run.per_replica_batch_size} per replica x "
            f"{plan.num_replicas}; peak learning rate {plan.learning_rate:g} = {rate_rule}, "
            f"{config.schedule.describe(plan.warmup_steps)}; "
            f"{plan.total_steps} steps ({plan.steps_per_epoch} per epoch)")


def _summary(built: Built, config: TrainConfig, plan: RunPlan, strategy_name: str,
             start_step: int, train_metrics: dict, throughput: Optional[float]) -> dict:
    """What summary.json says of a run, before its evaluation."""
    import keras
    import tensorflow as tf

    from distributed_mpt.cluster.strategy import describe_devices
    steps = int(built.trainer.step.numpy())
    return {
        "strategy": strategy_name, "num_workers": plan.num_workers,
        "num_replicas": plan.num_replicas, "per_replica_batch_size": config.run.per_replica_batch_size,
        "global_batch_size": plan.global_batch_size, "precision": plan.policy,
        "model": config.model.spec.name, "dataset": config.data.dataset, "steps": steps,
        "epochs": steps / plan.steps_per_epoch, "learning_rate": plan.learning_rate,
        "reference_batch_size": REFERENCE_BATCH_SIZE, "device": describe_devices(),
        "train_loss": train_metrics.get("loss"), "train_accuracy": train_metrics.get("accuracy"),
        "examples_per_second": throughput, "resumed_from_step": start_step,
        "eval_loss": None, "eval_accuracy": None, "eval_examples": 0, "eval_tta": config.evaluation.eval_tta,
        "tensorflow_version": tf.__version__, "keras_version": keras.__version__,
    }


def _evaluate_and_export(built: Built, config: TrainConfig, dataset: data.Dataset,
                         reporter: Reporter, summary: dict, export_model: bool, writes,
                         check) -> None:
    """Evaluates the trained model into `summary` (`check` refuses one not finite), and
    exports it if `export_model` (the chief) and the config say so; both write through
    `writes` (run_lock.Writes), the evaluation's collectives whatever they find."""
    # What training freed goes back to the system first, and what evaluation freed before
    # the export: each grows from what is in use, not the phase before's peak (process/memory.py).
    memory.release_freed_memory()
    if config.evaluation.evaluate:
        with reporter.doing(f"evaluating on the {len(dataset.test)} test images", say=True):
            result = built.trainer.evaluate(dataset.test)
        check(result, summary["steps"])  # every worker alike: their results are the same
        summary.update(result)
        # Logged like the evaluations during training: the accuracy curve ends where the run ends.
        writes(reporter.log, summary["steps"], {"epoch": summary["epochs"], **result})
    if export_model and config.run.export:
        memory.release_freed_memory()
        # The export says what it learned, so that its users can tell a
        # smoke test's model from a real one (distributed-mpt-predict does).
        with reporter.doing("exporting the model"):
            path = writes(outputs.export_model, built.trainer.model, config.run.model_dir,
                          dataset.info.class_names, dataset.info.image_shape,
                          outputs.model_info(config.flags(), summary, dataset.fingerprint),
                          writes.check_held)
        if path:
            reporter.say(f"exported to {path}")
