"""Which precision policy a run uses, and the loss scale it reports (the
loss-scaling optimizer itself is made in optim/optimizer.py).

mixed_float16: float16 compute, float32 variables, dynamic loss scaling
(float16 underflows small gradients). mixed_bfloat16: bfloat16 compute,
float32 variables, no loss scaling (bfloat16 has float32's range).
float32: the reference.
"""

from typing import Optional

# auto: decided by the devices (resolve_precision); the others are Keras'.
PRECISIONS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")

# float16 tensor cores arrived with Volta (compute capability 7.0).
_MIN_FLOAT16_CAPABILITY = (7, 0)


# CPU instructions that compute in bfloat16 natively (Linux /proc/cpuinfo
# names). With them, oneDNN runs mixed_bfloat16 faster than float32 at the
# same accuracy (by how much, on which CPU: docs/performance.md); without
# them bfloat16 is emulated and slower.
_BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_precision(requested: str) -> str:
    """Turns `auto` into a concrete policy for the local devices, as
    --precision's help says (older GPUs: float32)."""
    return _choose_precision(requested)[0]


def describe_precision_choice(requested: str) -> str:
    """The policy `requested` resolves to and what decided it, for a run's
    start line: "mixed_bfloat16: this CPU has AVX512_BF16", "float32: this
    CPU has no bfloat16 instructions", "float32: as requested"."""
    return "{}: {}".format(*_choose_precision(requested))


def _choose_precision(requested: str):
    """(policy, the reason for it): the one place `auto` is decided."""
    import tensorflow as tf  # TensorFlow's device list; this module imports without it

    if requested != "auto":
        return requested, "as requested"
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        capability = min(tf.config.experimental.get_device_details(g).get(
            "compute_capability", (0, 0)) for g in gpus)
        version = ".".join(map(str, capability))
        if capability >= _MIN_FLOAT16_CAPABILITY:
            return ("mixed_float16",
                    f"the GPUs have float16 tensor cores (compute capability {version})")
        return "float32", f"a GPU of compute capability {version} has no float16 tensor cores"
    instructions = cpu_bfloat16_instructions()
    if instructions:
        return "mixed_bfloat16", f"this CPU has {' and '.join(i.upper() for i in instructions)}"
    return "float32", "this CPU has no bfloat16 instructions"


def cpu_bfloat16_instructions(cpuinfo: str = "/proc/cpuinfo") -> tuple:
    """The bfloat16 instruction sets of this machine's CPU, by their
    /proc/cpuinfo names (Linux only; none where `cpuinfo` cannot tell)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return ()
    return tuple(flag for flag in _BFLOAT16_CPU_FLAGS if flag in flags)


def set_precision(policy_name: str) -> None:
    """Makes `policy_name` the global Keras dtype policy for models built after."""
    import keras

    keras.mixed_precision.set_global_policy(policy_name)
    avoid_float16_reference_kernels(policy_name)


# Whether avoid_float16_reference_kernels turned the process's remapper off.
_remapper_turned_off = False


def avoid_float16_reference_kernels(policy_name: Optional[str]) -> None:
    """Where a model computing in `policy_name` runs on a CPU in float16,
    turns off Grappler's remapper for every graph run after (training and
    predicting alike); for any other policy, turns it on again if this
    function turned it off (a remapper the user turned off stays off).

    The remapper fuses a float16 MatMul with its BiasAdd into oneDNN's inner
    product, which on a CPU with AVX512_FP16 has only its reference kernel
    for float16 (`inner_product,ref:any` in ONEDNN_VERBOSE; other CPUs not
    tried). On a 2-core Intel Xeon with AVX512_FP16 one Dense layer of the
    MLP (32x3072 by 3072x3000) took 15.6 s fused and 12 ms unfused; a
    training step of the MLP at batch 32 took 14 s fused and 0.35 s unfused,
    and predicting one image took 1.6 s fused.

    The setting is the process's: left off, it made every later run in the
    same process (a notebook's second run, the tests' in-process runs)
    compute unfused, slower and with other round-off. The MLP's weights
    after 60 bfloat16 steps differed by up to 0.067 from a run in a fresh
    process (2 cores of an Intel Xeon with AMX), which is how a resumed
    run's comparison caught it.
    """
    import tensorflow as tf

    global _remapper_turned_off
    if policy_name == "mixed_float16" and not tf.config.list_physical_devices("GPU"):
        if tf.config.optimizer.get_experimental_options().get("remapping", True):
            tf.config.optimizer.set_experimental_options({"remapping": False})
            _remapper_turned_off = True
    elif _remapper_turned_off:
        tf.config.optimizer.set_experimental_options({"remapping": True})
        _remapper_turned_off = False


def loss_scale(optimizer) -> float:
    """The current dynamic loss scale (1 when the optimizer does not scale)."""
    import keras
    import tensorflow as tf

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # A distributed variable under MirroredStrategy: read its value.
        return float(tf.convert_to_tensor(optimizer.dynamic_scale))
    return 1.0
