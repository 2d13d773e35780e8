"""What an extender reads beside docs/extending.md (whose own examples
tests/product/test_extending.py runs): every file of the repository that
the extenders' pages name exists where they say, and using-the-model.md's
Python samples run as written on an export."""

import json
import re

import numpy as np
import pytest

from conftest import REPO, assert_ok, train

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


def test_what_a_new_dataset_must_add_for_predict_is_where_the_page_says():
    """extending.md, "A dataset in the package": model_info.json records the
    options that rebuild a test split only for the datasets training/outputs.py
    names; the page names those datasets and the two names to edit."""
    import inspect

    from distributed_mpt.predict import _evaluate_on_test_split
    from distributed_mpt.training import outputs

    page = " ".join((REPO / "docs" / "extending.md").read_text().split())
    section = page[page.index("## A dataset in the package"):page.index("## An optimizer")]
    assert "`_ONLY_FOR` names (training/outputs.py: " in section
    named = section.split("`_ONLY_FOR` names (training/outputs.py: ", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`(\w+)`", named)) == {d for ds in outputs._ONLY_FOR.values() for d in ds}
    assert "`MODEL_INFO_CONFIG_KEYS`" in section
    # predict's own list, which the page says to extend with them.
    listed = re.search(r"k in \((.*?)\)", inspect.getsource(_evaluate_on_test_split), re.S)
    rebuilt = set(re.findall(r'"(\w+)"', listed.group(1)))
    assert rebuilt == set(outputs.MODEL_INFO_CONFIG_KEYS) - {"model", "model_width"}
