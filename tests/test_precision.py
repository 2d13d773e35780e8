"""`auto` precision follows the devices: GPUs by compute capability, CPUs by
their bfloat16 instructions."""

import pytest
import tensorflow as tf

from distributed_mpt import precision


def test_auto_precision_on_this_machine():
    if tf.config.list_physical_devices("GPU"):
        expected = "mixed_float16"
    else:
        flags = open("/proc/cpuinfo").read()
        expected = "mixed_bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    assert precision.resolve_precision("auto") == expected
    assert precision.resolve_precision("mixed_bfloat16") == "mixed_bfloat16"


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx512f avx512_bf16 fma", "mixed_bfloat16"),
    ("fpu amx_bf16 amx_tile", "mixed_bfloat16"),
    ("fpu avx512f avx2 fma", "float32"),
])
def test_auto_precision_on_a_cpu_follows_its_bfloat16_instructions(tmp_path, monkeypatch,
                                                                   flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n")
    assert precision.cpu_has_bfloat16(str(cpuinfo)) == (expected == "mixed_bfloat16")
    assert not precision.cpu_has_bfloat16(str(tmp_path / "missing")), "unknown: no bfloat16"
    monkeypatch.setattr(precision.tf.config, "list_physical_devices", lambda kind: [])
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: expected == "mixed_bfloat16")
    assert precision.resolve_precision("auto") == expected
