"""What a resume and predict hold against the run they continue or read:
the network's signature (core/models/signature.py: its variables and the
source that builds it, helper modules beside the file included), and for
predict --evaluate a test split of the model's own classes. Each refusal is
one named error line, exit 2; what does not change the network (a comment,
another function of the file) never blocks."""

import ast
import hashlib
import json
import sys
import uuid

import numpy as np
import pytest
from PIL import Image

from conftest import assert_ok, assert_one_error_line, run_in_process, train

FLAGS = ["--dataset=synthetic", "--synthetic_examples=256", "--per_replica_batch_size=32",
         "--precision=float32", "--warmup_epochs=0", "--noevaluate", "--noexport",
         "--steps_per_loop=2", "--log_every_steps=2"]

MODEL = '''
import keras


def net(info):
    """A network and its docstring."""
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))


def another(info):
    return net(info)
'''

MODEL_WITH_HELPER = '''
import keras

from {helper} import block


def net(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(block(x)))
'''

HELPER = '''
import keras


def block(x):
    return keras.layers.Dense(8, activation="relu")(x)
'''


def _train(model, run, steps):
    return train([*FLAGS, f"--model={model}:net", f"--train_steps={steps}", f"--model_dir={run}"])


def test_a_comment_or_another_function_edited_does_not_block_a_resume(tmp_path):
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL)
    assert_ok(_train(model, run, 2))
    model.write_text("# A comment, a docstring and another function edited.\n" + MODEL.replace(
        "A network and its docstring.", "Its docstring, rewritten.").replace(
        "return net(info)", "return keras.Sequential([net(info)])")
        # Neither runs as the package imports the file.
        + '"""A string as a comment."""\nif __name__ == "__main__":\n    print(another(None))\n')
    resumed = _train(model, run, 4)
    assert_ok(resumed)
    assert "resuming from step 2" in resumed.stdout


@pytest.mark.parametrize("change, fragment", [
    # Nothing of the variables changes: only the source can tell.
    (('"relu"', '"sigmoid"'), "is not the network the run in --model_dir="),
    # The checkpoints' own record (model.json) tells first.
    (("Dense(8", "Dense(16"), "holds checkpoints of a different model ('net'"),
])
def test_a_changed_helper_module_blocks_the_resume(tmp_path, change, fragment):
    helper = f"blocks_{uuid.uuid4().hex[:8]}"  # a module name no other test imported
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL_WITH_HELPER.format(helper=helper))
    (tmp_path / f"{helper}.py").write_text(HELPER)
    assert_ok(_train(model, run, 2))
    (tmp_path / f"{helper}.py").write_text(HELPER.replace(*change))
    del sys.modules[helper]  # as a new process finds it: read from the file
    result = _train(model, run, 4)
    assert_one_error_line(result, fragment)
    if "sigmoid" in change[1]:
        assert f"the source of {helper}.py differs" in result.stderr
    else:  # the same flags: it is the code that must be as it was
        assert "its code as it was" in result.stderr
    assert not (run / "checkpoints" / "ckpt-4.index").exists(), "nothing trained"


MODEL_WITH_SETTINGS = MODEL.replace("import keras\n", """import keras

SETTINGS = {"activation": "relu"}
SETTINGS["activation"] = "relu"
""").replace('activation="relu"', 'activation=SETTINGS["activation"]')


@pytest.mark.parametrize("change", [
    ('SETTINGS["activation"] = "relu"', 'SETTINGS["activation"] = "gelu"'),
    ('SETTINGS["activation"] = "relu"', 'SETTINGS.update(activation="gelu")'),
    ('SETTINGS["activation"] = "relu"', 'def _configure():\n    SETTINGS["activation"] = "gelu"'
                                        '\n\n\n_configure()'),
])
def test_a_top_level_statement_changing_a_value_the_model_uses_blocks_the_resume(tmp_path, change):
    """Such a statement binds no name the function uses: it counts as it
    runs when the file is imported, and changes the network (relu to gelu:
    its variables are the same)."""
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL_WITH_SETTINGS)
    assert_ok(_train(model, run, 2))
    model.write_text(MODEL_WITH_SETTINGS.replace(*change))
    result = _train(model, run, 3)
    assert_one_error_line(result, "the source of net (and of what it uses of its file) differs")
    assert not (run / "checkpoints" / "ckpt-3.index").exists(), "nothing trained"


# A model file with an import its network does not use, and no docstrings
# (a digest below is made by hand).
MODEL_IMPORTING_MORE = """import os
import keras


def net(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))
"""


def test_a_run_recorded_under_the_first_source_rule_resumes_as_it_was_recorded(tmp_path):
    """Runs before 2026-12-06 recorded the builder and the statements binding
    a name it uses, not every statement that runs on import: compared the new
    way, an unused import refused their resume as an edit. The record below
    is what main b4132ae wrote for this file (checked against it)."""
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL_IMPORTING_MORE)
    assert_ok(_train(model, run, 2))
    config = json.loads((run / "config.json").read_text())
    signature = config["resolved"]["model_signature"]
    assert signature.pop("source_rule") == 2
    used = ast.parse(MODEL_IMPORTING_MORE).body[1:]  # import keras, def net: not import os
    signature["source"] = {"net": hashlib.sha256(
        "\n".join(ast.dump(statement) for statement in used).encode()).hexdigest()}
    (run / "config.json").write_text(json.dumps(config))
    assert_ok(_train(model, run, 4))

    recorded = json.loads((run / "config.json").read_text())["earlier"][-1]
    model.write_text(MODEL_IMPORTING_MORE.replace("Dense(info", "Dense(units=info"))
    (run / "config.json").write_text(json.dumps(recorded))
    assert_one_error_line(_train(model, run, 6), "the source of net")


def test_a_run_recorded_before_signatures_resumes_as_it_was_recorded(tmp_path):
    """Its config.json holds the SHA-256 of the whole model file: the same
    file resumes, an edited one is refused, saying why."""
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL)
    assert_ok(_train(model, run, 2))
    config = json.loads((run / "config.json").read_text())
    del config["resolved"]["model_signature"]
    config["resolved"]["model_source"] = hashlib.sha256(model.read_bytes()).hexdigest()
    (run / "config.json").write_text(json.dumps(config))
    assert_ok(_train(model, run, 4))
    config = json.loads((run / "config.json").read_text())
    assert "model_signature" in config["resolved"], "the resumed segment records the new way"
    assert config["earlier"][-1]["resolved"]["model_source"], "and keeps the old record"

    model.write_text(MODEL + "# a comment\n")
    (run / "config.json").write_text(json.dumps(config["earlier"][-1]))
    assert_one_error_line(_train(model, run, 6), "its file's SHA-256 differs")


def _predict(*args):
    from distributed_mpt.predict import main
    return run_in_process(main, [str(a) for a in args])


def test_predict_from_a_checkpoint_refuses_a_changed_model_file(tmp_path):
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL)
    assert_ok(_train(model, run, 2))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    assert_ok(_predict(f"--model_dir={run}", f"--model={model}:net", photo))
    model.write_text(MODEL.replace('"relu"', '"sigmoid"'))
    result = _predict(f"--model_dir={run}", f"--model={model}:net", photo)
    assert_one_error_line(result, "the source of net (and of what it uses of its file) differs")
    assert "predict from the run's export" in result.stderr


def test_predict_imports_no_code_that_config_json_names(tmp_path):
    """Every file in --model_dir is untrusted: a config.json naming a file
    of its own (or any installed function, code:interact reading Python
    from stdin) was imported and called by predict from a checkpoint."""
    model, run = tmp_path / "mine.py", tmp_path / "run"
    model.write_text(MODEL)
    assert_ok(_train(model, run, 2))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    (run / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                 f"def net(info):\n    raise ValueError\n")
    config = json.loads((run / "config.json").read_text())
    config["model"]["model"] = f"{run / 'evil.py'}:net"
    (run / "config.json").write_text(json.dumps(config))
    assert_one_error_line(_predict(f"--model_dir={run}", photo),
                          "its checkpoint is of your own model")
    assert not (tmp_path / "ran").exists(), "nothing that config.json names was run"
    # The user's own file, named by the user, is the network the run recorded.
    assert_ok(_predict(f"--model_dir={run}", f"--model={model}:net", photo))
    assert not (tmp_path / "ran").exists()


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory):
    """An untrained tiny model's export of three classes of 32 x 32 images."""
    from distributed_mpt.core import models
    from distributed_mpt.core.data import DatasetInfo, cifar10
    from distributed_mpt.training import outputs

    info = DatasetInfo((32, 32, 3), ("cars", "dogs", "ships"), cifar10.INFO.mean, cifar10.INFO.std)
    directory = tmp_path_factory.mktemp("three")
    model = models.build_model(models.model_spec("resnet9"), info, 4)
    outputs.export_model(model, str(directory), info.class_names, info.image_shape)
    return directory


def _image_folder(root, classes):
    for split in ("train", "test"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            Image.fromarray(np.full((32, 32, 3), 100, np.uint8)).save(root / split / name / "a.png")
    return root


@pytest.mark.parametrize("dataset, fragment", [
    # Labels up to 9 for a model of 3 classes: an IndexError before.
    ("synthetic", "--dataset=synthetic's test split has the classes airplane, automobile"),
    # Three classes, named otherwise: a silent, meaningless accuracy before.
    ("image_folder", "--dataset=image_folder's test split has the classes ants, bees, cows, and "
                     "the model predicts cars, dogs, ships"),
])
def test_evaluate_refuses_a_split_of_other_classes(three_classes, tmp_path, dataset, fragment):
    folder = _image_folder(tmp_path / "folder", ("ants", "bees", "cows"))
    # Synthetic data reads no --data_dir, and predict refuses one given to it.
    data_dir = [f"--data_dir={folder}"] if dataset == "image_folder" else []
    result = _predict(f"--model_dir={three_classes}", "--evaluate", f"--dataset={dataset}",
                      *data_dir)
    assert_one_error_line(result, fragment)


def test_a_model_file_nesting_deeper_than_the_signature_walks_is_one_error_line(tmp_path):
    """Python compiles an expression of 1,500 terms that its own recursion
    limit cannot walk: a RecursionError traceback, before."""
    model, run = tmp_path / "deep.py", tmp_path / "run"
    model.write_text(MODEL + "\nSCALE = " + "+".join(["1"] * 1500) + "\n")
    assert_one_error_line(_train(model, run, 2), "its source nests too deep to record")
    assert not run.exists()
