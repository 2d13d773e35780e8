"""One Keras optimizer that trains every parameter group by its own rule,
rate and decay, with the learning rate read from the run's one step
counter.

One optimizer, so that checkpoints, loss scaling and every tf.distribute
strategy treat all groups alike. Its rate is `schedule(step)`, where `step`
is the run's step variable, which counts every step taken, applied or
skipped: Keras' LossScaleOptimizer does not advance the inner optimizer's
`iterations` on a skipped (non-finite) step, so a schedule read from them
would lag the lookahead, the whitening bias and the step totals by one per
skipped step.
"""

from typing import List

import keras
import tensorflow as tf

from distributed_mpt.core.optim.groups import ParameterGroup


class GroupedOptimizer(keras.optimizers.Optimizer):
    """Applies each `groups` rule to its variables at `schedule(step)` times
    its rate (or its own schedule); build it with the model's trainable
    variables, every one of which must be in a group."""

    def __init__(self, groups: List[ParameterGroup], schedule, step: tf.Variable,
                 name: str = "grouped"):
        super().__init__(learning_rate=lambda: schedule(step), name=name)
        self.groups, self._step = list(groups), step
        self._slot_names = sorted({slot for g in self.groups for slot in g.rule.slots})

    @property
    def step(self) -> tf.Variable:
        """The run's step variable (read-only: the training loop advances
        it), for rules whose arithmetic depends on the step."""
        return self._step

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        of = {id(v): group for group in self.groups for v in group.variables}
        missing = [v.path for v in variables if id(v) not in of]
        if missing:
            raise ValueError(f"variables in no parameter group: {', '.join(missing[:5])}")
        self._group_of_index = [of[id(v)] for v in variables]
        # `momentums` for the momentum slot (as Keras' SGD names it), a list
        # per other slot name; one per variable, in the variables' order.
        for slot in self._slot_names:
            setattr(self, f"{slot}s", [self.add_variable_from_reference(v, slot)
                                       for v in variables])

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        group = self._group_of_index[index]
        slots = {slot: getattr(self, f"{slot}s")[index] for slot in group.rule.slots}
        gradient = tf.cast(gradient, variable.dtype)
        if group.weight_decay:
            gradient += 2 * group.weight_decay * tf.convert_to_tensor(variable)
        rate = group.schedule(self._step) if group.schedule else group.rate * learning_rate
        rate = tf.cast(rate, variable.dtype)
        if group.train_steps is None:
            return group.rule.update(self, variable, gradient, rate, slots)
        training = self._step < group.train_steps
        if group.freeze == "coast":  # the gradient zeroed, the momentum runs out
            gradient *= tf.cast(training, gradient.dtype)
            return group.rule.update(self, variable, gradient, rate, slots)

        def update():
            group.rule.update(self, variable, gradient, rate, slots)
            return tf.constant(True)

        tf.cond(training, update, lambda: tf.constant(False))

    def get_config(self):
        # The groups hold variables, not settings: a grouped optimizer is
        # rebuilt from the run's flags, never from a saved config.
        return {**super().get_config(), "learning_rate": 0.0}


def make_optimizer(groups: List[ParameterGroup], schedule, step: tf.Variable,
                   loss_scaling: bool) -> keras.optimizers.Optimizer:
    """The grouped optimizer, wrapped for dynamic loss scaling if asked
    (needed under mixed_float16, where small gradients underflow)."""
    optimizer = GroupedOptimizer(groups, schedule, step)
    return keras.optimizers.LossScaleOptimizer(optimizer) if loss_scaling else optimizer
