"""The entry points as a user without root's rights meets them: another
user's folders and files in a run directory, a folder closed to them, a
umask that closes their own files to them. Each a refusal before anything
is trained or written, one `error:` line that names the path and says what
is wrong, and never another diagnosis ("no checkpoint", "damaged")."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import (SMOKE_FLAGS, assert_ok, assert_one_error_line, read_summary, snapshot,
                      train)
from support import unprivileged
from support.unprivileged import NOBODY_UID, chown_tree, run_as_nobody

_TEAM = 4242  # a group id of no one's, for a team's folder


@pytest.fixture
def scratch():
    """A folder the user nobody owns and may reach; skipped where a test
    cannot run a command as nobody."""
    why = unprivileged.unavailable()
    if why:
        pytest.skip(why)
    folder = unprivileged.scratch()
    yield folder
    unprivileged.remove(folder)


def _run_as_root(folder: Path, *flags) -> Path:
    """A finished run of 5 steps, trained as root, then given to nobody."""
    run = folder / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=5", f"--model_dir={run}", *flags]))
    chown_tree(run, NOBODY_UID)
    return run


@pytest.mark.parametrize("root_owns, mode, fragment", [
    # TensorFlow's summary writer failed with a traceback.
    ("tensorboard", None, "tensorboard is not writable (Permission denied)"),
    # The new export was moved into place, and removing the old one failed
    # after the training, with a traceback: summary.json unwritten.
    ("export/saved_model/variables", None, "variables is not writable (Permission denied)"),
    # Was "cannot write .../export (Permission denied): make it writable".
    ("export", 0o700, "export cannot be listed (Permission denied), and a new export removes"),
    # Found after TensorFlow's start, at the first line appended.
    ("metrics.jsonl", None, "metrics.jsonl is not writable (Permission denied), and a run "
                     "appends to it"),
    # "remove it if it is not a plain file": it is one, of another user.
    (".lock", None, "(Permission denied); make it writable for this user"),
])
def test_another_users_part_of_a_run_directory_is_refused_before_training(scratch, root_owns,
                                                                        mode, fragment):
    run = _run_as_root(scratch, "--export")
    os.chown(run / root_owns, 0, 0)
    if mode is not None:
        (run / root_owns).chmod(mode)
    before = snapshot(run)
    result = run_as_nobody("distributed_mpt.train", [
        *SMOKE_FLAGS, "--export", "--train_steps=10", f"--model_dir={run}"], scratch)
    assert_one_error_line(result, fragment)
    assert str(run) in result.stderr and "step " not in result.stdout, "nothing trained"
    assert snapshot(run) == before, "nothing written or removed"


@pytest.mark.parametrize("closed, fragment", [
    # Was "cannot be loaded (SavedModel file does not exist ...): remove it",
    # which would have had the user delete an intact export.
    ("export/saved_model/variables", "cannot read {path} (Permission denied): make it readable"),
    # Was "holds no export (export/saved_model) and no checkpoint".
    ("checkpoints", "cannot read {path} (Permission denied): make it readable"),
])
def test_predict_says_which_part_of_a_run_this_user_may_not_read(scratch, closed, fragment):
    run = _run_as_root(scratch, "--export" if closed.startswith("export") else "--noexport")
    (run / closed).chmod(0o700)
    os.chown(run / closed, 0, 0)
    image = scratch / "image.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    result = run_as_nobody("distributed_mpt.predict", [f"--model_dir={run}", image], scratch)
    assert_one_error_line(result, fragment.format(path=run / closed))


@pytest.mark.parametrize("entered", ["run", "run/export"])
def test_predict_answers_from_a_run_it_may_enter_but_not_list(scratch, entered):
    run = _run_as_root(scratch, "--export")
    chown_tree(run, 0)
    (scratch / entered).chmod(0o711)  # a shared run: found by name, not listed
    image = scratch / "image.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    result = run_as_nobody("distributed_mpt.predict", [f"--model_dir={scratch / entered}", image],
                           scratch)
    assert_ok(result)
    assert result.stdout.startswith(f"{image}: "), result.stdout


def test_predict_from_a_working_directory_closed_to_this_user_says_so(scratch):
    closed = scratch / "closed"
    (closed / "run").mkdir(parents=True)
    closed.chmod(0o700)  # root's; nobody's shell may stand in it (`sudo -u nobody`)
    image = scratch / "image.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    result = run_as_nobody("distributed_mpt.predict", ["--model_dir=run", image], scratch,
                           cwd=closed)
    # Was "--model_dir=run is not a directory".
    assert_one_error_line(result, "cannot reach --model_dir=run (Permission denied): a folder on "
                                  "its way is closed to this user")


def test_a_model_file_in_a_folder_this_user_may_not_search_is_no_missing_file(scratch):
    closed = scratch / "closed"
    closed.mkdir(mode=0o700)  # root's
    (closed / "my_models.py").write_text("def small(num_classes, input_shape):\n    pass\n")
    result = run_as_nobody("distributed_mpt.train", [
        *SMOKE_FLAGS, f"--model={closed / 'my_models.py'}:small",
        f"--model_dir={scratch / 'run'}"], scratch)
    # Was "... is not a file".
    assert_one_error_line(result, "my_models.py cannot be read (Permission denied)")
    assert not (scratch / "run").exists()


@pytest.mark.parametrize("parent, fragment", [
    # Was "CIFAR-10 is not in ... and ... cannot be reached".
    ("closed", "--data_dir={data_dir} is not writable (Permission denied)"),
    # Said so, and left new/tfds/ behind, made by the check that it was writable.
    ("new", "CIFAR-10 is not in {data_dir} and www.cs.toronto.edu cannot be reached"),
])
def test_prepare_data_without_network_says_why_and_makes_nothing(scratch, parent, fragment):
    if not shutil.which("unshare"):
        pytest.skip("needs unshare (util-linux), to run a command without network")
    closed = scratch / "closed"
    closed.mkdir()  # root's, mode 755
    data_dir = scratch / parent / "tfds"
    result = run_as_nobody("distributed_mpt.prepare_data", [f"--data_dir={data_dir}"], scratch,
                           network=False)
    assert_one_error_line(result, fragment.format(data_dir=data_dir))
    assert not data_dir.exists() and not (scratch / "new").exists()


def test_a_teams_run_directory_is_resumed_by_another_member(scratch):
    team = scratch / "team"  # root's, of a group nobody joins, as a team's folder is set up
    team.mkdir()
    os.chown(team, 0, _TEAM)
    team.chmod(0o2775)
    run = team / "run"
    flags = [*SMOKE_FLAGS, "--export", f"--model_dir={run}"]
    umask = os.umask(0o002)  # the team's: what one writes, the others may
    try:
        assert_ok(train([*flags, "--train_steps=5"]))
    finally:
        os.umask(umask)
    # Was refused: the lock file (mode 644 whatever the umask), tensorboard/
    # and the export's folders (755, TensorFlow's) were the first member's alone.
    assert_ok(run_as_nobody("distributed_mpt.train", [*flags, "--train_steps=10"], scratch,
                            umask=0o002, group=_TEAM))
    assert read_summary(run)["steps"] == 10 and (run / "export" / "saved_model").is_dir()


@pytest.mark.parametrize("closed, fragment", [
    # Was "cannot read DIR/train (Permission denied)", of a DIR closed to the user.
    ("images", "cannot read {images} (Permission denied)"),
    # Was "... is a symbolic link to nothing": it leads to a folder of images.
    ("elsewhere", "{images}/train/cat is a symbolic link into a folder closed to this user"),
])
def test_an_image_folder_closed_to_this_user_is_named(scratch, closed, fragment):
    images = scratch / "images"
    for folder in (images / "train" / "dog", images / "test" / "dog",
                   scratch / "elsewhere" / "cat"):
        folder.mkdir(parents=True)  # root's, mode 755
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "0.png")
    (images / "train" / "cat").symlink_to(scratch / "elsewhere" / "cat")
    (scratch / closed).chmod(0o700)
    result = run_as_nobody("distributed_mpt.train", [
        *SMOKE_FLAGS, "--dataset=image_folder", f"--data_dir={images}",
        f"--model_dir={scratch / 'run'}"], scratch)
    assert_one_error_line(result, fragment.format(images=images))
    assert not (scratch / "run").exists()


def test_a_umask_that_closes_the_users_own_files_is_refused_before_anything_is_made(scratch):
    result = run_as_nobody("distributed_mpt.train", [
        *SMOKE_FLAGS, f"--model_dir={scratch / 'run'}"], scratch, umask=0o777)
    # Was "--model_dir=... is not writable (Permission denied)", and a new
    # --model_dir of mode 000 was left behind; resumed, a traceback, and a
    # config.json of mode 000 that left the run unresumable.
    assert_one_error_line(result, "the umask 0777 denies this user the files it writes")
    assert not (scratch / "run").exists()


def test_a_ledger_this_user_may_not_write_is_refused_before_any_training(scratch):
    # Appended to in place since measurements may end at once: a ledger of
    # mode 0444 in a writable folder was found only after every seed trained.
    ledger = scratch / "ledger.jsonl"
    ledger.write_text("")
    chown_tree(scratch, NOBODY_UID)
    ledger.chmod(0o444)
    result = run_as_nobody("distributed_mpt.recipes.measure", [
        "--recipe=mlp", "--seeds=0", f"--runs_dir={scratch / 'runs'}", f"--ledger={ledger}"],
        scratch)
    assert_one_error_line(result, f"--ledger={ledger} is not writable (Permission denied)")
    assert not (scratch / "runs").exists(), "nothing trained"
