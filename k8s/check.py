#!/usr/bin/env python3
"""Checks k8s/ as you edited it, without a cluster.

    python k8s/check.py                   # every variant, k8s/data and k8s/volume
    python k8s/check.py jobset trainjob   # those
    python k8s/check.py SETTINGS_DIR      # all, with an edited copy of k8s/settings

Reads the files within bounds, renders each variant as `kubectl apply -k`
does, and gives it to what a cluster checks it with: the Kubernetes schemas,
strictly (kubernetes-validate), the CRDs in k8s/schemas/ (jsonschema), the
trainer's flag parser. Then it names settings out of range, left as
placeholders, not arrived, or contradicting each other: one `error:` line
each, and exit 2 (`warning:` and `note:` lines besides; exit 0 when nothing
is wrong). Needs kubectl 1.27+ and pip install -e '.[k8s]'.
"""

import collections
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

K8S = Path(__file__).resolve().parent
VARIANTS = ("trainjob", "jobset", "indexed-job")
EXTRAS = ("data", "volume")  # rendered and validated too, but train nothing
# The oldest Kubernetes the manifests support as written (the indexed Job's
# fields), and the newest kubernetes-validate knows (catches removals).
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# Each custom kind, with the CRD and version it is validated against.
CRDS = {"JobSet": ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
        "TrainJob": ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
        "TrainingRuntime": ("trainer.kubeflow.org_trainingruntimes.yaml", "v1alpha1")}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's topology requests (Kueue v0.14+); a pod template may carry one.
TOPOLOGY_ANNOTATIONS = tuple(f"kueue.x-k8s.io/podset-{how}-topology" for how in ("required", "preferred",
                                                                                 "unconstrained"))
# What the shipped files hold where only the user knows the value: RFC
# 2606's reserved domain, the all-zero digest, and what k8s/settings overwrites.
PLACEHOLDERS = ("example.com", "0" * 64, "set-by-settings")
MODELS = "/models/"  # where the pods see k8s/settings/model (k8s/base/trainer.yaml)

# Bounds on what is read: the files are the user's, and may be anything.
MAX_FILE_BYTES = 1 << 20  # a ConfigMap holds 1 MiB; the largest CRD carried, 0.9 MiB
MAX_FILES = 256
MAX_DEPTH = 100           # the deepest CRD carried nests 47 levels
MAX_RENDERED_BYTES = 32 << 20
# Per training container, more than any node offers (the largest cloud
# machines of 2026: under 1,000 cores, 32 TiB, 16 GPUs): a request no node
# can meet leaves the job pending without a word.
RESOURCE_MAXIMA = {"cpu": "1024", "memory": "32Ti", "ephemeral-storage": "1Pi", "/gpu": "16"}
# Kubernetes' quantity grammar (apimachinery, resource.ParseQuantity).
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE]|[eE][+-]?[0-9]+)?")
# apimachinery's Quantity: "no quantity may represent a number greater than
# 2^63-1 in magnitude" (a larger one is capped, not refused).
MAX_QUANTITY = 2 ** 63 - 1
_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, None: 1,
             **{f"{p}i": 2 ** (10 * n) for n, p in enumerate("KMGTPE", 1)}}
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LONGEST_POD = "{name}-worker-0-{last}"  # a JobSet's pods; a TrainJob's (-node-0-) and a Job's are shorter

# The trainer's flag parser, its error, and the most workers it takes.
Trainer = collections.namedtuple("Trainer", "parse_config user_error max_workers")


class Findings:
    """What the check found: errors (exit 2), warnings and notes."""

    def __init__(self):
        self.errors, self.warnings, self.notes = [], [], []

    def lines(self, limit: int = 400):
        """One line per finding, each at most about `limit` characters: a
        schema's message can quote a whole object."""
        for kind, found in (("error", self.errors), ("warning", self.warnings), ("note", self.notes)):
            for line in dict.fromkeys(" ".join(line.split()) for line in found):
                yield f"{kind}: {line if len(line) <= limit else line[:limit] + ' ...'}"


class InputError(Exception):
    """A file the check refuses to read, or a render that failed."""


# ----------------------------------------------------------------- reading

class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases (a few lines of them expand to
    gigabytes) and nesting deeper than MAX_DEPTH (which exhausts the stack)."""

    depth = 0

    def compose_node(self, parent, index):
        problem = "an alias (*name)" if self.check_event(yaml.AliasEvent) else \
            f"nesting deeper than {MAX_DEPTH}" if self.depth >= MAX_DEPTH else None
        if problem:
            raise yaml.composer.ComposerError(None, None, f"{problem}: not accepted", self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _DecimalLoader(_BoundedLoader):
    """_BoundedLoader, for the settings: YAML 1.1 reads `0x10`, `010`,
    `1_000` and `1:20` as the numbers 16, 8, 1000 and 80, which kubectl then
    carries into the manifests as written. A number there is decimal digits;
    anything else is text, which the settings' schema refuses."""


_INT = "tag:yaml.org,2002:int"
_DecimalLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_DecimalLoader.add_implicit_resolver(_INT, re.compile(r"[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))


def load_yaml(text: str, where, loader=_BoundedLoader) -> list:
    """The documents of `text`, read within bounds; InputError names `where`."""
    try:
        return [doc for doc in yaml.load_all(text, Loader=loader) if doc is not None]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise InputError(f"{where}: {at}{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not YAML: {e}") from None


def read_text(path: Path) -> str:
    """A regular file's text: UTF-8, at most MAX_FILE_BYTES. Opened without
    blocking, so that a FIFO is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise InputError(f"{path}: cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{path}: not a regular file")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise InputError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 (byte {e.start})") from None


def copy_tree(source: Path, target: Path, skip=(), budget=None) -> None:
    """Copies `source` to `target` through read_text, each YAML file read
    within bounds: kubectl then renders only what was vetted."""
    budget = [MAX_FILES] if budget is None else budget
    target.mkdir()
    for entry in sorted(source.iterdir()):
        budget[0] -= 1
        if budget[0] < 0:
            raise InputError(f"{source}: more than {MAX_FILES} files")
        if entry.name in skip:
            continue
        if entry.is_dir() and not entry.is_symlink():
            copy_tree(entry, target / entry.name, (), budget)
            continue
        text = read_text(entry)
        if entry.suffix in (".yaml", ".yml"):
            load_yaml(text, entry)
        (target / entry.name).write_text(text, encoding="utf-8")


def read_mapping(path: Path) -> dict:
    """The one mapping a YAML file holds; raises InputError."""
    docs = load_yaml(read_text(path), path.name, _DecimalLoader)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise InputError(f"{path.name}: must hold one mapping")
    return docs[0]


def render(directory: Path) -> list:
    """The objects `kubectl kustomize DIRECTORY` renders; raises InputError."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise InputError("kubectl is not installed: k8s/ is rendered with its kustomize (kubectl 1.27+)")
    try:
        result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise InputError("kubectl kustomize did not finish in 120 s") from None
    if result.returncode != 0:
        # Deprecation warnings come first, and the error's cause ends its
        # line, after the whole object it failed on: keep that end.
        lines = result.stderr.decode(errors="replace").split("\n")
        last = next((line.strip() for line in reversed(lines) if line.strip()), "(nothing on stderr)")
        raise InputError(f"kubectl kustomize failed: {last if len(last) <= 300 else '... ' + last[-300:]}")
    if len(result.stdout) > MAX_RENDERED_BYTES:
        raise InputError(f"kubectl kustomize rendered over {MAX_RENDERED_BYTES} bytes")
    return load_yaml(result.stdout.decode(errors="replace"), "kubectl kustomize")


# ------------------------------------------------------ the rendered objects

def of_kind(docs, kind: str) -> list:
    return [d for d in docs if d["kind"] == kind]


def job_templates(docs) -> list:
    """(where, Job spec) of every Job, and of every Job that a JobSet, or a
    TrainingRuntime's JobSet, makes."""
    found = [(f"Job {job['metadata']['name']}", job["spec"]) for job in of_kind(docs, "Job")]
    for jobset in of_kind(docs, "JobSet") + of_kind(docs, "TrainingRuntime"):
        spec = jobset["spec"]["template"]["spec"] if jobset["kind"] == "TrainingRuntime" else jobset["spec"]
        found += [(f"{jobset['kind']} {jobset['metadata']['name']} {r['name']}", r["template"]["spec"])
                  for r in spec["replicatedJobs"]]
    return found


def pod_templates(docs) -> list:
    """(where, pod template) of every pod template, the custom kinds' too."""
    return [(where, spec["template"]) for where, spec in job_templates(docs)] + \
        [(f"Pod {pod['metadata']['name']}", pod) for pod in of_kind(docs, "Pod")]


def is_trainer(template) -> bool:
    return template["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "trainer"


def training_containers(docs) -> list:
    """(where, pod template, training container, its command line) of every
    pod template that trains."""
    return [(where, t, c, c.get("command", []) + c.get("args", [])) for where, t in pod_templates(docs)
            if is_trainer(t) for c in t["spec"]["containers"] if c["name"] == "node"]


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
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    """A validator of `kind` against its CRD in k8s/schemas/, strict."""
    filename, version = CRDS[kind]
    (served,) = [v for v in read_mapping(K8S / "schemas" / filename)["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))


def _path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top)"


def validation_errors(docs) -> list:
    """What the API server would refuse: every built-in object, and the Job
    templates inside the custom kinds (whose CRDs embed them without their
    schemas), against the Kubernetes schemas; the custom kinds against their CRDs."""
    found = []
    embedded = [(f"{where}: Job template", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
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
                      for e in crd_validator(doc["kind"]).iter_errors(doc)]
    return found


@functools.lru_cache(maxsize=None)
def settings_validator() -> jsonschema.Draft7Validator:
    """settings.yaml's keys and kinds of value (k8s/schemas/settings.schema.json)."""
    return jsonschema.Draft7Validator(json.loads(read_text(K8S / "schemas" / "settings.schema.json")))


def _trainer():
    """The trainer's flag parser and bound (a Trainer), or None where the
    package cannot be imported (it needs absl-py, not TensorFlow)."""
    repo = K8S.parent
    if (repo / "distributed_mpt").is_dir() and str(repo) not in sys.path:
        sys.path.insert(0, str(repo))  # this clone's trainer, not another installed one
    try:
        from distributed_mpt.errors import UserError
        from distributed_mpt.cluster.environment import MAX_TASKS
        from distributed_mpt.train import parse_config
    except ImportError:
        return None
    return Trainer(parse_config, UserError, MAX_TASKS)


# --------------------------------------------------- what the settings say

def quantity(value) -> float:
    """A Kubernetes quantity's value; ValueError, saying why, if it is not
    one or is beyond what Kubernetes holds."""
    text = str(value)
    shown = text if len(text) < 40 else text[:40] + "..."  # a value may be megabytes long
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise ValueError(f"{shown!r} is not a Kubernetes quantity (4, 500m, 24Gi)")
    number, suffix = match.groups()
    # float() reads a decimal exponent of any length at once (to inf or 0),
    # where 10 ** int(exponent) would build a number of that many digits.
    amount = float(number) * _SUFFIXES[suffix] if suffix in _SUFFIXES else float(number + suffix)
    if not abs(amount) <= MAX_QUANTITY:
        raise ValueError(f"{shown} is beyond the largest quantity "
                         f"Kubernetes holds (2^63-1)")
    return amount


def _strings(node, path=""):
    """(path, string) of every string in a parsed YAML document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from _strings(value, f"{path}.{key}" if path else str(key))
    if isinstance(node, str):
        yield path, node


def value_errors(settings: dict, kustomization: dict, trainer) -> list:
    """Values no variant can carry as meant: out of range, or text that
    carries line breaks or YAML structure into the manifests."""
    found = []
    for where, node in (("settings.yaml", settings), ("kustomization.yaml", kustomization)):
        for path, text in _strings({k: v for k, v in node.items() if k != "transformers"}):
            try:
                structured = any(unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp")
                                 for c in text) or \
                    any(isinstance(doc, (dict, list)) for doc in load_yaml(text, path))
            except InputError:
                structured = True
            if structured:
                found.append(f"{where}: {path}: {text!r} carries a line break, a control character or YAML "
                             f"structure, not a value")
    if found:  # what follows reads these values
        return found
    name, workers = settings["spec"]["jobName"], settings["spec"]["workers"]
    pod = _LONGEST_POD.format(name=name, last=workers - 1)
    if not _DNS_1035.fullmatch(name) or len(pod) > 63:
        found.append(f"settings.yaml: jobName {name!r} must be a DNS label (lower-case letters, digits, '-', "
                     f"a letter first) short enough for the pods' names ({pod}: at most 63 characters)")
    if trainer and workers > trainer.max_workers:
        found.append(f"settings.yaml: workers {workers} is more than the trainer takes ({trainer.max_workers})")
    amounts = {}
    for bound, values in settings["template"]["spec"]["containers"][0]["resources"].items():
        for resource, value in values.items():
            most = RESOURCE_MAXIMA.get("/gpu" if str(resource).endswith("/gpu") else resource)
            try:
                amounts[bound, resource] = amount = quantity(value)
            except ValueError as e:
                found.append(f"settings.yaml: resources.{bound}.{resource}: {e}")
                continue
            if amount < 0 or (most and amount > quantity(most)):
                found.append(f"settings.yaml: resources.{bound}.{resource}: {value} is out of range (0 to {most}: "
                             f"more than any node has)")
            if bound == "limits" and amounts.get(("requests", resource), 0) > amount:
                found.append(f"settings.yaml: resources: the request of {resource} is above its limit")
    return found


def contradictions(settings: dict, found: Findings) -> None:
    """Settings that cannot work together, whatever the variant."""
    limits = settings["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    gpus = any(str(v) != "0" for k, v in limits.items() if k.endswith("/gpu"))
    spec, no_gpus = settings["spec"], "without GPUs (no nvidia.com/gpu limit)"
    if not gpus and spec["precision"] == "mixed_float16":
        found.errors.append(f"settings.yaml: precision mixed_float16 {no_gpus}: float16 is emulated on CPUs; "
                            f"use auto, mixed_bfloat16 (CPUs with AVX512_BF16 or AMX) or float32")
    if not gpus and spec["communication"] == "nccl":
        found.errors.append(f"settings.yaml: communication nccl {no_gpus}: NCCL runs between GPUs; use ring")
    if gpus and spec["precision"] == "mixed_bfloat16":
        found.warnings.append("settings.yaml: mixed_bfloat16 on GPUs is fast on compute capability 8.0+ "
                              "(A100, H100) only; on older GPUs use mixed_float16 (or auto)")
    mode, workers = spec["storage"]["accessMode"], spec["workers"]
    if mode in ("ReadOnlyMany", "ReadWriteOncePod"):
        found.errors.append(f"settings.yaml: storage.accessMode {mode}: the chief writes --model_dir on the "
                            f"claim and every worker reads it, so it must be ReadWriteMany (ReadWriteOnce "
                            f"with one node)")
    elif mode == "ReadWriteOnce" and workers > 1:
        found.warnings.append(f"settings.yaml: storage.accessMode ReadWriteOnce with {workers} workers: only "
                              f"pods on one node can mount it, so all of them must land there")


def arrival_errors(settings: dict, docs, trainer) -> list:
    """The worker count wherever it is written, against the settings' (one
    that disagrees, where a manifest's layout changed or a patch overrides
    it, leaves the pods waiting for peers that never come), and the training
    commands as the trainer takes them."""
    workers, found = settings["spec"]["workers"], []
    counts = [(f"{where} {field}", spec.get(field)) for where, spec in job_templates(docs) if "completions" in spec
              for field in ("completions", "parallelism")]
    counts += [(f"TrainJob {d['metadata']['name']} numNodes", d["spec"]["trainer"].get("numNodes"))
               for d in of_kind(docs, "TrainJob")]
    counts += [(f"TrainingRuntime {d['metadata']['name']} numNodes", d["spec"]["mlPolicy"].get("numNodes"))
               for d in of_kind(docs, "TrainingRuntime")]
    models = {key for cm in of_kind(docs, "ConfigMap") for key in cm.get("data", {})}
    for where, template, container, argv in training_containers(docs):
        counts.append((f"{where}: DMPT_NUM_WORKERS", next(
            (e.get("value") for e in container.get("env", []) if e["name"] == "DMPT_NUM_WORKERS"), None)))
        try:
            config = trainer and trainer.parse_config(argv[1:])
        except trainer.user_error as e:
            found.append(f"{where}: the trainer refuses its flags: {e}")
            continue
        for flag, path in (("data_dir", config and config.data.data_dir),
                           ("model_dir", config and config.run.model_dir)):
            if config and not (path or "").startswith("/data/"):
                found.append(f"{where}: --{flag}={path} is not on the claim, the pods' /data")
        source = config.model.model.rpartition(":")[0] if config else ""
        if source.endswith(".py") and not (source.startswith(MODELS) and source[len(MODELS):] in models):
            found.append(f"{where}: --model={config.model.model}: the pods see only the files of k8s/settings/model, "
                         f"at {MODELS} ({', '.join(sorted(models))})")
    return found + [f"{where} is {value}, settings.yaml says workers: {workers}" for where, value in counts
                    if str(value) != str(workers)]


def rendered_findings(variant: str, docs, found: Findings) -> None:
    """Placeholders left in, the image's pinning, and the Kueue queue label
    and topology requests as Kueue takes them."""
    for doc in docs:
        for path, text in _strings(doc):
            if any(p in text for p in PLACEHOLDERS) and not any(e.startswith(f"{text} ") for e in found.errors):
                found.errors.append(f"{text} is a placeholder left unset ({doc['kind']} {doc['metadata']['name']}: "
                                    f"{path}): put in yours in k8s/settings")
    for image in sorted({c["image"] for _, t in pod_templates(docs) for c in t["spec"]["containers"]}):
        if "@sha256:" not in image:
            found.warnings.append(f"image {image} is not pinned by digest: a tag can be moved to other content "
                                  f"(k8s/settings/kustomization.yaml, images: digest)")
    jobs = [d for d in docs if d["kind"] in ("TrainJob", "JobSet") or d["kind"] == "Job" and is_trainer(d)]
    if not jobs:
        return
    queue = jobs[0]["metadata"].get("labels", {}).get(QUEUE_LABEL)
    for where, template in pod_templates(docs):
        topology = [a for a in TOPOLOGY_ANNOTATIONS if a in template["metadata"].get("annotations", {})]
        if topology and queue is None and is_trainer(template):
            found.errors.append(f"{variant}: {where}: {topology[0]} without a queue label ({QUEUE_LABEL}, "
                                f"k8s/settings/kustomization.yaml): only Kueue places by topology, and only "
                                f"jobs it queues")
    found.notes.append("no Kueue queue label (k8s/settings/kustomization.yaml): jobs start when the cluster can "
                       "place them, unless its Kueue manages every job (manageJobsWithoutQueueName)"
                       if queue is None else f"queued in Kueue's LocalQueue {queue}: it must exist in the job's "
                       f"namespace (kubectl get localqueues), or the job stays suspended")


def check(k8s: Path, variants=VARIANTS + EXTRAS) -> Findings:
    """Checks the variants of the k8s/ tree at `k8s`, whose files copy_tree
    has read within bounds, with its settings."""
    found = Findings()
    try:
        settings = read_mapping(k8s / "settings" / "settings.yaml")
        kustomization = read_mapping(k8s / "settings" / "kustomization.yaml")
        settings_validator().validate(settings)
    except InputError as e:
        found.errors.append(str(e))
        return found
    except jsonschema.ValidationError as e:
        found.errors.append(f"settings.yaml: {_path(e)}: {e.message}")
        return found
    trainer = _trainer()
    if trainer is None:
        found.notes.append("the training commands were not given to the trainer's flag parser: "
                           "distributed_mpt cannot be imported here (pip install -e .)")
    found.errors += value_errors(settings, kustomization, trainer)
    if found.errors:  # rendered, they would only be named again
        return found
    contradictions(settings, found)
    for variant in variants:
        try:
            docs = render(k8s / variant)
        except InputError as e:
            found.errors.append(f"{variant}: {e}")
            continue
        found.errors += [f"{variant}: {line}" for line in validation_errors(docs) + arrival_errors(
            settings, docs, trainer)]
        rendered_findings(variant, docs, found)
    return found


def main(argv) -> int:
    """Checks what argv names (variants, or one settings directory); returns the exit code."""
    variants = [a for a in argv if a in VARIANTS + EXTRAS or not Path(a).is_dir()]
    directories = [Path(a) for a in argv if a not in variants]
    unknown = [v for v in variants if v not in VARIANTS + EXTRAS]
    if unknown or len(directories) > 1:
        print(f"error: {' '.join(unknown or map(str, directories))}: name variants "
              f"({', '.join(VARIANTS + EXTRAS)}) or one settings directory", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        # The variants include ../settings: check a copy of this tree, read
        # within bounds, whose settings are the given ones.
        k8s, found = Path(scratch) / "k8s", Findings()
        try:
            copy_tree(K8S, k8s, skip=("settings", "schemas", "__pycache__"))
            copy_tree(directories[0] if directories else K8S / "settings", k8s / "settings")
        except (InputError, OSError) as e:
            found.errors.append(str(e))
        found = found if found.errors else check(k8s, tuple(variants) or VARIANTS + EXTRAS)
    for line in found.lines():
        print(line, file=sys.stderr if line.startswith("error") else sys.stdout)
    if found.errors:
        return 2
    print(f"ok: {', '.join(variants or VARIANTS + EXTRAS)} render and validate, and carry the settings")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
