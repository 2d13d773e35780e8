"""Shared helpers: run the real entry points as separate processes."""

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# Imported before any test imports TensorFlow: the package picks
# TensorFlow's CPU kernels as it is imported (distributed_mpt/__init__.py),
# and a run a test starts in this process must compute with the kernels of
# the runs it starts as processes (a resumed run is compared with an
# uninterrupted one to 1e-5).
import distributed_mpt  # noqa: F401
from distributed_mpt.process.run_lock import LOCK_NAME

REPO = Path(__file__).resolve().parents[1]


def _ignoring_as_children_do_not_inherit():
    """The processes a test starts stand for commands run from a terminal.
    A runner that ignores a stop signal (nohup's SIGHUP; a shell's
    `command &`, SIGINT) would have them inherit it ignored, and a command
    then rightly keeps ignoring it (process/start_guard.py): a test of
    SIGHUP timed out under `nohup .ci/run`. A handler that does nothing keeps
    this process (and, by the variable, pytest-xdist's workers) as deaf to
    it as the runner asked, and every exec of a child resets a handled
    signal to its default."""
    ignored = set(filter(None, os.environ.get("DISTRIBUTED_MPT_TESTS_IGNORE", "").split(",")))
    for sig in (signal.SIGHUP, signal.SIGINT):
        if signal.getsignal(sig) is signal.SIG_IGN or sig.name in ignored:
            signal.signal(sig, lambda signum, frame: None)
            ignored.add(sig.name)
    os.environ["DISTRIBUTED_MPT_TESTS_IGNORE"] = ",".join(sorted(ignored))


_ignoring_as_children_do_not_inherit()

# A small, fast run: the notebook's MLP on learnable synthetic data.
SMOKE_FLAGS = [
    "--dataset=synthetic", "--synthetic_examples=1024", "--model=mlp",
    "--per_replica_batch_size=32", "--learning_rate=0.1", "--warmup_epochs=0",
    "--weight_decay=0", "--steps_per_loop=5", "--log_every_steps=10", "--noexport",
]


# For tests of several workers that train more than a few steps: small
# gradients. Each step's all-reduce of the MLP's 12 million weights took most
# of a second over gRPC on 2 cores of an Intel Xeon (AVX-512, AMX); airbench at
# width 4 has 9,184 weights, and at this rate reached 0.72 on the synthetic
# test split in 20 steps of batch 32 there.
SMALL_MODEL = ["--model=airbench", "--model_width=4", "--learning_rate=3"]

# A tiny cpu_cnn94_muon with every option of the 2025 record on, on synthetic
# data (32x32): 8 steps an epoch at its global batch of 32.
RECORD = ["--dataset=synthetic", "--synthetic_examples=256", "--model=airbench",
          "--model_width=8", "--per_replica_batch_size=32", "--lr_schedule=linear",
          "--warmup_epochs=0", "--shift_lr_multiplier=64", "--whiten_bias_epochs=1",
          "--crop_padding=2", "--flip=alternating", "--precision=float32", "--noexport",
          "--optimizer=muon", "--muon_renormalize=periodic", "--muon_weight_decay=0.05",
          "--muon_newton_schulz=speedrun2025", "--brightness_jitter=0.14",
          "--contrast_jitter=0.13"]


def group_settings(peak_learning_rate: float, steps_per_epoch: int = 1, total_steps: int = 0,
                   **flags):
    """core/optim/groups.py's Settings from flags by name; the model's
    defaults that the groups do not read at neutral values."""
    from distributed_mpt.core.optim.groups import MuonOptions, OptimizerOptions, Settings

    muon = {name: flags.pop(name) for name in list(flags) if name.startswith("muon_")}
    optimizer = OptimizerOptions(**{"learning_rate": 0.1, "max_learning_rate": 0.0,
                                    "label_smoothing": 0.0, **flags})
    return Settings(optimizer, peak_learning_rate, MuonOptions(**muon), steps_per_epoch,
                    total_steps)


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **extra})
    return env


def run_module(module: str, args, timeout: float = 300, env=None, wrapper=None):
    """Runs `python -m module args` (or a wrapper script) and returns the result."""
    command = [sys.executable]
    command += [str(wrapper), *args] if wrapper else ["-m", module, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=env or subprocess_env(), cwd=REPO)


class WatchedProcess:
    """`python -m module args`, whose output lines (stdout and stderr
    together) are collected as they come, each with the time it arrived."""

    def __init__(self, module, args, env=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *[str(a) for a in args]], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env or subprocess_env())
        self.lines = []  # (time.monotonic(), line)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern, timeout):
        """The time and the match of the first line matching `pattern`;
        fails the test after `timeout` seconds, or when the process ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return when, match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n{self.output()[-4000:]}")

    def finish(self, timeout):
        """The exit status, once the process has ended (killed after
        `timeout` seconds)."""
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
            self._reader.join(timeout=5)

    def output(self):
        return "\n".join(line for _, line in self.lines)


def train(args, **kwargs):
    """Runs the real training entry point: in this process, where a separate
    one adds nothing (TensorFlow's start-up is paid once), else as
    `python -m distributed_mpt.train` (an environment of its own, logical
    CPU devices, which TensorFlow configures once per process)."""
    args = [str(a) for a in args]
    if kwargs or any(a.startswith(("--cpu_replicas", "--strategy=mirrored")) for a in args):
        return run_module("distributed_mpt.train", args, **kwargs)
    from distributed_mpt.train import main
    return run_in_process(main, args)


def run_in_process(main, args) -> subprocess.CompletedProcess:
    """Calls an entry point's `main(args)` with its output captured as a
    process's would be (file descriptors 1 and 2 included, which TensorFlow
    and the log filter write to)."""
    import contextlib
    import tempfile

    import keras

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        stdout = open(1, "w", buffering=1, closefd=False)
        stderr = open(2, "w", buffering=1, closefd=False)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main(args)
        finally:
            stdout.flush()
            stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            # The run set the global precision policy; the next test builds
            # its own models.
            keras.mixed_precision.set_global_policy("float32")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, code, out.read().decode(), err.read().decode())


def read_terminal(controller: int, on_output=None) -> bytes:
    """All that a process writes to the pseudo-terminal `controller` until it
    closes it; `on_output(everything so far)` is called after each chunk."""
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
        if on_output:
            on_output(shown)
    return shown


def read_summary(model_dir) -> dict:
    return json.loads((Path(model_dir) / "summary.json").read_text())


def checkpoint_weights(model_dir) -> dict:
    """Every saved value of the latest checkpoint in model_dir (weights,
    optimizer slots, batch-norm statistics, step counters), by name."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(Path(model_dir) / "checkpoints"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name not in ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE")}


def weights_of_one_and_two_replicas(common, tmp_path, global_batch: int = 32, two_only=()):
    """Trains `common` flags on one replica and on two (logical CPU devices)
    at the same global batch, each into a model directory of its own under
    tmp_path (`two_only`: flags of the second run alone); returns both final
    checkpoints (`checkpoint_weights`), which hold the same names."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(train([*common, "--strategy=default", f"--per_replica_batch_size={global_batch}",
                     f"--model_dir={one}"]))
    assert_ok(train([*common, "--strategy=mirrored", "--cpu_replicas=2", *two_only,
                     f"--per_replica_batch_size={global_batch // 2}", f"--model_dir={two}"]))
    assert read_summary(two)["num_replicas"] == 2
    single, mirrored = checkpoint_weights(one), checkpoint_weights(two)
    assert single.keys() == mirrored.keys()
    return single, mirrored


def weights_of_whole_and_resumed(common, tmp_path, steps: int):
    """Trains `common` flags (a run of `steps` steps) once uninterrupted and
    once stopped by SIGTERM after its first progress line, then resumed;
    returns both final checkpoints (`checkpoint_weights`), which hold the
    same names."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert_ok(train([*common, f"--model_dir={whole}"]))
    run = WatchedProcess("distributed_mpt.train", [*common, f"--model_dir={stopped}"],
                         env=subprocess_env())
    run.wait_for(rf"^step +\d+/{steps}", timeout=300)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == 143, run.output()
    assert_ok(train([*common, f"--model_dir={stopped}"]))
    assert 0 < read_summary(stopped)["resumed_from_step"] < steps
    expected, resumed = checkpoint_weights(whole), checkpoint_weights(stopped)
    assert expected.keys() == resumed.keys()
    return expected, resumed


def assert_same_weights(got: dict, want: dict, rtol: float, atol: float) -> None:
    """Every value of two `checkpoint_weights` equal within the bounds, each
    failure named by its checkpoint key."""
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def assert_one_error_line(result, fragment, exit_code=2):
    """A refusal as the user must see it: `exit_code`, no traceback, and
    exactly one `error:` line, which holds `fragment`."""
    assert result.returncode == exit_code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr[-2000:]


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"


@pytest.fixture
def model_dir(tmp_path):
    return tmp_path / "run"


def write_cifar10_binary(directory: Path) -> Path:
    """Writes files in the format of CIFAR-10's official binary release
    (full size, 10,000 records each: label byte, then R, G, B planes) into
    `directory/cifar-10-batches-bin/`; labels cycle 0..9 and each image is
    its label's grey level, so the layout can be checked pixel by pixel;
    the G plane is 100 in the first file, 101 in the next (files that are
    copies of one another are refused)."""
    import numpy as np

    out = Path(directory) / "cifar-10-batches-bin"
    out.mkdir(parents=True)
    labels = np.arange(10_000, dtype=np.uint8) % 10
    records = np.repeat(labels[:, None], 1 + 3072, axis=1)
    for i, name in enumerate([f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]):
        records[:, 1 + 1024:1 + 2048] = 100 + i  # the G plane: tells planes from pixels
        records.tofile(out / name)
    return out


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs; skipped where this process may not mount one."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")

    def resize(megabytes):
        subprocess.run(["mount", "-o", f"remount,size={megabytes}m", str(mount_point)], check=True)

    yield mount_point, resize
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def make_path(kind: str, path: Path) -> Path:
    """Something of `kind` at `path` (or instead of it), which no reader may
    take for its file or directory: "FIFO", "directory", "socket", "device"
    (/dev/zero itself, returned: endless, where a read has no bound), "link
    to /dev/zero", "dangling symlink", "symlink loop" or "file of NUL bytes"."""
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":  # as bind() leaves one; bind() limits the path's length
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "device":
        return Path("/dev/zero")
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "dangling symlink":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "symlink loop":
        path.symlink_to(path)
    elif kind == "file of NUL bytes":
        path.write_bytes(b"\0" * 4096)
    else:
        raise ValueError(f"no path of kind {kind!r}")
    return path


def snapshot(*paths, directory_times: bool = False, lock_time: bool = False) -> dict:
    """Every entry at and under `paths`, links not followed: its kind, size,
    modification time, a link's target and a regular file's SHA-256. A
    directory's time only if `directory_times` (a probe file made and
    removed changes it: files.check_writable), the lock file's only if
    `lock_time` (every run that reads a run's state takes it, its content as
    it was)."""
    state = {}
    for top in paths:
        entries = [str(top)]
        if os.path.isdir(top) and not os.path.islink(top):
            for root, dirs, names in os.walk(top):
                entries += [os.path.join(root, n) for n in dirs + names]
        for entry in entries:
            try:
                s = os.lstat(entry)
            except FileNotFoundError:
                state[entry] = None
                continue
            if stat.S_ISDIR(s.st_mode):
                state[entry] = ("directory", s.st_mtime_ns if directory_times else None)
                continue
            content = (hashlib.sha256(Path(entry).read_bytes()).hexdigest()
                       if stat.S_ISREG(s.st_mode) else
                       os.readlink(entry) if stat.S_ISLNK(s.st_mode) else None)
            mtime = (None if os.path.basename(entry) == LOCK_NAME and not lock_time
                     else s.st_mtime_ns)
            state[entry] = (stat.S_IFMT(s.st_mode), s.st_size, mtime, content)
    return state


def made_a_fifo_when_checked(monkeypatch, path: Path) -> None:
    """Replaces the regular file at `path` with a FIFO right after the next
    os.stat of it, which still sees the file: a path changed between a
    reader's check and its open."""
    real_stat, swapped = os.stat, []

    def stat_then_swap(target, *args, **kwargs):
        result = real_stat(target, *args, **kwargs)
        if not swapped and os.fspath(target) == os.fspath(path):
            swapped.append(path)
            os.remove(path)
            os.mkfifo(path)
        return result

    monkeypatch.setattr(os, "stat", stat_then_swap)


@contextlib.contextmanager
def deadline(seconds: int):
    """Raises TimeoutError in the block after `seconds`: a read of a FIFO
    would block forever (Python runs the handler when the blocked system
    call is interrupted), and a test fails instead of hanging."""
    def expire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
