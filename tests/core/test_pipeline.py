"""The input pipeline: augmentation, sharding over pipelines and replicas,
resumption, and evaluation coverage."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.core import pipeline
from distributed_mpt.core.augmentation import CROP_PADDING, Augmentation
from distributed_mpt.core.data import synthetic

def _context(pipelines=1, pipeline_id=0, replicas=1):
    return tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def _collect(dataset):
    return [tuple(np.asarray(t) for t in element) for element in dataset]


@pytest.fixture(scope="module")
def split():
    train, _ = synthetic.make_synthetic(num_train=200, num_test=40, seed=3)
    return train


def test_augmentation_keeps_shape_dtype_and_pixels():
    images = tf.constant(np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    labels, indices = tf.range(6), tf.range(6)
    offsets = tf.constant([[4, 4], [0, 0], [8, 8], [4, 4], [0, 8], [2, 6]], tf.int32)
    flips = tf.constant([False, False, False, True, False, True])
    eager, _ = pipeline.gather_and_augment(images, labels, indices, offsets, flips)
    # In a tf.data map, as train_input_fn applies it.
    in_graph, _ = next(iter(tf.data.Dataset.from_tensors((indices, offsets, flips))
                            .map(lambda *batch: pipeline.gather_and_augment(images, labels, *batch))))
    for out in (eager, in_graph):
        assert out.dtype == tf.uint8 and out.shape == (6, 32, 32, 3)
    np.testing.assert_array_equal(eager, in_graph)
    np.testing.assert_array_equal(eager[0], images[0])            # centre crop: unchanged
    np.testing.assert_array_equal(eager[3], images[3][:, ::-1])   # centre crop, flipped
    np.testing.assert_array_equal(eager[1][4:, 4:], images[1][:-4, :-4])  # shifted by the pad


def test_training_epoch_is_a_shuffled_permutation(split):
    dataset_fn = pipeline.train_input_fn(split, global_batch_size=50, seed=1, start_step=0, num_steps=8)
    batches = _collect(dataset_fn(_context()))
    assert len(batches) == 8 and all(b[0].shape == (50, 32, 32, 3) for b in batches)
    labels = np.concatenate([b[1] for b in batches[:4]])
    # One epoch uses every example once: the label multiset matches the split.
    assert collections.Counter(labels) == collections.Counter(split.labels)
    second_epoch = np.concatenate([b[1] for b in batches[4:]])
    assert not np.array_equal(labels, second_epoch), "each epoch must be shuffled anew"


def test_shares_of_pipelines_and_replicas_make_the_same_global_batches(split):
    kwargs = dict(global_batch_size=40, seed=7, start_step=0, num_steps=5)
    whole = _collect(pipeline.train_input_fn(split, **kwargs)(_context()))
    # Two workers, each with two local replicas: per-replica batches of 10.
    shares = [_collect(pipeline.train_input_fn(split, **kwargs)(_context(2, p, 4))) for p in (0, 1)]
    for step, (images, labels) in enumerate(whole):
        parts = [shares[p][2 * step + r] for p in (0, 1) for r in (0, 1)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), images)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)


def test_resuming_yields_the_remaining_batches(split):
    full = _collect(pipeline.train_input_fn(split, 50, seed=2, start_step=0, num_steps=10)(_context()))
    resumed = _collect(pipeline.train_input_fn(split, 50, seed=2, start_step=6, num_steps=4)(_context()))
    assert len(resumed) == 4
    for a, b in zip(full[6:], resumed):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_no_pipeline_runs_tf_datas_autotuning(split):
    # Its model thread made deleting a training iterator wait ~30 s in some
    # runs (TensorFlow 2.21, docs/performance.md): the depths are fixed instead.
    train = pipeline.train_input_fn(split, 50, seed=0, start_step=0, num_steps=2)(_context())
    test = pipeline.eval_input_fn(split, 50)(_context())
    for dataset, batches in ((train, 2), (test, 4)):
        assert dataset.options().autotune.enabled is False
        assert len(_collect(dataset)) == batches


@pytest.mark.parametrize("pipelines, replicas", [(1, 1), (1, 3), (3, 3)])
def test_evaluation_covers_every_example_exactly_once(pipelines, replicas):
    _, test = synthetic.make_synthetic(num_train=10, num_test=103, seed=0)
    seen = collections.Counter()
    total_weight = 0.0
    for p in range(pipelines):
        for images, labels, weights in _collect(
                pipeline.eval_input_fn(test, 24)(_context(pipelines, p, replicas))):
            for image, w in zip(images, weights):
                if w:
                    seen[image.tobytes()] += 1
            total_weight += weights.sum()
    assert total_weight == 103
    assert sorted(seen.values()) == [1] * 103


def test_augmentation_matches_reflect_pad_crop_and_flip():
    """The single-gather implementation against the plain definition."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    offsets = rng.integers(0, 2 * CROP_PADDING + 1, (64, 2)).astype(np.int32)
    flips = rng.random(64) < 0.5
    padded = np.pad(images, [(0, 0), (4, 4), (4, 4), (0, 0)], mode="reflect")
    expected = np.stack([padded[i, y:y + 32, x:x + 32][:, ::-1 if f else 1]
                         for i, ((y, x), f) in enumerate(zip(offsets, flips))])
    augmented, _ = pipeline.gather_and_augment(images, np.arange(64), tf.range(64), offsets, flips)
    np.testing.assert_array_equal(augmented, expected)
    indices = tf.constant([5, 0, 63])
    augmented, labels = pipeline.gather_and_augment(images, np.arange(64), indices,
                                                offsets[[5, 0, 63]], flips[[5, 0, 63]])
    np.testing.assert_array_equal(augmented, expected[[5, 0, 63]])
    np.testing.assert_array_equal(labels, [5, 0, 63])


def test_the_pipeline_reads_the_splits_own_buffer_not_a_copy():
    # tf.constant would copy CIFAR-10's train split twice and keep one copy
    # for good (300 MB of a run's peak): the pipeline shares the buffer. An
    # ImageSplit keeps it as TensorFlow can share it, whatever it was given.
    from distributed_mpt.core.data import ImageSplit
    from distributed_mpt.core.data.dataset import ALIGNMENT
    rng = np.random.default_rng(0)
    given = np.zeros(100 * 12 + 1, np.uint8)[1:].reshape(100, 2, 2, 3)  # 1 byte off: unaligned
    given[...] = rng.integers(0, 256, given.shape)
    split = ImageSplit(given, np.arange(100, dtype=np.int32))
    np.testing.assert_array_equal(split.images, given)
    assert split.images.ctypes.data % ALIGNMENT == 0 and split.labels.ctypes.data % ALIGNMENT == 0
    images, labels = pipeline._host_tensors(split)
    split.images[7] = 255 - split.images[7]
    split.labels[7] = 99
    np.testing.assert_array_equal(images.numpy(), split.images)
    assert labels.numpy()[7] == 99
    # What cannot be shared (made read-only since) is copied, as before.
    frozen = ImageSplit(split.images.copy(), split.labels.copy())
    frozen.images.flags.writeable = False
    images, _ = pipeline._host_tensors(frozen)
    np.testing.assert_array_equal(images.numpy(), frozen.images)
    frozen.images.flags.writeable = True
    frozen.images[7] = 255 - frozen.images[7]
    assert not np.array_equal(images.numpy()[7], frozen.images[7]), "a copy, not the buffer"
    # A loader's array made read-only (np.frombuffer's) is copied once, aligned, when the
    # split is made: the pipeline then shares that copy.
    read_only = np.frombuffer(given.tobytes(), np.uint8).reshape(given.shape)
    split = ImageSplit(read_only, np.arange(100, dtype=np.int32))
    assert split.images.flags.writeable and split.images.ctypes.data % ALIGNMENT == 0



@pytest.mark.parametrize("padding, crop_size", [(4, 24), (2, 17), (0, 31)])
def test_early_crops_are_crops_of_the_padded_image_and_their_mirror_images(padding, crop_size):
    """--early_crop_size's crops against the plain definition: a square of
    `crop_size` anywhere in the reflect-padded image, flipped or not."""
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    corners = 2 * padding + 32 - crop_size + 1
    offsets = rng.integers(0, corners, (64, 2)).astype(np.int32)
    offsets[:2] = [[0, 0], [corners - 1, corners - 1]]  # both extremes
    flips = rng.random(64) < 0.5
    padded = np.pad(images, [(0, 0), (padding, padding), (padding, padding), (0, 0)],
                    mode="reflect")
    expected = np.stack([padded[i, y:y + crop_size, x:x + crop_size][:, ::-1 if f else 1]
                         for i, ((y, x), f) in enumerate(zip(offsets, flips))])
    cropped, labels = pipeline.gather_and_augment(images, np.arange(64), tf.range(64), offsets,
                                                  flips, padding, crop_size)
    np.testing.assert_array_equal(cropped, expected)
    np.testing.assert_array_equal(labels, np.arange(64))


def test_the_pipelines_crops_reach_every_corner_and_whole_images_follow(split):
    # With the split on the device the batches carry the corners themselves.
    def offsets(crop_size, start, steps):
        batches = _collect(pipeline.train_input_fn(
            split, 50, seed=4, start_step=start, num_steps=steps, images_on_device=True,
            augmentation=Augmentation(crop_padding=2, flip="random"), crop_size=crop_size)(_context()))
        return np.concatenate([b[1] for b in batches])

    early = offsets(24, 0, 8)
    assert early.min() == 0 and early.max() == 2 * 2 + 32 - 24, "every corner, and no farther"
    assert offsets(None, 8, 4).max() == 2 * 2, "whole images move by the padding only"
    batch = next(iter(pipeline.train_input_fn(split, 50, seed=4, start_step=0, num_steps=1,
                                              crop_size=24)(_context())))
    assert batch[0].shape == (50, 24, 24, 3) and batch[0].dtype == tf.uint8
