"""Where the data comes from: synthetic data, the official binary release,
tensorflow-datasets up to the network boundary, and damaged or missing files."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, assert_one_error_line, subprocess_env
from distributed_mpt.core.data import DataOptions, cifar10, synthetic
from distributed_mpt.errors import DataUnavailableError


def test_synthetic_labels_follow_from_images():
    train, test = synthetic.make_synthetic(num_train=500, num_test=100, seed=0)
    assert train.images.dtype == np.uint8 and train.images.shape == (500, 32, 32, 3)
    assert set(np.unique(train.labels)) == set(range(10))
    # A nearest-class-mean classifier fit on train labels test images well:
    # the labels carry information that a model can learn.
    means = np.stack([train.images[train.labels == c].reshape(-1, 3072).mean(0) for c in range(10)])
    distances = ((test.images.reshape(-1, 1, 3072) - means[None]) ** 2).sum(-1)
    assert (distances.argmin(1) == test.labels).mean() > 0.9
    again, _ = synthetic.make_synthetic(num_train=500, num_test=100, seed=0)
    np.testing.assert_array_equal(again.images, train.images)


# Records per file of the tiny binary release that tensorflow-datasets
# prepares below: 5 train files and 1 test file.
_RECORDS_PER_FILE = 4


@pytest.fixture(scope="module")
def prepared_cifar10(tmp_path_factory):
    """A tensorflow-datasets data directory holding a tiny CIFAR-10 prepared
    by tensorflow-datasets itself (real TFRecord files, dataset_info.json),
    from binary-release files of 4 records each instead of the download."""
    import tensorflow_datasets as tfds
    from unittest import mock

    root = tmp_path_factory.mktemp("cifar10")
    extracted = root / "extracted" / "cifar-10-batches-bin"
    extracted.mkdir(parents=True)
    records = np.zeros((_RECORDS_PER_FILE, 1 + 3072), np.uint8)
    records[:, 0] = np.arange(_RECORDS_PER_FILE)  # the labels; each image is its label's grey
    records[:, 1:] = records[:, :1]
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records.tofile(extracted / name)
    (extracted / "batches.meta.txt").write_text("\n".join(f"class{i}" for i in range(10)))
    builder = tfds.builder("cifar10", data_dir=str(root / "tfds"))
    with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                           return_value=str(extracted.parent)):
        builder.download_and_prepare()
    return root / "tfds"


@pytest.fixture
def cifar10_copy(prepared_cifar10, tmp_path):
    """A copy of the prepared data directory that a test may damage."""
    import shutil

    return shutil.copytree(prepared_cifar10, tmp_path / "tfds")


def test_prepared_cifar10_loads_through_tensorflow_datasets(cifar10_copy):
    loaded = DataOptions("cifar10", str(cifar10_copy), download=False).load(seed=0)
    train, test = loaded.train, loaded.test
    assert loaded.info == cifar10.INFO
    assert train.images.shape == (5 * _RECORDS_PER_FILE, 32, 32, 3) and train.images.dtype == np.uint8
    assert train.labels.dtype == np.int32 and len(test) == _RECORDS_PER_FILE
    for images, labels in [(train.images, train.labels), (test.images, test.labels)]:
        np.testing.assert_array_equal(images[:, 3, 5, 1], labels)  # every pixel is the label


def test_only_the_splits_asked_for_are_read(cifar10_copy, tmp_path):
    """Evaluating needs the test split only: a damaged or absent train split
    is not its concern, from tensorflow-datasets or the binary release."""
    from conftest import write_cifar10_binary

    _truncate(cifar10_copy / "cifar10" / "3.0.2" / _TRAIN_RECORDS, 0)
    loaded = DataOptions("cifar10", str(cifar10_copy), download=False).load(0, ("test",))
    assert list(loaded.splits) == ["test"] and len(loaded.test) == _RECORDS_PER_FILE
    binary = write_cifar10_binary(tmp_path / "binary")
    for train_file in binary.glob("data_batch_*.bin"):
        train_file.unlink()
    loaded = DataOptions("cifar10", str(binary), download=False).load(0, ("test",))
    assert list(loaded.splits) == ["test"] and len(loaded.test) == 10_000
    train, _ = synthetic.make_synthetic(num_train=500, num_test=100, seed=3)
    again = DataOptions("synthetic", synthetic_examples=500).load(seed=3, splits=("train",))
    assert list(again.splits) == ["train"]
    np.testing.assert_array_equal(again.train.images, train.images)


def _truncate(path, size):
    path.write_bytes(path.read_bytes()[:size])


def _flip_byte(path, position):
    content = bytearray(path.read_bytes())
    content[position] ^= 0xFF
    path.write_bytes(bytes(content))


def _write_records(path, count):
    """Replaces `path` by an intact TFRecord file of `count` records that are
    not CIFAR-10 examples."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(count):
            writer.write(b"not an example")


_TRAIN_RECORDS = "cifar10-train.tfrecord-00000-of-00001"
_TEST_RECORDS = "cifar10-test.tfrecord-00000-of-00001"


@pytest.mark.parametrize("damaged, damage, problem", [
    (_TRAIN_RECORDS, lambda p: _truncate(p, p.stat().st_size // 2 + 7), "is cut short or corrupted"),
    # The records are all the same size: half the file is 10 whole records,
    # which read back without an error, and only their count tells.
    (_TRAIN_RECORDS, lambda p: _truncate(p, p.stat().st_size // 2), "holds 10 records, not the 20"),
    (_TRAIN_RECORDS, lambda p: _flip_byte(p, p.stat().st_size // 3), "corrupted record at"),
    (_TEST_RECORDS, lambda p: _truncate(p, 0), f"holds 0 records, not the {_RECORDS_PER_FILE}"),
    (_TEST_RECORDS, lambda p: p.unlink(), "is missing"),
    ("dataset_info.json", lambda p: p.write_bytes(b"\x00garbage{"), "cannot be read as a dataset"),
    ("dataset_info.json", lambda p: _truncate(p, p.stat().st_size // 2), "Failed to load JSON"),
    ("dataset_info.json", lambda p: p.write_text("{}"), "does not describe cifar10 3.0.2"),
    # Every file reads back whole, but what it holds is not CIFAR-10: the
    # whole prepared directory is named.
    (".", lambda p: _write_records(p / _TRAIN_RECORDS, 5 * _RECORDS_PER_FILE),
     "holds unreadable train records"),
])
def test_damaged_prepared_cifar10_is_one_error_naming_the_file(cifar10_copy, damaged, damage,
                                                               problem):
    dataset_dir = cifar10_copy / "cifar10" / "3.0.2"
    damage(dataset_dir / damaged)
    with pytest.raises(DataUnavailableError) as error:
        DataOptions("cifar10", str(cifar10_copy), download=False).load(seed=0)
    message = str(error.value)
    assert "\n" not in message
    named = dataset_dir if damaged == "." else dataset_dir / damaged
    assert message.startswith(f"{named} ") and problem in message
    # How to get intact data back: prepare again, or read the binary release.
    assert f"Remove {dataset_dir} " in message
    assert f"distributed-mpt-prepare-data --data_dir={cifar10_copy}`" in message
    assert f"tar xzf cifar-10-binary.tar.gz -C {cifar10_copy}" in message


def test_preparing_over_damaged_data_says_how_to_recover(cifar10_copy, capsys):
    from distributed_mpt import prepare_data

    _flip_byte(cifar10_copy / "cifar10" / "3.0.2" / _TEST_RECORDS, 100)
    assert prepare_data.main([f"--data_dir={cifar10_copy}"]) == 2
    error_lines = capsys.readouterr().err.splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("error: ")
    assert _TEST_RECORDS in error_lines[0] and "Remove " in error_lines[0]


def test_preparing_a_directory_with_the_binary_release_finds_it_ready(tmp_path, capsys):
    from conftest import write_cifar10_binary
    from distributed_mpt import prepare_data

    write_cifar10_binary(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert prepare_data.main([f"--data_dir={tmp_path}"]) == 0
    assert capsys.readouterr().out == (f"CIFAR-10 ready in {tmp_path} (the official binary "
                                       f"release): 50000 train and 10000 test images\n")
    assert sorted(tmp_path.rglob("*")) == before, "read as training reads it: nothing written"


def test_training_on_damaged_data_exits_with_one_error_line(cifar10_copy, tmp_path):
    from conftest import train

    _flip_byte(cifar10_copy / "cifar10" / "3.0.2" / _TRAIN_RECORDS, 1000)
    model_dir = tmp_path / "run"
    result = train(["--dataset=cifar10", f"--data_dir={cifar10_copy}", "--nodownload",
                    "--model=mlp", "--train_steps=2", f"--model_dir={model_dir}"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and _TRAIN_RECORDS in error_lines[0], result.stderr[-3000:]
    assert not model_dir.exists()


def test_missing_cifar10_without_download_names_the_remedies(tmp_path, caplog):
    started = time.monotonic()
    with pytest.raises(DataUnavailableError) as error:
        cifar10.load_cifar10(str(tmp_path), download=False)
    message = str(error.value)
    assert time.monotonic() - started < 60
    for remedy in ("cifar-10-batches-bin/", "distributed-mpt-prepare-data",
                   "cifar-10-binary.tar.gz", str(tmp_path / "downloads" / "manual"),
                   "--dataset=synthetic"):
        assert remedy in message
    assert not [r for r in caplog.records if "Variant folder" in r.getMessage()], \
        "no warning about a folder that a first run has not made yet"


def test_unreachable_download_host_fails_fast(tmp_path, monkeypatch):
    # What a machine without network sees, whatever this machine has.
    monkeypatch.setattr(cifar10, "_CIFAR10_HOST", ("unreachable.invalid", 443))
    started = time.monotonic()
    with pytest.raises(DataUnavailableError, match="cannot be reached"):
        cifar10.load_cifar10(str(tmp_path), download=True)
    assert time.monotonic() - started < 60


def test_archive_in_the_manual_directory_is_used_and_checked(tmp_path, monkeypatch):
    # No network needed: the archive is taken from <data_dir>/downloads/manual.
    monkeypatch.setattr(cifar10, "_CIFAR10_HOST", ("unreachable.invalid", 443))
    manual = tmp_path / "downloads" / "manual"
    manual.mkdir(parents=True)
    (manual / cifar10.CIFAR10_ARCHIVE).write_bytes(b"not the real archive")
    with pytest.raises(DataUnavailableError, match="checksum does not match"):
        cifar10.load_cifar10(str(tmp_path), download=False)


def test_unwritable_data_dir_is_one_clear_error(tmp_path, monkeypatch):
    from distributed_mpt.errors import ConfigError

    # As if there were network: preparing would start, and must first find
    # that it cannot write.
    monkeypatch.setattr(cifar10, "_reachable", lambda *args, **kwargs: True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--data_dir=.* is not writable"):
        cifar10.load_cifar10(str(tmp_path / "file" / "tfds"), download=True)


def test_the_official_binary_release_is_read_directly(tmp_path):
    from conftest import write_cifar10_binary

    write_cifar10_binary(tmp_path)
    # No tensorflow-datasets preparation, no download: nothing is written.
    before = sorted(p for p in tmp_path.rglob("*"))
    loaded = DataOptions("cifar10", str(tmp_path), download=False).load(seed=0)
    train, test = loaded.train, loaded.test
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert train.images.shape == (50_000, 32, 32, 3) and len(test) == 10_000
    assert train.images.dtype == np.uint8 and train.labels.dtype == np.int32
    np.testing.assert_array_equal(train.labels[:12], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1])
    # Planes become channels: R and B are the label, G is 100, at every pixel.
    np.testing.assert_array_equal(train.images[7, 5, 9], [7, 100, 7])
    # The directory itself may be given, too.
    again = DataOptions("cifar10", str(tmp_path / cifar10.CIFAR10_BINARY_DIR),
                        download=False).load(seed=0).train
    np.testing.assert_array_equal(again.images[:100], train.images[:100])


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "data_batch_3.bin").write_bytes((d / "data_batch_3.bin").read_bytes()[:-1]),
     "data_batch_3.bin has 30,729,999 bytes, not 30,730,000"),
    # "cannot be read (No such file ...): it is not a file of the release", of
    # a file that was not there, in a folder of the release's name.
    (lambda d: (d / "test_batch.bin").unlink(), "test_batch.bin is missing: "),
    (lambda d: (d / "data_batch_1.bin").write_bytes(bytes([12]) * 30_730_000),
     "data_batch_1.bin has labels above 9"),
])
def test_a_damaged_binary_release_is_one_clear_error(tmp_path, damage, message):
    from conftest import write_cifar10_binary

    damage(write_cifar10_binary(tmp_path))
    with pytest.raises(DataUnavailableError) as error:
        DataOptions("cifar10", str(tmp_path), download=False).load(seed=0)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "extract the archive" in str(error.value)


def test_prepare_data_without_network_fails_fast_with_remedies(tmp_path):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "distributed_mpt.prepare_data",
                             f"--data_dir={tmp_path}"], capture_output=True, text=True,
                            timeout=90, env=subprocess_env(), cwd=REPO)
    assert time.monotonic() - started < 60
    # This machine has no network; on one with network the same command downloads.
    if result.returncode == 0:
        pytest.skip("this machine reaches the CIFAR-10 host: it prepared the data")
    assert_one_error_line(result, "downloads/manual")


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["a directory", "a FIFO"])
def test_prepare_data_with_no_file_where_the_archive_goes_is_one_error_line(tmp_path, capsys,
                                                                            make):
    """A directory named as the archive in downloads/manual (a download
    unpacked in place) ended prepare-data with a traceback; a FIFO would
    have blocked it."""
    from distributed_mpt import prepare_data

    archive = tmp_path / "downloads" / "manual" / cifar10.CIFAR10_ARCHIVE
    archive.parent.mkdir(parents=True)
    make(archive)
    assert prepare_data.main([f"--data_dir={tmp_path}"]) == 2
    errors = capsys.readouterr().err.splitlines()
    kind = "a directory" if archive.is_dir() else "a FIFO"
    assert errors == [f"error: {archive} is {kind}, not the CIFAR-10 archive: put the file "
                      f"downloaded from https://www.cs.toronto.edu/~kriz/cifar.html there, or "
                      f"remove it"], errors


def test_workers_reading_different_copies_of_cifar10_refuse_together(tmp_path):
    """Worker 1's copy had other labels: both trained to the end and exited
    0, without a word (CIFAR-10's loader gave no fingerprint to compare)."""
    from conftest import SMOKE_FLAGS, WatchedProcess, write_cifar10_binary
    from distributed_mpt.launch import free_ports, worker_tf_configs

    write_cifar10_binary(tmp_path / "a")
    for batch in write_cifar10_binary(tmp_path / "b").iterdir():  # a stale or damaged copy
        records = np.fromfile(batch, np.uint8).reshape(-1, 3073)
        records[:, 0] = (records[:, 0] + 3) % 10
        records.tofile(batch)
    flags = [*SMOKE_FLAGS, "--dataset=cifar10", "--nodownload", "--noevaluate",
             "--communication=ring", "--per_replica_batch_size=16", "--peer_timeout_seconds=300",
             "--train_steps=4", "--precision=float32", f"--model_dir={tmp_path / 'run'}"]
    workers = [WatchedProcess("distributed_mpt.train", [*flags, f"--data_dir={tmp_path / copy}"],
                              env=subprocess_env(TF_CONFIG=tf_config))
               for copy, tf_config in zip("ab", worker_tf_configs(free_ports(2)))]
    for worker in workers:
        assert worker.finish(timeout=180) == 2, worker.output()[-3000:]
        errors = [line for line in worker.output().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in worker.output(), worker.output()[-3000:]
        assert "the images differ between the workers of this job" in errors[0], errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training"


def test_a_run_resumed_on_another_copy_of_cifar10_is_refused_naming_what_differs(tmp_path):
    """A run on one copy of CIFAR-10 resumed on a copy with other labels (a
    stale or damaged one): refused in one line that says what a CIFAR-10
    fingerprint compares, not an image folder's 'file names or sizes'."""
    from conftest import SMOKE_FLAGS, assert_one_error_line, train, write_cifar10_binary

    write_cifar10_binary(tmp_path / "a")
    for batch in write_cifar10_binary(tmp_path / "b").iterdir():
        records = np.fromfile(batch, np.uint8).reshape(-1, 3073)
        records[:, 0] = (records[:, 0] + 3) % 10
        records.tofile(batch)
    flags = [*SMOKE_FLAGS, "--dataset=cifar10", "--nodownload", "--noevaluate",
             "--precision=float32", f"--model_dir={tmp_path / 'run'}"]
    first = train([*flags, "--train_steps=2", f"--data_dir={tmp_path / 'a'}"])
    assert first.returncode == 0, first.stderr[-2000:]
    result = train([*flags, "--train_steps=4", f"--data_dir={tmp_path / 'b'}"])
    assert_one_error_line(result, "holds a run trained on other images than --data_dir=")
    assert "other labels or pixels (the SHA-256 of the examples, in any order" in result.stderr, \
        result.stderr


def test_a_run_resumed_on_the_same_cifar10_in_another_order_continues(tmp_path):
    """A run started on one copy of CIFAR-10 and resumed on a copy of the
    same examples in another order (tensorflow-datasets' and the binary
    release's orders differ) was refused as "other labels or pixels". A
    config.json from before the order-free digest still compares in order:
    refused in another order, resumed in the same."""
    import json

    from conftest import SMOKE_FLAGS, assert_one_error_line, train, write_cifar10_binary

    write_cifar10_binary(tmp_path / "a")
    shuffle = np.random.default_rng(0).permutation
    names = [f"data_batch_{i}.bin" for i in range(1, 6)]
    copy = write_cifar10_binary(tmp_path / "b")
    train_records = np.concatenate([np.fromfile(copy / n, np.uint8).reshape(-1, 3073)
                                    for n in names])
    for name, records in zip(names, np.split(train_records[shuffle(50_000)], 5)):
        records.tofile(copy / name)
    test_records = np.fromfile(copy / "test_batch.bin", np.uint8).reshape(-1, 3073)
    test_records[shuffle(10_000)].tofile(copy / "test_batch.bin")
    flags = [*SMOKE_FLAGS, "--dataset=cifar10", "--nodownload", "--noevaluate",
             "--precision=float32", f"--model_dir={tmp_path / 'run'}"]
    first = train([*flags, "--train_steps=2", f"--data_dir={tmp_path / 'a'}"])
    assert first.returncode == 0, first.stderr[-2000:]
    other_order = train([*flags, "--train_steps=3", f"--data_dir={tmp_path / 'b'}"])
    assert other_order.returncode == 0, other_order.stderr[-2000:]
    config_path = tmp_path / "run" / "config.json"
    config = json.loads(config_path.read_text())
    del config["resolved"]["data_fingerprint"]["examples_sha256"]  # as written before it was kept
    config_path.write_text(json.dumps(config))
    refused = train([*flags, "--train_steps=4", f"--data_dir={tmp_path / 'a'}"])
    assert_one_error_line(refused, "holds a run trained on other images than --data_dir=")
    assert "other labels or pixels, or the same in another order" in refused.stderr
    same_order = train([*flags, "--train_steps=4", f"--data_dir={tmp_path / 'b'}"])
    assert same_order.returncode == 0, same_order.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4
