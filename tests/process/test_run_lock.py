"""One run per model directory, held for the life of the run. The holders
are real processes (what a run removes of a killed one's: test_model_dir.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (REPO, SMALL_MODEL, SMOKE_FLAGS, WatchedProcess, assert_ok,
                      assert_one_error_line, subprocess_env, train)
from distributed_mpt import files
from distributed_mpt.process import run_lock
from distributed_mpt.errors import ConfigError, ExitCode
from distributed_mpt.process.run_lock import ModelDirBusyError, RunLock
from distributed_mpt.training import outputs

E2E = [*SMOKE_FLAGS, "--checkpoint_every_steps=5", "--noevaluate"]
# The line of a worker whose chief lost its lock: the chief's --model_dir,
# which this worker's flag need not name as the chief's does, is not named.
_PEERS_LINE = ("error: the chief lost its lock: its --model_dir or the .lock file in it was "
               "removed or moved during this run (the chief's own line names the "
               "directory): every worker stops; put it back (or start afresh) and run the same "
               "command again")


_HOLDER = """
import sys, time
from distributed_mpt.process.run_lock import RunLock
from distributed_mpt.training import outputs
lock = RunLock(sys.argv[1])
if sys.argv[2:] == ["mark"]:
    outputs.mark(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def _hold_lock(model_dir, mark=False):
    """A separate process that takes the lock through the module and sleeps;
    with `mark`, it then marks the directory as a run does."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(model_dir),
                               *(["mark"] if mark else [])],
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


@pytest.mark.parametrize("content", [b"my notes\n", b'{"pid": 1}\n', b"\xff\xfe", b"[]"])
def test_a_lock_file_of_the_users_is_refused_not_emptied(tmp_path, content):
    """A `.lock` of the user's (their notes, a JSON file of theirs) was
    emptied by the next run; a hard link to one would empty their file."""
    path = tmp_path / run_lock.LOCK_NAME
    path.write_bytes(content)
    with pytest.raises(ConfigError) as raised:
        RunLock(str(tmp_path))
    assert "holds something this program did not write" in str(raised.value)
    assert "\n" not in str(raised.value)
    assert path.read_bytes() == content, "left as it was"


def test_a_hard_link_at_the_lock_file_is_refused(tmp_path):
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("")
    (tmp_path / "run").mkdir()
    os.link(theirs, tmp_path / "run" / run_lock.LOCK_NAME)
    with pytest.raises(ConfigError, match="is a hard link .2 names share the file"):
        RunLock(str(tmp_path / "run"))
    assert theirs.read_text() == ""


def test_a_hard_linked_copy_of_a_run_resumes_apart_from_the_original(tmp_path):
    """`cp -al` (a backup tool's snapshot alike): the copy's lock file, empty
    and shared, was refused as "something this program did not write"; once
    it was removed, the resume appended its steps to the original's log."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    flags = [*E2E, "--log_every_steps=2"]
    assert_ok(train([*flags, "--train_steps=4", f"--model_dir={original}"]))
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before = {p.relative_to(original): p.read_bytes() for p in original.rglob("*") if p.is_file()}
    assert_one_error_line(train([*flags, "--train_steps=8", f"--model_dir={copy}"]),
                          f"{copy / run_lock.LOCK_NAME} is a hard link (2 names share")
    (copy / run_lock.LOCK_NAME).unlink()  # as the line says
    assert_ok(train([*flags, "--train_steps=8", f"--model_dir={copy}"]))
    assert {p.relative_to(original): p.read_bytes() for p in original.rglob("*")
            if p.is_file()} == before
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8 and 4 in steps


def test_a_run_over_a_users_lock_file_is_one_error_line(model_dir):
    model_dir.mkdir()
    (model_dir / run_lock.LOCK_NAME).write_text("the key to the shed\n")
    result = train([*E2E, "--train_steps=2", f"--model_dir={model_dir}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds something this program did not write" in errors[0]
    assert (model_dir / run_lock.LOCK_NAME).read_text() == "the key to the shed\n"
    assert sorted(p.name for p in model_dir.iterdir()) == [run_lock.LOCK_NAME]


def test_the_lock_file_is_never_followed_through_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / run_lock.LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="cannot open the lock file"):
        RunLock(str(tmp_path / "run"))
    assert target.read_text() == "keep"


def test_a_lock_file_that_is_not_a_regular_file_is_refused_unopened(tmp_path):
    os.mkfifo(tmp_path / run_lock.LOCK_NAME)  # opened for reading, it would wait for a writer
    with pytest.raises(ConfigError, match="is not a regular file"):
        RunLock(str(tmp_path))
    assert (tmp_path / run_lock.LOCK_NAME).is_fifo(), "left as it was"


# A run takes the lock, then marks the directory as the package's: a
# second run may come between the two.
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "lock only"])
def test_a_second_training_run_on_a_locked_model_dir_is_refused_at_once(model_dir, marked):
    model_dir.mkdir()
    holder = _hold_lock(model_dir, mark=marked)
    try:
        started = time.monotonic()
        result = train([*E2E, "--train_steps=5", f"--model_dir={model_dir}"])
        assert result.returncode == ExitCode.MODEL_DIR_BUSY, result.stderr[-2000:]  # retryable
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in result.stderr
        assert f"pid {holder.pid} on host" in errors[0] and time.monotonic() - started < 120
        assert sorted(p.name for p in model_dir.iterdir()) == \
            sorted([run_lock.LOCK_NAME, *([outputs.MARKER] if marked else [])])
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
    assert [code for code, _ in results] == [0, ExitCode.MODEL_DIR_BUSY], results
    assert "in use by another run" in results[1][1]
    steps = [json.loads(line)["step"] for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


def test_a_stop_mid_write_removes_the_new_directory_with_its_own_temporary_file(tmp_path):
    """A stop during start-up removes the directory the run created; a
    write the stop cut short (found under load: the marker's temporary
    file) is this process's, by its owner tag, and goes too. Another
    process's, or the user's, keeps the directory."""
    from distributed_mpt import files

    for name, removed in [(f"{files.TEMPORARY_PREFIX}{files.owner_tag()}-abcd1234", True),
                          (f"{files.TEMPORARY_PREFIX}1-0badc0de-abcd1234", False),
                          (".tmp-notes", False)]:
        directory = tmp_path / name.strip(".")
        directory.mkdir()
        lock = RunLock(str(directory))
        (directory / name).write_text("half")
        lock.release(remove_model_dir_if_unused=True, own_files=outputs.BEFORE_TRAINING)
        assert directory.exists() is not removed, name


def test_a_file_renamed_while_a_stop_removes_the_new_directory_is_removed_too(tmp_path,
                                                                             monkeypatch):
    # A stop's undo runs beside the main thread, which may rename its
    # temporary file to the marker between the undo's listing and its
    # removal: the directory used to stay, holding the lock file and the
    # marker (a CI run, 2026-12-05).
    from distributed_mpt import files

    model_dir = tmp_path / "run"
    model_dir.mkdir()
    lock = RunLock(str(model_dir))
    temporary = model_dir / f"{files.TEMPORARY_PREFIX}{files.owner_tag()}-marker"
    temporary.write_text("{}\n")
    remove = os.remove

    def renamed_first(path):
        if os.path.basename(path) == temporary.name:
            os.rename(temporary, model_dir / outputs.MARKER)  # the main thread's rename
            raise FileNotFoundError(path)
        remove(path)

    monkeypatch.setattr(os, "remove", renamed_first)
    lock.release(remove_model_dir_if_unused=True, own_files=(outputs.MARKER,))
    assert not model_dir.exists()


def test_a_directory_that_gains_a_file_of_the_users_meanwhile_is_left(tmp_path, monkeypatch):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    lock = RunLock(str(model_dir))
    (model_dir / outputs.MARKER).write_text("{}\n")
    remove = os.remove

    def users_file_appears(path):
        remove(path)
        (model_dir / "notes.txt").write_text("mine")

    monkeypatch.setattr(os, "remove", users_file_appears)
    lock.release(remove_model_dir_if_unused=True, own_files=(outputs.MARKER,))
    assert (model_dir / "notes.txt").read_text() == "mine"


def _take_away(model_dir: Path, how: str) -> None:
    if how == "rm -rf":
        shutil.rmtree(model_dir)
    elif how == "mv":
        model_dir.rename(model_dir.with_name("moved"))
    else:
        (model_dir / run_lock.LOCK_NAME).unlink()


@pytest.mark.parametrize("how", ["rm -rf", "mv", "rm .lock"])
def test_a_model_dir_or_lock_taken_away_mid_run_stops_it_with_one_line(tmp_path, how):
    """Before, a removed or moved directory ended the run with a traceback at
    its next metrics line (or a save recreated it), and with its lock file
    removed a second run took the directory and both trained in it."""
    model_dir = tmp_path / "run"
    flags = [*SMOKE_FLAGS, "--train_steps=2000", "--steps_per_loop=2", "--log_every_steps=2",
             "--checkpoint_every_steps=20", "--noevaluate", f"--model_dir={model_dir}"]
    run = WatchedProcess("distributed_mpt.train", flags)
    run.wait_for(r"^step +30/", timeout=300)
    _take_away(model_dir, how)
    assert run.finish(timeout=120) == ExitCode.USAGE, run.output()[-2000:]
    assert "Traceback" not in run.output()
    assert run.output().splitlines()[-1].startswith(
        f"error: --model_dir={model_dir} or its .lock file was removed or moved"), run.output()
    if how == "rm -rf":
        assert not model_dir.exists(), "not recreated by a later write"


@pytest.mark.slow  # two workers
def test_a_lock_taken_from_the_chief_of_two_workers_stops_both_with_one_line(tmp_path):
    """The chief that lost its lock exited, and its peer failed in the
    collective under way as if a node had been lost: `lost a peer`, exit
    141, which a launcher or Kubernetes retries (and the restarted chief
    takes the directory again). Both now stop at the same step boundary,
    saving nothing, each with one line and the chief's exit code."""
    from distributed_mpt.launch import free_ports, worker_tf_configs

    model_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir()
    flags = [*SMOKE_FLAGS, *SMALL_MODEL, "--communication=ring", "--per_replica_batch_size=16",
             "--peer_timeout_seconds=300", "--train_steps=2000", "--steps_per_loop=2",
             "--log_every_steps=2", "--checkpoint_every_steps=1000", "--noevaluate",
             f"--model_dir={model_dir}"]
    workers = [WatchedProcess("distributed_mpt.train", flags, env=subprocess_env(
        TF_CONFIG=tf_config, TMPDIR=str(tmp_path / "tmp")))
               for tf_config in worker_tf_configs(free_ports(2))]
    workers[0].wait_for(r"^step +6/", timeout=300)
    (model_dir / run_lock.LOCK_NAME).unlink()
    taken = time.monotonic()
    # A responsiveness bound: TensorFlow's teardown at exit is most of it.
    assert [worker.finish(timeout=120) for worker in workers] == [ExitCode.USAGE] * 2, \
        "\n---\n".join(worker.output()[-3000:] for worker in workers)
    print(f"both workers ended {time.monotonic() - taken:.1f} s after the lock was taken")
    said = [[line for line in worker.output().splitlines() if line.startswith("error:")]
            for worker in workers]
    assert said[0] == [f"error: --model_dir={model_dir} or its .lock file was removed or moved "
                       f"during this run: stopping, as another run could take the "
                       f"directory; put it back (or start afresh) and run the same command "
                       f"again"], workers[0].output()[-3000:]
    assert said[1] == [_PEERS_LINE], said[1]
    assert not any("Traceback" in worker.output() for worker in workers)
    assert sorted(os.listdir(model_dir)) == [outputs.MARKER, "config.json", "metrics.jsonl",
                                             "tensorboard"], "no checkpoint, no lock file again"
    assert not list((tmp_path / "tmp").glob("dmpt-*")), "the peer's scratch directory went"


# A user's model (--model=file.py:function) whose call, run by Python only
# while TensorFlow traces it (on each worker), takes the chief's lock away
# the first time it is traced for inference (or for training) once
# CHECKPOINT is written: the final evaluation, or with --noevaluate the
# export; or the training step traced again for the last step, the first on
# whole images after early crops.
_TAKES_THE_LOCK = """
import contextlib, os
import keras

LOCK, CHECKPOINT, TRAINING = {lock!r}, {checkpoint!r}, {training!r}


class TakesTheLock(keras.layers.Layer):
    def call(self, x, training=None):
        if bool(training) == TRAINING and os.path.exists(CHECKPOINT) and os.path.exists(LOCK):
            with contextlib.suppress(FileNotFoundError):  # both workers trace it
                os.remove(LOCK)
                print("the test took the chief's lock away", flush=True)
        return x


def small(info):
    images = keras.Input((None, None, info.image_shape[-1]), dtype="uint8")  # crops too
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(TakesTheLock()(x)))
"""


@pytest.mark.slow  # two workers
@pytest.mark.parametrize("found_in", ["last step's writes", "evaluation", "export"])
def test_a_lock_taken_from_the_chief_after_training_ends_every_worker_with_2(tmp_path, found_in):
    """Taken in the last step (found in its progress line: the chief saves
    no checkpoint, its peer does), or after the last checkpoint, where no
    step is left to agree at: the chief exited 2 alone, and its peer, waiting for it at the
    end of the run, failed with `lost a peer` and exit 141, which a launcher
    or Kubernetes retries (and the restarted chief takes the directory
    again). The loss is now agreed where the workers leave together: both
    exit 2, each with one line."""
    from distributed_mpt.launch import free_ports, worker_tf_configs

    model_dir, steps = tmp_path / "run", 8
    (tmp_path / "tmp").mkdir()
    model = tmp_path / "takes_the_lock.py"
    in_training = found_in == "last step's writes"
    model.write_text(_TAKES_THE_LOCK.format(
        lock=str(model_dir / run_lock.LOCK_NAME), training=in_training,
        checkpoint=str(model_dir / "checkpoints" / f"ckpt-{4 if in_training else steps}.index")))
    flags = [*SMOKE_FLAGS, f"--model={model}:small", "--communication=ring",
             "--per_replica_batch_size=16", "--peer_timeout_seconds=300",
             f"--train_steps={steps}", "--checkpoint_every_steps=4", "--eval_every_epochs=0",
             # 32 steps an epoch: crops for steps 1-7, whole images (traced anew) for step 8
             *(["--early_crop_epochs=0.21875", "--early_crop_size=24"] if in_training else []),
             *(["--evaluate", "--noexport"] if found_in == "evaluation" else
               ["--noevaluate", "--export"]), f"--model_dir={model_dir}"]
    started = time.monotonic()
    workers = [WatchedProcess("distributed_mpt.train", flags, env=subprocess_env(
        TF_CONFIG=tf_config, TMPDIR=str(tmp_path / "tmp")))
               for tf_config in worker_tf_configs(free_ports(2))]
    # Generous: two TensorFlow start-ups on a loaded machine, then a few seconds.
    codes = [worker.finish(timeout=400) for worker in workers]
    output = "\n---\n".join(worker.output()[-3000:] for worker in workers)
    print(f"both workers ended {time.monotonic() - started:.1f} s after they started")
    assert "the test took the chief's lock away" in output, output
    assert not (model_dir / run_lock.LOCK_NAME).exists(), output
    assert codes == [ExitCode.USAGE] * 2, (codes, output)
    said = [[line for line in worker.output().splitlines() if line.startswith("error:")]
            for worker in workers]
    assert said[0] == [f"error: --model_dir={model_dir} or its .lock file was removed or moved "
                       f"during this run: stopping, as another run could take the "
                       f"directory; put it back (or start afresh) and run the same command "
                       f"again"], output
    assert said[1] == [_PEERS_LINE], output
    assert "lost a peer" not in output and "Traceback" not in output, output
    assert not (model_dir / "summary.json").exists() and not (model_dir / "export").exists()
    if in_training:  # found in the progress line of step 8: its checkpoint is not written
        assert not (model_dir / "checkpoints" / f"ckpt-{steps}.index").exists()
    assert not list((tmp_path / "tmp").glob("dmpt-*")), "the peer's scratch directory went"


def test_a_run_whose_working_directory_is_removed_goes_on(tmp_path):
    """A relative --model_dir outside the working directory, which is then
    removed: the run's first checkpoint after it ended with a traceback
    (TensorFlow's index resolves paths against the working directory)."""
    working = tmp_path / "work"
    working.mkdir()
    flags = [*SMOKE_FLAGS, "--train_steps=200", "--steps_per_loop=2", "--log_every_steps=2",
             "--checkpoint_every_steps=20", "--noevaluate", "--model_dir=../run"]
    run = subprocess.Popen([sys.executable, "-m", "distributed_mpt.train", *flags], cwd=working,
                           env=subprocess_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    for line in run.stdout:
        if line.startswith("step  10/"):
            break
    working.rmdir()
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 0, output[-2000:]
    assert "Traceback" not in output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 200


# Runs the real entry point with the end of training held at `where` (the
# export, the summary) until the test has taken --model_dir away, as a user
# would while it runs there.
_HELD_AT = """
import os, sys, time
from distributed_mpt import files
from distributed_mpt.training import outputs
from distributed_mpt.train import main

def held(real, is_the_place):
    def wait_then(*args, **kwargs):
        if is_the_place(*args):
            print("held", flush=True)
            while not os.path.exists(sys.argv[1]):
                time.sleep(0.05)
        return real(*args, **kwargs)
    return wait_then

if sys.argv[2] == "export":
    outputs._export_saved_model = held(outputs._export_saved_model, lambda *a: True)
else:
    files.write_json = held(files.write_json, lambda path, data: path.endswith("summary.json"))
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("where, how", [("export", "rm -rf"), ("export", "mv"),
                                        ("export", "rm .lock"), ("summary", "rm -rf")])
def test_a_model_dir_taken_away_as_the_run_ends_stops_it_with_one_line(tmp_path, where, how):
    """Taken away while the model was exported, the run exited 0 with the
    export (and summary.json) written into a directory it made again at the
    old path, or into one another run could hold; before summary.json, with
    a FileNotFoundError traceback."""
    model_dir, go = tmp_path / "run", tmp_path / "go"
    flags = [*SMOKE_FLAGS, "--train_steps=10", "--export", f"--model_dir={model_dir}"]
    run = subprocess.Popen([sys.executable, "-c", _HELD_AT, str(go), where, *flags], cwd=REPO,
                           env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    for line in run.stdout:
        if line.strip() == "held":
            break
    _take_away(model_dir, how)
    go.touch()
    out, err = run.communicate(timeout=300)
    assert run.returncode == ExitCode.USAGE, out + err[-2000:]
    assert "Traceback" not in err
    # Not "while this run trained": its training was over.
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        next(line for line in err.splitlines() if "was removed or moved during this run: "
             in line)], err
    for directory in (model_dir, tmp_path / "moved"):  # nothing written after it went
        assert not (directory / "export").exists() and not (directory / "summary.json").exists()


def test_a_lock_released_on_a_moved_directory_leaves_its_record_for_the_next_run(tmp_path):
    """Emptied on release, the lock file of a directory moved mid-run lost
    the owner tag that tells the run on it, moved back, which temporary files
    (an export's staging folder) the stopped run left."""
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    lock = RunLock(str(model_dir))
    model_dir.rename(tmp_path / "moved")
    lock.release()
    with RunLock(str(tmp_path / "moved")) as successor:
        assert successor.previous_tags == [files.owner_tag()]
