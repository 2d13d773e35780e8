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
runtime's), as in an evaluation, but for one: the UnknownError of a Python function the
model runs in its graph (tf.numpy_function, tf.py_function) failing inside its scope, which
is how TensorFlow passes on what that function raised (a RuntimeError, an AssertionError);
its MemoryError is ResourceExhaustedError, memory, and stays out.
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
# The ops that run Python in a graph: tf.numpy_function's, tf.py_function's.
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def is_the_models(error: BaseException, model) -> bool:
    """Whether `error` comes from `model`'s code: see the module's docstring."""
    if (found := inside_autograph(error)) and found[2]:
        return True
    return any(_in_the_models_scope(node, model) for node in _failed_nodes(error))


def _failed_nodes(error: BaseException) -> list:
    """The ops an error of TensorFlow's names as failing: none for another error."""
    return (_FAILED_NODE.findall(error.message) if isinstance(error, tf.errors.OpError)
            else [])


def _in_the_models_scope(node: str, model) -> bool:
    for scope in node.split("/")[:-1]:  # the last part is the op's own name, not a scope
        if scope == model.name or _UNIQUIFIED.sub("", scope) == model.name:
            return True
        if _UNIQUIFIED.sub("", scope) not in _AROUND_THE_MODEL:
            return False  # the package's own scope, or another's: not the model's call
    return False


def _its_python_failed(error: BaseException, model) -> bool:
    """Whether `error` is the UnknownError of Python code `model` runs in its graph."""
    return isinstance(error, tf.errors.UnknownError) and any(
        _UNIQUIFIED.sub("", node.rsplit("/", 1)[-1]) in _PYTHON_OPS
        and _in_the_models_scope(node, model) for node in _failed_nodes(error))


@contextlib.contextmanager
def named_if_its_own(name: str, model, steps: str, kept: str):
    """Runs training `steps` ("training steps 3-4") of `model`, --model=`name`: an error
    that is the model's (is_the_models) becomes one ModelError naming it, what it raised,
    and what of the run is `kept`."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if isinstance(e, NOT_THE_MODELS) and not _its_python_failed(e, model):
            raise
        if not is_the_models(e, model):
            raise
        raise ModelError(f"--model={quoted(name)} failed in {steps} ({cause(e)}); {kept}") \
            from None
