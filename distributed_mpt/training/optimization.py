"""The optimizer and how its learning rate follows the global batch.

The learning rate scales linearly with the global batch (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"), warms up linearly, and then decays: by a
cosine to zero, or linearly to a floor as airbench94 does.
"""

import keras
import tensorflow as tf

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


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int,
                           kind: str = "cosine"):
    """The learning rate of each step, of `kind` (see config.LR_SCHEDULES):

    cosine: linear warmup from 0 to `peak` over `warmup_steps`, then cosine
    decay to 0. linear: the same warmup, then linearly to 0.
    piecewise_linear: from 0.2 x `peak` to `peak` over `warmup_steps`, then
    linearly to 0.07 x `peak` at the last step.

    The warmup takes at most half of the run, so that a short run (a smoke
    test, --train_steps) still decays instead of ending at its peak.
    """
    warmup_steps = min(warmup_steps, total_steps // 2)
    if kind == "piecewise_linear":
        return PiecewiseLinear(peak, total_steps, warmup_steps)
    if kind == "linear":
        return PiecewiseLinear(peak, total_steps, warmup_steps, start=0.0, end=0.0)
    decay_steps = max(total_steps - warmup_steps, 1)
    if warmup_steps == 0:
        return keras.optimizers.schedules.CosineDecay(peak, decay_steps)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps, warmup_target=peak, warmup_steps=warmup_steps)


class PiecewiseLinear(keras.optimizers.schedules.LearningRateSchedule):
    """A linear rise from `start` x peak to the peak over `warmup_steps`, then
    a linear fall to `end` x peak at `total_steps`; airbench94's by default."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int, start: float = 0.2,
                 end: float = 0.07):
        self.peak, self.total_steps, self.warmup_steps = peak, total_steps, warmup_steps
        self.start, self.end = start, end

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        rising = self.start + (1 - self.start) * step / max(self.warmup_steps, 1)
        falling = 1 - (1 - self.end) * (step - self.warmup_steps) / max(
            self.total_steps - self.warmup_steps, 1)
        return self.peak * keras.ops.where(step < self.warmup_steps, rising, falling)

    def get_config(self):
        return {"peak": self.peak, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "start": self.start, "end": self.end}


def make_optimizer(learning_rate, momentum: float, loss_scaling: bool, muon_variables=(),
                   muon_rate_ratio: float = 0.0, muon_momentum: float = 0.0
                   ) -> keras.optimizers.Optimizer:
    """SGD with Nesterov momentum, and Muon for `muon_variables` if any (see
    `SGDWithMuon`); wrapped for dynamic loss scaling if asked (needed under
    mixed_float16, where small gradients underflow)."""
    if muon_variables:
        optimizer = SGDWithMuon(learning_rate, momentum, muon_variables, muon_rate_ratio,
                                muon_momentum)
    else:
        optimizer = keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum,
                                         nesterov=True)
    if loss_scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


class SGDWithMuon(keras.optimizers.SGD):
    """SGD with Nesterov momentum for most variables, and Muon for
    `muon_variables` (convolution filters), as airbench94_muon trains them.

    Muon (K. Jordan et al., 2024), as that reference has it: Nesterov
    momentum (`muon_momentum`, added to the raw gradient), the filter
    renormalized to a Frobenius norm of sqrt(output channels) before each
    step, and a step along the momentum orthogonalized by `orthogonalize`.
    Its learning rate follows SGD's schedule, `muon_rate_ratio` times SGD's
    at every step. One optimizer, so that checkpoints, loss scaling and every
    strategy treat it as they treat SGD.
    """

    def __init__(self, learning_rate, momentum: float, muon_variables, muon_rate_ratio: float,
                 muon_momentum: float, name="sgd_with_muon"):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=True, name=name)
        self._muon_keys = {id(v) for v in muon_variables}
        self.muon_rate_ratio, self.muon_momentum = muon_rate_ratio, muon_momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._muon_indices = {i for i, v in enumerate(variables) if id(v) in self._muon_keys}

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        if index not in self._muon_indices:
            return super().update_step(gradient, variable, learning_rate)
        momentum = self.momentums[index]  # Muon's own kind: the sum of past gradients
        gradient = tf.cast(gradient, variable.dtype)
        self.assign(momentum, self.muon_momentum * momentum + gradient)
        direction = gradient + self.muon_momentum * momentum  # Nesterov
        channels = variable.shape[-1]
        rate = self.muon_rate_ratio * tf.cast(learning_rate, variable.dtype)
        step = tf.reshape(orthogonalize(tf.reshape(direction, [-1, channels])), variable.shape)
        weights = tf.convert_to_tensor(variable)
        self.assign(variable, weights * (channels ** 0.5 / tf.norm(weights)) - rate * step)


# airbench94_muon's quintic Newton-Schulz coefficients: chosen to maximize the
# slope at 0, so that 3 steps suffice; singular values end near 1 (roughly
# 0.5-1.5), which trains as well as an exact orthogonalization.
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix: tf.Tensor, steps: int = 3) -> tf.Tensor:
    """`matrix` with its singular values moved near 1 by `steps` Newton-Schulz
    iterations (U S V^T -> about U V^T): Muon's update. In float32, where the
    reference uses bfloat16 for a GPU's speed: here the iteration costs a
    fraction of a percent of a step, and bfloat16's rounding of it would
    differ with the split of the batch, so N replicas would not train like
    one."""
    a, b, c = _NEWTON_SCHULZ
    x = tf.cast(matrix, tf.float32)
    x = x / (tf.norm(x) + 1e-7)  # singular values <= 1
    tall = matrix.shape[0] > matrix.shape[1]
    if tall:
        x = tf.transpose(x)  # the smaller Gram matrix
    for _ in range(steps):
        gram = tf.matmul(x, x, transpose_b=True)
        x = a * x + tf.matmul(b * gram + c * tf.matmul(gram, gram), x)
    if tall:
        x = tf.transpose(x)
    return tf.cast(x, matrix.dtype)


class Lookahead:
    """airbench94's lookahead: every EVERY_STEPS steps, an exponential moving
    average of the weights takes a step toward them and the weights are set
    to it; after the last step the weights are the average.

    The decay, BASE_DECAY x (step / total_steps)^3, is near 0 early (the
    average follows the weights) and grows as the learning rate falls, so
    the end of the run is averaged over ever more steps. Batch-norm
    statistics are averaged with the weights, as airbench averages the whole
    state dict. Create it in the strategy's scope after the model's weights
    are initialized; `state` (the averages) belongs in the checkpoint.
    """

    EVERY_STEPS = 5
    BASE_DECAY = 0.95 ** 5

    def __init__(self, model: keras.Model, total_steps: int):
        self._weights = [w for w in model.weights if "float" in str(w.dtype)]
        self._total_steps = total_steps
        self.state = tf.Module(name="lookahead")
        self.state.averages = [tf.Variable(tf.convert_to_tensor(w), trainable=False,
                                           name="lookahead_average") for w in self._weights]

    def after_step(self, step: tf.Tensor) -> None:
        """Updates after optimizer step number `step` (1-based); call in
        cross-replica context, inside the compiled loop."""
        if step % self.EVERY_STEPS == 0:
            fraction = tf.cast(step, tf.float32) / self._total_steps
            keep = self.BASE_DECAY * fraction ** 3
            for average, weight in zip(self.state.averages, self._weights):
                average.assign(keep * average + (1 - keep) * tf.convert_to_tensor(weight))
                weight.assign(average)
        if step == self._total_steps:
            for average, weight in zip(self.state.averages, self._weights):
                weight.assign(average)
