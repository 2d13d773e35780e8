"""The export replaces only what this program wrote, and only whole: a user's
file or directory named `export` in --model_dir (or a user's file inside
it) is refused, and kept as it was; a full disk leaves the old state."""

import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from conftest import (REPO, SMOKE_FLAGS, assert_ok, assert_one_error_line, read_summary,
                      run_in_process, subprocess_env, train)
from distributed_mpt.core import models
from distributed_mpt.core.models.contract import ModelError
from distributed_mpt.core.data import cifar10
from distributed_mpt.errors import ConfigError
from distributed_mpt.training import outputs


def _build(name, width=64):
    return models.build_model(models.model_spec(name), cifar10.INFO, width)


def _export(model, model_dir, info=None):
    return outputs.export_model(model, str(model_dir), cifar10.INFO.class_names,
                                cifar10.INFO.image_shape, info)


def _file(path):
    path.write_text("my notes")


def _symlink(path):
    (path.parent / "elsewhere").mkdir()
    (path.parent / "elsewhere" / "notes.txt").write_text("my notes")
    path.symlink_to(path.parent / "elsewhere")


def _directory(path):
    path.mkdir()
    (path / "notes.txt").write_text("my notes")


def _saved_model_and_notes(path):
    """An export's name with a user's file beside it: the export would take
    the file with it."""
    (path / "saved_model").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes")


def _contents(directory) -> dict:
    """Every path under `directory` (symlinks not followed), with the text
    of each file."""
    return {str(p.relative_to(directory)): p.read_text() if p.is_file() and not p.is_symlink()
            else p.is_symlink() for p in directory.rglob("*")}


@pytest.mark.parametrize("make", [_file, _symlink, _directory, _saved_model_and_notes],
                         ids=lambda f: f.__name__[1:])
def test_a_users_export_is_refused_and_kept(tmp_path, make):
    make(tmp_path / "export")
    before = _contents(tmp_path)
    with pytest.raises(ConfigError, match="not an export of this program"):
        outputs.check_export_destination(str(tmp_path))
    with pytest.raises(ConfigError, match="not an export of this program"):
        _export(_build("mlp"), tmp_path)
    assert _contents(tmp_path) == before  # nothing moved, no staging directory left


def test_nothing_an_empty_directory_or_a_previous_export_is_replaceable(tmp_path):
    outputs.check_export_destination(str(tmp_path))
    (tmp_path / "export").mkdir()
    outputs.check_export_destination(str(tmp_path))
    (tmp_path / "export" / "saved_model").mkdir()
    (tmp_path / "export" / "classes.txt").write_text("airplane\n")
    outputs.check_export_destination(str(tmp_path))


def test_export_replaces_the_previous_export_whole(tmp_path):
    model = _build("resnet9", width=4)
    first = _export(model, tmp_path)
    (tmp_path / "export" / "classes.txt").write_text("old")
    (tmp_path / "export" / "model_info.json").write_text("{}")  # this export has none
    assert _export(model, tmp_path) == first
    assert not (tmp_path / "export" / "model_info.json").exists()
    assert (tmp_path / "export" / "classes.txt").read_text().splitlines() == \
        list(cifar10.INFO.class_names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    served = tf.saved_model.load(str(tmp_path / "export" / "saved_model"))
    images = np.zeros((2, 32, 32, 3), np.uint8)
    # The model computes logits; the export serves their softmax.
    np.testing.assert_allclose(np.asarray(served.serve(images)["probabilities"]),
                               np.asarray(tf.nn.softmax(model(images))), rtol=1e-5)


def test_training_refuses_a_users_export_file_and_keeps_it(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "export").write_text("my notes")
    result = train([*SMOKE_FLAGS, "--train_steps=4", "--export", f"--model_dir={model_dir}"])
    assert_one_error_line(result, "not an export of this program")
    # Never moved: the next run's clean-up of debris cannot take it.
    assert (model_dir / "export").read_text() == "my notes"
    assert not list(model_dir.glob(".export-*"))


def test_an_export_on_a_full_disk_is_one_error_and_the_rerun_completes(tmpfs):
    mount_point, resize = tmpfs
    resize(16)
    model_dir = mount_point / "run"
    flags = [*SMOKE_FLAGS, "--noevaluate", "--model=resnet9", "--model_width=4", "--train_steps=5",
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


def test_a_finished_run_started_again_exports_anew_over_a_damaged_export(tmp_path):
    """An export whose fingerprint.pb was damaged, whose variables/ was lost, or whose
    variables' data file was removed (as predict's line for one that is a FIFO says: "remove
    it and run the run's training command again"), all of which predict refuses, was left as
    it was: only the export's entries and saved_model.pb were looked for."""
    from distributed_mpt.predict import main as predict

    model_dir = tmp_path / "run"
    flags = [*SMOKE_FLAGS, "--noevaluate", "--model=resnet9", "--model_width=4",
             "--train_steps=2", "--steps_per_loop=2", "--export", f"--model_dir={model_dir}"]
    assert_ok(train(flags))
    saved_model = model_dir / "export" / "saved_model"
    for damage in (lambda: shutil.rmtree(saved_model / "variables"),
                   lambda: next((saved_model / "variables").glob("variables.data-*")).unlink(),
                   lambda: (saved_model / "fingerprint.pb").write_bytes(b"\xff" * 100),
                   lambda: shutil.rmtree(saved_model) or saved_model.write_bytes(b"")):
        damage()
        again = train(flags)
        assert_ok(again)
        assert "its export was missing or incomplete: exported again" in again.stdout
    assert_ok(run_in_process(predict, [f"--model_dir={model_dir}",
                                       str(REPO / "docs" / "automobile.png")]))


def test_a_run_under_pythonwarnings_error_exports_with_the_libraries_warnings_shown(tmp_path):
    """Keras' own np.array(tensor), of which NumPy 2 warns, was a traceback
    after the training (its batch-norm recalibration, then its export)."""
    model_dir = tmp_path / "run"
    result = train([*SMOKE_FLAGS, "--noevaluate", "--model=resnet9", "--model_width=4",
                    "--train_steps=2", "--steps_per_loop=2", "--export",
                    f"--model_dir={model_dir}"], env=subprocess_env(PYTHONWARNINGS="error"))
    assert_ok(result)
    assert "Traceback" not in result.stderr
    assert (model_dir / "export" / "model.keras").exists()
    assert list((model_dir / "checkpoints").glob("ckpt-2.index"))


@pytest.mark.parametrize("name, blamed", [("mlp", False), ("mine.py:net", True)])
def test_only_a_users_model_is_blamed_for_a_failure_in_the_export(tmp_path, monkeypatch, name,
                                                                  blamed):
    """Every export ran as a user's code, so that a failure of the package's
    own (here a stand-in for a bug in it) in a built-in model's export was
    one line blaming --model=mlp, exit 2, where it is the package's, with
    its traceback."""
    def failing(*_):
        raise ValueError("a failure of the export's own code")
    monkeypatch.setattr(outputs, "_keras_model_with_probabilities", failing)
    with pytest.raises(ModelError if blamed else ValueError, match="export's own code"):
        _export(_build("mlp"), tmp_path, {"model": name})
    assert not (tmp_path / "export").exists() and list(tmp_path.iterdir()) == []
