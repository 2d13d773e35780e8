"""The validated, frozen configuration of one training run.

The entry point turns flags into a `TrainConfig`; every module below takes
the config or plain arguments and never reads flags.
"""

import dataclasses
import math
import os
from typing import Optional

from distributed_mpt.core import augmentation, batch_norm, data, models, precision
from distributed_mpt.core.optim import groups, rules, schedules
from distributed_mpt.errors import ConfigError, UserError

# The choices of the flags below, from where each is declared once: the
# core's registries (datasets, models, update rules) and modules.
DATASETS = tuple(data.DATASETS)
MODELS = tuple(models.MODELS)  # or a user's path/to/file.py:function, package.module:function
PRECISIONS = precision.PRECISIONS
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
COMMUNICATIONS = ("auto", "ring", "nccl")
LR_SCHEDULES = schedules.SCHEDULES
OPTIMIZERS = tuple(rules.UPDATE_RULES)
MOMENTUM_FORMS = rules.MOMENTUM_FORMS
MUON_RENORMALIZATIONS = rules.MUON_RENORMALIZATIONS
NEWTON_SCHULZ = tuple(rules.NEWTON_SCHULZ)
FREEZES = groups.FREEZES
FLIPS = augmentation.FLIPS
AIRBENCH_ACTIVATIONS = models.AIRBENCH_ACTIVATIONS
TTA_VIEWS = augmentation.TTA_VIEWS
BN_RECALIBRATIONS = batch_norm.RECALIBRATIONS
# A progress line at least this often, whatever --log_every_steps says.
PROGRESS_SECONDS = 20
# The flags each model has a default of its own for (models.Defaults).
_PER_MODEL = tuple(models.USER_DEFAULTS.values())


def _option(default, help: str, choices=None):
    """A config field that is also a command-line flag: its help text lives
    here, once, and the entry point derives the flag from it."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; each field is the flag of the same
    name of `distributed-mpt-train`."""

    model_dir: Optional[str] = _option(
        None, "Where checkpoints, TensorBoard logs, metrics.jsonl, summary.json and the export "
        "go. A run resumes from the checkpoints it finds here.")
    adopt_model_dir: bool = _option(
        False, "Train in a --model_dir that holds files this program did not write (refused "
        "otherwise); the run then writes config.json, summary.json, metrics.jsonl, "
        "checkpoints/, tensorboard/ and export/ there.")
    dataset: str = _option("cifar10", " ".join(
        f"{spec.name}: {spec.summary}." for spec in data.DATASETS.values()), DATASETS)
    data_dir: Optional[str] = _option(
        None, "Where the data is. cifar10: a directory holding the official binary release "
        "(cifar-10-batches-bin/, read directly), or a tensorflow-datasets data directory "
        "(default ~/tensorflow_datasets). image_folder: the folder of class folders.")
    download: bool = _option(True, "Download and prepare CIFAR-10 if it is not in --data_dir. "
                             "Turn off on workers that must read prepared data.")
    synthetic_examples: int = _option(50_000, "Training examples of --dataset=synthetic (test: "
                                      "a fifth as many).")
    image_size: int = _option(32, "--dataset=image_folder: images are resized to this many "
                              "pixels square (squashed, not cropped).")
    test_fraction: float = _option(
        0.0, "--dataset=image_folder without a test/ folder: hold out this fraction of each "
        "class's training images (chosen by --seed) for testing (beside a test/ folder: an "
        "error).")
    model: str = _option(
        "resnet9", " ".join(f"{spec.name}: {spec.summary}." for spec in models.MODELS.values())
        + " Or your own network: path/to/file.py:function or package.module:function, a "
        "function of the dataset's info returning a Keras model from uint8 images to logits "
        "(docs/extending.md).")
    model_width: int = _option(64, "Channels of the first stage of resnet9 or airbench (64 in "
                               "both references).")
    precision: str = _option(
        "auto", "auto: mixed_float16 on GPUs of compute capability 7.0+, mixed_bfloat16 on "
        "CPUs with bfloat16 instructions (AVX512_BF16 or AMX; how much faster than float32: "
        "docs/performance.md), else float32 (bfloat16 is emulated and slower without them, "
        "float16 on every CPU). mixed_float16 scales the loss dynamically; mixed_bfloat16 "
        "needs no scaling.", PRECISIONS)
    strategy: str = _option("auto", "auto picks multi_worker for a cluster, mirrored for "
                            "several GPUs or --cpu_replicas, one_device for one GPU, else "
                            "default.", STRATEGIES)
    cpu_replicas: int = _option(0, "Split the CPU into N logical devices so that mirrored runs "
                                "N replicas without GPUs (for tests and experiments); 0: off.")
    communication: str = _option("auto", "Collective implementation for multi_worker: nccl on "
                                 "GPUs (needs a large /dev/shm in containers), ring (gRPC) on "
                                 "CPUs.", COMMUNICATIONS)
    per_replica_batch_size: int = _option(128, "Examples per replica per step; the global "
                                          "batch is this times the number of replicas of all "
                                          "workers.")
    epochs: float = _option(24, "Epochs to train (a fraction of one counts its steps, rounded up).")
    train_steps: int = _option(0, "Optimizer steps to train; overrides --epochs when > 0.")
    # None: the model's default (its spec's `defaults` in core/models).
    learning_rate: Optional[float] = _option(
        None, "Learning rate at the reference batch of 128. The peak rate is this x global "
        "batch / 128, at most --max_learning_rate; the run prints the rate it uses.")
    max_learning_rate: Optional[float] = _option(
        None, "Ceiling of the peak learning rate (0: none), for networks that diverge above a "
        "rate whatever the batch (the MLP's default: 0.05). It caps the model's own rate; an "
        "explicit --learning_rate is used as scaled, unless --max_learning_rate is given too.")
    warmup_epochs: Optional[float] = _option(
        None, "Epochs of the learning-rate warmup (see --lr_schedule); at most half of the run.")
    lr_schedule: str = _option(
        "cosine", "cosine: linear warmup from 0 to the peak, then cosine decay to 0. linear: "
        "the same warmup, then linearly to 0. piecewise_linear (airbench94's): linear from 0.2x the peak to the peak over the "
        "warmup, then linear to 0.07x the peak at the last step.", LR_SCHEDULES)
    momentum: Optional[float] = _option(None, "SGD Nesterov momentum.")
    momentum_form: str = _option(
        "keras", "How SGD's momentum meets a changing rate. keras: the rate is folded into the "
        "velocity (v = m v - rate g). pytorch: the velocity sums raw gradients and the current "
        "rate scales the step (b = m b + g; step = rate (g + m b)), as in the PyTorch code "
        "airbench's rates were tuned with. The two agree while the rate is constant.",
        MOMENTUM_FORMS)
    optimizer: str = _option(
        "sgd", "sgd: SGD with Nesterov momentum. muon (airbench94_muon's): Muon for the "
        "convolution filters (orthogonalized steps, no weight decay: Muon keeps their norm; "
        "see --muon_learning_rate), SGD for the rest, with airbench's whitening bias at the "
        "batch-norm shifts' rate (--shift_lr_multiplier) falling linearly to 0 over "
        "--whiten_bias_epochs.", OPTIMIZERS)
    muon_learning_rate: float = _option(
        0.24, "--optimizer=muon: the filters' peak learning rate (not scaled with the batch: "
        "Muon's step size does not depend on the gradient's); it follows --lr_schedule.")
    muon_momentum: float = _option(0.6, "--optimizer=muon: the filters' Nesterov momentum.")
    muon_weight_decay: float = _option(
        0.0, "--optimizer=muon: after each step the filters are multiplied by 1 - Muon's rate x "
        "this (the 2025 record's decoupled decay, hiverge/cifar10-speedrun); a renormalization "
        "undoes it, so it acts between them (--muon_renormalize=periodic).")
    muon_renormalize: str = _option(
        "every_step", "--optimizer=muon: when a filter is scaled back to a norm of sqrt(output "
        "channels). every_step (airbench94_muon). periodic (the 2025 record, "
        "hiverge/cifar10-speedrun): before step n (from 1) if n minus the last such n is at "
        "least 2 + floor(15 n / total steps): every 2nd step at first, up to every 17th at the "
        "end.", MUON_RENORMALIZATIONS)
    muon_newton_schulz: str = _option(
        "airbench", "--optimizer=muon: the quintic Newton-Schulz coefficients of the "
        "orthogonalization. airbench: (3.4445, -4.7750, 2.0315), airbench94_muon's. "
        "speedrun2025: (3.4576, -4.7391, 2.0843), the 2025 record's (hiverge/cifar10-speedrun).",
        NEWTON_SCHULZ)
    weight_decay: Optional[float] = _option(
        None, "L2 coefficient c on kernels (2 c w added to their gradient, as c |w|^2 added to "
        "the mean loss); batch-norm shifts get c / --shift_lr_multiplier; biases and scales "
        "none (core/optim/groups.py).")
    label_smoothing: Optional[float] = _option(None, "Label smoothing of the training loss.")
    shift_lr_multiplier: float = _option(
        1.0, "Batch-norm shifts (beta) train at this multiple of the learning rate (airbench94: "
        "64); their L2 coefficient is --weight_decay divided by it, so that their decay per "
        "step is as large as the kernels'.")
    whiten_bias_epochs: float = _option(
        0.0, "airbench: train the whitening layer's bias for this many epochs, then freeze it "
        "(airbench94: 3; see --optimizer for Muon's); 0: the bias stays 0.")
    whiten_bias_freeze: str = _option(
        "coast", "How the whitening bias stops after --whiten_bias_epochs. stop: at once, as "
        "both airbench references do (a variable without a gradient is skipped). coast: its "
        "gradient is zeroed and its momentum runs out over the next steps (what the cpu_cnn "
        "and cpu_cnn94 recipes were measured with).", FREEZES)
    identity_init: bool = _option(
        True, "airbench: start each 3x3 convolution as the identity on its first c_in filters "
        "(airbench94's dirac_ initialization), so that each block passes its input through at "
        "first; --noidentity_init: every filter random, as PyTorch initializes them.")
    activation: str = _option(
        "gelu", "airbench: the activation of its convolution stages. gelu (airbench94's), silu "
        "(the 2025 record's), relu (which TensorFlow fuses into batch norm); GELU and SiLU are "
        "compiled into one pass each way on CPUs (core/models/faster_layers.py).",
        AIRBENCH_ACTIVATIONS)
    bn_momentum: float = _option(
        0.6, "airbench: its batch norms' momentum in Keras' sense (the weight of the old moving "
        "statistics; airbench94: 0.6, the 2025 record: 0.5566).")
    whiten_images: int = _option(
        5000, "airbench: how many of the first training images its whitening filters are "
        "computed from (airbench94: 5000, the 2025 record: 960).")
    lookahead: bool = _option(
        False, "airbench94's lookahead: every 5 steps the weights (and batch-norm statistics) "
        "move to an exponential moving average of themselves, of decay 0.95^5 x "
        "(step/total steps)^3, so that averaging grows as the learning rate falls; after the "
        "last step they are that average.")
    crop_padding: int = _option(
        4, "Random translation of each training image by up to this many pixels (a crop of "
        "the reflect-padded image; airbench94: 2); 0: none.")
    # None: the dataset's default (its spec's `flip` in core/data).
    flip: Optional[str] = _option(
        None, "Horizontal flips of training images. random: each image in each epoch "
        "with probability 1/2. alternating (airbench94's): each image flipped at random once, "
        "then all of them flipped on every odd epoch, so that every image is seen both ways "
        "in any two epochs. none. Default: " + ", ".join(
            f"{spec.name} {spec.flip}" for spec in data.DATASETS.values()) + " (a mirrored "
        "digit or letter is another sign).", FLIPS)
    brightness_jitter: float = _option(
        0.0, "Color jitter of the 2025 record (hiverge/cifar10-speedrun: 0.1399): each training "
        "image in each epoch gets b ~ U(-this, this) added to its normalized pixels (in standard "
        "deviations); needs a model whose normalization is a layer named 'normalize'. 0: none.")
    contrast_jitter: float = _option(
        0.0, "Color jitter of the 2025 record (0.1308): each training image's normalized pixels, "
        "after --brightness_jitter, multiplied by c ~ U(1 - this, 1 + this) in each epoch. 0: "
        "none.")
    seed: int = _option(0, "Seed of initialization, shuffling and augmentation.")
    steps_per_loop: int = _option(
        50, "At most this many optimizer steps per tf.function call (less Python overhead); "
        "fewer when steps are slow, so that progress and Ctrl-C are answered within seconds.")
    log_every_steps: int = _option(100, "Steps between progress lines (there is also one at "
                                   f"least every {PROGRESS_SECONDS} seconds and at the end of "
                                   "each epoch).")
    checkpoint_every_steps: int = _option(1000, "Steps between checkpoints (one is also written "
                                          "at the end and on SIGTERM/Ctrl-C).")
    xla: bool = _option(False, "Compile the forward and backward pass with XLA.")
    data_on_device: bool = _option(
        False, "Keep the uint8 train split in device memory (150 MB per GPU for CIFAR-10) and "
        "shuffle and augment there: only indices cross from the host. Same results as the "
        "host pipeline for the same seed.")
    peer_timeout_seconds: int = _option(300, "multi_worker: give up if the peers are not all up "
                                        "after this long.")
    evaluate: bool = _option(True, "Evaluate on the whole test split at the end.")
    eval_every_epochs: int = _option(0, "Also evaluate every N epochs during training (logged "
                                     "like the progress); 0: only at the end.")
    eval_tta: str = _option(
        "none", "Test-time augmentation: classify each test image by the mean logits of several "
        "views. flip: the image and its mirror image. flip_translate (airbench94's): those two, "
        "weighted 1/2, and both again shifted by one pixel up-left and down-right, 1/8 each. "
        "flip_translate_mean (the 2025 record's): the same six, 1/6 each. "
        "Runs evaluate with and without, so that each shows what it buys.", TTA_VIEWS)
    eval_tta_fraction: float = _option(
        1.0, "Test-time augmentation only for this fraction of the test images: those whose plain "
        "view is least confident (lowest top softmax probability; the 2025 record, "
        "hiverge/cifar10-speedrun: 0.25); the others keep the plain view's logits.")
    bn_recalibration: str = _option(
        "auto", f"After the last step, set batch norm's moving statistics to those of "
        f"{batch_norm.RECALIBRATION_IMAGES:,} unaugmented training images. auto: where momentum "
        f"** steps > {batch_norm.INITIAL_WEIGHT_LIMIT:g} (core/batch_norm.py).", BN_RECALIBRATIONS)
    export: bool = _option(True, "Export a SavedModel and a .keras file at the end.")

    def __post_init__(self):
        for name in ("model_dir", "data_dir"):
            object.__setattr__(self, name, user_path(getattr(self, name)))
        try:
            spec = models.model_spec(self.model)
        except UserError as e:
            raise ConfigError(str(e)) from None
        if self.learning_rate is not None and self.max_learning_rate is None:
            # The ceiling belongs to the model's own rate: a rate given
            # explicitly is used as given.
            object.__setattr__(self, "max_learning_rate", 0.0)
        for name in _PER_MODEL:
            if getattr(self, name) is None:
                # Frozen: set once here, before anyone reads the config.
                object.__setattr__(self, name, getattr(spec.defaults, name))
        if self.flip is None and self.dataset in data.DATASETS:
            object.__setattr__(self, "flip", data.DATASETS[self.dataset].flip)
        _validate(self)


def user_path(path: Optional[str]) -> Optional[str]:
    """A path flag's value with a leading ~ made the home directory, as for
    every entry point's path flags: no shell expands the ~ of
    `--model_dir=~/runs`, and a directory named `~` in the working directory
    is never what was meant."""
    return os.path.expanduser(path) if path else path


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _choice(name: str, value: str, choices) -> None:
    _require(value in choices, f"--{name}={value!r} is not one of {', '.join(choices)}")


# Bounds that catch a typo (an extra zero, 10**9) before it becomes an
# out-of-memory crash or a silent hang hours later.
_MAX_STEPS = 10**9
_STEP_COUNTS = ("train_steps", "epochs", "warmup_epochs", "whiten_bias_epochs", "eval_every_epochs",
                "steps_per_loop", "log_every_steps", "checkpoint_every_steps")
_MAX_EXAMPLES = 2_000_000    # synthetic images: 3 KB each in memory
_MAX_WIDTH = 1024            # resnet9 at 1024 already has 1.7 billion weights
_MAX_BATCH = 65_536
_MAX_CPU_REPLICAS = 64       # logical devices: TensorFlow stalls creating 100,000
_MAX_MULTIPLIER = 1e4
_MAX_DECAY = 1e2             # 5e-4 trains; divided by a multiplier (>= 1e-4) still finite
_MAX_PEER_TIMEOUT_SECONDS = 7 * 24 * 3600  # peers not up in a week: waiting for nothing
# Far above any rate that trains (airbench94's peak is 1.5 at batch 1024),
# and low enough that scaled by any global batch it stays finite.
_MAX_RATE = 1e3
# Three pooling stages need 8 pixels; 512 squared is 768 KB an image in memory.
_MIN_IMAGE_SIZE, _MAX_IMAGE_SIZE = 8, 512
# Reflect padding mirrors the image without its edge, so at most 31 pixels.
_MAX_CROP_PADDING = 31


def _validate(c: TrainConfig) -> None:
    for name, value in vars(c).items():  # a config.json read back passes no flag parser
        _require(math.isfinite(value) if isinstance(value, float) else name not in _PER_MODEL
                 or isinstance(value, int), f"--{name}={value} must be a finite number")
    _require(bool(c.model_dir), "--model_dir is required: where checkpoints, logs and the exported model go")
    for field in dataclasses.fields(c):  # every flag with choices, as its _option declares them
        if field.metadata["choices"]:
            _choice(field.name, getattr(c, field.name), field.metadata["choices"])
    _require(c.muon_weight_decay >= 0,
             f"--muon_weight_decay={c.muon_weight_decay} must be >= 0")
    _require(0 <= c.brightness_jitter <= 10,
             f"--brightness_jitter={c.brightness_jitter} must be in [0, 10] (standard deviations)")
    _require(0 <= c.contrast_jitter < 1,
             f"--contrast_jitter={c.contrast_jitter} must be in [0, 1) (a fraction of the contrast)")
    _require(0 < c.eval_tta_fraction <= 1,
             f"--eval_tta_fraction={c.eval_tta_fraction} must be in (0, 1]")
    _require(0 <= c.bn_momentum < 1, f"--bn_momentum={c.bn_momentum} must be in [0, 1)")
    _require(2 <= c.whiten_images <= _MAX_EXAMPLES,
             f"--whiten_images={c.whiten_images} must be in [2, {_MAX_EXAMPLES:,}]")
    _require(c.dataset != "image_folder" or bool(c.data_dir),
             "--dataset=image_folder needs --data_dir: the folder of class folders "
             "(DATA_DIR/train/<class>/<images>)")
    _require(_MIN_IMAGE_SIZE <= c.image_size <= _MAX_IMAGE_SIZE,
             f"--image_size={c.image_size} must be in [{_MIN_IMAGE_SIZE}, {_MAX_IMAGE_SIZE}]")
    _require(0 <= c.test_fraction < 1,
             f"--test_fraction={c.test_fraction} must be in [0, 1)")
    for name in ("per_replica_batch_size", "steps_per_loop", "log_every_steps",
                 "checkpoint_every_steps", "model_width", "synthetic_examples",
                 "peer_timeout_seconds"):
        value = getattr(c, name)
        _require(value > 0, f"--{name}={value} must be a positive integer")
    # Negative even beside --train_steps, which overrides it: else the typo
    # trains, and is recorded in config.json.
    _require(c.epochs > 0 or (c.epochs == 0 and c.train_steps > 0),
             f"--epochs={c.epochs} must be a positive number (or set --train_steps)")
    # What a run derives from each (steps, rates, a deadline) stays finite.
    for name, limit in (*((name, _MAX_STEPS) for name in _STEP_COUNTS),
                        ("synthetic_examples", _MAX_EXAMPLES), ("model_width", _MAX_WIDTH),
                        ("per_replica_batch_size", _MAX_BATCH), ("cpu_replicas", _MAX_CPU_REPLICAS),
                        ("peer_timeout_seconds", _MAX_PEER_TIMEOUT_SECONDS),
                        ("max_learning_rate", _MAX_RATE), *((name, _MAX_DECAY) for name in
                                                            ("weight_decay", "muon_weight_decay"))):
        value = getattr(c, name)
        _require(value <= limit, f"--{name}={value} is larger than this program accepts ({limit:,})")
    _require(c.train_steps >= 0, f"--train_steps={c.train_steps} must be >= 0 (0 means: use --epochs)")
    _require(0 < c.learning_rate <= _MAX_RATE,
             f"--learning_rate={c.learning_rate} must be in (0, {_MAX_RATE:g}]: the rate at the "
             f"reference batch of 128, scaled with the global batch")
    _require(c.max_learning_rate >= 0,
             f"--max_learning_rate={c.max_learning_rate} must be >= 0 (0: no ceiling)")
    _require(c.warmup_epochs >= 0, f"--warmup_epochs={c.warmup_epochs} must be >= 0")
    _require(0 <= c.momentum < 1, f"--momentum={c.momentum} must be in [0, 1)")
    _require(c.weight_decay >= 0, f"--weight_decay={c.weight_decay} must be >= 0")
    _require(0 <= c.label_smoothing < 1, f"--label_smoothing={c.label_smoothing} must be in [0, 1)")
    _require(1 / _MAX_MULTIPLIER <= c.shift_lr_multiplier <= _MAX_MULTIPLIER, f"--shift_lr_"
             f"multiplier={c.shift_lr_multiplier} must be in [{1 / _MAX_MULTIPLIER:g}, {_MAX_MULTIPLIER:g}]")
    _require(0 < c.muon_learning_rate <= _MAX_RATE,
             f"--muon_learning_rate={c.muon_learning_rate} must be in (0, {_MAX_RATE:g}]")
    _require(0 <= c.muon_momentum < 1, f"--muon_momentum={c.muon_momentum} must be in [0, 1)")
    _require(c.optimizer == "sgd" or c.model != "mlp",
             "--optimizer=muon trains convolution filters, and the mlp has none: use --optimizer=sgd")
    _require(c.whiten_bias_epochs >= 0, f"--whiten_bias_epochs={c.whiten_bias_epochs} must be >= 0")
    _require(0 <= c.crop_padding <= _MAX_CROP_PADDING,
             f"--crop_padding={c.crop_padding} must be in [0, {_MAX_CROP_PADDING}] (pixels)")
    # Seeds feed numpy (< 2**32) and TensorFlow's stateless ops (int32, plus small offsets).
    _require(0 <= c.seed < 2**31 - 16, f"--seed={c.seed} must be in [0, {2**31 - 16})")
    _require(c.eval_every_epochs >= 0,
             f"--eval_every_epochs={c.eval_every_epochs} must be >= 0 (0: only at the end)")
    _require(c.cpu_replicas >= 0, f"--cpu_replicas={c.cpu_replicas} must be >= 0 (0: do not split the CPU)")
    _require(c.cpu_replicas == 0 or c.strategy in ("auto", "mirrored"),
             f"--cpu_replicas={c.cpu_replicas} needs --strategy=mirrored (or auto); "
             f"--strategy={c.strategy} runs one replica per worker")


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


def training_flags(c: TrainConfig) -> dict:
    """The fields that shape what is trained, by flag name (see RESUME_MAY_CHANGE)."""
    return {field.name: getattr(c, field.name) for field in dataclasses.fields(c)
            if field.name not in RESUME_MAY_CHANGE}


def shared_flags(c: TrainConfig) -> dict:
    """The fields that every worker of one job must set alike, by flag name: all
    but the per-worker ones, so that a new field is checked unless declared so."""
    return {field.name: getattr(c, field.name) for field in dataclasses.fields(c)
            if field.name not in _PER_WORKER}
