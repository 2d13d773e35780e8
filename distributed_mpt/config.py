"""The validated, frozen configuration of one training run.

The entry point turns flags into a `TrainConfig`; every module below takes
the config or plain arguments and never reads flags.
"""

import dataclasses
from typing import Optional

from distributed_mpt.errors import ConfigError

DATASETS = ("cifar10", "synthetic")
MODELS = ("mlp", "resnet9")
PRECISIONS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
COMMUNICATIONS = ("auto", "ring", "nccl")


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
    learning_rate: float = 0.1
    warmup_epochs: float = 2.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    seed: int = 0
    steps_per_loop: int = 50
    log_every_steps: int = 100
    checkpoint_every_steps: int = 1000
    xla: bool = False
    data_on_device: bool = False
    peer_timeout_seconds: int = 300
    evaluate: bool = True
    eval_every_epochs: int = 0
    export: bool = True

    def __post_init__(self):
        _validate(self)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _choice(name: str, value: str, choices) -> None:
    _require(value in choices, f"--{name}={value!r} is not one of {', '.join(choices)}")


def _validate(c: TrainConfig) -> None:
    _require(bool(c.model_dir), "--model_dir is required: where checkpoints, logs and the exported model go")
    _choice("dataset", c.dataset, DATASETS)
    _choice("model", c.model, MODELS)
    _choice("precision", c.precision, PRECISIONS)
    _choice("strategy", c.strategy, STRATEGIES)
    _choice("communication", c.communication, COMMUNICATIONS)
    for name in ("per_replica_batch_size", "steps_per_loop", "log_every_steps",
                 "checkpoint_every_steps", "model_width", "synthetic_examples",
                 "peer_timeout_seconds"):
        value = getattr(c, name)
        _require(value > 0, f"--{name}={value} must be a positive integer")
    _require(c.epochs > 0 or c.train_steps > 0,
             f"--epochs={c.epochs} must be positive (or set --train_steps)")
    _require(c.train_steps >= 0, f"--train_steps={c.train_steps} must be >= 0 (0 means: use --epochs)")
    _require(c.learning_rate > 0, f"--learning_rate={c.learning_rate} must be positive")
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
