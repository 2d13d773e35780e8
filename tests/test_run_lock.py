"""One run per model directory, and a run that removes what a killed one
left. The holders and the killed runs are real processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMOKE_FLAGS, assert_ok, subprocess_env, train
from distributed_mpt.training import checkpointing
from distributed_mpt.process import run_lock
from distributed_mpt.errors import EXIT_MODEL_DIR_BUSY, ConfigError
from distributed_mpt.process.run_lock import ModelDirBusyError, RunLock

E2E = [*SMOKE_FLAGS, "--checkpoint_every_steps=5", "--noevaluate"]


_HOLDER = """
import sys, time
from distributed_mpt.process.run_lock import RunLock
lock = RunLock(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def _hold_lock(model_dir):
    """A separate process that takes the lock through the module and sleeps."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(model_dir)],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_holder_is_refused_and_a_killed_holder_blocks_nobody(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(ModelDirBusyError) as raised:
            RunLock(str(tmp_path))
        assert f"pid {holder.pid} on host {os.uname().nodename}" in str(raised.value)
        assert "\n" not in str(raised.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(str(tmp_path)) as lock:  # the OS released the dead holder's lock
        record = json.loads(Path(lock.path).read_text())
        assert record["pid"] == os.getpid()
    assert Path(lock.path).read_text() == "", "names a holder only while there is one"
    with RunLock(str(tmp_path)):  # and release() let go of it
        pass


def test_the_lock_file_is_never_followed_through_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / run_lock.LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="cannot open the lock file"):
        RunLock(str(tmp_path / "run"))
    assert target.read_text() == "keep"


def test_a_second_training_run_on_a_locked_model_dir_is_refused_at_once(model_dir):
    model_dir.mkdir()
    holder = _hold_lock(model_dir)
    try:
        started = time.monotonic()
        result = train([*E2E, "--train_steps=5", f"--model_dir={model_dir}"])
        assert result.returncode == EXIT_MODEL_DIR_BUSY, result.stderr[-2000:]  # retryable
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in result.stderr
        assert f"pid {holder.pid} on host" in errors[0] and time.monotonic() - started < 120
        assert sorted(p.name for p in model_dir.iterdir()) == [run_lock.LOCK_NAME]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert_ok(train([*E2E, "--train_steps=5", f"--model_dir={model_dir}"]))


def test_two_runs_started_together_one_trains_one_is_refused(model_dir):
    command = [sys.executable, "-m", "distributed_mpt.train", *E2E, "--train_steps=20",
               f"--model_dir={model_dir}"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env(), cwd=REPO) for _ in range(2)]
    results = sorted((run.wait(timeout=300), run.stderr.read()) for run in runs)
    assert [code for code, _ in results] == [0, EXIT_MODEL_DIR_BUSY], results
    assert "in use by another run" in results[1][1]
    steps = [json.loads(line)["step"] for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


def test_remove_debris_takes_only_what_this_project_writes(tmp_path):
    (tmp_path / "checkpoints" / "ckpt-4_temp").mkdir(parents=True)
    debris = [".tmp-abc123", ".write-test-x1", ".export-1a2b3c4d/saved_model/x", ".export-1a2b3c4d-old/y",
              "checkpoints/.tmp-q", "checkpoints/ckpt-4_temp/part-00000-of-00001.index",
              "checkpoints/ckpt-4.index.tempstate123", "checkpoints/checkpoint.tmp0f1e"]
    kept = ["checkpoints/ckpt-3.index", "checkpoints/ckpt-3.data-00000-of-00001",
            "checkpoints/checkpoint", "checkpoints/model.json", "metrics.jsonl", "notes.tmp",
            "export/saved_model/saved_model.pb", "my.tmp-file", "tensorboard/events.out.tfevents.1"]
    for name in debris + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    with RunLock(str(tmp_path)) as lock:
        removed = lock.remove_debris()
    assert len(removed) == 8
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(kept + [run_lock.LOCK_NAME])


def test_what_tensorflow_leaves_when_killed_mid_save_is_debris(tmp_path):
    """The temporary names are TensorFlow's: kill a saver while it writes and
    check that after remove_debris only whole checkpoints are left."""
    checkpoint_dir = tmp_path / "checkpoints"
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(checkpoint_dir)],
                             stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO)
    try:
        assert saver.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 120
        while not list(checkpoint_dir.glob("ckpt-*_temp/*")) and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait()
    assert list(checkpoint_dir.glob("ckpt-*_temp")), "killed while a checkpoint was being written"
    with RunLock(str(tmp_path)) as lock:
        lock.remove_debris()
    for path in checkpoint_dir.iterdir():
        assert path.name == "checkpoint" or checkpointing._CHECKPOINT_FILE.match(path.name), path


def test_a_run_after_a_killed_run_removes_its_debris(model_dir):
    assert_ok(train([*E2E, "--train_steps=5", f"--model_dir={model_dir}"]))
    for name in (".tmp-x", ".export-12345678/saved_model", "checkpoints/ckpt-9_temp/part",
                 "checkpoints/checkpoint.tmpabc"):
        (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / name).write_text("x")
    assert_ok(train([*E2E, "--train_steps=10", f"--model_dir={model_dir}"]))
    assert not [p for p in model_dir.rglob("*") if ".tmp" in p.name or "_temp" in p.name
                or p.name.startswith(".export-")]


_SAVER = """
import sys
import tensorflow as tf
from distributed_mpt.training.models import build_model
manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=build_model("mlp")), sys.argv[1],
                                     max_to_keep=3)
print("saving", flush=True)
for number in range(1, 1000):
    manager.save(checkpoint_number=number)
"""
