"""What an extender reads beside docs/extending.md (whose own examples
tests/product/test_extending.py runs): every file of the repository that
the extenders' pages name exists where they say, a dataset and an update
rule added as extending.md says work, and using-the-model.md's
Python samples run as written on an export."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_ok, subprocess_env, train

# The pages an extender follows: their own model, data, optimizer, the
# export, and the map of the code.
PAGES = ["README.md", "docs/extending.md", "docs/using-the-model.md", "docs/architecture.md",
         "docs/cifar10-data.md"]
# A path the pages name: from a folder of the repository, or of the package
# (core/..., training/...), as they write them; not a path inside a pod
# (/models/...) or a placeholder (core/models/NAME.py).
NAMED = re.compile(r"(?<![\w/.<-])((?:docs|tests|k8s|launch|distributed_mpt|core|training|"
                   r"process|cluster|benchmark|recipes)/[\w./-]*\w)")
PACKAGE_FOLDERS = ("core", "training", "process", "cluster", "benchmark", "recipes")
# The smallest export: the samples read any model's alike.
TINY_MODEL = """
import keras
from distributed_mpt.core.models.layers import normalized_input


def tiny(info):
    images, x = normalized_input(info)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(x))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))
"""


def named_paths(text: str) -> set:
    """The repository paths `text` names, placeholders left out."""
    return {path for path in NAMED.findall(text) if not re.search(r"\b[A-Z]{3,}\b", path)}


@pytest.mark.parametrize("page", PAGES)
def test_every_file_the_page_names_exists(page):
    """cifar10-data.md sent users to k8s/base/prepare-data-job.yaml after the
    Job had moved to k8s/data: each path an extender is told to open, copy
    or apply must be there."""
    missing = []
    for path in sorted(named_paths((REPO / page).read_text())):
        where = REPO / "distributed_mpt" / path if path.startswith(PACKAGE_FOLDERS) else REPO / path
        if not where.exists():
            missing.append(path)
    assert not missing, f"{page} names {missing}, which the repository does not hold"


def test_using_the_models_python_samples_run_on_an_export(tmp_path, monkeypatch):
    """The Keras sample and the TF Serving request, as the page prints them,
    on a tiny run's export (the page's runs/cpu_cnn) and the image that ships."""
    run = tmp_path / "runs" / "cpu_cnn"
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    assert_ok(train(["--dataset=synthetic", "--synthetic_examples=16",
                     f"--model={tmp_path / 'tiny.py'}:tiny", "--train_steps=1",
                     "--per_replica_batch_size=8", f"--model_dir={run}"]))
    page = (REPO / "docs" / "using-the-model.md").read_text()
    samples = [block for block in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
               if "read_image" in block]
    assert len(samples) == 2, "the Keras sample and the TF Serving request"
    (tmp_path / "my_photo.jpg").write_bytes((REPO / "docs" / "automobile.png").read_bytes())
    monkeypatch.chdir(tmp_path)
    scope = {}
    for sample in samples:
        exec(compile(sample, "using-the-model.md", "exec"), scope)
    classes = (run / "export" / "classes.txt").read_text().splitlines()
    assert scope["probabilities"].shape == (1, len(classes))
    request = json.loads((tmp_path / "request.json").read_text())
    assert np.asarray(request["instances"]).shape == (1, 32, 32, 3)
    # "The SavedModel works without this package too": its one line, as printed.
    import tensorflow as tf
    (served,) = re.findall(r"`(tf\.saved_model\.load\(.*?)`,", page)
    keras_images = np.stack([scope["read_image"]("my_photo.jpg", (32, 32))])
    probabilities = eval(served, {"tf": tf, "images": keras_images})
    np.testing.assert_allclose(probabilities, scope["probabilities"], rtol=1e-4, atol=1e-6)


def package_copy(tmp_path, spec: str = ""):
    """A copy of the package, its DATASETS ended by the DatasetSpec `spec`."""
    package = tmp_path / "copy" / "distributed_mpt"
    shutil.copytree(REPO / "distributed_mpt", package, ignore=shutil.ignore_patterns("__pycache__"))
    registry = package / "core" / "data" / "__init__.py"
    text = registry.read_text()
    assert text.count("\n)}\n") == 1
    registry.write_text(text.replace("\n)}\n", spec + "\n)}\n", 1))
    return package


def in_copy(package, module, *args):
    """`python -m module args` of the copy, not the package this test imports."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          cwd=package.parent, env=subprocess_env(), timeout=300)


def test_a_loader_may_give_numpys_default_integers_as_labels(tmp_path):
    """A loader written as the page says, its labels NumPy's default int64
    (np.array of ints): the run trained them as int32 would have. It failed
    in the first step, blamed on the model (int64 labels beside int32
    predictions)."""
    package = package_copy(tmp_path, """
    DatasetSpec("mine", "int64 labels", f"{_HERE}.mine:load"),""")
    (package / "core" / "data" / "mine.py").write_text(
        "import numpy as np\n"
        "from distributed_mpt.core.data import cifar10\n"
        "from distributed_mpt.core.data.dataset import Dataset, ImageSplit\n\n\n"
        "def load(options, seed, splits, headroom):\n"
        "    rng = np.random.default_rng(seed)\n"
        "    made = {split: ImageSplit(rng.integers(0, 256, (16, 32, 32, 3), np.uint8),\n"
        "                              np.array([i % 10 for i in range(16)]))  # int64\n"
        "            for split in splits}\n"
        "    return Dataset(cifar10.INFO, made)\n")
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    trained = in_copy(package, "distributed_mpt.train", "--dataset=mine", "--train_steps=1",
                      f"--model={tmp_path / 'tiny.py'}:tiny", "--per_replica_batch_size=4",
                      f"--model_dir={tmp_path / 'run'}", "--noexport")
    assert_ok(trained)


def test_a_dataset_added_as_the_page_says_is_evaluated_from_its_export(tmp_path):
    """extending.md, "A dataset in the package": one DatasetSpec line, its
    `reads` naming the options its loader reads, and predict --evaluate
    rebuilds the test split its export was trained with (here a quarter of
    each class held out, which the flags' default, 0, would not do)."""
    from PIL import Image

    package = package_copy(tmp_path, """
    DatasetSpec("my_folder", "a copy of image_folder", f"{_HERE}.image_folder:load",
                reads=("image_size", "test_fraction"), needs_data_dir="the folder"),""")
    rng = np.random.default_rng(0)
    for label, colour in enumerate(((220, 40, 40), (40, 200, 60))):
        (tmp_path / "photos" / "train" / f"class{label}").mkdir(parents=True)
        for i in range(8):
            pixels = np.clip(np.array(colour) + rng.integers(-60, 60, (20, 20, 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / "photos" / "train" /
                                                         f"class{label}" / f"{i}.png")
    run = tmp_path / "run"

    def command(module, *args):
        return in_copy(package, module, *args)

    assert_ok(command("distributed_mpt.train", "--dataset=my_folder", f"--data_dir={tmp_path / 'photos'}",
                      "--test_fraction=0.25", "--image_size=16", "--model=mlp", "--train_steps=2",
                      "--per_replica_batch_size=4", f"--model_dir={run}"))
    info = json.loads((run / "export" / "model_info.json").read_text())
    assert (info["dataset"], info["test_fraction"], info["image_size"]) == ("my_folder", 0.25, 16)
    evaluated = command("distributed_mpt.predict", f"--model_dir={run}", "--evaluate",
                        f"--data_dir={tmp_path / 'photos'}")
    assert_ok(evaluated)
    assert "my_folder test:" in evaluated.stdout and "(4 images)" in evaluated.stdout, evaluated.stdout


def test_an_update_rule_added_as_the_page_says_trains_the_filters(tmp_path):
    """extending.md, "An optimizer": its AdamW (the page's class head and
    UPDATE_RULES line, the update filled in) added to core/optim/rules.py is
    --optimizer=adamw, and trains the filters, the other groups SGD."""
    page = (REPO / "docs" / "extending.md").read_text()
    (sketch,) = [block for block in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
                 if "class AdamW(UpdateRule)" in block]
    head, _, line = sketch.partition("    ...\n")
    package = package_copy(tmp_path)
    rules = package / "core" / "optim" / "rules.py"
    rules.write_text(rules.read_text() + "\n\n" + head + """
    def __init__(self, beta_1, beta_2=0.999):
        self.beta_1, self.beta_2 = beta_1, beta_2

    def update(self, optimizer, variable, gradient, rate, slots):
        m, v = slots["m"], slots["v"]
        optimizer.assign(m, self.beta_1 * m + (1 - self.beta_1) * gradient)
        optimizer.assign(v, self.beta_2 * v + (1 - self.beta_2) * gradient * gradient)
        optimizer.assign_sub(variable, rate * m / (v ** 0.5 + 1e-8))
""" + line)
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    trained = in_copy(package, "distributed_mpt.train", "--dataset=synthetic", "--optimizer=adamw",
                      "--synthetic_examples=16", "--train_steps=2", "--per_replica_batch_size=4",
                      f"--model={tmp_path / 'tiny.py'}:tiny", f"--model_dir={tmp_path / 'run'}",
                      "--noexport")
    assert_ok(trained)
    assert "parameter groups: filters: AdamW, 1 variable(s)" in trained.stdout, trained.stdout
    assert "kernels: NesterovSGD" in trained.stdout
