"""Checkpoints that cannot be lost, one run per model directory, a full disk,
debris of killed runs, and private scratch directories (issue 8, items 1-4
and 7). Faults that are processes are real processes; a full disk is a real
tmpfs where the test may mount one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import pytest
import tensorflow as tf

from conftest import REPO, SMOKE_FLAGS, assert_ok, read_summary, subprocess_env, train
from distributed_mpt import checkpointing, run_lock
from distributed_mpt.checkpointing import (MAX_TO_KEEP, CheckpointDamagedError, Checkpoints,
                                           DiskFullError, model_identity)
from distributed_mpt.errors import EXIT_MODEL_DIR_BUSY, CheckpointMismatchError, ConfigError, UserError
from distributed_mpt.models import build_model
from distributed_mpt.run_lock import ModelDirBusyError, RunLock

# The end-to-end tests of the lock and of debris removal need train.py and
# trainer.py to take the lock and clean up; they run once that is wired.


def _checkpoints(model_dir, model=None, worker=None):
    model = model or build_model("resnet9", width=4)
    step = tf.Variable(0, dtype=tf.int64)
    return Checkpoints(str(model_dir), worker, model_identity(model, "float32"), model=model,
                       step=step), step


def _save_steps(model_dir, steps):
    saver, step = _checkpoints(model_dir)
    for number in steps:
        step.assign(number)
        saver.save(number)


def _snapshot(directory):
    """Every file's bytes and modification time (the lock file's time
    changes with each run that takes it, its content does not)."""
    return {p: (p.read_bytes(), p.name != run_lock.LOCK_NAME and p.stat().st_mtime_ns)
            for p in Path(directory).rglob("*") if p.is_file()}


def _data(model_dir, step):
    return Path(model_dir, "checkpoints", f"ckpt-{step}.data-00000-of-00001")


def _flip_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 16)


DAMAGES = {
    "empty index": lambda d: Path(d, "checkpoints", "ckpt-3.index").write_bytes(b""),
    "deleted index": lambda d: Path(d, "checkpoints", "ckpt-3.index").unlink(),
    "truncated data": lambda d: os.truncate(_data(d, 3), 100),
    "flipped data bytes": lambda d: _flip_bytes(_data(d, 3)),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, damage):
    _save_steps(tmp_path, [1, 2, 3])
    DAMAGES[damage](tmp_path)
    restorer, step = _checkpoints(tmp_path)
    restored = restorer.restore_latest()
    assert (restored.step, int(step.numpy())) == (2, 2)
    assert Path(restored.path).name == "ckpt-2", "the checkpoint reported is the one restored"
    assert [Path(p).name for p, _ in restored.skipped] == ["ckpt-3"]
    line = restored.describe()
    assert "resuming from step 2" in line and "ckpt-3:" in line and "\n" not in line


@pytest.mark.parametrize("index", ["garbage {{{\n", 'model_checkpoint_path: "ckpt-9"\n'])
def test_the_index_file_is_not_trusted(tmp_path, index):
    """A garbage index, or one naming a missing checkpoint, made the old code
    start from step 0 over three good checkpoints."""
    _save_steps(tmp_path, [1, 2, 3])
    Path(tmp_path, "checkpoints", "checkpoint").write_text(index)
    restorer, step = _checkpoints(tmp_path)
    assert restorer.restore_latest().step == 3 and int(step.numpy()) == 3
    # The index is repaired, so that the old checkpoints rotate out as usual.
    for number in (4, 5):
        step.assign(number)
        restorer.save(number)
    assert sorted(p.name for p in Path(tmp_path, "checkpoints").glob("*.index")) == \
        ["ckpt-3.index", "ckpt-4.index", "ckpt-5.index"]
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-5")


def test_a_skipped_checkpoint_is_removed_once_an_intact_newer_one_exists(tmp_path):
    _save_steps(tmp_path, [2, 4, 6])
    _flip_bytes(_data(tmp_path, 6))
    restorer, step = _checkpoints(tmp_path)
    assert restorer.restore_latest().step == 4
    step.assign(5)
    restorer.save(5)
    assert _data(tmp_path, 6).exists(), "kept while it is the newest"
    step.assign(7)
    restorer.save(7)
    assert not list(Path(tmp_path, "checkpoints").glob("ckpt-6*"))
    again, step = _checkpoints(tmp_path)
    assert again.restore_latest().step == 7 and not again.restore_latest().skipped


def test_a_finished_run_run_again_changes_no_checkpoint_file(tmp_path):
    _save_steps(tmp_path, [1, 2, 3])
    before = _snapshot(tmp_path)
    _checkpoints(tmp_path)[0].restore_latest()
    assert _snapshot(tmp_path) == before


def test_when_no_checkpoint_reads_back_nothing_is_changed(tmp_path):
    _save_steps(tmp_path, [1, 2])
    _flip_bytes(_data(tmp_path, 1))
    Path(tmp_path, "checkpoints", "ckpt-2.index").write_bytes(b"")
    before = _snapshot(tmp_path)
    restorer, step = _checkpoints(tmp_path)
    with pytest.raises(CheckpointDamagedError) as raised:
        restorer.restore_latest()
    message = str(raised.value)
    assert "\n" not in message and "none can be read" in message
    assert "ckpt-2:" in message and "ckpt-1:" in message and "nothing was changed" in message
    assert isinstance(raised.value, UserError) and raised.value.exit_code == 2
    assert _snapshot(tmp_path) == before and int(step.numpy()) == 0


def test_a_readable_checkpoint_of_other_state_is_still_refused(tmp_path):
    _save_steps(tmp_path, [1])
    other = build_model("resnet9", width=8)
    restorer = Checkpoints(str(tmp_path), None, model_identity(other, "float32"), model=other)
    with pytest.raises(CheckpointMismatchError, match="different model"):
        restorer.check_identity()
    with pytest.raises(CheckpointMismatchError, match="cannot restore"):
        restorer.restore_latest()


def test_checkpoints_without_an_index_file_still_count(tmp_path):
    _save_steps(tmp_path, [1])
    Path(tmp_path, "checkpoints", "checkpoint").unlink()
    Path(tmp_path, "checkpoints", "model.json").unlink()
    with pytest.raises(CheckpointMismatchError, match="without model.json"):
        _checkpoints(tmp_path)[0].check_identity()


# --- end to end: the real entry point over damaged checkpoints ---------------

E2E = [*SMOKE_FLAGS, "--checkpoint_every_steps=5", "--noevaluate"]


def test_training_resumes_from_the_newest_intact_checkpoint(model_dir):
    assert_ok(train([*E2E, "--train_steps=15", f"--model_dir={model_dir}"]))
    _flip_bytes(_data(model_dir, 15))
    result = train([*E2E, "--train_steps=20", f"--model_dir={model_dir}"])
    assert_ok(result)
    assert read_summary(model_dir)["resumed_from_step"] == 10
    assert "resuming from step 10" in result.stdout and "ckpt-15: " in result.stdout
    steps = [json.loads(line)["step"] for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20], "metrics cut back to the step actually restored"


def test_training_over_unreadable_checkpoints_stops_and_changes_nothing(model_dir):
    assert_ok(train([*E2E, "--train_steps=10", f"--model_dir={model_dir}"]))
    for step in (5, 10):
        Path(model_dir, "checkpoints", f"ckpt-{step}.index").write_bytes(b"")
    before = _snapshot(model_dir)
    result = train([*E2E, "--train_steps=20", f"--model_dir={model_dir}"])
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "none can be read" in errors[0] and "Traceback" not in result.stderr
    assert _snapshot(model_dir) == before


# --- one run per model directory ---------------------------------------------

_HOLDER = """
import sys, time
from distributed_mpt.run_lock import RunLock
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


# --- a full disk ---------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs; skipped where this process may not mount one."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")

    def resize(megabytes):
        subprocess.run(["mount", "-o", f"remount,size={megabytes}m", str(mount_point)], check=True)

    yield mount_point, resize
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_is_one_error_that_leaves_no_partial_checkpoint(tmpfs):
    mount_point, resize = tmpfs
    model = build_model("resnet9", width=16)  # 1.7 MB of weights: one checkpoint fits in 2 MB
    saver, step = _checkpoints(mount_point, model)
    step.assign(1)
    saver.save(1)
    step.assign(2)
    with pytest.raises(DiskFullError) as raised:
        saver.save(2)
    message = str(raised.value)
    needed = (MAX_TO_KEEP + 1) * checkpointing.checkpoint_bytes(model=model, step=step)
    assert str(mount_point / "checkpoints") in message and f"{-(-needed // 10**6)} MB" in message
    assert "\n" not in message and raised.value.exit_code == 2
    assert sorted(p.name for p in (mount_point / "checkpoints").iterdir()) == \
        ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "model.json"]

    resize(16)  # space freed: the rerun resumes from the last checkpoint and saves again
    rerun, step = _checkpoints(mount_point, build_model("resnet9", width=16))
    assert rerun.restore_latest().step == 1
    step.assign(2)
    rerun.save(2)
    assert _checkpoints(mount_point, build_model("resnet9", width=16))[0].restore_latest().step == 2


def test_checkpoint_bytes_match_the_files_written(tmp_path):
    model = build_model("resnet9", width=8)
    step = tf.Variable(0, dtype=tf.int64)
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    Checkpoints(str(tmp_path), None, model_identity(model, "float32"), model=model,
                optimizer=optimizer, step=step).save(1)
    written = sum(p.stat().st_size for p in (tmp_path / "checkpoints").glob("ckpt-1.*"))
    estimate = checkpointing.checkpoint_bytes(model=model, optimizer=optimizer, step=step)
    assert estimate <= written < estimate * 1.05 + 20_000


def test_training_on_a_full_disk_says_so_and_the_rerun_resumes(tmpfs):
    """The notebook's MLP with momentum: 98 MB per checkpoint."""
    mount_point, resize = tmpfs
    resize(160)  # room for one checkpoint, not two
    model_dir = mount_point / "run"
    result = train([*E2E, "--train_steps=15", f"--model_dir={model_dir}"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left in" in errors[0] and "392 MB" in errors[0], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not list(model_dir.rglob("*_temp*")) and not list(model_dir.rglob("*.tempstate*"))
    resize(450)
    resumed = train([*E2E, "--train_steps=15", f"--model_dir={model_dir}"])
    assert_ok(resumed)
    assert read_summary(model_dir)["resumed_from_step"] == 5


def test_an_export_on_a_full_disk_is_one_error_and_the_rerun_completes(tmpfs):
    mount_point, resize = tmpfs
    resize(16)
    model_dir = mount_point / "run"
    flags = [*E2E, "--model=resnet9", "--model_width=4", "--train_steps=5",
             f"--model_dir={model_dir}"]
    assert_ok(train(flags))  # trained, not exported (E2E has --noexport)
    (model_dir / "summary.json").unlink()  # as if killed before the export
    used = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    resize_to = f"{(used + 4096 * 40) // 1024}k"  # the export (>1 MB) cannot fit
    subprocess.run(["mount", "-o", f"remount,size={resize_to}", str(mount_point)], check=True)

    result = train([*flags, "--export"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0] and "Traceback" not in result.stderr
    assert not (model_dir / "summary.json").exists() and not (model_dir / "export").exists()
    assert not list(model_dir.glob(".export-*")) and not list(model_dir.glob(".tmp-*"))

    resize(16)
    assert_ok(train([*flags, "--export"]))
    assert (model_dir / "export" / "model.keras").exists()
    assert read_summary(model_dir)["train_loss"] is not None, "the training figures, from the log"


# --- debris of killed runs ------------------------------------------------------

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


_SAVER = """
import sys
import tensorflow as tf
from distributed_mpt.models import build_model
manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=build_model("mlp")), sys.argv[1],
                                     max_to_keep=3)
print("saving", flush=True)
for number in range(1, 1000):
    manager.save(checkpoint_number=number)
"""


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


# --- private scratch directories of non-chief workers ---------------------------

@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A world-writable, sticky temporary directory like /tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return tmp


def _worker_scratch(model_dir):
    worker, step = _checkpoints(model_dir, worker="worker-1")
    worker.save(1)
    scratch = Path(worker._own_dir)
    return worker, scratch


def test_scratch_directory_is_private_and_removed(tmp_path, private_tmp):
    worker, scratch = _worker_scratch(tmp_path / "run")
    info = os.lstat(scratch)
    assert scratch.parent == private_tmp and info.st_mode & 0o777 == 0o700
    assert info.st_uid == os.getuid() and list(scratch.glob("ckpt-1.*"))
    assert not (tmp_path / "run").exists(), "a non-chief never writes into model_dir"
    worker.close()
    assert not list(private_tmp.iterdir())


def test_a_killed_workers_scratch_directory_is_removed_by_its_successor(tmp_path, private_tmp):
    _, scratch = _worker_scratch(tmp_path / "run")  # never closed: killed
    (scratch / "ckpt-7_temp").mkdir()
    _, again = _worker_scratch(tmp_path / "run")
    assert again == scratch and sorted(p.name for p in again.iterdir()) == \
        ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]


def test_a_planted_symlink_does_not_redirect_the_scratch_directory(tmp_path, private_tmp):
    _, scratch = _worker_scratch(tmp_path / "run")
    Path(scratch).rename(tmp_path / "moved")
    target = tmp_path / "victim"
    target.mkdir()
    scratch.symlink_to(target)  # another user's trap under the predictable name
    worker, used = _worker_scratch(tmp_path / "run")
    assert not list(target.iterdir()), "nothing written through the symlink"
    assert scratch.is_symlink(), "someone else's entry is left alone"
    assert not used.is_symlink() and os.lstat(used).st_mode & 0o777 == 0o700
    worker.close()
    assert not used.exists() and target.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create another user's directory")
def test_another_users_directory_under_the_scratch_name_is_not_used(tmp_path, private_tmp):
    _, scratch = _worker_scratch(tmp_path / "run")
    worker_scratch_name = scratch.name
    shutil.rmtree(scratch)
    scratch.mkdir(mode=0o777)
    os.chown(scratch, 65534, 65534)  # nobody's, pre-created to read our checkpoints
    (scratch / "theirs").write_text("x")
    worker, used = _worker_scratch(tmp_path / "run")
    assert used.name != worker_scratch_name and os.lstat(used).st_uid == os.getuid()
    assert sorted(p.name for p in scratch.iterdir()) == ["theirs"]
    worker.close()
