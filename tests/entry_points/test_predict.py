"""Using a trained model: the export's serving signature, and the real
`distributed_mpt.predict` entry point run as a user runs it."""

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import (SMOKE_FLAGS, assert_ok, assert_one_error_line, deadline, make_path,
                      read_summary, run_in_process, run_module, snapshot, subprocess_env, train)
from distributed_mpt import predict as predict_module
from distributed_mpt.config import SECTIONS
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10, images
from distributed_mpt.training import outputs

CLASS_NAMES = cifar10.INFO.class_names


def _export_untrained(directory, info=None):
    """An untrained tiny resnet9's export in `directory`."""
    model = models.build_model(models.model_spec("resnet9"), cifar10.INFO, 4)
    outputs.export_model(model, str(directory), CLASS_NAMES, cifar10.INFO.image_shape, info)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A run directory holding an untrained tiny resnet9's export: the
    signature and the command do not depend on what the model learned."""
    directory = tmp_path_factory.mktemp("run")
    _export_untrained(directory)
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
    assert names == list(CLASS_NAMES)
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
    assert path == str(photo) and name in CLASS_NAMES and 0 < float(probability) <= 1


def test_top_k_as_json_from_the_export_directory(model_dir, photo):
    result = predict(f"--model_dir={model_dir / 'export'}", "--top_k=3", "--json", photo)
    assert_ok(result)
    top = json.loads(result.stdout)["predictions"][0]["top"]
    assert len(top) == 3 and {t["class"] for t in top} <= set(CLASS_NAMES)
    assert [t["probability"] for t in top] == sorted((t["probability"] for t in top), reverse=True)


def test_evaluate_prints_the_accuracy_on_every_test_image(model_dir):
    result = predict(f"--model_dir={model_dir}", "--evaluate", "--dataset=synthetic",
                     "--synthetic_examples=500")
    assert_ok(result)
    assert "accuracy" in result.stdout and "(100 images)" in result.stdout


def test_evaluate_needs_only_the_test_file_of_the_binary_release(model_dir, tmp_path):
    from conftest import write_cifar10_binary

    release = write_cifar10_binary(tmp_path)
    for train_file in release.glob("data_batch_*.bin"):
        train_file.unlink()
    result = predict(f"--model_dir={model_dir}", "--evaluate", "--dataset=cifar10",
                     f"--data_dir={tmp_path}")
    assert_ok(result)
    assert "(10000 images)" in result.stdout


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """What the quick start makes: a model that learned synthetic data,
    trained and exported through the real entry point."""
    run = tmp_path_factory.mktemp("synthetic") / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=20", "--export", f"--model_dir={run}"]))
    return run


def test_a_model_of_synthetic_data_says_so_before_its_answers(synthetic_run, photo):
    info = json.loads((synthetic_run / "export" / outputs.MODEL_INFO_NAME).read_text())
    summary = read_summary(synthetic_run)
    assert info["dataset"] == "synthetic" and info["model"] == "mlp"
    assert info["steps"] == summary["steps"] == 20
    assert info["eval_accuracy"] == summary["eval_accuracy"]
    assert info["precision"] == summary["precision"]
    result = run_module("distributed_mpt.predict", [f"--model_dir={synthetic_run}", str(photo)])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [predict_module.SYNTHETIC_WARNING]
    assert (f"model: mlp trained 20 steps with --dataset=synthetic, test accuracy "
            f"{summary['eval_accuracy']:.4f}") in result.stderr
    assert result.stdout.startswith(f"{photo}: ")


def test_a_model_trained_for_no_steps_says_its_answers_are_chance(tmp_path, photo):
    _export_untrained(tmp_path, info={"model": "resnet9", "model_width": 4,
                                      "dataset": "cifar10", "seed": 0, "steps": 0})
    result = predict(f"--model_dir={tmp_path}", photo)
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [predict_module.UNTRAINED_WARNING]
    assert "trained for 0 steps" in warnings[0]
    assert result.stdout.startswith(f"{photo}: ")


@pytest.mark.slow
def test_a_float16_model_predicts_on_a_cpu_without_onednn_reference_kernels(tmp_path, photo):
    """A model trained in mixed_float16 (a GPU's default) computes in float16
    wherever it is loaded; on a CPU TensorFlow would fuse its layers into a
    kernel that oneDNN runs only in its reference form, 1000x slower
    (precision.avoid_float16_reference_kernels)."""
    run = tmp_path / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=2", "--precision=mixed_float16", "--export",
                     f"--model_dir={run}"], timeout=300))  # a process: the policy is global
    result = run_module("distributed_mpt.predict", [f"--model_dir={run}", str(photo)],
                        env=subprocess_env(ONEDNN_VERBOSE="1"))
    assert_ok(result)
    assert f"{photo}: " in result.stdout
    assert "ref:any" not in result.stdout


@pytest.mark.slow
def test_a_bfloat16_model_predicts_on_a_cpu_without_avx512_with_no_error_line(tmp_path, photo):
    """On a CPU without AVX-512 (2 cores of an AVX2-only AMD EPYC), a
    mixed_bfloat16 model's answers came after TensorFlow's 'E0000 ... oneDNN
    supports DT_BFLOAT16 only on platforms with AVX-512. Falling back to the
    default Eigen-based implementation', twice: an error, to the eye, that
    was none. (Where the CPU has AVX-512 there is no such line to drop.)"""
    run = tmp_path / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=2", "--precision=mixed_bfloat16", "--export",
                     f"--model_dir={run}"], timeout=300))  # a process: the policy is global
    result = run_module("distributed_mpt.predict", [f"--model_dir={run}", str(photo)])
    assert_ok(result)
    assert result.stdout.startswith(f"{photo}: ")
    assert [line.split()[0] for line in result.stderr.splitlines()] == ["model:", "warning:"]


def test_a_run_without_export_is_evaluated_from_its_checkpoint_on_its_own_data(
        synthetic_run, tmp_path):
    run = tmp_path / "run"  # the run as it was before its export
    run.mkdir()
    (run / "checkpoints").symlink_to(synthetic_run / "checkpoints")
    shutil.copy(synthetic_run / "config.json", run)
    result = predict(f"--model_dir={run}", "--evaluate", "--json")
    assert_ok(result)
    answer = json.loads(result.stdout)
    # config.json says what it learned: the synthetic split of its own
    # seed and size (1024 training examples, a fifth as many test images).
    assert answer["model"]["dataset"] == "synthetic" and answer["model"]["steps"] == 20
    assert answer["evaluation"]["dataset"] == "synthetic"
    assert answer["evaluation"]["examples"] == 204
    assert answer["evaluation"]["accuracy"] > 0.5, "synthetic labels are learnable"


def test_a_checkpoint_of_a_newer_version_predicts_with_a_warning_naming_what_it_lacks(
        synthetic_run, tmp_path):
    """Predict trains nothing: a newer version's training settings do not
    change its answers (a model option would fail the restore), but are said."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(synthetic_run / "checkpoints")
    config = json.loads((synthetic_run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "mixup_alpha": 0.4}))
    result = predict(f"--model_dir={run}", "--evaluate", "--json")
    assert_ok(result)
    assert (f"warning: {run}/config.json records settings this version does not know "
            f"(mixup_alpha): it was likely written by a newer distributed_mpt; predicting "
            f"without them") in result.stderr.splitlines()
    assert json.loads(result.stdout)["evaluation"]["accuracy"] > 0.5


def test_a_half_written_newer_checkpoint_is_named_in_a_warning_and_none_whole_is_refused(
        synthetic_run, photo, tmp_path):
    """A run killed while it saved step 30: predict answered with step 20's
    model without a word, and with no whole checkpoint said it held none."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(synthetic_run / "config.json", run)
    for part in (synthetic_run / "checkpoints").glob("ckpt-20.*"):
        os.link(part, run / "checkpoints" / part.name)  # not a symbolic link: refused as one
        with open(part, "rb") as whole:  # its first kilobyte
            (run / "checkpoints" / part.name.replace("-20.", "-30.")).write_bytes(whole.read(1000))
    result = predict(f"--model_dir={run}", photo)
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings[0].startswith(
        f"warning: predicting with {run}/checkpoints/ckpt-20 (step 20), the newest checkpoint "
        f"that reads back whole: 1 newer one(s) cannot be read (ckpt-30: "), result.stderr
    assert result.stdout.startswith(f"{photo}: ")
    for part in (run / "checkpoints").glob("ckpt-20.*"):
        part.unlink()
    assert_one_error_line(predict(f"--model_dir={run}", photo),
                          f"--model_dir={run} holds no export, and none of its 1 checkpoint(s) "
                          f"reads back whole (ckpt-30: ")


def test_evaluate_with_test_time_views_reproduces_the_runs_own_evaluation(tmp_path, photo):
    """A run evaluated with the 2025 record's selective views; predict's
    --tta, from the export (probabilities only), gives back its numbers, and
    --tta=none the plain view's, so that a trained model is re-scored with
    other views without training again."""
    run = tmp_path / "run"
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=2", "--precision=float32", "--export",
                     "--eval_tta=flip_translate_mean", "--eval_tta_fraction=0.25",
                     f"--model_dir={run}"]))
    summary = read_summary(run)

    def evaluation(*flags):
        result = predict(f"--model_dir={run}", "--evaluate", "--json", *flags)
        assert_ok(result)
        return json.loads(result.stdout)["evaluation"]

    views = evaluation("--tta=flip_translate_mean", "--tta_fraction=0.25")
    assert views["accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-9)
    assert views["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert views["examples"] == summary["eval_examples"] == 204
    plain = evaluation()
    assert plain["accuracy"] == pytest.approx(summary["eval_accuracy_without_tta"], abs=1e-9)
    assert abs(plain["loss"] - views["loss"]) > 1e-4, "the views change the answers"
    result = predict(f"--model_dir={run}", "--evaluate", "--tta=flip")
    assert_ok(result)
    assert "(204 images, test-time views flip for 100% of them)" in result.stdout
    result = predict(f"--model_dir={run}", "--tta=flip_translate", photo)
    assert_ok(result)
    assert result.stdout.startswith(f"{photo}: ")


# The hostile inputs: each `make(tmp_path, untrained, trained, photo)` builds
# the bad thing in tmp_path and returns the directory that must be left as it
# was and predict's arguments; `untrained` and `trained` are the fixtures'
# run directories.

def _damaged_export(damage):
    def make(tmp_path, untrained, trained, photo):
        shutil.copytree(untrained / "export", tmp_path / "run" / "export")
        damage(tmp_path / "run" / "export" / "saved_model")
        return tmp_path / "run", [photo]
    return make


def _damaged_run_export(damage):
    """The trained run's checkpoint beside a damaged export: the export is
    refused, not passed over for the checkpoint without a word."""
    def make(tmp_path, untrained, trained, photo):
        run, args = _checkpoint_run()(tmp_path, untrained, trained, photo)
        _damaged_export(damage)(tmp_path, untrained, trained, photo)
        return run, args
    return make


def _replaced(saved_model, make):
    shutil.rmtree(saved_model)
    make(saved_model)


def _weightless_export(class_names=True):
    """The right signature (and, as an export has them, the class names)
    and no weights: 0.1 for every class, as an untrained model would
    answer."""
    def make(tmp_path, untrained, trained, photo):
        class Constant(tf.Module):
            @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.uint8,
                                                        name="images")])
            def serve(self, images):
                return {"probabilities": tf.fill([tf.shape(images)[0], 10], 0.1)}

        module = Constant()
        if class_names:
            module.class_names = [tf.Variable(list(CLASS_NAMES), trainable=False)]
        tf.saved_model.save(module, str(tmp_path / "run" / "export" / "saved_model"),
                            signatures={"serving_default": module.serve})
        return tmp_path / "run", [photo]
    return make


def _export_out_of_memory(tmp_path, untrained, trained, photo):
    """An export whose serving function asks for 4 TB for an image: its
    weights and class names as a run's export has them. The kernel refuses
    that much at once unless it overcommits always (mode 1), where the
    zeros would be written: skipped there."""
    import keras

    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory=1 grants 4 TB, which the zeros would then fill")

    layer = keras.layers.Dense(10)
    layer.build((None, 1))

    def serve(images):
        hungry = tf.zeros([tf.shape(images)[0] * 2**20, 2**20])
        ones = tf.ones([tf.shape(images)[0], 1]) + tf.reduce_sum(hungry)
        return {"probabilities": tf.nn.softmax(layer(ones))}

    archive = keras.export.ExportArchive()
    archive.track(layer)
    archive.add_endpoint("serve", serve, input_signature=[
        tf.TensorSpec([None, 32, 32, 3], tf.uint8, name="images")])
    archive.add_variable_collection("class_names", [tf.Variable(list(CLASS_NAMES),
                                                                trainable=False)])
    archive.write_out(str(tmp_path / "run" / "export" / "saved_model"), verbose=False)
    return tmp_path / "run", [photo]


def _checkpoint_run(config=None, weightless=False):
    """The trained run before its export, its config.json changed by
    `config` (a dict to merge, or the whole text), or with a checkpoint
    that holds no model weights."""
    def make(tmp_path, untrained, trained, photo):
        run = tmp_path / "run"
        if weightless:
            tf.train.Checkpoint(step=tf.Variable(20)).write(str(run / "checkpoints" / "ckpt-20"))
        else:
            run.mkdir()
            (run / "checkpoints").symlink_to(trained / "checkpoints")
        recorded = json.loads((trained / "config.json").read_text())
        if isinstance(config, str):
            text = config
        else:  # the changed flags go into their sections, as a run writes them
            text = json.dumps({name: {**value, **{k: v for k, v in (config or {}).items()
                                                  if k in value}} if name in SECTIONS else value
                               for name, value in recorded.items()})
        (run / "config.json").write_text(text)
        return run, [photo]
    return make


def _recorded_classes(names):
    """The trained run before its export, config.json listing `names` as the
    classes it learned (a hand edit; what predict answers with)."""
    def make(tmp_path, untrained, trained, photo):
        run, args = _checkpoint_run()(tmp_path, untrained, trained, photo)
        recorded = json.loads((run / "config.json").read_text())
        recorded["resolved"]["dataset_info"]["class_names"] = names
        (run / "config.json").write_text(json.dumps(recorded))
        return run, args
    return make


def _bad_image(made):
    """The untrained run, and `made(path)` as the image to classify."""
    def make(tmp_path, untrained, trained, photo):
        return untrained, [made(tmp_path / "image.png")]
    return make


def _text(path):
    path.write_text("not pixels")
    return path


def _saved(path, fmt):
    Image.new("RGB", (8, 8), (200, 30, 30)).save(path, fmt)
    return path


def _written(path, data: bytes):
    path.write_bytes(data)
    return path


def _cut_short(image, path):
    path.write_bytes(image.read_bytes()[:-100])
    return path


def _huge(path):
    with open(path, "wb") as f:
        f.truncate(images.MAX_IMAGE_BYTES + 1)  # sparse: no disk used
    return path


def _a_png_of_a_billion_pixels(path):
    # A whole PNG of 74 bytes that says 40,000 x 40,000 (4.8 GB decoded): an
    # image of one colour compresses about 1000:1, so its size says nothing.
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))

    header = struct.pack(">IIBBBBB", 40_000, 40_000, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    return path


def _padded_fingerprint(saved_model):
    # The real one, then a field of 256 MiB that no reader knows (sparse: no
    # disk used): TensorFlow read it whole and took it for intact (at 2 GB:
    # 60 s and 6 GB of memory on 2 cores of a Zen 5 AMD EPYC). Its key (field 1000, bytes), its length 2**28.
    path = saved_model / "fingerprint.pb"
    header = path.read_bytes() + bytes([0xC2, 0x3E, 0x80, 0x80, 0x80, 0x80, 0x01])
    path.write_bytes(header)
    os.truncate(path, len(header) + (1 << 28))


def _nothing(tmp_path, untrained, trained, photo):
    return tmp_path, [photo]


def _flags(*flags):
    def make(tmp_path, untrained, trained, photo):
        return untrained, ["--evaluate", "--dataset=synthetic", *flags]
    return make


HOSTILE_INPUTS = {
    # What loads must hold the model, whole.
    "empty saved_model.pb": (_damaged_export(
        lambda d: (d / "saved_model.pb").write_bytes(b"")), "cannot be loaded"),
    "garbage saved_model.pb": (_damaged_export(
        lambda d: (d / "saved_model.pb").write_bytes(os.urandom(1000))), "cannot be loaded"),
    "SavedModel without variables": (_damaged_export(
        lambda d: shutil.rmtree(d / "variables")), "cannot be loaded"),
    # TensorFlow loads past a damaged fingerprint.pb, under a traceback.
    "garbage fingerprint.pb": (_damaged_run_export(
        lambda d: (d / "fingerprint.pb").write_bytes(b"\xff" * 100)),
        "saved_model is damaged (its fingerprint.pb does not read back)"),
    "empty fingerprint.pb": (_damaged_run_export(lambda d: (d / "fingerprint.pb").write_bytes(b"")),
                             "saved_model is damaged (its fingerprint.pb does not read back)"),
    "fingerprint.pb of 256 MiB": (_damaged_run_export(_padded_fingerprint),
                                  "saved_model is damaged (its fingerprint.pb does not read back)"),
    "an empty file for saved_model/": (_damaged_run_export(
        lambda d: _replaced(d, lambda p: p.write_bytes(b""))),
        "export/saved_model is a file, not an export's folder"),
    "a link in a loop for saved_model/": (_damaged_run_export(
        lambda d: _replaced(d, lambda p: p.symlink_to(p.name))),
        "export/saved_model is a symbolic link in a loop, not an export's folder"),
    "export without weights": (_weightless_export(), "holds no trained variables"),
    "export without class names": (_weightless_export(class_names=False), "cannot be loaded"),
    # Not the export's fault: "remove it" had an intact one deleted.
    "an export out of memory": (_export_out_of_memory, "saved_model ran out of memory ("),
    "checkpoint without weights": (_checkpoint_run(weightless=True), "does not hold the weights"),
    "config.json of another model": (_checkpoint_run({"model": "resnet9", "model_width": 4}),
                                     "is not the network the run in"),
    "config.json of width 100,000": (_checkpoint_run({"model": "resnet9", "model_width": 100_000}),
                                     "larger than this program accepts"),
    "garbage config.json": (_checkpoint_run("\x00garbage{"), "config.json is damaged"),
    "config.json with a list for a section": (_checkpoint_run(
        '{"model": ["resnet9"], "data": {}, "run": {}}'), "its 'model' section is"),
    "config.json of a million classes": (_recorded_classes([f"c{i}" for i in range(10**6)]),
                                         "it names 1,000,000 classes"),
    "config.json of one class twice": (_recorded_classes(["cat", "cat", *"abcdefgh"]),
                                       "class names cat and cat read as one"),
    "config.json of classes that are not names": (_recorded_classes([None, 7, *"abcdefgh"]),
                                                  "its class names are not a list of names"),
    "no export, no checkpoint": (_nothing, "holds no export"),
    "a --model_dir that does not exist": (lambda tmp_path, untrained, trained, photo: (
        tmp_path / "missing", [photo]), "is not a directory"),
    # Images: refused by kind and size before they are read.
    "a text file as an image": (_bad_image(_text),
                                "is not an image file (PNG, JPEG"),
    # Named by their format, which the first bytes alone may not tell: a TGA
    # was "an image in the CUR format", a phone's HEIC "not an image file".
    "a TGA as an image": (_bad_image(lambda p: _saved(p, "TGA")), "in the TGA format, which"),
    "a HEIC as an image": (_bad_image(lambda p: _written(p, b"\0\0\0\x18ftypmif1\0\0\0\0"
                                                         b"mif1heic" + bytes(100))),
                           "in the HEIC format, which this program does not read"),
    "a truncated PNG": (lambda tmp_path, untrained, trained, photo: (
        untrained, [_cut_short(photo, tmp_path / "cut.png")]),
        "begins as a PNG image does but does not decode"),
    "a missing image": (_bad_image(lambda p: p), "cannot read"),
    "a directory as an image": (_bad_image(lambda p: make_path("directory", p)),
                                "not a regular file"),
    "a FIFO as an image": (_bad_image(lambda p: make_path("FIFO", p)), "not a regular file"),
    "/dev/zero as an image": (_bad_image(lambda p: make_path("device", p)), "not a regular file"),
    "an image of 64 MB": (_bad_image(_huge), "larger than an image"),
    "a PNG of 1.6 billion pixels": (_bad_image(_a_png_of_a_billion_pixels),
                                    "more than this program decodes"),
    # Among good ones: the first named, and the others counted, not found a run at a time.
    "bad images among good ones": (lambda tmp_path, untrained, trained, photo: (
        untrained, [photo, _text(tmp_path / "a.png"), photo, make_path("directory", tmp_path / "b"),
                    _text(tmp_path / "c.png")]),
        "a.png is not an image file (PNG, JPEG, GIF, BMP, WebP and TIFF are read) (2 more of the 5 "
        "files given are not readable images either, the next "),
    # Counts bounded as training bounds them.
    "--synthetic_examples=-1": (_flags("--synthetic_examples=-1"), "must be a positive"),
    "--synthetic_examples=10**11": (_flags(f"--synthetic_examples={10**11}"),
                                    "larger than this program accepts"),
    # Test-time views: named ones, for a fraction in (0, 1].
    "--tta=rotate": (_flags("--tta=rotate"), "--tta"),
    "--tta_fraction=0": (_flags("--tta=flip", "--tta_fraction=0"), "must be in (0, 1]"),
    "--tta_fraction=1.5": (_flags("--tta=flip", "--tta_fraction=1.5"), "--tta_fraction"),
    "--tta_fraction=nan": (_flags("--tta=flip", "--tta_fraction=nan"), "--tta_fraction"),
    # A test split's flags, which choose what --evaluate reads, were ignored without a word.
    "--data_dir without --evaluate": (lambda tmp_path, untrained, trained, photo: (
        untrained, [f"--data_dir={tmp_path}", "--nodownload", photo]),
        "--data_dir, --download are for --evaluate's test split, which is not asked for"),
    "--data_dir of a model of synthetic data": (lambda tmp_path, untrained, trained, photo: (
        trained, ["--evaluate", f"--data_dir={tmp_path}"]), "is not read: the test split is "
        "--dataset=synthetic's (the model's), made from its seed"),
    "--data_dir with --dataset=synthetic": (
        _flags(f"--data_dir={Path.home()}"),
        "is not read: the test split is --dataset=synthetic's, made"),
}


@pytest.mark.parametrize("problem", HOSTILE_INPUTS)
def test_hostile_input_is_one_error_line_and_exit_2(problem, model_dir, synthetic_run, photo,
                                                    tmp_path):
    make, fragment = HOSTILE_INPUTS[problem]
    run, args = make(tmp_path, model_dir, synthetic_run, photo)
    before = snapshot(run, directory_times=True, lock_time=True)
    with deadline(seconds=300):  # a FIFO read would block: fail instead
        result = predict(f"--model_dir={run}", *args)
    assert_one_error_line(result, fragment)
    assert snapshot(run, directory_times=True, lock_time=True) == before, "predict writes nothing"


def test_a_file_named_like_a_flag_gets_a_way_out(model_dir, photo, tmp_path, monkeypatch):
    """`predict -photo.png` said only "Unknown command line flag 'photo.png'"
    (found by a probe of predict's inputs); ./-photo.png and -- both work."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(photo, tmp_path / "-photo.png")
    assert_one_error_line(predict(f"--model_dir={model_dir}", "-photo.png"),
                          "(for the file -photo.png, give ./-photo.png, or put -- before the "
                          "files)")
    assert_ok(predict(f"--model_dir={model_dir}", "./-photo.png"))
    assert_ok(predict(f"--model_dir={model_dir}", "--", "-photo.png"))
