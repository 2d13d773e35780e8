"""A console that goes away must not end the process.

A reader can stop reading before the process is done: `| head` has its
lines, or a `| tee run.log` ends on the same Ctrl-C that asks training to
stop with a checkpoint. Python then raises BrokenPipeError at the next
print, and a training run died of it at its next progress line, before the
checkpoint its stop was saving (`distributed-mpt-train ... | tee log`, tee
ended, then SIGINT: exit 1 with a traceback, no checkpoint). The progress
lines are in metrics.jsonl as well, so nothing is lost by dropping them.

So every entry point's stdout and stderr drop what nobody reads: the first
write that finds its reader gone points the descriptor at /dev/null (where
TensorFlow's C++ lines and Python's final flush then go too), and the
process carries on as if it had been read. stderr passes through the log
filter in training, which drops what it cannot pass on: this covers it
before and after.

A console that cannot be written for another reason (`> log` on a full
disk) is an error instead, one `error:` line on stderr and exit 2:
predict's output is its answers, and a run's log should not vanish
unseen. Only when stderr is the stream that failed is there nobody to tell
(and in training, the log filter drops what it cannot write to stderr).
"""

import contextlib
import errno
import os
import sys
import threading
import time
from typing import Callable, TextIO

from distributed_mpt.errors import ConsoleError


class _DroppedWhenUnread:
    """A text stream whose writes succeed after its reader has gone, and
    that raises ConsoleError once when it cannot be written."""

    def __init__(self, stream, name: str, closed_at_start: bool):
        self._stream = stream
        self._name = name
        self.closed_at_start = closed_at_start  # `>&-` as the process began: /dev/null now

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)
        except OSError as e:
            raise self._unwritable(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
        except OSError as e:
            raise self._unwritable(e) from None

    def _unwritable(self, error: OSError) -> ConsoleError:
        # Once: what is still buffered, and what follows, would fail again
        # at every write and at the exit's flush.
        self._to_devnull()
        remedy = ("free space where it goes, or send it elsewhere"
                  if error.errno in (errno.ENOSPC, errno.EDQUOT) else "send it elsewhere")
        return ConsoleError(f"cannot write {self._name} ({error.strerror or error}): {remedy}")

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        self._stream.flush()  # what the reader missed is still buffered

    def __getattr__(self, name):
        return getattr(self._stream, name)


def run_with_console(main: Callable[[], int]) -> int:
    """An entry point's `main()`, run with sys.stdout and sys.stderr that
    drop what nobody reads (see above); its exit code. A console that cannot
    be written ends it with one `error:` line on the other stream."""
    _survive_lost_readers()
    try:
        code = main()
        # Here, not at exit: buffered output may fail only now.
        sys.stdout.flush()
        sys.stderr.flush()
        return code
    except ConsoleError as e:
        tell(f"error: {e}", sys.stderr)
        return e.exit_code


def tell(line: str, stream: TextIO) -> None:
    """Writes `line` to `stream` if it can be written. One that cannot
    (ConsoleError, said once) leads to /dev/null from then on: whoever
    should read it has nothing to read it with."""
    with contextlib.suppress(ConsoleError):
        print(line, file=stream, flush=True)


def _survive_lost_readers() -> None:
    """Makes sys.stdout and sys.stderr drop what nobody reads any more (see
    above). For an entry point, before it writes anything.

    A stream that was closed when the process started (`2>&-`) is None in
    Python; it becomes a stream to /dev/null, and its descriptor with it.
    Else code that asks it (isatty) crashes, and the next file opened gets
    the descriptor, into which TensorFlow's C++ lines (descriptor 2) go."""
    for fd, name, said_as in ((1, "stdout", "standard output"), (2, "stderr", "standard error")):
        closed = getattr(sys, name) is None
        stream = getattr(sys, name) or open(_occupy(fd), "w", closefd=False)
        if not isinstance(stream, _DroppedWhenUnread):
            stream = _DroppedWhenUnread(stream, said_as, closed)
        setattr(sys, name, stream)


def _occupy(fd: int) -> int:
    """Points descriptor `fd` at /dev/null if it is closed; returns it."""
    try:
        os.fstat(fd)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: maybe fd
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)
    return fd


@contextlib.contextmanager
def lines_while(activity: str, seconds: float, say: bool = True):
    """A line on stdout every `seconds` while the block runs (if `say`):
    what holds a process before its first line of progress is not silent
    (an image folder of 100,000 files took 7 minutes to decode, unseen, on
    2 cores of an AVX2-only AMD EPYC, Zen 3, loaded)."""
    done, started = threading.Event(), time.monotonic()

    def lines():
        while not done.wait(seconds):
            print(f"{activity}: {time.monotonic() - started:.0f} s so far", flush=True)

    if say:
        threading.Thread(target=lines, daemon=True, name="lines-while").start()
    try:
        yield
    finally:
        done.set()
