"""Precision policies and the optimizer that goes with each.

mixed_float16: float16 compute, float32 variables, dynamic loss scaling
(float16 underflows small gradients). mixed_bfloat16: bfloat16 compute,
float32 variables, no loss scaling (bfloat16 has float32's range).
float32: the reference.
"""

import keras
import tensorflow as tf

# float16 tensor cores arrived with Volta (compute capability 7.0).
_MIN_FLOAT16_CAPABILITY = (7, 0)


def resolve_precision(requested: str) -> str:
    """Turns `auto` into a concrete policy for the local devices.

    GPUs of compute capability 7.0+: mixed_float16 (as the original notebook).
    Older GPUs and CPUs: float32, because there float16 is emulated and much
    slower, and bfloat16 only pays on CPUs with AMX.
    """
    if requested != "auto":
        return requested
    gpus = tf.config.list_physical_devices("GPU")
    capabilities = [tf.config.experimental.get_device_details(g).get("compute_capability", (0, 0))
                    for g in gpus]
    if gpus and min(capabilities) >= _MIN_FLOAT16_CAPABILITY:
        return "mixed_float16"
    return "float32"


def set_precision(policy_name: str) -> None:
    """Makes `policy_name` the global Keras dtype policy for models built after."""
    keras.mixed_precision.set_global_policy(policy_name)


def loss_scale(optimizer: keras.optimizers.Optimizer) -> float:
    """The current dynamic loss scale (1 when the optimizer does not scale)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # A distributed variable under MirroredStrategy: read its value.
        return float(tf.convert_to_tensor(optimizer.dynamic_scale))
    return 1.0
