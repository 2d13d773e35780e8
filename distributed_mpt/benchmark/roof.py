"""The machine's compute roof, and the FLOPs a model trains with.

The roof of a compute dtype is the best rate of the kernels a CIFAR-10 CNN
spends its time in, timed alone: a large matmul and 3x3 convolutions at the
sizes of a CIFAR network's stages (32x32 with 64 channels down to 8x8 with
256). A training cell's FLOP/s over that roof says how much of what this
machine can do the whole training step reaches.
"""

import dataclasses
import time

import numpy as np

# (height and width, channels) of each 3x3 convolution, at a CIFAR network's stages.
CONVOLUTIONS = ((32, 64), (16, 128), (16, 256), (8, 256))
# Forward + backward = 3x forward: the backward pass computes the gradients of
# both the inputs and the weights, each as many multiply-adds as the forward.
TRAINING_FLOPS_PER_FORWARD_FLOP = 3


@dataclasses.dataclass(frozen=True)
class Roof:
    """What one roof measurement times: every kernel in `dtype`."""

    dtype: str  # a compute dtype: float32, bfloat16 or float16
    batch_size: int = 512  # of the convolutions; the matmul is 4x this square
    repeats: int = 3
    seconds: float = 1.0  # per timed window

    def describe(self) -> str:
        """The measurement in a few words, for progress lines and errors."""
        return f"roof {self.dtype}"


def measure(roof: Roof) -> dict:
    """Times every kernel of `roof` in this process: a warm-up call, then
    the best of `repeats` windows of about `seconds`. Returns {"rows":
    [{"kernel", "flops_per_second"}]}."""
    import tensorflow as tf

    dtype, batch = tf.as_dtype(roof.dtype), roof.batch_size
    random = tf.random.Generator.from_seed(0)

    def tensor(*shape):
        return tf.cast(random.normal(shape), dtype)

    n = 4 * batch
    kernels = {f"matmul {n}x{n}": (tf.linalg.matmul, tensor(n, n), tensor(n, n), 2 * n ** 3)}
    for size, channels in CONVOLUTIONS:
        kernels[f"conv3x3 {size}x{size}x{channels}"] = (
            lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), tensor(batch, size, size, channels),
            tensor(3, 3, channels, channels), 2 * batch * size * size * 9 * channels ** 2)
    rows = []
    for name, (op, a, b, flops) in kernels.items():
        # Returns one number, so that no copy of the output is timed.
        call = tf.function(lambda a=a, b=b, op=op: tf.reduce_sum(
            tf.cast(tf.reshape(op(a, b), [-1])[:1], tf.float32)))
        call().numpy()
        rows.append({"kernel": name, "flops_per_second": best_rate(
            lambda: call().numpy(), flops, roof.repeats, roof.seconds)})
    return {"rows": rows}


def best_rate(call, work: float, repeats: int, seconds: float) -> float:
    """The best of `repeats` windows of about `seconds`, each calling `call`
    as often as fits (once at least): `work` a call over the window's time."""
    rates = []
    for _ in range(repeats):
        calls, started = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < seconds:
            call()
            calls += 1
        rates.append(calls * work / (time.perf_counter() - started))
    return max(rates)


def forward_flops(model) -> int:
    """FLOPs of one example through `model`'s convolutions and dense layers
    (a multiply-add is 2), from the layers' kernel and output shapes. Other
    layers (batch norm, activations, pooling) are memory-bound and left out,
    as is usual for a FLOP count."""
    import keras

    total = 0
    for layer in model.layers:
        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
            # Every output position of every output channel takes one
            # multiply-add per weight of its filter (kernel size x inputs).
            weights_per_output = int(np.prod(layer.kernel.shape[:-1]))
            total += 2 * weights_per_output * int(np.prod(layer.output.shape[1:]))
    return total
