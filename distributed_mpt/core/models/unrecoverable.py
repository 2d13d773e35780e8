"""What a user's model code can do to the process that cannot be set back,
as contract.users_code sets back the working directory or a stop signal's
handler, and that broke the run only later, with a traceback:

- eager execution turned off (tf.compat.v1.disable_eager_execution(),
  disable_v2_behavior()), which TensorFlow cannot turn on again in the
  process: the probe call failed on a symbolic tensor;
- the distribution strategy's scope ended (keras.backend.clear_session()
  or tf.compat.v1.reset_default_graph() reset TensorFlow's default graph,
  which holds it): the variables made after it are not mirrored, and the
  scope's end failed with "IndexError: pop from empty list";
- sys.stdout or sys.stderr closed: the next progress line, or the error
  line itself, failed ("lost sys.stderr", the run's files left behind).

Each is refused, with what the model did (contract.py raises it); the
graph and the streams are made usable again first, so that the refusal
is one line and the run's clean-up runs.
"""

import os
import sys
from typing import NamedTuple, Optional

# What the run writes to each stream, for the refusal to name.
_STREAMS = {"stdout": "its progress lines", "stderr": "its warnings and errors"}


class Snapshot(NamedTuple):
    """The state `broken_since` looks at, before the model's code ran."""

    eager: bool
    graph: object
    strategy: Optional[object]  # the strategy whose scope the code ran in; None: none
    descriptors: dict  # each open stream of _STREAMS: its file descriptor, or None


def snapshot() -> Snapshot:
    """What `broken_since` compares with, taken before the model's code runs."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return Snapshot(tf.executing_eagerly(), tf.compat.v1.get_default_graph(), strategy,
                    {name: _descriptor(getattr(sys, name)) for name in _STREAMS
                     if not getattr(getattr(sys, name), "closed", True)})


def broken_since(before: Snapshot) -> Optional[str]:
    """What the code run since `before` did that the run cannot go on
    with ("turned off eager execution ...: remove that call"), None if
    nothing. A stream it closed is replaced by one on the same descriptor,
    and the default graph put back, so that the error can be said and the
    strategy's scope ended."""
    import tensorflow as tf

    closed = [name for name, descriptor in before.descriptors.items()
              if getattr(getattr(sys, name), "closed", False)]
    for name in closed:
        descriptor = before.descriptors[name]
        setattr(sys, name, open(os.devnull, "w") if descriptor is None else open(
            descriptor, "w", buffering=1, closefd=False, errors="backslashreplace"))
    if before.eager and not tf.executing_eagerly():
        return ("turned off eager execution (tf.compat.v1.disable_eager_execution() or "
                "disable_v2_behavior()), which TensorFlow cannot turn on again in this "
                "process, and the run's TensorFlow 2 code needs: remove that call")
    if before.strategy is not None and tf.compat.v1.get_default_graph() is not before.graph:
        from tensorflow.python.framework import ops

        # No public call makes a graph the default again outside a `with`,
        # which in eager mode would also leave eager execution.
        ops._default_graph_stack._global_default_graph = before.graph
        return (f"reset TensorFlow's default graph (keras.backend.clear_session() or "
                f"tf.compat.v1.reset_default_graph() does), which ended the scope of the run's "
                f"{type(before.strategy).__name__}: the variables made after it would not be "
                f"mirrored across its {before.strategy.num_replicas_in_sync} replicas; remove "
                f"that call (a run starts with nothing to clear)")
    if closed:
        return (f"closed {' and '.join(f'sys.{name}' for name in closed)}, to which the run "
                f"writes {' and '.join(_STREAMS[name] for name in closed)}: remove that call "
                f"({' or '.join(f'contextlib.redirect_{name}' for name in closed)} silences a "
                f"library for a while)")
    return None


def _descriptor(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except Exception:  # noqa: BLE001 - a stream without one (io.StringIO, pytest's capture)
        return None
