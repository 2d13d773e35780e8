"""The optimizer and how its learning rate follows the global batch.

The learning rate scales linearly with the global batch (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"), warms up linearly from zero, and then
follows a cosine decay to zero at the last step.
"""

import keras

# The batch at which --learning_rate is stated. 128 with lr 0.1 and SGD
# momentum 0.9 is the classic CIFAR ResNet recipe (He et al. 2016, sec. 4.2).
REFERENCE_BATCH_SIZE = 128


def scaled_learning_rate(base_learning_rate: float, global_batch_size: int,
                         ceiling: float = 0.0) -> float:
    """The peak learning rate for `global_batch_size` (linear scaling rule),
    at most `ceiling` (0: none).

    Linear scaling keeps the noise of a step constant; it cannot move the
    curvature limit (a rate above ~2/curvature diverges at any batch), which
    a network without normalization layers, like the MLP, reaches at large
    batches.
    """
    rate = base_learning_rate * global_batch_size / REFERENCE_BATCH_SIZE
    return min(rate, ceiling) if ceiling > 0 else rate


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int):
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine decay to 0.

    The warmup takes at most half of the run, so that a short run (a smoke
    test, --train_steps) still decays instead of ending at its peak.
    """
    warmup_steps = min(warmup_steps, total_steps // 2)
    decay_steps = max(total_steps - warmup_steps, 1)
    if warmup_steps == 0:
        return keras.optimizers.schedules.CosineDecay(peak, decay_steps)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps, warmup_target=peak, warmup_steps=warmup_steps)


def make_optimizer(learning_rate, momentum: float, loss_scaling: bool) -> keras.optimizers.Optimizer:
    """SGD with Nesterov momentum; wrapped for dynamic loss scaling if asked
    (needed under mixed_float16, where small gradients underflow)."""
    optimizer = keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum, nesterov=True)
    if loss_scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
