"""The user's own labelled images, one folder per class
(`--dataset=image_folder --data_dir=DIR`): trained as CIFAR-10 is, every
test image evaluated once across replicas, the folders' class names in the
export and in predict's answers; a damaged or foreign file refused by name
before any training."""

import json

import numpy as np
import pytest
from PIL import Image

from conftest import SMALL_MODEL, assert_ok, assert_one_error_line, read_summary, run_in_process, train

CLASSES = ("cars", "dogs", "ships")  # sorted: labels 0, 1, 2
COLOURS = {"cars": (220, 40, 40), "dogs": (40, 200, 60), "ships": (30, 60, 220)}


def _photo(path, colour, rng, size=(30, 40)):
    """A photo of another size than the model takes: a class colour and noise."""
    noise = rng.integers(-60, 60, (*size, 3))
    Image.fromarray(np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)).save(path)


def write_folder(root, train_per_class=24, test_per_class=6, test=True, extension="png"):
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("test", test_per_class if test else 0)):
        for name in CLASSES:
            if count:
                (root / split / name).mkdir(parents=True)
            for i in range(count):
                _photo(root / split / name / f"{i:03d}.{extension}", COLOURS[name], rng)
    return root


FLAGS = ["--dataset=image_folder", "--image_size=16", *SMALL_MODEL, "--precision=float32",
         "--per_replica_batch_size=12", "--warmup_epochs=0", "--weight_decay=0",
         "--label_smoothing=0", "--train_steps=24", "--steps_per_loop=6"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"))


def test_an_image_folder_trains_and_predict_names_its_classes(folder, tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]))
    summary = read_summary(run)
    assert summary["dataset"] == "image_folder" and summary["eval_examples"] == 18
    assert summary["eval_accuracy"] > 0.6, "three colours are learnable in 24 steps"
    assert (run / "export" / "classes.txt").read_text().splitlines() == list(CLASSES)
    info = json.loads((run / "export" / "model_info.json").read_text())
    assert info["image_size"] == 16

    from distributed_mpt.predict import main
    photo = folder / "test" / "ships" / "000.png"
    result = run_in_process(main, [f"--model_dir={run}", str(photo)])
    assert_ok(result)
    assert result.stdout.startswith(f"{photo}: ") and result.stdout.split()[1] in CLASSES
    evaluated = run_in_process(main, [f"--model_dir={run}", "--evaluate", f"--data_dir={folder}"])
    assert_ok(evaluated)
    assert "image_folder test:" in evaluated.stdout and "(18 images)" in evaluated.stdout


@pytest.mark.slow
def test_two_replicas_evaluate_every_test_image_once(folder, tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--data_dir={folder}", "--strategy=mirrored", "--cpu_replicas=2",
                     "--per_replica_batch_size=6", "--noexport", f"--model_dir={run}"]))
    summary = read_summary(run)
    assert (summary["num_replicas"], summary["eval_examples"]) == (2, 18)


def test_a_folder_without_test_holds_out_a_stated_fraction(tmp_path):
    folder = write_folder(tmp_path / "photos", test=False)
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]),
                          "has no test/ folder")
    assert not run.exists()
    assert_ok(train([*FLAGS, f"--data_dir={folder}", "--test_fraction=0.25", "--noexport",
                     f"--model_dir={run}"]))
    assert read_summary(run)["eval_examples"] == 3 * 6, "a quarter of each class's 24"


def _damaged(root):
    path = root / "train" / "dogs" / "007.png"
    path.write_bytes(path.read_bytes()[:60])
    return "007.png begins as a PNG image does but does not decode"


def _not_an_image(root):
    (root / "train" / "cars" / "notes.txt").write_text("taken in May\n")
    return "notes.txt is not an image file"


def _unknown_class(root):
    (root / "test" / "cats").mkdir()
    return "test has class folder(s) cats that"


@pytest.mark.parametrize("spoil", [_damaged, _not_an_image, _unknown_class])
def test_a_bad_folder_is_one_error_line_naming_it_before_training(tmp_path, spoil):
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    fragment = spoil(folder)
    (folder / "train" / "cars" / ".DS_Store").write_bytes(b"\x00\x01")  # skipped: a dot file
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]), fragment)
    assert not run.exists(), "nothing written"
