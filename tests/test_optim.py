"""Learning-rate scaling and schedule, the optimizer, and the run plan."""

import keras
import pytest

from distributed_mpt.training import optimization
from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import ConfigError
from distributed_mpt.training.plan import plan_run


def test_learning_rate_scales_linearly_with_the_global_batch():
    assert optimization.scaled_learning_rate(0.1, optimization.REFERENCE_BATCH_SIZE) == pytest.approx(0.1)
    assert optimization.scaled_learning_rate(0.1, 1024) == pytest.approx(0.8)


def test_schedule_warms_up_then_decays_to_zero():
    schedule = optimization.learning_rate_schedule(peak=0.8, total_steps=100, warmup_steps=10)
    values = [float(schedule(step)) for step in range(101)]
    assert values[0] == pytest.approx(0.0)
    assert values[5] == pytest.approx(0.4, rel=1e-5)
    assert max(values) == pytest.approx(0.8, rel=1e-5) and values.index(max(values)) == 10
    assert values[100] == pytest.approx(0.0, abs=1e-6)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_no_warmup_starts_at_the_peak():
    schedule = optimization.learning_rate_schedule(peak=0.5, total_steps=10, warmup_steps=0)
    assert float(schedule(0)) == pytest.approx(0.5)


def test_loss_scaling_wraps_the_optimizer():
    assert isinstance(optimization.make_optimizer(0.1, 0.9, loss_scaling=True),
                      keras.optimizers.LossScaleOptimizer)
    plain = optimization.make_optimizer(0.1, 0.9, loss_scaling=False)
    assert isinstance(plain, keras.optimizers.SGD) and plain.nesterov


def test_plan_scales_batch_and_rate_with_replicas(tmp_path):
    config = TrainConfig(model_dir=str(tmp_path), per_replica_batch_size=64, learning_rate=0.1,
                         epochs=2, warmup_epochs=0.5, precision="float32")
    plan = plan_run(config, num_replicas=4, num_workers=2, num_train_examples=50_000)
    assert plan.global_batch_size == 256
    assert plan.learning_rate == pytest.approx(0.2)
    assert plan.steps_per_epoch == 50_000 // 256 and plan.total_steps == 2 * (50_000 // 256)
    assert plan.warmup_steps == round(0.5 * (50_000 // 256))
    assert plan_run(TrainConfig(model_dir="x", train_steps=7, precision="float32"), 1, 1, 1000).total_steps == 7


def test_plan_refuses_a_batch_larger_than_the_data():
    with pytest.raises(ConfigError, match="exceeds"):
        plan_run(TrainConfig(model_dir="x", per_replica_batch_size=512), 4, 1, 1000)


def test_a_run_shorter_than_its_warmup_still_decays():
    schedule = optimization.learning_rate_schedule(peak=0.4, total_steps=10, warmup_steps=100)
    values = [float(schedule(step)) for step in range(11)]
    assert values.index(max(values)) == 5 and values[10] == pytest.approx(0.0, abs=1e-6)
