"""What to expect from training on this machine, measured with the package's
own training loop and input pipeline on CIFAR-shaped synthetic data (no
network): the machine's compute roof per precision, examples/s per model x
precision x batch x strategy, peak memory, the speedup mixed precision gives,
the fraction of the roof training reaches, whether the input pipeline keeps
up, and how training scales over replicas and workers.

Each measurement trains in a fresh process, so that its peak memory is its
own: a warm-up call of the loop, then --repeats timed calls of about 2 s, of
which the fastest is reported; the roof of each precision is timed the same
way, in a process of its own (the least disturbed by other processes, as
timeit reports). A section that fails is reported as FAILED with its reason,
the others still run, and the exit status is 1.

  Everything, in float32 and the precision training picks here (10 minutes
  on 2 cores of an AVX2-only AMD EPYC, docs/performance.md):
      distributed-mpt-benchmark --output=bench.json
  One model and batch:
      distributed-mpt-benchmark --models=resnet9 --batch_sizes=128
  How close the CPU recipe's training comes to the roof, in the precision
  training picks here:
      distributed-mpt-benchmark --models=airbench --batch_sizes=512 \
          --precisions=auto --sections=roof,compute
  A smoke run, for tests:
      distributed-mpt-benchmark --tiny --output=/tmp/bench.json
"""

import os

# Keeps most of TensorFlow's C++ start-up lines out of the report; the
# cells' processes inherit it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from distributed_mpt.benchmark.cli import main, run  # noqa: E402

__all__ = ["main", "run"]
