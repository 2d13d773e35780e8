"""Batch norm's moving statistics, recalibrated where a run's steps cannot
have made them converge.

A batch norm layer evaluates with moving averages of its training batches'
statistics: after `steps` steps its initial statistics (mean 0, variance 1)
still weigh momentum ** steps in them. airbench's 0.6 forgets them in ten
steps; Keras' default 0.99, which keras.applications' networks keep, needs
459 for them to weigh under 1%, and 0.999 needs 4,603: a shorter run
evaluates with statistics that are partly the initial ones, down to chance
(docs/extending.md: a MobileNet at 13.75% after an epoch, 38.57%
recalibrated), whatever it learned. Recalibration sets them to the data's instead: forward
passes over unaugmented training images, as training computes them (batch
statistics, synchronized over the replicas), each batch's statistics
averaged with the same weight.

This module imports no TensorFlow at import time (config.py reads its
choices, and flags are checked at once).
"""

import math

# --bn_recalibration: auto recalibrates where `unconverged` finds layers.
RECALIBRATIONS = ("auto", "on", "off")
# Above this weight of the initial statistics in a layer's moving average,
# the average cannot stand for the data (momentum ** steps).
INITIAL_WEIGHT_LIMIT = 0.01
# Training images the statistics are recalibrated over (fewer if the split
# holds fewer, in whole global batches): a fifth of CIFAR-10's train split,
# a few hundred thousand values per channel even for the last layers.
RECALIBRATION_IMAGES = 10_000


def batch_norm_layers(model) -> list:
    """Every BatchNormalization of `model` that trains and keeps moving
    statistics (a frozen one keeps those it was given; batch renormalization
    keeps its own)."""
    import keras

    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            and not layer.renorm]


def initial_weight(layer, steps: int) -> float:
    """The weight the initial statistics of `layer` still hold in its moving
    averages after `steps` training steps."""
    return layer.momentum ** steps


def unconverged(model, steps: int) -> list:
    """The layers of `model` whose moving statistics still weigh their
    initial ones above INITIAL_WEIGHT_LIMIT after `steps` steps."""
    return [layer for layer in batch_norm_layers(model)
            if initial_weight(layer, steps) > INITIAL_WEIGHT_LIMIT]


def to_recalibrate(model, steps: int, mode: str):
    """(the layers of `model` that --bn_recalibration=`mode` recalibrates
    after `steps` steps, why, in words); no layers where it recalibrates none."""
    if mode == "off":
        return [], ""
    if mode == "on":
        return batch_norm_layers(model), "--bn_recalibration=on"
    layers = unconverged(model, steps)
    if not layers:
        return [], ""
    heaviest = max(layers, key=lambda layer: initial_weight(layer, steps))
    return layers, (f"at momentum {heaviest.momentum:g}, {steps} steps leave the initial "
                    f"statistics {initial_weight(heaviest, steps):.0%} of their weight; "
                    f"--bn_recalibration=off keeps them")


def recalibration_batches(num_examples: int, global_batch_size: int) -> int:
    """Global batches for RECALIBRATION_IMAGES (at least one; at most the
    whole batches of the split)."""
    wanted = math.ceil(RECALIBRATION_IMAGES / global_batch_size)
    return max(1, min(wanted, num_examples // global_batch_size))


def recalibrate(model, strategy, iterator, num_batches: int, layers) -> None:
    """Sets the moving mean and variance of `layers` (of `model`) to the
    mean, over `num_batches` batches of `iterator` (distributed (images,
    labels), as training reads them), of each batch's statistics as training
    computes them. Every replica and worker calls it alike; the result
    depends on the batches and the weights only, not on the statistics
    before (the passes normalize with batch statistics): recalibrating
    twice gives the same."""
    import keras
    import numpy as np
    import tensorflow as tf

    momenta = [layer.momentum for layer in layers]
    totals = [[np.zeros(layer.moving_mean.shape, np.float64),
               np.zeros(layer.moving_variance.shape, np.float64)] for layer in layers]
    try:
        for layer in layers:
            # Read when the pass is traced: each batch's statistics replace
            # the moving ones, which are summed here between batches.
            layer.momentum = 0.0

        def per_replica(images):
            model(images, training=True)  # its only effect here: the statistics

        # Python branches only: nothing for autograph to convert.
        forward = tf.function(lambda images: strategy.run(per_replica, args=(images,)),
                              autograph=False)
        for _ in range(num_batches):
            images, _ = next(iterator)
            forward(images)
            for (mean, variance), layer in zip(totals, layers):
                mean += keras.ops.convert_to_numpy(layer.moving_mean)
                variance += keras.ops.convert_to_numpy(layer.moving_variance)
        for (mean, variance), layer in zip(totals, layers):
            layer.moving_mean.assign((mean / num_batches).astype(np.float32))
            layer.moving_variance.assign((variance / num_batches).astype(np.float32))
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
