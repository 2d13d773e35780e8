"""The input pipeline: augmentation, sharding, resumption, evaluation coverage,
synthetic data, and CIFAR-10 loading up to the network boundary."""

import collections
import time

import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt import data
from distributed_mpt.errors import DataUnavailableError


def _context(pipelines=1, pipeline_id=0, replicas=1):
    return tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def _collect(dataset):
    return [tuple(np.asarray(t) for t in element) for element in dataset]


@pytest.fixture(scope="module")
def split():
    train, _ = data.make_synthetic(num_train=200, num_test=40, seed=3)
    return train


def test_augmentation_keeps_shape_dtype_and_pixels():
    images = tf.constant(np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    offsets = tf.constant([[4, 4], [0, 0], [8, 8], [4, 4], [0, 8], [2, 6]], tf.int32)
    flips = tf.constant([False, False, False, True, False, True])
    eager = data.augment_batch(images, offsets, flips)
    in_graph = next(iter(tf.data.Dataset.from_tensors((images, offsets, flips))
                         .map(data.augment_batch)))
    for out in (eager, in_graph):
        assert out.dtype == tf.uint8 and out.shape == (6, 32, 32, 3)
    np.testing.assert_array_equal(eager, in_graph)
    np.testing.assert_array_equal(eager[0], images[0])            # centre crop: unchanged
    np.testing.assert_array_equal(eager[3], images[3][:, ::-1])   # centre crop, flipped
    np.testing.assert_array_equal(eager[1][4:, 4:], images[1][:-4, :-4])  # shifted by the pad


def test_training_epoch_is_a_shuffled_permutation(split):
    dataset_fn = data.train_input_fn(split, global_batch_size=50, seed=1, start_step=0, num_steps=8)
    batches = _collect(dataset_fn(_context()))
    assert len(batches) == 8 and all(b[0].shape == (50, 32, 32, 3) for b in batches)
    labels = np.concatenate([b[1] for b in batches[:4]])
    # One epoch uses every example once: the label multiset matches the split.
    assert collections.Counter(labels) == collections.Counter(split.labels)
    second_epoch = np.concatenate([b[1] for b in batches[4:]])
    assert not np.array_equal(labels, second_epoch), "each epoch must be shuffled anew"


def test_shares_of_pipelines_and_replicas_make_the_same_global_batches(split):
    kwargs = dict(global_batch_size=40, seed=7, start_step=0, num_steps=5)
    whole = _collect(data.train_input_fn(split, **kwargs)(_context()))
    # Two workers, each with two local replicas: per-replica batches of 10.
    shares = [_collect(data.train_input_fn(split, **kwargs)(_context(2, p, 4))) for p in (0, 1)]
    for step, (images, labels) in enumerate(whole):
        parts = [shares[p][2 * step + r] for p in (0, 1) for r in (0, 1)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), images)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)


def test_resuming_yields_the_remaining_batches(split):
    full = _collect(data.train_input_fn(split, 50, seed=2, start_step=0, num_steps=10)(_context()))
    resumed = _collect(data.train_input_fn(split, 50, seed=2, start_step=6, num_steps=4)(_context()))
    assert len(resumed) == 4
    for a, b in zip(full[6:], resumed):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("pipelines, replicas", [(1, 1), (1, 3), (3, 3)])
def test_evaluation_covers_every_example_exactly_once(pipelines, replicas):
    _, test = data.make_synthetic(num_train=10, num_test=103, seed=0)
    seen = collections.Counter()
    total_weight = 0.0
    for p in range(pipelines):
        for images, labels, weights in _collect(
                data.eval_input_fn(test, 24)(_context(pipelines, p, replicas))):
            for image, w in zip(images, weights):
                if w:
                    seen[image.tobytes()] += 1
            total_weight += weights.sum()
    assert total_weight == 103
    assert sorted(seen.values()) == [1] * 103


def test_synthetic_labels_follow_from_images():
    train, test = data.make_synthetic(num_train=500, num_test=100, seed=0)
    assert train.images.dtype == np.uint8 and train.images.shape == (500, 32, 32, 3)
    assert set(np.unique(train.labels)) == set(range(10))
    # A nearest-class-mean classifier fit on train labels test images well:
    # the labels carry information that a model can learn.
    means = np.stack([train.images[train.labels == c].reshape(-1, 3072).mean(0) for c in range(10)])
    distances = ((test.images.reshape(-1, 1, 3072) - means[None]) ** 2).sum(-1)
    assert (distances.argmin(1) == test.labels).mean() > 0.9
    again, _ = data.make_synthetic(num_train=500, num_test=100, seed=0)
    np.testing.assert_array_equal(again.images, train.images)


def test_cifar10_loads_through_tensorflow_datasets():
    import tensorflow_datasets as tfds
    from unittest import mock

    # mock_data stands in for prepared data; it does not mark it prepared.
    with tfds.testing.mock_data(num_examples=64), \
            mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True):
        train, test = data.load_cifar10("/nonexistent", download=False)
    assert train.images.shape == (64, 32, 32, 3) and train.images.dtype == np.uint8
    assert train.labels.dtype == np.int32 and len(test) == 64


def test_missing_cifar10_without_download_names_the_remedies(tmp_path):
    started = time.monotonic()
    with pytest.raises(DataUnavailableError) as error:
        data.load_cifar10(str(tmp_path), download=False)
    message = str(error.value)
    assert time.monotonic() - started < 60
    for remedy in ("distributed-mpt-prepare-data", "cifar-10-binary.tar.gz",
                   str(tmp_path / "downloads" / "manual"), "--dataset=synthetic"):
        assert remedy in message


def test_unreachable_download_host_fails_fast(tmp_path, monkeypatch):
    # What a machine without network sees, whatever this machine has.
    monkeypatch.setattr(data, "_CIFAR10_HOST", ("unreachable.invalid", 443))
    started = time.monotonic()
    with pytest.raises(DataUnavailableError, match="cannot be reached"):
        data.load_cifar10(str(tmp_path), download=True)
    assert time.monotonic() - started < 60


def test_augmentation_matches_reflect_pad_crop_and_flip():
    """The single-gather implementation against the plain definition."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    offsets = rng.integers(0, 2 * data.CROP_PADDING + 1, (64, 2)).astype(np.int32)
    flips = rng.random(64) < 0.5
    padded = np.pad(images, [(0, 0), (4, 4), (4, 4), (0, 0)], mode="reflect")
    expected = np.stack([padded[i, y:y + 32, x:x + 32][:, ::-1 if f else 1]
                         for i, ((y, x), f) in enumerate(zip(offsets, flips))])
    np.testing.assert_array_equal(data.augment_batch(tf.constant(images), offsets, flips), expected)
    indices = tf.constant([5, 0, 63])
    augmented, labels = data.gather_and_augment(images, np.arange(64), indices,
                                                offsets[[5, 0, 63]], flips[[5, 0, 63]])
    np.testing.assert_array_equal(augmented, expected[[5, 0, 63]])
    np.testing.assert_array_equal(labels, [5, 0, 63])


def test_archive_in_the_manual_directory_is_used_and_checked(tmp_path, monkeypatch):
    # No network needed: the archive is taken from <data_dir>/downloads/manual.
    monkeypatch.setattr(data, "_CIFAR10_HOST", ("unreachable.invalid", 443))
    manual = tmp_path / "downloads" / "manual"
    manual.mkdir(parents=True)
    (manual / data.CIFAR10_ARCHIVE).write_bytes(b"not the real archive")
    with pytest.raises(DataUnavailableError, match="checksum does not match"):
        data.load_cifar10(str(tmp_path), download=False)


def test_unwritable_data_dir_is_one_clear_error(tmp_path, monkeypatch):
    from distributed_mpt.errors import ConfigError

    # As if there were network: preparing would start, and must first find
    # that it cannot write.
    monkeypatch.setattr(data, "_reachable", lambda *args, **kwargs: True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--data_dir=.* is not writable"):
        data.load_cifar10(str(tmp_path / "file" / "tfds"), download=True)


def test_the_official_binary_release_is_read_directly(tmp_path):
    from conftest import write_cifar10_binary

    write_cifar10_binary(tmp_path)
    # No tensorflow-datasets preparation, no download: nothing is written.
    before = sorted(p for p in tmp_path.rglob("*"))
    train, test = data.load_dataset("cifar10", str(tmp_path), download=False,
                                    synthetic_examples=0, seed=0)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert train.images.shape == (50_000, 32, 32, 3) and len(test) == 10_000
    assert train.images.dtype == np.uint8 and train.labels.dtype == np.int32
    np.testing.assert_array_equal(train.labels[:12], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1])
    # Planes become channels: R and B are the label, G is 100, at every pixel.
    np.testing.assert_array_equal(train.images[7, 5, 9], [7, 100, 7])
    # The directory itself may be given, too.
    again, _ = data.load_dataset("cifar10", str(tmp_path / data.CIFAR10_BINARY_DIR), False, 0, 0)
    np.testing.assert_array_equal(again.images[:100], train.images[:100])


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "data_batch_3.bin").write_bytes((d / "data_batch_3.bin").read_bytes()[:-1]),
     "data_batch_3.bin has 30,729,999 bytes, not 30,730,000"),
    (lambda d: (d / "test_batch.bin").unlink(), "test_batch.bin cannot be read"),
    (lambda d: (d / "data_batch_1.bin").write_bytes(bytes([12]) * 30_730_000),
     "data_batch_1.bin has labels above 9"),
])
def test_a_damaged_binary_release_is_one_clear_error(tmp_path, damage, message):
    from conftest import write_cifar10_binary

    damage(write_cifar10_binary(tmp_path))
    with pytest.raises(DataUnavailableError) as error:
        data.load_dataset("cifar10", str(tmp_path), download=False, synthetic_examples=0, seed=0)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "extract the archive" in str(error.value)
