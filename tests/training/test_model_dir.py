"""What a run may touch in --model_dir: a directory of the user's files is
refused unless adopted, and a run removes only what a killed run of this
package left, by the exact shapes of the names it makes. The killed runs
are real processes."""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import (REPO, SMOKE_FLAGS, assert_ok, assert_one_error_line, snapshot, subprocess_env,
                      train)
from distributed_mpt.errors import ConfigError
from distributed_mpt.process import run_lock
from distributed_mpt.process.run_lock import RunLock
from distributed_mpt.training import checkpoints, outputs

E2E = [*SMOKE_FLAGS, "--checkpoint_every_steps=5", "--noevaluate"]


def test_a_directory_of_the_users_files_is_refused_unless_adopted(tmp_path):
    assert outputs.check_ours(str(tmp_path / "missing")) is None
    (tmp_path / "empty").mkdir()
    outputs.check_ours(str(tmp_path / "empty"))
    # What another run writes before its marker: the lock, its write test and
    # the marker's temporary file. Left to the lock (CI saw two runs started
    # together end in exit 2, "files this program did not write", not busy).
    starting = tmp_path / "starting"
    starting.mkdir()
    for name in (run_lock.LOCK_NAME, ".write-test-4242-9f3ab2c1-ab12cd_3",
                 ".tmp-4242-9f3ab2c1-x9y8z7w6"):
        (starting / name).write_text("")
    outputs.check_ours(str(starting))
    users = tmp_path / "users"
    users.mkdir()
    (users / "config.json").write_text('{"mine": 1}')
    (users / ".tmp-notes").write_text("mine")
    with pytest.raises(ConfigError) as raised:
        outputs.check_ours(str(users))
    message = str(raised.value)
    assert "holds files this program did not write (.tmp-notes, config.json)" in message
    assert "--adopt_model_dir" in message and "\n" not in message
    outputs.check_ours(str(users), adopt=True)
    outputs.mark(str(users))
    outputs.check_ours(str(users))  # marked: ours from now on


def test_a_run_refuses_a_directory_of_the_users_files_and_adopts_it_when_told(model_dir):
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"mine": 1}\n')
    (model_dir / "notes.txt").write_text("mine\n")
    before = snapshot(model_dir)
    # A process: the refusal comes before TensorFlow starts, sooner than an
    # in-process run may wait for the log filter to pass its line on.
    refused = train([*E2E, "--train_steps=2", f"--model_dir={model_dir}"], timeout=300)
    assert_one_error_line(refused, "holds files this program did not write")
    assert "--adopt_model_dir" in refused.stderr
    assert snapshot(model_dir) == before, "nothing written, nothing removed"

    assert_ok(train([*E2E, "--train_steps=2", "--adopt_model_dir", f"--model_dir={model_dir}"]))
    assert (model_dir / "notes.txt").read_text() == "mine\n", "the user's other files stay"
    assert (model_dir / outputs.MARKER).is_file()
    # Marked: the next run needs no flag.
    assert_ok(train([*E2E, "--train_steps=4", f"--model_dir={model_dir}"]))


@pytest.mark.parametrize("folder", ["checkpoints", "tensorboard"])
def test_a_run_refuses_a_folder_of_its_own_that_links_elsewhere(tmp_path, model_dir, folder):
    """A run writes into its folders and clears TensorFlow's leftovers from
    them by name: through a link, a user's `checkpoint.tmp42` where it led
    was deleted. Refused before anything is written, where it leads untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "checkpoint.tmp42").write_text("mine\n")
    (elsewhere / ("checkpoint.tmp" + "0f1e" * 8)).write_text("mine, shaped like TensorFlow's\n")
    model_dir.mkdir()
    outputs.mark(str(model_dir))
    (model_dir / folder).symlink_to(elsewhere)
    before = snapshot(model_dir, elsewhere)
    refused = train([*E2E, "--train_steps=2", f"--model_dir={model_dir}"], timeout=300)
    assert_one_error_line(refused, f"{model_dir / folder} is a symbolic link to a directory, "
                                   f"and a run writes and removes files in its {folder} folder")
    assert snapshot(model_dir, elsewhere) == before, "nothing written, nothing removed"


TAG = "4242-9f3ab2c1"  # a killed run's owner tag, as its lock file records it


def test_remove_debris_takes_only_what_carries_a_killed_runs_tag(tmp_path):
    (tmp_path / "checkpoints" / "ckpt-4_temp").mkdir(parents=True)
    debris = [f".tmp-{TAG}-abc123_z", f".write-test-{TAG}-x1y2z3w4",
              f".export-{TAG}-1a2b3c4d/saved_model/x", f".export-{TAG}-1a2b3c4d-old/y",
              f"checkpoints/.tmp-{TAG}-q1w2e3r4",
              "checkpoints/ckpt-4_temp/part-00000-of-00001.index",
              "checkpoints/ckpt-4.index.tempstate123", "checkpoints/checkpoint.tmp" + "0f1e" * 8]
    kept = ["checkpoints/ckpt-3.index", "checkpoints/ckpt-3.data-00000-of-00001",
            "checkpoints/checkpoint", "checkpoints/model.json", "metrics.jsonl", "notes.tmp",
            "export/saved_model/saved_model.pb", "my.tmp-file", "tensorboard/events.out.tfevents.1",
            # A user's names, among them the shapes the package made before
            # its names carried a tag: nothing proves they are the package's.
            ".export-backup/notes.txt", ".tmp-notes", ".tmp-ABCDEFGH", ".tmp-abc123_z9",
            ".tmp-abc123_z", ".write-test-x1y2z3w4", ".export-1a2b3c4d/x", ".write-test-notes",
            # Another run's tag, or one made to look like it.
            ".tmp-4242-9f3ab2c2-abc123_z", f".export-{TAG}-1a2b3c4d-new/x",
            f"checkpoints/.tmp-1-{TAG[5:]}-q1w2e3r4",
            # Not TensorFlow's name for an index being written (a uuid4's 32 hex digits).
            "checkpoints/checkpoint.tmp42", "checkpoints/checkpoint.tmp" + "0f1e" * 7]
    for name in debris + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    outputs.mark(str(tmp_path))
    with RunLock(str(tmp_path)):
        removed = outputs.remove_debris(str(tmp_path), [TAG])
    assert len(removed) == 8
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(kept + [run_lock.LOCK_NAME, outputs.MARKER])


def test_remove_debris_touches_nothing_in_a_directory_not_marked_as_ours(tmp_path):
    for name in (f".tmp-{TAG}-abcd1234", f".export-{TAG}-1a2b3c4d/x",
                 "checkpoints/checkpoint.tmp0f1e"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    before = snapshot(tmp_path)
    assert outputs.remove_debris(str(tmp_path), [TAG]) == []
    assert snapshot(tmp_path) == before


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
    outputs.mark(str(tmp_path))
    with RunLock(str(tmp_path)):
        outputs.remove_debris(str(tmp_path), [])
    for path in checkpoint_dir.iterdir():
        assert path.name == "checkpoint" or checkpoints._CHECKPOINT_FILE.match(path.name), path


def test_a_run_after_a_killed_run_removes_its_debris_and_only_that(model_dir):
    assert_ok(train([*E2E, "--train_steps=5", f"--model_dir={model_dir}"]))
    # What a run killed mid-write leaves: its record in the lock file, and
    # temporary names carrying the tag that record names.
    (model_dir / run_lock.LOCK_NAME).write_text(json.dumps(
        {"host": "h", "pid": 4242, "since": "2026-01-01T00:00:00+0000", "tag": TAG}) + "\n")
    for name in (f".tmp-{TAG}-x1y2z3w4", f".export-{TAG}-12345678/saved_model",
                 "checkpoints/ckpt-9_temp/part", "checkpoints/checkpoint.tmp" + "abc0" * 8):
        (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / name).write_text("x")
    # The user's, in the shapes the package's names had before they carried a tag.
    users = [".export-backup/notes", ".tmp-notes", ".tmp-x1y2z3w4", ".export-12345678/mine",
             ".write-test-abcd1234"]
    for name in users:
        (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / name).write_text("mine")
    result = train([*E2E, "--train_steps=10", f"--model_dir={model_dir}"])
    assert_ok(result)
    assert "removed what a killed run left" in result.stdout
    assert not [p for p in model_dir.rglob("*") if TAG in p.name or "_temp" in p.name
                or p.name.startswith("checkpoint.tmp")]
    for name in users:
        assert (model_dir / name).read_text() == "mine", f"the user's {name} is left alone"


_SAVER = """
import sys
import tensorflow as tf
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
model = models.build_model(models.model_spec("mlp"), cifar10.INFO)
manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), sys.argv[1], max_to_keep=3)
print("saving", flush=True)
for number in range(1, 1000):
    manager.save(checkpoint_number=number)
"""
