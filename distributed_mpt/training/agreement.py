"""Workers of one job agree before they train (the same run, the same
flags), and leave together when they are done.

A worker that resumes from another step (no shared --model_dir), finds
another split, or resolves another precision would call the collectives
differently: a hang. One started with another seed, rate, weight decay or
network (a model file that differs: core/models/signature.py) trains a
silently different run, which the chief's config.json would not show.
"""

import hashlib

import tensorflow as tf

from distributed_mpt.config import PRECISIONS
from distributed_mpt.errors import ClusterError, quoted


def check_workers_agree(strategy: tf.distribute.Strategy, facts: dict, flags: dict,
                        contents: dict) -> None:
    """Raises ClusterError on every worker unless all of them passed the
    same `facts` (numbers), `flags` (flag name: value) and `contents` (what
    each node's own files hold, by what they are: the model's signature,
    the images' fingerprint), naming what differs."""
    # Workers exchange only numbers: each flag or content travels as 32 bits
    # of its value's hash, which a float64 holds, and the sum over workers too.
    digests = [int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:4], "big")
               for v in [*flags.values(), *contents.values()]]
    values = tf.constant([float(v) for v in [*facts.values(), *digests]], tf.float64)

    @tf.function(autograph=False)
    def workers_differing():
        # Per entry: if all are equal, each equals the mean; if not, some
        # do not. The sum counts the workers that differ from the mean.
        mean = strategy.reduce("MEAN", strategy.run(lambda: tf.identity(values)), axis=None)
        differs = strategy.run(lambda: tf.cast(values != mean, tf.float64))
        return strategy.reduce("SUM", differs, axis=None)

    names = [*facts, *(f"--{name}" for name in flags), *contents]
    differing = {name for name, count in zip(names, workers_differing().numpy()) if count > 0}
    differing_flags = [f"--{name}" for name in flags if f"--{name}" in differing]
    if differing_flags:
        mine = " ".join(f"{name}={quoted(flags[name[2:]], 80)}" for name in differing_flags)
        raise ClusterError(
            f"the workers of this job were started with different {', '.join(differing_flags)} "
            f"(this worker: {mine}): give every worker the same flags")
    differing_contents = [name for name in contents if name in differing]
    if differing_contents:
        raise ClusterError(
            f"the {' and the '.join(differing_contents)} differ between the workers of this "
            f"job: give every node the same copy")
    if differing:
        mine = ", ".join(f"{name} {value:g}" for name, value in facts.items())
        raise ClusterError(
            f"the workers of this job see different runs ({', '.join(n for n in facts if n in differing)} "
            f"differ; this worker: {mine}; precision is an index into {'/'.join(PRECISIONS)}): "
            f"give every worker the same --model_dir on one shared file system, the same data "
            f"and flags, and an explicit --precision")


def leave_together(strategy: tf.distribute.Strategy) -> None:
    """Returns once every worker got here: the others wait for the chief's
    export. A worker that left first would have gone while the chief's
    coordination service still watched it, which logs it as crashed
    (`StartAbort UNAVAILABLE: ... The tasks have crashed`, as in
    tensorflow/tensorflow#58434) at the end of a run that succeeded."""

    @tf.function(autograph=False)
    def everyone_here():
        return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

    everyone_here()
