"""How a group of variables moves at each step: the update rules, declared
once each in `UPDATE_RULES` (--optimizer chooses the convolution filters'
rule; the other groups use SGD).

A rule gets each variable's gradient (its group's decay already added), the
group's learning rate at this step, and its slot variables (the optimizer
makes those named in `slots`, one per variable); `optimizer.step` is the
run's step. Each UPDATE_RULES entry makes its rule from the group's
momentum and the run's `groups.Settings`, so that a rule's own options are
read in one place. Adding one (AdamW, say) means a class here and a line in
UPDATE_RULES (docs/extending.md).
TensorFlow is imported where a step is computed, not with the module, so
that flags are checked without it.
"""

from typing import Dict, Tuple

MOMENTUM_FORMS = ("keras", "pytorch")
# When Muon scales a filter back to its norm: before every step
# (airbench94_muon), or before the steps `periodic_renormalization` names
# (the 2025 record, hiverge/cifar10-speedrun).
MUON_RENORMALIZATIONS = ("every_step", "periodic")
# Quintic Newton-Schulz coefficients (a, b, c). airbench94_muon's: chosen to
# maximize the slope at 0, so that 3 steps suffice; singular values end near
# 1 (roughly 0.5-1.5), which trains as well as an exact orthogonalization.
# speedrun2025: the 2025 record's own tuning of the same.
NEWTON_SCHULZ = {"airbench": (3.4445, -4.7750, 2.0315),
                 "speedrun2025": (3.4576, -4.7391, 2.0843)}


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
    `orthogonalize` with the Newton-Schulz `coefficients`. No L2 decay: the
    renormalization keeps the norm.

    The 2025 record's options: `renormalize_steps`, a table of the run's
    steps (see `periodic_renormalization`) that renormalize, the others not
    (the table is read at min(step, its last), so a resumed run needs no
    state beyond the step); `weight_decay` (lambda): after the step the
    filter is multiplied by 1 - rate x lambda, decoupled from the gradient.
    """

    def __init__(self, momentum: float, weight_decay: float = 0.0, renormalize_steps=None,
                 coefficients=NEWTON_SCHULZ["airbench"]):
        if renormalize_steps is not None and not len(renormalize_steps):
            raise ValueError("Muon's renormalization table is empty: a run of 0 steps?")
        self.momentum, self.weight_decay = momentum, weight_decay
        self.renormalize_steps = None if renormalize_steps is None else tuple(renormalize_steps)
        self.coefficients = tuple(coefficients)

    def update(self, optimizer, variable, gradient, rate, slots):
        import tensorflow as tf

        buffer = slots["momentum"]  # Muon's kind: the sum of past gradients
        optimizer.assign(buffer, self.momentum * buffer + gradient)
        direction = gradient + self.momentum * buffer  # Nesterov
        channels = variable.shape[-1]
        step = tf.reshape(orthogonalize(tf.reshape(direction, [-1, channels]),
                                        coefficients=self.coefficients), variable.shape)
        weights = tf.convert_to_tensor(variable)
        scale = channels ** 0.5 / tf.norm(weights)
        # A zero filter (kernel_initializer="zeros") has no direction to scale
        # back: 0 x inf made every weight NaN. It keeps its norm until a step
        # moves it; the orthogonalized step of a zero gradient is zero.
        scale = tf.where(tf.math.is_finite(scale), scale, tf.ones_like(scale))
        if self.renormalize_steps is not None:
            table = tf.constant(self.renormalize_steps, tf.bool)
            last = tf.constant(len(self.renormalize_steps) - 1, optimizer.step.dtype)
            due = tf.gather(table, tf.minimum(optimizer.step, last))
            scale = tf.where(due, scale, tf.ones_like(scale))
        weights = weights * scale - rate * step
        if self.weight_decay:  # no op at all without it: the default's arithmetic unchanged
            weights *= 1 - rate * tf.cast(self.weight_decay, weights.dtype)
        optimizer.assign(variable, weights)


def orthogonalize(matrix, steps: int = 3, coefficients=NEWTON_SCHULZ["airbench"]):
    """`matrix` with its singular values moved near 1 by `steps` Newton-Schulz
    iterations (U S V^T -> about U V^T): Muon's update, with the quintic
    `coefficients` (a, b, c): X <- a X + (b A + c A^2) X, A = X X^T. In float32, where the
    reference uses bfloat16 for a GPU's speed: here the iteration costs a
    fraction of a percent of a step, and bfloat16's rounding of it would
    differ with the split of the batch, so N replicas would not train like
    one."""
    import tensorflow as tf

    a, b, c = coefficients
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


def periodic_renormalization(total_steps: int) -> list:
    """Which of the steps 0 .. total_steps - 1 renormalize Muon's filters in
    the 2025 record (hiverge/cifar10-speedrun): with n = step + 1, those where
    n - (the last such n, at first 0) >= 2 + floor(15 n / total_steps), so
    every 2nd step at first and up to every 17th at the end (in a run of 243
    steps the longest gap is 16). In between, the filters' norm grows with
    each step, which shrinks the step relative to the filter (a slowly
    falling effective rate)."""
    due, last = [], 0
    for n in range(1, total_steps + 1):
        renormalize = n - last >= 2 + (15 * n) // total_steps
        due.append(renormalize)
        if renormalize:
            last = n
    return due


def _muon(momentum: float, s) -> Muon:
    muon = s.muon  # its options (groups.MuonOptions)
    periodic = muon.muon_renormalize == "periodic"
    return Muon(momentum, weight_decay=muon.muon_weight_decay,
                renormalize_steps=periodic_renormalization(s.total_steps) if periodic else None,
                coefficients=NEWTON_SCHULZ[muon.muon_newton_schulz])


# name -> (momentum, groups.Settings) -> rule. --optimizer's choices.
UPDATE_RULES = {
    "sgd": lambda momentum, s: NesterovSGD(momentum, s.optimizer.momentum_form),
    "muon": _muon,
}
