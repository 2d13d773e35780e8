"""Batch normalization that trains in one fused kernel where it can.

Keras 3's `BatchNormalization` casts a bfloat16 activation to float32 and
normalizes it in several elementwise passes, forward and backward; on a CPU
those passes, not the convolutions, bound a small CNN's step. TensorFlow's
`FusedBatchNormV3` does the same arithmetic in one pass each way. It cannot
all-reduce its statistics, so the layer uses it only when the batch is the
global one (one replica in sync); with more, Keras' synchronized path keeps N
replicas training like one. Measured in docs/performance.md.
"""

import keras
import tensorflow as tf


class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization`, the same function and variables,
    trained by `FusedBatchNormV3` when one replica sees the global batch
    (and the input is NHWC, channels last, unmasked). Saved models get
    Keras' own layer in its place (models.with_keras_layers)."""

    def call(self, inputs, training=None, mask=None):
        replicas = tf.distribute.get_replica_context()  # None in a cross-replica context
        fusable = (training and self.trainable and mask is None and not self.renorm
                   and len(inputs.shape) == 4 and self.axis in (-1, 3)
                   and replicas is not None and replicas.num_replicas_in_sync == 1)
        if not fusable:
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        ones, zeros = tf.ones([channels], tf.float32), tf.zeros([channels], tf.float32)
        empty = tf.constant([], tf.float32)
        outputs, mean, variance, *_ = tf.raw_ops.FusedBatchNormV3(
            x=inputs, scale=tf.cast(self.gamma, tf.float32) if self.scale else ones,
            offset=tf.cast(self.beta, tf.float32) if self.center else zeros,
            mean=empty, variance=empty, epsilon=self.epsilon, is_training=True)
        # The kernel returns the unbiased (n - 1) variance, for its own moving
        # average; Keras' moving variance, which inference uses, is biased.
        count = tf.cast(tf.size(inputs) // channels, tf.float32)
        variance *= (count - 1.0) / count
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(outputs, self.compute_dtype)

