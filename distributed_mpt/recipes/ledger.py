"""The results ledger (records.py): every measured run of a recipe, one JSON
object a line in `ledger.jsonl` beside the recipes. The README's table,
each recipe's headline and the figures docs/recipes.md quotes are rendered
from it (render.py), and a test keeps them equal.

    python -m distributed_mpt.recipes.ledger [RECIPE]     every run, by set
    python -m distributed_mpt.recipes.ledger --check      do the README, the
                                                          recipes and the docs agree?
    python -m distributed_mpt.recipes.ledger --write      make them agree
    python -m distributed_mpt.recipes.ledger --time_tests=fast --conditions=quiet
                                                          time the tests into it
"""

from typing import Optional

from absl import flags

from distributed_mpt import cli, recipes
from distributed_mpt.errors import ConfigError
from distributed_mpt.recipes import render, suite
from distributed_mpt.recipes.records import (Ledger, load, percent, recorded_unit, variant,
                                             wall_seconds, wall_time)


def listing(ledger: Ledger, recipe: Optional[str] = None) -> str:
    """Every run (of `recipe`), set by set, as Markdown."""
    lines = []
    for name, runs in ledger.sets.items():
        if recipe and runs[0]["recipe"] != recipe:
            continue
        first = runs[0]
        lines += ["", f"## {name}: `{first['recipe']}` "
                      f"{variant(first['flags'], first['recipe']) or '(as shipped)'}",
                  f"{ledger.machines[first['machine']]['cpu']}; {first['command']}", "",
                  "| seed | commit | test accuracy | without TTA | wall time | examples/s | "
                  "conditions |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in runs:
            wall = wall_time(wall_seconds(r), recorded_unit(r))
            lines.append(f"| {r['seed']} | {r['commit'] or '?'} | {percent(r['eval_accuracy'])}"
                         f" | {percent(r.get('eval_accuracy_without_tta'))} | {wall} | "
                         f"{r.get('examples_per_second') or '—'} | {r.get('conditions') or ''} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_bool("check", False, "Check that the README, the recipes' headers and "
                      "docs/*.md say what the ledger says; exit 1 and show where not.",
                      flag_values=fv)
    flags.DEFINE_bool("write", False, "Render the ledger's figures into those files.",
                      flag_values=fv)
    flags.DEFINE_bool("count_tests", True, "With --check or --write: count the tests afresh "
                      "(pytest --collect-only, a minute or more) for the README's test suite "
                      "lines; --nocount_tests takes the counts the README states.",
                      flag_values=fv)
    flags.DEFINE_enum("time_tests", None, ["fast", "all"], "Run the fast tier (-m 'not "
                      "slow') or all the tests, timed, and record the run in the ledger.",
                      flag_values=fv)
    flags.DEFINE_string("conditions", None, "With --time_tests: what else ran on the machine "
                        "(\"quiet\", \"two busy loops at nice 10\"); required.", flag_values=fv)
    return fv


def main(argv=None) -> int:
    """Lists the ledger, checks or writes what is rendered from it, or times
    the tests into it; returns the exit code."""
    return cli.run_main(__doc__, _flag_values(), _run, argv)


def _run(fv, argv) -> int:
    rest = cli.parse("ledger", fv, argv, positionals=True)
    if fv.check or fv.write:
        if rest or fv.check == fv.write or fv.time_tests:
            raise ConfigError("--check or --write, one of them, and nothing else")
        return render.main(write=fv.write, collect=fv.count_tests)
    if fv.time_tests:
        if not fv.conditions:
            raise ConfigError("--time_tests needs --conditions: what else ran on the machine "
                              "(a time means little without it)")
        return suite.time_tests(fv.time_tests, fv.conditions)
    if len(rest) > 1:
        raise ConfigError(f"one recipe at most, not {' '.join(rest)}")
    if rest and rest[0] not in recipes.names():
        raise ConfigError(f"{rest[0]} is not one of the shipped recipes: "
                          f"{', '.join(recipes.names())}")
    print(listing(load(), *rest), end="")
    return 0


if __name__ == "__main__":
    cli.console_script(main, exit_at_once=False)
