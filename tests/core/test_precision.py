"""`auto` precision follows the devices: GPUs by compute capability, CPUs by
their bfloat16 instructions; a run can say which decided it; and what a
float16 run sets for its process does not outlast it."""

import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import (REPO, SMOKE_FLAGS, assert_ok, assert_same_weights, checkpoint_weights,
                      run_module, subprocess_env, train)
from distributed_mpt.core import precision


@pytest.fixture
def cpu_with(tmp_path, monkeypatch):
    """Makes this a GPU-less machine whose CPU has the given cpuinfo flags."""

    read_cpuinfo = precision.cpu_bfloat16_instructions

    def make(flags):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n")
        monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: [])
        monkeypatch.setattr(precision, "cpu_bfloat16_instructions",
                            lambda: read_cpuinfo(str(cpuinfo)))
    return make


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx512f avx512_bf16 fma", "mixed_bfloat16: this CPU has AVX512_BF16"),
    ("fpu amx_bf16 amx_tile avx512_bf16", "mixed_bfloat16: this CPU has AVX512_BF16 and AMX_BF16"),
    ("fpu avx512f avx2 fma", "float32: this CPU has no bfloat16 instructions"),
])
def test_auto_precision_on_a_cpu_follows_its_bfloat16_instructions(cpu_with, flags, expected):
    cpu_with(flags)
    assert precision.describe_precision_choice("auto") == expected
    assert precision.resolve_precision("auto") == expected.split(":")[0]


@pytest.mark.parametrize("capabilities, expected", [
    ([(8, 0), (8, 0)],
     "mixed_float16: the GPUs have float16 tensor cores (compute capability 8.0)"),
    ([(8, 0), (6, 1)], "float32: a GPU of compute capability 6.1 has no float16 tensor cores"),
])
def test_auto_precision_on_gpus_follows_the_oldest(monkeypatch, capabilities, expected):
    gpus = [f"GPU:{i}" for i in range(len(capabilities))]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: gpus)
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda gpu: {"compute_capability": capabilities[gpus.index(gpu)]})
    assert precision.describe_precision_choice("auto") == expected
    assert precision.resolve_precision("auto") == expected.split(":")[0]


def test_an_explicit_precision_is_kept_whatever_the_devices(cpu_with):
    cpu_with("fpu avx2")
    assert precision.resolve_precision("mixed_bfloat16") == "mixed_bfloat16"
    assert precision.describe_precision_choice("mixed_float16") == "mixed_float16: as requested"


def test_cpuinfo_that_cannot_be_read_means_no_bfloat16(tmp_path):
    assert precision.cpu_bfloat16_instructions(str(tmp_path / "missing")) == ()


# A float16 Dense layer on a CPU, run with oneDNN saying which kernel ran.
_FLOAT16_DENSE = """
import sys
import keras, tensorflow as tf
from distributed_mpt.core import precision
if sys.argv[1] == "set_precision":
    precision.set_precision("mixed_float16")
else:
    keras.mixed_precision.set_global_policy("mixed_float16")
layer = keras.layers.Dense(64)
tf.function(lambda x: layer(x))(tf.ones([8, 128]))
"""


def _onednn_kernels(how: str) -> str:
    result = subprocess.run([sys.executable, "-c", _FLOAT16_DENSE, how], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=subprocess_env(ONEDNN_VERBOSE="1"))
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_float16_on_a_cpu_never_runs_onednn_reference_kernels():
    """TensorFlow fuses a float16 MatMul with its bias into an inner product
    that oneDNN runs only with its reference kernel on a CPU (1000x slower:
    precision.avoid_float16_reference_kernels); set_precision avoids the fusion."""
    assert "ref:any" not in _onednn_kernels("set_precision")
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_fp16" in cpu_flags:  # where oneDNN computes in float16: the check can fail
        assert "inner_product,ref:any" in _onednn_kernels("keras_only")


def test_a_float16_run_leaves_the_next_run_in_its_process_the_kernels_of_a_fresh_one(tmp_path):
    """A notebook that trains in float16 and then in another precision (the
    tests' in-process runs do the same): the second run computes as a run in
    a process of its own does. The remapper that float16 turns off for the
    process was left off, and the second run's weights were another run's."""
    flags = [*SMOKE_FLAGS, "--train_steps=8", "--steps_per_loop=4", "--noevaluate"]
    assert_ok(train([*flags, "--precision=mixed_float16", f"--model_dir={tmp_path / 'f16'}"]))
    assert_ok(train([*flags, f"--model_dir={tmp_path / 'after'}"]))  # in this process
    assert_ok(run_module("distributed_mpt.train", [*flags, f"--model_dir={tmp_path / 'fresh'}"]))
    assert_same_weights(checkpoint_weights(tmp_path / "after"),
                        checkpoint_weights(tmp_path / "fresh"), rtol=1e-5, atol=1e-6)
