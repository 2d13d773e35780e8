"""The tf.data pipelines that feed an `ImageSplit` to every replica, and the
augmentation of training images (test images' views: eval_views.py).

The whole split stays in host memory as uint8 (150 MB for CIFAR-10's train
split). Each epoch is a seeded permutation of indices; batches of indices are
gathered, augmented as whole batches, and travel to the device as uint8, where
the model casts and normalizes them. Which images form global batch k of epoch
e, and how each is augmented, depends only on (seed, e, k): never on how many
workers or replicas share the work. That is what makes N replicas at batch b
train like one replica at batch N*b (to float32 round-off), and a resumed run continue with
the very batches it would have seen.
"""

from typing import Callable, Optional

import tensorflow as tf

from distributed_mpt.core.augmentation import CROP_PADDING, Augmentation
from distributed_mpt.core.data import ImageSplit
from distributed_mpt.core.data.dataset import shareable

def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches per epoch (training drops the ragged remainder)."""
    return num_examples // global_batch_size


def gather_and_augment(images, labels, indices, offsets, flips, crop_padding=CROP_PADDING,
                       crop_size=None):
    """The augmented training batch at `indices` of `images` and `labels`:
    a padded random crop and a horizontal flip of each image.

    images: uint8 [N, H, W, C]; labels: int32 [N]; indices: int32 [B];
    offsets: int32 [B, 2] in [0, 2*crop_padding + H - crop_size], the crop's
    corner in the reflect-padded image; flips: bool [B]; crop_size: the
    crop's side (None: H x W, the images' own size). Returns uint8
    [B, crop_size or H, crop_size or W, C] images and their labels.

    Padding, cropping and flipping only decide which source pixel lands
    where, so the source pixel's index is computed and the whole batch is
    read with a single gather of uint8 pixels: no padded copy, no float
    copy, no separate flip.
    """
    _, height, width, channels = images.shape
    out_height, out_width = (crop_size, crop_size) if crop_size else (height, width)
    rows = _reflect(offsets[:, :1] - crop_padding + tf.range(out_height)[None, :], height)
    columns = tf.where(flips[:, None], tf.range(out_width - 1, -1, -1)[None, :],
                       tf.range(out_width)[None, :])
    columns = _reflect(offsets[:, 1:] - crop_padding + columns, width)                   # [B, W]
    pixel = (indices[:, None, None] * height + rows[:, :, None]) * width + columns[:, None, :]
    augmented = tf.gather(tf.reshape(images, [-1, channels]), pixel)  # [B, H, W, C]
    return augmented, tf.gather(labels, indices)


def jitter_colors(normalized: tf.Tensor, jitter: tf.Tensor) -> tf.Tensor:
    """The 2025 record's color jitter (hiverge/cifar10-speedrun): images
    `normalized` [B, H, W, C] (per channel, as the model normalizes them)
    become (normalized + b) x c, where jitter [B, 2] holds each image's
    brightness shift b and contrast factor c."""
    jitter = tf.cast(jitter, normalized.dtype)
    return (normalized + jitter[:, 0, None, None, None]) * jitter[:, 1, None, None, None]


def _reflect(position: tf.Tensor, size: int) -> tf.Tensor:
    """Maps positions up to size - 1 outside [0, size) back inside, as
    tf.pad's REFLECT mode does (-1 -> 1, size -> size - 2)."""
    position = tf.abs(position)
    return tf.where(position >= size, 2 * (size - 1) - position, position)


def _pipeline_share(values: tf.Tensor, steps: int, context: tf.distribute.InputContext,
                    replica_batch_size: int) -> tf.Tensor:
    """This input pipeline's part of each global batch, as per-replica batches.

    `values` holds `steps` global batches back to back. Pipeline p takes the
    p-th contiguous slice of each, cut into per-replica batches in the order
    the strategy hands them to its local replicas.
    """
    trailing = values.shape[1:]
    per_step = tf.reshape(values, [steps, context.num_input_pipelines, -1, *trailing])
    mine = per_step[:, context.input_pipeline_id]
    return tf.reshape(mine, [-1, replica_batch_size, *trailing])


def _host_tensors(split: ImageSplit):
    """The split as tensors in host memory, where tf.data runs (an eager
    constant would otherwise land on the GPU and be copied back), sharing
    the split's buffers: `tf.constant` would copy them twice and keep one
    copy for the life of the process (TensorFlow 2.21: 300 MB for CIFAR-10's
    train split). DLPack shares a buffer only if it is C-contiguous and
    64-byte aligned (TensorFlow aborts the process otherwise), as
    `ImageSplit` keeps them, and writeable (NumPy's rule)."""
    def tensor(array):
        if shareable(array):
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        return tf.constant(array)

    with tf.device("/cpu:0"):
        return tensor(split.images), tensor(split.labels)


# Batches a pipeline assembles at once and keeps ready. tf.data's
# autotuning is off, so these are fixed: its model thread is joined when an
# iterator is deleted, and in TensorFlow 2.21 that join could wait out the
# thread's sleep, ~30 s at the end of training in some runs
# (docs/performance.md). One gather a batch needs little.
_PARALLEL_BATCHES = 2


def _options() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = True
    options.autotune.enabled = False
    # Sharding is done explicitly above; file-based auto-sharding would be
    # wrong (CIFAR-10 is a single file) and data-based would waste work.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


def train_input_fn(split: ImageSplit, global_batch_size: int, seed: int, start_step: int,
                   num_steps: int, images_on_device: bool = False,
                   augmentation: Augmentation = Augmentation(flip="random"),
                   crop_size: Optional[int] = None
                   ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """A `dataset_fn` for `distribute_datasets_from_function` yielding
    `(uint8 images, int32 labels)` per-replica batches for steps
    `start_step .. start_step + num_steps - 1`, each epoch shuffled and
    augmented by `seed`, as `augmentation` says; with `crop_size`, the
    images are random crops of that side, anywhere in the padded image.

    With `images_on_device`, it yields `(indices, offsets, flips)` instead:
    the caller keeps the split on the device and applies `gather_and_augment`
    there, so only a few bytes per image cross from the host each step.
    If `augmentation.jitters_colors`, each batch ends with float32 [B, 2]
    color jitter (brightness shift, contrast factor), drawn like the crops
    from (seed, epoch) and the position in the epoch, for `jitter_colors`
    after the model's normalization.

    The global batch must fit the split at least once; `trainer.plan_run`
    checks that, with the flags to change, before any pipeline is built.
    """
    num_examples = len(split)
    epoch_steps = steps_per_epoch(num_examples, global_batch_size)
    first_epoch, skip_steps = divmod(start_step, epoch_steps)
    last_epoch = (start_step + num_steps + epoch_steps - 1) // epoch_steps

    padding = augmentation.crop_padding
    # Where a crop's corner may be in the padded image, the same each way
    # (models.take_crops refuses crops of images that are not square): a
    # whole image moves by up to `padding`, a smaller crop also within it.
    corners = 2 * padding + 1 + (split.images.shape[1] - crop_size if crop_size else 0)
    # One coin per image for alternating flips, the same in every epoch.
    image_flips = tf.random.stateless_uniform([num_examples], seed=[seed + 3, 0]) < 0.5

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        replica_batch = context.get_per_replica_batch_size(global_batch_size)
        local_replicas = global_batch_size // context.num_input_pipelines // replica_batch
        used = epoch_steps * global_batch_size

        def epoch(e):
            e = tf.cast(e, tf.int32)
            order = tf.random.experimental.stateless_shuffle(
                tf.range(num_examples), seed=tf.stack([seed, e]))[:used]
            # Augmentation is keyed by position in the epoch, like the order,
            # so it does not depend on how the batch is split.
            offsets = tf.random.stateless_uniform([used, 2], seed=tf.stack([seed + 1, e]),
                                                  maxval=corners, dtype=tf.int32)
            if augmentation.flip == "random":
                flips = tf.random.stateless_uniform([used], seed=tf.stack([seed + 2, e])) < 0.5
            elif augmentation.flip == "alternating":
                # Every image is seen both ways in any two epochs: less
                # repetition than independent coins (airbench).
                flips = tf.not_equal(tf.gather(image_flips, order), e % 2 == 1)
            else:
                flips = tf.zeros([used], tf.bool)
            share = lambda x: _pipeline_share(x, epoch_steps, context, replica_batch)
            parts = (share(order), share(offsets), share(flips))
            if augmentation.jitters_colors:
                brightness = augmentation.brightness_jitter * tf.random.stateless_uniform(
                    [used], seed=tf.stack([seed + 4, e]), minval=-1.0, maxval=1.0)
                contrast = 1.0 + augmentation.contrast_jitter * tf.random.stateless_uniform(
                    [used], seed=tf.stack([seed + 5, e]), minval=-1.0, maxval=1.0)
                parts += (share(tf.stack([brightness, contrast], axis=1)),)
            return tf.data.Dataset.from_tensor_slices(parts)

        # `do_not_convert`: these functions branch on Python values only, so
        # autograph's rewrite of each (in every process) would buy nothing.
        batches = (tf.data.Dataset.range(first_epoch, last_epoch)
                   .flat_map(tf.autograph.experimental.do_not_convert(epoch))
                   .skip(skip_steps * local_replicas)
                   .take(num_steps * local_replicas))
        if not images_on_device:
            images, labels = _host_tensors(split)
            augment = lambda indices, offsets, flips, *jitter: (
                *gather_and_augment(images, labels, indices, offsets, flips, padding, crop_size),
                *jitter)
            batches = batches.map(tf.autograph.experimental.do_not_convert(augment),
                                  num_parallel_calls=_PARALLEL_BATCHES)
        return batches.prefetch(_PARALLEL_BATCHES).with_options(_options())

    return dataset_fn


def eval_steps(num_examples: int, global_batch_size: int) -> int:
    """Global batches needed to cover every example (the last one padded)."""
    return -(-num_examples // global_batch_size)


def eval_input_fn(split: ImageSplit, global_batch_size: int, with_indices: bool = False
                  ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """A `dataset_fn` yielding `(images, labels, weights)` per-replica batches
    that cover every example exactly once across all pipelines; padding
    examples carry weight 0, so no image is dropped or counted twice. With
    `with_indices`, each batch ends with the examples' int32 indices in the
    split."""
    num_examples = len(split)
    steps = eval_steps(num_examples, global_batch_size)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        replica_batch = context.get_per_replica_batch_size(global_batch_size)
        images, labels = _host_tensors(split)
        positions = tf.range(steps * global_batch_size)
        share = lambda x: _pipeline_share(x, steps, context, replica_batch)
        indices = share(tf.minimum(positions, num_examples - 1))
        weights = share(tf.cast(positions < num_examples, tf.float32))
        return (tf.data.Dataset.from_tensor_slices((indices, weights))
                .map(tf.autograph.experimental.do_not_convert(
                    lambda i, w: (tf.gather(images, i), tf.gather(labels, i), w,
                                  *([i] if with_indices else []))))
                .prefetch(_PARALLEL_BATCHES)
                .with_options(_options()))

    return dataset_fn
