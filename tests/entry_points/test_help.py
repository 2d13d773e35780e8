"""Every entry point's --help reads as written: no sentences run together,
no command line swallowed by a backslash, every flag filed under its own
program, and training's help says what each recipe is, reached and sets."""

import re

import pytest

from conftest import REPO, assert_ok, run_module

ENTRY_POINTS = ["distributed_mpt.train", "distributed_mpt.predict", "distributed_mpt.launch",
                "distributed_mpt.benchmark", "distributed_mpt.prepare_data",
                "distributed_mpt.recipes.measure", "distributed_mpt.recipes.ledger",
                "distributed_mpt.benchmark.scaling"]
RECIPES = REPO / "distributed_mpt" / "recipes"

# "word.Word": two sentences whose strings were joined without a space
# (a CamelCase name such as errors.ExitCode is not a sentence).
_JOINED = re.compile(r"[a-z0-9)][.;:,][A-Z][a-z]+\b")
# A long run of spaces inside a line, not after a label's colon: a line of
# a docstring whose trailing backslash joined it to the next one.
_SWALLOWED = re.compile(r"[^:\s] {8,}\S")


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_has_no_lines_run_together(module):
    result = run_module(module, ["--help"])
    assert_ok(result)
    text = result.stdout
    for line in text.splitlines():
        assert not _JOINED.search(line), f"run together: {line!r}"
        assert not _SWALLOWED.search(line), f"two lines joined by a backslash: {line!r}"
    # Flags defined through cli.define_integer/define_float belong to the entry point.
    assert "distributed_mpt.cli:" not in text


def test_train_help_says_what_each_recipe_is_reached_and_sets():
    result = run_module("distributed_mpt.train", ["--help"])
    assert_ok(result)
    section = result.stdout.split("\nRecipes (", 1)[1]
    blocks = re.split(r"\n  (?=\S)", "\n" + section)[1:]
    for path in sorted(RECIPES.glob("*.flags")):
        lines = path.read_text().splitlines()
        name, summary = path.stem, lines[0].lstrip("# ")
        block = next((b for b in blocks if b.startswith(f"{name}: ")), None)
        assert block, f"no paragraph of its own for {name} in:\n{section}"
        # Its own first line, then what it reached, then what it sets, none glued to another's.
        assert block.splitlines()[0] == f"{name}: {summary}"
        flat = " ".join(block.split())
        assert " Measured: " in flat
        sets = flat.split(" Sets: ", 1)[1]
        assert sets == " ".join(line for line in lines if line.startswith("--"))


@pytest.mark.parametrize("module", ["distributed_mpt.train", "distributed_mpt.prepare_data",
                                    "distributed_mpt.benchmark.cli",
                                    "distributed_mpt.benchmark.scaling"])
def test_an_entry_point_without_positional_arguments_refuses_one(module, capsys):
    # One rule, in cli.parse, for every program that takes only --flags: a
    # stray word (a value whose flag lost its `=`) is one error line, exit 2.
    import importlib

    assert importlib.import_module(module).main(["stray\x1b[2J"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: unexpected argument(s) ") and "all options are --flags" in error
    assert "\x1b" not in error and error.count("\n") == 1, error
