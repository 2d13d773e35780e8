"""Checks of k8s/ that need no cluster.

The manifests are rendered with `kubectl kustomize` as a user would submit
them, then checked against what would reject or break them on a cluster:
the Kubernetes API schemas (strict), the TFJob CRD schema and the training
operator's admission webhook, the trainer's own flag parser and cluster
resolution (fed the TF_CONFIG the operator would inject, or the indexed
Job's environment), and the Job controller's pod-failure rules. Each check
is a function returning the problems it finds, and each is shown to find
the mistake it exists for on a mutated copy.
"""

import copy
import fnmatch
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distributed_mpt import errors
from distributed_mpt.cluster import ClusterError, resolve_cluster
from distributed_mpt.config import ConfigError
from distributed_mpt.train import parse_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# In CI the repository is cloned beside a copy of shared/.
TFJOB_CRD = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "kubeflow.org_tfjobs.yaml"

VARIANTS = ("tfjob", "tfjob-chief", "indexed-job")
# 1.30 is the oldest release the indexed Job supports as written
# (backoffLimitPerIndex and podReplacementPolicy on by default since 1.29,
# podFailurePolicy since 1.26); the newest bundled one catches removals.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
TRAINER = "tensorflow"  # the container name the training operator requires
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ---------------------------------------------------------------- rendering

def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize variants cannot be rendered")
    return kubectl


def render_dir(directory: Path) -> list:
    """The documents `kubectl kustomize directory` renders."""
    result = subprocess.run([_kubectl(), "kustomize", str(directory)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.lru_cache(maxsize=None)
def _render_cached(variant: str) -> str:
    return json.dumps(render_dir(K8S / variant))


def render(variant: str) -> list:
    """A fresh (mutable) copy of a rendered variant of k8s/."""
    return json.loads(_render_cached(variant))


def read_settings(k8s_dir: Path = K8S) -> dict:
    """The values of k8s/settings, the one place they are set."""
    component = yaml.safe_load((k8s_dir / "settings" / "kustomization.yaml").read_text())
    (generator,) = [g for g in component["configMapGenerator"] if g["name"] == "distributed-mpt-settings"]
    literals = dict(item.split("=", 1) for item in generator["literals"])
    (image,) = component["images"]
    return {"workers": int(literals["workers"]), "gpus": int(literals["gpusPerWorker"]),
            "storage_class": literals["storageClass"],
            "image": f"{image['newName']}:{image['newTag']}", "placeholder_image": image["name"]}


# ---------------------------------------------------------------- accessors

def of_kind(docs, kind: str) -> list:
    return [d for d in docs if d["kind"] == kind]


def only(docs, kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def is_trainer(doc) -> bool:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "trainer"


def training_pods(docs) -> list:
    """(where, pod template) for every pod template that trains."""
    pods = []
    for tfjob in of_kind(docs, "TFJob"):
        for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items():
            pods.append((f"TFJob {tfjob['metadata']['name']} {replica_type}", spec["template"]))
    for job in of_kind(docs, "Job"):
        if is_trainer(job):
            pods.append((f"Job {job['metadata']['name']}", job["spec"]["template"]))
    return pods


def prepare_job(docs) -> dict:
    (job,) = [j for j in of_kind(docs, "Job") if not is_trainer(j)]
    return job


def all_pods(docs) -> list:
    job = prepare_job(docs)
    return training_pods(docs) + [(f"Job {job['metadata']['name']}", job["spec"]["template"])]


def container(template, name: str = TRAINER) -> dict:
    (found,) = [c for c in template["spec"]["containers"] if c["name"] == name]
    return found


def literal_env(c) -> dict:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def argv(c) -> list:
    return list(c.get("command", [])) + list(c.get("args", []))


def flag_value(c, name: str):
    values = [a.split("=", 1)[1] for a in argv(c) if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def mount_of(template, c, volume_type: str):
    """(mountPath, volume) of the container's mount of the given volume type."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    return [(m["mountPath"], volumes[m["name"]]) for m in c.get("volumeMounts", [])
            if volume_type in volumes.get(m["name"], {})]


_QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                      "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity_bytes(quantity) -> float:
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return float(number) * _QUANTITY_SUFFIXES[suffix]


def mutated(doc, mutate):
    doc = copy.deepcopy(doc)
    mutate(doc)
    return doc


# ---------------------------------------------------------------- files

def test_every_manifest_parses_and_every_variant_renders():
    files = sorted(K8S.rglob("*.yaml"))
    assert files, "k8s/ holds no manifests"
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            assert {"apiVersion", "kind"} <= set(doc), f"{path}: a document without apiVersion/kind"
    for variant in VARIANTS:
        kinds = sorted(d["kind"] for d in render(variant))
        assert {"PersistentVolumeClaim", "NetworkPolicy", "Job"} <= set(kinds), (variant, kinds)
        # The settings ConfigMap is read by kustomize, never applied.
        assert "ConfigMap" not in kinds, f"{variant} would apply the local-config settings"
    assert "TFJob" in [d["kind"] for d in render("tfjob")]
    assert "Service" in [d["kind"] for d in render("indexed-job")]


# ------------------------------------------------------- Kubernetes schemas

def _builtin(docs) -> list:
    return [d for d in docs if not d["apiVersion"].startswith("kubeflow.org/")]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_builtin_kinds_validate_strictly(variant, version):
    docs = render(variant)
    for doc in _builtin(docs):
        kubernetes_validate.validate(doc, version, strict=True)
    # The TFJob's pod templates are Kubernetes PodTemplateSpecs too; validate
    # them as strictly as the built-in kinds.
    for where, template in training_pods(docs):
        if where.startswith("TFJob"):
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                version, strict=True)


def test_strict_validation_rejects_a_misspelt_field():
    job = _indexed_job(render("indexed-job"))
    bad = mutated(job, lambda j: j["spec"]["template"]["spec"]["containers"][0].update(comand=["x"]))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)


# ---------------------------------------------------------------- TFJob CRD

def _strict_schema(schema):
    """The CRD schema with unknown fields rejected, as `kubectl apply`
    (server-side field validation, Strict by default) rejects them."""
    if isinstance(schema, list):
        return [_strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict_schema(value) for key, value in schema.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _tfjob_validator():
    if not TFJOB_CRD.exists():
        pytest.skip(f"the TFJob CRD schema is not at {TFJOB_CRD} (shared/ is not beside the repository)")
    crd = yaml.safe_load(TFJOB_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(tfjob) -> list:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _tfjob_validator().iter_errors(tfjob)]


@pytest.mark.parametrize("variant", ["tfjob", "tfjob-chief"])
def test_tfjob_validates_against_the_operator_crd(variant):
    tfjob = only(render(variant), "TFJob")
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    assert crd_errors(tfjob) == []


@pytest.mark.parametrize("mutate", [
    lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update(restartpolicy="ExitCode"),
    lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update(replicas="two"),
    lambda j: j["spec"]["runPolicy"].update(backoffLimit="10"),
    lambda j: j["spec"].pop("tfReplicaSpecs"),
], ids=["misspelt-field", "replicas-not-int", "backoff-not-int", "no-replica-specs"])
def test_crd_check_catches(mutate):
    assert crd_errors(mutated(only(render("tfjob"), "TFJob"), mutate))


# ------------------------------------------------ training operator webhook

OPERATOR_REPLICA_TYPES = ("Chief", "Master", "Worker", "PS", "Evaluator")
# MultiWorkerMirroredStrategy has no parameter servers or evaluator, and
# the trainer's cluster resolution accepts only chief and worker tasks.
TRAINER_REPLICA_TYPES = ("Chief", "Worker")
CLEAN_POD_POLICIES = ("None", "Running", "All")
MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


def webhook_errors(tfjob) -> list:
    """What the training operator's TFJob admission webhook
    (pkg/webhooks/tensorflow/tfjob_webhook.go) would reject, plus this
    trainer's own limits on replica types."""
    problems = []
    name = tfjob["metadata"].get("name", "")
    if not DNS1035_LABEL.match(name) or len(name) > 63:
        problems.append(f"name {name!r} is not a DNS-1035 label")
    specs = tfjob["spec"].get("tfReplicaSpecs") or {}
    if not specs:
        problems.append("spec.tfReplicaSpecs is required")
    if sum(t in ("Chief", "Master") for t in specs) > 1:
        problems.append("more than one Chief or Master role")
    for replica_type, spec in specs.items():
        if replica_type not in OPERATOR_REPLICA_TYPES:
            problems.append(f"replica type {replica_type} is not one of {OPERATOR_REPLICA_TYPES}")
        elif replica_type not in TRAINER_REPLICA_TYPES:
            problems.append(f"replica type {replica_type}: MultiWorkerMirroredStrategy runs only {TRAINER_REPLICA_TYPES}")
        replicas = spec.get("replicas", 1)
        if replica_type in ("Chief", "Master") and replicas > 1:
            problems.append(f"{replica_type} has {replicas} replicas; at most one chief")
        if replicas < 1:
            problems.append(f"{replica_type} has {replicas} replicas")
        containers = spec.get("template", {}).get("spec", {}).get("containers") or []
        if not containers:
            problems.append(f"{replica_type}: no containers")
        if any(not c.get("image") for c in containers):
            problems.append(f"{replica_type}: a container without an image")
        if TRAINER not in [c.get("name") for c in containers]:
            problems.append(f"{replica_type}: no container named {TRAINER}")
        # The operator names each pod and Service <name>-<type>-<index>.
        longest = f"{name}-{replica_type.lower()}-{max(replicas - 1, 0)}"
        if not DNS1035_LABEL.match(longest) or len(longest) > 63:
            problems.append(f"service name {longest!r} is not a DNS-1035 label of at most 63 characters")
    run_policy = tfjob["spec"].get("runPolicy", {})
    if run_policy.get("cleanPodPolicy", "None") not in CLEAN_POD_POLICIES:
        problems.append(f"cleanPodPolicy {run_policy['cleanPodPolicy']!r} is not one of {CLEAN_POD_POLICIES}")
    for field in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        if run_policy.get(field, 0) < 0:
            problems.append(f"runPolicy.{field} must be >= 0")
    if run_policy.get("managedBy", MANAGED_BY[0]) not in MANAGED_BY:
        problems.append(f"runPolicy.managedBy {run_policy['managedBy']!r} is not supported")
    return problems


@pytest.mark.parametrize("variant", ["tfjob", "tfjob-chief"])
def test_tfjob_passes_the_operator_webhook(variant):
    assert webhook_errors(only(render(variant), "TFJob")) == []


def _copy_replica(source: str, target: str, replicas=None):
    def mutate(job):
        specs = job["spec"]["tfReplicaSpecs"]
        specs[target] = copy.deepcopy(specs[source])
        if replicas is not None:
            specs[target]["replicas"] = replicas
    return mutate


def _rename_trainer(job):
    job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"


@pytest.mark.parametrize("variant,mutate", [
    ("tfjob", lambda j: j["metadata"].update(name="CIFAR10")),
    ("tfjob", lambda j: j["metadata"].update(name="10-cifar")),
    ("tfjob", lambda j: j["metadata"].update(name="c" * 50)),  # c..c-worker-1 is 59: fine ...
    ("tfjob", lambda j: j["metadata"].update(name="c" * 55)),  # ... c..c-worker-1 is 64: too long
    ("tfjob", _copy_replica("Worker", "PS")),
    ("tfjob", _copy_replica("Worker", "Evaluator")),
    ("tfjob", _copy_replica("Worker", "Trainer")),
    ("tfjob", _rename_trainer),
    ("tfjob", lambda j: j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("image")),
    ("tfjob", lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Always")),
    ("tfjob", lambda j: j["spec"]["runPolicy"].update(backoffLimit=-1)),
    ("tfjob-chief", lambda j: j["spec"]["tfReplicaSpecs"]["Chief"].update(replicas=2)),
    ("tfjob-chief", _copy_replica("Chief", "Master")),
], ids=["uppercase-name", "digit-first-name", "long-name-ok", "name-too-long", "ps", "evaluator",
        "unknown-type", "no-tensorflow-container", "no-image", "bad-clean-pod-policy",
        "negative-backoff", "two-chief-replicas", "chief-and-master"])
def test_webhook_check_catches(request, variant, mutate):
    problems = webhook_errors(mutated(only(render(variant), "TFJob"), mutate))
    if request.node.callspec.id.startswith("long-name-ok"):
        assert problems == []
    else:
        assert problems


# ------------------------------------------------------ restarts and exits

def operator_retries(restart_policy: str, exit_code: int) -> bool:
    """Whether the training operator recreates a pod that exited so
    (restartPolicy ExitCode: 1-127 permanent, 128-255 retryable)."""
    assert restart_policy == "ExitCode", "only the ExitCode policy tells permanent from retryable exits"
    return exit_code >= 128


PERMANENT = (errors.EXIT_USAGE, errors.EXIT_DIVERGED)
RETRYABLE = (errors.EXIT_PREEMPTED, errors.EXIT_PEER_TIMEOUT, errors.EXIT_PEER_LOST,
             137)  # 137: SIGKILL, OOM kill


@pytest.mark.parametrize("variant", ["tfjob", "tfjob-chief"])
def test_tfjob_restarts_preempted_workers_and_stops_on_bad_input(variant):
    tfjob = only(render(variant), "TFJob")
    for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        policy = spec.get("restartPolicy")
        assert policy == "ExitCode", f"{replica_type}: restartPolicy {policy}"
        for code in PERMANENT:
            assert not operator_retries(policy, code), f"exit {code} would be retried forever"
        for code in RETRYABLE:
            assert operator_retries(policy, code), f"exit {code} would end the job"
    run_policy = tfjob["spec"]["runPolicy"]
    # Pods still running when the job ends hold GPUs: remove them.
    assert run_policy["cleanPodPolicy"] in ("Running", "All")
    assert run_policy["backoffLimit"] >= 1
    # The operator does not count ExitCode recreations against backoffLimit;
    # only a deadline bounds a restart loop.
    assert run_policy["activeDeadlineSeconds"] > 0


def job_failure_action(job, exit_code: int, conditions=()) -> str:
    """What the Job controller does when a pod of `job` fails with
    exit_code in the trainer container: the first matching podFailurePolicy
    rule's action, or 'Count' (retried while the backoff budget lasts)."""
    containers = {c["name"] for c in job["spec"]["template"]["spec"]["containers"]}
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        on_exit = rule.get("onExitCodes")
        if on_exit and on_exit.get("containerName", TRAINER) == TRAINER and TRAINER in containers:
            listed = exit_code in on_exit["values"]
            if listed == (on_exit["operator"] == "In"):
                return rule["action"]
        for pattern in rule.get("onPodConditions", []):
            if pattern["type"] in conditions and pattern.get("status", "True") == "True":
                return rule["action"]
    return "Count"


def _indexed_job(docs):
    (job,) = [j for j in of_kind(docs, "Job") if is_trainer(j)]
    return job


def failure_policy_problems(job) -> list:
    """Exit codes the indexed Job would treat wrongly."""
    problems = []
    spec = job["spec"]
    if spec["template"]["spec"].get("restartPolicy") != "Never":
        problems.append("a podFailurePolicy needs restartPolicy Never")
    if spec.get("backoffLimitPerIndex", spec.get("backoffLimit", 6)) < 1:
        problems.append("no retries at all")
    for code in PERMANENT:
        if job_failure_action(job, code) != "FailJob":
            problems.append(f"exit {code} (permanent) would be retried")
    for code in RETRYABLE:
        if job_failure_action(job, code) not in ("Count", "Ignore"):
            problems.append(f"exit {code} (retryable) would end the job")
    # A preempted or evicted pod is retried without using up the budget.
    if job_failure_action(job, errors.EXIT_PREEMPTED, {"DisruptionTarget"}) != "Ignore":
        problems.append("a preempted pod uses up the retry budget")
    return problems


def test_indexed_job_fails_on_bad_input_and_retries_preemption():
    assert failure_policy_problems(_indexed_job(render("indexed-job"))) == []


def _rule(index, **changes):
    """Change the exit-code pattern (rule 0) or the pod-condition pattern (rule 1)."""
    def mutate(job):
        rule = job["spec"]["podFailurePolicy"]["rules"][index]
        (rule["onExitCodes"] if "onExitCodes" in rule else rule["onPodConditions"][0]).update(**changes)
    return mutate


@pytest.mark.parametrize("mutate", [
    _rule(0, containerName="trainer"),
    _rule(0, values=[1]),
    _rule(0, operator="NotIn", values=[0, 143]),
    _rule(1, type="ConfigIssue"),
    lambda j: j["spec"].update(backoffLimitPerIndex=0),
    lambda j: j["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
], ids=["wrong-container", "code-2-not-listed", "fails-on-137", "disruption-counted", "no-retries",
        "restart-in-place"])
def test_failure_policy_check_catches(mutate):
    assert failure_policy_problems(mutated(_indexed_job(render("indexed-job")), mutate))


# ------------------------------------------------------- the trainer's view

@pytest.mark.parametrize("variant", VARIANTS)
def test_training_flags_are_accepted_by_the_trainer(variant):
    docs = render(variant)
    data_dir = flag_value(container(prepare_job(docs)["spec"]["template"], "prepare-data"), "data_dir")
    for where, template in training_pods(docs):
        trainer = container(template)
        command = argv(trainer)
        assert command[0] == "distributed-mpt-train", where
        config = parse_config(command[1:])
        assert config.strategy == "multi_worker", where
        assert config.download is False, f"{where} would download: pass --nodownload"
        assert config.data_dir == data_dir, f"{where} reads {config.data_dir}, the data is prepared in {data_dir}"
        (data_mount, _), = mount_of(template, trainer, "persistentVolumeClaim")
        assert config.model_dir.startswith(data_mount + "/"), f"{where}: --model_dir is not on the shared volume"


def test_the_flag_check_rejects_bad_flags():
    flags = argv(container(_indexed_job(render("indexed-job"))["spec"]["template"]))[1:]
    for bad in (["--no_such_flag=1"], ["--strategy=parameter_server"], ["--per_replica_batch_size=0"]):
        with pytest.raises(ConfigError):
            parse_config(flags + bad)


def operator_tf_config(tfjob, namespace: str, replica_type: str, index: int) -> str:
    """The TF_CONFIG the training operator injects into one pod
    (pkg/controller.v1/tensorflow/tensorflow.go, genTFConfigJSONStr)."""
    name = tfjob["metadata"]["name"]
    cluster = {}
    for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        if rtype == "Evaluator":  # not part of the training cluster
            continue
        ports = [p["containerPort"] for c in spec["template"]["spec"]["containers"] if c["name"] == TRAINER
                 for p in c.get("ports", []) if p.get("name") == "tfjob-port"]
        port = ports[0] if ports else 2222
        cluster[rtype.lower()] = [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}"
                                  for i in range(spec.get("replicas", 1))]
    return json.dumps({"cluster": cluster, "task": {"type": replica_type.lower(), "index": index},
                       "environment": "cloud"})


@pytest.mark.parametrize("variant", ["tfjob", "tfjob-chief"])
def test_tf_config_from_the_operator_resolves_to_the_right_cluster(variant):
    tfjob = only(render(variant), "TFJob")
    name, namespace = tfjob["metadata"]["name"], "ml-team"
    specs = tfjob["spec"]["tfReplicaSpecs"]
    chiefs = [f"{name}-chief-{i}.{namespace}.svc:2222" for i in range(specs.get("Chief", {}).get("replicas", 0))]
    workers = [f"{name}-worker-{i}.{namespace}.svc:2222" for i in range(specs["Worker"]["replicas"])]
    expected = tuple(chiefs + workers)
    assert len(expected) == read_settings()["workers"] + len(chiefs)
    for replica_type, spec in specs.items():
        for index in range(spec["replicas"]):
            environ = literal_env(container(spec["template"]))
            environ["TF_CONFIG"] = operator_tf_config(tfjob, namespace, replica_type, index)
            cluster = resolve_cluster(environ)
            assert (cluster.task_type, cluster.task_index) == (replica_type.lower(), index)
            assert cluster.addresses == expected
            assert cluster.chief_address == expected[0]
            own = f"{name}-{replica_type.lower()}-{index}.{namespace}.svc:2222"
            assert cluster.is_chief == (own == expected[0])


def indexed_job_problems(docs) -> list:
    """Why the pods of the indexed Job would not find each other."""
    problems = []
    job = _indexed_job(docs)
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    environ = literal_env(container(spec["template"]))
    if spec.get("completionMode") != "Indexed":
        problems.append("completionMode is not Indexed: pods get no JOB_COMPLETION_INDEX")
    if spec.get("completions") != spec.get("parallelism"):
        problems.append("completions != parallelism: MWMS needs every worker running at once")
    if environ.get("DMPT_NUM_WORKERS") != str(spec.get("completions")):
        problems.append(f"DMPT_NUM_WORKERS={environ.get('DMPT_NUM_WORKERS')} but completions={spec.get('completions')}")
    if environ.get("DMPT_JOB_NAME") != name:
        problems.append(f"DMPT_JOB_NAME={environ.get('DMPT_JOB_NAME')} but the Job is {name}")
    subdomain = pod.get("subdomain")
    if environ.get("DMPT_SERVICE_NAME") != subdomain:
        problems.append(f"DMPT_SERVICE_NAME={environ.get('DMPT_SERVICE_NAME')} but subdomain={subdomain}")
    services = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == subdomain]
    if not services:
        return problems + [f"no Service named after the subdomain {subdomain!r}"]
    service = services[0]["spec"]
    if service.get("clusterIP") != "None":
        problems.append("the Service is not headless (clusterIP: None): pods get no DNS records")
    if service.get("publishNotReadyAddresses") is not True:
        problems.append("publishNotReadyAddresses is not true: peers do not resolve before they are ready")
    labels = spec["template"]["metadata"].get("labels", {})
    if not service.get("selector") or any(labels.get(k) != v for k, v in service["selector"].items()):
        problems.append("the Service does not select the Job's pods")
    port = int(environ.get("DMPT_PORT", 2222))
    if port not in [p["containerPort"] for p in container(spec["template"]).get("ports", [])]:
        problems.append(f"the trainer container does not declare port {port}")
    if port not in [p.get("targetPort", p["port"]) for p in service.get("ports", [])]:
        problems.append(f"the Service does not cover port {port}")
    hostname = f"{name}-{max(spec.get('completions', 1) - 1, 0)}"
    if not DNS1123_LABEL.match(hostname) or len(hostname) > 63:
        problems.append(f"pod hostname {hostname!r} is not a DNS label")
    if not DNS1035_LABEL.match(subdomain or "") or len(subdomain) > 63:
        problems.append(f"Service name {subdomain!r} is not a DNS-1035 label")
    return problems


def test_indexed_job_pods_find_each_other():
    docs = render("indexed-job")
    assert indexed_job_problems(docs) == []
    job = _indexed_job(docs)
    name, service = job["metadata"]["name"], job["spec"]["template"]["spec"]["subdomain"]
    workers = job["spec"]["completions"]
    assert workers == read_settings()["workers"]
    expected = tuple(f"{name}-{i}.{service}:2222" for i in range(workers))
    base_env = literal_env(container(job["spec"]["template"]))
    for index in range(workers):
        cluster = resolve_cluster({**base_env, "JOB_COMPLETION_INDEX": str(index)})
        assert (cluster.task_type, cluster.task_index) == ("worker", index)
        assert cluster.addresses == expected
        assert cluster.chief_address == expected[0]
        assert cluster.is_chief == (index == 0)
    with pytest.raises(ClusterError):  # an index the Job never hands out
        resolve_cluster({**base_env, "JOB_COMPLETION_INDEX": str(workers)})


def _job_env(name, value):
    def mutate(docs):
        env = _indexed_job(docs)["spec"]["template"]["spec"]["containers"][0]["env"]
        next(e for e in env if e["name"] == name)["value"] = value
    return mutate


def _service(mutate_spec):
    return lambda docs: mutate_spec(only(docs, "Service")["spec"])


@pytest.mark.parametrize("mutate", [
    _job_env("DMPT_NUM_WORKERS", "3"),
    _job_env("DMPT_JOB_NAME", "cifar10"),
    _job_env("DMPT_SERVICE_NAME", "workers"),
    lambda docs: _indexed_job(docs)["spec"]["template"]["spec"].update(subdomain="other"),
    lambda docs: _indexed_job(docs)["spec"].update(parallelism=1),
    lambda docs: _indexed_job(docs)["spec"].pop("completionMode"),
    _service(lambda s: s.pop("clusterIP")),
    _service(lambda s: s.update(publishNotReadyAddresses=False)),
    _service(lambda s: s["selector"].update({"app.kubernetes.io/instance": "other"})),
    _service(lambda s: s["ports"][0].update(targetPort=2223)),
], ids=["num-workers", "job-name", "service-name", "subdomain", "parallelism", "not-indexed",
        "not-headless", "not-ready-hidden", "selector", "port"])
def test_indexed_job_check_catches(mutate):
    docs = render("indexed-job")
    mutate(docs)
    assert indexed_job_problems(docs)


# ----------------------------------------------------- pods, volumes, GPUs

def security_problems(template) -> list:
    """Hardening every container must have."""
    problems = []
    pod = template["spec"].get("securityContext", {})
    if template["spec"].get("automountServiceAccountToken") is not False:
        problems.append("the pod mounts a service-account token it never uses")
    for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
        own = c.get("securityContext", {})
        setting = lambda key: own.get(key, pod.get(key))  # noqa: E731  (container overrides pod)
        if own.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation is not false")
        if "ALL" not in own.get("capabilities", {}).get("drop", []):
            problems.append(f"{c['name']}: capabilities are not all dropped")
        if setting("runAsNonRoot") is not True:
            problems.append(f"{c['name']}: runAsNonRoot is not true")
        if not isinstance(setting("runAsUser"), int) or setting("runAsUser") <= 0:
            problems.append(f"{c['name']}: runAsUser is not a numeric non-root UID")
        if (setting("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{c['name']}: seccompProfile is not RuntimeDefault")
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_is_hardened(variant):
    for where, template in all_pods(render(variant)):
        assert security_problems(template) == [], where


@pytest.mark.parametrize("mutate", [
    lambda c: c["securityContext"].update(allowPrivilegeEscalation=True),
    lambda c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
    lambda c: c["securityContext"].update(runAsUser=0),
    lambda c: c["securityContext"].update(runAsNonRoot=False),
    lambda c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}),
], ids=["privilege-escalation", "capabilities", "root", "non-root-off", "seccomp"])
def test_security_check_catches(mutate):
    (_, template), *_ = training_pods(render("tfjob"))
    mutate(template["spec"]["containers"][0])
    assert security_problems(template)


def test_security_check_catches_a_mounted_token():
    (_, template), *_ = training_pods(render("tfjob"))
    del template["spec"]["automountServiceAccountToken"]
    assert security_problems(template) == ["the pod mounts a service-account token it never uses"]


def settings_problems(docs, settings) -> list:
    """Where a rendered variant disagrees with k8s/settings."""
    problems = []
    for where, template in all_pods(docs):
        for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            if c["image"] != settings["image"]:
                problems.append(f"{where} {c['name']}: image {c['image']}, settings say {settings['image']}")
    for where, template in training_pods(docs):
        gpus = container(template).get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpus is None or int(gpus) != settings["gpus"]:
            problems.append(f"{where}: nvidia.com/gpu {gpus}, settings say {settings['gpus']}")
    for tfjob in of_kind(docs, "TFJob"):
        if tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] != settings["workers"]:
            problems.append("TFJob Worker replicas differ from settings")
    for job in [j for j in of_kind(docs, "Job") if is_trainer(j)]:
        env = literal_env(container(job["spec"]["template"]))
        found = (job["spec"]["completions"], job["spec"]["parallelism"], env.get("DMPT_NUM_WORKERS"))
        if found != (settings["workers"], settings["workers"], str(settings["workers"])):
            problems.append(f"Job completions/parallelism/DMPT_NUM_WORKERS {found}, settings say {settings['workers']}")
    for claim in of_kind(docs, "PersistentVolumeClaim"):
        if claim["spec"].get("storageClassName") != settings["storage_class"]:
            problems.append(f"PVC storage class {claim['spec'].get('storageClassName')}")
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_follow_the_settings(variant):
    settings = read_settings()
    docs = render(variant)
    assert settings_problems(docs, settings) == []
    assert settings["image"] != settings["placeholder_image"]


def test_settings_are_set_in_one_place(tmp_path):
    """Changing k8s/settings alone changes every variant consistently."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    path = k8s / "settings" / "kustomization.yaml"
    text = path.read_text()
    for old, new in (("workers=2", "workers=5"), ("gpusPerWorker=1", "gpusPerWorker=4"),
                     ("storageClass=nfs-client", "storageClass=cephfs"),
                     ("newTag: \"0.1.0\"", "newTag: \"0.2.0\"")):
        # Guard the edit itself, so that a reworded settings file is noticed here.
        assert old in text, f"k8s/settings/kustomization.yaml no longer has {old!r}"
        text = text.replace(old, new)
    path.write_text(text)
    settings = read_settings(k8s)
    assert (settings["workers"], settings["gpus"], settings["storage_class"]) == (5, 4, "cephfs")
    for variant in VARIANTS:
        docs = render_dir(k8s / variant)
        assert settings_problems(docs, settings) == [], variant
    assert settings_problems(render("tfjob"), settings), "the check cannot tell the settings apart"


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_pods_have_gpus_shm_and_the_shared_volume(variant):
    docs = render(variant)
    claims = {c["metadata"]["name"]: c for c in of_kind(docs, "PersistentVolumeClaim")}
    for where, template in all_pods(docs):
        c = template["spec"]["containers"][0]
        (mount, volume), = mount_of(template, c, "persistentVolumeClaim")
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every worker mounts the same volume"
        assert mount == "/data", where
    gpu_limits = set()
    for where, template in training_pods(docs):
        trainer = container(template)
        gpu_limits.add(int(trainer["resources"]["limits"]["nvidia.com/gpu"]))
        (shm_path, shm), = mount_of(template, trainer, "emptyDir")
        assert shm_path == "/dev/shm", where
        assert shm["emptyDir"].get("medium") == "Memory", where
        assert quantity_bytes(shm["emptyDir"]["sizeLimit"]) >= 2**30, f"{where}: /dev/shm too small for NCCL"
        # The memory-backed /dev/shm counts against the memory limit.
        assert quantity_bytes(trainer["resources"]["limits"]["memory"]) > quantity_bytes(shm["emptyDir"]["sizeLimit"])
        if where.startswith("TFJob"):
            assert {"name": "tfjob-port", "containerPort": 2222} in [
                {k: p[k] for k in ("name", "containerPort")} for p in trainer["ports"]], where
    assert len(gpu_limits) == 1, f"workers differ in GPUs: {gpu_limits}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_data_is_prepared_once_and_workers_wait_for_it(variant):
    docs = render(variant)
    prepare = prepare_job(docs)
    command = argv(container(prepare["spec"]["template"], "prepare-data"))
    assert command == ["distributed-mpt-prepare-data", "--data_dir=/data/tfds"]
    assert prepare["spec"].get("completions", 1) == 1 and prepare["spec"].get("parallelism", 1) == 1
    for where, template in training_pods(docs):
        (wait,) = template["spec"]["initContainers"]
        script = " ".join(argv(wait))
        (pattern,) = re.findall(r"(/\S+/dataset_info\.json)", script)
        # TFDS writes into cifar10/incomplete.<id>_<version>/ and renames it
        # to cifar10/<version>/ only when the dataset is complete.
        assert fnmatch.fnmatch("/data/tfds/cifar10/3.0.2/dataset_info.json", pattern), where
        assert not fnmatch.fnmatch("/data/tfds/cifar10/incomplete.0a1b_3.0.2/dataset_info.json", pattern), where


def networkpolicy_problems(docs) -> list:
    """Whether exactly the training job's pods may reach the workers."""
    problems = []
    policies = of_kind(docs, "NetworkPolicy")
    selects = lambda selector, labels: (  # noqa: E731
        not selector.get("matchExpressions")
        and all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()))
    trainer_labels = [t["metadata"].get("labels", {}) for _, t in training_pods(docs)]
    prepare_labels = prepare_job(docs)["spec"]["template"]["metadata"].get("labels", {})
    for where, template in training_pods(docs):
        labels = template["metadata"].get("labels", {})
        governing = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                     and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        if not governing:
            problems.append(f"{where}: no NetworkPolicy isolates it")
            continue
        rules = [r for p in governing for r in p["spec"].get("ingress", [])]
        for rule in rules:
            peers = rule.get("from", [])
            if not peers:
                problems.append(f"{where}: an ingress rule admits every source")
            for peer in peers:
                if set(peer) != {"podSelector"}:
                    problems.append(f"{where}: an ingress peer other than a pod of the namespace: {peer}")
                elif selects(peer["podSelector"], prepare_labels) or not peer["podSelector"].get("matchLabels"):
                    problems.append(f"{where}: pods other than the trainers may connect")
        admits_trainers = [r for r in rules if any(
            set(peer) == {"podSelector"} and all(selects(peer["podSelector"], other) for other in trainer_labels)
            for peer in r.get("from", []))]
        if not any(not r.get("ports") or any(p.get("port") == 2222 for p in r["ports"]) for r in admits_trainers):
            problems.append(f"{where}: the other workers cannot reach port 2222")
        if flag_value(container(template), "communication") == "nccl" and not any(
                not r.get("ports") for r in admits_trainers):
            problems.append(f"{where}: NCCL connects on ephemeral ports, which the policy closes")
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_job_reaches_the_workers(variant):
    assert networkpolicy_problems(render(variant)) == []


def _policy(mutate_spec):
    return lambda docs: mutate_spec(only(docs, "NetworkPolicy")["spec"])


@pytest.mark.parametrize("mutate", [
    _policy(lambda s: s["ingress"].append({})),
    _policy(lambda s: s["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})),
    _policy(lambda s: s["ingress"][0]["from"].append({"namespaceSelector": {}})),
    _policy(lambda s: s["ingress"][0]["from"][0]["podSelector"].update(matchLabels={"app.kubernetes.io/name": "distributed-mpt"})),
    _policy(lambda s: s["ingress"][0].update(ports=[{"port": 6006, "protocol": "TCP"}])),
    _policy(lambda s: s["ingress"][0].update(ports=[{"port": 2222, "protocol": "TCP"}])),
    _policy(lambda s: s["podSelector"]["matchLabels"].update({"app.kubernetes.io/component": "server"})),
], ids=["allow-all-rule", "ip-block", "any-namespace", "prepare-job-admitted", "port-2222-closed",
    "nccl-ports-closed", "not-selected"])
def test_networkpolicy_check_catches(mutate):
    docs = render("tfjob")
    mutate(docs)
    assert networkpolicy_problems(docs)


# ---------------------------------------------------------- image and docs

def test_dockerfile_builds_a_pinned_non_root_image_of_this_package():
    dockerfile = (K8S / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    (base_arg,) = [line for line in lines if line.startswith("ARG TF_IMAGE=")]
    base = base_arg.split("=", 1)[1]
    match = re.fullmatch(r"tensorflow/tensorflow:(\d+)\.(\d+)\.(\d+)-gpu", base)
    assert match, f"base image {base} is not a pinned official TensorFlow GPU tag"
    # Keras 3 (TensorFlow 2.16+) is what the package is written for.
    assert tuple(map(int, match.group(1, 2))) >= (2, 16), f"{base} predates Keras 3"
    assert "FROM ${TF_IMAGE}" in lines
    copied = " ".join(line for line in lines if line.startswith("COPY"))
    for needed in ("setup.py", "README.md", "distributed_mpt/"):
        assert needed in copied, f"the Dockerfile does not COPY {needed}"
        assert (REPO / needed).exists(), f"the Dockerfile copies {needed}, which the repository lacks"
    assert re.search(r"pip install /src\b", dockerfile)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users, "the image runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1]} is not a numeric non-root UID"
    for variant in VARIANTS:
        for where, template in all_pods(render(variant)):
            assert template["spec"]["securityContext"]["runAsUser"] == int(uid), where


def test_readme_names_only_paths_and_variants_that_exist():
    readme = (K8S / "README.md").read_text()
    for path in set(re.findall(r"\bk8s/[\w./-]*[\w-]", readme)):
        assert (REPO / path).exists(), f"k8s/README.md names {path}, which does not exist"
    applied = set(re.findall(r"kubectl (?:apply|delete|kustomize)[^\n]*?-k\s+k8s/([\w-]+)", readme))
    assert applied and applied <= set(VARIANTS), applied
    assert "tensorboard" in readme.lower()
