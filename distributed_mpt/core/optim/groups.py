"""Which variables train how: the parameter groups of a model, declared in
one place (`parameter_groups`), as airbench declares its `param_configs`.

A group is its variables, its update rule, its rate (a multiple of the
run's learning rate, or a schedule of its own), its L2 coefficient, and
optionally a number of steps after which it stops training. Every trainable
variable of the model is in exactly one group; `GroupedOptimizer` refuses a
variable in none. (Keras is imported where the groups are made, so that
flags are checked without TensorFlow.)
"""

import dataclasses
from typing import Callable, List, Optional, Tuple

from distributed_mpt.core.optim.rules import (MOMENTUM_FORMS, MUON_RENORMALIZATIONS,
                                              NEWTON_SCHULZ, UPDATE_RULES, UpdateRule)
from distributed_mpt.core.optim.schedules import (REFERENCE_BATCH_SIZE, learning_rate_schedule,
                                                  scaled_learning_rate)
from distributed_mpt.options import MAX_STEPS, Options, option, require, require_at_most

# The groups every model's trainable variables are sorted into (airbench's
# whitening bias, when there is one, aside).
GROUPS = ("filters", "shifts", "kernels", "others")
# A model may say which of its variables go to which group: a function
# `model.parameter_group(variable) -> name of GROUPS or None` (None: the
# default below). docs/extending.md, "Which variables train how".
HOOK = "parameter_group"

# What a group does once its `train_steps` are over: "stop" leaves it as it
# is at once (the references: a variable without a gradient is skipped);
# "coast" zeroes its gradient and lets its momentum run out.
FREEZES = ("stop", "coast")


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    """Variables that train alike.

    rate: multiple of the run's learning rate at every step, unless
    `schedule` (step -> rate) gives the group a rate of its own.
    weight_decay: L2 coefficient c: 2 c w is added to each gradient, as the
    gradient of c |w|^2 added to the mean loss.
    train_steps: trained for the first N steps only (None: all), then frozen
    as `freeze` says.
    """

    name: str
    variables: Tuple
    rule: UpdateRule
    rate: float = 1.0
    weight_decay: float = 0.0
    schedule: Optional[Callable] = None
    train_steps: Optional[int] = None
    freeze: str = "stop"


_MAX_MULTIPLIER = 1e4
# Far above any rate that trains (airbench94's peak is 1.5 at batch 1024),
# and low enough that scaled by any global batch it stays finite.
MAX_RATE = 1e3
MAX_DECAY = 1e2  # 5e-4 trains; divided by a multiplier (>= 1e-4) still finite


@dataclasses.dataclass(frozen=True)
class MuonOptions(Options):
    """Muon's own options (--optimizer=muon), read where the groups and their rules are made."""

    muon_learning_rate: float = option(
        0.24, "--optimizer=muon: the filters' peak learning rate (not scaled with the batch: "
        "Muon's step size does not depend on the gradient's); it follows --lr_schedule.")
    muon_momentum: float = option(0.6, "--optimizer=muon: the filters' Nesterov momentum.")
    muon_weight_decay: float = option(
        0.0, "--optimizer=muon: after each step the filters are multiplied by 1 - Muon's rate x "
        "this (the 2025 record's decoupled decay, hiverge/cifar10-speedrun); a renormalization "
        "undoes it, so it acts between them (--muon_renormalize=periodic).")
    muon_renormalize: str = option(
        "every_step", "--optimizer=muon: when a filter is scaled back to a norm of sqrt(output "
        "channels). every_step (airbench94_muon). periodic (the 2025 record, "
        "hiverge/cifar10-speedrun): before step n (from 1) if n minus the last such n is at "
        "least 2 + floor(15 n / total steps): every 2nd step at first, up to every 17th at the "
        "end.", MUON_RENORMALIZATIONS)
    muon_newton_schulz: str = option(
        "airbench", "--optimizer=muon: the quintic Newton-Schulz coefficients of the "
        "orthogonalization. airbench: (3.4445, -4.7750, 2.0315), airbench94_muon's. "
        "speedrun2025: (3.4576, -4.7391, 2.0843), the 2025 record's (hiverge/cifar10-speedrun).",
        tuple(NEWTON_SCHULZ))

    def check(self) -> None:
        require(self.muon_weight_decay >= 0,
                f"--muon_weight_decay={self.muon_weight_decay} must be >= 0")
        require_at_most(self, MAX_DECAY, "muon_weight_decay")
        require(0 < self.muon_learning_rate <= MAX_RATE,
                f"--muon_learning_rate={self.muon_learning_rate} must be in (0, {MAX_RATE:g}]")
        require(0 <= self.muon_momentum < 1,
                f"--muon_momentum={self.muon_momentum} must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class OptimizerOptions(Options):
    """How the groups train: the filters' update rule, the rate, momentum and
    decay, the shifts' multiple, the whitening bias's training, the label
    smoothing and the lookahead. None: the model's default (core/models)."""

    optimizer: str = option(
        "sgd", "sgd: SGD with Nesterov momentum. muon (airbench94_muon's): Muon for the "
        "convolution filters (orthogonalized steps, no weight decay: Muon keeps their norm; "
        "see --muon_learning_rate), SGD for the rest, with airbench's whitening bias at the "
        "batch-norm shifts' rate (--shift_lr_multiplier) falling linearly to 0 over "
        "--whiten_bias_epochs.", tuple(UPDATE_RULES))
    learning_rate: Optional[float] = option(
        None, "Learning rate at the reference batch of 128. The peak rate is this x global "
        "batch / 128, at most --max_learning_rate; the run prints the rate it uses.")
    max_learning_rate: Optional[float] = option(
        None, "Ceiling of the peak learning rate (0: none), for networks that diverge above a "
        "rate whatever the batch (the MLP's default: 0.05). It caps the model's own rate; an "
        "explicit --learning_rate is used as scaled, unless --max_learning_rate is given too.")
    momentum: Optional[float] = option(None, "SGD Nesterov momentum.")
    momentum_form: str = option(
        "keras", "How SGD's momentum meets a changing rate. keras: the rate is folded into the "
        "velocity (v = m v - rate g). pytorch: the velocity sums raw gradients and the current "
        "rate scales the step (b = m b + g; step = rate (g + m b)), as in the PyTorch code "
        "airbench's rates were tuned with. The two agree while the rate is constant.",
        MOMENTUM_FORMS)
    weight_decay: Optional[float] = option(
        None, "L2 coefficient c on kernels (2 c w added to their gradient, as c |w|^2 added to "
        "the mean loss); batch-norm shifts get c / --shift_lr_multiplier; biases and scales "
        "none (core/optim/groups.py).")
    label_smoothing: Optional[float] = option(None, "Label smoothing of the training loss.")
    shift_lr_multiplier: float = option(
        1.0, "Batch-norm shifts (beta) train at this multiple of the learning rate (airbench94: "
        "64); their L2 coefficient is --weight_decay divided by it, so that their decay per "
        "step is as large as the kernels'.")
    whiten_bias_epochs: float = option(
        0.0, "airbench: train the whitening layer's bias for this many epochs, then freeze it "
        "(airbench94: 3; see --optimizer for Muon's); 0: the bias stays 0.")
    whiten_bias_freeze: str = option(
        "coast", "How the whitening bias stops after --whiten_bias_epochs. stop: at once, as "
        "both airbench references do (a variable without a gradient is skipped). coast: its "
        "gradient is zeroed and its momentum runs out over the next steps (what the cpu_cnn "
        "and cpu_cnn94 recipes were measured with).", FREEZES)
    lookahead: bool = option(
        False, "airbench94's lookahead: every 5 steps the weights (and batch-norm statistics) "
        "move to an exponential moving average of themselves, of decay 0.95^5 x "
        "(step/total steps)^3, so that averaging grows as the learning rate falls; after the "
        "last step they are that average.")

    def check(self) -> None:
        require_at_most(self, MAX_STEPS, "whiten_bias_epochs")
        require_at_most(self, MAX_RATE, "max_learning_rate")
        require_at_most(self, MAX_DECAY, "weight_decay")
        require(0 < self.learning_rate <= MAX_RATE,
                f"--learning_rate={self.learning_rate} must be in (0, {MAX_RATE:g}]: the rate at "
                f"the reference batch of 128, scaled with the global batch")
        require(self.max_learning_rate >= 0,
                f"--max_learning_rate={self.max_learning_rate} must be >= 0 (0: no ceiling)")
        require(0 <= self.momentum < 1, f"--momentum={self.momentum} must be in [0, 1)")
        require(self.weight_decay >= 0, f"--weight_decay={self.weight_decay} must be >= 0")
        require(0 <= self.label_smoothing < 1,
                f"--label_smoothing={self.label_smoothing} must be in [0, 1)")
        require(1 / _MAX_MULTIPLIER <= self.shift_lr_multiplier <= _MAX_MULTIPLIER,
                f"--shift_lr_multiplier={self.shift_lr_multiplier} must be in "
                f"[{1 / _MAX_MULTIPLIER:g}, {_MAX_MULTIPLIER:g}]")
        require(self.whiten_bias_epochs >= 0,
                f"--whiten_bias_epochs={self.whiten_bias_epochs} must be >= 0")

    def peak_learning_rate(self, global_batch_size: int) -> float:
        """The run's peak rate: --learning_rate scaled to the global batch, capped."""
        return scaled_learning_rate(self.learning_rate, global_batch_size, self.max_learning_rate)

    def describe_rate(self, global_batch_size: int, peak: float) -> str:
        """How `peak` follows from the flags, for the run's first line."""
        scaled = scaled_learning_rate(self.learning_rate, global_batch_size)
        rule = f"{self.learning_rate:g} x {global_batch_size}/{REFERENCE_BATCH_SIZE}"
        if peak < scaled:
            rule += f" = {scaled:g}, capped at --max_learning_rate={self.max_learning_rate:g}"
        return rule

    def make_lookahead(self, model, total_steps: int):
        """airbench94's lookahead over `model` (lookahead.py) if asked for, else None."""
        from distributed_mpt.core.optim.lookahead import Lookahead

        return Lookahead(model, total_steps) if self.lookahead else None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the groups are made from: the optimizer's options and Muon's,
    the run's peak rate, and its steps per epoch (the whitening bias's
    epochs count them) and in all (Muon's periodic renormalization spans them)."""

    optimizer: OptimizerOptions
    peak_learning_rate: float
    muon: MuonOptions = MuonOptions()
    steps_per_epoch: int = 1
    total_steps: int = 0


def parameter_groups(model, settings: Settings) -> List[ParameterGroup]:
    """The groups of `model`'s trainable variables, each in the group its
    model's `parameter_group` hook names, or by default:

    whitening bias  airbench's; SGD. With --optimizer=sgd as airbench94 has
                    it: the run's rate, decay c; with muon as
                    airbench94_muon has it: --shift_lr_multiplier x the peak,
                    falling linearly to 0 over its steps, decay c / that.
    filters         convolution kernels (4-D): --optimizer's rule; SGD decays
                    them by c, Muon not at all (it renormalizes them); Muon
                    at its own peak rate, following the run's schedule.
    shifts          batch-norm shifts (beta): SGD at --shift_lr_multiplier x
                    the rate, decay c / that.
    kernels         the other kernels (dense layers): SGD, decay c.
    others          biases, batch-norm scales: SGD, no decay.
    """
    import keras

    s, options, muon_options = settings, settings.optimizer, settings.muon
    sgd = UPDATE_RULES["sgd"](options.momentum, s)
    decay, shift_rate = options.weight_decay, options.shift_lr_multiplier
    bias = _whitening_bias(model)
    shift_ids = {id(layer.beta) for layer in model._flatten_layers(include_self=False)
                 if isinstance(layer, keras.layers.BatchNormalization) and layer.center
                 and layer.beta.trainable}
    chosen = chosen_groups(model)
    members = {name: [] for name in GROUPS}
    for variable in model.trainable_variables:
        if variable is not bias:
            rank = len(variable.shape)
            default = ("shifts" if id(variable) in shift_ids else "filters" if rank == 4
                       else "kernels" if rank >= 2 else "others")
            members[chosen.get(id(variable), default)].append(variable)
    muon = options.optimizer == "muon"
    filters_rule = UPDATE_RULES[options.optimizer](
        muon_options.muon_momentum if muon else options.momentum, s)
    groups = [
        ParameterGroup("filters", tuple(members["filters"]), filters_rule,
                       rate=muon_options.muon_learning_rate / s.peak_learning_rate if muon else 1.0,
                       weight_decay=0.0 if muon else decay),
        ParameterGroup("shifts", tuple(members["shifts"]), sgd, rate=shift_rate,
                       weight_decay=decay / shift_rate),
        ParameterGroup("kernels", tuple(members["kernels"]), sgd, weight_decay=decay),
        ParameterGroup("others", tuple(members["others"]), sgd),
    ]
    if bias is not None and bias.trainable:
        steps = round(options.whiten_bias_epochs * s.steps_per_epoch)
        # With muon, its own rate, falling to 0 over its steps, whatever the schedule.
        own = (learning_rate_schedule(shift_rate * s.peak_learning_rate, steps, 0, "linear")
               if muon else None)
        groups.insert(0, ParameterGroup(
            "whitening bias", (bias,), sgd, schedule=own,
            weight_decay=decay / shift_rate if muon else decay, train_steps=steps,
            freeze=options.whiten_bias_freeze))
    return [group for group in groups if group.variables]


def chosen_groups(model) -> dict:
    """{id(variable): group} for each trainable variable to which `model`'s
    `parameter_group` hook gives a group; {} for a model without the hook.
    Raises ValueError for a hook that is not a function, or an answer that
    names no group (training/build.py turns it into one line naming the model)."""
    hook = getattr(model, HOOK, None)
    if hook is None:
        return {}
    if not callable(hook):
        raise ValueError(f"model.{HOOK} is a {type(hook).__name__}, not a function of a "
                         f"variable returning one of {', '.join(GROUPS)} or None")
    chosen = {}
    for variable in model.trainable_variables:
        group = hook(variable)
        if group is not None:
            if not isinstance(group, str) or group not in GROUPS:
                raise ValueError(f"model.{HOOK}({variable.path}) returned {group!r}: name one of "
                                 f"{', '.join(GROUPS)}, or None for the default group")
            chosen[id(variable)] = group
    return chosen


def describe(groups: List[ParameterGroup]) -> str:
    """The groups in one line, for a run's start: each group's rule and how
    many variables and weights it trains."""
    import math

    return "; ".join(f"{group.name}: {type(group.rule).__name__}, {len(group.variables)} "
                     f"variable(s), {sum(math.prod(v.shape) for v in group.variables):,} weights"
                     for group in groups)


def freezes(groups: List[ParameterGroup]) -> List[Tuple[int, Tuple]]:
    """(train_steps, variables) of each group that trains for a number of
    steps only: what the training loop leaves out of the gradient from that
    step on (steps.Trainer's `frozen`)."""
    return [(group.train_steps, group.variables) for group in groups
            if group.train_steps is not None]


def _whitening_bias(model):
    """The bias of the model's whitening layer, or None."""
    from distributed_mpt.core.models.layers import WhiteningConv2D

    found = [layer for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, WhiteningConv2D) and layer.use_bias]
    return found[0].bias if found else None
