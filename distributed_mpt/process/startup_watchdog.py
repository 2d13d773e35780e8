"""Bounds TensorFlow's start-up: a separate process that ends its parent if
the parent is asked to stop while TensorFlow starts (its import, the
strategy, for a multi-worker job the wait for the peers), or if the peers
are not all up by a deadline.

While TensorFlow starts, the worker holds its stop signals blocked and
cannot act on them (see stopping.py, "WAITING FOR TENSORFLOW"): its import
holds the interpreter for seconds at a time, and MultiWorkerMirroredStrategy
holds it for the whole wait. This process sees a stop signal pending in
/proc within POLL_SECONDS and ends the worker as stopping.py's policy says,
so that Kubernetes' SIGTERM during a rollout, or Kueue's preemption of a job
that has just started, is obeyed at once. It ignores those signals itself,
so that a signal sent to the whole process group cannot take it away. A
--model_dir that the worker created is removed again once the worker is
gone, as a stop before training leaves nothing new (stopping.py).
"""

import os
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

from distributed_mpt.errors import UserError, status_of_signal
from distributed_mpt.process import stopping

POLL_SECONDS = 0.2
# At the deadline, the peers that do not answer are named: each is given this
# long, all at once, the first MAX_PROBED of them.
PROBE_SECONDS = 2.0
MAX_PROBED = 64


class StartupWatchdog:
    """Use as a context manager around TensorFlow's start-up, inside
    `stopping.tensorflow_starting`. peers: the other workers' addresses, and
    timeout_seconds how long they may take to be up (from the watchdog's
    start), for a multi-worker job; None: no deadline."""

    def __init__(self, timeout_seconds: Optional[float] = None, peers: Sequence[str] = (),
                 new_model_dir: Optional[str] = None, own_files: Sequence[str] = ()):
        """new_model_dir: the --model_dir this process created (it holds its
        lock), removed if the worker is ended before training and it holds
        nothing but the lock file and `own_files` (names)."""
        deadline = "none" if timeout_seconds is None else str(timeout_seconds)
        # Only the peers it would probe, and how many there are: 10,000 of
        # them were more than one command line holds (E2BIG, a traceback,
        # under `ulimit -s 1024`), TF_CONFIG counting a second time there.
        self._command = stopping.helper_command(
            "distributed_mpt.process.startup_watchdog", str(os.getpid()), deadline,
            new_model_dir or "", ",".join(own_files), str(len(peers)), *peers[:MAX_PROBED])

    def __enter__(self):
        self._process = subprocess.Popen(self._command)
        return self

    def __exit__(self, *exc_info):
        self._process.kill()
        self._process.wait()


def _is_up(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:  # "[::1]:2222": the resolver takes an IPv6 address without its brackets
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
        return True
    except (OSError, ValueError):
        return False


def _not_up(peers: Sequence[str]) -> List[str]:
    """Those of the first MAX_PROBED `peers` that accept no connection
    within PROBE_SECONDS, probed at once: one after the other, 40 peers
    that drop connections took 80 s past the deadline, with stop signals
    unheeded."""
    up = set()
    probes = [threading.Thread(target=lambda p=p: _is_up(p) and up.add(p), daemon=True)
              for p in peers[:MAX_PROBED]]
    started = []
    for probe in probes:
        try:
            probe.start()
        except RuntimeError:  # no thread left (a pids limit): the rest count as not up
            break
        started.append(probe)
    ends = time.monotonic() + PROBE_SECONDS + 0.5
    for probe in started:
        probe.join(max(0.0, ends - time.monotonic()))
    return [p for p in peers[:MAX_PROBED] if p not in up]


def _watch(parent: int, timeout: Optional[float], peers: Sequence[str], count: int) -> bool:
    """Ends `parent` on a stop or at the deadline; returns whether it did.
    peers: the first MAX_PROBED of the `count` peers."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if os.getppid() != parent:
            return False  # the parent is gone
        stop = stopping.pending_stop_signal(parent)
        if stop is not None:
            end = stopping.WAITING_WORKER_STOP_SIGNAL
            print(f"{stop.name} while TensorFlow started: stopping (nothing trained yet; exit "
                  f"status {status_of_signal(end)}, retryable)", file=sys.stderr, flush=True)
            os.kill(parent, end)
            return True
        time.sleep(POLL_SECONDS)
    missing = _not_up(peers) or peers[:MAX_PROBED]
    unprobed = f" (and {count - MAX_PROBED:,} not probed)" if count > MAX_PROBED else ""
    end = stopping.PEER_TIMEOUT_SIGNAL
    print(f"error: peers not up after {timeout:g}s (--peer_timeout_seconds): waited for "
          f"{', '.join(missing)}{unprobed}; check that every worker was started with the same "
          f"cluster (exit status {status_of_signal(end)}, retryable)", file=sys.stderr, flush=True)
    os.kill(parent, end)
    return True


def _remove_new_model_dir(parent: int, model_dir: str, own_files: Sequence[str]) -> None:
    """Once the ended `parent` is gone (and with it its lock), removes the
    `model_dir` it created, under the lock, if it holds nothing but the
    lock file and `own_files`; a run that took the directory meanwhile
    keeps it."""
    from distributed_mpt.process.run_lock import RunLock

    gone_by = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < gone_by:
        time.sleep(POLL_SECONDS / 4)
    try:
        lock = RunLock(model_dir)
    except UserError:
        return
    lock.release(remove_model_dir_if_unused=True, own_files=own_files)


if __name__ == "__main__":  # ignoring the stop signals (start_guard.py)
    worker, model_dir, own = int(sys.argv[1]), sys.argv[3], sys.argv[4].split(",")
    if _watch(worker, None if sys.argv[2] == "none" else float(sys.argv[2]), sys.argv[6:],
              int(sys.argv[5])) and model_dir:
        _remove_new_model_dir(worker, model_dir, own)
