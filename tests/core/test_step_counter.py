"""One step counter: under mixed_float16, Keras' LossScaleOptimizer skips a
step whose gradients overflow without advancing its inner optimizer's
`iterations`; the run's schedule, lookahead and totals must follow the
steps taken all the same (core/optim/optimizer.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import group_settings

from distributed_mpt.core import data, pipeline
from distributed_mpt.core.optim.groups import parameter_groups
from distributed_mpt.core.optim.lookahead import Lookahead
from distributed_mpt.core.optim.optimizer import GroupedOptimizer
from distributed_mpt.core.optim.schedules import learning_rate_schedule
from distributed_mpt.core.steps import StepRules, Trainer

STEPS = 30  # a multiple of the lookahead's 5


def _tiny_model(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def test_skipped_steps_leave_one_counter_for_the_schedule_and_the_lookahead():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        dataset = data.DataOptions("synthetic", synthetic_examples=512).load(seed=0)
        strategy = tf.distribute.get_strategy()
        model = _tiny_model(dataset.info)
        step = tf.Variable(0, dtype=tf.int64)
        schedule = learning_rate_schedule(0.1, STEPS, 0, "linear")
        groups = parameter_groups(model, group_settings(0.1, weight_decay=0.0, momentum=0.9))
        # A loss scale far too large: float16 gradients overflow, the step is
        # skipped and the scale halves, until it fits.
        optimizer = keras.optimizers.LossScaleOptimizer(
            GroupedOptimizer(groups, schedule, step), initial_scale=2.0 ** 30)
        optimizer.build(model.trainable_variables)
        lookahead = Lookahead(model, STEPS)
        trainer = Trainer(model, optimizer, strategy, step,
                          StepRules(global_batch_size=32, loss_scaling=True, lookahead=lookahead))
        iterator = iter(strategy.distribute_datasets_from_function(
            pipeline.train_input_fn(dataset.train, 32, seed=0, start_step=0, num_steps=STEPS)))
        totals = trainer.train(iterator, STEPS)
    finally:
        keras.mixed_precision.set_global_policy(previous)

    skipped = round(totals.nonfinite_steps)
    applied = int(optimizer.inner_optimizer.iterations.numpy())
    assert 0 < skipped < STEPS, "some steps were skipped, some applied"
    assert (int(step.numpy()), applied) == (STEPS, STEPS - skipped), \
        "Keras' own counter lags by the skipped steps"
    # The rate of the next step is the schedule's at the steps taken, not at
    # the steps applied (which would be the rate of an earlier step).
    assert float(optimizer.learning_rate) == pytest.approx(float(schedule(STEPS)), abs=1e-9)
    assert float(schedule(STEPS)) != pytest.approx(float(schedule(applied)))
    # The lookahead pulled the weights to its averages at step 30: the same
    # counter (after the last step they are the averages).
    print(f"{skipped} of {STEPS} steps skipped")
    for weight, average in zip(lookahead._weights, lookahead.state.averages):
        np.testing.assert_array_equal(weight.numpy(), average.numpy())
