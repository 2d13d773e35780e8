"""Learning-rate scaling and schedule, the optimizer and its one step
counter, and the run plan."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distributed_mpt.config import TrainConfig
from distributed_mpt.core.optim import schedules
from distributed_mpt.core.optim.groups import ParameterGroup
from distributed_mpt.core.optim.optimizer import GroupedOptimizer, make_optimizer
from distributed_mpt.core.optim.rules import Muon, NesterovSGD
from distributed_mpt.errors import ConfigError
from distributed_mpt.training.plan import plan_run


def test_learning_rate_scales_linearly_with_the_global_batch():
    assert schedules.scaled_learning_rate(0.1, schedules.REFERENCE_BATCH_SIZE) == pytest.approx(0.1)
    assert schedules.scaled_learning_rate(0.1, 1024) == pytest.approx(0.8)
    assert schedules.scaled_learning_rate(0.1, 1024, ceiling=0.5) == pytest.approx(0.5)


def test_schedule_warms_up_then_decays_to_zero():
    schedule = schedules.learning_rate_schedule(peak=0.8, total_steps=100, warmup_steps=10)
    values = [float(schedule(step)) for step in range(101)]
    assert values[0] == pytest.approx(0.0)
    assert values[5] == pytest.approx(0.4, rel=1e-5)
    assert max(values) == pytest.approx(0.8, rel=1e-5) and values.index(max(values)) == 10
    assert values[100] == pytest.approx(0.0, abs=1e-6)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_no_warmup_starts_at_the_peak():
    schedule = schedules.learning_rate_schedule(peak=0.5, total_steps=10, warmup_steps=0)
    assert float(schedule(0)) == pytest.approx(0.5)


def _one_variable_groups(momentum=0.9):
    kernel = keras.Variable(np.ones((2, 2)), dtype="float32")
    return kernel, [ParameterGroup("kernels", (kernel,), NesterovSGD(momentum))]


def test_loss_scaling_wraps_the_optimizer():
    step = tf.Variable(0, dtype=tf.int64)
    _, groups = _one_variable_groups()
    scaled = make_optimizer(groups, lambda s: 0.1, step, loss_scaling=True)
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)
    assert isinstance(scaled.inner_optimizer, GroupedOptimizer)
    _, groups = _one_variable_groups()
    plain = make_optimizer(groups, lambda s: 0.1, step, loss_scaling=False)
    assert isinstance(plain, GroupedOptimizer)
    rule = plain.groups[0].rule
    assert isinstance(rule, NesterovSGD) and rule.momentum == 0.9 and rule.form == "keras"


def test_the_rate_follows_the_runs_step_counter_not_the_optimizers():
    """Keras' LossScaleOptimizer does not count a skipped step in the inner
    optimizer's iterations: the schedule reads the run's counter instead."""
    step = tf.Variable(0, dtype=tf.int64)
    schedule = schedules.learning_rate_schedule(peak=1.0, total_steps=10, warmup_steps=0,
                                                kind="linear")
    kernel, groups = _one_variable_groups(momentum=0.0)
    optimizer = make_optimizer(groups, schedule, step, loss_scaling=True)
    inner = optimizer.inner_optimizer
    step.assign(4)
    assert float(inner.learning_rate) == pytest.approx(0.6)
    optimizer.apply_gradients([(tf.fill([2, 2], np.inf), kernel)])  # skipped: not finite
    np.testing.assert_array_equal(kernel.numpy(), np.ones((2, 2)))
    assert int(inner.iterations.numpy()) == 0
    step.assign(5)  # the run counts every step, applied or skipped
    optimizer.apply_gradients([(tf.ones([2, 2]) * optimizer.dynamic_scale, kernel)])
    np.testing.assert_allclose(kernel.numpy(), np.full((2, 2), 1 - 0.5), rtol=1e-6,
                               err_msg="the rate of step 5")


@pytest.mark.parametrize("gradient", [0.0, 1.0])
def test_muon_steps_a_zero_filter_to_finite_weights(gradient):
    """A filter that starts at zero has no norm to be scaled back to: every
    weight became NaN (0 x inf), and the run said to lower the rate."""
    filters = keras.Variable(np.zeros((3, 3, 2, 4)), dtype="float32")
    step = tf.Variable(0, dtype=tf.int64)
    optimizer = GroupedOptimizer([ParameterGroup("filters", (filters,), Muon(0.6), rate=0.2)],
                                 lambda s: 0.1, step)
    optimizer.apply_gradients([(tf.fill(filters.shape, gradient), filters)])
    weights = filters.numpy()
    assert np.all(np.isfinite(weights))
    assert np.any(weights != 0) == bool(gradient), "a step only where there is a gradient"


def test_a_variable_in_no_group_is_refused():
    kernel, groups = _one_variable_groups()
    stray = keras.Variable(np.ones(3), dtype="float32")
    optimizer = GroupedOptimizer(groups, lambda s: 0.1, tf.Variable(0, dtype=tf.int64))
    with pytest.raises(ValueError, match="in no parameter group"):
        optimizer.build([kernel, stray])


def test_plan_scales_batch_and_rate_with_replicas(tmp_path):
    config = TrainConfig.from_flags(model_dir=str(tmp_path), per_replica_batch_size=64, learning_rate=0.1,
                         epochs=2, warmup_epochs=0.5, precision="float32")
    plan = plan_run(config, num_replicas=4, num_workers=2, num_train_examples=50_000)
    assert plan.global_batch_size == 256
    assert plan.learning_rate == pytest.approx(0.2)
    assert plan.steps_per_epoch == 50_000 // 256 and plan.total_steps == 2 * (50_000 // 256)
    assert plan.warmup_steps == round(0.5 * (50_000 // 256))
    assert plan_run(TrainConfig.from_flags(model_dir="x", train_steps=7, precision="float32"), 1, 1, 1000).total_steps == 7


def test_plan_refuses_a_batch_larger_than_the_data():
    with pytest.raises(ConfigError, match="exceeds"):
        plan_run(TrainConfig.from_flags(model_dir="x", per_replica_batch_size=512), 4, 1, 1000)


def test_a_run_shorter_than_its_warmup_still_decays():
    schedule = schedules.learning_rate_schedule(peak=0.4, total_steps=10, warmup_steps=100)
    values = [float(schedule(step)) for step in range(11)]
    assert values.index(max(values)) == 5 and values[10] == pytest.approx(0.0, abs=1e-6)
