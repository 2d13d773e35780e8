"""Checkpoints that cannot be lost: damaged ones skipped, another model's
refused, a full disk survived, and non-chief workers' private scratch
directories. A full disk is a real tmpfs where the test may mount one."""

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import (SMOKE_FLAGS, assert_ok, group_settings, make_path, read_summary, snapshot,
                      train)
from distributed_mpt import files
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
from distributed_mpt.core.optim import groups, optimizer as optimizer_lib
from distributed_mpt.errors import CheckpointMismatchError, UserError
from distributed_mpt.training import checkpoints
from distributed_mpt.training.checkpoints import (MAX_TO_KEEP, CheckpointDamagedError, Checkpoints,
                                                  DiskFullError, model_identity)


def build_model(name, width=64):
    return models.build_model(models.model_spec(name), cifar10.INFO, width)


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


@pytest.mark.parametrize("index", [b"garbage {{{\n", b'model_checkpoint_path: "ckpt-9"\n',
                                   b"\xff\xfe\x00binary", b""])
def test_the_index_file_is_not_trusted(tmp_path, index):
    """A garbage index, or one naming a missing checkpoint, made the old code
    start from step 0 over three good checkpoints; binary garbage made it
    raise UnicodeDecodeError."""
    _save_steps(tmp_path, [1, 2, 3])
    Path(tmp_path, "checkpoints", "checkpoint").write_bytes(index)
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
    before = snapshot(tmp_path)
    _checkpoints(tmp_path)[0].restore_latest()
    assert snapshot(tmp_path) == before


def test_when_no_checkpoint_reads_back_nothing_is_changed(tmp_path):
    _save_steps(tmp_path, [1, 2])
    _flip_bytes(_data(tmp_path, 1))
    Path(tmp_path, "checkpoints", "ckpt-2.index").write_bytes(b"")
    before = snapshot(tmp_path)
    restorer, step = _checkpoints(tmp_path)
    with pytest.raises(CheckpointDamagedError) as raised:
        restorer.restore_latest()
    message = str(raised.value)
    assert "\n" not in message and "none can be read" in message
    assert "ckpt-2:" in message and "ckpt-1:" in message and "nothing was changed" in message
    assert isinstance(raised.value, UserError) and raised.value.exit_code == 2
    assert snapshot(tmp_path) == before and int(step.numpy()) == 0


def test_a_readable_checkpoint_of_other_state_is_still_refused(tmp_path):
    _save_steps(tmp_path, [1])
    other = build_model("resnet9", width=8)
    restorer = Checkpoints(str(tmp_path), None, model_identity(other, "float32"), model=other)
    with pytest.raises(CheckpointMismatchError, match="different model"):
        restorer.check_identity()
    with pytest.raises(CheckpointMismatchError, match="cannot restore"):
        restorer.restore_latest()


def test_an_index_naming_no_checkpoint_on_disk_is_removed(tmp_path):
    _save_steps(tmp_path, [1])
    for path in Path(tmp_path, "checkpoints").glob("ckpt-1.*"):
        path.unlink()
    Path(tmp_path, "checkpoints", "checkpoint").write_bytes(b"\x80garbage")
    restorer, step = _checkpoints(tmp_path)
    assert restorer.restore_latest() is None
    assert not Path(tmp_path, "checkpoints", "checkpoint").exists()
    restorer.save(1)  # the manager starts from a clean state


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"", b"[1, 2]", b'{"model": 3}',
                                     b"[" * 100_000])
def test_a_damaged_model_json_is_one_error_naming_it(tmp_path, content):
    _save_steps(tmp_path, [1])
    Path(tmp_path, "checkpoints", "model.json").write_bytes(content)
    with pytest.raises(UserError) as raised:
        _checkpoints(tmp_path)[0].check_identity()
    message = str(raised.value)
    assert "model.json is damaged" in message and "\n" not in message
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("kind", ["FIFO", "socket", "link to /dev/zero", "directory"])
@pytest.mark.parametrize("suffix", ["index", "data-00000-of-00001"])
def test_a_checkpoint_file_that_is_not_a_file_is_refused_unread(tmp_path, kind, suffix):
    """TensorFlow opened a FIFO at a checkpoint's index or data file and waited
    for a writer forever. Each kind is refused, with one line, before any of
    it is opened, and stays as it was."""
    _save_steps(tmp_path, [1, 2])
    path = Path(tmp_path, "checkpoints", f"ckpt-2.{suffix}")
    path.unlink()  # what a user, a script or a broken copy can leave in its place
    make_path(kind, path)
    restorer, _ = _checkpoints(tmp_path)
    outcome = []

    def restore():
        try:
            restorer.restore_latest()
        except Exception as e:  # noqa: BLE001 - the outcome is asserted below
            outcome.append(e)

    reader = threading.Thread(target=restore, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # let a reader blocked on the FIFO go, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"restoring waited on the {kind} at {path.name}")
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointDamagedError), outcome
    message = str(outcome[0])
    assert f"ckpt-2.{suffix}" in message and "not a checkpoint file" in message
    assert "\n" not in message
    assert os.path.lexists(path) and not path.is_file() or kind == "directory"


def test_a_checkpoint_whose_name_is_not_its_step_is_skipped(tmp_path):
    """A copy of ckpt-2 named with a number no run reaches, or a later step,
    became the newest checkpoint: each restart resumed from step 2 and
    trained the same steps again, and the run never finished."""
    _save_steps(tmp_path, [1, 2])
    directory = Path(tmp_path, "checkpoints")
    for number in ("99999999999999999999999", "7"):
        for path in directory.glob("ckpt-2.*"):
            shutil.copy(path, directory / path.name.replace("ckpt-2", f"ckpt-{number}"))
    restorer, step = _checkpoints(tmp_path)
    restored = restorer.restore_latest()
    assert (restored.step, int(step.numpy())) == (2, 2)
    assert [Path(p).name for p, _ in restored.skipped] == ["ckpt-99999999999999999999999",
                                                           "ckpt-7"]
    line = restored.describe()
    assert "larger than any step" in line and "holds step 2, not the step its name says" in line
    assert "resuming from step 2 " in line and "\n" not in line


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
    # Cut back to the step restored (10), then a line after each of the
    # first two calls of the resumed run (11, 12) and at the interval (20).
    assert steps == [1, 2, 10, 11, 12, 20], "metrics cut back to the step actually restored"


def test_a_log_longer_than_any_file_read_whole_resumes(model_dir, monkeypatch):
    """metrics.jsonl grows by a line per logged step: past 1.3 M of them
    (--log_every_steps=1) it was larger than any file the package reads whole
    (files.MAX_READ_BYTES, 256 MB), and the run could not resume (exit 2).
    Here, in this process, that bound is lowered rather than the log grown."""
    flags = [*E2E, "--log_every_steps=1", f"--model_dir={model_dir}"]
    assert_ok(train([*flags, "--train_steps=30"]))
    metrics = model_dir / "metrics.jsonl"
    logged = metrics.read_bytes()
    # What a run killed after step 31 leaves: a step trained again, a line cut short.
    with open(metrics, "ab") as f:
        f.write(b'{"step": 31, "elapsed_seconds": 100000}\n{"step": 32, "elap')
    # Too small for the log, not for the files a run reads whole (config.json...).
    monkeypatch.setattr(files, "MAX_READ_BYTES", len(logged) - 1)
    assert max(p.stat().st_size for p in model_dir.rglob("*.json")) < len(logged) - 1
    result = train([*flags, "--train_steps=35"])
    assert_ok(result)
    assert "metrics.jsonl: its last line was cut short; rewritten without it" in result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 36))
    assert metrics.read_bytes().startswith(logged), "the records of steps 1-30 kept as they were"
    assert records[30]["elapsed_seconds"] > 100000, "the killed run's time counted, all of it"


def test_training_over_a_fifo_at_a_checkpoint_file_is_one_error_line(model_dir):
    assert_ok(train([*E2E, "--train_steps=10", f"--model_dir={model_dir}"]))
    data = _data(model_dir, 10)
    data.unlink()
    os.mkfifo(data)
    before = snapshot(model_dir)
    # A process with a deadline: the run waited for a writer to the FIFO forever.
    result = train([*E2E, "--train_steps=20", f"--model_dir={model_dir}"], timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is a FIFO, not a checkpoint file" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and snapshot(model_dir) == before


def test_training_over_unreadable_checkpoints_stops_and_changes_nothing(model_dir):
    assert_ok(train([*E2E, "--train_steps=10", f"--model_dir={model_dir}"]))
    for step in (5, 10):
        Path(model_dir, "checkpoints", f"ckpt-{step}.index").write_bytes(b"")
    before = snapshot(model_dir)
    result = train([*E2E, "--train_steps=20", f"--model_dir={model_dir}"])
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "none can be read" in errors[0] and "Traceback" not in result.stderr
    assert snapshot(model_dir) == before


# --- a full disk ---------------------------------------------------------------


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
    needed = (MAX_TO_KEEP + 1) * checkpoints.checkpoint_bytes(model=model, step=step)
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


def _resumed_with_a_path_mounted_over(tmp_path, name: str, read_only: bool):
    """A 2-step run, resumed to 4 steps with `name` of its --model_dir
    bind-mounted onto itself (read-only if asked); the run's directory, its
    flags, the resumed run's result and its error lines."""
    model_dir = tmp_path / "run"
    flags = [*SMOKE_FLAGS, "--model=resnet9", "--model_width=4", "--noevaluate",
             f"--model_dir={model_dir}"]
    assert_ok(train([*flags, "--train_steps=2"]))
    path = model_dir / name
    if subprocess.run(["mount", "--bind", str(path), str(path)]).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        result = train([*flags, "--train_steps=4"])
    finally:
        subprocess.run(["umount", str(path)], check=True)
    return model_dir, flags, result, [
        line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_checkpoints_that_cannot_be_written_are_one_line_and_the_rerun_resumes(tmp_path):
    """checkpoints/ on a read-only mount (as a directory of another user,
    EACCES): a TensorFlow traceback and exit 1, before; then one line after
    the steps it could not keep; now one line before any step."""
    model_dir, flags, result, errors = _resumed_with_a_path_mounted_over(
        tmp_path, "checkpoints", read_only=True)
    saved = model_dir / "checkpoints"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors == [f"error: {saved} is not writable (Read-only file system), and a run writes "
                      f"its checkpoints there: make it writable for this user, or choose another "
                      f"--model_dir"]
    assert "step " not in result.stdout, "no step trained that could not be kept"
    assert_ok(train([*flags, "--train_steps=4"]))
    assert read_summary(model_dir)["resumed_from_step"] == 2


def test_a_file_of_the_run_that_cannot_be_replaced_is_one_line(tmp_path):
    """summary.json mounted onto itself (EBUSY as it is renamed over): an
    OSError traceback, and its temporary file left in --model_dir."""
    model_dir, _, result, errors = _resumed_with_a_path_mounted_over(
        tmp_path, "summary.json", read_only=False)
    summary = model_dir / "summary.json"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors == [f"error: cannot write {summary} (Device or resource busy): free it of what "
                      f"holds it (a mount) and run the same command again to resume"]
    assert not [p.name for p in model_dir.iterdir() if p.name.startswith(".tmp")]


def test_checkpoint_bytes_match_the_files_written(tmp_path):
    model = build_model("resnet9", width=8)
    step = tf.Variable(0, dtype=tf.int64)
    # The optimizer a run checkpoints: a momentum slot per trained variable.
    optimizer = optimizer_lib.make_optimizer(
        groups.parameter_groups(model, group_settings(0.1, weight_decay=5e-4, momentum=0.9)),
        lambda s: 0.1, step, loss_scaling=False)
    optimizer.build(model.trainable_variables)
    Checkpoints(str(tmp_path), None, model_identity(model, "float32"), model=model,
                optimizer=optimizer, step=step).save(1)
    written = sum(p.stat().st_size for p in (tmp_path / "checkpoints").glob("ckpt-1.*"))
    estimate = checkpoints.checkpoint_bytes(model=model, optimizer=optimizer, step=step)
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


def test_checkpoints_restore_and_refuse_another_model(tmp_path):
    mlp = build_model("mlp")
    saver, step = _checkpoints(tmp_path, mlp)
    saver.check_identity()
    step.assign(7)
    saver.save(7)
    restorer, restored_step = _checkpoints(tmp_path, build_model("mlp"))
    restorer.check_identity()
    assert restorer.restore_latest() and int(restored_step.numpy()) == 7
    other, _ = _checkpoints(tmp_path, build_model("resnet9", width=4))
    with pytest.raises(CheckpointMismatchError, match="different model"):
        other.check_identity()


def test_checkpoints_of_another_precision_say_which_flag_to_pass(tmp_path):
    model = build_model("resnet9", width=4)
    step = tf.Variable(0, dtype=tf.int64)
    Checkpoints(str(tmp_path), None, model_identity(model, "mixed_float16"), model=model,
                step=step).save(1)
    other = Checkpoints(str(tmp_path), None, model_identity(model, "float32"), model=model, step=step)
    with pytest.raises(CheckpointMismatchError, match="--precision=mixed_float16"):
        other.check_identity()
