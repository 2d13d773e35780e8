"""The validated, frozen configuration of one training run: the sections
that the parts declare next to the code that reads them, composed, and the
rules across them.

The entry point turns flags into a `TrainConfig` (`from_flags`); every module
below takes its section or plain arguments and never reads flags.
"""

import dataclasses
import json
import math
import os
import typing
from typing import Optional

from distributed_mpt.cluster import ClusterOptions
from distributed_mpt.core import data
from distributed_mpt.core.augmentation import Augmentation
from distributed_mpt.core.data import DataOptions
from distributed_mpt.core.models import AirbenchOptions, ModelOptions
from distributed_mpt.core.optim.groups import MuonOptions, OptimizerOptions
from distributed_mpt.core.optim.schedules import ScheduleOptions
from distributed_mpt.errors import quoted
from distributed_mpt.options import require
from distributed_mpt.recipes.records import as_flag
from distributed_mpt.training import EvaluationOptions, RunOptions


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, by section, each declared and
    checked by the part that reads it (docs/architecture.md). Every field of
    a section is the flag of the same name of `distributed-mpt-train`."""

    data: DataOptions
    model: ModelOptions
    airbench: AirbenchOptions
    optimizer: OptimizerOptions
    muon: MuonOptions
    schedule: ScheduleOptions
    augmentation: Augmentation
    run: RunOptions
    evaluation: EvaluationOptions
    cluster: ClusterOptions

    @classmethod
    def from_flags(cls, **flags) -> "TrainConfig":
        """The config of `flags` by flag name (any subset: the others take
        their defaults), each section checked, then the rules across them.
        Raises ConfigError, saying what is wrong in one line."""
        unknown = sorted(set(flags) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"unknown flag(s): {', '.join(unknown)}")
        values = {**DEFAULTS, **flags}
        for name in ("model_dir", "data_dir"):
            values[name] = user_path(values[name])
        if values["model_dir"]:  # TensorFlow's checkpoint index needs the working directory
            values["model_dir"] = os.path.abspath(values["model_dir"])
        model = ModelOptions(**_of(ModelOptions, values))  # its defaults come first
        if values["learning_rate"] is not None and values["max_learning_rate"] is None:
            # The ceiling belongs to the model's own rate: a rate given
            # explicitly is used as given.
            values["max_learning_rate"] = 0.0
        for name, default in model.spec.defaults.values().items():
            value = values[name] = default if values[name] is None else values[name]
            require(math.isfinite(value) if isinstance(value, float) else isinstance(value, int),
                    f"--{name}={value} must be a finite number")
        if values["flip"] is None and values["dataset"] in data.DATASETS:
            values["flip"] = data.DATASETS[values["dataset"]].flip
        # The run's section first: a missing --model_dir is said before what
        # else is wrong, as before the sections.
        made = {name: model if section is ModelOptions else section(**_of(section, values))
                for name, section in sorted(SECTIONS.items(), key=lambda item: item[0] != "run")}
        config = cls(**made)
        require(config.optimizer.optimizer == "sgd" or config.model.model != "mlp",
                f"--optimizer={config.optimizer.optimizer} trains convolution filters, and the "
                f"mlp has none: use --optimizer=sgd")
        return config

    def ignored_flags(self) -> str:
        """The flags set to other than their default that this run has no use
        for, in one line for a `warning:` ("" if none): airbench's for another
        network (a recipe tuned for airbench, run with another --model, keeps
        them), Muon's without --optimizer=muon."""
        spec, flags = self.model.spec, self.flags()
        by_model = [f.name for f in dataclasses.fields(AirbenchOptions)
                    if f.name not in spec.options]
        by_model += _NOTHING_TO_ACT_ON.get(spec.name, ("model_width",) * spec.is_users)
        by_optimizer = [f.name for f in dataclasses.fields(MuonOptions)
                        if self.optimizer.optimizer != "muon"]
        said = [f"{', '.join(given)}: {why}" for given, why in (
            ([as_flag(name, flags[name]) for name in names if flags[name] != DEFAULTS[name]], why)
            for names, why in ((by_model, f"--model={quoted(self.model.model)} has no part they "
                                          f"act on"),
                               (by_optimizer, "they are --optimizer=muon's"))) if given]
        return "this run ignores " + "; ".join(said) if said else ""

    def flags(self) -> dict:
        """Every field by flag name, as resolved (the per-model defaults and the
        dataset's flip filled in, `~` expanded): what runs compare, and what
        a config.json held before the sections."""
        return {name: value for section in SECTIONS for name, value in
                dataclasses.asdict(getattr(self, section)).items()}


def check_model_dir_outside_the_images(config: TrainConfig) -> None:
    """Raises ConfigError if --model_dir is in an image folder's train/ or
    test/, whose folders are read as classes: there the run's own folder was
    refused as a class of no images (train/) or one train/ lacks (test/),
    and an adopted train/ trained once, its checkpoints/ then a class that
    no resume could read. Training's check, not from_flags': predict gives
    it a --model_dir of "." that may be anywhere."""
    if config.data.dataset != "image_folder":
        return
    model_dir = os.path.realpath(config.run.model_dir)
    for split in ("train", "test"):
        folder = os.path.realpath(os.path.join(config.data.data_dir, split))
        require(os.path.commonpath([model_dir, folder]) != folder,
                f"--model_dir={quoted(config.run.model_dir)} is in --data_dir's {split}/ "
                f"({quoted(folder)}), whose folders are read as classes: choose one outside it")


# What each built-in network has no part for, besides airbench's own options
# (which only its builder takes: ModelSpec.options): the mlp has no batch norm,
# no whitening layer and a fixed width, resnet9 no whitening layer. A user's
# function is given no width (its layers are its own: it may whiten).
_NOTHING_TO_ACT_ON = {
    "mlp": ("model_width", "shift_lr_multiplier", "whiten_bias_epochs", "whiten_bias_freeze"),
    "resnet9": ("whiten_bias_epochs", "whiten_bias_freeze")}

SECTIONS = {field.name: field.type for field in dataclasses.fields(TrainConfig)}
# Every flag of distributed-mpt-train: the sections' fields, each name in one section.
FIELDS = tuple(field for section in SECTIONS.values() for field in dataclasses.fields(section))
DEFAULTS = {field.name: field.default for field in FIELDS}


def _of(section, values: dict) -> dict:
    return {field.name: values[field.name] for field in dataclasses.fields(section)}


def flat_record(record: dict) -> dict:
    """A config.json's flags by name, whether the run that wrote it kept them
    in sections ({"data": {...}, ...}) or flat, as runs before sections did.
    A flag at the top wins over one in a section: it was put there by hand."""
    sections = {name: value for name, value in record.items()
                if name in SECTIONS and isinstance(value, dict)}
    return {**{k: v for section in sections.values() for k, v in section.items()},
            **{k: v for k, v in record.items() if k not in sections}}


def section_problem(record: dict) -> Optional[str]:
    """What is wrong with the sections of `record`, a config.json read back,
    or None. A file written in sections holds each as an object of flags; a
    flat one of before holds none, and its `model` and `optimizer` are the
    flags of those names. A section of another kind would be read as a flag
    (`Pass --model=['resnet9']`, said a resume), or lose the flags it held."""
    in_sections = any(isinstance(record.get(name), dict) for name in SECTIONS)
    for name, value in record.items():
        if name in SECTIONS and not isinstance(value, dict) and (
                in_sections or name not in DEFAULTS):
            return (f"its {name!r} section is {quoted(json.dumps(value), 60)}, where this "
                    f"program writes an object of flags")
    return None


# What config.json records besides the flags (training/run.py's _config_record).
_RECORDED = ("from_step", "earlier", "resolved")


def unknown_settings(record: dict) -> str:
    """The keys of `record`, a config.json read back, that are neither a flag
    of this version nor what it records beside them, as 'section.key' in a
    section ("" if none): a newer version's settings, which a run of this one
    would silently do without (a resume trained on without its clipping)."""
    unknown = [key for key in record if key not in (*SECTIONS, *DEFAULTS, *_RECORDED)]
    unknown += [f"{name}.{key}" for name in SECTIONS if isinstance(record.get(name), dict)
                for key in record[name] if key not in DEFAULTS]  # a flag moved across sections
    return (f"records settings this version does not know ({quoted(', '.join(unknown), 120)}"
            f"): it was likely written by a newer distributed_mpt" if unknown else "")


def user_path(path: Optional[str]) -> Optional[str]:
    """A path flag's value with a leading ~ made the home directory, as for
    every entry point's path flags: no shell expands the ~ of
    `--model_dir=~/runs`, and a directory named `~` in the working directory
    is never what was meant."""
    return os.path.expanduser(path) if path else path


# Flags that may differ between the workers of one job: where each finds its
# files, what only the chief does, and what each resolves from `auto` on its
# own machine (the trainer compares the resolved precision instead).
_PER_WORKER = ("model_dir", "adopt_model_dir", "data_dir", "download", "peer_timeout_seconds",
               "export", "precision", "strategy", "communication")


# Flags that a resumed run may set otherwise than the run it continues: its
# length, its batch (the rate is rescaled, and it says so), where things are,
# how it runs and reports, and its evaluation. Every other flag shapes what is
# trained, and a resume refuses to change it: a new flag is refused unless declared here.
RESUME_MAY_CHANGE = (
    "epochs", "train_steps", "per_replica_batch_size", "model_dir", "adopt_model_dir",
    "data_dir", "download", "strategy", "cpu_replicas", "communication", "steps_per_loop",
    "log_every_steps", "checkpoint_every_steps", "xla", "data_on_device", "peer_timeout_seconds",
    "evaluate", "eval_every_epochs", "eval_tta", "eval_tta_fraction", "bn_recalibration", "export")


_WRITTEN_AS = {bool: "true or false", str: "a string", float: "a number", int: "a whole number"}


def compared_flag_problem(flags: dict) -> Optional[str]:
    """What is wrong with a flag that a resume compares (not in
    RESUME_MAY_CHANGE) in `flags`, a config.json's flags by name, or None: a
    value of a type this program never writes there. Compared as it was, the
    string "0.1" was said to differ from --learning_rate=0.1, and the user
    told to pass what they had passed."""
    for field in FIELDS:
        if field.name in RESUME_MAY_CHANGE or field.name not in flags:
            continue
        value, kinds = flags[field.name], typing.get_args(field.type) or (field.type,)
        kind = kinds[0]
        if kind is bool or isinstance(value, bool):
            fits = isinstance(value, bool) and kind is bool
        elif kind is str:
            fits = isinstance(value, str)
        else:  # a whole float (64.0) is the number a JSON writer may make of 64
            fits = isinstance(value, int) or isinstance(value, float) and (
                kind is float or value.is_integer())
        if not fits and not (value is None and type(None) in kinds):
            return (f"its {field.name!r} is {quoted(json.dumps(value), 40)}, where this program "
                    f"writes {_WRITTEN_AS[kind]}")
    return None


def training_flags(c: TrainConfig) -> dict:
    """The fields that shape what is trained, by flag name (see RESUME_MAY_CHANGE)."""
    return {name: value for name, value in c.flags().items() if name not in RESUME_MAY_CHANGE}


def shared_flags(c: TrainConfig) -> dict:
    """The fields that every worker of one job must set alike, by flag name: all
    but the per-worker ones, so that a new field is checked unless declared so."""
    return {name: value for name, value in c.flags().items() if name not in _PER_WORKER}
