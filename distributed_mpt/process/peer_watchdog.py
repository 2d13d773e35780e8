"""Bounds a multi-worker start-up: a separate process that ends its parent
if the peers are not all up by a deadline, or if the parent is asked to stop
while it waits.

While MultiWorkerMirroredStrategy waits for its peers, the worker holds its
stop signals blocked and cannot act on them (see stopping.py, "WAITING FOR
TENSORFLOW"); this process sees them pending in /proc and ends the worker as
stopping.py's policy says. It ignores those signals itself, so that a signal
sent to the whole process group cannot take the deadline away.
"""

import os
import socket
import subprocess
import sys
import time

from distributed_mpt.process import stopping
from distributed_mpt.errors import status_of_signal

_POLL_SECONDS = 0.2


class PeerWatchdog:
    """Use as a context manager around the wait for the peers, inside
    `stopping.tensorflow_starting`."""

    def __init__(self, timeout_seconds: float, peers):
        self._command = stopping.helper_command(
            "distributed_mpt.process.peer_watchdog", str(os.getpid()), str(timeout_seconds), *peers)

    def __enter__(self):
        self._process = subprocess.Popen(self._command)
        return self

    def __exit__(self, *exc_info):
        self._process.kill()
        self._process.wait()


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
        stop = stopping.pending_stop_signal(parent)
        if stop is not None:
            end = stopping.WAITING_WORKER_STOP_SIGNAL
            print(f"{stop.name} while waiting for the peers: stopping (nothing trained yet; exit "
                  f"status {status_of_signal(end)}, retryable)", file=sys.stderr, flush=True)
            os.kill(parent, end)
            return
        time.sleep(_POLL_SECONDS)
    missing = [p for p in peers if not _is_up(p)] or peers
    end = stopping.PEER_TIMEOUT_SIGNAL
    print(f"error: peers not up after {timeout:g}s (--peer_timeout_seconds): waited for "
          f"{', '.join(missing)}; check that every worker was started with the same cluster "
          f"(exit status {status_of_signal(end)}, retryable)", file=sys.stderr, flush=True)
    os.kill(parent, end)


if __name__ == "__main__":
    stopping.ignore_stop_signals()
    _watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
