"""What a user's model code may change of the process that the run relies
on: read before it runs and set back after it, by contract.users_code.

The working directory (relative paths), Keras' mixed-precision policy (set
from --precision), the stop signals' handlers (a library that ignores
SIGTERM) and the descriptor that signals wake: process/stopping.py hears of
a stop through it, and an event loop that sets its own (asyncio's, which
sets none when it closes) left a run that only SIGKILL stopped.
"""

import contextlib
import os
import signal
import threading
from typing import Optional

from distributed_mpt.errors import STOP_SIGNALS, first_line, quoted

POLICY = "the mixed-precision policy"
_CWD, _HANDLERS = "the working directory", "the handlers of stop signals"
_WAKEUP = "the descriptor that signals wake (signal.set_wakeup_fd)"
# What the run would do without what a model changed and cannot be set back.
WITHOUT = {_CWD: "relative paths would lead elsewhere",
           _HANDLERS: "a stop signal would not stop it with a checkpoint",
           _WAKEUP: "a stop signal would not stop it with a checkpoint"}


def read() -> dict:
    """What the run relies on, as it is now: the signals' parts only in the
    main thread, which alone may set them."""
    import keras

    state = {_CWD: _cwd(), POLICY: keras.mixed_precision.global_policy().name}
    if threading.current_thread() is threading.main_thread():
        state[_HANDLERS] = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        state[_WAKEUP] = _wakeup_fd()
    return state


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


def _cwd() -> Optional[str]:
    try:
        return os.getcwd()
    except OSError:  # removed under the process
        return None


def set_back(kept: dict, changed) -> dict:
    """Sets back what of `kept` is `changed`; returns {what: why} for what
    could not be."""
    import keras

    failed = {}
    if POLICY in changed:
        keras.mixed_precision.set_global_policy(kept[POLICY])
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
    return failed
