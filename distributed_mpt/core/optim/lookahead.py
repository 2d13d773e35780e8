"""airbench94's lookahead: an average of the weights that the weights are
pulled to every few steps."""

import keras
import tensorflow as tf


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
