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

from distributed_mpt.core.optim.rules import UPDATE_RULES, UpdateRule
from distributed_mpt.core.optim.schedules import learning_rate_schedule

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the groups are made from (each a flag of distributed-mpt-train).

    filters_rule: the update rule of the convolution filters (--optimizer);
    filters_rate: their rate relative to the run's (Muon's own peak over the
    run's); momentum_form: SGD's (rules.NesterovSGD); shift_rate: batch-norm
    shifts' multiple of the rate, their decay divided by it so that their
    decay per step is the kernels'; whiten_bias_steps: how long airbench's
    whitening bias trains, and whiten_bias_freeze how it stops. Muon's
    options (the 2025 record's; rules.Muon): muon_weight_decay,
    muon_renormalize (one of rules.MUON_RENORMALIZATIONS), muon_newton_schulz
    (a rules.NEWTON_SCHULZ key), and total_steps, the run's length, which
    the periodic renormalization's table spans.
    """

    peak_learning_rate: float
    weight_decay: float
    momentum: float
    filters_rule: str = "sgd"
    filters_rate: float = 1.0
    filters_momentum: float = 0.0
    momentum_form: str = "keras"
    shift_rate: float = 1.0
    whiten_bias_steps: int = 0
    whiten_bias_freeze: str = "coast"
    muon_weight_decay: float = 0.0
    muon_renormalize: str = "every_step"
    muon_newton_schulz: str = "airbench"
    total_steps: int = 0


def parameter_groups(model, settings: Settings) -> List[ParameterGroup]:
    """The groups of `model`'s trainable variables, each in the group its
    model's `parameter_group` hook names, or by default:

    whitening bias  airbench's; SGD. With --optimizer=sgd as airbench94 has
                    it: the run's rate, decay c; with muon as
                    airbench94_muon has it: shift_rate x the peak, falling
                    linearly to 0 over its steps, decay c / shift_rate.
    filters         convolution kernels (4-D): `filters_rule`; SGD decays
                    them by c, Muon not at all (it renormalizes them).
    shifts          batch-norm shifts (beta): SGD at shift_rate x the rate,
                    decay c / shift_rate.
    kernels         the other kernels (dense layers): SGD, decay c.
    others          biases, batch-norm scales: SGD, no decay.
    """
    import keras

    s = settings
    sgd = UPDATE_RULES["sgd"](s.momentum, s)
    bias = _whitening_bias(model)
    shifts = [layer.beta for layer in model._flatten_layers(include_self=False)
              if isinstance(layer, keras.layers.BatchNormalization) and layer.center
              and layer.beta.trainable]
    shift_ids = {id(v) for v in shifts}
    chosen = chosen_groups(model)
    members = {name: [] for name in GROUPS}
    for variable in model.trainable_variables:
        if bias is None or variable is not bias:
            rank = len(variable.shape)
            default = ("shifts" if id(variable) in shift_ids else "filters" if rank == 4
                       else "kernels" if rank >= 2 else "others")
            members[chosen.get(id(variable), default)].append(variable)
    muon = s.filters_rule == "muon"
    groups = [
        ParameterGroup("filters", tuple(members["filters"]),
                       UPDATE_RULES[s.filters_rule](s.filters_momentum if muon else s.momentum, s),
                       rate=s.filters_rate, weight_decay=0.0 if muon else s.weight_decay),
        ParameterGroup("shifts", tuple(members["shifts"]), sgd, rate=s.shift_rate,
                       weight_decay=s.weight_decay / s.shift_rate),
        ParameterGroup("kernels", tuple(members["kernels"]), sgd, weight_decay=s.weight_decay),
        ParameterGroup("others", tuple(members["others"]), sgd),
    ]
    if bias is not None and bias.trainable:
        steps = s.whiten_bias_steps
        if muon:  # its own rate, falling to 0 over its steps, whatever the schedule
            own = learning_rate_schedule(s.shift_rate * s.peak_learning_rate, steps, 0, "linear")
            group = ParameterGroup("whitening bias", (bias,), sgd, schedule=own,
                                   weight_decay=s.weight_decay / s.shift_rate,
                                   train_steps=steps, freeze=s.whiten_bias_freeze)
        else:
            group = ParameterGroup("whitening bias", (bias,), sgd, weight_decay=s.weight_decay,
                                   train_steps=steps, freeze=s.whiten_bias_freeze)
        groups.insert(0, group)
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
        if group is not None and (not isinstance(group, str) or group not in GROUPS):
            raise ValueError(f"model.{HOOK}({variable.path}) returned {group!r}: name one of "
                             f"{', '.join(GROUPS)}, or None for the default group")
        if group is not None:
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
