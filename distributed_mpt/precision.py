"""Which precision policy a run uses, and the loss scale it reports (the
loss-scaling optimizer itself is made in optimization.py).

mixed_float16: float16 compute, float32 variables, dynamic loss scaling
(float16 underflows small gradients). mixed_bfloat16: bfloat16 compute,
float32 variables, no loss scaling (bfloat16 has float32's range).
float32: the reference.
"""

import keras
import tensorflow as tf

# float16 tensor cores arrived with Volta (compute capability 7.0).
_MIN_FLOAT16_CAPABILITY = (7, 0)


# CPU instructions that compute in bfloat16 natively (Linux /proc/cpuinfo
# names). With them, oneDNN runs mixed_bfloat16 1.2-1.3x faster than float32
# at the same accuracy (measured on an AMD EPYC with AVX512_BF16: README,
# "Results"); without them bfloat16 is emulated and slower.
_BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_precision(requested: str) -> str:
    """Turns `auto` into a concrete policy for the local devices.

    GPUs of compute capability 7.0+: mixed_float16 (as the original notebook).
    Older GPUs: float32. CPUs with bfloat16 instructions: mixed_bfloat16.
    Other CPUs: float32, because there float16 and bfloat16 are emulated and
    slower.
    """
    if requested != "auto":
        return requested
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        capabilities = [tf.config.experimental.get_device_details(g).get("compute_capability",
                                                                        (0, 0)) for g in gpus]
        return "mixed_float16" if min(capabilities) >= _MIN_FLOAT16_CAPABILITY else "float32"
    return "mixed_bfloat16" if cpu_has_bfloat16() else "float32"


def cpu_has_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True if this machine's CPU has bfloat16 instructions (Linux only; False
    where `cpuinfo` cannot tell)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in _BFLOAT16_CPU_FLAGS)


def set_precision(policy_name: str) -> None:
    """Makes `policy_name` the global Keras dtype policy for models built after."""
    keras.mixed_precision.set_global_policy(policy_name)


def loss_scale(optimizer: keras.optimizers.Optimizer) -> float:
    """The current dynamic loss scale (1 when the optimizer does not scale)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # A distributed variable under MirroredStrategy: read its value.
        return float(tf.convert_to_tensor(optimizer.dynamic_scale))
    return 1.0
