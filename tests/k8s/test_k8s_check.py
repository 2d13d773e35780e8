"""k8s/check.py, the offline check users run on their edited k8s/settings,
run as they run it: on the shipped settings, on an edited copy that must
pass, on a contradictory one, and on hostile files, each of which must end in
one `error:` line and exit 2, within bounds, before anything is rendered.
"""

import os
import shutil
import time
from pathlib import Path

import pytest

from support.k8s_pods import (K8S, VARIANTS, edit, edit_kustomization, edit_settings, load_check, render,
                              run_check)

check = load_check()
DIGEST = "sha256:" + "ab" * 32


def _errors(result) -> list:
    """The check's error lines, after asserting that it refused, in its
    format: exit 2, only `error:` lines on stderr, no traceback."""
    print(result.stdout + result.stderr)
    assert result.returncode == 2, result.returncode
    found = result.stderr.splitlines()
    assert found and all(line.startswith("error: ") for line in found), found
    return found


def settings_copy(tmp_path) -> Path:
    """An edited copy of k8s/settings that passes the check: CPU-only, the
    image pinned by digest."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit_settings(k8s, recipe="cpu_cnn94", precision="auto", communication="ring")
    edit(k8s / "settings" / "kustomization.yaml", {"registry.example.com/": "registry.internal/",
                                                   "sha256:" + "0" * 64: DIGEST})
    return k8s / "settings"


def test_the_shipped_configuration_fails_only_on_its_placeholder_image():
    (line,) = _errors(run_check())
    assert line.startswith("error: registry.example.com/ml/distributed-mpt@sha256:0000") and "placeholder" in line


def test_an_edited_copy_renders_validates_and_passes_the_check(tmp_path):
    """CPU-only, 4 workers, another job name and namespace, the image by
    digest, no taint tolerated, your own network on your own images, a Kueue
    queue and topology: a change of k8s/settings alone, which the check passes
    (given as a settings directory)."""
    settings = settings_copy(tmp_path)
    edit_settings(settings.parent, workers=4, jobName="flowers-cnn",
                  flags=["--dataset=image_folder", "--data_dir=/data/images/flowers",
                         "--model=/models/model.py:small_cnn"],
                  storage={"claim": "team-datasets", "class": "cephfs", "accessMode": "ReadWriteMany"},
                  pod={"tolerations": [], "nodeSelector": {"node.kubernetes.io/instance-type": "c7a.8xlarge"}})
    edit_kustomization(settings.parent, queue=True, topology="cloud.google.com/gce-topology-block",
                       namespace="ml-team")
    result = run_check(str(settings))
    print(result.stdout + result.stderr)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "queued in Kueue's LocalQueue" in result.stdout


def test_the_check_refuses_a_contradictory_copy(tmp_path):
    """Each problem is one error line, exit 2: GPUs gone but precision and
    communication left for them, the Kueue topology's placeholder left in and
    without a queue, a TrainJob patched to a node count the settings do not
    say, a model file the pods do not have."""
    settings = settings_copy(tmp_path)
    k8s = settings.parent
    edit_settings(k8s, precision="mixed_float16", communication="nccl",
                  flags=["--data_dir=/data/tfds", "--model=/models/mine.py:net"])
    edit_kustomization(k8s, queue=False, topology="")
    workers = check.read_mapping(settings / "settings.yaml")["spec"]["workers"]
    edit(k8s / "trainjob" / "kustomization.yaml", {"\npatches:\n": (  # one more of its patches
        "\npatches:\n- target:\n    kind: TrainJob\n  patch: |-\n    - op: replace\n"
        f"      path: /spec/trainer/numNodes\n      value: {workers + 1}\n")})
    found = _errors(run_check(k8s=k8s))
    wanted = ["precision mixed_float16 without GPUs", "communication nccl without GPUs",
              "topology.example.com/block is a placeholder left unset",
              f"trainjob: TrainJob cifar10-resnet9 numNodes is {workers + 1}, settings.yaml says workers: {workers}"]
    wanted += [f"{variant}: {where}: --model=/models/mine.py:net: the pods see only the files of k8s/settings/model"
               for variant in VARIANTS for where, _ in check.pod_templates(render(variant, k8s))]
    wanted += [f"{variant}: {where}: kueue.x-k8s.io/podset-preferred-topology without a queue label"
               for variant in VARIANTS for where, _ in check.pod_templates(render(variant, k8s))]
    for text in wanted:
        assert sum(text in line for line in found) == 1, text
    assert len(found) == len(wanted), found


def test_the_check_names_an_unknown_setting_and_an_unknown_variant(tmp_path):
    settings = Path(shutil.copytree(K8S / "settings", tmp_path / "settings"))
    edit(settings / "settings.yaml", {"\nspec:\n": "\nspec:\n  gpusPerWorker: 1\n"})
    for args, message in (([str(settings)], "'gpusPerWorker' was unexpected"), (["jobsets"], "jobsets")):
        result = run_check(*args)
        (line,) = _errors(result)
        assert message in line and result.stdout == "", line


def test_kubectl_failing_is_told_by_its_last_line(tmp_path):
    """kubectl's deprecation warnings come first, its error last, with the
    cause at the end of that line: that is what the error line keeps."""
    settings = settings_copy(tmp_path)
    edit(settings / "kustomization.yaml", {"resources:\n- settings.yaml\n": (
        "commonLabels: {a: b}\npatchesStrategicMerge: []\npatchesJson6902: []\nvars: []\n"
        "resources:\n- settings.yaml\n- missing.yaml\n")})
    (line,) = _errors(run_check(str(settings), "trainjob"))
    assert line.startswith("error: trainjob: kubectl kustomize failed: ") and "Warning" not in line, line
    assert "missing.yaml: no such file or directory" in line[-60:], line


def _billion_laughs(text: str) -> str:
    """The tolerations made of ten anchors of nine aliases each: 10^9
    strings once expanded (the shipped check's kubectl grew past 4.6 GB on it)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    text = _set(text, "\nspec:\n", "\nlaughs:\n" + "".join(f"  {line}\n" for line in lines) + "spec:\n")
    return text[:text.index("    tolerations:")] + "    tolerations: *a9\n"


def _set(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# Each a file of the settings directory as a user, a tool or an attacker may
# leave it: (file, how it is made from the shipped one, what the error says).
HOSTILE = {
    "invalid UTF-8": ("settings.yaml", lambda text: text.encode() + b"\n# caf\xe9\n", "not UTF-8"),
    "10,000-deep nesting": ("settings.yaml", lambda text: text + "deep: " + "[" * 10_000 + "]" * 10_000 + "\n",
                            "nesting deeper than 100"),
    "an alias bomb": ("settings.yaml", _billion_laughs, "an alias (*name): not accepted"),
    "a file of 2 MB": ("model/model.py", lambda text: text + "#" * 2_000_000 + "\n", "larger than 1048576 bytes"),
    "100,000 workers": ("settings.yaml", lambda text: _set(text, "workers: 2\n", "workers: 100000\n"),
                        "workers 100000 is more than the trainer takes (10000)"),
    "a size carrying YAML": ("settings.yaml", lambda text: _set(text, "size: 20Gi", 'size: "20Gi\\nfoo: bar"'),
                             "spec.storage.size: '20Gi\\nfoo: bar' carries a line break"),
    "a name carrying YAML": ("settings.yaml", lambda text: _set(text, "jobName: cifar10-resnet9",
                                                                'jobName: "{a: b}"'), "carries a line break, a control character or YAML structure"),
    "a size out of range": ("settings.yaml", lambda text: _set(text, "ephemeral-storage: 6Gi", "ephemeral-storage: 6Ei"),
                            "resources.limits.ephemeral-storage: 6Ei is out of range (0 to 1Pi"),
    "a size that is no quantity": ("settings.yaml", lambda text: _set(text, "memory: 24Gi", "memory: 24GB"),
                                   "'24GB' is not a Kubernetes quantity"),
    "a size of 1e400": ("settings.yaml", lambda text: _set(text, "memory: 24Gi", "memory: 1e400"),
                        "resources.requests.memory: 1e400 is beyond the largest quantity Kubernetes holds"),
    "a size of 1e9999999": ("settings.yaml", lambda text: _set(text, "ephemeral-storage: 2Gi",
                                                                  "ephemeral-storage: 1e9999999"),
                            "ephemeral-storage: 1e9999999 is beyond the largest quantity Kubernetes holds"),
    "a resource named by a number": ("settings.yaml", lambda text: _set(text, "  limits:\n",
                                                                        "  limits:\n          1: 2\n"),
                                     "resources.limits: 1 is not of type 'string'"),
    "a node label named by a number": ("settings.yaml", lambda text: _set(text, "nodeSelector:\n",
                                                                          "nodeSelector:\n      1: 2\n"),
                                       "nodeSelector: 1 is not of type 'string'"),
    "a job name too long for its pods": ("settings.yaml", lambda text: _set(
        text, "jobName: cifar10-resnet9", "jobName: " + "a" * 60), "short enough for the pods' names"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_settings_file_is_one_error_line(tmp_path, case):
    """Refused with one line naming the file and the problem, within bounds
    (no traceback, no exhausted memory or stack), before kubectl is run."""
    name, make, message = HOSTILE[case]
    settings = settings_copy(tmp_path)
    content = make((settings / name).read_text())
    (settings / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    started = time.monotonic()
    (line,) = _errors(run_check(str(settings)))
    print(f"refused in {time.monotonic() - started:.1f} s")
    assert message in line, line


def test_a_fifo_in_the_settings_is_refused_not_waited_on(tmp_path):
    settings = settings_copy(tmp_path)
    (settings / "kustomization.yaml").unlink()
    os.mkfifo(settings / "kustomization.yaml")  # nobody ever writes into it
    (line,) = _errors(run_check(str(settings)))
    assert line == f"error: {settings / 'kustomization.yaml'}: not a regular file"


@pytest.mark.parametrize("text", ["1e400", "1e9999999", "-1e9999999", "9" * 400, "1e" + "9" * 5000, "8Ei"])
def test_a_quantity_beyond_kubernetes_is_refused_at_once(text):
    """Refused with a reason, not an OverflowError, nor after building a
    number of millions of digits (1e9999999 took 24 s)."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"is beyond the largest quantity Kubernetes holds \(2\^63-1\)"):
        check.quantity(text)
    print(f"refused in {time.monotonic() - started:.6f} s")
    assert time.monotonic() - started < 5


def test_a_quantity_has_its_value():
    assert [check.quantity(text) for text in ("4", "500m", "24Gi", "1e3", "1.5E+2", ".5k", "7E", "-2")] == \
        [4, 0.5, 24 * 2 ** 30, 1000, 150, 500, 7e18, -2]
