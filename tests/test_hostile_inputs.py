"""Bad input, as a careless or unlucky user gives it, to the training entry
point: one table of bad values grouped by where they come from (a flag, a
file in --model_dir, the environment, a path of the wrong kind). Each must
give one `error:` line, exit 2, no traceback, and leave --model_dir as it
was. The runs are in-process (conftest's `train`), and every refusal comes
before the first training step."""

import os
import shutil
from pathlib import Path

import pytest

from conftest import SMOKE_FLAGS, assert_ok, assert_one_error_line, train
from distributed_mpt.process.run_lock import LOCK_NAME

FLAGS = [*SMOKE_FLAGS, "--train_steps=4", "--noevaluate"]


def _write(relative_path: str, content: bytes):
    """Damage: `content` written over a file of the run."""
    def make(model_dir, tmp_path):
        Path(model_dir, relative_path).write_bytes(content)
    return make


def _flagfile(content: bytes):
    """A --flagfile holding `content`."""
    def make(model_dir, tmp_path):
        path = tmp_path / "bad.flags"
        path.write_bytes(content)
        return [f"--flagfile={path}"]
    return make


def _fifo(model_dir, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    return [f"--flagfile={tmp_path / 'fifo'}"]


def _entry(relative_path: str, kind: str):
    """Something of the wrong kind where the run keeps `relative_path`."""
    def make(model_dir, tmp_path):
        path = Path(model_dir, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        {"file": lambda: path.write_text("the user's own file\n"), "directory": path.mkdir,
         "fifo": lambda: os.mkfifo(path)}[kind]()
    return make


# source: {case: (how to make it, extra flags, environment, fragment of the error line)}
# "how to make it" takes (model_dir, tmp_path) and may return more flags.
# File cases start from a run of 4 steps, resumed to 8 (or started again).
CASES = {
    "flag": {
        "bool flag with a value": (None, ["--nodownload=1"], {}, "--nodownload=1"),
        "another bool flag with a value": (None, ["--noexport=1"], {}, "--noexport=1"),
        "negative seed": (None, ["--seed=-1"], {}, "--seed=-1"),
        "zero batch": (None, ["--per_replica_batch_size=0"], {}, "--per_replica_batch_size=0"),
        "unknown model": (None, ["--model=vgg16"], {}, "--model"),
        "recipe as a path": (None, ["--recipe=../../x"], {}, "not one of the shipped recipes"),
        "flagfile in Latin-1": (_flagfile("--seed=1 # é\n".encode("latin-1")), [], {},
                                "not UTF-8"),
        "binary flagfile": (_flagfile(b"\x00\xff\xfe\x80" * 64), [], {}, "not UTF-8"),
        "flagfile that is a FIFO": (_fifo, [], {}, "is a FIFO, not a regular file"),
        "flagfile that is a directory": (lambda d, t: [f"--flagfile={t}"], [], {},
                                         "is a directory, not a regular file"),
    },
    "file": {
        "model.json binary": (_write("checkpoints/model.json", b"\xff\xfe\x00"), [], {},
                              "model.json is damaged"),
        "model.json empty": (_write("checkpoints/model.json", b""), [], {},
                             "model.json is damaged"),
        "model.json a list": (_write("checkpoints/model.json", b"[1, 2]"), [], {},
                              "model.json is damaged"),
        "model.json deeply nested": (_write("checkpoints/model.json", b"[" * 100_000), [], {},
                                     "model.json is damaged"),
        "config.json a list": (_write("config.json", b"[]"), [], {}, "config.json is damaged"),
        "config.json binary": (_write("config.json", b"\x89PNG\r\n"), [], {},
                               "config.json is damaged"),
        "config.json without the seed": (_write("config.json", b'{"dataset": "synthetic"}'), [],
                                         {}, "config.json is damaged"),
        "summary.json binary, run finished": (_write("summary.json", b"\xff" * 10),
                                              ["--train_steps=4"], {}, "summary.json is damaged"),
        "resumed with another seed": (None, ["--seed=7"], {},
                                      "changes --seed=0 to 7. Pass --seed=0 to resume it"),
        "resumed with another rate": (None, ["--learning_rate=0.2"], {},
                                      "changes --learning_rate=0.1 to 0.2"),
    },
    "environment": {
        "TF_CONFIG not JSON": (None, [], {"TF_CONFIG": "{not json"}, "TF_CONFIG"),
        "TF_CONFIG a parameter server": (
            None, [], {"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", '
                                    '"index": 0}}'}, "ps"),
    },
    "path kind": {
        "file where checkpoints/ belongs": (_entry("checkpoints", "file"), [], {},
                                            "is a file, not a directory"),
        "file where tensorboard/ belongs": (_entry("tensorboard", "file"), [], {},
                                            "is a file, not a directory"),
        "file where export/ belongs": (_entry("export", "file"), ["--export"], {},
                                       "not an export of this program"),
        "directory where metrics.jsonl belongs": (_entry("metrics.jsonl", "directory"), [], {},
                                                  "is a directory, not a regular file"),
        "directory where config.json belongs": (_entry("config.json", "directory"), [], {},
                                                "is a directory, not a regular file"),
        "directory where summary.json belongs": (_entry("summary.json", "directory"), [], {},
                                                 "is a directory, not a regular file"),
        "FIFO where metrics.jsonl belongs": (_entry("metrics.jsonl", "fifo"), [], {},
                                             "is a FIFO, not a regular file"),
        "FIFO where the lock file belongs": (_entry(".lock", "fifo"), [], {},
                                             "is a FIFO, not a regular file"),
        "directory where the checkpoint index belongs": (
            _entry("checkpoints/checkpoint", "directory"), [], {},
            "is a directory, not a regular file"),
        "a directory of the user's files": (_entry("notes.txt", "file"), [], {},
                                            "holds files this program did not write"),
        "--model_dir a file": (lambda d, t: d.write_text("the user's own file\n") and None,
                               [], {}, "is a file, not a directory"),
    },
}


def _snapshot(directory: Path):
    """Every entry under `directory`: its kind, and a file's bytes and
    modification time (the lock file, which any run takes, aside)."""
    if not directory.exists() and not directory.is_symlink():
        return None
    if not directory.is_dir():
        return directory.read_bytes()
    return {p: (p.is_dir(), p.is_file() and (p.read_bytes(), p.stat().st_mtime_ns))
            for p in directory.rglob("*") if p.name != LOCK_NAME}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps, for the file cases to damage copies of."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    assert_ok(train([*FLAGS, f"--model_dir={model_dir}"]))
    return model_dir


@pytest.mark.parametrize("source, case", [(source, case) for source, cases in CASES.items()
                                          for case in cases])
def test_bad_input_to_train_is_one_error_line_and_changes_nothing(
        source, case, tmp_path, request, monkeypatch):
    make, flags, environment, fragment = CASES[source][case]
    model_dir = tmp_path / "run"
    if source == "file":
        shutil.copytree(request.getfixturevalue("trained"), model_dir)
        flags = ["--train_steps=8", *flags]
    extra = (make(model_dir, tmp_path) if make else None) or []
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    before = _snapshot(model_dir)
    result = train([*FLAGS, *flags, *extra, f"--model_dir={model_dir}"])
    assert_one_error_line(result, fragment)
    assert _snapshot(model_dir) == before, "--model_dir changed"
