#!/usr/bin/env python3
"""Checks k8s/ as you edited it, without a cluster.

    python k8s/check.py                   # every variant, and k8s/volume
    python k8s/check.py jobset trainjob   # those
    python k8s/check.py SETTINGS_DIR      # every variant, with the settings in
                                          # SETTINGS_DIR (an edited copy of k8s/settings)

Renders each variant as `kubectl apply -k` does (`kubectl kustomize`), and
gives it to what a cluster would check it with: the Kubernetes schemas,
strictly, as `kubectl apply` rejects unknown fields (kubernetes-validate);
the CRDs carried in k8s/schemas/ for the custom kinds (jsonschema); the
trainer's own flag parser for every training command. Then it names the
settings that did not arrive where they must, or contradict each other.

Prints one `error:` line per problem and exits 2 if there is one; `warning:`
lines say what is likely not what you meant, `note:` lines what follows
from the settings. Exit 0: nothing is wrong. Needs kubectl 1.27+ (its
kustomize) and PyYAML, kubernetes-validate and jsonschema
(pip install -e '.[k8s]', or those three alone).
"""

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

K8S = Path(__file__).resolve().parent
VARIANTS = ("trainjob", "jobset", "jobset-chief", "tfjob", "tfjob-chief", "indexed-job")
EXTRAS = ("volume",)  # rendered and validated too, but trains nothing
# The oldest Kubernetes the manifests support as written (the indexed Job's
# fields), and the newest kubernetes-validate knows (catches removals).
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# Each custom kind, with the CRD and version it is validated against.
CRDS = {"TFJob": ("kubeflow.org_tfjobs.yaml", "v1"),
        "JobSet": ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
        "TrainJob": ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
        "ClusterTrainingRuntime": ("trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1")}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's topology requests (Kueue v0.14+); a pod template may carry one.
TOPOLOGY_ANNOTATIONS = ("kueue.x-k8s.io/podset-required-topology",
                        "kueue.x-k8s.io/podset-preferred-topology",
                        "kueue.x-k8s.io/podset-unconstrained-topology")
PLACEHOLDER_IMAGE = "registry.example.com/"
# What settings.yaml holds: its keys and their kinds of value. The values
# themselves are checked where they land, by the Kubernetes schemas, the
# CRDs and the trainer's flag parser.
SETTINGS_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["workers", "recipe", "precision", "communication", "resources", "nodeSelector",
                 "tolerations", "deadlineSeconds", "storage"],
    "properties": {
        "workers": {"type": "integer", "minimum": 1},
        "recipe": {"type": "string"}, "precision": {"type": "string"}, "communication": {"type": "string"},
        "resources": {"type": "object", "required": ["requests", "limits"], "additionalProperties": False,
                      "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}}},
        "nodeSelector": {"type": "object", "minProperties": 1},
        "tolerations": {"type": "array", "minItems": 1},
        "deadlineSeconds": {"type": "integer", "minimum": 1},
        "storage": {"type": "object", "required": ["claim", "class", "accessMode", "size"],
                    "additionalProperties": False,
                    "properties": {"claim": {"type": "string"}, "class": {"type": "string"},
                                   "accessMode": {"type": "string"}, "size": {"type": ["string", "integer"]}}}}}


class Findings:
    """What the check found: errors (exit 2), warnings and notes."""

    def __init__(self):
        self.errors, self.warnings, self.notes = [], [], []

    def lines(self, limit: int = 400):
        """One line per finding, each at most about `limit` characters: a
        schema's message can quote a whole object."""
        for kind, found in (("error", self.errors), ("warning", self.warnings), ("note", self.notes)):
            for line in dict.fromkeys(found):
                line = " ".join(line.split())
                yield f"{kind}: {line if len(line) <= limit else line[:limit] + ' ...'}"


# --------------------------------------------------------------- rendering

class RenderError(Exception):
    pass


def render(directory: Path) -> list:
    """The objects `kubectl kustomize DIRECTORY` renders. Raises RenderError."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RenderError("kubectl is not installed: k8s/ is rendered with its kustomize (kubectl 1.27+)")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def read_settings(k8s: Path) -> dict:
    """The values of k8s/settings/settings.yaml (its spec)."""
    return yaml.safe_load((k8s / "settings" / "settings.yaml").read_text())["spec"]


def of_kind(docs, kind: str) -> list:
    return [d for d in docs if d["kind"] == kind]


def job_templates(docs) -> list:
    """(where, Job spec) of every Job, and of every Job that a JobSet, or a
    Trainer runtime's JobSet, makes."""
    found = [(f"Job {job['metadata']['name']}", job["spec"]) for job in of_kind(docs, "Job")]
    for jobset in of_kind(docs, "JobSet") + of_kind(docs, "ClusterTrainingRuntime"):
        spec = jobset["spec"]["template"]["spec"] if jobset["kind"] == "ClusterTrainingRuntime" else jobset["spec"]
        found += [(f"{jobset['kind']} {jobset['metadata']['name']} {r['name']}", r["template"]["spec"])
                  for r in spec["replicatedJobs"]]
    return found


def pod_templates(docs) -> list:
    """(where, pod template) of every pod template, the custom kinds' too."""
    found = [(f"TFJob {tfjob['metadata']['name']} {replica_type}", spec["template"])
             for tfjob in of_kind(docs, "TFJob") for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items()]
    found += [(where, spec["template"]) for where, spec in job_templates(docs)]
    return found + [(f"Pod {pod['metadata']['name']}", pod) for pod in of_kind(docs, "Pod")]


def is_trainer(template) -> bool:
    return template["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "trainer"


def training_object(docs):
    """What is submitted to train (TFJob, JobSet, TrainJob or the indexed Job), or None."""
    found = [d for d in docs if d["kind"] in ("TFJob", "JobSet", "TrainJob")] or \
        [j for j in of_kind(docs, "Job") if j["spec"].get("completionMode") == "Indexed"]
    return found[0] if found else None


def training_containers(docs) -> list:
    """(where, pod template, training container, its command line) of every
    pod template that trains. A TrainJob's pods run its runtime's command
    followed by the TrainJob's args (Trainer v2's plainml policy)."""
    job = training_object(docs)
    args = job["spec"]["trainer"].get("args", []) if job and job["kind"] == "TrainJob" else []
    found = []
    for where, template in pod_templates(docs):
        if is_trainer(template):
            (container,) = [c for c in template["spec"]["containers"] if c["name"] in ("tensorflow", "node")]
            found.append((where, template, container, container.get("command", []) + container.get("args", []) + args))
    return found


# -------------------------------------------------------------- validation

def _strict(schema):
    """A CRD schema with unknown fields rejected, as `kubectl apply`'s strict
    server-side field validation (its default) rejects them."""
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
def crd_validator(kind: str, k8s: Path = K8S) -> jsonschema.Draft7Validator:
    """A validator of `kind` against its CRD in k8s/schemas/, strict."""
    filename, version = CRDS[kind]
    crd = yaml.safe_load((k8s / "schemas" / filename).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))


def _path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top)"


def validation_errors(docs, k8s: Path = K8S) -> list:
    """What the API server would refuse: every built-in object, and the pod
    and Job templates inside the custom kinds (whose CRDs embed them without
    their schemas), against the Kubernetes schemas; the custom kinds against
    their CRDs."""
    found = []
    embedded = [(f"{where}: pod template", {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                           "template": template})
                for where, template in pod_templates(of_kind(docs, "TFJob"))]
    embedded += [(f"{where}: Job template", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
                                             "spec": spec})
                 for where, spec in job_templates([d for d in docs if d["kind"] != "Job"])]
    builtin = [(f"{d['kind']} {d['metadata']['name']}", d) for d in docs if d["kind"] not in CRDS]
    for version in KUBERNETES_VERSIONS:
        for where, doc in builtin + embedded:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                found.append(f"{where}: {_path(e)}: {e.message} (Kubernetes {version} schema)")
            except kubernetes_validate.SchemaNotFoundError:
                found.append(f"{where}: {doc['apiVersion']} {doc['kind']} is not served by Kubernetes {version}")
    for doc in docs:
        if doc["kind"] in CRDS:
            filename, version = CRDS[doc["kind"]]
            if doc["apiVersion"].rsplit("/", 1)[-1] != version:
                found.append(f"{doc['kind']} {doc['metadata']['name']}: {doc['apiVersion']} is not the version "
                             f"checked ({version}, k8s/schemas/{filename})")
            found += [f"{doc['kind']} {doc['metadata']['name']}: {_path(e)}: {e.message} (k8s/schemas/{filename})"
                      for e in crd_validator(doc["kind"], k8s).iter_errors(doc)]
    return found


def _parse_config():
    """The trainer's own flag parser, or None where the package cannot be
    imported (it needs absl-py; TensorFlow is not imported)."""
    repo = K8S.parent
    if (repo / "distributed_mpt").is_dir() and str(repo) not in sys.path:
        sys.path.insert(0, str(repo))  # this clone's trainer, not another installed one
    try:
        from distributed_mpt.errors import UserError
        from distributed_mpt.train import parse_config
    except ImportError:
        return None
    return parse_config, UserError


# ------------------------------------------------------ what the settings say

def _has_gpus(resources) -> bool:
    """Does a container ask for GPUs (a limit of any `<vendor>/gpu` resource
    but 0)? A malformed count is the Kubernetes schema's to refuse."""
    return any(str(v) != "0" for k, v in resources.get("limits", {}).items() if k.endswith("/gpu"))


def _last_flag(argv, flag: str):
    """The value absl uses: the last `--flag=value` on the command line."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")]
    return values[-1] if values else None


def contradictions(settings: dict, found: Findings) -> None:
    """Settings that cannot work together, whatever the variant."""
    gpus = _has_gpus(settings["resources"])
    precision, communication, workers = settings["precision"], settings["communication"], settings["workers"]
    if not gpus and precision == "mixed_float16":
        found.errors.append("settings.yaml: precision mixed_float16 without GPUs (no nvidia.com/gpu limit): "
                            "float16 is emulated on CPUs; use auto, mixed_bfloat16 (CPUs with AVX512_BF16 "
                            "or AMX) or float32")
    if not gpus and communication == "nccl":
        found.errors.append("settings.yaml: communication nccl without GPUs (no nvidia.com/gpu limit): NCCL "
                            "runs between GPUs; use ring (or auto)")
    if gpus and precision == "mixed_bfloat16":
        found.warnings.append("settings.yaml: mixed_bfloat16 on GPUs is fast on compute capability 8.0+ "
                              "(A100, H100) only; on older GPUs use mixed_float16 (or auto)")
    if gpus and communication == "ring":
        found.notes.append("settings.yaml: communication ring between GPUs goes through gRPC, slower than nccl")
    mode = settings["storage"]["accessMode"]
    if mode in ("ReadOnlyMany", "ReadWriteOncePod"):
        found.errors.append(f"settings.yaml: storage.accessMode {mode}: the chief writes --model_dir on the "
                            f"claim and every worker reads it, so it must be ReadWriteMany (ReadWriteOnce "
                            f"with one node)")
    elif mode == "ReadWriteOnce" and workers > 1:
        found.warnings.append(f"settings.yaml: storage.accessMode ReadWriteOnce with {workers} workers: only "
                              f"pods on one node can mount it, so all of them must land there; ReadWriteMany "
                              f"lets them spread")


def arrival_errors(settings: dict, docs) -> list:
    """Where a rendered variant does not carry what settings.yaml says: a
    value wiring.yaml did not write (a manifest changed its layout), or one
    overridden by an edit of the manifests."""
    found = []

    def expect(where, what, rendered, wanted):
        if rendered != wanted:
            found.append(f"{where}: {what} is {json.dumps(rendered)}, settings.yaml says {json.dumps(wanted)}")

    for where, template, container, argv in training_containers(docs):
        for flag in ("recipe", "precision", "communication"):
            expect(where, f"--{flag}", _last_flag(argv, flag), settings[flag])
        expect(where, "the training container's resources", container.get("resources"), settings["resources"])
        for field in ("nodeSelector", "tolerations"):
            expect(where, field, template["spec"].get(field), settings[field])
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "DMPT_NUM_WORKERS" in env:
            expect(where, "DMPT_NUM_WORKERS", env["DMPT_NUM_WORKERS"], str(settings["workers"]))
    job = training_object(docs)
    if job is not None:
        name, spec, workers, deadline = f"{job['kind']} {job['metadata']['name']}", job["spec"], settings["workers"], \
            settings["deadlineSeconds"]
        if job["kind"] == "TFJob":
            expect(name, "Worker replicas", spec["tfReplicaSpecs"]["Worker"]["replicas"], workers)
            expect(name, "activeDeadlineSeconds", spec["runPolicy"].get("activeDeadlineSeconds"), deadline)
        elif job["kind"] == "TrainJob":
            expect(name, "numNodes", spec["trainer"].get("numNodes"), workers)
            env = {e["name"]: e.get("value") for e in spec["trainer"].get("env", [])}
            expect(name, "DMPT_NUM_WORKERS (plainml injects no node count)", env.get("DMPT_NUM_WORKERS"),
                   str(workers))
            expect(name, "activeDeadlineSeconds", spec.get("activeDeadlineSeconds"), deadline)
        else:
            jobs = [(name, spec)] if job["kind"] == "Job" else \
                [(f"{name} {r['name']}", r["template"]["spec"]) for r in spec["replicatedJobs"]]
            for where, job_spec in jobs:
                count = 1 if where.endswith(" chief") else workers
                expect(where, "completions", job_spec.get("completions"), count)
                expect(where, "parallelism", job_spec.get("parallelism"), count)
                expect(where, "activeDeadlineSeconds", job_spec.get("activeDeadlineSeconds"), deadline)
    storage = settings["storage"]
    for claim in of_kind(docs, "PersistentVolumeClaim"):
        where = f"PersistentVolumeClaim {claim['metadata']['name']}"
        expect(where, "the name", claim["metadata"]["name"], storage["claim"])
        expect(where, "storageClassName", claim["spec"].get("storageClassName"), storage["class"])
        expect(where, "accessModes", claim["spec"]["accessModes"], [storage["accessMode"]])
        expect(where, "the size", claim["spec"]["resources"]["requests"]["storage"], storage["size"])
    for where, template in pod_templates(docs):
        for volume in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                expect(where, f"the claim of volume {volume['name']}", volume["persistentVolumeClaim"]["claimName"],
                       storage["claim"])
    return found


def flag_errors(docs, parser) -> list:
    """Training commands the trainer would refuse at start (exit 2)."""
    parse_config, user_error = parser
    found = []
    for where, _, _, argv in training_containers(docs):
        if argv[:1] != ["distributed-mpt-train"]:
            found.append(f"{where}: the command is {argv[:1]}, not distributed-mpt-train")
            continue
        try:
            parse_config(argv[1:])
        except user_error as e:
            found.append(f"{where}: the trainer refuses its flags: {e}")
    return found


def kueue_findings(variant: str, docs, found: Findings) -> None:
    """The queue label and topology annotations, as Kueue takes them."""
    job = training_object(docs)
    if job is None:
        return
    queue = job["metadata"].get("labels", {}).get(QUEUE_LABEL)
    for where, template in pod_templates(docs):
        topology = [a for a in TOPOLOGY_ANNOTATIONS if a in template["metadata"].get("annotations", {})]
        if len(topology) > 1:
            found.errors.append(f"{variant}: {where}: {' and '.join(topology)}: Kueue takes one topology "
                                f"request per pod template, and refuses the job")
        if topology and queue is None and is_trainer(template):
            found.errors.append(f"{variant}: {where}: {topology[0]} without a queue label "
                                f"({QUEUE_LABEL}, k8s/settings/kustomization.yaml): only Kueue places by "
                                f"topology, and only jobs it queues")
    if queue is None:
        found.notes.append("no Kueue queue label (k8s/settings/kustomization.yaml): jobs start when the cluster "
                           "can place them, unless the cluster's Kueue manages every job "
                           "(manageJobsWithoutQueueName), which then queues them in the namespace's default "
                           "LocalQueue")
    else:
        found.notes.append(f"queued in Kueue's LocalQueue {queue}: it must exist in the job's namespace "
                           f"(kubectl get localqueues), or the job stays suspended")
        if job["kind"] == "TFJob":
            found.warnings.append(f"{variant}: Kueue deprecated its TFJob integration (kubernetes-sigs/kueue#12601), "
                                  f"has left it off by default since v0.19 and plans to remove it (tentatively "
                                  f"v0.20): where it is off the TFJob is not queued, the label is ignored; use "
                                  f"k8s/trainjob or k8s/jobset")


def image_findings(docs, found: Findings) -> None:
    images = {c["image"] for _, t in pod_templates(docs)
              for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    for image in sorted(images):
        if "@sha256:" not in image:
            found.warnings.append(f"image {image} is not pinned by digest: a tag can be moved to other content "
                                  f"(k8s/settings/kustomization.yaml, images: digest)")
        if image.startswith(PLACEHOLDER_IMAGE) or image.endswith("0" * 64):
            found.warnings.append(f"image {image} is the example's placeholder: put the image you pushed in "
                                  f"k8s/settings/kustomization.yaml")


def check(k8s: Path = K8S, variants=VARIANTS + EXTRAS) -> Findings:
    """Checks the variants of the k8s/ tree at `k8s` with its settings."""
    found = Findings()
    try:
        settings = read_settings(k8s)
        jsonschema.validate(settings, SETTINGS_SCHEMA)
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        found.errors.append(f"{k8s / 'settings' / 'settings.yaml'}: cannot be read: {e}")
        return found
    except jsonschema.ValidationError as e:
        found.errors.append(f"settings.yaml: {_path(e)}: {e.message}")
        return found
    contradictions(settings, found)
    parser = _parse_config()
    if parser is None:
        found.notes.append("the training commands were not given to the trainer's flag parser: "
                           "distributed_mpt cannot be imported here (pip install -e .)")
    for variant in variants:
        try:
            docs = render(k8s / variant)
        except RenderError as e:
            found.errors.append(f"{variant}: {e}")
            continue
        found.errors += [f"{variant}: {line}" for line in validation_errors(docs, k8s)]
        found.errors += [f"{variant}: {line}" for line in arrival_errors(settings, docs)]
        if parser is not None:
            found.errors += [f"{variant}: {line}" for line in flag_errors(docs, parser)]
        kueue_findings(variant, docs, found)
        image_findings(docs, found)
    return found


def main(argv) -> int:
    """Checks what argv names (variants, or one settings directory); returns the exit code."""
    variants = [a for a in argv if not Path(a).is_dir() or a in VARIANTS + EXTRAS]
    directories = [Path(a) for a in argv if a not in variants]
    unknown = [v for v in variants if v not in VARIANTS + EXTRAS]
    if unknown or len(directories) > 1:
        print(f"error: {' '.join(unknown or map(str, directories))}: name variants "
              f"({', '.join(VARIANTS + EXTRAS)}) or one settings directory", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        k8s = K8S
        if directories:
            # The variants include ../settings: check a copy of this tree whose
            # settings are the given ones.
            if not (directories[0] / "settings.yaml").is_file():
                print(f"error: {directories[0]} holds no settings.yaml: give a copy of k8s/settings",
                      file=sys.stderr)
                return 2
            k8s = Path(shutil.copytree(K8S, Path(scratch) / "k8s", ignore=shutil.ignore_patterns("settings")))
            shutil.copytree(directories[0], k8s / "settings")
        found = check(k8s, tuple(variants) or VARIANTS + EXTRAS)
    for line in found.lines():
        print(line, file=sys.stderr if line.startswith("error") else sys.stdout)
    if found.errors:
        return 2
    print(f"ok: {', '.join(variants or VARIANTS + EXTRAS)} render and validate, and carry the settings")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
