"""How a group of variables moves at each step: the update rules, declared
once each in `UPDATE_RULES` (--optimizer chooses the convolution filters'
rule; the other groups use SGD).

A rule gets each variable's gradient (its group's decay already added), the
group's learning rate at this step, and its slot variables (the optimizer
makes those named in `slots`, one per variable). Adding one (AdamW, say)
means a class here and a line in UPDATE_RULES (docs/extending.md).
TensorFlow is imported where a step is computed, not with the module, so
that flags are checked without it.
"""

from typing import Dict, Tuple

MOMENTUM_FORMS = ("keras", "pytorch")


class UpdateRule:
    """The update of one variable; `slots` names the state it keeps."""

    slots: Tuple[str, ...] = ("momentum",)

    def update(self, optimizer, variable, gradient, rate, slots: Dict) -> None:
        raise NotImplementedError


class NesterovSGD(UpdateRule):
    """SGD with Nesterov momentum `momentum`, in one of two forms that agree
    while the rate is constant and differ while it changes:

    keras (Keras' and TensorFlow's): the rate is folded into the velocity,
        v <- momentum v - rate g;  w <- w + momentum v - rate g
    pytorch (PyTorch's, which airbench's rates were tuned with): the
    velocity sums raw gradients and the current rate scales the step,
        b <- momentum b + g;  w <- w - rate (g + momentum b)
    """

    def __init__(self, momentum: float, form: str = "keras"):
        if form not in MOMENTUM_FORMS:
            raise ValueError(f"unknown momentum form {form!r}; choose from {MOMENTUM_FORMS}")
        self.momentum, self.form = momentum, form

    def update(self, optimizer, variable, gradient, rate, slots):
        import tensorflow as tf

        velocity = slots["momentum"]
        momentum = tf.cast(self.momentum, variable.dtype)
        if self.form == "keras":
            optimizer.assign(velocity, momentum * velocity - rate * gradient)
            optimizer.assign_add(variable, momentum * velocity - rate * gradient)
        else:
            optimizer.assign(velocity, momentum * velocity + gradient)
            optimizer.assign_sub(variable, rate * (gradient + momentum * velocity))


class Muon(UpdateRule):
    """Muon (K. Jordan et al., 2024), as airbench94_muon has it, for matrix-
    shaped variables (convolution filters: [..., out channels]): Nesterov
    momentum `momentum` added to the raw gradient, the filter renormalized
    to a Frobenius norm of sqrt(output channels) before each step, and a
    step of the group's rate along the momentum orthogonalized by
    `orthogonalize`. No weight decay: the renormalization keeps the norm."""

    def __init__(self, momentum: float):
        self.momentum = momentum

    def update(self, optimizer, variable, gradient, rate, slots):
        import tensorflow as tf

        buffer = slots["momentum"]  # Muon's kind: the sum of past gradients
        optimizer.assign(buffer, self.momentum * buffer + gradient)
        direction = gradient + self.momentum * buffer  # Nesterov
        channels = variable.shape[-1]
        step = tf.reshape(orthogonalize(tf.reshape(direction, [-1, channels])), variable.shape)
        weights = tf.convert_to_tensor(variable)
        optimizer.assign(variable, weights * (channels ** 0.5 / tf.norm(weights)) - rate * step)


def make_rule(name: str, momentum: float, momentum_form: str = "keras") -> UpdateRule:
    """The update rule `name` (an UPDATE_RULES key) with its momentum."""
    return UPDATE_RULES[name](momentum, momentum_form)


UPDATE_RULES = {
    "sgd": lambda momentum, form: NesterovSGD(momentum, form),
    "muon": lambda momentum, form: Muon(momentum),
}


# airbench94_muon's quintic Newton-Schulz coefficients: chosen to maximize the
# slope at 0, so that 3 steps suffice; singular values end near 1 (roughly
# 0.5-1.5), which trains as well as an exact orthogonalization.
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix, steps: int = 3):
    """`matrix` with its singular values moved near 1 by `steps` Newton-Schulz
    iterations (U S V^T -> about U V^T): Muon's update. In float32, where the
    reference uses bfloat16 for a GPU's speed: here the iteration costs a
    fraction of a percent of a step, and bfloat16's rounding of it would
    differ with the split of the batch, so N replicas would not train like
    one."""
    import tensorflow as tf

    a, b, c = _NEWTON_SCHULZ
    x = tf.cast(matrix, tf.float32)
    x = x / (tf.norm(x) + 1e-7)  # singular values <= 1
    tall = matrix.shape[0] > matrix.shape[1]
    if tall:
        x = tf.transpose(x)  # the smaller Gram matrix
    for _ in range(steps):
        gram = tf.matmul(x, x, transpose_b=True)
        x = a * x + tf.matmul(b * gram + c * tf.matmul(gram, gram), x)
    if tall:
        x = tf.transpose(x)
    return tf.cast(x, matrix.dtype)
