"""Keras' layers computed faster, or leaner: the same function and variables as Keras'
own (an export gets Keras' layers in their place: layers.with_keras_layers),
each computed another way where that was measured to pay (docs/performance.md
has the figures). A model saved with these layers in it (not an export) names
each by its class name, which Keras looks up in its `custom_objects`: renaming
a class would break such files, renaming this module does not
(tests/core/test_faster_layers.py).

FusedBatchNormalization: TensorFlow's `FusedBatchNormV3`, one pass each way
where Keras 3 makes several; it cannot all-reduce its statistics, so only
where one replica sees the global batch.

CompiledActivation: the exact GELU (or SiLU), five TensorFlow ops each way,
compiled by XLA into one pass forward and one backward, in float32.

Maps computed again (`computable_again`, `computation_of`): the backward pass
computes a map again from what it keeps anyway, instead of keeping it: an
activation's input after a fused batch norm, and in float32 on CPUs, where
memory is largest, the whitened map and each convolution's input for its
weight gradient. A float32 `cpu_cnn94_muon` step (batch 1536, the AMX Xeon of
docs/performance.md) peaked at 0.89 GB of live tensors instead of 1.74.

LeanMaxPooling2D: keeps one byte per output (where the maximum was) for the
gradient, not Keras' whole input. XLA's pooling is slower than oneDNN's, so
only float32 maps are pooled this way, where memory is largest and the time
the smallest part of a step.

SideBySideConv2D: oneDNN convolves in blocks of output pixels along a row,
which airbench's 7- and 3-pixel maps leave mostly empty. With AMX, in
bfloat16, images side by side in 64-pixel rows (a zero gap between them: the
same convolution) ran the 3-pixel weight gradient at 253 GFLOP/s instead of
41 (a Xeon); with AVX512_BF16 and no AMX (a Zen 5 EPYC), the weight gradient
as 9 matrix products, one per tap, ran 1.6x (7 pixels) and 2.7x (3 pixels)
faster. Elsewhere both were slower, and are not used.
"""

import functools
import math

import keras
import tensorflow as tf

from distributed_mpt.core import precision

# Images up to this wide are placed side by side in rows of about
# ROW_WIDTH pixels, or get their weight gradient by taps, where either pays.
MAX_IMAGE_WIDTH = 7
ROW_WIDTH = 64
# The rows of a weight gradient by taps are summed in this many parts, one
# batched matrix product per tap: the 7-pixel 256 -> 256 weight gradient at
# batch 1536 ran at 552 GFLOP/s instead of 491 as one product, the 3-pixel
# one at 523 instead of 480 (bfloat16, timed alone on 2 cores of the AMD EPYC
# Zen 5; 2, 8 and 16 parts: 480-548).
TAP_ROW_PARTS = 4
# The activations with a compiled form, by their Keras names (an export names
# its activation, so that Keras alone can load it). Not ReLU: TensorFlow
# fuses it into the batch norm before it.
COMPILED_ACTIVATIONS = ("gelu", "silu")


class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization`, trained by `FusedBatchNormV3` when
    one replica sees the global batch (and the input is NHWC, unmasked)."""

    def call(self, inputs, training=None, mask=None):
        replicas = tf.distribute.get_replica_context()  # None in a cross-replica context
        fusable = (training and self.trainable and mask is None and not self.renorm
                   and len(inputs.shape) == 4 and self.axis in (-1, 3)
                   and replicas is not None and replicas.num_replicas_in_sync == 1)
        if not fusable:
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        ones, zeros = tf.ones([channels], tf.float32), tf.zeros([channels], tf.float32)
        scale = tf.cast(self.gamma, tf.float32) if self.scale else ones
        offset = tf.cast(self.beta, tf.float32) if self.center else zeros
        empty = tf.constant([], tf.float32)
        outputs, mean, variance, saved_mean, saved_variance, _ = tf.raw_ops.FusedBatchNormV3(
            x=inputs, scale=scale, offset=offset, mean=empty, variance=empty,
            epsilon=self.epsilon, is_training=True)
        # The kernel returns the unbiased (n - 1) variance, for its own moving
        # average; Keras' moving variance, which inference uses, is biased.
        count = tf.cast(tf.size(inputs) // channels, tf.float32)
        variance *= (count - 1.0) / count
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            self.moving_variance * self.momentum + variance * (1.0 - self.momentum))

        def normalize_again():
            # The same bits from the input, which the norm's gradient keeps
            # anyway: the kernel in inference mode, with the batch's mean and
            # biased variance, its reserve spaces on a CPU (where alone the
            # maps are computed again; cuDNN's second one is an inverse).
            return tf.raw_ops.FusedBatchNormV3(
                x=inputs, scale=scale, offset=offset, mean=saved_mean, variance=saved_variance,
                epsilon=self.epsilon, is_training=False)[0]

        return computable_again(tf.cast(outputs, self.compute_dtype), normalize_again)


class SideBySideConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D`, which convolves images of at most
    MAX_IMAGE_WIDTH pixels side by side where that pays (bfloat16 on a CPU
    with AMX), and computes their weight gradient by taps where that pays
    (bfloat16 on a CPU with AVX512_BF16 and no AMX). Only a stride-1,
    "same"-padded, channels-last convolution of an odd kernel; any other as
    Keras computes it. A float32 input that can be computed again
    (`computation_of`) is not kept for the weight gradient, on CPUs."""

    def convolution_op(self, inputs, kernel):
        width = inputs.shape[2]
        narrow = (self.padding == "same" and self.data_format == "channels_last"
                  and tuple(self.strides) == (1, 1) and tuple(self.dilation_rate) == (1, 1)
                  and self.kernel_size[0] % 2 == 1 and self.kernel_size[1] % 2 == 1
                  and self.groups == 1 and None not in inputs.shape[1:]
                  and width <= MAX_IMAGE_WIDTH and inputs.dtype == tf.bfloat16)
        if narrow and _cpu() == "amx":
            return side_by_side(functools.partial(super().convolution_op, kernel=kernel),
                                inputs, ROW_WIDTH // (width + 1), gap=self.kernel_size[1] // 2)
        if narrow and _cpu() == "avx512_bf16":
            # A tensor of the inputs' dtype, not the (autocast) variable: the
            # custom gradient is the kernel tensor's.
            return convolve_with_weight_gradient_by_taps(inputs, tf.cast(kernel, inputs.dtype))
        plain = (self.data_format == "channels_last" and self.groups == 1
                 and tuple(self.dilation_rate) == (1, 1) and len(inputs.shape) == 4)
        # float32 maps only, as the lean pooling: where memory is largest.
        again = (computation_of(inputs) if plain and inputs.dtype == tf.float32 and compiles_here()
                 else None)
        if again is not None:
            return convolve_computing_input_again(
                inputs, tf.cast(kernel, inputs.dtype), again, self.strides, self.padding.upper())
        return super().convolution_op(inputs, kernel)


@functools.cache
def _cpu() -> str:
    """"amx", "avx512_bf16" (without AMX), or "" (other CPUs, or GPUs present)."""
    if tf.config.list_physical_devices("GPU"):
        return ""
    instructions = precision.cpu_bfloat16_instructions()
    return "amx" if "amx_bf16" in instructions else "avx512_bf16" if instructions else ""


def side_by_side(convolve, images, per_row: int, gap: int):
    """`convolve(images)` computed on rows of `per_row` images side by side,
    each followed by `gap` zero columns (half the kernel's width, so that
    no output pixel reaches past its image into the next one); zero images
    fill the last row. images: [N, H, W, C] of static H, W and C."""
    count = tf.shape(images)[0]
    _, height, width, channels = images.shape
    spaced = width + gap
    padded = tf.pad(images, [[0, -count % per_row], [0, 0], [0, gap], [0, 0]])
    # [N, H, W + gap, C] -> [N / per_row, H, per_row * (W + gap), C]
    rows = tf.transpose(tf.reshape(padded, [-1, per_row, height, spaced, channels]), [0, 2, 1, 3, 4])
    outputs = convolve(tf.reshape(rows, [-1, height, per_row * spaced, channels]))
    # ... and back, without the gaps and the filling images.
    filters = outputs.shape[-1]
    outputs = tf.transpose(tf.reshape(outputs, [-1, height, per_row, spaced, filters]), [0, 2, 1, 3, 4])
    return tf.reshape(outputs, [-1, height, spaced, filters])[:count, :, :width]


def convolve_with_weight_gradient_by_taps(images, kernel):
    """tf.nn.conv2d(images, kernel, 1, "SAME") with its usual input
    gradient, and its weight gradient from `weight_gradient_by_taps`.
    kernel: [height, width, in, out] of odd height and width."""

    @tf.custom_gradient
    def convolve(images, kernel):
        def gradients(output_gradient):
            image_gradient = tf.raw_ops.Conv2DBackpropInput(
                input_sizes=tf.shape(images), filter=kernel, out_backprop=output_gradient,
                strides=[1, 1, 1, 1], padding="SAME")
            return image_gradient, weight_gradient_by_taps(images, output_gradient, kernel.shape)

        return tf.nn.conv2d(images, kernel, 1, "SAME"), gradients

    return convolve(images, kernel)


def convolve_computing_input_again(images, kernel, images_again, strides, padding: str):
    """tf.nn.conv2d(images, kernel, strides, padding) (NHWC) with the usual
    gradients, except that the kernel's is computed from `images_again()`
    (the same images, computed again from what the backward pass keeps
    anyway: `computation_of`) rather than from `images` kept until then."""
    strides = [1, *strides, 1]

    @tf.custom_gradient
    def convolve(images, kernel):
        # Taken now: a shape read in the gradient would keep the images.
        image_shape = tf.shape(images)

        def gradients(output_gradient):
            # Not before the gradient arrives: computed in the forward pass,
            # the copy would be kept as long as the images were.
            with tf.control_dependencies([output_gradient]):
                again = images_again()
            kernel_gradient = tf.raw_ops.Conv2DBackpropFilter(
                input=again, filter_sizes=tf.shape(kernel), out_backprop=output_gradient,
                strides=strides, padding=padding)
            # After the kernel's, so that the copy is let go before the
            # images' gradient, as large, is made.
            with tf.control_dependencies([kernel_gradient]):
                image_gradient = tf.raw_ops.Conv2DBackpropInput(
                    input_sizes=image_shape, filter=kernel, out_backprop=output_gradient,
                    strides=strides, padding=padding)
            return image_gradient, kernel_gradient

        return tf.nn.conv2d(images, kernel, strides, padding), gradients

    return convolve(images, kernel)


def weight_gradient_by_taps(images, output_gradient, kernel_shape):
    """The gradient of a stride-1 "same" convolution's kernel [height, width,
    in, out] (odd height and width) from its images [N, H, W, in] and the
    gradient of its outputs [N, H, W, out]: for each tap (i, j), the images
    shifted by it (zero-padded as the convolution pads them) times the output
    gradient, summed over every image and pixel: a matrix product
    [in, N*H*W] x [N*H*W, out] per tap. The N*H*W rows are cut into
    TAP_ROW_PARTS parts where they split evenly (a batch of static size), one
    batched product per tap, and the parts summed in float32: oneDNN then
    shares the long sum among its threads (see TAP_ROW_PARTS)."""
    kernel_height, kernel_width, channels, filters = kernel_shape
    count, height, width, _ = images.shape
    rows = None if count is None else count * height * width
    parts = TAP_ROW_PARTS if rows and rows % TAP_ROW_PARTS == 0 else 1
    # Not before the gradient arrives: they need nothing else, so they were
    # made in the forward pass and held until the backward pass (24-step runs
    # of cpu_cnn94_muon peaked at 2.88-3.04 GB on 2 cores of a Zen 5 AMD EPYC
    # with AVX512_BF16; docs/performance.md).
    with tf.control_dependencies([output_gradient]):
        padded = tf.pad(images, [[0, 0], [kernel_height // 2] * 2, [kernel_width // 2] * 2, [0, 0]])
    gradient = tf.reshape(output_gradient, [parts, -1, filters])
    taps = []
    for i, j in ((i, j) for i in range(kernel_height) for j in range(kernel_width)):
        # Each shifted copy cut once the product two taps before is done:
        # two copies at most alive, one cut while the other is multiplied.
        with tf.control_dependencies(taps[-2:-1]):
            tap = tf.reshape(padded[:, i:i + height, j:j + width], [parts, -1, channels])
        taps.append(tf.linalg.matmul(tap, gradient, transpose_a=True))
    summed = tf.reduce_sum(tf.cast(tf.stack(taps), tf.float32), axis=1)  # [taps, in, out]
    return tf.cast(tf.reshape(summed, kernel_shape), images.dtype)


class LeanMaxPooling2D(keras.layers.MaxPooling2D):
    """`keras.layers.MaxPooling2D` over 2x2 windows at stride 2, which keeps
    for its gradient which pixel of each window was the largest (one byte
    per output) instead of its whole input (four outputs' worth, in the
    compute dtype): airbench's pools read the largest maps of the network,
    whose copies, kept for the backward pass, were 0.67 of the 3.74 GB a
    float32 `cpu_cnn94_muon` run held at its peak (docs/performance.md).
    Compiled like the activations, on CPUs, for float32 maps; the
    gradient goes where Keras' goes, to the first largest pixel in row-major
    order. Any other pooling or dtype, and GPUs, as Keras computes it."""

    def call(self, inputs):
        lean = (compiles_here() and inputs.dtype == tf.float32 and tuple(self.pool_size) == (2, 2)
                and tuple(self.strides) == (2, 2) and self.padding == "valid"
                and self.data_format == "channels_last" and len(inputs.shape) == 4
                and None not in inputs.shape[1:3])
        return max_pool_2x2(inputs) if lean else super().call(inputs)


def max_pool_2x2(images):
    """2x2 max pooling at stride 2 ("valid": an odd last row or column is
    dropped) whose gradient keeps only the uint8 position of each window's
    maximum. images: [N, H, W, C] of static H and W."""
    dropped = (images.shape[1] % 2, images.shape[2] % 2)

    @tf.custom_gradient
    def pool(images):
        pooled, position = _pool_forward(images)
        return pooled, lambda output_gradient: _pool_backward(position, output_gradient, dropped)

    return pool(images)


@tf.function(jit_compile=True)
def _pool_forward(images):
    # The four pixels of every 2x2 window, in row-major order, as four maps.
    height, width = tf.shape(images)[1] // 2 * 2, tf.shape(images)[2] // 2 * 2
    corners = [images[:, i:height:2, j:width:2] for i in (0, 1) for j in (0, 1)]
    pooled = tf.reduce_max(tf.stack(corners), axis=0)
    # The first corner equal to the maximum, as Keras' gradient routes it.
    position = tf.fill(tf.shape(pooled), tf.constant(3, tf.uint8))
    for index in (2, 1, 0):
        position = tf.where(corners[index] == pooled, tf.constant(index, tf.uint8), position)
    return pooled, position


@tf.function(jit_compile=True)
def _pool_backward(position, output_gradient, dropped):
    """The images' gradient; the row and column "valid" pooling `dropped`
    (each 0 or 1) get none. Padded here, inside the compiled function, so that
    the gradient is written once: padded after it, the map was there twice
    (airbench's first pooling, float32, batch 1536: 354 + 378 MB at once)."""
    zero = tf.zeros_like(output_gradient)
    top, bottom = [[tf.where(position == 2 * i + j, output_gradient, zero) for j in (0, 1)]
                   for i in (0, 1)]
    # Interleave: [N, H/2, W/2, 2 (column), C] -> rows, then [N, H/2, 2 (row), W, C].
    count, half_height, half_width, channels = (tf.shape(output_gradient)[k] for k in range(4))
    rows = [tf.reshape(tf.stack(pair, axis=3), [count, half_height, 2 * half_width, channels])
            for pair in (top, bottom)]
    spread = tf.reshape(tf.stack(rows, axis=2), [count, 2 * half_height, 2 * half_width, channels])
    return tf.pad(spread, [[0, 0], [0, dropped[0]], [0, dropped[1]], [0, 0]])


class CompiledActivation(keras.layers.Activation):
    """`keras.layers.Activation(name)` for a name of COMPILED_ACTIVATIONS,
    computed by `activate` on CPUs (GPUs keep TensorFlow's kernels: not
    measured)."""

    def __init__(self, activation: str, **kwargs):
        if activation not in COMPILED_ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose from {COMPILED_ACTIVATIONS}")
        super().__init__(activation, **kwargs)
        self._activation_name = activation

    def call(self, inputs):
        if compiles_here():
            return activate(inputs, self._activation_name)
        return super().call(inputs)


@functools.cache
def compiles_here() -> bool:
    """Whether to compile activations: without GPUs."""
    return not tf.config.list_physical_devices("GPU")


def activate(x, name: str):
    """Activation `name` of x, compiled forward and backward (see above).

    Where x can be computed again (`computation_of`: the output of a
    training FusedBatchNormalization, whose input the norm's own gradient
    keeps anyway), the backward pass computes it again instead of keeping
    it: one elementwise pass for a feature map's worth of memory
    (docs/performance.md, "Where a run's memory goes"). The output is then
    marked as computable again too, for the convolution after it
    (`SideBySideConv2D`)."""
    x_again = computation_of(x)

    @tf.custom_gradient
    def compiled(x):
        def gradient(output_gradient):
            if x_again is None:
                return _backward(x, output_gradient, name)
            # Not before the gradient arrives: computed in the forward pass,
            # the copy would be kept as long as x was.
            with tf.control_dependencies([output_gradient]):
                return _backward(x_again(), output_gradient, name)

        return _forward(x, name), gradient

    activated = compiled(x)
    return activated if x_again is None else computable_again(
        activated, lambda: _forward(x_again(), name))


def computable_again(x, compute):
    """x, marked as computed again, bit for bit, by `compute()` from small
    tensors or tensors the backward pass keeps anyway (`computation_of`
    reads the mark). Returns x."""
    if not tf.executing_eagerly():
        x._computed_again = compute
    return x


def computation_of(x):
    """The function that computes graph tensor x again, bit for bit, from
    tensors that the backward pass keeps anyway, if x (or what an identity
    passes on as x) is marked by `computable_again`: the output of a
    training `FusedBatchNormalization`, of the whitening convolution in
    float32, and an activation of either. None otherwise (eager tensors)."""
    if tf.executing_eagerly():
        return None
    while getattr(x, "_computed_again", None) is None and x.op.type == "Identity":
        x = x.op.inputs[0]
    return getattr(x, "_computed_again", None)


def _value_and_slope(name: str, x):
    """activation(x) and its derivative at x (float32)."""
    if name == "gelu":  # exact, as keras.activations.gelu: x * Phi(x)
        cdf = 0.5 * tf.math.erfc(x * -math.sqrt(0.5))
        return x * cdf, cdf + x * tf.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    sigmoid = tf.sigmoid(x)  # silu
    return x * sigmoid, sigmoid * (1 + x * (1 - sigmoid))


@tf.function(jit_compile=True)
def _forward(x, name):
    value, _ = _value_and_slope(name, tf.cast(x, tf.float32))
    return tf.cast(value, x.dtype)


@tf.function(jit_compile=True)
def _backward(x, output_gradient, name):
    _, slope = _value_and_slope(name, tf.cast(x, tf.float32))
    return tf.cast(tf.cast(output_gradient, tf.float32) * slope, x.dtype)
