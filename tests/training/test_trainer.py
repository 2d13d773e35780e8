"""The training loop: the same weights whatever the replicas, steps per call,
XLA or data placement; every model trains at its defaults; divergence is
caught. And what a person watching a run sees: the first progress line soon
after the start, a stop signal answered at once and obeyed within seconds, a
second Ctrl-C that aborts (real processes: signals and timing are what a user
sees)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (REPO, SMOKE_FLAGS, WatchedProcess, assert_ok, assert_same_weights,
                      checkpoint_weights, read_summary, read_terminal, subprocess_env, train,
                      weights_of_one_and_two_replicas)
from distributed_mpt.core.models import MODELS
from distributed_mpt.process.run_lock import Writes
from distributed_mpt.training.loop import _steps_per_call

# A run long enough to be interrupted: resnet9 at full width, whose steps
# take about a second on 2 CPU cores, on synthetic data.
SLOW_RUN = ["--dataset=synthetic", "--synthetic_examples=2048", "--model=resnet9",
            "--train_steps=2000", "--noexport", "--noevaluate"]


def test_progress_starts_soon_and_a_stop_signal_is_answered_at_once(tmp_path):
    run = WatchedProcess("distributed_mpt.train", [*SLOW_RUN, f"--model_dir={tmp_path / 'run'}"])
    started, _ = run.wait_for(r"^resnet9 on synthetic", timeout=120)
    first_step, _ = run.wait_for(r"^step +\d+/2000", timeout=120)
    # It took 67 s under a load of 11 on 2 cores of an AVX2-only AMD EPYC (Zen 3): generous.
    print(f"first progress line {first_step - started:.1f} s after the start line")
    assert first_step - started < 90, "the first progress line comes within 90 s of the start"

    signalled = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    acknowledged, line = run.wait_for(r"^SIGINT: stopping", timeout=10)
    assert acknowledged - signalled < 1, "Ctrl-C is acknowledged within a second"
    assert "Ctrl-C again to abort" in line.string
    assert run.finish(timeout=60) == 143, run.output()
    stopped_at = time.monotonic()
    assert stopped_at - signalled < 30, "the stop takes effect within seconds, with a checkpoint"
    assert re.search(r"stopped by a signal at step \d+; checkpoint saved", run.output())
    assert not re.search(r"^[IWE]\d{4} ", run.output(), re.M), "no TensorFlow C++ log lines"


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    run = WatchedProcess("distributed_mpt.train", [*SLOW_RUN, f"--model_dir={tmp_path / 'run'}"])
    run.wait_for(r"^step +\d+/2000", timeout=120)
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"^SIGINT: stopping", timeout=10)
    second = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout=30) == 130, run.output()
    assert time.monotonic() - second < 5, "a second Ctrl-C does not wait for the step under way"
    assert "second Ctrl-C: aborting without a checkpoint" in run.output()


def test_a_ctrl_c_after_a_sigterm_is_not_said_to_be_the_second(tmp_path):
    """The first was a scheduler's SIGTERM, which offered Ctrl-C to abort."""
    run = WatchedProcess("distributed_mpt.train", [*SLOW_RUN, f"--model_dir={tmp_path / 'run'}"])
    run.wait_for(r"^step +\d+/2000", timeout=120)
    run.process.send_signal(signal.SIGTERM)
    run.wait_for(r"^SIGTERM: stopping", timeout=10)
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout=30) == 130, run.output()
    assert re.search(r"^Ctrl-C: aborting without a checkpoint", run.output(), re.M), run.output()


def test_a_second_ctrl_c_as_the_run_finishes_says_its_checkpoint_is_saved(tmp_path):
    # It said "aborting without a checkpoint", the final step's saved already.
    model_dir = tmp_path / "run"
    # The export after the evaluation keeps the run finishing for seconds more.
    run = WatchedProcess("distributed_mpt.train", [*SMOKE_FLAGS, "--train_steps=40", "--export",
                                                   f"--model_dir={model_dir}"])
    run.wait_for(r"^evaluating on the", timeout=120)
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"^SIGINT: stopping once the run is complete", timeout=10)
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout=30) == 130, run.output()
    assert "second Ctrl-C: aborting with the checkpoint saved" in run.output()
    assert (model_dir / "checkpoints" / "ckpt-40.index").exists()


def _loop_with_a_fake_trainer(pace_of_all_workers, local_clock, monkeypatch):
    """The steps of each loop call, and the steps logged, on a worker whose
    own clock ticks `local_clock` seconds per clock reading, when the
    all-reduced pace (the same on every worker) comes back as
    `pace_of_all_workers`, call by call."""
    from types import SimpleNamespace

    from distributed_mpt.config import TrainConfig
    from distributed_mpt.core.steps import LoopTotals
    from distributed_mpt.training import loop as loop_module
    from distributed_mpt.training.loop import TrainingLoop
    from distributed_mpt.training.plan import plan_run

    config = TrainConfig.from_flags(model_dir="unused", train_steps=200, precision="float32",
                         log_every_steps=1000, checkpoint_every_steps=1000)
    sizes, logged, paces = [], [], iter(pace_of_all_workers)

    def train(iterator, num_steps, seconds_per_step, crop_size):
        sizes.append(num_steps)
        return LoopTotals(1.0, 1.0, 1.0, 0.0, 0.0, 0.0, next(paces))

    fake = SimpleNamespace(train=train, optimizer=SimpleNamespace(learning_rate=0.1))
    ticks = iter(range(0, 10**6, local_clock))
    monkeypatch.setattr(loop_module.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(loop_module.precision, "loss_scale", lambda optimizer: 1.0)
    quiet = SimpleNamespace(log=lambda step, *a, **k: logged.append(step), live=lambda step: None,
                            say=print, doing=lambda activity: contextlib.nullcontext())
    loop = TrainingLoop(fake, config, plan_run(config, 1, 1, 50_000),
                        SimpleNamespace(save=lambda step: None), quiet,
                        train_input=lambda split, start_step, end_step, crop_size: [],
                        writes=Writes(check_held=lambda: None, alone=True))
    loop.run(None, None, start_step=0)
    return sizes, logged


def test_a_terminal_gets_a_status_line(tmp_path):
    import pty

    controller, terminal = pty.openpty()
    args = [*SMOKE_FLAGS, "--train_steps=40", "--log_every_steps=1000"]
    process = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.train", *args, f"--model_dir={tmp_path / 'tty'}"],
        stdout=terminal, stderr=subprocess.DEVNULL, cwd=REPO, env=subprocess_env())
    os.close(terminal)
    shown = read_terminal(controller)
    assert process.wait(timeout=60) == 0
    assert b"\r\x1b[Kstep " in shown, "steps counted on the status line between progress lines"
    # A log gets whole lines only: test_train.py's first test.


def test_workers_with_different_clocks_call_the_loop_alike(monkeypatch):
    paces = [0.0, 0.5, 0.1, 0.01, 0.2] + [0.05] * 200
    fast, _ = _loop_with_a_fake_trainer(paces, local_clock=1, monkeypatch=monkeypatch)
    slow, _ = _loop_with_a_fake_trainer(paces, local_clock=7, monkeypatch=monkeypatch)
    assert fast == slow, "the call sizes follow the agreed pace only, not a worker's own clock"
    # One step while the pace is unknown, then about a second per call.
    assert fast[:7] == [1, 1, 2, 10, 50, 5, 20] and sum(fast) == 200


def test_a_progress_line_comes_at_least_every_20_seconds(monkeypatch):
    # --log_every_steps=1000 and 390 steps per epoch: only the clock and the
    # run's end call for lines here. Each call reads the clock twice, 5 s
    # apart: a call of 5 s, and 5 s more before the next.
    sizes, logged = _loop_with_a_fake_trainer([0.5] * 200, local_clock=5, monkeypatch=monkeypatch)
    assert logged[0] == 1, "a line after the first call"
    steps_at_call_end = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert set(logged) <= set(steps_at_call_end) and logged[-1] == 200
    gaps = [steps_at_call_end.index(b) - steps_at_call_end.index(a) for a, b in zip(logged, logged[1:])]
    assert max(gaps) <= 2, "20 s of this clock is two calls"


@pytest.mark.parametrize("seconds_per_step, expected", [
    (0.0, 1),      # pace not known yet (the first calls, tracing)
    (2.0, 1),      # slow steps: one per call, so that signals wait at most a step
    (0.1, 10),     # about a second per call
    (1e-4, 50),    # fast steps: --steps_per_loop caps the call
])
def test_loop_calls_last_about_a_second(seconds_per_step, expected):
    assert _steps_per_call(seconds_per_step, steps_per_loop=50) == expected


def test_a_run_signalled_while_it_exports_completes_and_keeps_its_training_figures(tmp_path):
    model_dir = tmp_path / "run"
    run = WatchedProcess("distributed_mpt.train", [*SMOKE_FLAGS, "--train_steps=40", "--export", f"--model_dir={model_dir}"])
    run.wait_for(r"^evaluating on the", timeout=120)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output()
    assert "SIGTERM: stopping once the run is complete" in run.output()
    summary = read_summary(model_dir)
    assert (model_dir / "export" / "saved_model" / "saved_model.pb").exists()
    assert summary["train_loss"] is not None and summary["examples_per_second"] > 0

    # Killed before its summary was written: the rerun completes it, with
    # the training figures from metrics.jsonl.
    (model_dir / "summary.json").unlink()
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=40", f"--model_dir={model_dir}"]))
    rerun = read_summary(model_dir)
    assert rerun["resumed_from_step"] == 40
    assert rerun["train_loss"] == pytest.approx(summary["train_loss"])
    assert rerun["examples_per_second"] > 0  # the last interval's, as logged
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [40], "one final evaluation"


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_each_precision_trains(model_dir, precision):
    result = train([*SMOKE_FLAGS, "--train_steps=30", f"--precision={precision}",
                    f"--model_dir={model_dir}"])
    assert_ok(result)
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line)]  # the training records
    assert records[-1]["loss"] < records[0]["loss"] / 2
    summary = read_summary(model_dir)
    assert summary["precision"] == precision
    assert summary["eval_accuracy"] > 0.5  # chance is 0.1
    if precision == "mixed_float16":
        assert records[-1]["loss_scale"] > 1, "dynamic loss scaling is on"
    else:
        assert "loss_scale" not in records[-1], "logged only where the loss is scaled"


@pytest.mark.parametrize("precision, rtol, atol", [
    ("float32", 1e-4, 2e-6),
    # float16 compute: round-off differs with the batch split. Loss-scale
    # skips must be agreed across replicas (Keras decides per replica).
    ("mixed_float16", 1e-2, 5e-3),
])
def test_two_mirrored_replicas_match_one_replica_at_the_same_global_batch(
        tmp_path, precision, rtol, atol):
    common = [*SMOKE_FLAGS, "--train_steps=8", f"--precision={precision}", "--noevaluate"]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path)
    assert read_summary(tmp_path / "two")["global_batch_size"] == 32
    assert single["step/.ATTRIBUTES/VARIABLE_VALUE"] == mirrored["step/.ATTRIBUTES/VARIABLE_VALUE"] == 8
    kernels = [n for n in single if single[n].ndim == 2]
    assert len(kernels) >= 6, "weights and momentum slots of three Dense layers"
    if precision == "mixed_float16":
        scale = "optimizer/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE"
        assert single[scale] == mirrored[scale]
    assert_same_weights(mirrored, single, rtol=rtol, atol=atol)


def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(model_dir):
    # A resume may not change the rate, but its batch (and with it the
    # scaled rate): 1 x 8/128 trains, 1 x 1024/128 makes the MLP diverge.
    common = [*SMOKE_FLAGS, "--learning_rate=1", "--max_learning_rate=0", "--precision=float32",
              f"--model_dir={model_dir}"]
    assert_ok(train([*common, "--train_steps=5", "--noevaluate", "--per_replica_batch_size=8"]))
    good = checkpoint_weights(model_dir)
    result = train([*common, "--train_steps=40", "--per_replica_batch_size=1024",
                    "--checkpoint_every_steps=5"])
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "NaN or infinite" in errors[0]
    assert "kept the last good checkpoint (step 5)" in errors[0]
    assert "--precision=float32" not in errors[0], "no advice to use what the run used"
    assert "--max_learning_rate) in a new --model_dir (a resume refuses a changed learning " \
           "rate" in errors[0], "what a resume here would refuse"
    kept = checkpoint_weights(model_dir)
    for name in good:
        np.testing.assert_array_equal(kept[name], good[name])
    assert json.loads((model_dir / "summary.json").read_text())["steps"] == 5, \
        "summary.json still says what the last finished run did"


@pytest.mark.slow
def test_steps_per_loop_xla_and_device_data_give_the_same_weights(tmp_path):
    # Loop calls grow from one step as the pace becomes known: "looped" runs
    # calls of 1, 1 and 6 steps, "plain" eight calls of one.
    common = [*SMOKE_FLAGS, "--train_steps=8", "--precision=float32", "--noevaluate"]
    runs = {"plain": ["--steps_per_loop=1"], "looped": ["--steps_per_loop=8"],
            "xla": ["--steps_per_loop=3", "--xla"],
            "device_data": ["--steps_per_loop=2", "--data_on_device"],
            "device_data_mirrored": ["--data_on_device", "--strategy=mirrored", "--cpu_replicas=2",
                                     "--per_replica_batch_size=16"]}
    weights = {}
    for name, flags in runs.items():
        assert_ok(train([*common, *flags, f"--model_dir={tmp_path / name}"]))
        weights[name] = checkpoint_weights(tmp_path / name)
    for name in runs.keys() - {"plain"}:
        assert weights[name].keys() == weights["plain"].keys()
        for variable in weights["plain"]:
            np.testing.assert_allclose(weights[name][variable], weights["plain"][variable],
                                       rtol=1e-4, atol=2e-6, err_msg=f"{name}: {variable}")


def test_evaluation_and_progress_every_epoch_are_logged(model_dir):
    # 1024 synthetic examples at batch 32: 32 steps per epoch.
    result = train([*SMOKE_FLAGS, "--train_steps=70", "--eval_every_epochs=1",
                    "--log_every_steps=1000", f"--model_dir={model_dir}"])
    assert_ok(result)
    records = [json.loads(l) for l in (model_dir / "metrics.jsonl").read_text().splitlines()]
    training = [r["step"] for r in records if "loss" in r]
    assert {1, 32, 64, 70} <= set(training), "after the first call, at each epoch's end, at the end"
    # (A slow evaluation adds "...: 21 s so far" lines, which end otherwise.)
    assert result.stdout.splitlines().count("evaluating on the 204 test images") == 3, \
        "a line before each"
    evaluations = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evaluations] == [32, 64, 70], "the final one ends the curve"
    assert evaluations[-1]["eval_accuracy"] > 0.5
    assert read_summary(model_dir)["eval_examples"] == 1024 // 5


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batch, steps", [(16, 10), (1024, 10), (256, 60)])
def test_default_hyperparameters_train_every_model_without_diverging(tmp_path, model, batch, steps):
    """No tuning flags: each model's own defaults must hold at any batch and
    run length (in-process: a subprocess would add only TensorFlow's start-up)."""
    import keras
    import tensorflow as tf

    from distributed_mpt.config import TrainConfig
    from distributed_mpt.training.run import train_and_evaluate

    config = TrainConfig.from_flags(model_dir=str(tmp_path), dataset="synthetic", synthetic_examples=2048,
                         model=model, model_width=8, per_replica_batch_size=batch,
                         train_steps=steps, export=False)
    try:
        summary = train_and_evaluate(config, tf.distribute.get_strategy(), "default", None)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(summary["train_loss"]) and summary["steps"] == steps
    if steps >= 60:
        assert summary["eval_accuracy"] > 0.5, "learned the learnable synthetic labels"


@pytest.mark.slow
def test_two_replicas_at_the_largest_batch_keep_the_mlp_finite(model_dir):
    # The case that diverged with one default for every model: 2 x 1024.
    result = train(["--dataset=synthetic", "--synthetic_examples=8192", "--model=mlp",
                    "--strategy=mirrored", "--cpu_replicas=2", "--per_replica_batch_size=1024",
                    "--train_steps=12", "--steps_per_loop=4", "--noexport", "--noevaluate",
                    f"--model_dir={model_dir}"])
    assert_ok(result)
    assert np.isfinite(read_summary(model_dir)["train_loss"])


def test_evaluation_starts_without_the_train_split(tmp_path, monkeypatch):
    """The train split's images (150 MB for CIFAR-10), which its pipeline
    shares, are let go once training is over: evaluation and the export grow
    from what is left."""
    import weakref

    import keras
    import tensorflow as tf

    from distributed_mpt.config import TrainConfig
    from distributed_mpt.core import data, steps
    from distributed_mpt.training.run import train_and_evaluate

    train_splits, alive_at_evaluation = [], []
    load, evaluate = data.DataOptions.load, steps.Trainer.evaluate

    def loading(*args, **kwargs):
        dataset = load(*args, **kwargs)
        train_splits.append(weakref.ref(dataset.train.images))  # the buffer the pipeline shared
        return dataset

    def evaluating(trainer, split):
        alive_at_evaluation.append(train_splits[0]() is not None)
        return evaluate(trainer, split)

    monkeypatch.setattr(data.DataOptions, "load", loading)
    monkeypatch.setattr(steps.Trainer, "evaluate", evaluating)
    config = TrainConfig.from_flags(
        model_dir=str(tmp_path), dataset="synthetic", synthetic_examples=512, model="mlp",
        per_replica_batch_size=64, train_steps=4, export=False, precision="float32")
    try:
        summary = train_and_evaluate(config, tf.distribute.get_strategy(), "default", None)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert summary["eval_examples"] == 512 // 5
    assert alive_at_evaluation == [False]
