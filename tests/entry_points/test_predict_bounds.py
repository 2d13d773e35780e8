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
