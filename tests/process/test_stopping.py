"""How a training process stops (stopping.py), as a user and a scheduler see
it, with real processes and real signals: a stop waits for the step under way
only, however slow a step is; its acknowledgement starts on a line of its
own; a stop before training exits at once; the helper processes never run
code from the working directory."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMOKE_FLAGS, WatchedProcess, read_terminal, subprocess_env
from distributed_mpt.process import stopping
from distributed_mpt.errors import ExitCode

# Steps of about 2 seconds each on 2 CPU cores (the notebook's MLP at a
# batch of 4096; 2.3 s on an AVX2-only EPYC, alone), which trace in seconds,
# unlike a big CNN's. Slow enough that the loop runs one step per call, as
# it does for any step over a second or so; a slower step proves nothing
# more and costs the suite a minute of CPU.
SLOW_STEPS = ["--dataset=synthetic", "--synthetic_examples=4096", "--model=mlp",
              "--per_replica_batch_size=4096", "--precision=float32", "--learning_rate=0.0001",
              "--train_steps=1000",
              "--log_every_steps=1", "--noexport", "--noevaluate"]


def test_a_stop_waits_for_the_step_under_way_only(tmp_path):
    model_dir = tmp_path / "run"
    run = WatchedProcess("distributed_mpt.train", [*SLOW_STEPS, f"--model_dir={model_dir}"])
    # Step 2's line is the first after tracing: steps 3 and 4 show the pace.
    third, _ = run.wait_for(r"^step +3/", timeout=600)
    fourth, _ = run.wait_for(r"^step +4/", timeout=300)
    step_seconds = fourth - third
    time.sleep(step_seconds / 3)  # well inside step 5
    signalled = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout=step_seconds + 120) == ExitCode.PREEMPTED, run.output()[-3000:]
    took = time.monotonic() - signalled
    print(f"steps of {step_seconds:.1f} s; exit {took:.1f} s after the signal")
    assert took < step_seconds + 10, f"stopped {took:.1f} s after the signal; a step takes " \
                                     f"{step_seconds:.1f} s"
    stopped = re.search(r"stopped by a signal at step (\d+); checkpoint saved", run.output())
    assert stopped and int(stopped.group(1)) <= 5, "no step begun after the signal"
    index = (model_dir / "checkpoints" / "checkpoint").read_text()
    assert f"ckpt-{stopped.group(1)}\"" in index.splitlines()[0]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2],
                         ids=lambda sig: sig.name)
def test_a_closed_terminal_or_slurms_warning_signal_stops_like_sigterm(tmp_path, sig):
    """SIGHUP (a terminal closed, an ssh connection dropped) and SIGUSR1 or
    SIGUSR2 (`sbatch --signal=USR1@120`, ahead of the time limit) ended the
    run at once without a checkpoint: now each saves and exits 143."""
    model_dir = tmp_path / "run"
    run = WatchedProcess("distributed_mpt.train", [*SMOKE_FLAGS, "--train_steps=100000",
                                                   f"--model_dir={model_dir}"])
    run.wait_for(r"^step +\d+/100000", timeout=300)
    run.process.send_signal(sig)
    assert run.finish(timeout=300) == ExitCode.PREEMPTED, run.output()[-3000:]
    # Only a SIGINT aborts: a second one of these would not ("Ctrl-C again" was offered).
    assert (f"{sig.name}: stopping after the steps under way, with a checkpoint; Ctrl-C "
            f"(SIGINT) to abort (exit 130)") in run.output(), run.output()[-3000:]
    stopped = re.search(r"stopped by a signal at step (\d+); checkpoint saved", run.output())
    assert stopped, run.output()[-3000:]
    index = (model_dir / "checkpoints" / "checkpoint").read_text()
    assert f"ckpt-{stopped.group(1)}\"" in index.splitlines()[0]


def test_a_scripts_background_run_ignores_sigint_and_stops_on_sigterm(tmp_path):
    """A shell script's `command &` runs with SIGINT ignored (no job
    control), so `kill -INT` there does nothing, as docs/reliability.md
    says; SIGTERM stops it. Its acknowledgement offered "Ctrl-C again to
    abort", which nothing could do."""
    train = [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS, "--train_steps=100000",
             f"--model_dir={tmp_path / 'run'}"]
    script = f'{shlex.join(train)} &\necho "pid $!"\nwait $!\n'
    run = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO, env=subprocess_env())
    try:
        pid = int(run.stdout.readline().split()[1])
        steps = (line for line in run.stdout if re.match(r"step +\d+/100000", line))
        next(steps)
        os.kill(pid, signal.SIGINT)
        for _ in range(3):  # trained on
            next(steps)
        os.kill(pid, signal.SIGTERM)
        output = run.communicate(timeout=300)[0]
    finally:
        run.kill()
    assert run.returncode == ExitCode.PREEMPTED, output[-3000:]
    assert "SIGINT" not in output, output[-3000:]
    acknowledged = [line for line in output.splitlines() if line.startswith("SIGTERM")]
    assert acknowledged == ["SIGTERM: stopping after the steps under way, with a checkpoint"], \
        output[-3000:]


def test_the_acknowledgement_starts_a_line_of_its_own_on_a_terminal(tmp_path):
    import pty

    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS, "--train_steps=100000",
         "--log_every_steps=100000", f"--model_dir={tmp_path / 'run'}"],
        stdout=terminal, stderr=terminal, cwd=REPO, env=subprocess_env())
    os.close(terminal)
    signalled = []

    def interrupt_once_steps_show(shown):
        if not signalled and len(re.findall(rb"\r\x1b\[Kstep \d+", shown)) >= 3:
            process.send_signal(signal.SIGINT)  # while the status line shows a step
            signalled.append(True)

    shown = read_terminal(controller, interrupt_once_steps_show)
    assert process.wait(timeout=120) == ExitCode.PREEMPTED, shown[-2000:]
    acknowledged = shown.index(b"SIGINT: stopping")
    assert shown[:acknowledged].endswith((b"\r\x1b[K", b"\n")), shown[acknowledged - 80:]


def test_a_stop_before_training_exits_at_once_having_trained_nothing(tmp_path):
    # Once TensorFlow has started (its start-up watchdog came and went: a
    # stop during the start-up is startup_watchdog.py's, test_startup_stop.py),
    # the run prepares its data and model: 50,000 synthetic images and the
    # MLP take a second or more, and a stop there exits at once.
    model_dir = tmp_path / "run"
    run = WatchedProcess("distributed_mpt.train", [*SMOKE_FLAGS, "--synthetic_examples=50000",
                                                   "--train_steps=100", f"--model_dir={model_dir}"])
    deadline = time.monotonic() + 300
    while not _children(run.process.pid, "distributed_mpt.process.startup_watchdog"):
        assert time.monotonic() < deadline and run.process.poll() is None, run.output()
        time.sleep(0.01)
    while _children(run.process.pid, "distributed_mpt.process.startup_watchdog"):
        assert time.monotonic() < deadline and run.process.poll() is None, run.output()
        time.sleep(0.01)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == ExitCode.PREEMPTED, run.output()[-3000:]
    assert "SIGTERM before training started" in run.output(), run.output()[-3000:]
    assert "Traceback" not in run.output()
    assert not model_dir.exists(), "a stop before training leaves no new --model_dir"


def _children(pid: int, command: str) -> list:
    """The child processes of `pid` whose command line holds `command`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and command in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


PLANTED = """import pathlib
pathlib.Path({marker!r}).write_text("the planted package ran")
raise SystemExit(99)
"""


@pytest.fixture
def planted(tmp_path):
    """A working directory holding a `distributed_mpt/` that marks it ran."""
    marker = tmp_path / "planted-ran"
    package = tmp_path / "cwd" / "distributed_mpt"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    return package.parent, marker


def test_the_planted_package_would_run_under_plain_python_m(planted):
    cwd, marker = planted
    subprocess.run([sys.executable, "-m", "distributed_mpt.process.log_filter"], cwd=cwd, input=b"",
                   capture_output=True, timeout=60)
    assert marker.exists(), "the fixture plants what `python -m` picks up"


def test_helper_processes_never_import_from_the_working_directory(planted, tmp_path):
    cwd, marker = planted
    launcher = Path(sys.executable).parent / "distributed-mpt-launch"
    # The worker (and its log filter) starts and refuses the model_dir:
    # both ran the installed package, or the planted one would have exited 99.
    result = subprocess.run(
        [str(launcher), "--num_workers=1", "--max_restarts=0", "--", *SMOKE_FLAGS,
         "--model_dir=/proc/not-writable"],
        cwd=cwd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert result.returncode == ExitCode.USAGE, result.stdout + result.stderr
    assert "is not writable" in result.stderr
    # The start-up watchdog: its deadline ends the shell that started it.
    watchdog = shlex.join(stopping.helper_command("distributed_mpt.process.startup_watchdog"))
    shell = subprocess.run(["sh", "-c", f"{watchdog} $$ 0.5 '' '' 0; sleep 60"], cwd=cwd,
                           capture_output=True, text=True, timeout=60)
    assert shell.returncode == -stopping.PEER_TIMEOUT_SIGNAL, shell.stderr
    assert not marker.exists(), marker.read_text()
