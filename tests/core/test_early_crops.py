"""--early_crop_size and --early_crop_epochs: the first epochs train on
smaller crops (fewer FLOPs a step), the rest on whole images. The crops'
arithmetic is test_pipeline.py's; here, the run around them: where the
phases meet, that the loop's promises hold across the change of size (N
replicas = 1 replica, a step-exact resume), and the refusals."""

import json

import numpy as np
import pytest

from conftest import (RECORD, assert_ok, assert_one_error_line, assert_same_weights,
                      read_summary, train, weights_of_one_and_two_replicas,
                      weights_of_whole_and_resumed)

from distributed_mpt.config import TrainConfig
from distributed_mpt.errors import ConfigError
from distributed_mpt.training.plan import plan_run


@pytest.mark.parametrize("epochs, total, expected", [
    (0.0, 40, 0), (1.0, 40, 8), (2.3, 40, 18), (2.32, 40, 19), (9.0, 40, 40)])
def test_the_early_phase_ends_at_the_nearest_step_and_whole_images_follow(epochs, total,
                                                                          expected):
    flags = dict(model_dir="/tmp/x", dataset="synthetic", synthetic_examples=256,
                 per_replica_batch_size=16, train_steps=total)
    if epochs:
        flags.update(early_crop_size=24, early_crop_epochs=epochs)
    plan = plan_run(TrainConfig.from_flags(**flags), num_replicas=2, num_workers=1,
                    num_train_examples=256)
    assert plan.steps_per_epoch == 8 and plan.early_crop_steps == expected
    phases, step = [], 0
    while step < total:
        end, size = plan.input_phase(step)
        phases.append((step, end, size))
        step = end
    assert phases == [p for p in [(0, expected, 24), (expected, total, None)] if p[0] < p[1]]


@pytest.mark.parametrize("flags, fragment", [
    (dict(early_crop_size=24), "go together"),
    (dict(early_crop_epochs=2.0), "go together"),
    (dict(early_crop_size=-1, early_crop_epochs=2.0), "must be >= 0"),
])
def test_an_early_crop_half_given_is_refused(flags, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig.from_flags(model_dir="/tmp/x", **flags)


def test_the_run_trains_on_crops_then_on_whole_images(tmp_path):
    # 2 epochs of 24-pixel crops, then whole images: the same model takes both.
    result = train([*RECORD, "--train_steps=24", "--early_crop_size=24",
                    "--early_crop_epochs=2", "--steps_per_loop=5", "--log_every_steps=4",
                    f"--model_dir={tmp_path}"])
    assert_ok(result)
    summary = read_summary(tmp_path)
    assert summary["steps"] == 24 and np.isfinite(summary["train_loss"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 16 in {r["step"] for r in records if "loss" in r}, "no loop call spans the change"
    config = json.loads((tmp_path / "config.json").read_text())
    assert "early_crop_size" in json.dumps(config), "recorded: a resume must not change it"


@pytest.mark.slow
def test_two_replicas_match_one_across_the_change_of_size(tmp_path):
    # Steps 1-2 on crops, 3-4 on whole images; the second run keeps the
    # split on its devices, where the crops are cut in the step.
    common = [*RECORD, "--train_steps=4", "--early_crop_size=20", "--early_crop_epochs=0.25",
              "--noevaluate"]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path,
                                                      two_only=["--data_on_device"])
    # Muon lifts float32 round-off (test_airbench94.py's bound).
    assert_same_weights(mirrored, single, rtol=1e-4, atol=2e-4)


@pytest.mark.slow
def test_a_run_resumed_on_crops_ends_as_an_uninterrupted_one(tmp_path):
    # Stopped early in the 36 steps of crops, resumed on them, then whole images.
    common = [*RECORD, "--train_steps=40", "--early_crop_size=24", "--early_crop_epochs=4.5",
              "--noevaluate", "--steps_per_loop=4"]
    expected, resumed = weights_of_whole_and_resumed(common, tmp_path, steps=40)
    assert read_summary(tmp_path / "stopped")["resumed_from_step"] < 36, "resumed before the change"
    assert_same_weights(resumed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, fragment", [
    (["--model=mlp", "--optimizer=sgd", "--early_crop_size=24", "--early_crop_epochs=1"],
     "--model=mlp cannot train on crops of 24x24 pixels"),
    (["--model=airbench", "--early_crop_size=32", "--early_crop_epochs=1"],
     "--early_crop_size=32 must be smaller than the 32x32 images"),
])
def test_crops_a_model_cannot_take_are_one_error_line(tmp_path, flags, fragment):
    result = train(["--dataset=synthetic", "--synthetic_examples=256", "--model_width=8",
                    "--precision=float32", "--train_steps=2", *flags,
                    f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, fragment)
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training"


def test_crops_of_images_that_are_not_square_are_refused():
    # A dataset a user adds may have them; the crops' corners are drawn for
    # square images (train_input_fn).
    import keras

    from distributed_mpt.core import models

    images = keras.Input((32, 48, 3), dtype="uint8")
    pooled = keras.layers.GlobalAveragePooling2D()(keras.layers.Rescaling(1 / 255)(images))
    model = keras.Model(images, keras.layers.Dense(10)(pooled))
    with pytest.raises(ConfigError, match="needs square images, and these are 32x48"):
        models.take_crops(model, 24, (32, 48, 3), "mine")
    models.take_crops(model, 24, (32, 32, 3), "mine")  # the same model on square images
