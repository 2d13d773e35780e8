"""distributed-mpt-prepare-data as a careless user meets it: where it cannot
write, and what it leaves behind (no network here: tensorflow-datasets'
download is replaced by a tiny binary release, as tests/core does)."""

import os
import subprocess

import pytest

from conftest import SMOKE_FLAGS, assert_one_error_line, run_in_process


def _prepare(args):
    from distributed_mpt.prepare_data import main
    return run_in_process(main, args)


def _train(args):
    from distributed_mpt.train import main
    return run_in_process(main, args)


@pytest.mark.skipif(os.geteuid() != 0, reason="as root: another user is refused /proc outright")
@pytest.mark.parametrize("run, args, said", [
    (_prepare, ["--data_dir=/proc"],
     "--data_dir=/proc is not writable (cannot make a file in it: No such file or directory)"),
    (_train, [*SMOKE_FLAGS, "--model_dir=/proc/run"],
     "--model_dir=/proc/run is not writable (cannot make it: No such file or directory)")])
def test_a_directory_in_a_pseudo_file_system_is_refused_for_what_fails(run, args, said):
    # Was "--data_dir=/proc is not writable (No such file or directory)", of
    # a directory that exists: the C library's reason for the file or folder
    # that could not be made there, given as the directory's.
    assert_one_error_line(run(args), said)


@pytest.fixture
def downloaded(tmp_path, monkeypatch):
    """tensorflow-datasets' download, as if there were network: the archive
    extracted, its release of 100 random images a file."""
    import numpy as np
    import tensorflow_datasets as tfds
    from unittest import mock

    from distributed_mpt.core.data import cifar10

    extracted = tmp_path / "extracted" / cifar10.CIFAR10_BINARY_DIR
    extracted.mkdir(parents=True)
    records = np.random.default_rng(0).integers(0, 256, (100, 1 + 3072), dtype=np.uint8)
    records[:, 0] %= 10
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records.tofile(extracted / name)
    (extracted / "batches.meta.txt").write_text("\n".join(cifar10.INFO.class_names))
    monkeypatch.setattr(cifar10, "_reachable", lambda *args, **kwargs: True)
    with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                           return_value=str(extracted.parent)):
        yield


def test_a_full_disk_is_one_error_line_and_leaves_no_file(downloaded, tmpfs):
    mount_point, _ = tmpfs
    filler = mount_point / "filler"
    free = os.statvfs(mount_point)
    filler.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 256 * 1024))
    data_dir = mount_point / "data"
    result = _prepare([f"--data_dir={data_dir}"])
    # Was a traceback ending in tensorflow-datasets' RuntimeError.
    assert_one_error_line(result, f"cannot prepare CIFAR-10 in {data_dir} (No space left on "
                                  f"device), nothing prepared: free space there, or choose "
                                  f"another --data_dir")
    assert not [p for p in data_dir.rglob("*") if not p.is_dir()], "no half-written file"


def test_a_folder_it_cannot_write_is_named_in_one_error_line(downloaded, tmpfs, tmp_path):
    mount_point, _ = tmpfs
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "downloads").symlink_to(mount_point)  # a read-only mount, where it downloads
    result = _prepare([f"--data_dir={data_dir}"])
    # Was a traceback ending in OSError; as was a folder there of another user.
    assert_one_error_line(result, f"cannot prepare CIFAR-10 in {data_dir} (Read-only file "
                                  f"system: {data_dir}/downloads/extracted), nothing prepared: "
                                  f"make it writable")
    assert sorted(p.name for p in data_dir.iterdir()) == ["downloads"]


def test_a_file_where_it_makes_a_folder_is_named_in_one_error_line(downloaded, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "downloads").write_text("notes\n")
    result = _prepare([f"--data_dir={data_dir}"])
    # Was a traceback ending in FileExistsError.
    assert_one_error_line(result, f"cannot prepare CIFAR-10 in {data_dir} (File exists: "
                                  f"{data_dir}/downloads), nothing prepared: move it away")
    # tensorflow-datasets' progress bars, off the terminal: their cursor moves
    # came before the error line, which then began with one (not `error:`).
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr, result.stderr
    assert (data_dir / "downloads").read_text() == "notes\n"
