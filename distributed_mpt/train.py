"""Train a CIFAR-10 classifier with mixed precision on one device, all GPUs of
a node, or many workers.

CPU only:            distributed-mpt-train --recipe=cpu_cnn --model_dir=runs/cnn
One GPU:             distributed-mpt-train --recipe=resnet9 --strategy=one_device --model_dir=runs/r9
All GPUs of a node:  distributed-mpt-train --recipe=resnet9 --strategy=mirrored --model_dir=runs/r9
Several workers:     distributed-mpt-launch --num_workers=2 -- --recipe=resnet9 --model_dir=runs/r9
                     (or TF_CONFIG, a Kubernetes indexed Job, SLURM: see README)
No download, no GPU: distributed-mpt-train --dataset=synthetic --model=mlp \\
                         --train_steps=100 --model_dir=/tmp/smoke
Real CIFAR-10 offline: add --data_dir=DIR --nodownload, DIR holding the official
                     cifar-10-batches-bin/ (or a tensorflow-datasets directory).
TensorFlow's own start-up log lines are hidden; DMPT_VERBOSE=1 shows them.
"""
import os
import sys
import typing

from absl import flags

from distributed_mpt import cli, files, recipes
from distributed_mpt import config as config_lib
from distributed_mpt.cluster.environment import resolve_cluster
from distributed_mpt.core import models
from distributed_mpt.errors import ConfigError

_DEFINE = {bool: flags.DEFINE_bool, str: flags.DEFINE_string,
           int: lambda *args, flag_values: cli.define_integer(flag_values, *args),
           float: lambda *args, flag_values: cli.define_float(flag_values, *args)}


def _flag_values() -> flags.FlagValues:
    """One flag per field of a `TrainConfig` section, with the field's
    default and help text, plus --recipe."""
    fv = flags.FlagValues()
    flags.DEFINE_enum("recipe", None, recipes.names(),
                      "A shipped recipe, read as a --flagfile (flags given explicitly override "
                      "it). What each is, what it reached and the flags it sets: \"Recipes\", "
                      "at the end of this help.", flag_values=fv)
    for field in config_lib.FIELDS:
        help_text = field.metadata["help"]
        if field.name in models.USER_DEFAULTS.values():
            help_text += " Default per model: " + ", ".join(
                f"{name} {getattr(spec.defaults, field.name):g}"
                for name, spec in models.MODELS.items()) + (
                f", your own {getattr(models.USER_DEFAULTS, field.name):g}.")
        if field.metadata["choices"]:
            flags.DEFINE_enum(field.name, field.default, field.metadata["choices"], help_text,
                              flag_values=fv)
        else:
            # Optional[float] -> float: None stands for "the model's default".
            kind = next(t for t in (*typing.get_args(field.type), field.type) if t in _DEFINE)
            _DEFINE[kind](field.name, field.default, help_text, flag_values=fv)
    return fv


def _expand_recipes(argv) -> list:
    """Turns --recipe=NAME into --flagfile=<its file>, put first, so that every
    flag given explicitly overrides the recipe's, wherever it stands."""
    expanded, others, argv = [], [], list(argv)
    while argv:
        arg = argv.pop(0)
        if arg == "--recipe" and argv:
            arg = "--recipe=" + argv.pop(0)
        if arg.startswith("--recipe="):
            expanded.append("--flagfile=" + recipes.path(arg[len("--recipe="):]))
        else:
            others.append(arg)
    if len(expanded) > 1:  # absl would merge them, each flag from whichever came last
        names = [os.path.basename(e).removesuffix(".flags") for e in expanded]
        raise ConfigError(f"--recipe given {len(names)} times ({', '.join(names)}): one recipe a "
                          f"run; flags after it change what it sets")
    return expanded + others


def parse_config(argv) -> config_lib.TrainConfig:
    """Parses command-line flags (without the program name) into a validated
    config. Raises ConfigError, with one line saying what is wrong."""
    fv = _flag_values()
    args = _expand_recipes(argv)
    cli.parse("distributed-mpt-train", fv, args)
    cli.check_path_flags(fv, "model_dir", "data_dir")
    if fv["recipe"].present:  # -recipe=..., or inside a --flagfile: absl only stored it
        raise ConfigError(f"--recipe={fv.recipe} must be given on the command line, as "
                          f"--recipe={fv.recipe} (inside a flagfile, use --flagfile="
                          f"{recipes.path(fv.recipe)})")
    config = config_lib.TrainConfig.from_flags(**{name: fv[name].value
                                                  for name in config_lib.DEFAULTS})
    config_lib.check_model_dir_outside_the_images(config)
    return config


def main(argv=None) -> int:
    """Runs training from command-line flags; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if cli.wants_help(argv):
        return cli.show_help(__doc__, _flag_values(), recipes.describe_all())

    def train() -> int:
        config = parse_config(argv)
        ignored = config.ignored_flags()
        if ignored and getattr(resolve_cluster(), "is_chief", True):  # said once a job
            files.warn(ignored)
        # Imported only now, so that bad flags are answered at once (the run
        # imports TensorFlow only once it holds --model_dir).
        from distributed_mpt.training import run as training
        return training.run(config)

    return cli.guarded(train)


def run() -> None:
    """Console-script entry point. Ends the process at once when training
    is over, every output written (see `stopping.exit_now`)."""
    cli.console_script(main)


if __name__ == "__main__":
    run()
