"""A run whose --epochs come to few steps (an epoch of fewer than about 20, a
run of fewer than about 200) says so at its start, with a batch size and
epochs that would give more; a run of the steps it asked for does not."""

import pytest

from conftest import assert_ok, train
from distributed_mpt.config import DEFAULTS, TrainConfig
from distributed_mpt.training.plan import (SHORT_EPOCH_STEPS, SHORT_RUN_STEPS, plan_run,
                                           short_run, start_warnings)


def _warning(examples, replicas=1, **flags):
    config = TrainConfig.from_flags(model_dir="unused", **flags)
    return short_run(config, plan_run(config, replicas, 1, examples), examples)[0]


def test_a_run_of_few_steps_warns_once_at_its_start_with_a_batch_that_gives_more(model_dir):
    # 1,414 images at batch 256: 5 steps an epoch, 10 in all.
    result = train(["--dataset=synthetic", "--synthetic_examples=1414", "--model=mlp",
                    "--per_replica_batch_size=256", "--epochs=2", "--noevaluate", "--noexport",
                    "--precision=float32", f"--model_dir={model_dir}"])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: this run trains 10 steps (5 per epoch: 1,414 training images in global "
        "batches of 256), too few to learn much; --per_replica_batch_size=64 and --epochs=10 "
        "would train 220 (22 per epoch)"], result.stderr[-2000:]
    assert result.stdout.index("10 steps (5 per epoch)") < result.stdout.index("step ")


@pytest.mark.parametrize("examples, replicas, flags", [
    (1414, 1, {"per_replica_batch_size": 1024, "epochs": 5}),  # the docs' own images, once
    (1414, 2, {"per_replica_batch_size": 512, "epochs": 5}),
    (50_000, 1, {"per_replica_batch_size": 128, "epochs": 0.2}),  # long epochs, a short run
    (50_000, 4, {"per_replica_batch_size": 1024, "epochs": 3}),   # short epochs, 48 steps
    (30, 1, {"per_replica_batch_size": 8, "epochs": 1}),
])
def test_what_the_warning_suggests_is_a_run_it_would_not_warn_of(examples, replicas, flags):
    said = _warning(examples, replicas, **flags)
    assert said
    suggested = dict(flags)
    for option in said.split("; ")[1].split(" would")[0].split(" and "):
        name, value = option.removeprefix("--").split("=")
        suggested[name] = type(DEFAULTS[name])(value)
    assert suggested != flags
    plan = plan_run(TrainConfig.from_flags(model_dir="unused", **suggested), replicas, 1, examples)
    assert plan.steps_per_epoch >= SHORT_EPOCH_STEPS and plan.total_steps >= SHORT_RUN_STEPS
    assert said.endswith(f"would train {plan.total_steps} ({plan.steps_per_epoch} per epoch)")
    assert not _warning(examples, replicas, **suggested)


def test_runs_of_enough_steps_or_of_the_steps_they_asked_for_do_not_warn():
    assert not _warning(50_000, 1, per_replica_batch_size=1024, epochs=5)  # cpu_cnn: 48 x 5
    # The README's smoke run, and the tests' short runs: the steps are theirs.
    smoke = dict(dataset="synthetic", model="mlp", train_steps=200)
    assert not _warning(50_000, 1, **smoke)
    assert not _warning(1024, 1, per_replica_batch_size=32, train_steps=8)


def test_a_split_too_small_for_any_batch_says_so_instead_of_advice_that_still_warns():
    # 30 images on 2 replicas: even a batch of 1 gives 15 steps an epoch.
    said = _warning(30, 2, per_replica_batch_size=8, epochs=1)
    assert said == ("this run trains 1 step (1 per epoch: 30 training images in global batches "
                    "of 16), too few to learn much; more training images would give more steps "
                    "per epoch")


def _start_warnings(examples, replicas, **flags):
    config = TrainConfig.from_flags(model_dir="unused", **flags)
    return start_warnings(config, plan_run(config, replicas, 1, examples), examples)


def test_the_batch_rule_is_left_unsaid_only_where_the_short_runs_batch_keeps_it():
    # 1,414 images at 256: the suggested 64 is within the rule's 141: one line.
    (short,) = _start_warnings(1414, 1, per_replica_batch_size=256, epochs=2)
    assert "--per_replica_batch_size=64" in short
    # ImageNet's 1,281,167 at 8 x 2048, 2 epochs: the advice keeps the batch
    # (only more epochs), which stays above 8192: both lines.
    short, beyond = _start_warnings(1_281_167, 8, per_replica_batch_size=2048, epochs=2)
    assert "--epochs=3" in short and "--per_replica_batch_size" not in short
    assert beyond.startswith("a global batch of 16384 is above 8192")


def test_a_tiny_positive_number_of_epochs_trains_one_step(model_dir):
    # --epochs=0 is refused, and --epochs=1e-9 came to 0 steps: a model never
    # trained was evaluated and exported as the run's result.
    result = train(["--dataset=synthetic", "--synthetic_examples=256", "--model=mlp",
                    "--per_replica_batch_size=32", "--epochs=1e-9", "--noevaluate",
                    "--noexport", f"--model_dir={model_dir}"])
    assert_ok(result)
    assert "\nstep 1/1 " in result.stdout, result.stdout
