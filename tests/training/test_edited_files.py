"""The files a run reads back from --model_dir, edited by hand: wrong types,
nested junk, numbers too large for a float. A resume either goes on (what is
not needed is passed over) or stops with one `error:` line naming the file;
never a traceback, and no file the run writes holds `Infinity` or `NaN`."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import SMOKE_FLAGS, assert_ok, assert_one_error_line, train

FLAGS = [*SMOKE_FLAGS, "--train_steps=4", "--noevaluate", "--checkpoint_every_steps=2"]


def _edit(name: str, change):
    """`change(the JSON object in file `name`)` written back as text: a
    callable returning the new text."""
    def edit(model_dir: Path):
        path = model_dir / name
        path.write_text(change(json.loads(path.read_text())))
    return edit


def _with(**fields):
    return lambda record: json.dumps({**record, **fields})


def _flat(record: dict) -> str:
    """config.json as runs wrote it before the sections: every flag at the top."""
    from distributed_mpt.config import SECTIONS

    return json.dumps({**{k: v for name in SECTIONS for k, v in record[name].items()},
                       **{k: v for k, v in record.items() if k not in SECTIONS}})


def _in_section(section: str, **fields):
    return lambda record: json.dumps({**record, section: {**record[section], **fields}})


def _metrics_line(line: str):
    def edit(model_dir: Path):
        with open(model_dir / "metrics.jsonl", "a") as f:
            f.write(line + "\n")
    return edit


# case: (edit, steps of the run that follows, the error line's fragment or
# None for a run that goes on)
CASES = {
    # Written in sections; an old run's flat file resumes and is compared alike.
    "config.json: in sections": (_edit("config.json", json.dumps), 8, None),
    "config.json: another seed in its section": (
        _edit("config.json", _in_section("run", seed=3)), 8, "changes --seed=3 to 0"),
    "config.json: flat, as before sections": (_edit("config.json", _flat), 8, None),
    "config.json: flat, another seed": (
        _edit("config.json", lambda r: json.dumps({**json.loads(_flat(r)), "seed": 3})), 8,
        "changes --seed=3 to 0"),
    # A section of another kind was read as a flag: "Pass --model=['resnet9']".
    "config.json: a section a list": (_edit("config.json", _with(model=["resnet9"])), 8,
                                      "config.json is damaged (its 'model' section is "
                                      "[\"resnet9\"], where this program writes an object of "
                                      "flags); it records the flags"),
    "config.json: a section a string": (_edit("config.json", _with(run="x")), 8,
                                        "damaged (its 'run' section is \"x\", where"),
    "config.json: a section a number": (_edit("config.json", _with(data=3)), 8,
                                        "damaged (its 'data' section is 3, where"),
    "config.json: a section null": (_edit("config.json", _with(optimizer=None)), 8,
                                    "damaged (its 'optimizer' section is null, where"),
    # Its remedy says: "remove it to resume without comparing them"; removed, it was
    # "damaged (no 'dataset')", and the run could not resume at all.
    "config.json: removed": (lambda model_dir: (model_dir / "config.json").unlink(), 8, None),
    "config.json: a list": (_edit("config.json", lambda r: json.dumps([r])), 8,
                            "config.json is damaged (a JSON list, not an object)"),
    "config.json: earlier not a list": (_edit("config.json", _with(earlier="junk")), 8,
                                        "config.json is damaged ('earlier' is not a list"),
    "config.json: earlier of numbers": (_edit("config.json", _with(earlier=[1, 2])), 8,
                                        "config.json is damaged ('earlier' is not a list"),
    # A flag of a type never written there was compared as it was: "changes
    # --learning_rate=0.1 to 0.1. Pass --learning_rate=0.1", for the string "0.1".
    "config.json: a flag of nested junk": (
        _edit("config.json", _with(learning_rate={"a": [[[1]]]})), 8,
        "config.json is damaged (its 'learning_rate' is {\"a\": [[[1]]]}, where this program "
        "writes a number)"),
    "config.json: a rate as a string": (
        _edit("config.json", _in_section("optimizer", learning_rate="0.1")), 8,
        "config.json is damaged (its 'learning_rate' is \"0.1\", where this program writes a "
        "number); it records the flags"),
    "config.json: a choice as true": (
        _edit("config.json", _in_section("augmentation", flip=True)), 8,
        "(its 'flip' is true, where this program writes a string)"),
    "config.json: a width of 64.5": (
        _edit("config.json", _in_section("model", model_width=64.5)), 8,
        "(its 'model_width' is 64.5, where this program writes a whole number)"),
    "config.json: a width of 64.0": (_edit("config.json", _in_section("model", model_width=64.0)),
                                     8, None),
    # A flag it lacks (an older version's file) was the default, and is said to be.
    "config.json: the model removed": (
        _edit("config.json", lambda r: json.dumps({**r, "model": {"model_width": 64}})), 8,
        "changes --model=resnet9 (the default: its config.json does not record it) to mlp. "
        "Pass --model=resnet9"),
    "config.json: a huge seed": (_edit("config.json", _with(seed=10**30)), 8, "changes --seed"),
    "config.json: a number beyond a float": (
        _edit("config.json", lambda r: json.dumps(r).replace('"seed": 0', '"seed": 1e400')), 8,
        "config.json is damaged (not JSON: 1e400 is too large a number"),
    "config.json: resolved of junk": (
        _edit("config.json", lambda r: json.dumps({**r, "resolved": {
            "total_steps": "many", "peak_learning_rate": [1], "model_source": None}})), 8, None),
    "summary.json: steps a string": (_edit("summary.json", _with(steps="4")), 4,
                                     "summary.json is damaged ('steps' is a str)"),
    "summary.json: results of junk": (_edit("summary.json", _with(eval_accuracy={"x": []})), 4,
                                      None),
    "model.json: shapes of junk": (_edit("checkpoints/model.json",
                                         _with(variable_shapes=[[1, "x"], 3])), 8,
                                   "model.json is damaged (its variable_shapes"),
    # Said as "a different model ('mlp', 12230010 parameters) than this run's ('mlp', 12230010)".
    "model.json: a key added": (_edit("checkpoints/model.json", _with(note="mine")), 8,
                                "('mlp', 12230010; its model.json differs in note)"),
    "metrics.jsonl: elapsed beyond a float": (
        _metrics_line('{"step": 1, "elapsed_seconds": 1e400}'), 8, None),
    "metrics.jsonl: a huge step": (_metrics_line('{"step": 1000000000000000000000000000000, '
                                                 '"elapsed_seconds": 1}'), 8, None),
    "metrics.jsonl: a loss of junk": (_metrics_line('{"step": 4, "elapsed_seconds": 1, '
                                                    '"loss": [1], "epoch": "x"}'), 8, None),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 4 steps, for each case to edit a copy of."""
    model_dir = tmp_path_factory.mktemp("finished") / "run"
    assert_ok(train([*FLAGS, f"--model_dir={model_dir}"]))
    return model_dir


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} in a file this program wrote")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("case", CASES)
def test_an_edited_file_is_passed_over_or_one_error_line(case, finished, tmp_path):
    edit, steps, fragment = CASES[case]
    model_dir = tmp_path / "run"
    shutil.copytree(finished, model_dir)
    edit(model_dir)
    result = train([*FLAGS, f"--train_steps={steps}", f"--model_dir={model_dir}"])
    if fragment:
        assert_one_error_line(result, fragment)
    else:
        assert_ok(result)
    assert "Traceback" not in result.stderr
    for name in ("config.json", "summary.json", "checkpoints/model.json"):
        _strict_json((model_dir / name).read_text())
    if fragment is None:  # rewritten by the run: every line standard JSON
        for line in (model_dir / "metrics.jsonl").read_text().splitlines():
            _strict_json(line)
