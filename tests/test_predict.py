"""Using a trained model: the export's serving signature, and the real
`distributed_mpt.predict` entry point run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import SMOKE_FLAGS, assert_ok, run_in_process, run_module, subprocess_env, train
from distributed_mpt import outputs
from distributed_mpt.models import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A run directory holding an untrained tiny resnet9's export: the
    signature and the command do not depend on what the model learned."""
    directory = tmp_path_factory.mktemp("run")
    outputs.export_model(build_model("resnet9", width=4), str(directory))
    return directory


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """A PNG of another size than CIFAR-10's, as a user's photo would be."""
    path = tmp_path_factory.mktemp("images") / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def predict(*args):
    """The real predict entry point, in this process (TensorFlow's start-up
    paid once); the test of what a person sees runs it as a process."""
    from distributed_mpt.predict import main
    return run_in_process(main, [str(a) for a in args])


def test_the_serving_signature_maps_images_to_probabilities(model_dir):
    loaded = tf.saved_model.load(str(model_dir / "export" / "saved_model"))
    serve = loaded.signatures["serving_default"]
    _, inputs = serve.structured_input_signature
    assert list(inputs) == ["images"] and inputs["images"].dtype == tf.uint8
    assert inputs["images"].shape.as_list() == [None, 32, 32, 3]
    assert list(serve.structured_outputs) == ["probabilities"]
    images = np.random.default_rng(1).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    probabilities = serve(images=tf.constant(images))["probabilities"].numpy()
    assert probabilities.shape == (4, 10) and probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)
    names = [n.decode() for n in loaded.class_names[0].numpy()]
    assert names == list(outputs.CLASS_NAMES)
    assert (model_dir / "export" / "classes.txt").read_text().splitlines() == names


# Installed with TensorFlow, beside this Python (which need not be on PATH).
SAVED_MODEL_CLI = Path(sys.executable).parent / "saved_model_cli"


@pytest.mark.skipif(not SAVED_MODEL_CLI.exists(), reason="saved_model_cli not installed")
def test_saved_model_cli_shows_and_runs_the_named_signature(model_dir, tmp_path):
    saved_model = str(model_dir / "export" / "saved_model")
    np.save(tmp_path / "images.npy", np.zeros((1, 32, 32, 3), np.uint8))
    shown = subprocess.run([SAVED_MODEL_CLI, "show", "--dir", saved_model, "--all"],
                           capture_output=True, text=True, env=subprocess_env(), check=True)
    assert "inputs['images']" in shown.stdout and "DT_UINT8" in shown.stdout
    assert "outputs['probabilities']" in shown.stdout
    ran = subprocess.run([SAVED_MODEL_CLI, "run", "--dir", saved_model, "--tag_set", "serve",
                          "--signature_def", "serving_default",
                          "--inputs", f"images={tmp_path / 'images.npy'}"],
                         capture_output=True, text=True, env=subprocess_env(), check=True)
    assert "Result for output key probabilities" in ran.stdout


def test_classifies_an_image_file_into_a_named_class(model_dir, photo):
    result = run_module("distributed_mpt.predict", [f"--model_dir={model_dir}", str(photo)])
    assert_ok(result)
    path, answer = result.stdout.strip().rsplit(": ", 1)
    name, probability = answer.split()
    assert path == str(photo) and name in outputs.CLASS_NAMES and 0 < float(probability) <= 1


def test_top_k_as_json_from_the_export_directory(model_dir, photo):
    result = predict(f"--model_dir={model_dir / 'export'}", "--top_k=3", "--json", photo)
    assert_ok(result)
    top = json.loads(result.stdout)["predictions"][0]["top"]
    assert len(top) == 3 and {t["class"] for t in top} <= set(outputs.CLASS_NAMES)
    assert [t["probability"] for t in top] == sorted((t["probability"] for t in top), reverse=True)


def test_evaluate_prints_the_accuracy_on_every_test_image(model_dir):
    result = predict(f"--model_dir={model_dir}", "--evaluate", "--dataset=synthetic",
                     "--synthetic_examples=500")
    assert_ok(result)
    assert "accuracy" in result.stdout and "(100 images)" in result.stdout


def test_a_run_without_export_is_evaluated_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=20", f"--model_dir={run}"]))  # --noexport
    result = predict(f"--model_dir={run}", "--evaluate", "--dataset=synthetic", "--json",
                     "--synthetic_examples=1024")
    assert_ok(result)
    assert json.loads(result.stdout)["evaluation"]["accuracy"] > 0.5, "synthetic labels are learnable"


@pytest.mark.parametrize("problem, message", [
    ("not_an_image", "is not a PNG, JPEG"), ("missing_image", "cannot read"),
    ("missing_export", "holds no export")])
def test_bad_input_is_one_error_line_and_exit_2(model_dir, photo, tmp_path, problem, message):
    text_file = tmp_path / "notes.png"
    text_file.write_text("not pixels")
    args = {"not_an_image": [f"--model_dir={model_dir}", text_file],
            "missing_image": [f"--model_dir={model_dir}", tmp_path / "absent.png"],
            "missing_export": [f"--model_dir={tmp_path}", photo]}[problem]
    result = predict(*args)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert "Traceback" not in result.stderr
