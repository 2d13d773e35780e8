"""The export replaces only what this program wrote: a user's file or
directory named `export` in --model_dir is refused, and kept as it was."""

import pytest

from conftest import SMOKE_FLAGS, assert_one_error_line, train
from distributed_mpt.training import outputs
from distributed_mpt.errors import ConfigError
from distributed_mpt.training.models import build_model


def _file(path):
    path.write_text("my notes")


def _symlink(path):
    (path.parent / "elsewhere").mkdir()
    (path.parent / "elsewhere" / "notes.txt").write_text("my notes")
    path.symlink_to(path.parent / "elsewhere")


def _directory(path):
    path.mkdir()
    (path / "notes.txt").write_text("my notes")


def _contents(directory) -> dict:
    """Every path under `directory` (symlinks not followed), with the text
    of each file."""
    return {str(p.relative_to(directory)): p.read_text() if p.is_file() and not p.is_symlink()
            else p.is_symlink() for p in directory.rglob("*")}


@pytest.mark.parametrize("make", [_file, _symlink, _directory], ids=lambda f: f.__name__[1:])
def test_a_users_export_is_refused_and_kept(tmp_path, make):
    make(tmp_path / "export")
    before = _contents(tmp_path)
    with pytest.raises(ConfigError, match="not an export of this program"):
        outputs.check_export_destination(str(tmp_path))
    with pytest.raises(ConfigError, match="not an export of this program"):
        outputs.export_model(build_model("mlp"), str(tmp_path))
    assert _contents(tmp_path) == before  # nothing moved, no staging directory left


def test_nothing_an_empty_directory_or_a_previous_export_is_replaceable(tmp_path):
    outputs.check_export_destination(str(tmp_path))
    (tmp_path / "export").mkdir()
    outputs.check_export_destination(str(tmp_path))
    (tmp_path / "export" / "saved_model").mkdir()
    (tmp_path / "export" / "classes.txt").write_text("airplane\n")
    outputs.check_export_destination(str(tmp_path))


def test_training_refuses_a_users_export_file_and_keeps_it(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "export").write_text("my notes")
    result = train([*SMOKE_FLAGS, "--train_steps=4", "--export", f"--model_dir={model_dir}"])
    assert_one_error_line(result, "not an export of this program")
    # Never moved: the next run's clean-up of debris cannot take it.
    assert (model_dir / "export").read_text() == "my notes"
    assert not list(model_dir.glob(".export-*"))
