"""Whether an error of a training step after a run's first is a user's model's, to be one
line naming it rather than a traceback, exit 1, with nothing said of whose it was.

After the first step the package's own part of the step (input, loss, optimizer) has run
once already; what fails later is most often the model's: an assertion or a numerics
check of its own that a later batch trips, or its Python code traced anew (at a new crop
size, or where variables freeze). That is blamed on the model only where the error says
so: a failing op that TensorFlow names inside the model's own name scope (its forward or
backward pass), or a line of the user's file that autograph names. The model's scope counts
only where the step opens it, below nothing but the step's loop, branches, tape and
replicas: the package's own scopes (Muon's `grouped/update/norm`) may share a name with a
user's layer, or with a model named so, and a failure there is the package's.
The rest, the package's own failures among them, stays a traceback; so do the errors
that say nothing of the model (eval_views.NOT_THE_MODELS: memory, lost peers, the
runtime's), as in an evaluation.
"""

import contextlib
import re

import tensorflow as tf

from distributed_mpt.core.eval_views import NOT_THE_MODELS
from distributed_mpt.core.models.contract import ModelError, cause
from distributed_mpt.errors import UserError, inside_autograph, quoted

# How TensorFlow names the op that failed, in an error of a graph it ran.
_FAILED_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
# What TensorFlow appends to a name scope used twice in one graph (dense, dense_1).
_UNIQUIFIED = re.compile(r"_\d+$")
# The scopes a training step or forward pass opens around the model's call: the
# loop of --steps_per_loop, its branches, the gradient tape's backward pass,
# each replica's copy.
_AROUND_THE_MODEL = frozenset({"while", "cond", "gradient_tape", "replica"})


def is_the_models(error: BaseException, model) -> bool:
    """Whether `error` comes from `model`'s code: see the module's docstring."""
    if (found := inside_autograph(error)) and found[2]:
        return True
    if not isinstance(error, tf.errors.OpError):  # only TensorFlow's errors name an op
        return False
    for node in _FAILED_NODE.findall(error.message):
        for scope in node.split("/")[:-1]:  # the last part is the op's own name, not a scope
            if scope == model.name or _UNIQUIFIED.sub("", scope) == model.name:
                return True
            if _UNIQUIFIED.sub("", scope) not in _AROUND_THE_MODEL:
                break  # the package's own scope, or another's: not the model's call
    return False


@contextlib.contextmanager
def named_if_its_own(name: str, model, steps: str, kept: str):
    """Runs training `steps` ("training steps 3-4") of `model`, --model=`name`: an error
    that is the model's (is_the_models) becomes one ModelError naming it, what it raised,
    and what of the run is `kept`."""
    try:
        yield
    except (UserError, *NOT_THE_MODELS):
        raise
    except Exception as e:
        if not is_the_models(e, model):
            raise
        raise ModelError(f"--model={quoted(name)} failed in {steps} ({cause(e)}); {kept}") \
            from None
