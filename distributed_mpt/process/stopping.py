"""How a training process stops: the one owner of its stop signals.

SIGTERM (what Kubernetes, SLURM and the launcher send) and SIGINT (Ctrl-C)
mean "stop, keeping what was done", and so do SIGHUP (the terminal closed,
an ssh connection dropped) and SIGUSR1 and SIGUSR2 (what `sbatch
--signal=USR1@120` sends ahead of a job's time limit): each of them is
treated exactly as SIGTERM. What that takes depends on the phase the process
is in:

- STARTING, before TensorFlow: nothing is trained, so a stop exits at once
  with ExitCode.PREEMPTED (retryable).
- WAITING FOR TENSORFLOW (its import and the strategy, which for
  MultiWorkerMirroredStrategy means waiting for the peers): TensorFlow's C++
  code holds the GIL (for seconds at a time during the import, for the
  whole wait for the peers), so no Python handler or thread of this process
  runs, and its coordination service installs a SIGTERM handler that only
  records the signal. So the signals are blocked in every thread
  (`tensorflow_starting`) and stay pending; the start-up watchdog
  (startup_watchdog.py), a separate process, sees them in /proc within a
  fraction of a second and ends the worker with the signal
  `WAITING_WORKER_STOP_SIGNAL` (exit ExitCode.KILLED, retryable).
- PREPARING (data, model, restore): as STARTING.
- TRAINING: the first signal is a request; the training loop looks at it at
  every step boundary (`requested`, or the `on_request` callback that the
  trainer uses to set a flag inside its compiled loop), saves a checkpoint
  and exits with ExitCode.PREEMPTED, in FINISHING once it is saved. A
  second Ctrl-C aborts at once (ExitCode.ABORTED).
- FINISHING (final evaluation and export): what is left makes the run
  complete, so a request lets it finish (exit 0); a second Ctrl-C aborts.
- Once an error line has decided the exit (`say_decided_error`): a stop is
  ignored, as the process is ending anyway; its 143 said "retry" of a
  mistake that a retry only repeats.

A Python signal handler runs only when the main thread gets back from
TensorFlow, which may take a whole step. Python's C-level handler writes the
signal number to a wakeup pipe at once, though, and a thread reading it
acts within milliseconds, whatever the main thread is doing.

The helper processes a run starts (the log filter, the start-up watchdog)
ignore the stop signals (start_guard.py): a Ctrl-C reaches the whole process
group, and they must outlive the process they serve. They are started with
`helper_command`, which never imports from the working directory. And
before a process of the package is ready to handle a stop as above,
start_guard.py answers it.
"""

import contextlib
import enum
import os
import signal
import sys
import threading
from typing import Callable, List, Optional

from distributed_mpt.errors import STOP_SIGNALS, ExitCode
from distributed_mpt.process.start_guard import (end_start_guard, heeded_stop_signals,
                                                 is_a_command, stopped_before)


# How the start-up watchdog ends a worker that TensorFlow holds while it starts
# for its peers: signals it cannot block or swallow (SIGALRM is never
# blocked here and TensorFlow leaves it alone), whose default action gives
# the exit status that says why.
WAITING_WORKER_STOP_SIGNAL = signal.Signals(ExitCode.KILLED - 128)        # SIGKILL
PEER_TIMEOUT_SIGNAL = signal.Signals(ExitCode.PEER_TIMEOUT - 128)          # SIGALRM


class Phase(enum.Enum):
    """Where a training process is, as far as stopping goes (see above)."""

    STARTING = "starting"
    PREPARING = "preparing"
    TRAINING = "training"
    FINISHING = "finishing"


def helper_command(module: str, *args: str) -> List[str]:
    """The command that runs `module` of this package as a helper process.

    `python -m` puts the working directory first on sys.path, so a
    `./distributed_mpt/` there would run instead of the installed package:
    -P (Python 3.11+) leaves it out; before 3.11, -I does, and also ignores
    PYTHON* variables and the user's site-packages.
    """
    isolation = "-P" if sys.version_info >= (3, 11) else "-I"
    return [sys.executable, isolation, "-m", module, *args]


def passed_on(received: List[int]) -> int:
    """The signal with which a process passes the stop signals it `received`
    (newest last) on to its children: the first as SIGTERM, which stops a
    child at any moment, even before its Python starts (where Ctrl-C kills
    it, with 130, or prints a traceback); a later one as it came, so that a
    second Ctrl-C aborts."""
    return signal.SIGTERM if len(received) == 1 else received[-1]


def pending_stop_signal(pid: int) -> Optional[signal.Signals]:
    """A stop signal (STOP_SIGNALS) pending (blocked) in process `pid`; None
    also where there is no /proc (not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:  # the thread's pending ones, and the process's
            masks = [int(line.split()[1], 16) for line in f
                     if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return None
    return next((s for s in STOP_SIGNALS if any(mask >> (s - 1) & 1 for mask in masks)), None)


class _Owner:
    """The stop state of this process while `owning_stops` runs."""

    def __init__(self):
        self.phase = Phase.STARTING
        self.requested = False
        self._first: Optional[signal.Signals] = None  # the signal that requested the stop
        self.on_request: Optional[Callable[[], None]] = None  # see `enter`
        self.undo_start: Optional[Callable[[], None]] = None  # see `on_stop_before_training`
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        end_start_guard()
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        # What the acknowledgement offers: only a SIGINT aborts (a SIGTERM
        # after a first stop is a scheduler's, SLURM's at the time limit
        # after its USR1 warning: it must not cut the checkpoint short), and
        # nothing does where SIGINT is ignored (a script's `command &`).
        self.sigint_aborts = signal.SIGINT in heeded_stop_signals()
        # Python's C-level handler writes the signal to the pipe; the
        # Python-level one (run later, in the main thread) has nothing to do.
        for sig in heeded_stop_signals():  # an ignored one stays ignored (nohup)
            signal.signal(sig, _nothing)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd)
        # Started with the signals blocked, so that this thread is never the
        # one they are delivered to while TensorFlow starts (see
        # tensorflow_starting); it only reads the pipe.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            threading.Thread(target=self._watch, daemon=True, name="stop-signals").start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _watch(self) -> None:
        while True:
            received = os.read(self._read_fd, 64)
            if not received:  # close() closed the pipe
                os.close(self._read_fd)
                return
            for signum in received:  # every signal with a Python handler comes here
                if signum in STOP_SIGNALS:
                    self._handle(signal.Signals(signum))

    def _handle(self, sig: signal.Signals) -> None:
        if _exit_is_decided:  # one that came just before the handlers were set to ignore it
            return
        if self.phase in (Phase.STARTING, Phase.PREPARING):
            # At once, whatever the main thread is doing (TensorFlow may hold
            # it): everything written so far was written whole, the OS drops
            # the lock, and the next run removes what is left.
            _say_now(stopped_before(sig, "before training started", ExitCode.PREEMPTED,
                                     "trained"))
            # What cannot be undone stays; the exit happens all the same.
            with contextlib.suppress(Exception):
                if self.undo_start is not None:
                    self.undo_start()
            os._exit(ExitCode.PREEMPTED)
        if self.requested:
            if sig == signal.SIGINT:
                # FINISHING: the last checkpoint is saved (a stop's, or the final step's).
                kept = ("without a checkpoint" if self.phase == Phase.TRAINING else
                        "with the checkpoint saved, without the final evaluation and export")
                again = "second Ctrl-C" if self._first == signal.SIGINT else "Ctrl-C"
                _say_now(f"{again}: aborting {kept} (exit {ExitCode.ABORTED:d})")
                os._exit(ExitCode.ABORTED)
            return
        self.requested, self._first = True, sig  # before anything that can fail
        if self.on_request is not None:
            self.on_request()
        what = ("after the steps under way, with a checkpoint"
                if self.phase == Phase.TRAINING else
                "once the run is complete: evaluating and exporting first")
        abort = ("" if not self.sigint_aborts else
                 f"; {'Ctrl-C again' if sig == signal.SIGINT else 'Ctrl-C (SIGINT)'} to abort "
                 f"(exit {ExitCode.ABORTED:d})")
        _say_now(f"{sig.name}: stopping {what}{abort}")

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for sig, handler in self._previous.items() if not _exit_is_decided else ():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # ends the watching thread


def _nothing(signum, frame) -> None:
    """The Python-level handler: the watching thread has acted already."""


_owner: Optional[_Owner] = None
_exit_is_decided = False


def say_decided_error(message: str) -> None:
    """Prints the `error: message` line of a failure that decides the
    command's exit itself (a user's mistake's 2, a lost peer's 141): a stop
    signal from then on is ignored. It ended a mistake with 143 (retryable),
    its line glued to the error line ("...was given)SIGTERM before training
    started"), so that a Job retried it; a lost peer's survivor, told to stop
    by the launcher that saw the peer die, promised "a checkpoint" that no
    failed collective can keep. Ignored only in a command's own process
    (start_guard): a library caller or a test keeps its handlers."""
    global _exit_is_decided
    if is_a_command() and threading.current_thread() is threading.main_thread():
        _exit_is_decided = True
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    print(f"error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def owning_stops():
    """Owns this process's stop signals for the block (an entry point's
    whole run), starting in Phase.STARTING; puts back what it found."""
    global _owner
    _owner = _Owner()
    try:
        yield
    finally:
        _owner.close()
        _owner = None


@contextlib.contextmanager
def tensorflow_starting():
    """Holds the stop signals blocked while TensorFlow starts (see the
    module's docstring). Enter it before TensorFlow starts any thread, as
    threads inherit the mask. On exit, the owner's handlers replace whatever
    TensorFlow installed before the signals are unblocked: one that came
    meanwhile is acted on then, as Phase.STARTING says. An ignored signal
    is not held: held, it would be pending, and the watchdog would act on it."""
    heeded = heeded_stop_signals()
    signal.pthread_sigmask(signal.SIG_BLOCK, heeded)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            # Replaces TensorFlow's handler with the owner's (or the default).
            signal.signal(sig, signal.SIG_IGN if sig not in heeded else
                          _nothing if _owner is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, heeded)


class Terminated(KeyboardInterrupt):
    """A stop signal other than Ctrl-C, raised as Ctrl-C is (see
    `stops_interrupting`)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def stops_interrupting():
    """For a process with nothing to save when it is stopped (the benchmark):
    in the block every stop signal but Ctrl-C's raises Terminated, a
    KeyboardInterrupt as Ctrl-C raises, in the main thread, so that the
    `finally`s on the way out run and end its child processes (by default
    SIGTERM ends the process at once, and a child measuring a cell ran on for
    up to 15 minutes)."""
    end_start_guard()
    others = [sig for sig in heeded_stop_signals() if sig != signal.SIGINT]
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in others}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def enter(phase: Phase, on_request: Optional[Callable[[], None]] = None) -> None:
    """Moves this process to `phase`; in Phase.TRAINING, `on_request` is
    called (from another thread) when a stop is requested. Without an owner
    (a library caller, a test) there is nothing to do."""
    if _owner is not None:
        _owner.phase = phase
        if on_request is not None:
            _owner.on_request = on_request


def on_stop_before_training(undo: Optional[Callable[[], None]]) -> None:
    """`undo()` is called (from another thread, the main thread running on)
    when a stop comes before training, right before the process exits: it
    removes what the start wrote, so that a stopped start leaves nothing
    new. None: nothing to undo."""
    if _owner is not None:
        _owner.undo_start = undo


def requested() -> bool:
    """Whether a stop was requested during training."""
    return _owner is not None and _owner.requested


_kept_until_exit = []


def keep_until_exit(anything) -> None:
    """Keeps `anything` from being freed before `exit_now`."""
    _kept_until_exit.append(anything)


def exit_now(code: int) -> None:
    """Ends the process with `code` at once, skipping the interpreter's
    teardown; for a process whose every output is written and closed.
    TensorFlow's teardown does nothing of use, and takes 1.6-1.9 CPU-s on 2
    idle cores of an AMD EPYC (Zen 3, AVX2 only; `import tensorflow` and one
    op: 7.3-8.2 s to exit normally, 5.7-6.4 s this way) and up to a minute
    on a loaded machine."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: a descriptor closed when the process started
            stream.flush()  # a reader that went away is console.py's: no error here
    os._exit(code)


def _say_now(message: str) -> None:
    """Writes a line from the watching thread, with one os.write (the main
    thread may be inside a print). On a terminal it goes where the status
    line is (stdout, see training/loop.py's Reporter), clearing it first, so
    that the line starts at the left margin and not after `step 20/679`;
    elsewhere, to stderr."""
    with contextlib.suppress(OSError):  # nobody reads any more: the stop still happens
        tty = os.isatty(1)
        os.write(1 if tty else 2, (b"\r\x1b[K" if tty else b"") + message.encode() + b"\n")
