"""Hostile input, as a careless or unlucky user, a damaged disk or an attacker
gives it, to every entry point: train, predict, launch, benchmark,
prepare_data and k8s/check.py. The inputs are generated: each number flag
with each kind of bad number, each path flag with each kind of path that is
no file of its kind, each file of a run with each kind of damage, each
cluster variable with malformed values, each file of the Kubernetes settings
with what exhausts a reader.

Each must end in one `error:` line, exit 2 and no traceback, and leave every
file it touches as it was (names, kinds, sizes, modification times and
contents); an input that is legitimate, though it looks hostile, must succeed
with the `warning:` line that says what was wrong. The runs are in-process
(TensorFlow's start-up is paid once) and every refusal comes before the
first training step; the cases that need a trained run share one small run.
"""

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from conftest import SMOKE_FLAGS, assert_ok, deadline, make_path, run_in_process, snapshot, train
from distributed_mpt import config as config_lib
from distributed_mpt.process.run_lock import LOCK_NAME

FLAGS = [*SMOKE_FLAGS, "--train_steps=4", "--noevaluate"]
# The shared run: a model of 9,184 weights, so that each case's copy of it
# and the snapshots of that copy cost milliseconds.
SMALL = ["--model=airbench", "--model_width=4"]
RUN_FILES = ("config.json", "summary.json", "checkpoints/model.json", "checkpoints/checkpoint",
             "metrics.jsonl", ".distributed_mpt")


@dataclasses.dataclass
class Scene:
    """What a case builds its input in: a directory of its own, the shared
    trained run, and what it registers: the paths the input touches (each
    snapshotted before and after) and the environment."""

    tmp_path: Path
    trained: Callable[[], Path]
    touched: List[Path] = dataclasses.field(default_factory=list)
    environ: Dict[str, str] = dataclasses.field(default_factory=dict)

    def touch(self, *paths) -> Path:
        self.touched += [Path(p) for p in paths]
        return Path(paths[0])

    def run(self) -> Path:
        """A copy of the shared trained run, touched."""
        return self.touch(shutil.copytree(self.trained(), self.tmp_path / "run", symlinks=True))


@dataclasses.dataclass(frozen=True)
class Case:
    """`make(scene)` builds the input and returns the entry point's
    arguments; `expect` is a fragment of the one `error:` line, or, for a
    legitimate input, of its `warning:` line."""

    entry: str
    make: Callable[[Scene], List[str]]
    expect: str
    legitimate: bool = False


CASES: Dict[str, Case] = {}


def case(name: str, entry: str, make, expect: str, legitimate: bool = False) -> None:
    assert f"{entry}: {name}" not in CASES, name  # each input distinct
    assert expect, name  # "" is in every line: a case that cannot fail
    CASES[f"{entry}: {name}"] = Case(entry, make, expect, legitimate)


# ------------------------------------------------------------ kinds of input

# Numbers no flag takes: Python's int() and float() take the middle ones.
BAD_NUMBERS = {"nan": "nan", "inf": "inf", "-1": "-1", "1e400": "1e400", "hex": "0x10",
               "underscore": "1_000", "Arabic-Indic digits": "\u0661\u0662", "huge": "9" * 400}


# No "unreadable" file: the tests run as root, who reads a file of mode 000.
# A loop of links is what no one can open.
FILE_KINDS = ("FIFO", "directory", "device", "dangling symlink", "symlink loop", "file of NUL bytes")
DIRECTORY_KINDS = ("FIFO", "device", "dangling symlink", "symlink loop", "file of NUL bytes")

# What a file of the run may become: a killed writer, a bad disk, an editor.
DAMAGE = {
    "empty": lambda text: b"",
    "invalid UTF-8": lambda text: text[:-2] + b"\xff\xfe\n",
    "cut in half": lambda text: text[:len(text) // 2],
    "NUL bytes": lambda text: b"\0" * len(text),
    "nested 100,000 deep": lambda text: b"[" * 100_000 + b"]" * 100_000,
    "a number of 10,000 digits": lambda text: b'{"seed": ' + b"9" * 10_000 + b"}",
    "NaN": lambda text: text.replace(b"0", b"NaN", 1) if text.startswith(b"{") else b"NaN",
    "a list": lambda text: b"[" + text + b"]",
}


def _damaged(relative: str, damage: str):
    def make(scene):
        path = scene.run() / relative
        path.write_bytes(DAMAGE[damage](path.read_bytes()))
        return []
    return make


def _replaced(relative: str, kind: str):
    def make(scene):
        path = scene.run() / relative
        path.unlink()
        make_path("link to /dev/zero" if kind == "device" else kind, path)
        return []
    return make


# --------------------------------------------------------------- the runners

def _run_entry(entry: str, args: List[str], monkeypatch):
    args = [str(a) for a in args]
    if entry == "train":
        return train(args)
    if entry == "predict":
        from distributed_mpt.predict import main
    elif entry == "launch":
        from distributed_mpt.launch import main
    elif entry == "benchmark":
        from distributed_mpt.benchmark import cli, sections

        def measured(cell):
            raise AssertionError(f"{cell.describe()} was measured")

        monkeypatch.setattr(sections, "run_cell", measured)
        main = cli.main
    elif entry == "prepare_data":
        from distributed_mpt.prepare_data import main
    elif entry == "k8s/check.py":
        from support.k8s_pods import load_check
        main = load_check().main
    return run_in_process(main, args)


# --------------------------------------------------------------------- train

def _args(*args):
    return lambda scene: list(args)


def _flagfile(content: bytes):
    def make(scene):
        path = scene.touch(scene.tmp_path / "bad.flags")
        path.write_bytes(content)
        return [f"--flagfile={path}"]
    return make


def _train_path(flag: str, kind: str, *others: str, suffix: str = ""):
    """`flag` naming something of `kind`."""
    def make(scene):
        path = make_path(kind, scene.tmp_path / "given")
        scene.touch(scene.tmp_path)
        return [f"--{flag}={path}{suffix}", *others]
    return make


for name, text in {"bool flag with a value": "--nodownload=1",
                   "another bool flag with a value": "--noexport=1",
                   "unknown model": "--model=vgg16",
                   "unknown flag": "--learning_rat=0.1",
                   "a positional argument": "runs/cnn",
                   "recipe as a path": "--recipe=../../x"}.items():
    case(name, "train", _args(text), text.split("=")[0].lstrip("-") if name != "recipe as a path"
         else "not one of the shipped recipes")
case("flagfile in Latin-1", "train", _flagfile("--seed=1 # \u00e9\n".encode("latin-1")),
     "not UTF-8")
# Every entry point: predict raised ValueError (an image path with a NUL
# byte, absl's reading of it), the launcher printed the environment whole.
for entry in ("train", "predict", "launch", "benchmark", "prepare_data"):
    case("flagfile of /proc/self/environ", entry, _args("--flagfile=/proc/self/environ"),
         "holds NUL bytes")
case("a flagfile naming a FIFO", "train", lambda scene: (
    make_path("FIFO", scene.tmp_path / "fifo"),
    (scene.tmp_path / "a.flags").write_text(f"--flagfile={scene.tmp_path / 'fifo'}\n"),
    scene.touch(scene.tmp_path), [f"--flagfile={scene.tmp_path / 'a.flags'}"])[-1],
    "is a FIFO, not a regular file")

for field in config_lib.FIELDS:
    if field.metadata["choices"] or not ({int, float} & {field.type, *getattr(
            field.type, "__args__", ())}):
        continue
    for what, value in BAD_NUMBERS.items():
        case(f"--{field.name}={what}", "train", _args(f"--{field.name}={value}"),
             f"--{field.name}")

for kind in FILE_KINDS:
    case(f"--flagfile a {kind}", "train", _train_path("flagfile", kind), "--flagfile")
    case(f"--model a {kind}", "train", _train_path("model", kind, suffix=":build"), "--model")
for kind in DIRECTORY_KINDS:
    named = "/dev/zero" if kind == "device" else "given"
    case(f"--model_dir a {kind}", "train", _train_path("model_dir", kind), named)
    case(f"--data_dir of CIFAR-10 a {kind}", "train",
         _train_path("data_dir", kind, "--dataset=cifar10", "--nodownload"), named)
    case(f"--data_dir of an image folder a {kind}", "train",
         _train_path("data_dir", kind, "--dataset=image_folder"), named)

# A file of the run, damaged, resumed with --train_steps=8: each kind of
# damage in config.json, what the reader of the other two must handle apart
# (each costs a start of TensorFlow). The marker's content is not read, and
# the two records below are rebuilt.
FEWER_DAMAGE = ("invalid UTF-8", "nested 100,000 deep", "a number of 10,000 digits", "NaN")
for relative in RUN_FILES:
    for damage in {"config.json": DAMAGE}.get(relative, FEWER_DAMAGE if relative in RUN_FILES[:3]
                                                     else ()):
        case(f"{relative} {damage}", "train", _damaged(relative, damage), relative)
    for kind in ("FIFO", "directory", "device", "dangling symlink", "symlink loop"):
        case(f"{relative} a {kind}", "train", _replaced(relative, kind), relative)


# Legitimate: a damaged line of the progress record costs that line, and a
# damaged checkpoint index is rebuilt from the checkpoints, each said in a
# warning, and the run resumes (each trains: one of each).
for relative, damage in (("metrics.jsonl", "invalid UTF-8"), ("checkpoints/checkpoint", "cut in half")):
    case(f"{relative} {damage}", "train", _damaged(relative, damage), relative, legitimate=True)


def _resumed(*flags):
    def make(scene):
        scene.run()
        return list(flags)
    return make


case("config.json without the seed", "train", lambda scene: (
    (scene.run() / "config.json").write_text('{"dataset": "synthetic"}'), [])[-1],
     "config.json is damaged")
case("resumed with another seed", "train", _resumed("--seed=7"),
     "changes --seed=0 to 7. Pass --seed=0 to resume it")
case("resumed with another rate", "train", _resumed("--learning_rate=0.2"),
     "changes --learning_rate=0.1 to 0.2")
case("a .lock holding the user's text", "train", lambda scene: (
    (scene.run() / LOCK_NAME).write_text("my notes\n"), [])[-1], LOCK_NAME)


def _entry(relative: str, kind: str):
    """Something of the wrong kind where a new run keeps `relative`."""
    def make(scene):
        path = scene.touch(scene.tmp_path / "run") / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_text("the user's own file\n")
        else:
            make_path(kind, path)
        return []
    return make


for relative, kind, expect in (
        ("checkpoints", "file", "is a file, not a directory"),
        ("tensorboard", "file", "is a file, not a directory"),
        ("metrics.jsonl", "directory", "is a directory, not a regular file"),
        ("config.json", "directory", "is a directory, not a regular file"),
        ("summary.json", "directory", "is a directory, not a regular file"),
        ("metrics.jsonl", "FIFO", "is a FIFO, not a regular file"),
        (LOCK_NAME, "FIFO", "is a FIFO, not a regular file"),
        ("checkpoints/checkpoint", "directory", "is a directory, not a regular file"),
        ("notes.txt", "file", "holds files this program did not write")):
    case(f"a new run's {relative} a {kind}", "train", _entry(relative, kind), expect)
case("a new run's export a file", "train", lambda scene: _entry("export", "file")(scene) + [
    "--export"], "not an export of this program")

# The environment: what a cluster hands a process, malformed.
TF_CONFIGS = {
    "not JSON": "{not json",
    "a list": "[1, 2]",
    "no cluster": '{"task": {"type": "worker", "index": 0}}',
    "a parameter server": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}',
    "addresses not strings": '{"cluster": {"worker": [1, 2]}, "task": {"type": "worker", "index": 0}}',
    "port 0": '{"cluster": {"worker": ["a:0"]}, "task": {"type": "worker", "index": 0}}',
    "port in Arabic-Indic digits": '{"cluster": {"worker": ["a:\u0661\u0662"]}, "task": '
                                   '{"type": "worker", "index": 0}}',
    "a host with a newline": '{"cluster": {"worker": ["a\\nb:1"]}, "task": {"type": "worker", '
                             '"index": 0}}',
    "index out of range": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 5}}',
    "index true": '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", '
                  '"index": true}}',
    "index of 5,000 digits": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", '
                             '"index": ' + "9" * 5000 + '}}',
    "nested 100,000 deep": '{"cluster": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "one address twice": '{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", '
                         '"index": 0}}',
    "10,001 workers": json.dumps({"cluster": {"worker": [f"h{i}:1" for i in range(10_001)]},
                                  "task": {"type": "worker", "index": 0}}),
    "two chiefs": '{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}',
}
for what, value in TF_CONFIGS.items():
    case(f"TF_CONFIG {what}", "train", lambda scene, value=value: (
        scene.environ.update(TF_CONFIG=value), [])[-1],
        "cluster" if what in ("port 0", "port in Arabic-Indic digits", "a host with a newline",
                              "one address twice") else "TF_CONFIG")

JOBSET = {"JOBSET_NAME": "cifar", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "0",
          "JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2", "HOSTNAME": "cifar-worker-0-0"}
INDEXED_JOB = {"JOB_COMPLETION_INDEX": "0", "DMPT_NUM_WORKERS": "2", "DMPT_JOB_NAME": "cifar",
               "DMPT_SERVICE_NAME": "cifar"}
SLURM = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
CLUSTER_VARIABLES = {
    "JobSet": (JOBSET, {"JOBSET_NAME": ["Cifar_10", "a" * 64, "cifar\n"],
                        "JOB_INDEX": ["1", "\u0661"],
                        "JOB_COMPLETION_INDEX": ["2", "-1", "0x0", "99999999999"],
                        "DMPT_NUM_WORKERS": ["0", "1_000", "10001"],
                        "DMPT_PORT": ["0", "65536", "22 22"],
                        "HOSTNAME": ["cifar-worker-0-1"],
                        "JOBSET_COORDINATOR": ["evil.example.com"]}),
    "indexed Job": (INDEXED_JOB, {"JOB_COMPLETION_INDEX": ["2", "nan"],
                                  "DMPT_JOB_NAME": ["", "../x"],
                                  "DMPT_NUM_WORKERS": ["", "inf"]}),
    "SLURM": (SLURM, {"SLURM_STEP_NUM_TASKS": ["", "\u0662", "99999999999"],
                      "SLURM_PROCID": ["2", "-1"],
                      "SLURM_STEP_NODELIST": ["n[1-999999999]", "n[a-b]"],
                      "SLURM_STEP_TASKS_PER_NODE": ["1(x99999)"]}),
}
for scheduler, (valid, bad) in CLUSTER_VARIABLES.items():
    for variable, values in bad.items():
        for value in values:
            case(f"{scheduler} {variable}={value!r}", "train", lambda scene, environ={
                **valid, variable: value}: (scene.environ.update(environ), [])[-1],
                "SLURM host list" if value == "n[a-b]" else variable)


# ------------------------------------------------------------------- predict

def _photo(scene, name="photo.png") -> Path:
    import numpy as np
    from PIL import Image

    path = scene.touch(scene.tmp_path / name)
    Image.fromarray(np.full((48, 64, 3), 127, np.uint8)).save(path, format="PNG")
    return path


def _predict(*flags, image=True):
    """predict on the shared run (touched), with `flags` and a photo."""
    def make(scene):
        run = scene.touch(scene.trained())
        return [f"--model_dir={run}", *flags, *([_photo(scene)] if image else [])]
    return make


for name, (flags, image) in {"synthetic_examples": (["--evaluate", "--dataset=synthetic"], False),
                             "tta_fraction": (["--tta=flip"], True),
                             "top_k": ([], True)}.items():
    for what, value in BAD_NUMBERS.items():
        case(f"--{name}={what}", "predict", _predict(*flags, f"--{name}={value}", image=image),
             f"--{name}")
for kind in FILE_KINDS:
    case(f"an image a {kind}", "predict", lambda scene, kind=kind: [
        f"--model_dir={scene.touch(scene.trained())}", make_path(kind, scene.touch(
            scene.tmp_path / "image.png"))], "image.png" if kind != "device" else "/dev/zero")
for kind in DIRECTORY_KINDS:
    case(f"--model_dir a {kind}", "predict", lambda scene, kind=kind: [
        f"--model_dir={make_path(kind, scene.touch(scene.tmp_path) / 'given')}",
        _photo(scene)], "--model_dir" if kind == "device" else "given")
    case(f"--data_dir a {kind}", "predict", lambda scene, kind=kind: [
        f"--model_dir={scene.touch(scene.trained())}", "--evaluate", "--dataset=cifar10",
        "--nodownload", f"--data_dir={make_path(kind, scene.touch(scene.tmp_path) / 'given')}"],
        "/dev/zero" if kind == "device" else "given")
for relative in ("config.json",):  # what predict reads of a run without an export
    for damage in DAMAGE:
        case(f"{relative} {damage}", "predict", lambda scene, relative=relative, damage=damage: [
            *_damaged(relative, damage)(scene), f"--model_dir={scene.tmp_path / 'run'}",
            _photo(scene)], relative)
case("no image and no --evaluate", "predict", _predict(image=False), "nothing to do")
case("an unknown flag", "predict", _predict("--topk=3"), "topk")
# Legitimate, though odd: answered, with the warning that the model learned
# synthetic data.
for name in ("a name with a newline\n.png", "-not-a-flag.png", "\u202egnp.exe"):
    case(f"an image named {name!r}", "predict", lambda scene, name=name: [
        f"--model_dir={scene.touch(scene.trained())}", "--", _photo(scene, name)],
        "trained on synthetic data", legitimate=True)


# -------------------------------------------------------------------- launch

def _launch(*flags):
    def make(scene):
        return [*flags, "--", f"--model_dir={scene.touch(scene.tmp_path / 'run')}"]
    return make


for name in ("num_workers", "max_restarts", "grace_seconds"):
    for what, value in BAD_NUMBERS.items():
        case(f"--{name}={what}", "launch", _launch(f"--{name}={value}"), f"--{name}")
case("no training flags", "launch", _args("--num_workers=2"), "no training flags")
case("a positional argument before --", "launch", _launch("train"), "unexpected argument")
case("an unknown flag", "launch", _launch("--workers=2"), "workers")
case("more workers than the host holds", "launch", _launch("--num_workers=100000"),
     "this host holds at most")


# ----------------------------------------------------------------- benchmark

def _benchmark(*flags):
    def make(scene):
        return ["--tiny", *flags, f"--output={scene.touch(scene.tmp_path) / 'bench.json'}"]
    return make


for name in ("model_width", "repeats", "batch_sizes"):
    for what, value in BAD_NUMBERS.items():
        case(f"--{name}={what}", "benchmark", _benchmark(f"--{name}={value}"), f"--{name}")
for kind in ("FIFO", "directory", "device", "dangling symlink", "symlink loop"):
    case(f"--output a {kind}", "benchmark", lambda scene, kind=kind: [
        "--tiny", f"--output={make_path(kind, scene.touch(scene.tmp_path) / 'given')}"],
        "--output")
case("--output in a missing directory", "benchmark", lambda scene: [
    "--tiny", f"--output={scene.touch(scene.tmp_path) / 'missing' / 'bench.json'}"],
    "does not exist")
for flag in ("--models=vgg16", "--sections=", "--precisions=float64", "--batch_sizes=0",
             "--batch_sizes=1,,2"):
    case(flag, "benchmark", _benchmark(flag), flag.split("=")[0])


# -------------------------------------------------------------- prepare_data

for kind in DIRECTORY_KINDS:
    case(f"--data_dir a {kind}", "prepare_data", lambda scene, kind=kind: [
        f"--data_dir={make_path(kind, scene.touch(scene.tmp_path) / 'given')}"],
        "/dev/zero" if kind == "device" else "given")
case("a positional argument", "prepare_data", lambda scene: [
    f"--data_dir={scene.touch(scene.tmp_path)}", "cifar10"], "unexpected argument")
case("an unknown flag", "prepare_data", _args("--datadir=/tmp"), "datadir")
case("a release of short files", "prepare_data", lambda scene: [
    f"--data_dir={scene.touch(scene.tmp_path)}", *[
        (scene.tmp_path / "cifar-10-batches-bin").mkdir(exist_ok=True),
        *[(scene.tmp_path / "cifar-10-batches-bin" / name).write_bytes(b"\0" * 3073) for name in (
            [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"])]][:0]],
     "cifar-10-batches-bin")


# -------------------------------------------------------------- k8s/check.py

def _settings(scene) -> Path:
    from support.k8s_pods import K8S
    return scene.touch(shutil.copytree(K8S / "settings", scene.tmp_path / "settings"))


def _billion_laughs(text: bytes) -> bytes:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines).encode() + b"\n" + text


SETTINGS_DAMAGE = {
    "invalid UTF-8": (lambda text: text + b"\n# caf\xe9\n", "not UTF-8"),
    "nested 10,000 deep": (lambda text: text + b"\ndeep: " + b"[" * 10_000 + b"]" * 10_000,
                           "nesting deeper than 100"),
    "an alias bomb": (_billion_laughs, "an alias (*name): not accepted"),
    "2 MB": (lambda text: text + b"#" * 2_000_000 + b"\n", "larger than 1048576 bytes"),
    "NUL bytes": (lambda text: text + b"\0\0\0", "not YAML: unacceptable character #x0000"),
    "a tab for indentation": (lambda text: text + b"\nx:\n\t- y\n",
                              "found character '\\t' that cannot start any token"),
}
for name in ("settings.yaml", "kustomization.yaml", "wiring.yaml", "model/kustomization.yaml"):
    for damage, (change, expect) in SETTINGS_DAMAGE.items():
        case(f"{name} {damage}", "k8s/check.py", lambda scene, name=name, change=change: [
            str(_settings(scene)), (scene.tmp_path / "settings" / name).write_bytes(
                change((scene.tmp_path / "settings" / name).read_bytes()))][:1],
             expect if name == "settings.yaml" else name.split("/")[-1])
for name in ("settings.yaml", "model/model.py"):
    for kind in ("FIFO", "dangling symlink", "symlink loop", "device"):
        case(f"{name} a {kind}", "k8s/check.py", lambda scene, name=name, kind=kind: [
            str(_settings(scene)), (scene.tmp_path / "settings" / name).unlink(),
            make_path("link to /dev/zero" if kind == "device" else kind,
                      scene.tmp_path / "settings" / name)][:1], name.split("/")[-1])
for value in ("\u0661\u0662", "-1", "0", "100000", "1e400", ".nan", "0x10", "true",
              '"2\\nfoo: bar"'):
    case(f"workers: {value}", "k8s/check.py", lambda scene, value=value: [
        str(_settings(scene)), (scene.tmp_path / "settings" / "settings.yaml").write_text(
            (scene.tmp_path / "settings" / "settings.yaml").read_text().replace(
                "workers: 2\n", f"workers: {value}\n"))][:1], "workers")
case("two settings directories", "k8s/check.py", lambda scene: [
    str(_settings(scene)), str(scene.tmp_path)], "one settings directory")


# ------------------------------------------------------------------ the test

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps on synthetic data, for the cases that resume it,
    damage a copy of it, or predict with it."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    assert_ok(train([*FLAGS, *SMALL, f"--model_dir={model_dir}"]))
    return model_dir


@pytest.fixture(scope="module")
def timer():
    started = time.monotonic()
    yield
    print(f"\n{len(CASES)} hostile inputs in {time.monotonic() - started:.1f} s: " + ", ".join(
        f"{entry} {sum(c.entry == entry for c in CASES.values())}" for entry in dict.fromkeys(
            c.entry for c in CASES.values())))


@pytest.mark.parametrize("name", CASES)
def test_hostile_input_is_one_error_line_and_changes_nothing(name, tmp_path, request, monkeypatch,
                                                             timer):
    entry, make, expect, legitimate = dataclasses.astuple(CASES[name])
    scene = Scene(tmp_path, lambda: request.getfixturevalue("trained"))
    args = make(scene)
    if entry == "train" and (scene.tmp_path / "run") in scene.touched:
        args = ["--train_steps=8", *args] if "summary.json" not in name else args
        args = [*FLAGS, *SMALL, *args, f"--model_dir={scene.tmp_path / 'run'}"]
    elif entry == "train":
        args = [*FLAGS, *args]
        if not any(a.startswith("--model_dir") for a in args):
            args.append(f"--model_dir={scene.touch(tmp_path / 'run')}")
    for variable, value in scene.environ.items():
        monkeypatch.setenv(variable, value)
    before = snapshot(*scene.touched)
    with deadline(300 if legitimate else 60):  # a FIFO read would block: fail instead
        result = _run_entry(entry, args, monkeypatch)
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if legitimate:
        assert_ok(result)
        assert [line for line in lines if line.startswith("warning:") and expect in line], lines
        return
    errors = [line for line in lines if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and expect in errors[0], (
        result.returncode, lines[-20:])
    assert snapshot(*scene.touched) == before, "a file changed"
