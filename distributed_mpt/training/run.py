"""One training run, from data to export: load, plan, build, restore, train,
evaluate, export. Writes checkpoints, logs, metrics, `summary.json` and the
export into --model_dir (the chief; other workers use scratch directories)."""

import dataclasses
import time
from typing import Optional

import keras
import tensorflow as tf

from distributed_mpt import config as config_lib
from distributed_mpt.training import datasets, distribution, optimization, outputs, precision
from distributed_mpt.process import stopping
from distributed_mpt.training.checkpointing import Checkpoints, model_identity
from distributed_mpt.process.cluster import Cluster
from distributed_mpt.config import TrainConfig
from distributed_mpt.training.loop import TrainingLoop
from distributed_mpt.training.plan import RunPlan, plan_run
from distributed_mpt.training.reporting import Reporter
from distributed_mpt.training.resumption import continue_with, refuse_other_data, resume
from distributed_mpt.training.trainer import Trainer


def train_and_evaluate(config: TrainConfig, strategy: tf.distribute.Strategy,
                       strategy_name: str, cluster: Optional[Cluster]) -> dict:
    """Trains, evaluates and exports as `config` says; returns the summary."""
    started = time.monotonic()
    is_chief = cluster is None or cluster.is_chief
    train_split, test_split = datasets.load_dataset(
        config.dataset, config.data_dir, config.download, config.synthetic_examples, config.seed)
    plan = plan_run(config, strategy.num_replicas_in_sync,
                    cluster.num_workers if cluster else 1, len(train_split))
    precision.set_precision(plan.policy)
    keras.utils.set_random_seed(config.seed)
    trainer = Trainer(config, plan, strategy, train_split)

    worker = None if is_chief else f"{cluster.task_type}-{cluster.task_index}"
    checkpoints = Checkpoints(config.model_dir, worker, model_identity(trainer.model, plan.policy),
                              **trainer.checkpointables)
    try:  # a non-chief's scratch directory goes, however the run ends
        resumed = resume(checkpoints, trainer.step, config.model_dir, plan.total_steps)
        if plan.num_workers > 1:  # before any of them acts on what it found
            trainer.check_workers_agree(resumed.agreement(plan), config_lib.shared_flags(config))
        refuse_other_data(resumed, config)  # finished or not: never silently
        if resumed.finished:
            # A finished run started again: its results stay exactly as they
            # are, but an export that was lost is made again.
            if is_chief:
                print(f"{config.model_dir} holds a finished run of {resumed.start_step} steps "
                      f"(see summary.json); nothing to train. To train longer, pass a larger "
                      f"--epochs or --train_steps.", flush=True)
                if config.export and not outputs.export_is_whole(config.model_dir):
                    stopping.enter(stopping.Phase.FINISHING)  # as any export: it completes
                    # What the run trained on, not what this command line says.
                    trained = {**dataclasses.asdict(config), **resumed.previous_config}
                    info = outputs.model_info(trained, resumed.finished_summary)
                    print(f"its export was missing or incomplete: exported again to "
                          f"{outputs.export_model(trainer.model, config.model_dir, info)}",
                          flush=True)
            return resumed.finished_summary
        reporter = Reporter(config.model_dir, is_chief, plan.total_steps, resumed.start_step,
                            started, evaluates_at_end=config.evaluate)
        try:
            if is_chief:  # written first, so that even a run that crashes says what it was
                outputs.write_json(f"{config.model_dir}/config.json",
                                   _config_record(config, plan, strategy_name))
            reporter.say(_start_line(config, plan, strategy_name))
            for note in continue_with(resumed, plan, trainer.trained_global_batch):
                reporter.say(note)

            stopping.enter(stopping.Phase.TRAINING, on_request=trainer.request_stop)
            train_metrics, throughput = TrainingLoop(trainer, checkpoints, reporter).run(
                train_split, test_split, resumed.start_step)
            # A stop requested from here on lets the run finish: what is left
            # (evaluation, export) is what makes it complete.
            stopping.enter(stopping.Phase.FINISHING)
            summary = _summary(trainer, strategy_name, resumed.start_step, train_metrics,
                               throughput)
            _evaluate_and_export(trainer, test_split, reporter, summary, export=is_chief)
            summary["wall_seconds"] = time.monotonic() - started  # the export included
            if is_chief:
                outputs.write_json(f"{config.model_dir}/summary.json", summary)
            return summary
        finally:
            reporter.close()
    finally:
        checkpoints.close()


def _config_record(config: TrainConfig, plan: RunPlan, strategy_name: str) -> dict:
    """config.json: the flags as given, and under "resolved" what `auto` and
    the per-model defaults became on this machine."""
    return {**dataclasses.asdict(config),
            "resolved": {"precision": plan.policy, "strategy": strategy_name,
                         "num_workers": plan.num_workers, "num_replicas": plan.num_replicas,
                         "global_batch_size": plan.global_batch_size,
                         "peak_learning_rate": plan.learning_rate, "total_steps": plan.total_steps,
                         "warmup_steps": plan.warmup_steps}}


def _start_line(config: TrainConfig, plan: RunPlan, strategy_name: str) -> str:
    """What the run will do, and why: the precision and what decided it, the
    strategy, the global batch, and the learning rate with its rule."""
    scaled = optimization.scaled_learning_rate(config.learning_rate, plan.global_batch_size)
    rate_rule = (f"{config.learning_rate:g} x {plan.global_batch_size}/"
                 f"{optimization.REFERENCE_BATCH_SIZE}")
    if plan.learning_rate < scaled:
        rate_rule += f" = {scaled:g}, capped at --max_learning_rate={config.max_learning_rate:g}"
    return (f"{config.model} on {config.dataset}: "
            f"{precision.describe_precision_choice(config.precision)}; {strategy_name} strategy, "
            f"{plan.num_workers} worker(s), {plan.num_replicas} replica(s); global batch "
            f"{plan.global_batch_size} = {config.per_replica_batch_size} per replica x "
            f"{plan.num_replicas}; peak learning rate {plan.learning_rate:g} = {rate_rule}, "
            f"{config.lr_schedule} schedule with {plan.warmup_steps} warmup steps; "
            f"{plan.total_steps} steps ({plan.steps_per_epoch} per epoch)")


def _summary(trainer: Trainer, strategy_name: str, start_step: int, train_metrics: dict,
             throughput: Optional[float]) -> dict:
    """What summary.json says of a run, before its evaluation."""
    config, plan = trainer.config, trainer.plan
    steps = int(trainer.step.numpy())
    summary = {
        "strategy": strategy_name, "num_workers": plan.num_workers,
        "num_replicas": plan.num_replicas, "per_replica_batch_size": config.per_replica_batch_size,
        "global_batch_size": plan.global_batch_size, "precision": plan.policy,
        "model": config.model, "dataset": config.dataset, "steps": steps,
        "epochs": steps / plan.steps_per_epoch, "learning_rate": plan.learning_rate,
        "reference_batch_size": optimization.REFERENCE_BATCH_SIZE,
        "train_loss": train_metrics.get("loss"), "train_accuracy": train_metrics.get("accuracy"),
        "examples_per_second": throughput, "resumed_from_step": start_step,
        "eval_loss": None, "eval_accuracy": None, "eval_examples": 0, "eval_tta": config.eval_tta,
        "device": distribution.describe_devices(),
        "tensorflow_version": tf.__version__, "keras_version": keras.__version__,
    }
    return summary


def _evaluate_and_export(trainer: Trainer, test_split, reporter: Reporter, summary: dict,
                         export: bool) -> None:
    """Evaluates the trained model into `summary`, and exports it if
    `export` (the chief) and the config say so."""
    config, steps = trainer.config, summary["steps"]
    if config.evaluate:
        reporter.say(f"evaluating on the {len(test_split)} test images")
        result = trainer.evaluate(test_split)
        summary.update(result)
        # Logged like the evaluations during training, so that the accuracy
        # curve ends where the run ends.
        reporter.log(steps, {"epoch": summary["epochs"], **result})
    if export and config.export:
        # The export says what it learned, so that its users can tell a
        # smoke test's model from a real one (distributed-mpt-predict does).
        info = outputs.model_info(dataclasses.asdict(config), summary)
        reporter.say(f"exported to {outputs.export_model(trainer.model, config.model_dir, info)}")
