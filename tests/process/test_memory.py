"""A model too large for the memory this process may take is one line before
any weight exists: the host's MemAvailable, or a container's, pod's or SLURM
job's cgroup limit, whichever is lower (process/memory.py). The probe is
read from trees made here; a real cgroup is used where the test may make
one (root, a writable memory controller), and an injected limit everywhere."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (REPO, SMOKE_FLAGS, assert_one_error_line, run_in_process, subprocess_env,
                      train)
from distributed_mpt.core import models
from distributed_mpt.process import memory

GB = 10**9
# 1.7 billion weights: 6.7 GB of float32 weights alone, 47 GB to train and export.
TOO_LARGE = [*SMOKE_FLAGS, "--model=resnet9", "--model_width=1024", "--train_steps=2"]


def _tree(root: Path, files: dict):
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = "MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n"  # 51.2 GB available


def test_a_cgroup_v2_limit_below_the_hosts_memory_is_the_headroom(tmp_path):
    _tree(tmp_path, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "0::/kubepods/pod1/container\n",
        "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 "
                                "cgroup2 rw,nsdelegate\n",
        # The container has no limit of its own; its pod has, and the one above it a larger one.
        "/sys/fs/cgroup/kubepods/pod1/container/memory.max": "max\n",
        "/sys/fs/cgroup/kubepods/pod1/container/memory.current": "100\n",
        "/sys/fs/cgroup/kubepods/pod1/memory.max": "4000000000\n",
        "/sys/fs/cgroup/kubepods/pod1/memory.current": "1500000000\n",
        # Page cache the kernel would reclaim first is not in use.
        "/sys/fs/cgroup/kubepods/pod1/memory.stat": "anon 1000000000\ninactive_file 500000000\n",
        "/sys/fs/cgroup/kubepods/memory.max": "64000000000\n",
        "/sys/fs/cgroup/kubepods/memory.current": "1500000000\n",
    })
    headroom = memory.headroom(str(tmp_path))
    assert headroom.bytes == 4 * GB - 1 * GB
    assert headroom.describe() == ("3.0 GB left under the memory limit of cgroup /kubepods/pod1 "
                                   "(4.0 GB, memory.max)")


def test_a_cgroup_v1_limit_and_a_namespaced_path(tmp_path):
    """cgroup v1 (a SLURM job's, an older Docker's); in a cgroup namespace
    /proc/self/cgroup may name a path that is not under the mount, whose
    top is then the process's own cgroup."""
    _tree(tmp_path, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "5:cpu:/\n4:memory:/../../slurm/uid_0/job_7\n0::/\n",
        "/proc/self/mountinfo": (
            "35 31 0:32 /slurm/uid_0/job_7 /sys/fs/cgroup/memory rw,relatime - cgroup cgroup "
            "rw,memory\n36 31 0:33 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"),
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "2000000000\n",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": "600000000\n",
        "/sys/fs/cgroup/memory/memory.stat": "cache 300000000\ntotal_inactive_file 100000000\n",
    })
    headroom = memory.headroom(str(tmp_path))
    assert headroom.bytes == 2_000_000_000 - 500_000_000
    assert "cgroup / (2.0 GB, memory.limit_in_bytes)" in headroom.limit


def test_without_a_cgroup_limit_the_hosts_available_memory_counts(tmp_path):
    _tree(tmp_path, {
        "/proc/meminfo": MEMINFO,
        "/proc/self/cgroup": "4:memory:/\n",
        "/proc/self/mountinfo": "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # no limit
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": "600000000\n",
    })
    assert memory.headroom(str(tmp_path)) == memory.Headroom(
        50_000_000 * 1024, "available on this host (MemAvailable)")
    assert memory.headroom(str(tmp_path / "nothing")) is None  # not Linux: no check


def test_the_parameters_are_counted_without_allocating_them():
    from distributed_mpt.core.data import cifar10

    spec = models.model_spec("resnet9")
    assert models.parameter_count(spec, cifar10.INFO, 16) == \
        models.build_model(spec, cifar10.INFO, 16).count_params()
    assert models.parameter_count(models.model_spec("x.py:build"), cifar10.INFO) is None


def test_an_injected_limit_refuses_the_model_before_it_is_built(tmp_path, monkeypatch):
    """The memory probe is the test's: 2 GB left under a pod's limit."""
    limit = memory.Headroom(2 * GB, "left under the memory limit of cgroup /pod (4.0 GB, "
                                    "memory.max)")
    monkeypatch.setattr(memory, "headroom", lambda: limit)

    def never(*args, **kwargs):
        raise AssertionError("the model was built before its memory was checked")

    monkeypatch.setattr(models, "build_model", never)
    result = train([*TOO_LARGE, f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "--model=resnet9 at --model_width=1024 has 1,680,071,680 "
                                  "parameters: training it needs about 47.0 GB, more than the "
                                  "2.0 GB left under the memory limit of cgroup /pod")
    assert not (tmp_path / "run").exists(), "a new --model_dir refused leaves nothing"


def _memory_cgroup():
    """A new cgroup with a memory controller under this process's own, and
    the file its limit goes in; skips where none can be made."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    own = {line.split(":", 2)[1]: line.split(":", 2)[2]
           for line in Path("/proc/self/cgroup").read_text().splitlines()}
    candidates = []
    if "memory" in own:  # v1
        candidates.append((Path("/sys/fs/cgroup/memory") / own["memory"].lstrip("/"),
                           "memory.limit_in_bytes"))
    if "" in own:  # v2
        for top in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            if "memory" in (top / "cgroup.controllers").read_text().split() \
                    if (top / "cgroup.controllers").exists() else False:
                candidates.append((top / own[""].lstrip("/"), "memory.max"))
    for parent, limit_file in candidates:
        child = parent / f"dmpt-test-{os.getpid()}"
        try:
            child.mkdir()
        except OSError:
            continue
        if (child / limit_file).exists():
            return child, limit_file
        child.rmdir()
    pytest.skip("no cgroup with a memory controller can be made here")


def _train_in_cgroup(tmp_path, limit: int, flags, entry_point="train"):
    """distributed-mpt-train (or another `entry_point`) with `flags` in a new
    cgroup limited to `limit` bytes, as a pod or a SLURM job runs at its
    limit; its result."""
    cgroup, limit_file = _memory_cgroup()
    try:
        (cgroup / limit_file).write_text(str(limit))
        procs = cgroup / "cgroup.procs"
        result = subprocess.run(
            [sys.executable, "-m", f"distributed_mpt.{entry_point}", *flags,
             f"--model_dir={tmp_path / 'run'}"],
            preexec_fn=lambda: procs.write_text(str(os.getpid())), capture_output=True,
            text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    finally:
        for _ in range(50):  # empty once the process is gone
            try:
                cgroup.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)
    print(result.stderr[-500:])
    assert "left under the memory limit of cgroup /" in result.stderr, result.stderr[-2000:]
    assert f"({limit / 1e9:.1f} GB, {limit_file})" in result.stderr
    if entry_point == "train":
        assert not (tmp_path / "run").exists(), "a new --model_dir refused leaves nothing"
    return result


def test_a_real_cgroup_limit_refuses_the_model_before_the_oom_killer(tmp_path):
    """The run in a cgroup limited to 1.5 GB: TensorFlow and the data fit, a
    model of 47 GB does not. It was killed building its weights (exit 137,
    no word), as a pod or a SLURM job is at its limit."""
    result = _train_in_cgroup(tmp_path, 1_500_000_000, TOO_LARGE)
    assert_one_error_line(result, "--model=resnet9 at --model_width=1024 has 1,680,071,680 "
                                  "parameters: training it needs about 47.0 GB, more than the ")


def test_each_replica_on_the_cpu_is_counted(tmp_path):
    """--cpu_replicas keeps a copy of the model per replica in host memory
    (resnet9 at width 128 peaked at 3.7 GB on 4 replicas, 1.3 GB on 1): a
    model that fits once but not four times is refused, where it was
    counted once and met the OOM killer."""
    result = _train_in_cgroup(tmp_path, 2_000_000_000, [
        *SMOKE_FLAGS, "--model=resnet9", "--model_width=128", "--train_steps=2",
        "--strategy=mirrored", "--cpu_replicas=4"])
    assert_one_error_line(result, "--model=resnet9 at --model_width=128 has 26,")
    needed, headroom = re.search(r"on 4 replicas in this host's memory needs about ([\d.]+) GB, "
                                 r"more than the ([\d.]+) GB left", result.stderr).groups()
    assert float(needed) / 4 < float(headroom) < float(needed), "one copy would have fitted"
    assert "fewer --cpu_replicas" in result.stderr

# A user's network of 3.1 GB of weights (764 million), 86 GB to train and export: its
# size is known only as its variables are made.
_WIDE = """
import keras

def wide(info):
    x = inputs = keras.Input(info.image_shape, dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))
    for _ in range(12):
        x = keras.layers.Dense(8192)(x)
    return keras.Model(inputs, keras.layers.Dense(info.num_classes)(x))
"""


_SWALLOWS = """
import keras

def swallows(info):
    images = keras.Input(info.image_shape, dtype="uint8")
    small = keras.Model(images, keras.layers.Dense(info.num_classes)(
        keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))))
    try:  # an optional part, dropped on any error: the refusal too
        keras.layers.Dense(4096).build((None, 3072))
    except Exception:
        pass
    return small
"""


def test_a_refusal_that_the_users_code_swallows_still_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "headroom", lambda: memory.Headroom(
        100_000_000, "available on this host (MemAvailable)"))
    (tmp_path / "swallows.py").write_text(_SWALLOWS)
    result = train([*SMOKE_FLAGS, f"--model={tmp_path / 'swallows.py'}:swallows",
                    "--train_steps=2", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "swallows.py:swallows has at least 12,")
    assert not (tmp_path / "run").exists()


def test_a_users_network_too_large_is_refused_as_it_is_built(tmp_path):
    """A user's network is counted as its variables are made, and refused at
    the first that takes it past the limit: before, the OOM killer ended the
    run halfway through building its weights (exit 137, no word)."""
    (tmp_path / "wide.py").write_text(_WIDE)
    result = _train_in_cgroup(tmp_path, 1_500_000_000, [
        *SMOKE_FLAGS, f"--model={tmp_path / 'wide.py'}:wide", "--train_steps=2"])
    assert_one_error_line(result, "wide.py:wide has at least ")
    assert "parameters (counted as it was built): training it needs at least " in result.stderr


@pytest.mark.parametrize("name", ["resnet9", "airbench"])
def test_counting_the_parameters_changes_no_initial_weight(name):
    """Keras draws initializers' seeds from Python's generator: a count that
    drew them too gave every run other initial weights than its seed's."""
    import keras
    import numpy as np

    from distributed_mpt.core.data import cifar10

    spec = models.model_spec(name)
    keras.utils.set_random_seed(0)
    plain = models.build_model(spec, cifar10.INFO, 8).get_weights()
    keras.utils.set_random_seed(0)
    models.parameter_count(spec, cifar10.INFO, 8)
    counted_first = models.build_model(spec, cifar10.INFO, 8).get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(plain, counted_first))


def test_freed_memory_goes_back_to_the_system():
    # A heap that holds 320 MB freed below a block still in use: glibc keeps
    # it (it gives back only what is free at the top) until told.
    probe = """
import os
from distributed_mpt.process import memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

chunks = [b"x" * 32768 for _ in range(10_000)]
in_use = b"y" * 32768
del chunks
kept = resident()
released = memory.release_freed_memory()
print(released, kept, resident())
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=subprocess_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    released, kept, after = result.stdout.split()
    print(f"resident before {int(kept) / 1e6:.0f} MB, after {int(after) / 1e6:.0f} MB")
    assert released == "True"
    assert int(kept) - int(after) > 200e6


def test_without_malloc_trim_nothing_is_released(monkeypatch):
    # musl or macOS: a C library without glibc's malloc_trim.
    import ctypes

    class WithoutTrim:
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", WithoutTrim)
    assert memory.release_freed_memory() is False


def test_a_real_cgroup_limit_refuses_an_image_folder_before_it_is_decoded(tmp_path):
    """2,002 images at 512 x 512 (1.6 GB decoded) in a cgroup limited to
    1.5 GB: the bound before decoding was the host's memory, and the
    OOM killer ended the run as it decoded (exit 137, no word)."""
    from PIL import Image

    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8), (90, 20, 200)).save(photo)
    for split, count in (("train", 1000), ("test", 1)):
        for name in ("cats", "dogs"):
            (tmp_path / "photos" / split / name).mkdir(parents=True)
            for i in range(count):
                # Copies, not links to it: two paths to one file are refused.
                (tmp_path / "photos" / split / name / f"{i}.png").write_bytes(photo.read_bytes())
    result = _train_in_cgroup(tmp_path, 1_500_000_000, [
        *SMOKE_FLAGS, "--dataset=image_folder", f"--data_dir={tmp_path / 'photos'}",
        "--image_size=512", "--train_steps=2"])
    assert_one_error_line(result, f"the 2,002 images of {tmp_path / 'photos'} take 1.6 GB of "
                                  f"memory at --image_size=512, more than the ")


def test_a_real_cgroup_limit_refuses_an_image_folder_to_evaluate_before_it_is_decoded(tmp_path):
    """predict --evaluate on 2,000 test images (and 2 to train) at the model's 512 x 512 in a
    cgroup limited to 1.5 GB: the bound was the host's memory there too, and
    the OOM killer ended the evaluation as it decoded (exit 137, no word)."""
    from PIL import Image

    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8), (90, 20, 200)).save(photo)
    for folder, test_count in (("few", 1), ("many", 1000)):
        for split, count in (("train", 1), ("test", test_count)):
            for name in ("cats", "dogs"):
                (tmp_path / folder / split / name).mkdir(parents=True)
                for i in range(count):
                    (tmp_path / folder / split / name / f"{i}.png").write_bytes(
                        photo.read_bytes())  # a copy: two paths to one file are refused
    trained = train([*SMOKE_FLAGS, "--dataset=image_folder", f"--data_dir={tmp_path / 'few'}",
                     "--image_size=512", "--model=resnet9", "--model_width=4",
                     "--per_replica_batch_size=2", "--train_steps=1", "--export",
                     f"--model_dir={tmp_path / 'run'}"])
    assert trained.returncode == 0, trained.stderr[-2000:]
    result = _train_in_cgroup(tmp_path, 1_500_000_000, [
        "--evaluate", f"--data_dir={tmp_path / 'many'}"], entry_point="predict")
    assert_one_error_line(result, f"the 2,002 images of {tmp_path / 'many'} take 1.6 GB of "
                                  f"memory at --image_size=512, more than the ")


def _run_whose_config_names_width_1024(tmp_path):
    """A tiny resnet9's trained run (no export) whose config.json was
    changed to name width 1,024: 6.7 GB of weights, which its checkpoint
    does not hold."""
    import json

    run = tmp_path / "run"
    assert train([*SMOKE_FLAGS, "--model=resnet9", "--model_width=4", "--train_steps=1",
                  f"--model_dir={run}"]).returncode == 0
    recorded = json.loads((run / "config.json").read_text())
    recorded["model"]["model_width"] = 1024
    (run / "config.json").write_text(json.dumps(recorded))
    photo = tmp_path / "photo.png"
    from PIL import Image
    Image.new("RGB", (32, 32), (90, 20, 200)).save(photo)
    return run, photo


def test_predict_refuses_a_config_json_naming_a_model_too_large_before_it_is_built(
        tmp_path, monkeypatch):
    """predict built what a run's config.json named before any check: an
    edited (or hostile) one naming width 1,024 built 6.7 GB of weights
    before the checkpoint was found not to hold them, the OOM killer's
    exit 137 on a smaller machine. The memory probe is the test's."""
    from distributed_mpt.predict import main

    run, photo = _run_whose_config_names_width_1024(tmp_path)
    monkeypatch.setattr(memory, "headroom", lambda: memory.Headroom(
        2 * GB, "left under the memory limit of cgroup /pod (4.0 GB, memory.max)"))

    def never(*args, **kwargs):
        raise AssertionError("the model was built before its memory was checked")

    monkeypatch.setattr(models, "build_model", never)
    result = run_in_process(main, [f"--model_dir={run}", str(photo)])
    assert_one_error_line(result, f"{run}/config.json names --model=resnet9 at "
                                  f"--model_width=1024, of 1,680,071,680 parameters: predicting "
                                  f"with it needs about 13.4 GB, more than the 2.0 GB left under "
                                  f"the memory limit of cgroup /pod")


def test_predict_in_a_real_cgroup_refuses_a_config_json_naming_a_model_too_large(tmp_path):
    """The same in a cgroup limited to 1.5 GB: it was killed building the
    weights (exit 137, no word)."""
    run, photo = _run_whose_config_names_width_1024(tmp_path)
    result = _train_in_cgroup(tmp_path, 1_500_000_000, [str(photo)], entry_point="predict")
    assert_one_error_line(result, "config.json names --model=resnet9 at --model_width=1024, of "
                                  "1,680,071,680 parameters: predicting with it needs about ")
