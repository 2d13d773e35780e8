"""The validated, frozen configuration of one training run.

The entry point turns flags into a `TrainConfig`; every module below takes
the config or plain arguments and never reads flags.
"""

import dataclasses
import math
from typing import Optional

from distributed_mpt.errors import ConfigError

DATASETS = ("cifar10", "synthetic")
MODELS = ("mlp", "resnet9", "airbench")
PRECISIONS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
COMMUNICATIONS = ("auto", "ring", "nccl")


# What each network needs to train well, and not diverge, at any batch
# (rates at the reference batch of 128, scaled with the global batch; see
# optimization.py). A flag given explicitly overrides its entry here.
MODEL_DEFAULTS = {
    # The notebook's MLP has no normalization layer: its first layer sees
    # 3,072 strongly correlated pixels, so a rate of 0.1 can diverge at any
    # batch (measured on synthetic data: at batch 256 after a 16-step warmup,
    # and on 2 x 1024), while 0.05 held in every case: linear scaling stops
    # there.
    "mlp": dict(learning_rate=0.05, max_learning_rate=0.05, warmup_epochs=1.0, momentum=0.9,
                weight_decay=0.0, label_smoothing=0.0),
    # Batch norm makes the networks below scale-invariant: no ceiling needed.
    # Page's ResNet-9 settings (warmup to epoch 5 of 24, label smoothing 0.2
    # as in his final version).
    "resnet9": dict(learning_rate=0.1, max_learning_rate=0.0, warmup_epochs=5.0, momentum=0.9,
                    weight_decay=5e-4, label_smoothing=0.2),
    # airbench94's settings, converted: lr 1.5 per mean-loss step at batch 1024
    # (its "11.5 per kilostep" with momentum 0.85) is 0.1875 at batch 128; its
    # decay of 0.002 per step at lr 1.5 is an L2 coefficient of 6.5e-4.
    "airbench": dict(learning_rate=0.1875, max_learning_rate=0.0, warmup_epochs=1.5,
                     momentum=0.85, weight_decay=6.5e-4, label_smoothing=0.2),
}
_PER_MODEL = tuple(MODEL_DEFAULTS["mlp"])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; see `distributed_mpt.train` for the flags."""

    model_dir: str
    dataset: str = "cifar10"
    data_dir: Optional[str] = None
    download: bool = True
    synthetic_examples: int = 50_000
    model: str = "resnet9"
    model_width: int = 64
    precision: str = "auto"
    strategy: str = "auto"
    cpu_replicas: int = 0
    communication: str = "auto"
    per_replica_batch_size: int = 128
    epochs: int = 24
    train_steps: int = 0
    # None: the model's entry in MODEL_DEFAULTS.
    learning_rate: Optional[float] = None
    max_learning_rate: Optional[float] = None
    warmup_epochs: Optional[float] = None
    momentum: Optional[float] = None
    weight_decay: Optional[float] = None
    label_smoothing: Optional[float] = None
    seed: int = 0
    steps_per_loop: int = 50
    log_every_steps: int = 100
    checkpoint_every_steps: int = 1000
    xla: bool = False
    data_on_device: bool = False
    peer_timeout_seconds: int = 300
    evaluate: bool = True
    eval_every_epochs: int = 0
    eval_tta: bool = False
    export: bool = True

    def __post_init__(self):
        _choice("model", self.model, MODELS)
        if self.learning_rate is not None and self.max_learning_rate is None:
            # The ceiling belongs to the model's own rate: a rate given
            # explicitly is used as given.
            object.__setattr__(self, "max_learning_rate", 0.0)
        for name in _PER_MODEL:
            if getattr(self, name) is None:
                # Frozen: set once here, before anyone reads the config.
                object.__setattr__(self, name, MODEL_DEFAULTS[self.model][name])
        _validate(self)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _choice(name: str, value: str, choices) -> None:
    _require(value in choices, f"--{name}={value!r} is not one of {', '.join(choices)}")


# Bounds that catch a typo (an extra zero, 10**9) before it becomes an
# out-of-memory crash or a silent hang hours later.
_MAX_STEPS = 10**9
_MAX_EXAMPLES = 2_000_000    # synthetic images: 3 KB each in memory
_MAX_WIDTH = 1024            # resnet9 at 1024 already has 1.7 billion weights
_MAX_BATCH = 65_536
_MAX_CPU_REPLICAS = 64       # logical devices: TensorFlow stalls creating 100,000


def _validate(c: TrainConfig) -> None:
    _require(bool(c.model_dir), "--model_dir is required: where checkpoints, logs and the exported model go")
    _choice("dataset", c.dataset, DATASETS)
    _choice("precision", c.precision, PRECISIONS)
    _choice("strategy", c.strategy, STRATEGIES)
    _choice("communication", c.communication, COMMUNICATIONS)
    for name in ("per_replica_batch_size", "steps_per_loop", "log_every_steps",
                 "checkpoint_every_steps", "model_width", "synthetic_examples",
                 "peer_timeout_seconds"):
        value = getattr(c, name)
        _require(value > 0, f"--{name}={value} must be a positive integer")
    for name in _PER_MODEL:
        value = getattr(c, name)
        _require(isinstance(value, (int, float)) and math.isfinite(value),
                 f"--{name}={value} must be a finite number")
    for name, limit in (("train_steps", _MAX_STEPS), ("epochs", _MAX_STEPS),
                        ("synthetic_examples", _MAX_EXAMPLES), ("model_width", _MAX_WIDTH),
                        ("per_replica_batch_size", _MAX_BATCH),
                        ("cpu_replicas", _MAX_CPU_REPLICAS)):
        value = getattr(c, name)
        _require(value <= limit, f"--{name}={value} is larger than this program accepts ({limit:,})")
    _require(c.epochs > 0 or c.train_steps > 0,
             f"--epochs={c.epochs} must be positive (or set --train_steps)")
    _require(c.train_steps >= 0, f"--train_steps={c.train_steps} must be >= 0 (0 means: use --epochs)")
    _require(c.learning_rate > 0, f"--learning_rate={c.learning_rate} must be positive")
    _require(c.max_learning_rate >= 0,
             f"--max_learning_rate={c.max_learning_rate} must be >= 0 (0: no ceiling)")
    _require(c.warmup_epochs >= 0, f"--warmup_epochs={c.warmup_epochs} must be >= 0")
    _require(0 <= c.momentum < 1, f"--momentum={c.momentum} must be in [0, 1)")
    _require(c.weight_decay >= 0, f"--weight_decay={c.weight_decay} must be >= 0")
    _require(0 <= c.label_smoothing < 1, f"--label_smoothing={c.label_smoothing} must be in [0, 1)")
    # Seeds feed numpy (< 2**32) and TensorFlow's stateless ops (int32, with
    # small offsets added).
    _require(0 <= c.seed < 2**31 - 16, f"--seed={c.seed} must be in [0, {2**31 - 16})")
    _require(c.eval_every_epochs >= 0,
             f"--eval_every_epochs={c.eval_every_epochs} must be >= 0 (0: only at the end)")
    _require(c.cpu_replicas >= 0, f"--cpu_replicas={c.cpu_replicas} must be >= 0 (0: do not split the CPU)")
    _require(c.cpu_replicas == 0 or c.strategy in ("auto", "mirrored"),
             f"--cpu_replicas={c.cpu_replicas} needs --strategy=mirrored (or auto); "
             f"--strategy={c.strategy} runs one replica per worker")
