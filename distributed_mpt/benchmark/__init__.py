"""Measure what the package buys, side by side, on this machine.

Every comparison is a ratio of two figures measured in this same run,
interleaved (A, B, A, B, ...), each after a warm-up, as the median of
`--repeats` repeats. Needs no network: the data is CIFAR-shaped synthetic
(`data.make_synthetic`).

Sections (`--sections`, JSON keys of `--output`):

  input_pipeline  images/s of the package's input pipeline (batched gather
                  and augmentation of uint8 arrays) against the per-example
                  `map` pipeline most CIFAR examples use; and how many times
                  faster than the training step it delivers.
  training        examples/s of the package's training loop (the real
                  `trainer.train_and_evaluate`) against the original
                  notebook's way (`model.fit` on a float copy of the images),
                  same model, batch, precision and optimizer; plus what
                  `--steps_per_loop` and `--xla` buy.
  machine_limit   achieved FLOP/s of the training loop over the rate of a
                  large matmul in the same dtype: the fraction of peak.
  memory          peak resident memory of training on a 50,000-image split
                  with the package against the notebook (each in its own
                  process: peak RSS is per process).
  scaling         `mirrored` with 2 replicas against 1 at the same global
                  batch, and 2 local workers (`distributed_mpt.launch`,
                  MultiWorkerMirroredStrategy) against 1, as subprocesses of
                  the real entry points.
  startup         wall time of a 1-step training run (process start to exit)
                  against that of `import tensorflow`.

Recipes:

  Everything, about 10 minutes on 2 CPU cores:
      distributed-mpt-benchmark --output=bench.json
  One section, one model:
      distributed-mpt-benchmark --sections=training --models=resnet9 --batch_sizes=128
  On GPUs, per precision (the figures for each come from this flag):
      distributed-mpt-benchmark --precisions=float32,mixed_float16 --batch_sizes=256,512
  Seconds, for tests:
      distributed-mpt-benchmark --tiny --output=/tmp/bench.json

The default precision is float32: on CPUs float16 is emulated and slow. On a
machine with GPUs pass `--precisions`; every training figure is reported per
precision.
"""

import os

# As in train.py: keep TensorFlow's C++ start-up chatter out of the table.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from distributed_mpt.benchmark.cli import main, run  # noqa: E402

__all__ = ["main", "run"]
