"""The contract every network meets before it trains, checked on the built
model (`build_model` in __init__.py; docs/extending.md, "Your own model"):

- It takes uint8 images [batch, *info.image_shape], 0-255, and normalizes
  them itself. A model that takes floats (a float `keras.Input`, or a
  Sequential built without one, to which Keras gives the precision's
  compute dtype: float32, or bfloat16 or float16 under mixed precision)
  gets the same values as floats, 0.0-255.0: it must rescale them before
  a layer with weights sees them (a Rescaling or Normalization layer, a
  Lambda or arithmetic on the input, as keras.applications' models with
  their preprocessing do), or it is refused: a network made for 0-1 input
  would train on values 255 times too large, without a word.
- It returns logits [batch, info.num_classes] in any floating-point dtype,
  computed from its weights so that a gradient reaches them. A final
  softmax (a Softmax layer, an Activation("softmax"), a last layer's
  softmax activation, keras.ops.softmax on the output) is dropped, with a
  note: the loss and test-time augmentation take logits, and the export
  adds the softmax back. A subclassed model's softmax is inside its call(),
  which cannot be dropped: it is refused, saying so.
- It has weights to train.
- Its `parameter_group` hook, if it has one, names a group of
  core/optim/groups.py (or None) for every trainable variable: checked
  where the groups are made (training/build.py), which calls it once.

A model function is code, trusted as its user: whatever it raises, a
SystemExit and a KeyboardInterrupt included, is one ModelError naming it
(`users_code`), never a traceback or, worse, an exit 0.
"""

import contextlib
import os
import re
import signal
from typing import Optional, Tuple

from distributed_mpt import files
from distributed_mpt.core import precision
from distributed_mpt.core.models import process_state
from distributed_mpt.core.models.softmax import named
from distributed_mpt.core.models.process_state import FLOATX as _FLOATX, POLICY as _POLICY
from distributed_mpt.errors import (ExitCode, UserError, first_line, inside_autograph, quoted,
                                   text_of)


class ModelError(UserError):
    """A user's model that cannot be loaded, built, or breaks the contract."""


# What a run whose user's model failed after training began cannot do: go on with the
# model fixed. A resume compares the model's source (signature.py), and refuses it.
CHANGED = ("a change to the model's source makes another network: it trains anew, in "
           "another --model_dir")


class FirstStepError(ModelError):
    """A user's model failed in the first training step of a new run:
    nothing trained."""


@contextlib.contextmanager
def users_code(name: str, failure: str, passes: tuple = ()):
    """Runs model code of --model=`name`: anything it raises becomes one
    ModelError, "--model=NAME <failure> (<what it raised>)", except the
    errors of `passes` (a write's, where the code writes too) and a
    KeyboardInterrupt that Ctrl-C may have raised (predict's, where SIGINT
    has Python's default handler; a training run owns its stop signals).
    What it changes of the process that the run relies on (process_state.py
    lists it) is set back, with a warning; what cannot be is a ModelError, as
    the run would go on without it. A process it forked that returns into the
    run ends there. What it prints goes to stderr: stdout is the run's own
    (predict --json's)."""
    kept, raised = process_state.read(), True
    try:
        with _left_usable(name):
            yield
        raised = False
    except (UserError, *passes):
        raise
    except KeyboardInterrupt:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise
        raise ModelError(f"--model={quoted(name)} {failure} (KeyboardInterrupt, raised by the "
                         f"model's own code: a run stops on Ctrl-C at a step boundary, with a "
                         f"checkpoint)") from None
    except SystemExit as e:
        call = "os._exit" if isinstance(e, process_state.ExitAtOnce) else "sys.exit"
        raise ModelError(f"--model={quoted(name)} {failure} (it called {call}({quoted(e.code)}), "
                         f"which would end the run as if it had finished: raise an error saying "
                         f"what is wrong instead)") from None
    except BaseException as e:  # noqa: BLE001 - whatever the user's code raises is one line
        raise ModelError(f"--model={quoted(name)} {failure} ({cause(e)})") from None
    finally:
        now = process_state.read()
        changed = process_state.changed(kept, now)
        failed = process_state.set_back(kept, changed)
        # Its layers have it now.
        own = next((what for what in (_POLICY, _FLOATX) if what in changed and not raised), None)
        if own:
            flag = (f"--precision={now[own]}" if now[own] in precision.PRECISIONS
                    else f"--precision ({', '.join(precision.PRECISIONS)})")
            sets = ("which the run sets from --precision, with loss scaling where float16 "
                    "needs it" if own == _POLICY else "which the run keeps float32 (its "
                    "variables'), computing in the precision --precision sets")
            raise ModelError(f"--model={quoted(name)} sets {own} itself ({now[own]}), {sets}: "
                             f"remove that line, and pass {flag}")
        if failed:
            line = (f"--model={quoted(name)} changed {' and '.join(failed)}, which the run "
                    f"relies on, and it cannot be set back ({'; '.join(failed.values())})")
            if not raised:
                without = dict.fromkeys(process_state.WITHOUT[what] for what in failed)
                raise ModelError(f"{line}: {', and '.join(without)}; the model's code must put "
                                 f"back what it changes")
            files.warn(f"{line}; the run ends with the model's error")
        if restored := [what for what in changed if what not in failed]:
            files.warn(f"--model={quoted(name)} changed {' and '.join(restored)}, which the "
                       f"run relies on: set back")


@contextlib.contextmanager
def _left_usable(name: str):
    """Refuses what the code did that cannot be set back (process_state.py), before what
    can be is set back. A process the code forked that returned from it into the run ends
    there, at once: it trained too, as an orphan that hung for ever and held the --model_dir
    lock (shared through fork), so that every later run was refused. Its parent owns the
    run's files: nothing is cleaned up."""
    before, pid = process_state.unrecoverable(), os.getpid()
    try:
        with process_state.prints_to_stderr(), process_state.exit_at_once_refused():
            yield
    finally:
        if os.getpid() != pid:
            with contextlib.suppress(OSError):  # on descriptor 2: sys.stderr is the model's
                os.write(2, f"error: a process that --model={quoted(name)} forked returned from "
                            f"it into the run: it ends here; the run goes on in the process "
                            f"that forked it\n".encode(errors="backslashreplace"))
            os._exit(ExitCode.USAGE)
        if broken := process_state.broken_since(before):
            raise ModelError(f"--model={quoted(name)} {broken}") from None


# A model file larger is not code written by hand: Python's compiler holds
# the GIL, and leaves Ctrl-C and SIGTERM unanswered, for the whole compile,
# 1 to 3 s and 90 to 250 MB per MB of source (2 cores of an AVX2-only AMD
# EPYC, Zen 3: one of 60 MB went on for minutes). The largest .py file of
# the package's environment holds 4 MB, of generated data.
_MAX_SOURCE_BYTES = 8 << 20


def check_source(name: str, path: str) -> None:
    """Raises ModelError unless the file of --model=`name` at `path` is a
    regular file this user may read, of at most _MAX_SOURCE_BYTES, named in
    UTF-8 (as every path flag: its name's hash failed, "does not import")."""
    if re.search("[\ud800-\udfff]", path):  # os.fsdecode's stand-ins for bytes not UTF-8
        raise ModelError(f"--model={quoted(name)} is not UTF-8 text, the only paths this "
                         f"program takes: set a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1 "
                         f"if the name is UTF-8, else rename it")
    if problem := files.why_unreadable_file(path):
        raise ModelError(f"--model={quoted(name)}: {quoted(path)} {problem}")
    size = os.stat(path).st_size
    if size > _MAX_SOURCE_BYTES:
        raise ModelError(f"--model={quoted(name)}: {quoted(path)} holds {size / 2 ** 20:.0f} MB, "
                         f"more than the {_MAX_SOURCE_BYTES >> 20} MB of Python a model file may "
                         f"hold: load what makes it large (weights, tables) from a file of its "
                         f"own beside it")


# Keras wraps an error raised inside a layer's call in a header naming the
# layer, and the error's own message in bold (keras/src/utils/traceback_utils.py).
_KERAS_CALL = re.compile(r"Exception encountered when calling (\S+?)\.?$")
_KERAS_ARGUMENTS = "Arguments received by "
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")


def cause(error: BaseException) -> str:
    """What `error` says, for an error line: its type and first line (of
    the error inside Keras' "Exception encountered when calling" wrapper,
    with the layer; of the one inside autograph's "in user code:", with
    the user's file and line after its type), "..." where it is cut."""
    name, message, line = inside_autograph(error) or (type(error).__name__, error, None)
    lines = [line for line in _TERMINAL_CODES.sub("", text_of(message)).splitlines()
             if line.strip()]
    where = _KERAS_CALL.match(lines[0].strip()) if len(lines) > 1 else None
    # Keras' wrapper lists the call's arguments after the message, which an error may lack.
    said = where and not lines[1].startswith(_KERAS_ARGUMENTS)
    text = (f"in {where.group(1)}" + f": {lines[1].strip()}" * bool(said) if where
            else first_line(message, limit=10_000))
    # A variable's repr puts its values on the lines after "numpy=".
    text = re.sub(r",? numpy=$", ">", text)
    text = re.sub(r"^\{\{function_node [^}]*\}\} *", "", text)  # the function it failed in
    name += f" at {line}" if line else ""  # first: the end of a long message is cut
    return quoted(f"{name} {text}" if where else f"{name}: {text}")


def check_is_model(name: str, model) -> None:
    """Raises ModelError unless the model function returned a keras.Model.
    A generator or coroutine it returned (a `yield` or `async def`) is
    closed first: left to the garbage collector, a coroutine's "never
    awaited" warning followed the error line."""
    import keras

    if not isinstance(model, keras.Model):
        with contextlib.suppress(Exception):
            model.close()
        raise ModelError(f"--model={quoted(name)} returned {type(model).__name__}, not a "
                         f"keras.Model")


def check_servable(name: str, model, image_shape) -> None:
    """Raises ModelError if `model`, traced as the export's serving function
    traces it (any batch size, not training), cannot be a SavedModel's: its
    graph calls Python (a tf.py_function trained, and was exported; then
    predict failed on the SavedModel, "Could not find callback")."""
    import tensorflow as tf

    serving = tf.function(lambda images: model(images, training=False))
    with users_code(name, "failed when traced for the export, at any batch size"):
        graph = serving.get_concrete_function(tf.TensorSpec([None, *image_shape], tf.uint8)).graph
    if python := sorted({op.type for op in graph.get_operations() if "PyFunc" in op.type}):
        raise ModelError(f"--model={quoted(name)} calls Python inside its graph "
                         f"({', '.join(python)}: tf.py_function or tf.numpy_function), which "
                         f"the export's saved_model/ cannot hold (predict and TF Serving could "
                         f"not run it): compute it with TensorFlow or keras.ops; or pass "
                         f"--noexport")


def ignored_by_the_run(model, name: str) -> Optional[str]:
    """A note naming what of `model` only Keras' fit() uses (an overridden
    train_step or compute_loss, a compile()), which this run does not: it
    trained without a word, as if the user's step ran. None if nothing."""
    import keras

    # Keras' own training (fit) calls these, and uses what compile() was
    # given; the run has its own step, loss and optimizer, from the flags.
    what = [f"its {method}()" for method in ("train_step", "compute_loss")
            if getattr(type(model), method) is not getattr(keras.Model, method)]
    what += ["the compile() it was given"] if getattr(model, "compiled", False) else []
    if not what:
        return None
    return (f"--model={quoted(name)}: Keras' fit() alone uses {' and '.join(what)}; the run "
            f"trains with its own step, its loss and optimizer set by the flags")


def check_contract(name: str, model, info, traced_batch: Optional[int] = None) -> None:
    """Raises ModelError unless `model` (its final softmax dropped) maps uint8 images of
    `info`'s shape to float logits of `info`'s classes (a probe call of two images), takes
    0-255 as it means to, has weights to train and, given `traced_batch` (a replica's
    training batch), compiles into a training step at that batch whose gradient reaches
    them (not asked of the package's own models: their tests compile them)."""
    import numpy as np

    probe = np.random.default_rng(0).integers(0, 256, (2, *info.image_shape), dtype=np.uint8)
    shape = f"uint8 images {list(info.image_shape)}"
    subclassed = not isinstance(getattr(model, "outputs", None), list)
    with users_code(name, f"failed when called on {shape}"):
        try:
            outputs = model(probe, training=False)
        except Exception as e:  # noqa: BLE001 - a shape or dtype the model does not take
            # What TensorFlow says of a tensor used outside its graph: Keras builds a
            # subclassed model's layers by calling it on symbolic inputs in a scratch graph,
            # and a layer that makes tensors (not variables) as it is built keeps that
            # graph's (keras.layers.Normalization given its mean).
            if "is out of scope and cannot be used here" in str(e) and subclassed:
                raise ModelError(
                    f"--model={quoted(name)}: a layer of this subclassed model kept a tensor of "
                    f"the symbolic call in which Keras first builds such a model "
                    f"({cause(e).split(' Use return values')[0]}): "
                    f"build that layer in __init__ (a Normalization given its mean and variance: "
                    f"layer.build((None, *info.image_shape)); docs/extending.md, \"A subclassed "
                    f"model\")") from None
            # Not "does not take": the call may raise for reasons of its own
            # (an assertion on the values), and the cause says which.
            raise ModelError(
                f"--model={quoted(name)} failed when called on two {shape}, 0-255, which is "
                f"what this package gives every model ({cause(e)}): if it does not take them, "
                f"take them as they are (keras.Input(info.image_shape, dtype=\"uint8\"), or a "
                f"subclassed model's call()) and rescale or cast them before the first layer "
                f"that computes with them (keras.layers.Rescaling(1 / 255) does both)") from None
    _check_logits(name, outputs, 2, info.num_classes)
    try:
        values = np.asarray(outputs, np.float32)
    except (TypeError, ValueError) as e:  # a SparseTensor, a RaggedTensor: a traceback, exit 1
        raise ModelError(f"--model={quoted(name)} returns a {type(outputs).__name__}, not one "
                         f"dense tensor ({cause(e)}): it must return [batch, "
                         f"{info.num_classes}] logits") from None
    if np.all(values >= 0) and np.allclose(values.sum(axis=1), 1.0, atol=1e-3):
        where = ("from its call(): a subclassed model's softmax is code, which cannot be dropped "
                 "as a final softmax layer is" if subclassed
                 else "from something other than a final softmax")
        raise ModelError(f"--model={quoted(name)} returns probabilities (each row sums to 1) "
                         f"{where}: return logits, which the loss and test-time augmentation "
                         f"take (the export adds the softmax back)")
    if unscaled := _unscaled_float_input(model):
        dtype, layer = unscaled
        raise ModelError(
            f"--model={quoted(name)} takes its images as {dtype} and gives them to {layer} "
            f"unscaled: this package gives every model pixels 0-255, not 0-1. Rescale them first "
            f"(keras.layers.Rescaling(1 / 255), or layers.normalized_input(info)), or declare "
            f"keras.Input(info.image_shape, dtype=\"uint8\") if 0-255 is what the network expects")
    if not model.trainable_weights:
        raise ModelError(f"--model={quoted(name)} has no trainable weights ({len(model.weights)} "
                         f"frozen): there is nothing to train; leave some layers trainable "
                         f"(layer.trainable = False freezes one)")
    if traced_batch:
        _check_training_step(name, model, info, traced_batch)


def _check_logits(name: str, logits, batch: int, num_classes: int) -> None:
    """Raises ModelError unless `logits` are floats of shape [batch,
    num_classes] (a traced shape's unknown sizes pass, not an unknown rank)."""
    if isinstance(logits, (list, tuple, dict)):  # a model of several outputs: no shape of its own
        raise ModelError(f"--model={quoted(name)} returns {len(logits)} outputs (a "
                         f"{type(logits).__name__}); it must return one, [batch, {num_classes}] "
                         f"logits")
    shape = getattr(logits, "shape", ())
    returned = tuple(shape) if getattr(shape, "rank", 0) is not None else ("unknown rank",)
    if len(returned) != 2 or any(got not in (None, want)
                                 for got, want in zip(returned, (batch, num_classes))):
        raise ModelError(f"--model={quoted(name)} returns shape {list(returned)} for {batch} "
                         f"images; the dataset has {num_classes} classes: it must return "
                         f"[batch, {num_classes}] logits")
    dtype = getattr(logits.dtype, "name", str(logits.dtype))
    if "float" not in dtype:
        raise ModelError(f"--model={quoted(name)} returns {dtype}, not floating-point logits: "
                         f"the loss needs a gradient through them to train the weights")


def _check_training_step(name: str, model, info, batch: int) -> None:
    """Raises ModelError unless `model` compiles into a training step: the forward pass
    in training mode and the gradient of its logits, traced as a graph (nothing runs) at a
    replica's training `batch`. The probe call runs eagerly on 2 images, where code that
    needs a tensor's values (NumPy on it) or a batch size of its own still works; the run's
    step, a graph at the training batch, would fail only after the run's files are made.
    What only running finds (a kernel missing for a dtype) fails in the first step
    (training/loop.py names it)."""
    import tensorflow as tf

    reached = []

    def step(images):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            _check_logits(name, logits, batch, info.num_classes)
            total = tf.reduce_sum(tf.cast(logits, tf.float32))
        gradients = tape.gradient(total, model.trainable_variables)
        reached.extend(g is not None for g in gradients)
        return logits

    # As the step runs: in each replica (the variables of a strategy's scope
    # are read there, not in the scope's cross-replica context).
    replicas_step = tf.function(lambda images: tf.distribute.get_strategy().run(step, (images,)),
                                autograph=False)
    with users_code(name, f"failed when compiled into a training step on {batch} uint8 images "
                          f"{list(info.image_shape)}, as a graph (a tf.function)"):
        replicas_step.get_concrete_function(tf.TensorSpec((batch, *info.image_shape), tf.uint8))
    if not any(reached):
        raise ModelError(f"--model={quoted(name)}: no gradient reaches its weights from its "
                         f"logits (computed through a stop_gradient, or a round trip "
                         f"through integers?): nothing would train")


# What the user rescales pixels with: these layers, and arithmetic on the
# input tensor (keras.ops; `images / 255` in a functional model).
_RESCALING = ("Rescaling", "Normalization", "BatchNormalization", "LayerNormalization", "Lambda",
              "Add", "Subtract", "Multiply", "Divide", "TrueDivide")


def _unscaled_float_input(model) -> Optional[Tuple[str, str]]:
    """(the input's dtype, the layer) if `model` takes floats and its input reaches a layer
    with weights before anything that rescales it; None if it takes integers, rescales
    first, or is subclassed (its call() is code, and gets the uint8 images as they are)."""
    import keras

    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    inputs = getattr(graph, "inputs", None)
    if not (isinstance(inputs, list) and len(inputs) == 1 and hasattr(graph, "operations")):
        return None
    dtype = str(inputs[0].dtype)
    if "float" not in dtype:
        return None
    consumers = {}
    for operation in graph.operations:
        for node in operation._inbound_nodes:
            for tensor in node.input_tensors:
                consumers.setdefault(id(tensor), []).append((operation, node))
    frontier, seen = [inputs[0]], set()
    while frontier:
        tensor = frontier.pop()
        for operation, node in consumers.get(id(tensor), []):
            if type(operation).__name__ in _RESCALING:
                continue
            if isinstance(operation, keras.Model):
                if inner := _unscaled_float_input(operation):
                    return dtype, inner[1]
            elif getattr(operation, "weights", None):
                return dtype, named(operation)
            elif id(node) not in seen:  # padding, resizing, a cast: the values pass unscaled
                seen.add(id(node))
                frontier.extend(node.output_tensors)
    return None
