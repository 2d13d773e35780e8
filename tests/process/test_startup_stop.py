"""A worker asked to stop while it starts: Kubernetes sends SIGTERM when a
pod is deleted in a rollout, or Kueue preempts a job that has just started,
often while TensorFlow is still being imported or the worker waits for its
peers. It must end within seconds, with a code its restart policy retries
(stopping.py, startup_watchdog.py).

Times are measured from when the worker can act on the signal (its start-up
watchdog is running, or its gRPC server listens), not from the process's
start, and printed; the bound is generous for a loaded machine, the figure
is what to read (docs/reliability.md states it with its load)."""

import ast
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMOKE_FLAGS, subprocess_env
from distributed_mpt import errors

BOUND_SECONDS = 10  # the target is 2 s; a loaded CI machine gets five times that


def _children(pid: int):
    """The command lines of `pid`'s child processes."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in children:
            try:
                found.append((int(child), Path(f"/proc/{child}/cmdline").read_bytes()))
            except OSError:
                pass
    return found


def _wait_until(condition, timeout: float, what: str, process):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the worker ended before {what}:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _start(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "distributed_mpt.train", *args], cwd=REPO,
                            env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _stop_and_time(process) -> float:
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    finally:
        process.kill()
    return time.monotonic() - signalled


def test_sigterm_while_tensorflow_is_imported_ends_the_worker_at_once(tmp_path):
    process = _start([*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={tmp_path / 'run'}"])
    # The watchdog starts right before `import tensorflow`, which then takes
    # seconds: the signal comes while TensorFlow is imported.
    _wait_until(lambda: any(b"startup_watchdog" in cmd for _, cmd in _children(process.pid)),
                120, "start-up watchdog", process)
    seconds = _stop_and_time(process)
    output = process.stdout.read()
    print(f"ended {seconds:.2f} s after SIGTERM during TensorFlow's import")
    assert process.returncode == -signal.SIGKILL, output  # 137: retryable
    assert errors.ExitCode(128 + signal.SIGKILL).retryable
    assert "SIGTERM while TensorFlow started: stopping" in output
    assert seconds < BOUND_SECONDS, output
    assert not (tmp_path / "run").exists(), "a stop during start-up leaves no new --model_dir"


def test_sigusr1_while_tensorflow_is_imported_is_a_stop_like_sigterm(tmp_path):
    """What `sbatch --signal=USR1@120` sends: held pending while TensorFlow
    starts, and acted on by the start-up watchdog (it ended the worker with
    no word, exit 138, and left a new --model_dir behind)."""
    process = _start([*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={tmp_path / 'run'}"])
    _wait_until(lambda: any(b"startup_watchdog" in cmd for _, cmd in _children(process.pid)),
                120, "start-up watchdog", process)
    process.send_signal(signal.SIGUSR1)
    process.wait(timeout=120)
    output = process.stdout.read()
    assert process.returncode == -signal.SIGKILL, output  # 137: retryable
    assert "SIGUSR1 while TensorFlow started: stopping" in output
    assert not (tmp_path / "run").exists(), "a stop during start-up leaves no new --model_dir"


def test_sigterm_while_waiting_for_peers_ends_the_worker_at_once(tmp_path):
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                 "task": {"type": "worker", "index": 0}}
    process = _start([*SMOKE_FLAGS, "--train_steps=10", "--peer_timeout_seconds=600",
                      f"--model_dir={tmp_path / 'run'}"],
                     env=subprocess_env(TF_CONFIG=json.dumps(tf_config)))

    def listening():  # its gRPC server is up: it waits for worker 1, which never comes
        with socket.socket() as client:
            return client.connect_ex(("127.0.0.1", ports[0])) == 0

    _wait_until(listening, 180, "gRPC server", process)
    seconds = _stop_and_time(process)
    output = process.stdout.read()
    print(f"ended {seconds:.2f} s after SIGTERM while waiting for its peer")
    assert process.returncode == -signal.SIGKILL, output
    assert "SIGTERM while TensorFlow started: stopping" in output
    assert seconds < BOUND_SECONDS, output
    assert not (tmp_path / "run" / "checkpoints").exists(), "nothing trained"


def test_sigterm_before_tensorflow_exits_preempted(tmp_path):
    # Before the watchdog: the stop-signal thread exits at once with 143.
    process = _start([*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={tmp_path / 'run'}"])
    time.sleep(0.05)  # Python itself is starting: the signal is pending or handled at once
    seconds = _stop_and_time(process)
    print(f"ended {seconds:.2f} s after an early SIGTERM with {process.returncode}")
    # Killed by the default handler before ours is installed (-15), or ours: 143.
    assert process.returncode in (-signal.SIGTERM, errors.ExitCode.PREEMPTED)
    assert seconds < BOUND_SECONDS
    assert not (tmp_path / "run").exists()


def test_a_stop_just_after_the_lock_is_taken_leaves_no_new_model_dir(tmp_path):
    """The lock and the marker are written before TensorFlow starts; a stop
    then (here: as soon as the lock file appears) exited at once and left
    the new directory behind, holding them."""
    model_dir = tmp_path / "run"
    process = _start([*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={model_dir}"])
    _wait_until(lambda: (model_dir / ".lock").exists(), 120, "lock file", process)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    output = process.stdout.read()
    assert process.returncode in (errors.ExitCode.PREEMPTED, -signal.SIGKILL), output
    assert not model_dir.exists(), f"left {sorted(p.name for p in model_dir.iterdir())}"


def _silent_peers(count: int):
    """`count` listening sockets whose accept queues are full, so that a
    connection's SYN is dropped, as a lost node's or a firewall's; and the
    sockets to close."""
    held = []
    for _ in range(count):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        held.append(listener)
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            held.append(filler)
    time.sleep(0.5)
    return [f"127.0.0.1:{s.getsockname()[1]}" for s in held[::4]], held


def test_the_peers_not_up_at_the_deadline_are_named_at_once():
    """They were probed one after the other, 2 s each: 40 peers that drop
    connections held a 10-second deadline for 91 s, stop signals unheeded."""
    from distributed_mpt.process import startup_watchdog

    silent, held = _silent_peers(40)
    up = [socket.create_server(("127.0.0.1", 0))]
    if socket.has_ipv6:
        try:
            up.append(socket.create_server(("::1", 0), family=socket.AF_INET6))
        except OSError:
            pass
    answering = [f"127.0.0.1:{up[0].getsockname()[1]}"] + \
        [f"[::1]:{s.getsockname()[1]}" for s in up[1:]]
    try:
        began = time.monotonic()
        missing = startup_watchdog._not_up([*answering, *silent])
        seconds = time.monotonic() - began
    finally:
        for s in held + up:
            s.close()
    print(f"41+ peers probed in {seconds:.2f} s")
    assert missing == silent, "the peers that answer, over IPv6 too, are not named"
    assert seconds < startup_watchdog.PROBE_SECONDS + BOUND_SECONDS


def test_thousands_of_peers_are_waited_for_under_a_small_stack_limit(tmp_path):
    """The watchdog was given every peer's address on its command line,
    which with TF_CONFIG in its environment as well held more than the
    kernel takes under `ulimit -s 768` (a quarter of the stack: 192 KiB):
    E2BIG, a traceback and exit 1 before TensorFlow started. It is given
    the peers it probes, and their count."""
    workers = [f"127.0.0.1:{10_000 + i}" for i in range(5_000)]
    env = subprocess_env(TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                               "task": {"type": "worker", "index": 1}}))
    result = subprocess.run(
        ["prlimit", f"--stack={768 * 1024}", sys.executable, "-m", "distributed_mpt.train",
         *SMOKE_FLAGS, "--peer_timeout_seconds=1", f"--model_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    # Ended by the watchdog's signal: 142 to a shell.
    assert errors.status_of_signal(-result.returncode) == errors.ExitCode.PEER_TIMEOUT, \
        result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "127.0.0.1:10000, 127.0.0.1:10002" in result.stderr
    assert "(and 4,935 not probed)" in result.stderr


# Every command, run as a user runs it, with what it would do for seconds if
# no stop came.
_COMMANDS = ["train", "launch", "benchmark", "predict", "prepare_data", "recipes.measure",
             "distributed-mpt-train", "-mdistributed_mpt.train"]


def _command(name: str, tmp: Path) -> list:
    model_dir = f"--model_dir={tmp / 'run'}"
    train = [*SMOKE_FLAGS, "--train_steps=10", model_dir]
    if name.startswith("distributed-mpt-"):  # the console script
        return [str(Path(sys.executable).with_name(name)), *train]
    if name.startswith("-m"):  # the module joined to -m
        return [sys.executable, name, *train]
    args = {"train": train, "launch": ["--num_workers=1", "--", *train],
            "benchmark": ["--tiny", f"--output={tmp / 'bench.json'}"],
            "predict": ["--evaluate", "--dataset=synthetic", model_dir],
            "prepare_data": [f"--data_dir={tmp / 'data'}"],
            "recipes.measure": ["--recipe=cpu_cnn94", "--seeds=0", f"--runs_dir={tmp / 'run'}",
                                "--ledger="]}[name]
    return [sys.executable, "-m", f"distributed_mpt.{name}", *args]


def _importing(pid: int) -> bool:
    """Whether process `pid` has loaded an extension module. The interpreter
    loads none as it starts (site, runpy, a console script's first lines):
    the process is importing the command's modules, past the package's
    __init__, whose first lines guard the start (start_guard.guard_the_start)."""
    try:
        return ".cpython-" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # it ended
        return True


# A SIGTERM before the package's first line is SIGTERM's default, 143 to a
# shell: test_sigterm_before_tensorflow_exits_preempted sends one that early.
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
@pytest.mark.parametrize("name", _COMMANDS)
def test_a_stop_while_a_command_starts_is_one_line_and_its_stop_code(name, sig, tmp_path):
    """Ctrl-C while a command imported its modules printed a KeyboardInterrupt
    traceback (exit 1 or 130), and SIGTERM ended it without a word. Now each
    exits as a stop before its start says: 143; 130 for a Ctrl-C to one that
    Ctrl-C aborts (cli.interrupted): all but training and its launcher."""
    command = _command(name, tmp_path)
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed")
    process = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Not before: a Ctrl-C while the interpreter itself starts is Python's.
        deadline = time.monotonic() + 120
        while not _importing(process.pid):
            assert time.monotonic() < deadline, "no extension module loaded within 120 s"
            time.sleep(0.001)
        process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    status = 128 - process.returncode if process.returncode < 0 else process.returncode
    trains = "train" in name or name == "launch"
    expected = {errors.ExitCode.ABORTED if sig == signal.SIGINT and not trains
                else errors.ExitCode.PREEMPTED}
    if trains:  # on a loaded machine the signal may come as late as TensorFlow's import
        expected.add(errors.ExitCode.KILLED)
    assert status in expected and "Traceback" not in out + err, out + err
    # SIGTERM's default would give 143 too, without a word
    assert len(err.splitlines()) == 1 and err.startswith(sig.name), err
    assert not (tmp_path / "run").exists()


def _ignoring_hangup_and_ctrl_c():
    """As `nohup` starts a command (SIGHUP ignored), and a shell without job
    control its `command &` (SIGINT ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("name", ["predict", "train"])
def test_the_stop_signals_a_command_inherits_ignored_stay_ignored(name, tmp_path):
    """`nohup distributed-mpt-train &` ended with 143 when the terminal closed
    as it started, and once training stopped with a checkpoint; `command &`
    in a script took the script's Ctrl-C. SIGHUP and SIGINT, sent again and
    again from its start to its end, now leave it running to its own end:
    predict's error for a missing directory, or a finished run."""
    args = {"predict": ["--evaluate", "--dataset=synthetic", f"--model_dir={tmp_path / 'none'}"],
            "train": [*SMOKE_FLAGS, "--train_steps=10", f"--model_dir={tmp_path / 'run'}"]}
    process = subprocess.Popen([sys.executable, "-m", f"distributed_mpt.{name}", *args[name]],
                               cwd=REPO, env=subprocess_env(), text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, preexec_fn=_ignoring_hangup_and_ctrl_c)
    deadline = time.monotonic() + 300
    try:
        while process.poll() is None and time.monotonic() < deadline:
            for sig in (signal.SIGHUP, signal.SIGINT):
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)
            time.sleep(0.01)
    finally:
        process.kill()
    output = process.communicate()[0]
    assert process.returncode == (errors.ExitCode.USAGE if name == "predict" else 0), output
    assert "SIGHUP" not in output and "SIGINT" not in output, output


_SPAWNING = """
import multiprocessing, signal, sys
import distributed_mpt

def child():
    print("child", signal.getsignal(signal.SIGINT).__name__, flush=True)

if __name__ == "__main__":
    print("command", signal.getsignal(signal.SIGINT).__name__, flush=True)
    process = multiprocessing.get_context(sys.argv[1]).Process(target=child)
    process.start()
    process.join()
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_child_process_of_a_command_is_not_guarded(start_method, tmp_path):
    """A multiprocessing child of a command (a Pool in a user's model code)
    copies the command's sys.argv, and was guarded as the command: Ctrl-C
    ended each with "SIGINT while starting ... nothing was done yet" at any
    time, as nothing ever ended its guard. Python starts it with `-c`: it
    handles Ctrl-C as Python does, while the command itself is guarded."""
    script = tmp_path / "distributed-mpt-predict"  # what a console script runs
    script.write_text(_SPAWNING)
    result = subprocess.run([sys.executable, str(script), start_method], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[:2] == ["command _stop_while_starting",
                                             "child default_int_handler"], result


# The modules with a `__main__` that are no command of the package's users:
# a stop while they start is theirs to handle, or Python's.
_NOT_GUARDED = {
    "benchmark.cells": "a process of the benchmark, which ends it when it is stopped",
    "benchmark.allreduce": "a process of the benchmark, which ends it when it is stopped",
    "recipes.ledger": "a maintainer's tool, handling no stop of its own: Ctrl-C is Python's",
}


def _runs_as_main(path) -> bool:
    """Whether the module has a top-level `if __name__ == ...` block (not
    the words in a docstring: core/models/signature.py speaks of them)."""
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and getattr(node.test.left, "id", None) == "__name__"
               for node in ast.parse(path.read_text()).body)


def test_every_command_and_helper_is_guarded_as_it_starts():
    """The commands that start_guard guards are a list beside setup.py's
    console scripts and the modules run with `python -m`: a command added to
    one and not the other would print a traceback on a Ctrl-C as it starts."""
    from distributed_mpt.process import start_guard

    table = start_guard._CTRL_C_WHILE_STARTING
    scripts = re.findall(r'"(distributed-mpt-[\w-]+)=distributed_mpt\.([\w.]+):',
                         (REPO / "setup.py").read_text())
    assert scripts, "setup.py's console_scripts are where this test looks"
    for script, module in scripts:
        assert start_guard.command_of([sys.executable, f"/venv/bin/{script}"]) == module, script
    mains = {path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
             for path in (REPO / "distributed_mpt").rglob("*.py")
             if _runs_as_main(path) or path.name == "__main__.py"}
    for main in mains:
        command = start_guard.command_of([sys.executable, "-m", main.removesuffix(".__main__")])
        assert command in table or command in _NOT_GUARDED, f"{main} is in neither list"
    assert set(table).isdisjoint(_NOT_GUARDED)


def test_a_helper_process_passes_its_lines_on_through_a_ctrl_c():
    """The log filter, started as a run starts it, outlives a Ctrl-C to the
    process group and passes on what its writer writes until it is done."""
    from distributed_mpt.process import stopping

    process = subprocess.Popen(stopping.helper_command("distributed_mpt.process.log_filter"),
                               cwd=REPO, env=subprocess_env(), stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not _importing(process.pid):  # past the package's __init__
            assert time.monotonic() < deadline, "no extension module loaded within 120 s"
            time.sleep(0.001)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(b"after Ctrl-C\n", timeout=120)
    finally:
        process.kill()
    assert (process.returncode, out, err) == (0, b"after Ctrl-C\n", b"")
