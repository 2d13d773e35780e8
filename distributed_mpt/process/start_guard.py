"""A stop signal while a command of the package starts: one line, the exit
code of a stop, and no traceback.

Every command imports the package's __init__ first, which runs
`guard_the_start` before anything else. Until the command handles a stop
itself (process/stopping.py's owner in training, KeyboardInterrupt where
`cli.guarded` catches it, the launcher's forwarding, the benchmark's
`stops_interrupting`), a stop signal ends it at once: it is importing its
modules and parsing its flags, and has written nothing yet. Python's own
handling would raise KeyboardInterrupt in the middle of an import (a
traceback, exit 1 or 130), and end it on SIGTERM without a word. A helper
process (the log filter, the start-up watchdog) ignores the stop signals
from that moment on.

Only the interpreter's own start is out of the package's reach, the first
10 to 30 ms (on 2 cores of an AVX2-only AMD EPYC, Zen 3): a Ctrl-C there is
Python's (a KeyboardInterrupt in its `site` module, or the signal's death).
This module imports nothing that loads an extension module, so that the
guard is in place before the first one loads
(tests/process/test_startup_stop.py waits for that).
"""

import os
import signal
import sys

from distributed_mpt.errors import STOP_SIGNALS, ExitCode

# The commands of the package, by the module that runs each (`python -m
# distributed_mpt.NAME`, or its console script distributed-mpt-NAME, with
# "-" for "_": setup.py), and the exit code of a Ctrl-C that stops one while
# it starts, or None for a helper, which ignores the stop signals from its
# start on (here, and nowhere else). Ctrl-C is a stop like the others for
# training and for the launcher (whose workers train); it aborts the others,
# as `cli.guarded` says. tests/process/test_startup_stop.py checks that
# every command is here.
_CTRL_C_WHILE_STARTING = {
    "train": ExitCode.PREEMPTED, "launch": ExitCode.PREEMPTED,
    "benchmark": ExitCode.ABORTED, "benchmark.scaling": ExitCode.ABORTED,
    "predict": ExitCode.ABORTED, "prepare_data": ExitCode.ABORTED,
    "recipes.measure": ExitCode.ABORTED,
    "process.log_filter": None, "process.startup_watchdog": None,
}
_COMMAND_PREFIXES = ("distributed-mpt-", "distributed_mpt.")

_ctrl_c_while_starting: int | None = None  # the guarded command's
_inherited = {}  # each stop signal's handler when the guard came: what it hands back


def stopped_before(sig: signal.Signals, when: str, code: int, done: str) -> str:
    """The line that says a stop came `when` nothing was `done` yet."""
    return f"{sig.name} {when}: exiting with {code:d} (retryable); nothing was {done} yet"


def command_of(orig_argv: list[str]) -> str | None:
    """The command that the interpreter's command line `orig_argv`
    (sys.orig_argv) runs: "train" for `distributed-mpt-train` (its console
    script is the script Python runs) and for `python -m distributed_mpt.train`.
    None for anything else: a library user, a test, and `python -c`, which
    multiprocessing runs for a spawn or forkserver child (a child of a
    command copies its sys.argv, so that names the parent's command)."""
    run = _what_python_runs(orig_argv)
    prefix = next((p for p in _COMMAND_PREFIXES if run.startswith(p)), None)
    return run[len(prefix):].replace("-", "_") if prefix else None


def _what_python_runs(orig_argv: list[str]) -> str:
    """The file name of the script or the module that a command line of
    Python runs; "" for `-c` and standard input."""
    args = orig_argv[1:]
    while args:
        arg, args = args[0], args[1:]
        if arg == "--":  # the script next
            arg = args[0] if args else ""
        if arg == "-" or not arg.startswith("-"):
            return "" if arg == "-" else os.path.basename(arg)
        if arg.startswith("--"):  # one takes a value
            args = args[arg == "--check-hash-based-pycs":]
            continue
        for at, option in enumerate(arg[1:], 2):  # options joined: -Im, -mMODULE
            if option in "cmWX":  # its value is the rest of `arg`, or the next one
                value = arg[at:] or (args[0] if args else "")
                args = args[not arg[at:]:]
                if option in "cm":
                    return value if option == "m" else ""
                break
    return ""


def guard_the_start() -> None:
    """In a process that runs a command of the package (see above), makes
    each stop signal end it at once, with one line and the exit code of a
    stop while it starts, until `end_start_guard`; a helper ignores them."""
    global _ctrl_c_while_starting
    command = command_of(sys.orig_argv)
    if command not in _CTRL_C_WHILE_STARTING:
        return
    _ctrl_c_while_starting = _CTRL_C_WHILE_STARTING[command]
    if _ctrl_c_while_starting is None:
        # A helper: a stop meant for the process group leaves it running, so
        # that it can still serve the process that is stopping.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return
    for sig in heeded_stop_signals():
        _inherited[sig] = signal.getsignal(sig)
        signal.signal(sig, _stop_while_starting)


def is_a_command() -> bool:
    """Whether this process runs a command of the package that
    `guard_the_start` guarded (not a helper, a library caller or a test)."""
    return _ctrl_c_while_starting is not None


def _stop_while_starting(signum, frame) -> None:
    sig = signal.Signals(signum)
    code = _ctrl_c_while_starting if sig == signal.SIGINT else ExitCode.PREEMPTED
    try:  # one write: the main thread, interrupted, may be inside a print
        os.write(2, (stopped_before(sig, "while starting", code, "done") + "\n").encode())
    except OSError:
        pass  # nobody reads it: the exit code says it
    os._exit(code)


def end_start_guard() -> None:
    """Hands the stop signals that `guard_the_start` holds back to the
    handlers it found (Python's), for a command that handles a stop from now
    on: Ctrl-C as KeyboardInterrupt, or with handlers of its own, put in
    place after this, which put Python's back when they are done (not the
    guard's: the start is over)."""
    for sig, handler in _inherited.items():
        if signal.getsignal(sig) is _stop_while_starting:
            signal.signal(sig, handler)


def heeded_stop_signals() -> list[signal.Signals]:
    """The stop signals this process acts on: all but those it ignores,
    which whoever started it said must not stop it (nohup's SIGHUP; a shell
    without job control ignores SIGINT in its `command &`, so that Ctrl-C
    leaves the background job running). Whoever takes a stop signal over
    takes only these."""
    return [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
