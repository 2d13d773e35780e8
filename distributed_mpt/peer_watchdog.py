"""Bounds a multi-worker start-up: a separate process that ends its parent
if the peers are not all up by a deadline, or if the parent is asked to stop
while it waits.

While MultiWorkerMirroredStrategy waits for its peers, the worker is inside
TensorFlow's C++ code holding the GIL: no Python thread or signal handler of
its own runs, and TensorFlow's coordination service installs a SIGTERM
handler that only records the signal. So the worker holds SIGTERM and
SIGINT blocked until its strategy exists (`hold_stop_signals`; they stay
pending, visible in /proc), and this process, started with
`python -m distributed_mpt.peer_watchdog`, acts on them. It ignores those signals itself, so that a signal sent to the whole
process group cannot take the deadline away.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from distributed_mpt.errors import EXIT_PEER_TIMEOUT

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_POLL_SECONDS = 0.2


@contextlib.contextmanager
def hold_stop_signals():
    """Blocks SIGTERM and SIGINT in the calling (main) thread for the block.

    Enter it before TensorFlow starts any thread: threads inherit the mask,
    so TensorFlow's never take these signals (a process-directed signal goes
    to a thread that does not block it), and they stay pending while the
    main thread is busy. On exit, the handlers found on entry replace
    TensorFlow's before the signals are unblocked: a SIGTERM that arrived
    meanwhile, or comes before the training loop installs its own handler,
    ends the process as it would any (128 + 15 = 143, retryable); nothing is
    lost, as nothing has been trained yet.
    """
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # replaces whatever TensorFlow installed
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


class PeerWatchdog:
    """Use as a context manager around the wait for the peers, inside
    `hold_stop_signals`."""

    def __init__(self, timeout_seconds: float, peers):
        self._command = [sys.executable, "-m", "distributed_mpt.peer_watchdog", str(os.getpid()),
                         str(timeout_seconds), *peers]

    def __enter__(self):
        self._process = subprocess.Popen(self._command)
        return self

    def __exit__(self, *exc_info):
        self._process.kill()
        self._process.wait()


def _pending_stop_signal(pid: int):
    """SIGTERM or SIGINT if one is pending (blocked) in process `pid`."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f
                     if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return None  # no /proc (not Linux): only the deadline applies
    pending = 0
    for mask in masks:
        pending |= mask
    return next((s for s in _STOP_SIGNALS if pending & (1 << (s - 1))), None)


def _is_up(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def _watch(parent: int, timeout: float, peers) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return  # the parent is gone
        stop = _pending_stop_signal(parent)
        if stop is not None:
            print(f"{signal.Signals(stop).name} while waiting for the peers: stopping (nothing "
                  f"trained yet; exit status 137, retryable)", file=sys.stderr, flush=True)
            os.kill(parent, signal.SIGKILL)  # the only signal it cannot block or swallow
            return
        time.sleep(_POLL_SECONDS)
    missing = [p for p in peers if not _is_up(p)] or peers
    print(f"error: peers not up after {timeout:g}s (--peer_timeout_seconds): waited for "
          f"{', '.join(missing)}; check that every worker was started with the same cluster "
          f"(exit status {EXIT_PEER_TIMEOUT}, retryable)", file=sys.stderr, flush=True)
    # SIGALRM is not blocked, and its default action ends the parent with
    # 128 + SIGALRM, which is EXIT_PEER_TIMEOUT.
    os.kill(parent, signal.SIGALRM)


if __name__ == "__main__":
    for stop_signal in _STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)
    _watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
