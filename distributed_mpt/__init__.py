"""Mixed-precision CIFAR-10 training on one GPU, all GPUs of a node, or many nodes."""

import os
import platform

__version__ = "0.1.0"

# TensorFlow turns its oneDNN kernels on by default only on x86 CPUs with
# AVX512_VNNI, AVX512_BF16 or AMX (TensorFlow 2.9's release notes); on the
# others, AVX2-only CPUs among them, convolutions run as Eigen's many small
# matrix products. On 2 cores of an AVX2-only AMD EPYC the oneDNN kernels
# trained airbench 1.55x faster (144 against 93 examples/s, float32, batch
# 512) and the MLP 1.29x (docs/performance.md). It must be set before
# TensorFlow is imported, so here, which every entry point imports first; a
# user's own setting wins.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
