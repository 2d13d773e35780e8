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
"""
import os
import sys
from importlib import resources

# TensorFlow's C++ start-up chatter buries the progress lines; errors still
# show. Must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from distributed_mpt import config as config_lib  # noqa: E402
from distributed_mpt.errors import EXIT_PEER_LOST, ConfigError, Preempted, UserError  # noqa: E402

_DEFAULTS = config_lib.TrainConfig.__dataclass_fields__
_RECIPES = resources.files("distributed_mpt") / "recipes"


def _define_flags(fv: flags.FlagValues) -> None:
    d = lambda name: _DEFAULTS[name].default  # noqa: E731 - the config's default

    def per_model(name):  # the help text's part that names each model's default
        values = ", ".join(f"{model} {defaults[name]:g}"
                           for model, defaults in config_lib.MODEL_DEFAULTS.items())
        return f" Default per model: {values}."
    flags.DEFINE_enum("recipe", None, recipe_names(),
                      "A shipped recipe, read as a --flagfile (flags given explicitly override "
                      "it): "
                      "cpu_cnn (91.9% on 2 CPU cores in 15 min), mlp (the notebook's network), "
                      "resnet9 (GPUs).", flag_values=fv)
    flags.DEFINE_enum("dataset", d("dataset"), config_lib.DATASETS,
                      "cifar10 from tensorflow-datasets, or synthetic CIFAR-shaped data "
                      "with learnable labels (no download).", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "Where CIFAR-10 is: a directory holding the official "
                        "binary release (cifar-10-batches-bin/, read directly), or a "
                        "tensorflow-datasets data directory (default ~/tensorflow_datasets).",
                        flag_values=fv)
    flags.DEFINE_bool("download", d("download"), "Download and prepare CIFAR-10 if it is not "
                      "in --data_dir. Turn off on workers that must read prepared data.",
                      flag_values=fv)
    flags.DEFINE_integer("synthetic_examples", d("synthetic_examples"),
                         "Training examples of --dataset=synthetic (test: a fifth as many).",
                         flag_values=fv)
    flags.DEFINE_enum("model", d("model"), config_lib.MODELS,
                      "mlp: the original notebook's network. resnet9: the residual CNN of "
                      "Page's DAWNBench entries (94% in 24 epochs on a GPU). airbench: Keller "
                      "Jordan's airbench94 network (91.9% in 7 epochs, 15 min on 2 CPU cores: "
                      "--recipe=cpu_cnn).", flag_values=fv)
    flags.DEFINE_integer("model_width", d("model_width"),
                         "Channels of the first stage of resnet9 or airbench (64 in both "
                         "references).", flag_values=fv)
    flags.DEFINE_enum("precision", d("precision"), config_lib.PRECISIONS,
                      "auto: mixed_float16 on GPUs of compute capability 7.0+, mixed_bfloat16 "
                      "on CPUs with bfloat16 instructions (AVX512_BF16 or AMX: 1.2-1.3x faster "
                      "than float32, measured), else float32 (float16 is emulated and slow on "
                      "CPUs). mixed_float16 scales the loss dynamically; mixed_bfloat16 needs "
                      "no scaling.", flag_values=fv)
    flags.DEFINE_enum("strategy", d("strategy"), config_lib.STRATEGIES,
                      "auto picks multi_worker for a cluster, mirrored for several GPUs or "
                      "--cpu_replicas, one_device for one GPU, else default.", flag_values=fv)
    flags.DEFINE_integer("cpu_replicas", d("cpu_replicas"),
                         "Split the CPU into N logical devices so that mirrored runs N replicas "
                         "without GPUs (for tests and experiments); 0: off.", flag_values=fv)
    flags.DEFINE_enum("communication", d("communication"), config_lib.COMMUNICATIONS,
                      "Collective implementation for multi_worker: nccl on GPUs (needs a large "
                      "/dev/shm in containers), ring (gRPC) on CPUs.", flag_values=fv)
    flags.DEFINE_integer("per_replica_batch_size", d("per_replica_batch_size"),
                         "Examples per replica per step; the global batch is this times the "
                         "number of replicas of all workers.", flag_values=fv)
    flags.DEFINE_integer("epochs", d("epochs"), "Epochs to train.", flag_values=fv)
    flags.DEFINE_integer("train_steps", d("train_steps"),
                         "Optimizer steps to train; overrides --epochs when > 0.", flag_values=fv)
    flags.DEFINE_float("learning_rate", None,
                       "Peak learning rate at the reference batch of 128; scaled linearly "
                       "with the global batch." + per_model("learning_rate"), flag_values=fv)
    flags.DEFINE_float("max_learning_rate", None,
                       "Ceiling of the scaled learning rate (0: none), for networks that "
                       "diverge above a rate whatever the batch." + per_model("max_learning_rate"),
                       flag_values=fv)
    flags.DEFINE_float("warmup_epochs", None,
                       "Linear warmup from 0, in epochs, then cosine decay to 0; at most half "
                       "of the run." + per_model("warmup_epochs"), flag_values=fv)
    flags.DEFINE_float("momentum", None, "SGD Nesterov momentum." + per_model("momentum"),
                       flag_values=fv)
    flags.DEFINE_float("weight_decay", None, "L2 coefficient on kernels." +
                       per_model("weight_decay"), flag_values=fv)
    flags.DEFINE_float("label_smoothing", None, "Label smoothing of the training loss." +
                       per_model("label_smoothing"), flag_values=fv)
    flags.DEFINE_string("model_dir", None, "Where checkpoints, TensorBoard logs, metrics.jsonl, "
                        "summary.json and the export go. A run resumes from the checkpoints "
                        "it finds here.", flag_values=fv)
    flags.DEFINE_integer("seed", d("seed"), "Seed of initialization, shuffling and augmentation.",
                         flag_values=fv)
    flags.DEFINE_integer("steps_per_loop", d("steps_per_loop"),
                         "Optimizer steps per tf.function call (less Python overhead).",
                         flag_values=fv)
    flags.DEFINE_integer("log_every_steps", d("log_every_steps"), "Steps between progress lines.",
                         flag_values=fv)
    flags.DEFINE_integer("checkpoint_every_steps", d("checkpoint_every_steps"),
                         "Steps between checkpoints (one is also written at the end and on "
                         "SIGTERM/Ctrl-C).", flag_values=fv)
    flags.DEFINE_bool("xla", d("xla"), "Compile the forward and backward pass with XLA.",
                      flag_values=fv)
    flags.DEFINE_bool("data_on_device", d("data_on_device"),
                      "Keep the uint8 train split in device memory (150 MB per GPU for "
                      "CIFAR-10) and shuffle and augment there: only indices cross from the "
                      "host. Same results as the host pipeline for the same seed.",
                      flag_values=fv)
    flags.DEFINE_integer("peer_timeout_seconds", d("peer_timeout_seconds"),
                         "multi_worker: give up if the peers are not all up after this long.",
                         flag_values=fv)
    flags.DEFINE_bool("evaluate", d("evaluate"), "Evaluate on the whole test split at the end.",
                      flag_values=fv)
    flags.DEFINE_bool("eval_tta", d("eval_tta"), "Test-time augmentation: evaluate on the "
                      "mean of the predictions for each test image and its mirror image "
                      "(horizontal flip, as airbench does).", flag_values=fv)
    flags.DEFINE_integer("eval_every_epochs", d("eval_every_epochs"),
                         "Also evaluate every N epochs during training (logged like the "
                         "progress); 0: only at the end.", flag_values=fv)
    flags.DEFINE_bool("export", d("export"), "Export a SavedModel and a .keras file at the end.",
                      flag_values=fv)


def recipe_path(name: str) -> str:
    """The shipped recipe `name` (distributed_mpt/recipes/NAME.flags), from
    any working directory and for an installed package alike."""
    path = _RECIPES / f"{name}.flags"
    if not path.is_file():
        raise ConfigError(f"--recipe={name} is not one of the shipped recipes: "
                          f"{', '.join(recipe_names())}")
    return str(path)


def recipe_names() -> list:
    return sorted(p.name[:-len(".flags")] for p in _RECIPES.iterdir() if p.name.endswith(".flags"))


def _expand_recipes(argv) -> list:
    """Turns --recipe=NAME into --flagfile=<its file>, put first, so that every
    flag given explicitly overrides the recipe's, wherever it stands."""
    recipes, others, argv = [], [], list(argv)
    while argv:
        arg = argv.pop(0)
        if arg == "--recipe" and argv:
            arg = "--recipe=" + argv.pop(0)
        if arg.startswith("--recipe="):
            recipes.append("--flagfile=" + recipe_path(arg[len("--recipe="):]))
        else:
            others.append(arg)
    return recipes + others


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    _define_flags(fv)
    return fv


def parse_config(argv) -> config_lib.TrainConfig:
    """Parses command-line flags (without the program name) into a validated
    config. Raises ConfigError, with one line saying what is wrong."""
    fv = _flag_values()
    try:
        rest = fv(["distributed-mpt-train", *_expand_recipes(argv)])
    except flags.Error as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if len(rest) > 1:
        raise ConfigError(f"unexpected argument(s) {' '.join(rest[1:])}: all options are --flags")
    if fv["recipe"].present:  # -recipe=..., or inside a --flagfile: absl only stored it
        raise ConfigError(f"--recipe={fv.recipe} must be given on the command line, as "
                          f"--recipe={fv.recipe} (inside a flagfile, use --flagfile="
                          f"{recipe_path(fv.recipe)})")
    values = {name: fv[name].value for name in _DEFAULTS if name in fv}
    return config_lib.TrainConfig(**values)


def main(argv=None) -> int:
    """Runs training from command-line flags; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help", "--helpfull"} & set(argv):
        print(__doc__ + "\nFlags:\n" + _flag_values().get_help())
        return 0
    from distributed_mpt.cluster import resolve_cluster
    lock, new_model_dir = None, None
    try:
        config = parse_config(argv)
        cluster = resolve_cluster(os.environ)
        # Imported only now, so that bad input is answered without
        # TensorFlow's start-up.
        from distributed_mpt import distribution, outputs, run_lock, trainer
        strategy_name = distribution.resolve_strategy_name(
            config.strategy, cluster, config.cpu_replicas)
        if cluster is None or cluster.is_chief:
            if not os.path.exists(config.model_dir):
                new_model_dir = config.model_dir
            outputs.check_writable(config.model_dir)
            # One run per model_dir, held until main returns (the OS drops it
            # if the process dies); only the holder may clear debris.
            lock = run_lock.RunLock(config.model_dir)
            removed = lock.remove_debris()
            if removed:
                print(f"removed what a killed run left: {', '.join(removed)}", flush=True)
        strategy = distribution.create_strategy(
            strategy_name, config.cpu_replicas, config.communication, cluster,
            config.peer_timeout_seconds)
        try:
            trainer.train_and_evaluate(config, strategy, strategy_name, cluster)
        except _peer_errors() as e:
            if cluster is None:
                raise
            # A peer died (its node was lost, it was OOM-killed): the
            # collectives fail on every survivor. A retryable exit lets the
            # launcher or Kubernetes restart the group from the checkpoint.
            print(f"error: lost a peer of the multi-worker job ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]}); exiting with {EXIT_PEER_LOST} so that "
                  f"the group restarts from the latest checkpoint", file=sys.stderr, flush=True)
            return EXIT_PEER_LOST
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Preempted as e:
        print(f"{e}; exiting with {e.exit_code} so that a restart resumes", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: steps since the last checkpoint were not saved", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.release()
        if new_model_dir:
            _remove_if_unused(new_model_dir)
    return 0


def _remove_if_unused(model_dir: str) -> None:
    """Removes a --model_dir that this run created and that holds nothing but
    the lock file: a run refused before it wrote anything leaves no trace."""
    from distributed_mpt.run_lock import LOCK_NAME

    try:
        if set(os.listdir(model_dir)) <= {LOCK_NAME}:
            if os.path.exists(os.path.join(model_dir, LOCK_NAME)):
                os.remove(os.path.join(model_dir, LOCK_NAME))
            os.rmdir(model_dir)
    except OSError:
        pass  # a concurrent run took it over, or it is gone: leave it


def _peer_errors() -> tuple:
    """The errors TensorFlow raises on survivors when a peer is lost."""
    import tensorflow as tf

    return (tf.errors.UnavailableError, tf.errors.AbortedError,
            tf.errors.DeadlineExceededError, tf.errors.CancelledError)


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
