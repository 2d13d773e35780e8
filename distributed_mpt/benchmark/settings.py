"""What every section shares: the section names, the optimizer settings both
sides of a comparison use, the split sizes, and `BenchConfig` (what to
measure), set from the flags by `cli.parse_config`."""

import dataclasses
from typing import Optional


SECTIONS = ("input_pipeline", "training", "machine_limit", "memory", "scaling", "startup")

# The notebook used Keras' SGD default of 0.01; both sides use it (stated at
# the reference batch and scaled like the package does), with the package's
# Nesterov momentum, and no weight decay, so only the loop and input differ.
LEARNING_RATE = 0.01
MOMENTUM = 0.9
# The input pipelines are timed over this many images after pipeline._PIPELINE_WARMUP
# batches (the per-example pipeline first fills its 50,000-image shuffle buffer).
PIPELINE_IMAGES = 40_000
TRAIN_SPLIT = 50_000  # CIFAR-10's train split


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure; see the flags."""

    output: Optional[str] = None
    repeats: int = 3
    steps: int = 0
    models: tuple = ("mlp", "resnet9")
    model_width: int = 64
    batch_sizes: tuple = (32, 256)
    # float32 always; `auto` adds mixed_float16 on GPUs of compute capability
    # 7.0+ (and is float32 again on CPUs, where it is dropped as a repeat).
    precisions: tuple = ("float32", "auto")
    sections: tuple = SECTIONS
    train_examples: int = TRAIN_SPLIT
    pipeline_images: int = PIPELINE_IMAGES
    seed: int = 0
    tiny: bool = False
