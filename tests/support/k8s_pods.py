"""The rendered k8s/ variants, and the pods their controllers would make of
them: each pod's hostname, the DNS names that reach it, its command, the
environment it gets, and whether the manifest's failure policy retries an
exit code. Shared by tests/k8s/test_k8s.py (offline checks) and
tests/k8s/test_k8s_pods.py (the pods run as processes); and edited copies of
k8s/, as a user edits k8s/settings.

Only what a controller hands a pod is modelled here, from the controllers'
sources: the Job controller's hostname
`<job>-<index>` and JOB_COMPLETION_INDEX, JobSet's names, labels and
coordinator annotation (kubernetes-sigs/jobset v0.12, constructJob and
labelAndAnnotateObject), Trainer v2's merge of a TrainJob into its runtime
(kubeflow/trainer v2.3, jobset builder and the plainml plugin), and the
kubelet's HOSTNAME.
"""

import copy
import dataclasses
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
VARIANTS = ("indexed-job", "jobset", "trainjob")
TRAINING_KINDS = ("JobSet", "TrainJob")


@functools.lru_cache(maxsize=None)
def _render_text(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        import pytest
        pytest.skip("kubectl is not installed: the kustomize variants cannot be rendered")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return json.dumps([doc for doc in yaml.safe_load_all(result.stdout) if doc])


def render(variant: str, k8s: Path = K8S) -> list:
    """The documents `kubectl kustomize k8s/<variant>` renders (a fresh copy)."""
    return json.loads(_render_text(k8s / variant))


def of_kind(docs, kind: str) -> list:
    return [d for d in docs if d["kind"] == kind]


def training_job(docs) -> dict:
    """The object submitted to train: JobSet, TrainJob, or the indexed Job."""
    (job,) = [d for d in docs if d["kind"] in TRAINING_KINDS] or \
        [j for j in of_kind(docs, "Job") if j["spec"].get("completionMode")]
    return job


@dataclasses.dataclass
class Pod:
    """A training pod as its controllers make it."""

    hostname: str
    names: List[str]          # DNS names that reach it, the hostname first
    command: List[str]        # the container's command and args
    env: Dict[str, str]       # the manifest's env with what the controllers add
    retried: Callable[[int], bool]  # does the job's failure policy retry this exit code?


def training_pods(docs) -> List[Pod]:
    """Every training pod of the rendered variant `docs`."""
    job = training_job(docs)
    if job["kind"] == "TrainJob":
        (runtime,) = [r for r in of_kind(docs, job["spec"]["runtimeRef"]["kind"])
                      if r["metadata"]["name"] == job["spec"]["runtimeRef"]["name"]]
        return _jobset_pods(_trainer_jobset(job, runtime))
    if job["kind"] == "JobSet":
        return _jobset_pods(job)
    return _indexed_job_pods(job)


def main_container(pod_spec) -> dict:
    """The training container, `node` (the name Trainer v2 looks for)."""
    (container,) = [c for c in pod_spec["containers"] if c["name"] == "node"]
    return container


def _env(container, labels=None, annotations=None) -> Dict[str, str]:
    """The container's env as the kubelet sets it, the downward API's
    label and annotation references resolved ("" when absent)."""
    metadata = {"labels": labels or {}, "annotations": annotations or {}}
    env = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            where, key = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path).groups()
            env[variable["name"]] = metadata[where].get(key, "")
    return env


def _command(container) -> List[str]:
    return container.get("command", []) + container.get("args", [])


def _pod_failure_action(job_spec, container_name: str, exit_code: int):
    """The action of the first podFailurePolicy rule that matches the exit code."""
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and codes.get("containerName", container_name) == container_name:
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return rule["action"]
    return None


# ------------------------------------------------------------ indexed Job

def _indexed_job_pods(job) -> List[Pod]:
    name, spec = job["metadata"]["name"], job["spec"]
    container = main_container(spec["template"]["spec"])

    def retried(code):
        # FailJob ends the job; any other failure is retried while the
        # index has budget left.
        return _pod_failure_action(spec, container["name"], code) != "FailJob" and spec["backoffLimitPerIndex"] > 0

    subdomain = spec["template"]["spec"].get("subdomain")
    return [Pod(f"{name}-{i}", [f"{name}-{i}"] + ([f"{name}-{i}.{subdomain}"] if subdomain else []),
                _command(container), {**_env(container), "JOB_COMPLETION_INDEX": str(i)}, retried)
            for i in range(spec["completions"])]


# ----------------------------------------------------------------- JobSet

def _jobset_pods(jobset) -> List[Pod]:
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    # JobSet's webhook defaults: DNS hostnames on, the subdomain the JobSet's name.
    network = spec.get("network", {})
    if network.get("enableDNSHostnames") is False:
        return []  # no pod could resolve another
    subdomain = network.get("subdomain") or name
    annotations = {}
    if "coordinator" in spec:
        c = spec["coordinator"]
        annotations["jobset.sigs.k8s.io/coordinator"] = \
            f"{name}-{c['replicatedJob']}-{c.get('jobIndex', 0)}-{c.get('podIndex', 0)}.{subdomain}"
    failure_policy = spec.get("failurePolicy", {})
    pods = []
    for replicated_job in spec["replicatedJobs"]:
        job_spec = replicated_job["template"]["spec"]
        pod_spec = job_spec["template"]["spec"]
        container = main_container(pod_spec)

        def retried(code, job_spec=job_spec, container=container):
            # A FailJob rule fails the Job with reason PodFailurePolicy; any
            # other failure beyond backoffLimit with BackoffLimitExceeded.
            failed = _pod_failure_action(job_spec, container["name"], code) == "FailJob"
            reason = "PodFailurePolicy" if failed else "BackoffLimitExceeded"
            for rule in failure_policy.get("rules", []):
                if reason in rule.get("onJobFailureReasons", [reason]):
                    return rule["action"] != "FailJobSet"
            return failure_policy.get("maxRestarts", 0) > 0

        for job_index in range(replicated_job.get("replicas", 1)):
            labels = {**job_spec["template"].get("metadata", {}).get("labels", {}),
                      "jobset.sigs.k8s.io/jobset-name": name,
                      "jobset.sigs.k8s.io/replicatedjob-name": replicated_job["name"],
                      "jobset.sigs.k8s.io/job-index": str(job_index)}
            for pod_index in range(job_spec.get("completions", 1)):
                hostname = f"{name}-{replicated_job['name']}-{job_index}-{pod_index}"
                env = {**_env(container, labels, annotations), "JOB_COMPLETION_INDEX": str(pod_index)}
                pods.append(Pod(hostname, [hostname, f"{hostname}.{subdomain}"], _command(container), env,
                                retried))
    return pods


def _trainer_jobset(trainjob, runtime) -> dict:
    """The JobSet Trainer v2 makes of a TrainJob on a plainml runtime: the
    runtime's template named after the TrainJob, with the TrainJob's node
    count as the trainer Job's parallelism and completions, and its image,
    command, args (replacing the runtime's) and env (added) on the `node`
    container."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    trainer = trainjob["spec"].get("trainer", {})
    for replicated_job in spec["replicatedJobs"]:
        labels = replicated_job["template"].get("metadata", {}).get("labels", {})
        if labels.get("trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
            continue
        replicated_job["replicas"] = 1
        job_spec = replicated_job["template"]["spec"]
        job_spec["parallelism"] = job_spec["completions"] = \
            trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
        container = next(c for c in job_spec["template"]["spec"]["containers"] if c["name"] == "node")
        for field in ("image", "command", "args"):
            if field in trainer:
                container[field] = trainer[field]
        overrides = {e["name"] for e in trainer.get("env", [])}
        container["env"] = [e for e in container.get("env", []) if e["name"] not in overrides] + \
            trainer.get("env", [])
    return {"kind": "JobSet", "metadata": {"name": trainjob["metadata"]["name"]}, "spec": spec}


# ---------------------------------------------------- edited copies of k8s/

def load_check():
    """k8s/check.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("k8s_check", K8S / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(*args, k8s: Path = K8S) -> subprocess.CompletedProcess:
    """Runs k8s/check.py as a user does. The bound only ends a hung run: on a
    2-core machine shared with other work, a full check took 6 minutes."""
    return subprocess.run([sys.executable, str(k8s / "check.py"), *args], capture_output=True, text=True,
                          timeout=1200)


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


def edit_settings(k8s: Path, pod=None, **values) -> None:
    """Sets values of k8s/settings/settings.yaml's spec in the copy at `k8s`
    (a dict is merged), merges `pod` into its template's spec, and removes
    its GPUs: whatever the settings were, as a user edits them."""
    path = k8s / "settings" / "settings.yaml"
    document = yaml.safe_load(path.read_text())
    spec, template = document["spec"], document["template"]["spec"]
    for bound in template["containers"][0]["resources"].values():
        for resource in [r for r in bound if r.endswith("/gpu")]:
            del bound[resource]
    for key, value in values.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    template.update(pod or {})
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def edit_kustomization(k8s: Path, queue: bool, topology, **values) -> None:
    """Sets the namespace or image of k8s/settings/kustomization.yaml in the
    copy at `k8s`, and turns the Kueue queue on or off, and the topology
    request off (None) or on at a level (the shipped placeholder: "")."""
    path = k8s / "settings" / "kustomization.yaml"
    for block, wanted in (("labels:", queue), ("transformers:", topology is not None)):
        if wanted:
            uncomment(path, block)
    if topology:
        edit(path, {"topology.example.com/block": topology})
    kustomization = yaml.safe_load(path.read_text())
    for block, wanted in (("labels", queue), ("transformers", topology is not None)):
        if not wanted:
            kustomization.pop(block, None)
    kustomization.update(values)
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))
