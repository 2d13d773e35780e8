"""What a person watching a run sees: the first progress line soon after the
start, a stop signal answered at once and obeyed within seconds, a second
Ctrl-C that aborts. Real processes: signals and timing are what a user sees."""

import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, SMOKE_FLAGS, assert_ok, read_summary, subprocess_env, train
from distributed_mpt.trainer import _steps_per_call

# A run long enough to be interrupted: resnet9 at full width, whose steps
# take about a second on 2 CPU cores, on synthetic data.
SLOW_RUN = ["--dataset=synthetic", "--synthetic_examples=2048", "--model=resnet9",
            "--train_steps=2000", "--noexport", "--noevaluate"]


class _Run:
    """A training process whose output lines are timestamped as they come."""

    def __init__(self, args):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distributed_mpt.train", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=subprocess_env())
        self.lines = []  # (monotonic time, line)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern, timeout):
        """The time and text of the first line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if re.search(pattern, line):
                    return when, line
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n" +
                    "\n".join(line for _, line in self.lines))

    def finish(self, timeout):
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
            self._reader.join(timeout=5)

    def output(self):
        return "\n".join(line for _, line in self.lines)


def test_progress_starts_soon_and_a_stop_signal_is_answered_at_once(tmp_path):
    run = _Run([*SLOW_RUN, f"--model_dir={tmp_path / 'run'}"])
    started, _ = run.wait_for(r"^resnet9 on synthetic", timeout=120)
    first_step, _ = run.wait_for(r"^step +\d+/2000", timeout=120)
    assert first_step - started < 30, "the first progress line comes within 30 s of the start"

    signalled = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    acknowledged, line = run.wait_for(r"^SIGINT: stopping", timeout=10)
    assert acknowledged - signalled < 1, "Ctrl-C is acknowledged within a second"
    assert "Ctrl-C again to abort" in line
    assert run.finish(timeout=60) == 143, run.output()
    stopped_at = time.monotonic()
    assert stopped_at - signalled < 30, "the stop takes effect within seconds, with a checkpoint"
    assert re.search(r"stopped by a signal at step \d+; checkpoint saved", run.output())
    assert not re.search(r"^[IWE]\d{4} ", run.output(), re.M), "no TensorFlow C++ log lines"


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    run = _Run([*SLOW_RUN, f"--model_dir={tmp_path / 'run'}"])
    run.wait_for(r"^step +\d+/2000", timeout=120)
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"^SIGINT: stopping", timeout=10)
    second = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout=30) == 130, run.output()
    assert time.monotonic() - second < 5, "a second Ctrl-C does not wait for the step under way"
    assert "aborting without a checkpoint" in run.output()


@pytest.mark.parametrize("seconds_per_step, expected", [
    (0.0, 1),      # pace not known yet (the first calls, tracing)
    (2.0, 1),      # slow steps: one per call, so that signals wait at most a step
    (0.1, 10),     # about a second per call
    (1e-4, 50),    # fast steps: --steps_per_loop caps the call
])
def test_loop_calls_last_about_a_second(seconds_per_step, expected):
    assert _steps_per_call(seconds_per_step, steps_per_loop=50) == expected


def test_a_run_signalled_while_it_exports_completes_and_keeps_its_training_figures(tmp_path):
    model_dir = tmp_path / "run"
    run = _Run([*SMOKE_FLAGS, "--train_steps=40", "--export", f"--model_dir={model_dir}"])
    run.wait_for(r"^evaluating on the", timeout=120)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output()
    assert "SIGTERM: stopping once the run is complete" in run.output()
    summary = read_summary(model_dir)
    assert (model_dir / "export" / "saved_model" / "saved_model.pb").exists()
    assert summary["train_loss"] is not None and summary["examples_per_second"] > 0

    # Killed before its summary was written: the rerun completes it, with
    # the training figures from metrics.jsonl.
    (model_dir / "summary.json").unlink()
    assert_ok(train([*SMOKE_FLAGS, "--train_steps=40", f"--model_dir={model_dir}"]))
    rerun = read_summary(model_dir)
    assert rerun["resumed_from_step"] == 40
    assert rerun["train_loss"] == pytest.approx(summary["train_loss"])
    assert rerun["examples_per_second"] > 0  # the last interval's, as logged
