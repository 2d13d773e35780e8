"""One run, from a validated config to its exit code (docs/architecture.md),
and the options it reads itself: how it runs (RunOptions) and evaluates
(EvaluationOptions). TensorFlow-free, so that flags are checked without it."""

import dataclasses
from typing import Optional

from distributed_mpt.core import augmentation, batch_norm, precision
from distributed_mpt.options import (MAX_STEPS, Options, option, require, require_at_most,
                                     require_positive)

# A progress line at least this often, whatever --log_every_steps says.
PROGRESS_SECONDS = 20
_MAX_BATCH = 65_536


@dataclasses.dataclass(frozen=True)
class RunOptions(Options):
    """Where a run keeps its files, its seed and precision, and its pace."""

    model_dir: Optional[str] = option(
        None, "Where checkpoints, TensorBoard logs, metrics.jsonl, summary.json and the export "
        "go. A run resumes from the checkpoints it finds here.")
    adopt_model_dir: bool = option(
        False, "Train in a --model_dir that holds files this program did not write (refused "
        "otherwise); the run then writes config.json, summary.json, metrics.jsonl, "
        "checkpoints/, tensorboard/ and export/ there.")
    seed: int = option(0, "Seed of initialization, shuffling and augmentation.")
    # The run's, not the model's: each worker resolves `auto` on its own machine.
    precision: str = option(
        "auto", "auto: mixed_float16 on GPUs of compute capability 7.0+, mixed_bfloat16 on "
        "CPUs with bfloat16 instructions (AVX512_BF16 or AMX; how much faster than float32: "
        "docs/performance.md), else float32 (bfloat16 is emulated and slower without them, "
        "float16 on every CPU). mixed_float16 scales the loss dynamically; mixed_bfloat16 "
        "needs no scaling.", precision.PRECISIONS)
    per_replica_batch_size: int = option(128, "Examples per replica per step; the global "
                                         "batch is this times the number of replicas of all "
                                         "workers.")
    steps_per_loop: int = option(
        50, "At most this many optimizer steps per tf.function call (less Python overhead); "
        "fewer when steps are slow, so that progress and Ctrl-C are answered within seconds.")
    log_every_steps: int = option(100, "Steps between progress lines (there is also one at "
                                  f"least every {PROGRESS_SECONDS} seconds and at the end of "
                                  "each epoch).")
    checkpoint_every_steps: int = option(1000, "Steps between checkpoints (one is also written "
                                         "at the end and on SIGTERM/Ctrl-C).")
    xla: bool = option(False, "Compile the forward and backward pass with XLA.")
    data_on_device: bool = option(
        False, "Keep the uint8 train split in device memory (150 MB per GPU for CIFAR-10) and "
        "shuffle and augment there: only indices cross from the host. Same results as the "
        "host pipeline for the same seed.")
    export: bool = option(True, "Export a SavedModel and a .keras file at the end.")

    def check(self) -> None:
        require(bool(self.model_dir),
                "--model_dir is required: where checkpoints, logs and the exported model go")
        counts = ("steps_per_loop", "log_every_steps", "checkpoint_every_steps")
        require_positive(self, "per_replica_batch_size", *counts)
        require_at_most(self, MAX_STEPS, *counts)
        require_at_most(self, _MAX_BATCH, "per_replica_batch_size")
        # Seeds feed numpy (< 2**32) and TensorFlow's stateless ops (int32, plus small offsets).
        require(0 <= self.seed < 2**31 - 16, f"--seed={self.seed} must be in [0, {2**31 - 16})")


@dataclasses.dataclass(frozen=True)
class EvaluationOptions(Options):
    """When a run evaluates, with which test-time views, and whether batch
    norm's statistics are recalibrated first."""

    evaluate: bool = option(True, "Evaluate on the whole test split at the end.")
    eval_every_epochs: int = option(0, "Also evaluate every N epochs during training (logged "
                                    "like the progress); 0: only at the end.")
    eval_tta: str = option(
        "none", "Test-time augmentation: classify each test image by the mean logits of several "
        "views. flip: the image and its mirror image. flip_translate (airbench94's): those two, "
        "weighted 1/2, and both again shifted by one pixel up-left and down-right, 1/8 each. "
        "flip_translate_mean (the 2025 record's): the same six, 1/6 each. "
        "Runs evaluate with and without, so that each shows what it buys.",
        augmentation.TTA_VIEWS)
    eval_tta_fraction: float = option(
        1.0, "Test-time augmentation only for this fraction of the test images: those whose plain "
        "view is least confident (lowest top softmax probability; the 2025 record, "
        "hiverge/cifar10-speedrun: 0.25); the others keep the plain view's logits.")
    bn_recalibration: str = option(
        "auto", f"After the last step, set batch norm's moving statistics to those of "
        f"{batch_norm.RECALIBRATION_IMAGES:,} unaugmented training images. auto: where momentum "
        f"** steps > {batch_norm.INITIAL_WEIGHT_LIMIT:g} (core/batch_norm.py).",
        batch_norm.RECALIBRATIONS)

    def check(self) -> None:
        require(0 < self.eval_tta_fraction <= 1,
                f"--eval_tta_fraction={self.eval_tta_fraction} must be in (0, 1]")
        require_at_most(self, MAX_STEPS, "eval_every_epochs")
        require(self.eval_every_epochs >= 0,
                f"--eval_every_epochs={self.eval_every_epochs} must be >= 0 (0: only at the end)")
