"""What a user's model code may change of the process that the run relies
on, read before it runs and judged after it, by contract.users_code.

Set back, with a warning: the working directory (relative paths), Keras'
mixed-precision policy (set from --precision) and default float type (left
float32: float16 failed the first step on a dtype mismatch; both refused
once the model is built with them, by contract.users_code), the stop
signals' handlers (a library that ignores SIGTERM), the descriptor that signals wake:
process/stopping.py hears of a stop through it, and an event loop that sets
its own (asyncio's, which sets none when it closes) left a run that only
SIGKILL stopped; the real-time timer, which a library's timeout left
armed (signal.alarm(3)) killed by SIGALRM, without a line, with the exit
status of a peer's time-out; and the sys.stdout and sys.stderr objects:
an io.StringIO lost every progress line, exit 0, and sys.stderr = None
sent the error line to stdout; the umask, of which os.umask(0o777) left
every file of the run mode 000, exit 0; and a warnings filter that makes
warnings errors (warnings.simplefilter("error") in a model file): the
libraries' own warnings then failed the export, after training, with a
traceback (cli.libraries_warnings_stay_warnings keeps those of -W error).
Its other filters (a library that silences its warnings) stay. Also the
folder of temporary files and the recursion limit: tempfile.tempdir set to
a missing folder, or sys.setrecursionlimit(120), failed the first training
step, which autograph could not convert, blaming the model for what it did
not say ("Iterating over a symbolic `tf.Tensor` is not allowed"). And
tf.config.run_functions_eagerly(True), a debugging line left in: the
compiled steps ran eagerly, 4.3 times slower without a word (a small CNN on
2 cores of a Zen 5 AMD EPYC, AVX512_BF16).

Refused, as nothing can set them back, after which the run broke only later
and with a traceback:
- eager execution turned off (tf.compat.v1.disable_eager_execution(),
  disable_v2_behavior()): the probe call failed on a symbolic tensor;
- the distribution strategy's scope ended (keras.backend.clear_session()
  or tf.compat.v1.reset_default_graph() reset TensorFlow's default graph,
  which holds it): the variables made after it are not mirrored, and the
  scope's end failed with "IndexError: pop from empty list";
- sys.stdout or sys.stderr closed: the next progress line, or the error
  line itself, failed ("lost sys.stderr", the run's files left behind);
- file descriptor 1 or 2 closed or replaced (os.close(1)): the next file
  the run opened took it, and the progress lines went into it, exit 0.
The graph, the streams and the descriptors are made usable again first, so that the refusal
is one line and the run's clean-up runs.

While the code runs, what it prints goes to stderr, and os._exit raises,
for users_code to refuse: it ended the run at once, exit 0 if it said 0.
"""

import contextlib
import os
import signal
import sys
import tempfile
import threading
import warnings
from typing import NamedTuple, Optional

from distributed_mpt import files
from distributed_mpt.errors import STOP_SIGNALS, first_line, quoted

POLICY = "the mixed-precision policy"
FLOATX = "Keras' default float type (keras.config.set_floatx)"
_CWD, _HANDLERS = "the working directory", "the handlers of stop signals"
_WAKEUP = "the descriptor that signals wake (signal.set_wakeup_fd)"
_TIMER = "the real-time timer (signal.alarm or signal.setitimer(signal.ITIMER_REAL))"
_UMASK = "the umask (os.umask), which gives the run's files their modes"
_FILTERS = ('the warnings filters that make warnings errors (warnings.simplefilter("error")), '
            'or that keep them warnings (warnings.resetwarnings())')
_TEMPDIR = "the folder of temporary files (tempfile.tempdir)"
_RECURSION = "Python's recursion limit (sys.setrecursionlimit)"
_EAGER_FUNCTIONS = "whether tf.functions run eagerly (tf.config.run_functions_eagerly)"
# What the run would do without what a model changed and cannot be set back.
WITHOUT = {_CWD: "relative paths would lead elsewhere",
           _HANDLERS: "a stop signal would not stop it with a checkpoint",
           _WAKEUP: "a stop signal would not stop it with a checkpoint",
           _TIMER: "the alarm set before it would not go off"}


def read() -> dict:
    """What the run relies on, as it is now: the signals' parts only in the
    main thread, which alone may set them."""
    import keras
    import tensorflow as tf

    # Whether the timer is armed, not what it has left, which runs down.
    state = {_CWD: working_directory(), POLICY: keras.mixed_precision.global_policy().name,
             FLOATX: keras.config.floatx(),
             _TIMER: signal.getitimer(signal.ITIMER_REAL)[0] > 0, _UMASK: files.umask(),
             _FILTERS: list(warnings.filters), _TEMPDIR: _temporary_folder(),
             _RECURSION: sys.getrecursionlimit(),
             _EAGER_FUNCTIONS: tf.config.functions_run_eagerly()}
    state.update((f"sys.{name}", getattr(sys, name)) for name in _STREAMS)
    if threading.current_thread() is threading.main_thread():
        state[_HANDLERS] = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        state[_WAKEUP] = _wakeup_fd()
    return state


def _temporary_folder():
    """tempfile's folder, found now if it is not yet (tempfile keeps it): one a
    library first asked for while the model's code ran would read as changed."""
    with contextlib.suppress(OSError):  # no folder is usable: none to keep
        tempfile.gettempdir()
    return tempfile.tempdir


def _wakeup_fd() -> int:
    """The descriptor signals wake (-1: none), read by swapping in a pipe
    of our own and back: a signal that comes in between, written to the
    pipe, is passed on to it, so that no stop is lost."""
    read, write = os.pipe()
    try:
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        fd = signal.set_wakeup_fd(write)
        signal.set_wakeup_fd(fd)
        with contextlib.suppress(OSError):  # BlockingIOError: none came
            caught = os.read(read, 64)
            if fd != -1:
                os.write(fd, caught)
    finally:
        os.close(read)
        os.close(write)
    return fd


def working_directory() -> Optional[str]:
    """The process's working directory; None if it was removed under the
    process (by another shell, a `git worktree remove`): os.getcwd() then
    raises, and a relative path made absolute failed with a traceback."""
    try:
        return os.getcwd()
    except OSError:
        return None


def changed(kept: dict, now: dict) -> list:
    """What of `kept`, read before the model's code ran, differs `now`: a
    stream it closed is not, as broken_since has put one in its place and
    refuses it."""
    return [what for what, value in now.items()
            if (_counted(value, kept[what]) if what == _FILTERS else value) != kept[what]
            and not (what.startswith("sys.") and getattr(kept[what], "closed", False))
            and not (what == _RECURSION and value > kept[what])]  # deep models raise it


def set_back(kept: dict, changed) -> dict:
    """Sets back what of `kept` is `changed`; returns {what: why} for what
    could not be."""
    import keras

    failed = {}
    if POLICY in changed:
        keras.mixed_precision.set_global_policy(kept[POLICY])
    if FLOATX in changed:
        keras.config.set_floatx(kept[FLOATX])
    if _UMASK in changed:
        os.umask(kept[_UMASK])
    if _TEMPDIR in changed:
        tempfile.tempdir = kept[_TEMPDIR]
    if _RECURSION in changed:
        sys.setrecursionlimit(kept[_RECURSION])
    if _EAGER_FUNCTIONS in changed:
        import tensorflow as tf

        tf.config.run_functions_eagerly(kept[_EAGER_FUNCTIONS])
    if _FILTERS in changed:
        now = list(warnings.filters)
        warnings.resetwarnings()  # what tells the warnings module its filters changed
        warnings.filters[:] = [*(f for f in now if f not in _counted(now, kept[_FILTERS])),
                               *kept[_FILTERS]]
    for name in _STREAMS:
        if f"sys.{name}" in changed:  # replaced: an io.StringIO that kept the progress lines
            setattr(sys, name, kept[f"sys.{name}"])
    try:
        if _CWD in changed:
            os.chdir(kept[_CWD])
    except TypeError:  # None
        failed[_CWD] = "it had been removed before the model's code ran"
    except OSError as e:
        failed[_CWD] = f"{quoted(kept[_CWD])}: {e.strerror}"
    for sig, handler in kept[_HANDLERS].items() if _HANDLERS in changed else ():
        try:
            if handler is None:  # not set from Python: what it was is unknown
                raise ValueError(f"{sig.name}'s was not set from Python")
            signal.signal(sig, handler)
        except (OSError, TypeError, ValueError) as e:
            failed[_HANDLERS] = first_line(e)
    try:
        if _WAKEUP in changed:
            signal.set_wakeup_fd(kept[_WAKEUP])
    except (OSError, ValueError) as e:  # the model closed it, or made it blocking
        failed[_WAKEUP] = first_line(e)
    if _TIMER in changed and kept[_TIMER]:
        failed[_TIMER] = "it was armed before the model's code ran, and is not now"
    elif _TIMER in changed:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return failed


def _counted(now: list, kept: list) -> list:
    """The warnings filters `now` whose change counts against those `kept`:
    all but those added since that keep warnings warnings (a library
    imported meanwhile that silences its own stays, first, as it put them).
    A filter removed counts: cli.libraries_warnings_stay_warnings' one,
    ahead of -W error's, kept the export's Keras warnings warnings."""
    return [f for f in now if f in kept or f[0] == "error"]


# What the run writes to each stream, for the refusal to name.
_STREAMS = {"stdout": "its progress lines", "stderr": "its warnings and errors"}


class Unrecoverable(NamedTuple):
    """What `broken_since` looks at, before the model's code ran."""

    eager: bool
    graph: object
    strategy: Optional[object]  # the strategy whose scope the code ran in; None: none
    streams: dict  # each open stream of _STREAMS: (the object, its file descriptor or None)
    saved: dict  # each open descriptor of _FDS: (a duplicate of it, the identity of its file)


def unrecoverable() -> Unrecoverable:
    """What `broken_since` compares with, taken before the model's code runs."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return Unrecoverable(tf.executing_eagerly(), tf.compat.v1.get_default_graph(), strategy,
                         {name: (getattr(sys, name), _descriptor(getattr(sys, name)))
                          for name in _STREAMS
                          if not getattr(getattr(sys, name), "closed", True)}, _saved())


# The descriptors the run's output goes to, by the process's and Python's
# own name for them.
_FDS = {1: "stdout", 2: "stderr"}


def _saved() -> dict:
    saved = {}
    for fd in _FDS:
        with contextlib.suppress(OSError):  # closed before the model's code ran
            saved[fd] = os.dup(fd), _identity(fd)
    return saved


def _identity(fd: int) -> Optional[tuple]:
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _put_back(saved: dict) -> list:
    """Puts back each of the saved descriptors that is closed or on another
    file now (the next file opened took a closed 1, and the progress lines
    went into it); returns them. Closes the saved copies."""
    replaced = []
    for fd, (copy, identity) in saved.items():
        if _identity(fd) != identity:
            os.dup2(copy, fd)
            replaced.append(fd)
        os.close(copy)
    return replaced


def broken_since(before: Unrecoverable) -> Optional[str]:
    """What the code run since `before` did that the run cannot go on
    with ("turned off eager execution ...: remove that call"), None if
    nothing. A stream it closed is replaced by one on the same descriptor,
    a descriptor 1 or 2 it closed or replaced put back, and the default
    graph put back, so that the error can be said and the
    strategy's scope ended."""
    import tensorflow as tf

    replaced = _put_back(before.saved)
    # The streams as they were: set_back puts back one the code replaced.
    closed = [name for name, (stream, _) in before.streams.items()
              if getattr(stream, "closed", False)]
    for name in closed:
        descriptor = before.streams[name][1]
        setattr(sys, name, open(os.devnull, "w") if descriptor is None else open(
            descriptor, "w", buffering=1, closefd=False, errors="backslashreplace"))
    if before.eager and not tf.executing_eagerly():
        return ("turned off eager execution (tf.compat.v1.disable_eager_execution() or "
                "disable_v2_behavior()), which TensorFlow cannot turn on again in this "
                "process, and the run's TensorFlow 2 code needs: remove that call")
    if before.strategy is not None and tf.compat.v1.get_default_graph() is not before.graph:
        from tensorflow.python.framework import ops

        # No public call makes a graph the default again outside a `with`,
        # which in eager mode would also leave eager execution. TensorFlow
        # 2.21's private attribute, written only where it is there: one that
        # renamed it leaves a traceback after this line (test_model_contract's
        # clear_session case fails on such an upgrade).
        stack = getattr(ops, "_default_graph_stack", None)
        if hasattr(stack, "_global_default_graph"):
            stack._global_default_graph = before.graph
        return (f"reset TensorFlow's default graph (keras.backend.clear_session() or "
                f"tf.compat.v1.reset_default_graph() does), which ended the scope of the run's "
                f"{type(before.strategy).__name__}: the variables made after it would not be "
                f"mirrored across its {before.strategy.num_replicas_in_sync} replicas; remove "
                f"that call (a run starts with nothing to clear)")
    if replaced:
        return (f"closed or replaced "
                f"{' and '.join(f'file descriptor {fd} ({_FDS[fd]})' for fd in replaced)}, to "
                f"which the run writes {' and '.join(_STREAMS[_FDS[fd]] for fd in replaced)}: "
                f"remove that call (os.close or os.dup2 on it)")
    if closed:
        return (f"closed {' and '.join(f'sys.{name}' for name in closed)}, to which the run "
                f"writes {' and '.join(_STREAMS[name] for name in closed)}: remove that call "
                f"({' or '.join(f'contextlib.redirect_{name}' for name in closed)} silences a "
                f"library for a while)")
    return None


class _PrintsToStderr:
    """sys.stdout while a model's code runs: what it prints (a print,
    model.summary()) goes to stderr, as stdout carries the run's own output
    (predict --json's object, which a model's print made unreadable). The
    rest (close, fileno) is stdout's, for broken_since to judge. Whether
    it ended its last line is kept: a prompt's (input()) had the next
    line, the run's error line, glued to it."""

    def __init__(self, stdout, stderr):
        self._stdout, self._stderr, self.ended_line = stdout, stderr, True

    def write(self, text):
        if text:
            self.ended_line = str(text).endswith("\n")
        return self._stderr.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        self._stderr.flush()

    def __getattr__(self, name):
        return getattr(self._stdout, name)


@contextlib.contextmanager
def prints_to_stderr():
    """Sends what the code run inside prints to stderr (_PrintsToStderr);
    a stream it put in sys.stdout's place stays there, for set_back."""
    stdout, stderr = sys.stdout, sys.stderr
    usable = not (getattr(stdout, "closed", True) or getattr(stderr, "closed", True))
    proxy = _PrintsToStderr(stdout, stderr) if usable else stdout
    sys.stdout = proxy
    try:
        yield
    finally:
        if sys.stdout is proxy:
            sys.stdout = stdout
        if usable and not proxy.ended_line:
            with contextlib.suppress(Exception):  # a stderr the code closed: broken_since's
                stderr.write("\n")


class ExitAtOnce(SystemExit):
    """os._exit, called by a model's code in the run's own thread: the run
    ended there, exit 0 if it said 0, with nothing trained or said."""


@contextlib.contextmanager
def exit_at_once_refused():
    """os._exit raises ExitAtOnce while the code runs, in this thread of
    this process: a process it forked, and the run's other threads (the
    stop signals' watcher), still end at once."""
    real, pid, thread = os._exit, os.getpid(), threading.get_ident()

    def _exit(code):
        if os.getpid() == pid and threading.get_ident() == thread:
            raise ExitAtOnce(code)
        real(code)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def _descriptor(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except Exception:  # noqa: BLE001 - a stream without one (io.StringIO, pytest's capture)
        return None
