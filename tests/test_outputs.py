"""Atomic outputs, the export, and checkpoints that refuse another model."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt import outputs, precision
from distributed_mpt.checkpointing import Checkpoints, model_identity
from distributed_mpt.errors import CheckpointMismatchError, ConfigError
from distributed_mpt.models import build_model


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


def _checkpoints(model_dir, model, worker=None):
    step = tf.Variable(0, dtype=tf.int64)
    return Checkpoints(str(model_dir), worker, model_identity(model, "float32"), model=model, step=step), step


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


def test_non_chief_scratch_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    worker, step = _checkpoints(tmp_path / "run", build_model("resnet9", width=4), worker="worker-1")
    worker.save(1)
    assert list((tmp_path / "tmp").iterdir()), "the worker saved into its scratch directory"
    assert not (tmp_path / "run").exists(), "a non-chief never writes into model_dir"
    worker.close()
    assert not list((tmp_path / "tmp").iterdir())


def test_auto_precision_on_this_machine():
    if tf.config.list_physical_devices("GPU"):
        expected = "mixed_float16"
    else:
        flags = open("/proc/cpuinfo").read()
        expected = "mixed_bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    assert precision.resolve_precision("auto") == expected
    assert precision.resolve_precision("mixed_bfloat16") == "mixed_bfloat16"


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx512f avx512_bf16 fma", "mixed_bfloat16"),
    ("fpu amx_bf16 amx_tile", "mixed_bfloat16"),
    ("fpu avx512f avx2 fma", "float32"),
])
def test_auto_precision_on_a_cpu_follows_its_bfloat16_instructions(tmp_path, monkeypatch,
                                                                   flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n")
    assert precision.cpu_has_bfloat16(str(cpuinfo)) == (expected == "mixed_bfloat16")
    assert not precision.cpu_has_bfloat16(str(tmp_path / "missing")), "unknown: no bfloat16"
    monkeypatch.setattr(precision.tf.config, "list_physical_devices", lambda kind: [])
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: expected == "mixed_bfloat16")
    assert precision.resolve_precision("auto") == expected


def test_checkpoints_of_another_precision_say_which_flag_to_pass(tmp_path):
    model = build_model("resnet9", width=4)
    step = tf.Variable(0, dtype=tf.int64)
    Checkpoints(str(tmp_path), None, model_identity(model, "mixed_float16"), model=model,
                step=step).save(1)
    other = Checkpoints(str(tmp_path), None, model_identity(model, "float32"), model=model, step=step)
    with pytest.raises(CheckpointMismatchError, match="--precision=mixed_float16"):
        other.check_identity()


def test_a_torn_last_metrics_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert outputs.read_jsonl(str(path)) == [{"step": 1}, {"step": 2}]


def test_written_files_follow_the_umask(tmp_path):
    outputs.write_json(str(tmp_path / "a.json"), {})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask
