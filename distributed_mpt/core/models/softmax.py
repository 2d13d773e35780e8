"""A user's final softmax, dropped for training (contract.py says why): the
loss and test-time augmentation take logits, and the export adds the
softmax back."""

from typing import Optional, Tuple

from distributed_mpt.errors import quoted


def drop_final_softmax(model, name: str) -> Tuple[object, Optional[str]]:
    """(`model` returning logits, a note saying what was dropped) if its
    output is a softmax; (`model`, None) if not. The model returned may be
    a new one over the same layers."""
    import keras

    if isinstance(model, keras.Sequential):
        last = model.layers[-1] if model.layers else None
        if _is_softmax(last):
            model.pop()
            return model, _dropped(name, f"its last layer, {named(last)}")
    else:
        outputs = getattr(model, "outputs", None)
        if not (isinstance(outputs, list) and len(outputs) == 1):
            return model, None  # subclassed: its call() is code (see check_contract)
        operation, node_index, _ = outputs[0]._keras_history
        if _is_softmax(operation):
            before = operation._inbound_nodes[node_index].input_tensors[0]
            # One input as one tensor, as the user's model took it: Keras
            # warns of a call whose structure differs from its inputs'.
            inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
            kind = "layer" if isinstance(operation, keras.layers.Layer) else "operation"
            logits = keras.Model(inputs, before, name=model.name)
            from distributed_mpt.core.optim.groups import HOOK

            if hasattr(model, HOOK):  # the user's choice of update rules, kept
                setattr(logits, HOOK, getattr(model, HOOK))
            return logits, _dropped(name, f"its last {kind}, {named(operation)}")
        last = operation
    if _has_softmax_activation(last):
        last.activation = keras.activations.linear
        return model, _dropped(name, f"the softmax activation of its last layer, {named(last)}")
    return model, None


def _is_softmax(operation) -> bool:
    """A keras.layers.Softmax or keras.ops.softmax over the last axis: cut
    off. A layer with a softmax activation, Activation("softmax") among
    them, is made linear instead, as runs from before the cut resume."""
    return (type(operation).__name__ == "Softmax"
            and type(operation).__module__.startswith("keras.")
            and getattr(operation, "axis", -1) in (-1, [-1], (-1,)))


def _has_softmax_activation(layer) -> bool:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", "") == "softmax"


def named(operation) -> str:
    """A layer or operation as a line names it: its type and name."""
    return f"{type(operation).__name__} {quoted(operation.name)!r}"


def _dropped(name: str, what: str) -> str:
    return (f"--model={quoted(name)} ends in a softmax ({what}): it is dropped for training, "
            f"whose loss and test-time augmentation take logits; the export adds it back")
