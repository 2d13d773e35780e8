"""A reader that goes away (`| head`, or a `| tee` ended by the same Ctrl-C
that stops training) ends no entry point: what nobody reads is dropped. A
console that cannot be written is one error line."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, SMOKE_FLAGS, subprocess_env
from distributed_mpt.errors import ExitCode


def _pipe_nobody_reads() -> int:
    """The write end of a pipe whose reader has already gone: the first
    write to it fails, whenever it comes."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("module", ["distributed_mpt.train", "distributed_mpt.predict",
                                    "distributed_mpt.launch", "distributed_mpt.prepare_data",
                                    "distributed_mpt.benchmark"])
def test_help_into_a_pipe_nobody_reads_is_no_error(module):
    output = _pipe_nobody_reads()
    try:
        result = subprocess.run([sys.executable, "-m", module, "--help"], stdout=output,
                                stderr=output, cwd=REPO, env=subprocess_env(), timeout=120)
    finally:
        os.close(output)
    # A BrokenPipeError's traceback (which nobody could read either) exits 1.
    assert result.returncode == ExitCode.OK


@pytest.mark.parametrize("module", ["distributed_mpt.train", "distributed_mpt.predict",
                                    "distributed_mpt.launch", "distributed_mpt.prepare_data",
                                    "distributed_mpt.benchmark"])
def test_output_to_a_full_disk_is_one_error_line(module):
    env = subprocess_env()
    del env["PYTHONUNBUFFERED"]  # as a user runs it: buffered, so the write fails at the end
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC
        result = subprocess.run([sys.executable, "-m", module, "--help"], stdout=full,
                                stderr=subprocess.PIPE, text=True, cwd=REPO, env=env, timeout=120)
        assert result.returncode == ExitCode.USAGE
        assert result.stderr == ("error: cannot write standard output (No space left on device): "
                                 "free space where it goes, or send it elsewhere\n")
        # With stderr full too, there is nobody to tell: the exit code says it.
        result = subprocess.run([sys.executable, "-m", module, "--help"], stdout=full,
                                stderr=full, cwd=REPO, env=env, timeout=120)
        assert result.returncode == ExitCode.USAGE


def test_help_with_stdout_closed_is_no_error():
    # Python's sys.stdout is then None: console.py gives it /dev/null, and
    # the help goes there without an error.
    result = subprocess.run([sys.executable, "-m", "distributed_mpt.train", "--help"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.close(1), cwd=REPO, env=subprocess_env(),
                            timeout=120)
    assert result.returncode == ExitCode.OK and not result.stderr, result.stderr[-2000:]


def test_a_run_with_its_console_closed_trains_to_the_end(model_dir):
    # `>&- 2>&-`: Python's sys.stdout and sys.stderr are None, and the next
    # files opened would get descriptors 1 and 2.
    result = subprocess.run(
        [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS, "--train_steps=4",
         f"--model_dir={model_dir}"], preexec_fn=lambda: (os.close(1), os.close(2)), cwd=REPO,
        env=subprocess_env(), timeout=120)
    assert result.returncode == ExitCode.OK
    assert json.loads((model_dir / "summary.json").read_text())["steps"] == 4


def test_a_run_whose_reader_left_still_stops_with_its_checkpoint(model_dir, tmp_path):
    output = _pipe_nobody_reads()
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS, "--train_steps=100000",
             f"--model_dir={model_dir}"],
            stdout=output, stderr=stderr, cwd=REPO, env=subprocess_env())
    os.close(output)
    try:
        # Its start line and its first progress lines went nowhere, and it trains on.
        metrics = model_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    finally:
        process.kill()
    said = (tmp_path / "stderr").read_text()
    assert code == ExitCode.PREEMPTED, said[-3000:]
    stopped = int(re.search(r"stopped at step (\d+) after a checkpoint", said).group(1))
    assert (model_dir / "checkpoints" / f"ckpt-{stopped}.index").exists()


def test_a_long_wait_before_the_first_line_of_progress_is_said(capsys):
    """An image folder of 100,000 files was decoded for 7 minutes before a
    run's first line (found by a probe of image folders)."""
    from distributed_mpt.process import console

    with console.lines_while("reading --dataset=image_folder", 0.05):
        time.sleep(1)
    with console.lines_while("a chief's only", 0.05, say=False):
        time.sleep(0.2)
    time.sleep(0.2)  # nothing more once the block is over
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(re.fullmatch(
        r"reading --dataset=image_folder: \d+ s so far", line) for line in lines), lines
