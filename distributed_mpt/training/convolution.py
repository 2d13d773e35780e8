"""Convolutions that keep a CPU's matrix units busy on small images.

oneDNN computes a convolution in blocks of output pixels along a row. On the
narrow feature maps at the end of airbench (7 and 3 pixels wide) those blocks
run mostly empty: on a Xeon with AMX, in bfloat16, the weight gradient of its
3-pixel stage ran at 41 GFLOP/s, against 253 with 16 of the images side by
side in rows 64 pixels wide. Images placed side by side, with a zero gap
between neighbours, give the same convolution: every output pixel sees its
own image and zeros, as the padding would give it. It pays only there: on
the same Xeon, in float32 (no AMX), the rearrangement made airbench's step
11% slower, and at 15 pixels wide 14% slower (docs/performance.md).
"""

import functools

import keras
import tensorflow as tf

from distributed_mpt.training import precision

# Images up to this wide are placed side by side in rows of about
# ROW_WIDTH pixels; wider ones are convolved as they are.
MAX_IMAGE_WIDTH = 7
ROW_WIDTH = 64


class SideBySideConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D`, the same function and variables, which
    convolves images of at most MAX_IMAGE_WIDTH pixels side by side where
    that is faster: bfloat16 on a CPU with AMX, no GPU. Only a stride-1,
    "same"-padded, channels-last convolution is rearranged; any other is
    computed as Keras computes it. Saved models get Keras' own layer in its
    place (models.with_keras_layers)."""

    def convolution_op(self, inputs, kernel):
        width = inputs.shape[2]
        rearrangeable = (self.padding == "same" and self.data_format == "channels_last"
                         and tuple(self.strides) == (1, 1) and tuple(self.dilation_rate) == (1, 1)
                         and self.kernel_size[1] % 2 == 1 and None not in inputs.shape[1:])
        if not (rearrangeable and width <= MAX_IMAGE_WIDTH and _pays_side_by_side(inputs.dtype)):
            return super().convolution_op(inputs, kernel)
        return side_by_side(lambda rows: super(SideBySideConv2D, self).convolution_op(rows, kernel),
                            inputs, ROW_WIDTH // (width + 1), gap=self.kernel_size[1] // 2)


def _pays_side_by_side(dtype) -> bool:
    """Whether convolving narrow images side by side is faster here (see
    the module's docstring): in bfloat16 on AMX, without GPUs."""
    return dtype == tf.bfloat16 and _amx_without_gpus()


@functools.cache
def _amx_without_gpus() -> bool:
    return ("amx_bf16" in precision.cpu_bfloat16_instructions()
            and not tf.config.list_physical_devices("GPU"))


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
