"""predict on many images, on a model of more classes than CIFAR-10's, and on
the paths a careless shell line gives it."""

import dataclasses

import numpy as np
import pytest
from PIL import Image

from conftest import assert_ok, assert_one_error_line, run_in_process
from distributed_mpt import predict as predict_module
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
from distributed_mpt.training import outputs


def _export(directory, classes: int = 10):
    """An export of a tiny airbench that predicts `classes` classes."""
    info = dataclasses.replace(cifar10.INFO, class_names=tuple(f"c{i}" for i in range(classes)))
    model = models.build_model(models.model_spec("airbench"), info, width=4)
    outputs.export_model(model, str(directory), info.class_names, info.image_shape,
                         {"model": "airbench", "model_width": 4, "dataset": "cifar10", "seed": 0,
                          "steps": 1})
    return directory


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("run"))


def predict(*args):
    return run_in_process(predict_module.main, [str(a) for a in args])


def _photos(directory, count: int, side: int = 40) -> list:
    rng = np.random.default_rng(0)
    paths = [directory / f"{i}.png" for i in range(count)]
    for path in paths:
        Image.fromarray(rng.integers(0, 256, (side, side, 3), np.uint8)).save(path)
    return paths


def test_top_k_goes_up_to_the_models_classes_and_no_further(tmp_path):
    """--top_k stopped at 10, CIFAR-10's classes, for a model of an image
    folder of more; above a model's classes it printed fewer, without a word."""
    export = _export(tmp_path / "run", classes=12)
    photo = _photos(tmp_path, 1)[0]
    result = predict(f"--model_dir={export}", "--top_k=12", photo)
    assert_ok(result)
    assert result.stdout.count(" 0.") == 12, result.stdout
    assert_one_error_line(predict(f"--model_dir={export}", "--top_k=13", photo),
                          f"--top_k=13 is more than the 12 classes "
                          f"{export / 'export' / 'saved_model'} predicts: give at most 12")
