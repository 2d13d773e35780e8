"""Mixed-precision CIFAR-10 training on one GPU, all GPUs of a node, or many nodes."""

# First, as every command imports this first: a Ctrl-C or SIGTERM while a
# command imports and starts ends it with one line, not a traceback.
from distributed_mpt.process import start_guard as _start_guard  # noqa: I001

_start_guard.guard_the_start()

import os  # noqa: E402
import platform  # noqa: E402

__version__ = "0.1.0"

# TensorFlow turns its oneDNN kernels on by default only on x86 CPUs with
# AVX512_VNNI, AVX512_BF16 or AMX (TensorFlow 2.9's release notes); on the
# others, AVX2-only CPUs among them, convolutions run as Eigen's many small
# matrix products. On 2 cores of an AMD EPYC (Zen 3) with AVX2 and no
# AVX-512 the oneDNN kernels trained airbench 1.55x faster (144 against 93
# examples/s, float32, batch 512) and the MLP 1.34x (docs/performance.md).
# It must be set before TensorFlow is imported, so here, which every entry
# point imports first; a user's own setting wins. Other architectures were
# not measured, so TensorFlow's default stands there.
X86_MACHINES = ("x86_64", "amd64")  # platform.machine(), lowercased
if platform.machine().lower() in X86_MACHINES:
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
