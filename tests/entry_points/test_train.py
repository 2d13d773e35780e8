"""The real training entry point end to end: what a run writes, resuming,
bad input, data sources, recipes."""

import json
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (REPO, SMALL_MODEL, SMOKE_FLAGS, WatchedProcess, assert_ok,
                      assert_one_error_line, assert_same_weights, checkpoint_weights, read_summary,
                      subprocess_env, train)
import distributed_mpt

SUMMARY_KEYS = {"strategy", "num_workers", "num_replicas", "per_replica_batch_size",
                "global_batch_size", "precision", "model", "steps", "epochs", "learning_rate",
                "train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "eval_examples",
                "examples_per_second", "resumed_from_step"}


@pytest.mark.skipif(platform.machine().lower() not in distributed_mpt.X86_MACHINES,
                    reason="an x86 CPU")
@pytest.mark.parametrize("users_setting, kernels", [(None, "on"), ("0", "off")])
def test_the_package_turns_on_onednn_kernels_on_every_x86_cpu(users_setting, kernels):
    # TensorFlow's own default leaves them off on AVX2-only CPUs, where they
    # train airbench 1.55x faster; a user's setting wins.
    env = subprocess_env(TF_CPP_MIN_LOG_LEVEL="0")
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    if users_setting is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = users_setting
    result = subprocess.run([sys.executable, "-c", "import distributed_mpt, tensorflow"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert_ok(result)
    said_on = "oneDNN custom operations are on" in result.stderr
    assert said_on == (kernels == "on"), result.stderr[-2000:]


def test_synthetic_run_writes_every_output(model_dir):
    result = train([*SMOKE_FLAGS, "--export", "--train_steps=20", f"--model_dir={model_dir}"])
    assert_ok(result)
    summary = read_summary(model_dir)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["steps"] == 20 and summary["resumed_from_step"] == 0
    assert summary["global_batch_size"] == 32 and summary["num_replicas"] == 1
    assert summary["learning_rate"] == pytest.approx(0.1 * 32 / 128)
    assert summary["eval_examples"] == 1024 // 5
    assert summary["eval_accuracy"] > 0.5, "synthetic labels are learnable"
    assert "global batch 32" in result.stdout and "learning rate 0.025" in result.stdout
    progress = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert progress[0].startswith("step  1/20"), "a first line as soon as the first step is done"
    assert "ETA" not in progress[0], "no ETA from a step that includes tracing"
    assert "ETA 0:00:" in progress[1], "the next line says what is left"
    assert "evaluating on the 204 test images" in result.stdout
    assert "\r" not in result.stdout and "\x1b" not in result.stdout, "a log gets whole lines only"
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r, "eval_accuracy" in r) for r in records] == [
        (1, True, False), (2, True, False), (10, True, False), (20, True, False),
        (20, False, True)], "training (a line after each of the first two calls), then the " \
        "final evaluation"
    assert {"loss", "accuracy", "learning_rate", "examples_per_second",
            "elapsed_seconds"} <= set(records[0])
    assert "loss_scale" not in records[0] and "loss_scale" not in result.stdout, \
        "no loss scale where the loss is not scaled (float32)"
    assert list((model_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (model_dir / "export" / "saved_model" / "saved_model.pb").exists()
    leftovers = [p.name for p in model_dir.rglob(".*") if p.name.startswith((".tmp-", ".export-"))]
    assert not leftovers

    import keras
    model = keras.models.load_model(model_dir / "export" / "model.keras")
    images = np.zeros((2, 32, 32, 3), np.uint8)
    np.testing.assert_allclose(np.asarray(model(images)).sum(-1), 1.0, rtol=1e-4)


def test_cifar10_from_tensorflow_datasets(model_dir):
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "mock_cifar10_train.py"), "300",
         "--model=resnet9", "--model_width=4", "--per_replica_batch_size=32", "--train_steps=6",
         "--steps_per_loop=3", "--log_every_steps=3", "--noexport", f"--model_dir={model_dir}",
         "--data_dir=/nonexistent"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    assert_ok(result)
    summary = read_summary(model_dir)
    assert summary["dataset"] == "cifar10" and summary["model"] == "resnet9"
    assert summary["eval_examples"] == 300, "the whole test split, none dropped by batching"
    assert summary["steps"] == 6 and np.isfinite(summary["train_loss"])


INTERRUPTIBLE = [*SMOKE_FLAGS, "--train_steps=60", "--steps_per_loop=2", "--log_every_steps=4",
                 "--checkpoint_every_steps=1000", "--noevaluate"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights of the run no signal interrupted, to compare with."""
    model_dir = tmp_path_factory.mktemp("straight")
    assert_ok(train([*INTERRUPTIBLE, f"--model_dir={model_dir}"]))
    return checkpoint_weights(model_dir)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_run_resumes_at_the_step_it_stopped(tmp_path, sig, uninterrupted):
    interrupted = tmp_path / "interrupted"
    run = WatchedProcess("distributed_mpt.train", [*INTERRUPTIBLE, f"--model_dir={interrupted}"])
    run.wait_for(r"^step +12/", timeout=120)
    run.process.send_signal(sig)
    assert run.finish(timeout=120) == 143, run.output()[-2000:]
    assert "Traceback" not in run.output()
    assert f"{sig.name}: stopping after the steps under way" in run.output(), "acknowledged"
    saved = int(Path(interrupted, "checkpoints", "checkpoint").read_text().split('"')[1].split("-")[-1])
    assert 12 <= saved < 60, "saved where it stopped, not at a checkpoint interval"
    assert not (interrupted / "summary.json").exists(), "an interrupted run has no summary yet"

    resumed = train([*INTERRUPTIBLE, f"--model_dir={interrupted}"])
    assert_ok(resumed)
    assert f"resuming from step {saved}" in resumed.stdout
    summary = read_summary(interrupted)
    assert (summary["resumed_from_step"], summary["steps"]) == (saved, 60)
    assert "deprecat" not in (resumed.stdout + resumed.stderr).lower(), "no TensorFlow noise"
    records = [json.loads(l) for l in (interrupted / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r["step"] for r in records]
    assert steps_logged == sorted(set(steps_logged)), "no step logged twice across both runs"
    elapsed = [r["elapsed_seconds"] for r in records]
    assert elapsed == sorted(set(elapsed)), "time goes on across the resume, it does not restart"
    every_interval = set(range(4, 61, 4))
    assert every_interval <= set(steps_logged) <= every_interval | {1, 2, saved + 1, saved + 2}, \
        "every interval, and a line after each of the first two calls of each run"
    # Exactly the run that was never interrupted: no step lost or done twice.
    weights = checkpoint_weights(interrupted)
    assert_same_weights(weights, uninterrupted, rtol=1e-5, atol=1e-6)


def test_refuses_a_checkpoint_of_another_model_and_leaves_it_untouched(model_dir):
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=5", "--noevaluate", f"--model_dir={model_dir}"]))
    before = {p: p.read_bytes() for p in model_dir.rglob("*") if p.is_file()}
    result = train([*SMOKE_FLAGS, "--model=resnet9", "--model_width=4", "--train_steps=5",
                    f"--model_dir={model_dir}"])
    assert result.returncode == 2
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "different model" in errors[0] and "Traceback" not in result.stderr
    after = {p: p.read_bytes() for p in model_dir.rglob("*") if p.is_file()}
    assert after == before


# Each bad value is tested once, in test_config.py; here, the two ways the
# entry point refuses: a flag (before TensorFlow starts) and a contradiction
# found later (after the --model_dir was created: it is removed again).
@pytest.mark.parametrize("flags, fragment", [
    (["--model=vgg16"], "model"),
    (["--strategy=multi_worker"], "needs a cluster"),
])
def test_bad_flags_exit_with_one_line_and_write_nothing(tmp_path, flags, fragment):
    model_dir = tmp_path / "run"
    result = train([*SMOKE_FLAGS, *flags, f"--model_dir={model_dir}"], timeout=120)
    assert_one_error_line(result, fragment)
    assert not model_dir.exists()


def test_xla_with_synchronized_batch_norm_over_replicas_is_refused(tmp_path):
    result = train([*SMOKE_FLAGS, "--model=resnet9", "--model_width=4", "--xla",
                    "--strategy=mirrored", "--cpu_replicas=2", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "--xla")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_malformed_tf_config_exits_with_one_line(tmp_path):
    result = train([*SMOKE_FLAGS, f"--model_dir={tmp_path / 'run'}"],
                   env=subprocess_env(TF_CONFIG='{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}'))
    assert_one_error_line(result, "ps")


def test_unwritable_model_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = train([*SMOKE_FLAGS, f"--model_dir={blocker / 'run'}"])
    assert_one_error_line(result, "not writable")


def test_missing_cifar10_without_network_fails_fast_with_remedies(tmp_path):
    started = time.monotonic()
    result = train(["--dataset=cifar10", "--nodownload", f"--data_dir={tmp_path / 'tfds'}",
                    f"--model_dir={tmp_path / 'run'}"], timeout=90)
    assert time.monotonic() - started < 60
    assert_one_error_line(result, "--dataset=synthetic")
    assert "distributed-mpt-prepare-data" in result.stderr and "downloads/manual" in result.stderr
    assert "cifar-10-batches-bin/" in result.stderr, "the route without tensorflow-datasets"


def test_the_official_binary_release_trains_offline_and_reports_time_to_accuracy(tmp_path):
    from conftest import write_cifar10_binary

    write_cifar10_binary(tmp_path / "data")
    model_dir = tmp_path / "run"
    result = train(["--model=airbench", "--model_width=4", f"--data_dir={tmp_path / 'data'}",
                    "--nodownload", "--per_replica_batch_size=64", "--train_steps=4",
                    "--steps_per_loop=2", "--log_every_steps=2", "--eval_tta=flip", "--noexport",
                    f"--model_dir={model_dir}"])
    assert_ok(result)
    summary = read_summary(model_dir)
    assert summary["dataset"] == "cifar10" and summary["eval_examples"] == 10_000
    assert summary["eval_tta"] == "flip" and 0 <= summary["eval_accuracy_without_tta"] <= 1
    assert summary["wall_seconds"] > 0 and "cores" in summary["device"]
    assert summary["tensorflow_version"] and summary["keras_version"]
    # The run's peak resident memory, in bytes: train() ran in this process,
    # whose peak (getrusage's maxrss, KiB on Linux) can only have grown since.
    peak_since = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 100e6 < summary["peak_memory_bytes"] <= peak_since, "TensorFlow alone has more"
    # The final evaluation ends the accuracy curve, with the time it took to get there.
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4 and records[-1]["eval_accuracy"] == summary["eval_accuracy"]
    assert all(r["elapsed_seconds"] > 0 for r in records)
    assert records[-1]["elapsed_seconds"] <= summary["wall_seconds"]
    import tensorflow as tf
    tagged = {(v.tag, e.step) for f in (model_dir / "tensorboard").glob("events.out.tfevents.*")
              for e in tf.compat.v1.train.summary_iterator(str(f)) for v in e.summary.value}
    assert ("eval_accuracy", 4) in tagged
    config = json.loads((model_dir / "config.json").read_text())
    assert config["optimizer"]["learning_rate"] == 0.1875, "the model's default, as used, in its section"


def test_a_damaged_binary_release_is_one_error_line_and_nothing_written(tmp_path):
    from conftest import write_cifar10_binary

    data = write_cifar10_binary(tmp_path / "data")
    (data / "data_batch_2.bin").write_bytes(b"\0" * 1000)
    result = train(["--model=mlp", f"--data_dir={tmp_path / 'data'}", "--nodownload",
                    "--train_steps=2", f"--model_dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data_batch_2.bin has 1,000 bytes" in errors[0], result.stderr
    assert not (tmp_path / "run").exists(), "a refused run leaves no empty --model_dir behind"


def test_a_rate_given_to_a_run_of_the_models_rate_says_what_its_ceiling_of_0_is(model_dir):
    """The MLP's own rate has a ceiling; a --learning_rate given has none (0). Resumed with
    one, the refusal said "changes --max_learning_rate=0.05 to 0.0", a flag not given."""
    flags = [*(f for f in SMOKE_FLAGS if not f.startswith("--learning_rate=")), "--noevaluate",
             "--train_steps=2", "--precision=float32", f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    assert_one_error_line(train([*flags, "--learning_rate=0.2"]),
                          "changes --learning_rate=0.05 to 0.2, --max_learning_rate=0.05 to 0.0 "
                          "(none: a --learning_rate given has no ceiling). Pass "
                          "--learning_rate=0.05 --max_learning_rate=0.05 to resume it")


def test_a_binary_release_with_a_file_copied_over_another_is_refused(tmp_path):
    """test_batch.bin copied as data_batch_5.bin (a missing batch replaced):
    the run trained on the test images and scored them as unseen, exit 0."""
    import shutil

    from conftest import write_cifar10_binary

    data = write_cifar10_binary(tmp_path / "data")
    shutil.copy(data / "test_batch.bin", data / "data_batch_5.bin")
    result = train(["--model=mlp", f"--data_dir={tmp_path / 'data'}", "--nodownload",
                    "--train_steps=2", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "data_batch_5.bin and test_batch.bin begin with the same records, "
                                  "one a copy of the other; extract the archive again")
    assert not (tmp_path / "run").exists(), "nothing written"


def test_a_finished_run_started_again_leaves_its_results_as_they_are(model_dir):
    flags = [*SMOKE_FLAGS, "--train_steps=10", "--precision=float32", f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    files = {name: (model_dir / name).read_bytes()
             for name in ("summary.json", "metrics.jsonl", "config.json")}
    again = train(flags)
    assert_ok(again)
    assert "holds a finished run of 10 steps" in again.stdout
    assert "predict" not in again.stdout
    # Other test-time views do not re-score it: it says what does.
    views = train([*flags, "--eval_tta=flip", "--eval_tta_fraction=0.5"])
    assert_ok(views)
    assert (f"Its test results are with --eval_tta=none --eval_tta_fraction=1.0; to score it "
            f"with others: distributed-mpt-predict --model_dir={model_dir} --evaluate "
            f"--tta=flip --tta_fraction=0.5") in views.stdout
    # Other data is refused, finished run or not: never two runs in one model.
    assert_one_error_line(train([*flags, "--seed=7"]),
                          "holds a run trained otherwise: this run changes --seed=0 to 7")
    for name, content in files.items():
        assert (model_dir / name).read_bytes() == content, f"{name} was rewritten"
    # Extending it is a new plan, and says so.
    longer = train([*flags, "--train_steps=20"])
    assert_ok(longer)
    assert "planned for 10 steps and now has 20" in longer.stdout
    assert read_summary(model_dir)["steps"] == 20
    resolved = json.loads((model_dir / "config.json").read_text())["resolved"]
    assert resolved["precision"] == "float32" and resolved["total_steps"] == 20
    # A stopped run (no summary yet) given fewer steps than it has: says what it does.
    (model_dir / "summary.json").unlink()
    shorter = train([*flags, "--train_steps=15"])
    assert_ok(shorter)
    assert "checkpoint is at step 20 and this run has 15 steps: nothing is left" in shorter.stdout


def test_a_finished_run_whose_checkpoints_are_gone_is_refused_not_trained_again(model_dir):
    """Checkpoints removed to free space, or left out of a copy: it trained
    again from step 0 (exit 0) over the finished run's summary.json,
    metrics.jsonl and config.json; with only the ckpt-* files gone, after a
    warning that it removed the index naming them."""
    flags = [*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={model_dir}"]
    assert_ok(train(flags))

    def refused(lost):
        def files():
            return {path: path.read_bytes() for path in model_dir.rglob("*")
                    if path.is_file() and path.name != ".lock"}
        before = files()
        again = train(flags)
        assert_one_error_line(again, "holds a finished run (see summary.json) but its checkpoints "
                                     "are gone from")
        assert "Restore its checkpoints to resume or extend it" in again.stderr
        assert files() == before, f"{lost}: nothing is written"

    for checkpoint in (model_dir / "checkpoints").glob("ckpt-*"):
        checkpoint.unlink()
    refused("ckpt-* gone, the index and model.json kept")
    shutil.rmtree(model_dir / "checkpoints")
    refused("checkpoints/ gone")


def test_a_finished_run_on_a_read_only_mount_says_so_as_on_a_writable_one(model_dir):
    """It was refused (`--model_dir is not writable`, exit 2) before TensorFlow
    started, for want of the lock; run longer, it still is, before any write."""
    flags = [*SMOKE_FLAGS, "--train_steps=10", "--noevaluate", f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    if subprocess.run(["mount", "--bind", str(model_dir), str(model_dir)]).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(model_dir)], check=True)
        again, longer = train(flags), train([*flags, "--train_steps=20"])
        other = train([*flags, "--seed=7"])
        exported = train([*flags, "--export"])  # its export missing: one to write
    finally:
        subprocess.run(["umount", str(model_dir)], check=True)
    assert_ok(again)
    assert "holds a finished run of 10 steps" in again.stdout
    assert_one_error_line(longer, f"{model_dir} is not writable (Read-only file system)")
    assert len(longer.stderr.splitlines()) == 1, longer.stderr  # no TensorFlow complaint before it
    # What is refused for another reason says that reason, not the mount.
    assert_one_error_line(other, "holds a run trained otherwise: this run changes --seed=0 to 7")
    # Was "cannot write .../.export-...: make it writable ... to resume", an inner folder's name.
    assert_one_error_line(exported, f"{model_dir} is not writable (Read-only file system)")


def test_an_extension_stopped_after_its_last_checkpoint_is_evaluated_by_the_first_command(
        model_dir):
    """Finished at 10 steps, extended to 20 and stopped after the checkpoint
    of step 20, before its summary: the first command again said 'holds a
    finished run of 20 steps' and left summary.json and the export of step
    10 as the run's, the model of step 20 never evaluated or exported."""
    flags = [*(f for f in SMOKE_FLAGS if f != "--noexport"), "--train_steps=10",
             f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    summary_of_10 = (model_dir / "summary.json").read_bytes()
    assert_ok(train([*flags, "--train_steps=20"]))
    (model_dir / "summary.json").write_bytes(summary_of_10)  # as the stop left it
    again = train(flags)
    assert_ok(again)
    assert "holds a finished run" not in again.stdout
    assert ("the checkpoint is at step 20 and this run has 10 steps: nothing is left to train; "
            "the model of step 20 is evaluated and exported") in again.stdout
    assert read_summary(model_dir)["steps"] == 20
    assert json.loads((model_dir / "export" / "model_info.json").read_text())["steps"] == 20
    # Each end's evaluation once: the one of step 10 was dropped, that of step 20 logged twice.
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [10, 20]
    # Its checkpoints gone too, config.json still says it resumed: refused, not trained from 0.
    shutil.rmtree(model_dir / "checkpoints")
    (model_dir / "summary.json").unlink()
    assert_one_error_line(train(flags), "holds a run resumed at step 20 (see config.json) but "
                                        "its checkpoints are gone")


def test_a_finished_run_with_only_its_export_left_is_not_trained_over_from_step_0(model_dir):
    """Its checkpoints and summary.json removed (a script keeping only the model), the export
    of the run was replaced by one of a run from step 0, said to be where "it stopped before
    its first" checkpoint: the export is written only after a run's last step."""
    flags = [*(f for f in SMOKE_FLAGS if f != "--noexport"), "--train_steps=4",
             f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    shutil.rmtree(model_dir / "checkpoints")
    (model_dir / "summary.json").unlink()
    exported = {p: p.read_bytes() for p in (model_dir / "export").rglob("*") if p.is_file()}
    assert_one_error_line(train(flags), "holds the export of a run that trained to its end (see "
                                        "export/) but its checkpoints are gone")
    assert {p: p.read_bytes() for p in (model_dir / "export").rglob("*") if p.is_file()} == exported
    assert not (model_dir / "checkpoints").exists()


def test_a_new_batch_that_leaves_the_capped_rate_as_it_was_says_so(model_dir):
    common = ["--dataset=synthetic", "--synthetic_examples=1024", "--model=mlp",
              "--warmup_epochs=0", "--noexport", "--noevaluate", f"--model_dir={model_dir}"]
    assert_ok(train([*common, "--per_replica_batch_size=128", "--train_steps=2"]))
    resumed = train([*common, "--per_replica_batch_size=256", "--train_steps=4"])
    assert_ok(resumed)
    # 0.05 x 256/128 is capped at the MLP's 0.05: not "rescaled to 0.05 (was 0.05)".
    assert "the peak learning rate stays 0.05 and" in resumed.stdout


def test_a_finished_run_whose_export_was_lost_exports_it_again(model_dir):
    flags = [*(f for f in SMOKE_FLAGS if f != "--noexport"), *SMALL_MODEL, "--train_steps=10",
             f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    export = model_dir / "export"
    info = (export / "model_info.json").read_text()
    shutil.rmtree(export / "saved_model")  # what predict's error says to do with a damaged one
    again = train(flags)
    assert_ok(again)
    assert "its export was missing or incomplete: exported again" in again.stdout
    assert (export / "saved_model" / "saved_model.pb").is_file()
    assert (export / "model_info.json").read_text() == info, "it says what the run learned"


def test_a_recipe_by_name_from_any_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "distributed_mpt.train", "--recipe=mlp", "--dataset=synthetic",
         "--synthetic_examples=512", "--train_steps=2", "--noexport", "--model_dir=run"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert_ok(result)
    summary = read_summary(tmp_path / "run")
    assert summary["model"] == "mlp", "the recipe's model"
    assert summary["examples_per_second"] > 0, "even a run of a single loop call has a throughput"


def test_workers_started_with_different_flags_refuse_together_naming_them(tmp_path):
    """Worker 1 with another seed and weight decay made both workers train
    on and exit 0, the chief's config.json saying nothing of it."""
    from distributed_mpt.launch import free_ports, worker_tf_configs

    # The peer timeout bounds TensorFlow's whole start-up, its import included,
    # which takes most of a minute on a loaded machine.
    flags = [*SMOKE_FLAGS, "--communication=ring", "--per_replica_batch_size=16",
             "--peer_timeout_seconds=300", "--train_steps=4", "--precision=float32"]
    differing = [[], ["--seed=5", "--weight_decay=0.01"]]
    workers = [WatchedProcess("distributed_mpt.train",
                              [*flags, *extra, f"--model_dir={tmp_path / 'run'}"],
                              env=subprocess_env(TF_CONFIG=tf_config))
               for extra, tf_config in zip(differing, worker_tf_configs(free_ports(2)))]
    for worker, mine in zip(workers, ["--seed=0 --weight_decay=0.0", "--seed=5 --weight_decay=0.01"]):
        assert worker.finish(timeout=180) == 2, worker.output()[-3000:]
        errors = [line for line in worker.output().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in worker.output(), worker.output()[-3000:]
        assert "different --weight_decay, --seed" in errors[0] and "(this worker: " in errors[0]
        assert all(flag in errors[0] for flag in mine.split()), errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training"


def test_a_run_started_again_before_its_first_checkpoint_says_it_starts_from_step_0(tmp_path):
    """What a run killed before its first checkpoint leaves (its config.json,
    no checkpoint), started again, as a launcher restarting a group after a
    lost peer does: the restarted run says it starts over, not silently."""
    run = tmp_path / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=5", f"--model_dir={run}"]))
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    again = train([*SMOKE_FLAGS, "--train_steps=5", f"--model_dir={run}"])
    assert_ok(again)
    assert ("holds no checkpoint of the run started there before (it stopped before its first): "
            "training starts again from step 0") in again.stdout
    fresh = train([*SMOKE_FLAGS, "--train_steps=5", f"--model_dir={tmp_path / 'fresh'}"])
    assert_ok(fresh)
    assert "starts again" not in fresh.stdout
    # An adopted directory's own config.json is no run's (found in review).
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "config.json").write_text('{"name": "my project settings"}')
    adopted = train([*SMOKE_FLAGS, "--train_steps=5", "--adopt_model_dir",
                     f"--model_dir={tmp_path / 'project'}"])
    assert_ok(adopted)
    assert "starts again" not in adopted.stdout
