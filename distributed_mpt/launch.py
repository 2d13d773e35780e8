"""Start N local worker processes for multi-worker training, and restart the
group when one dies.

    distributed-mpt-launch --num_workers=2 --max_restarts=3 -- \\
        --dataset=synthetic --model=mlp --train_steps=200 --model_dir=runs/mw

Each worker is `python -P -m distributed_mpt.train <train flags>` with its own TF_CONFIG on
127.0.0.1 and a port free on every address of this host; its output is prefixed with
`[worker i]` (`distributed-mpt-launch -- --help` lists the train flags, once). Ctrl-C,
SIGTERM and the other stop signals (SIGHUP, SIGUSR1, SIGUSR2) are passed on to every
worker, which save a checkpoint and stop.
MultiWorkerMirroredStrategy cannot go on without a peer, so when a worker dies the others
are stopped and the whole group is started again on fresh ports, up to --max_restarts times;
training resumes from its latest checkpoint (from step 0 if it saved none). Exit codes 2
(bad input), 3 (diverged) and 144 (--model_dir in use) are not retried.

Exit status: the chief's (worker 0's) when the group finishes or is stopped by a signal;
the status of the worker that failed when the launcher does not restart the group or gives
up (137: killed by SIGKILL); 2 with one `error:` line and no worker started for training
flags train refuses, or when this host cannot hold that many workers or has no free port
or process left. Whatever ends the launcher, its workers end with it: it stops them, or,
killed itself, the kernel does.

Across nodes, use SLURM (launch/slurm.sbatch) or Kubernetes (k8s/).
"""
# In the code: stopping.passed_on (which signal a worker is sent), errors.ExitCode (the
# codes), max_workers (what this host holds), _DIE_WITH_LAUNCHER (workers die with it).

import bisect
import contextlib
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Collection, List, Optional, Tuple

from absl import flags

from distributed_mpt import cli, train
from distributed_mpt.errors import (ConfigError, ConsoleError, ExitCode, UserError, first_line,
                                    quoted, status_of_signal)
from distributed_mpt.process import console
from distributed_mpt.process.start_guard import end_start_guard, heeded_stop_signals
from distributed_mpt.process.stopping import helper_command, passed_on

# Exit codes after which restarting cannot help (see errors.py): bad input,
# divergence; or not at once, as this launcher would: a busy --model_dir.
# Any other failure, a crash included, restarts the group.
_PERMANENT = "is permanent (bad input or divergence)"
_NOT_RESTARTED = {ExitCode.USAGE: _PERMANENT, ExitCode.DIVERGED: _PERMANENT,
                  ExitCode.MODEL_DIR_BUSY: "says another run holds --model_dir"}
# Exit codes of a worker that stopped because another one was lost.
_PEER_LOSS = (ExitCode.PEER_LOST, ExitCode.PEER_TIMEOUT)
# How long a peer's loss waits for the exit of the worker that caused it.
_CAUSE_SECONDS = 5.0
# What TensorFlow prints when a worker cannot listen on its TF_CONFIG port.
_GRPC_BIND_FAILURE = "Could not start gRPC server"
# TensorFlow's gRPC server listens on every interface (0.0.0.0:PORT), whatever
# address TF_CONFIG gives, so a port is only usable if it is free on all of them.
_GRPC_LISTEN_ADDRESS = "0.0.0.0"
# A save takes seconds; an hour covers a large checkpoint on a slow disk.
MAX_GRACE_SECONDS = 3600.0
# Far more restarts than a group that keeps failing deserves.
_MAX_RESTARTS = 10_000

# What one worker costs this host (`max_workers`). Linux caps one environment
# string ("TF_CONFIG=...") at MAX_ARG_STRLEN, 32 pages.
_ENVIRONMENT_STRING_BYTES = 32 * os.sysconf("SC_PAGE_SIZE")
# The launcher's open files: a worker's stdout and stderr pipes and, while
# ports are chosen, its port's socket; then the launcher's own.
_FILES_PER_WORKER, _FILES_OF_THE_LAUNCHER = 3, 64
# A worker of a 2-worker airbench run on 2 cores of an AMD EPYC (TensorFlow
# 2.21) had 110-125 threads (TensorFlow's pools, gRPC) and 317-322 MiB of
# private memory; larger models, more data and more cores take more.
_THREADS_PER_WORKER, _BYTES_PER_WORKER = 128, 256 * 2**20


class HostLimitError(UserError):
    """This host has no free TCP port, or cannot start one more worker (no
    process, file or thread left)."""


def max_workers() -> Tuple[int, str]:
    """The most workers this host can hold, and the limit that sets it:
    TF_CONFIG in one environment string, this process's open files, the
    user's processes and threads (the kernel exempts root), memory."""
    limits = [(_most_in_one_environment_string(), "the TF_CONFIG of more would not fit in one "
               f"environment string ({_ENVIRONMENT_STRING_BYTES:,} bytes on Linux)")]
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if files != resource.RLIM_INFINITY:
        limits.append(((files - _FILES_OF_THE_LAUNCHER) // _FILES_PER_WORKER,
                       f"ulimit -n is {files}, {_FILES_PER_WORKER} open files a worker"))
    threads = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if threads != resource.RLIM_INFINITY and os.geteuid() != 0:
        limits.append((threads // _THREADS_PER_WORKER,
                       f"ulimit -u is {threads}, about {_THREADS_PER_WORKER} threads a worker"))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limits.append((memory // _BYTES_PER_WORKER, f"this host has {memory / 2**30:.1f} GiB of "
                   f"memory, at least {_BYTES_PER_WORKER // 2**20} MiB a worker"))
    return min(limits)


def _most_in_one_environment_string() -> int:
    def entry_bytes(count):  # the longest "TF_CONFIG=...\0"; each address takes 17 at least
        return (len(f"TF_CONFIG={worker_tf_config([65535] * count, count - 1)}") + 1
                if count * 17 <= _ENVIRONMENT_STRING_BYTES else math.inf)

    return bisect.bisect_right(range(_ENVIRONMENT_STRING_BYTES), _ENVIRONMENT_STRING_BYTES,
                               lo=1, key=entry_bytes) - 1


def free_ports(count: int, avoid: Collection[int] = ()) -> List[int]:
    """`count` distinct TCP ports that are free on every address of this host
    right now, none of them in `avoid` (the ports of earlier groups: one of
    them may be what made the group fail). Raises HostLimitError when the host
    has no free port left."""
    held = []  # kept bound until all are chosen, so that the kernel offers each port once
    ports = []
    try:
        while len(ports) < count:
            probe = socket.socket()
            held.append(probe)
            probe.bind((_GRPC_LISTEN_ADDRESS, 0))
            port = probe.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    except OSError as e:
        raise HostLimitError(f"no free TCP port for worker {len(ports)} of {count} on this "
                             f"host ({e.strerror}); free some, or start fewer workers") from None
    finally:
        for probe in held:
            probe.close()
    return ports


def worker_tf_config(ports: List[int], index: int) -> str:
    """The TF_CONFIG of local worker `index` of those on `ports`; worker 0 is the chief."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def worker_tf_configs(ports: List[int]) -> List[str]:
    """The TF_CONFIG of each local worker."""
    return [worker_tf_config(ports, index) for index in range(len(ports))]


# Each worker runs this (`python -I -c`), then execs the trainer. It asks the
# kernel for SIGTERM when the launcher dies: a launcher killed by SIGKILL
# stops nobody, and its workers, each in a session of its own, ran on holding
# the --model_dir lock (the next launch got exit 144). A process group would
# not do: SIGKILL to the launcher's pid reaches it alone. SIGTERM, not
# SIGKILL: the workers save a checkpoint and stop, as on Ctrl-C. The request
# survives exec, and fires when the *thread* that started the worker ends:
# only the main thread starts workers. A launcher gone before the request
# shows as another parent.
_DIE_WITH_LAUNCHER = f"""\
import ctypes, os, signal, sys
launcher, command = int(sys.argv[1]), sys.argv[2:]
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM.value) != 0:  # PR_SET_PDEATHSIG
    sys.exit(f"error: prctl(PR_SET_PDEATHSIG): {{os.strerror(ctypes.get_errno())}}")
if os.getppid() != launcher:
    sys.exit({int(ExitCode.PREEMPTED)})
os.execv(command[0], command)
"""


class _Group:
    """One generation of worker processes, worker i listening on ports[i]."""

    def __init__(self, ports: List[int]):
        self.ports = ports
        self.processes = []
        self.unbound_workers = set()  # workers that said they could not listen on their port
        self._pumps = []

    def start(self, train_flags: List[str]) -> None:
        """Starts worker i on ports[i], two threads relaying its output. From
        the main thread only (see _DIE_WITH_LAUNCHER). Raises HostLimitError
        when this host cannot start one more; the caller stops the others."""
        command = helper_command("distributed_mpt.train", *train_flags)
        if sys.platform.startswith("linux"):  # prctl is Linux's: the trainer dies with us
            command = [sys.executable, "-I", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command]
        for index, port in enumerate(self.ports):
            tf_config = worker_tf_config(self.ports, index)
            env = dict(os.environ, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
            try:
                process = subprocess.Popen(
                    command, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                    start_new_session=True)  # our Ctrl-C is forwarded, not broadcast by the tty
                self.processes.append(process)
                for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                    self._pumps.append(threading.Thread(target=self._relay, daemon=True,
                                                        args=(source, sink, index)))
                    self._pumps[-1].start()
            except (OSError, RuntimeError) as e:  # RuntimeError: "can't start new thread"
                raise HostLimitError(f"cannot start worker {index} of {len(self.ports)} "
                                     f"({first_line(e)}): start fewer, or raise this host's "
                                     "limits") from None
            _say(f"[launch] started worker {index} (pid {process.pid}) on port {port}")

    def _relay(self, source, sink, index: int) -> None:
        # Keep reading even when our own output is gone (`| head`): a worker
        # whose pipe is not drained blocks.
        for line in source:
            if _GRPC_BIND_FAILURE in line:
                self.unbound_workers.add(index)
            with contextlib.suppress(OSError, ValueError):  # a line the console cannot show
                _say(f"[worker {index}] " + line.rstrip("\n"), sink)
        source.close()  # two files a worker, not two for every worker ever started

    def first_failure(self) -> Optional[int]:
        """Index of a worker that exited non-zero, if any: one that failed on
        its own before one that only lost that peer. A survivor notices a
        lost peer within a step, often before the next poll sees either
        exit, and the report must name the cause."""
        failed = [index for index, process in enumerate(self.processes)
                  if process.poll() not in (None, 0)]
        causes = [index for index in failed
                  if self.processes[index].returncode not in _PEER_LOSS]
        return (causes or failed or [None])[0]

    def failure(self, cause_seconds: float = _CAUSE_SECONDS) -> Optional[int]:
        """first_failure(), once a peer's loss (141) had `cause_seconds` to be
        followed by its cause's exit, which may come later (its status, a 2, is
        the launcher's: not restarted). A cause that hangs is stopped after."""
        deadline = time.monotonic() + cause_seconds
        while ((failed := self.first_failure()) is not None and not self.done()
               and self.processes[failed].returncode in _PEER_LOSS and time.monotonic() < deadline):
            time.sleep(0.1)
        return self.first_failure()

    def done(self) -> bool:
        return all(p.poll() is not None for p in self.processes)

    def signal(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def stop(self, grace_seconds: float) -> None:
        """SIGTERM, then SIGKILL whoever is still running after the grace period
        (a worker blocked in a collective with a dead peer never returns)."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.signal(signal.SIGKILL)
        self.wait()

    def wait(self) -> None:
        """Waits for every worker, and for the last of its output."""
        for process in self.processes:
            process.wait()
        for pump in self._pumps:
            if pump.is_alive():  # one that failed to start never ran
                pump.join(timeout=5)


def _say(line: str, stream=None) -> None:
    """Writes one line to stdout (or `stream`) at once. When nobody reads it
    any more (`| head`), or it cannot be written (a full disk), it is
    dropped (console.py): the workers must still be supervised."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except ConsoleError as e:  # said once: the stream leads to /dev/null from now on
        console.tell(f"warning: {e}; the workers run on", sys.stderr)


def exit_status(returncode: int) -> int:
    """A process's return code as a shell reports it (killed by signal n: 128 + n)."""
    return status_of_signal(-returncode) if returncode < 0 else returncode


def launch(num_workers: int, max_restarts: int, grace_seconds: float, train_flags: List[str]) -> int:
    """Runs the group to completion, restarting it on fresh ports after a
    retryable failure; returns the chief's exit code. Raises HostLimitError
    when this host has no free port or process left, having stopped every
    worker it started."""
    forwarded = []  # signals received, newest last
    groups = []  # every generation started, the running one last

    def forward(signum, frame):
        forwarded.append(signum)
        if groups:
            groups[-1].signal(passed_on(forwarded))

    end_start_guard()
    previous_handlers = {sig: signal.signal(sig, forward) for sig in heeded_stop_signals()}
    try:
        used_ports, restarts = set(), 0
        while True:
            ports = free_ports(num_workers, avoid=used_ports)
            used_ports.update(ports)
            group = _Group(ports)
            groups.append(group)
            group.start(train_flags)
            if forwarded:  # a signal came while the group was starting
                group.signal(passed_on(forwarded))
            while not group.done() and group.first_failure() is None:
                time.sleep(0.2)
            failed = group.failure()
            if failed is None or forwarded:
                return _finish(group, grace_seconds)
            code = exit_status(group.processes[failed].returncode)
            _say(f"[launch] worker {failed} exited with {code}; stopping the group")
            group.stop(grace_seconds)
            busy = [f"worker {i} could not start its gRPC server: port {group.ports[i]} is taken "
                    f"on some address of this host" for i in sorted(group.unbound_workers)]
            if busy:
                _say(f"error: {'; '.join(busy)} (see `ss -ltnp`)", sys.stderr)
            # The launcher chose that port and fresh ones cure it, whatever
            # code the worker turned the failure into.
            if code in _NOT_RESTARTED and not busy:
                _say(f"[launch] exit code {code} {_NOT_RESTARTED[code]}: not restarting")
                return code
            if restarts >= max_restarts or forwarded:
                _say(f"[launch] giving up after {restarts} restart(s)")
                return code
            restarts += 1
            _say(f"[launch] restart {restarts}/{max_restarts} on fresh ports: the run resumes "
                 f"from its latest checkpoint, or from step 0 if it saved none")
    finally:
        # A failure of the launcher's own (no thread, no process): none of
        # its workers may run on without it.
        if groups and not groups[-1].done():
            groups[-1].stop(grace_seconds)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def _finish(group: _Group, grace_seconds: float) -> int:
    """Lets a group that succeeded or was signalled end; returns the chief's status."""
    # Signalled workers save a checkpoint and exit 143; one that fails
    # otherwise leaves its peers blocked in a collective.
    while not group.done():
        if any(p.poll() not in (None, 0, ExitCode.PREEMPTED) for p in group.processes):
            group.stop(grace_seconds)
        time.sleep(0.2)
    group.wait()
    return exit_status(group.processes[0].returncode)


def main(argv=None) -> int:
    """Parses launcher flags (train flags follow `--`) and launches."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own, train_flags = argv[:split], argv[split + 1:]
    fv = flags.FlagValues()
    # Decimal digits only, as training's flags (cli.py).
    cli.define_integer(fv, "num_workers", 2, "Worker processes to start (at most what this host "
                       "can hold: a larger number is refused, naming the limit).", lower=1)
    cli.define_integer(fv, "max_restarts", 3, "Times the whole group is restarted after a worker "
                       "dies.", lower=0, upper=_MAX_RESTARTS)
    cli.define_float(fv, "grace_seconds", 20.0, "After SIGTERM, seconds a worker has to save and "
                     "exit before it is killed.")
    # Not absl's bounds, which let nan through: nan fails every comparison.
    flags.register_validator("grace_seconds", lambda seconds: 0 <= seconds <= MAX_GRACE_SECONDS,
                             f"must be a number of seconds from 0 to {MAX_GRACE_SECONDS:g}",
                             flag_values=fv)
    if cli.wants_help(own):
        return cli.show_help(__doc__, fv)
    try:
        # cli.parse: absl's words escaped and cut, a --flagfile read safely
        # (absl echoed /proc/self/environ whole, and waited on a FIFO).
        rest = cli.parse("distributed-mpt-launch", fv, own, positionals=True)
        if rest:
            raise ConfigError(f"unexpected argument(s) {quoted(' '.join(rest))}; put training "
                              "flags after --")
        if not train_flags:
            raise ConfigError("no training flags: distributed-mpt-launch --num_workers=N -- "
                              "--model_dir=DIR ...")
        # Training's help and refusals said once here, not once by each worker.
        if cli.wants_help(train_flags):
            return train.main(train_flags)
        train.parse_config(train_flags).cluster.check_for_workers(fv.num_workers)
        most, why = max_workers()
        if fv.num_workers > most:
            raise ConfigError(f"--num_workers={fv.num_workers}: this host holds at most {most} "
                              f"({why})")
        return launch(fv.num_workers, fv.max_restarts, fv.grace_seconds, train_flags)
    except UserError as e:  # ConfigError, HostLimitError
        _say(f"error: {e}", sys.stderr)
        return e.exit_code


def run() -> None:
    """Console-script entry point."""
    sys.exit(console.run_with_console(main))


if __name__ == "__main__":
    run()
