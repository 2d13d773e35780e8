"""predict on many images, on a model of more classes than CIFAR-10's, and on
the paths a careless shell line gives it."""

import dataclasses

import numpy as np
import pytest
from PIL import Image

from conftest import assert_ok, assert_one_error_line, run_in_process
from distributed_mpt import predict as predict_module
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10, images
from distributed_mpt.training import outputs


def _export(directory, classes: int = 10):
    """An export of a tiny airbench that predicts `classes` classes."""
    info = dataclasses.replace(cifar10.INFO, class_names=tuple(f"c{i}" for i in range(classes)))
    model = models.build_model(models.model_spec("airbench"), info, width=4)
    directory.mkdir(parents=True, exist_ok=True)  # a run's: the export makes none
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


def test_each_image_is_decoded_once_and_classified_a_batch_at_a_time(export, tmp_path,
                                                                      monkeypatch):
    """Every image was decoded twice (checked before the model loads, then
    read again), and all were stacked in memory at once to be classified."""
    photos = _photos(tmp_path, 7)
    decoded, batches = [], []
    read_image, load = images.read_image, predict_module.load_classifier

    def counted(path, size=None):
        decoded.append(str(path))
        return read_image(path, size)

    def watched(*load_args):
        classifier = load(*load_args)

        def probabilities(x):
            batches.append(len(x))
            return classifier.probabilities(x)
        return dataclasses.replace(classifier, probabilities=probabilities)

    monkeypatch.setattr(images, "read_image", counted)
    assert_ok(predict(f"--model_dir={export}", *photos))
    assert sorted(decoded) == sorted(map(str, photos))

    args = ["--tta=flip_translate", "--tta_fraction=0.5", "--top_k=3", f"--model_dir={export}"]
    whole = predict(*args, *photos)  # in one batch
    assert_ok(whole)
    monkeypatch.setattr(predict_module, "load_classifier", watched)
    monkeypatch.setattr(predict_module, "_BATCH", 2)
    # Three images' pixels kept from the check (40 x 40 x 3 each), the others decoded again.
    monkeypatch.setattr(predict_module, "_KEPT_BYTES", 3 * 40 * 40 * 3)
    in_batches = predict(*args, *photos)
    assert_ok(in_batches)
    # The least confident half of all 7 augmented, not of each batch.
    assert in_batches.stdout == whole.stdout and len(whole.stdout.splitlines()) == 7
    assert max(batches) <= 2, batches


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


@pytest.mark.parametrize("path, said", [
    ("", "a path given is empty (an unset shell variable?): give image files"),
    ("-", "- names no file: predict reads no standard input; give image files"),
    ("{}/*.jpg", "{}/*.jpg names no file: a pattern that matched none, which the shell passes "
                 "on as it is; give image files"),
], ids=["empty", "dash", "unmatched glob"])
def test_a_path_that_names_no_file_says_what_it_was_likely_meant_as(export, tmp_path, path,
                                                                    said):
    """`predict "$PHOTO"` with PHOTO unset said "cannot read  (No such file
    or directory)", naming nothing; a glob that matched nothing, or `-`,
    was called a missing file."""
    photo = _photos(tmp_path, 1)[0]
    result = predict(f"--model_dir={export}", photo, path.format(tmp_path))
    assert_one_error_line(result, said.format(tmp_path))
    assert result.stdout == ""
