"""predict against files made to exhaust it, and a model that never
trained: bounded before decoding, and said before any answer."""

import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import (REPO, assert_ok, assert_one_error_line, deadline, run_in_process,
                      subprocess_env)
from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10
from distributed_mpt.training import outputs


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """An export of a tiny airbench that its record says trained 0 steps
    (what a run stopped in its first compiled call leaves)."""
    directory = tmp_path_factory.mktemp("run")
    model = models.build_model(models.model_spec("airbench"), cifar10.INFO, width=4)
    outputs.export_model(model, str(directory), cifar10.INFO.class_names, cifar10.INFO.image_shape,
                         {"model": "airbench", "model_width": 4, "dataset": "cifar10", "seed": 0,
                          "steps": 0})
    return directory


def predict(*args):
    from distributed_mpt.predict import main
    return run_in_process(main, [str(a) for a in args])


def test_an_animation_of_many_large_frames_is_refused_by_name_in_bounded_memory(untrained,
                                                                               tmp_path):
    # 30 frames of 2000 x 2000 (of "L": "P" frames without a palette are all
    # black, and Pillow writes them as one): 120 million pixels, 360 MB in
    # RGB, a few hundred kB compressed. Every frame is decoded, one at a
    # time, until the frames' pixels pass the bound. TensorFlow's decoder
    # grew to 6 GiB on a bigger one.
    frames = [Image.new("L", (2000, 2000), 30 * (i % 7)) for i in range(30)]
    path = tmp_path / "animation.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    del frames
    timed = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m",
                            "distributed_mpt.predict", f"--model_dir={untrained}", str(path)],
                           capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                           timeout=300)
    peak_mb = int(timed.stderr.strip().splitlines()[-1]) // 1024
    result = subprocess.CompletedProcess(timed.args, timed.returncode, timed.stdout,
                                         "\n".join(timed.stderr.splitlines()[:-1]))
    assert_one_error_line(result, "holds 26 or more frames of 104,000,000 pixels in all, more "
                                  "than this program decodes (100,000,000)")
    print(f"predict's peak memory on the animation: {peak_mb} MB")
    assert peak_mb < 1500, "one frame of 12 MB at a time, not 30"


def test_a_webp_that_says_it_holds_too_many_pixels_is_refused_before_decoding(untrained, tmp_path):
    # A real 4 x 4 WebP whose VP8 header is made to say 16383 x 16383.
    encoded = io.BytesIO()
    Image.new("RGB", (4, 4)).save(encoded, "WEBP")
    data = bytearray(encoded.getvalue())
    start = data.index(b"\x9d\x01\x2a") + 3
    data[start:start + 4] = (16383).to_bytes(2, "little") * 2
    path = tmp_path / "huge.webp"
    path.write_bytes(bytes(data))
    assert_one_error_line(predict(f"--model_dir={untrained}", path),
                          "says it holds 268,402,689 pixels, more than this program decodes")


def test_a_model_trained_for_0_steps_is_flagged_before_its_answers(untrained, tmp_path):
    path = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(path)
    result = predict(f"--model_dir={untrained}", path)
    assert_ok(result)
    assert "warning: this model was trained for 0 steps" in result.stderr
    assert result.stdout.startswith(f"{path}: ")


def test_a_newline_in_a_file_name_cannot_forge_an_answer_line(untrained, tmp_path):
    path = tmp_path / "cat.png\nship.png: ship 1.000"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(path, format="PNG")
    result = predict(f"--model_dir={untrained}", path)
    assert_ok(result)
    assert len(result.stdout.splitlines()) == 1 and "\\n" in result.stdout


@pytest.mark.parametrize("part", ["saved_model.pb", "variables/variables.data-00000-of-00001"])
def test_an_export_holding_a_fifo_is_refused_not_waited_on(untrained, tmp_path, part):
    """TensorFlow's loader opened it and waited for ever."""
    export = tmp_path / "export"
    shutil.copytree(untrained / "export", export)
    fifo = export / "saved_model" / part
    fifo.unlink()
    os.mkfifo(fifo)
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    with deadline(60):
        result = predict(f"--model_dir={export}", photo)
    assert_one_error_line(result, f"{fifo} is a FIFO, not a regular file or folder")


def test_an_export_holding_a_link_to_a_fifo_names_what_it_leads_to(untrained, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(untrained / "export", export)
    os.mkfifo(tmp_path / "fifo")
    link = export / "saved_model" / "saved_model.pb"
    link.unlink()
    link.symlink_to(tmp_path / "fifo")
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    with deadline(60):
        result = predict(f"--model_dir={export}", photo)
    assert_one_error_line(result, f"{link} is a symbolic link to a FIFO, not a regular file")


def _hand_made_export(directory, kind: str, side: int = 32, names=None):
    """An export that passes for this program's but for `kind`, its classes
    `names` (default c0 to c9)."""
    import tensorflow as tf
    from tensorflow.python.trackable.autotrackable import AutoTrackable

    class Export(AutoTrackable):
        def __init__(self):
            self.w = tf.Variable(tf.ones([10]))
            self.trainable_variables = [self.w]
            self.class_names = [tf.Variable(names or [f"c{i}" for i in range(10)],
                                            trainable=False)]

        @tf.function(input_signature=[tf.TensorSpec([None, side, side, 3], tf.uint8,
                                                    name="images")])
        def serve(self, images):
            pixels = tf.cast(images, tf.float32)
            brightness = tf.reduce_mean(pixels, axis=[1, 2, 3])[:, None]
            x = brightness * self.w
            if kind == "raises":
                tf.debugging.assert_less(tf.reduce_max(x), -1.0, message="boom at run time")
            if kind == "c0 if its top is brighter":
                top = tf.reduce_mean(pixels[:, :side // 2], axis=[1, 2, 3])
                bottom = tf.reduce_mean(pixels[:, side // 2:], axis=[1, 2, 3])
                x = tf.one_hot(tf.zeros_like(top, tf.int32), 10) * (top - bottom)[:, None]
            p = tf.nn.softmax(x)
            if kind == "NaN where bright":
                p = tf.where(brightness > 128, float("nan"), p)
            return {"probabilities": {"strings": tf.strings.as_string(p),
                                      "rank 3": p[:, None, :]}.get(kind, p)}

    export = Export()
    tf.saved_model.save(export, str(directory / "saved_model"),
                        signatures={"serving_default": export.serve})
    return directory


@pytest.mark.parametrize("kind, side, fragment", [
    ("strings", 32, "to float `probabilities` [N, classes]"),
    ("rank 3", 32, "to float `probabilities` [N, classes]"),
    ("huge", 20_000, "(at most 4096 a side)"),
    ("raises", 32, "failed to run (assertion failed: [boom at run time]"),
])
def test_an_export_that_answers_no_probabilities_is_one_error_line(tmp_path, kind, side, fragment):
    """Each passed the load's checks and ended in a traceback; the one that
    takes 20,000 x 20,000 images took 15 GB to classify one."""
    export = _hand_made_export(tmp_path / "export", kind, side)
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    assert_one_error_line(predict(f"--model_dir={export}", photo), fragment)


def test_predict_with_its_output_closed_is_refused(untrained, tmp_path):
    """`predict ... >&-` exited 0 with its answers written nowhere."""
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    result = subprocess.run(["bash", "-c", '"$@" >&-', "predict", sys.executable, "-m",
                             "distributed_mpt.predict", f"--model_dir={untrained}", str(photo)],
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (
        "error: standard output is closed: give the answers somewhere to go")


def test_class_names_are_printed_with_bidi_and_zero_width_characters_escaped(tmp_path):
    """A class named with a right-to-left override reordered the rest of
    the answer's line; a zero-width space hid that two classes differ."""
    names = ["god\u202etac", "ca\u200bt", *(f"c{i}" for i in range(2, 10))]
    export = _hand_made_export(tmp_path / "export", "plain", names=names)
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    result = predict(f"--model_dir={export}", "--top_k=10", photo)
    assert_ok(result)
    assert "god\\u202etac 0.100" in result.stdout and "ca\\u200bt 0.100" in result.stdout
    assert "\u202e" not in result.stdout and "\u200b" not in result.stdout


@pytest.mark.parametrize("evaluate", [False, True], ids=["files", "evaluate"])
def test_an_export_that_answers_nan_is_refused_naming_the_image(tmp_path, evaluate):
    """It printed 'nan' as a probability, and a class as the answer."""
    export = _hand_made_export(tmp_path / "export", "NaN where bright")
    photos = tmp_path / "photos"
    for split in ("train", "test"):
        for i in range(10):
            (photos / split / f"c{i}").mkdir(parents=True)
            Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(
                photos / split / f"c{i}" / "0.png")
    bright = photos / "test" / "c3" / "1.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(bright)
    args = (["--evaluate", "--dataset=image_folder", f"--data_dir={photos}"] if evaluate else
            [photos / "test" / "c0" / "0.png", bright])
    which = ("test image 5 of 11 of --dataset=image_folder (of class c3)" if evaluate else
             str(bright))
    assert_one_error_line(predict(f"--model_dir={export}", *args),
                          f"{export / 'saved_model'} answers NaN, not probabilities, for {which}: "
                          f"it is damaged, or its arithmetic overflows on that image; remove it "
                          f"and run the run's training command again")


def test_model_beside_an_export_is_refused_not_ignored(untrained, tmp_path):
    """--model builds a checkpoint's network: with an export, it was
    ignored without a word, whatever code it named."""
    (tmp_path / "mine.py").write_text("def build(info):\n    raise SystemExit('it ran')\n")
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    result = predict(f"--model_dir={untrained}", f"--model={tmp_path / 'mine.py'}:build", photo)
    assert_one_error_line(result, f"--model={tmp_path / 'mine.py'}:build builds the network of a "
                                  f"run's checkpoint, and {untrained / 'export' / 'saved_model'} "
                                  f"is an export, which holds its network and is used: drop "
                                  f"--model")


def test_a_photo_is_classified_upright_as_its_exif_orientation_says(tmp_path):
    """A phone's photo, stored upside down with an Orientation tag of 3, was
    classified as stored: the top of what it shows taken for its bottom."""
    export = _hand_made_export(tmp_path / "export", "c0 if its top is brighter")
    stored = np.zeros((32, 32, 3), np.uint8)
    stored[16:] = 220  # the bottom as stored: the top, turned as the tag says
    exif = Image.Exif()
    exif[0x0112] = 3
    photo = tmp_path / "photo.jpg"
    Image.fromarray(stored).save(photo, exif=exif, quality=95)
    result = predict(f"--model_dir={export}", photo)
    assert_ok(result)
    assert result.stdout.split(": ")[1].startswith("c0 "), result.stdout


@pytest.mark.parametrize("save", ["keras export()", "tf.saved_model.save"])
def test_another_programs_saved_model_is_named_so_not_called_damaged(tmp_path, save):
    """A Keras model's SavedModel, written by Keras or by TensorFlow, was
    'cannot be loaded (... no attribute 'class_names'): ... run the run's
    training command again', as if this program's export were damaged."""
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    saved_model = tmp_path / "export" / "saved_model"
    if save == "keras export()":
        model.export(str(saved_model), verbose=False)
    else:
        tf.saved_model.save(model, str(saved_model))
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    assert_one_error_line(predict(f"--model_dir={tmp_path / 'export'}", photo),
                          f"{saved_model} is not an export of this program: its serving signature "
                          f"does not map uint8 `images`")


@pytest.mark.parametrize("names, problem", [
    (["", *(f"c{i}" for i in range(1, 10))], "its class name 1 of 10 is empty"),
    (["cat", "Cat ", *(f"c{i}" for i in range(2, 10))], "class names cat and Cat  read as one"),
], ids=["empty", "twice"])
def test_an_exports_class_names_are_checked_as_a_checkpoints_are(tmp_path, names, problem):
    """An export naming a class '' answered 'photo.png:  0.100'; one naming
    two classes alike answered with both, a reader unable to tell which."""
    export = _hand_made_export(tmp_path / "export", "plain", names=names)
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(photo)
    assert_one_error_line(predict(f"--model_dir={export}", photo),
                          f"{export / 'saved_model'} is damaged ({problem}")
