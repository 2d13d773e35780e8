"""Files written whole or not at all, with the umask; the export replaced whole."""

import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from conftest import SMOKE_FLAGS, assert_ok, read_summary, train
from distributed_mpt.training import outputs
from distributed_mpt.errors import ConfigError
from distributed_mpt.training.models import build_model


def test_write_json_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "summary.json"
    outputs.write_json(str(path), {"a": 1})
    outputs.write_json(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_check_writable(tmp_path):
    outputs.check_writable(str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        outputs.check_writable(str(tmp_path / "file" / "run"))
    with pytest.raises(ConfigError, match="--model_dir=.*file is a file, not a directory"):
        outputs.check_writable(str(tmp_path / "file"))
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(ConfigError, match="link is a file, not a directory"):
        outputs.check_writable(str(tmp_path / "link"))
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="dangling is a symbolic link to nothing, not a direct"):
        outputs.check_writable(str(tmp_path / "dangling"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="fifo is a special file, not a directory"):
        outputs.check_writable(str(tmp_path / "fifo"))


def test_export_replaces_the_previous_export_whole(tmp_path):
    model = build_model("resnet9", width=4)
    first = outputs.export_model(model, str(tmp_path))
    (tmp_path / "export" / "marker").write_text("old")
    assert outputs.export_model(model, str(tmp_path)) == first
    assert not (tmp_path / "export" / "marker").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    served = tf.saved_model.load(str(tmp_path / "export" / "saved_model"))
    images = np.zeros((2, 32, 32, 3), np.uint8)
    np.testing.assert_allclose(np.asarray(served.serve(images)["probabilities"]),
                               np.asarray(model(images)), rtol=1e-5)


@pytest.mark.parametrize("tail, damage", [
    (b'{"ste', "its last line was cut short"),
    (b'\xff\xfe\n{"step": 4}\n', "line 3 is damaged (not UTF-8 text)"),
    (b"[3]\n", "line 3 is damaged (a JSON list, not an object)"),
    (b'{"step": "3"}\n', "line 3 is damaged ('step' is a str)"),
    (b'{"loss": 1}\n', "line 3 is damaged (no 'step')"),
    (b"\n", "line 3 is damaged (not JSON"),
])
def test_metrics_are_read_up_to_the_first_damaged_line(tmp_path, tail, damage):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + tail)
    records, found = outputs.read_jsonl(str(path), {"step": int})
    assert records == [{"step": 1}, {"step": 2}] and found.startswith(damage)


@pytest.mark.parametrize("content, problem", [
    (b"\xff{}", "not UTF-8 text at byte 0"),
    (b"", "not JSON"),
    (b"[]", "a JSON list, not an object"),
    (b'{"steps": true}', "'steps' is a bool"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_a_damaged_json_file_is_one_line_naming_it_and_the_remedy(tmp_path, content, problem):
    path = tmp_path / "summary.json"
    path.write_bytes(content)
    with pytest.raises(outputs.DamagedFileError) as raised:
        outputs.read_json(str(path), {"steps": int}, remedy="remove it")
    assert str(raised.value).startswith(f"{path} is damaged ({problem}")
    assert str(raised.value).endswith("; remove it") and "\n" not in str(raised.value)


def test_json_that_is_not_there_is_empty_and_a_fifo_is_refused_unread(tmp_path):
    assert outputs.read_json(str(tmp_path / "missing.json")) == {}
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(outputs.DamagedFileError, match="not a regular file"):
        outputs.read_json(str(tmp_path / "fifo"))  # would block forever if opened


def test_written_files_follow_the_umask(tmp_path):
    outputs.write_json(str(tmp_path / "a.json"), {})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask


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
