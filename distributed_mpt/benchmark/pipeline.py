"""The input_pipeline section: the package's batched uint8 pipeline against
the per-example `map` pipeline of most CIFAR examples, and how many times
faster than the training step it delivers."""

import gc
import time
from typing import Callable, Optional

from distributed_mpt.benchmark.measure import interleaved, ratio
from distributed_mpt.benchmark.settings import BenchConfig


_PIPELINE_WARMUP = 5


def package_pipeline(split, batch_size: int, seed: int, num_steps: int):
    """The package's training pipeline on one host, as the trainer builds it."""
    import tensorflow as tf

    from distributed_mpt import data

    return data.train_input_fn(split, batch_size, seed, 0, num_steps)(tf.distribute.InputContext())


def per_example_pipeline(split, batch_size: int, seed: int, repeat: bool = True):
    """The pipeline of most CIFAR examples: slices of the arrays, shuffled,
    each image padded, cropped and flipped on its own, then batched. The same
    augmentation as the package (4-pixel reflect padding, random 32x32 crop,
    random horizontal flip), on uint8; parallel `map`, so not a straw man."""
    import tensorflow as tf

    from distributed_mpt.data import CROP_PADDING, IMAGE_SHAPE

    def augment(image, label):
        image = tf.pad(image, [[CROP_PADDING] * 2, [CROP_PADDING] * 2, [0, 0]], mode="REFLECT")
        image = tf.image.random_crop(image, IMAGE_SHAPE)
        return tf.image.random_flip_left_right(image), label

    dataset = tf.data.Dataset.from_tensor_slices((split.images, split.labels))
    dataset = dataset.shuffle(len(split), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    return (dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch_size, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))


def _pipeline_rate(make_dataset: Callable, batch_size: int, timed_batches: int) -> float:
    """Images/s delivered by a fresh pipeline after _PIPELINE_WARMUP batches."""
    iterator = iter(make_dataset())
    for _ in range(_PIPELINE_WARMUP):
        next(iterator)
    started = time.perf_counter()
    for _ in range(timed_batches):
        next(iterator)
    elapsed = time.perf_counter() - started
    del iterator
    gc.collect()
    return timed_batches * batch_size / elapsed


def bench_input_pipeline(config: BenchConfig, training: Optional[dict]) -> dict:
    from distributed_mpt import data, precision

    split, _ = data.make_synthetic(config.train_examples, 1, config.seed)
    training_policy = precision.resolve_precision(config.precisions[0])
    results = []
    for batch in config.batch_sizes:
        timed = max(config.pipeline_images // batch, 3)
        steps = timed + _PIPELINE_WARMUP
        figures = interleaved({
            "package": lambda: _pipeline_rate(
                lambda: package_pipeline(split, batch, config.seed, steps), batch, timed),
            "per_example": lambda: _pipeline_rate(
                lambda: per_example_pipeline(split, batch, config.seed), batch, timed),
        }, config.repeats, f"input_pipeline batch {batch}")
        package_rate = figures["package"]["median"]
        step_rates = {row["model"]: row["package_examples_per_second"]
                      for row in (training or {}).get("results", [])
                      if row["batch_size"] == batch and row["precision"] == training_policy}
        results.append({
            "batch_size": batch, "images_timed": timed * batch,
            "package_images_per_second": package_rate,
            "per_example_images_per_second": figures["per_example"]["median"],
            "speedup": ratio(package_rate, figures["per_example"]["median"]),
            "training_examples_per_second": step_rates,
            "package_over_training_step": {model: ratio(package_rate, rate)
                                           for model, rate in step_rates.items()},
            "runs": {name: f["runs"] for name, f in figures.items()}})
    return {"train_examples": config.train_examples, "results": results,
            "note": "package_over_training_step: how many times faster the package pipeline "
                    "delivers images than its training step (precision "
                    f"{config.precisions[0]}) consumes them; above 1 the input is not the "
                    "bottleneck."}
