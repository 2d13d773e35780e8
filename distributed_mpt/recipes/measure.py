"""Run a recipe over several seeds and tabulate what it reached: n, the
mean, the standard deviation and a 95% interval of the mean, and every run.

    python -m distributed_mpt.recipes.measure --recipe=cpu_cnn94 --seeds=0-4 \\
        --runs_dir=runs/cnn94 -- --data_dir=DIR --nodownload

Each seed trains with the real entry point, one after the other, into
RUNS_DIR/seed-S; the flags after `--` go to every run. It is resumable:
started again, a finished seed is read back as it is and a stopped one
resumes from its checkpoint (distributed-mpt-train's own rules), so a
measurement cut short by a reboot costs at most the steps since a
checkpoint. The table goes to stdout and to RUNS_DIR/results.md, and each
finished run into the results ledger (--ledger; by default the one beside
the recipes, in a source checkout the repository's), from which
`python -m distributed_mpt.recipes.ledger --write` renders the figures the
README and the recipes state.
"""

import os
import signal
import subprocess
import sys
from typing import List

from absl import flags

from distributed_mpt import cli, files, recipes
from distributed_mpt.errors import ConfigError, ExitCode, quoted
from distributed_mpt.process import stopping
from distributed_mpt.recipes import records
from distributed_mpt.recipes.records import percent, statistics_of, wall_time


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_enum("recipe", None, recipes.names(), "The recipe to measure.", flag_values=fv)
    flags.DEFINE_string("seeds", "0-4", "Seeds: a range A-B, or a list A,B,C.", flag_values=fv)
    flags.DEFINE_string("runs_dir", None, "Where each seed's run goes (RUNS_DIR/seed-S) and "
                        "results.md (default runs/RECIPE).", flag_values=fv)
    flags.DEFINE_string("ledger", records.PATH, "The results ledger each finished run is added "
                        "to (with this machine, the commit and the flags), from which the "
                        "README and the recipes' figures are rendered; '' for none.",
                        flag_values=fv)
    flags.DEFINE_string("conditions", None, "What else ran on the machine meanwhile, for the "
                        "ledger (\"quiet\", \"tests at nice 10\").", flag_values=fv)
    flags.DEFINE_bool("shared", False, "Other work used the cores meanwhile: the ledger marks the "
                      "runs, and their figures say so (their wall times are not the machine's).",
                      flag_values=fv)
    return fv


def seeds_of(text: str) -> List[int]:
    """"0-4" -> [0, 1, 2, 3, 4]; "1,5" -> [1, 5]; ConfigError otherwise."""
    parts = text.split("-") if "-" in text else text.split(",")
    # Decimal digits only (cli.py); the range is counted before it is made.
    if not all(cli.is_decimal_integer(part) for part in parts) or ("-" in text and len(parts) != 2):
        raise ConfigError(f"--seeds={quoted(text)} is not a range A-B or a list A,B,C")
    numbers = [int(part) for part in parts]
    count = numbers[1] - numbers[0] + 1 if "-" in text else len(numbers)
    if not 1 <= count <= 1000:
        raise ConfigError(f"--seeds={quoted(text)} must name 1 to 1000 seeds, none negative")
    if "-" not in text and len(set(numbers)) != len(numbers):  # one run, counted twice
        raise ConfigError(f"--seeds={quoted(text)} names a seed twice")
    return list(range(numbers[0], numbers[1] + 1)) if "-" in text else numbers


# What measure gives each seed's run itself: given after `--` too, the last
# would win, and every seed would train alike (the ledger then held one run
# as several seeds) or into one --model_dir.
_OWN_FLAGS = {"seed": "--seeds", "model_dir": "--runs_dir", "recipe": "--recipe"}


def _refuse_own_flags(train_flags: List[str]) -> None:
    """Raises ConfigError if a training flag after `--` is one measure sets."""
    for arg in train_flags:
        name = arg.lstrip("-").partition("=")[0]
        if arg.startswith("-") and name in _OWN_FLAGS:
            raise ConfigError(f"--{name} after -- is measure's to give each seed's run (seed S "
                              f"trains with --seed=S into RUNS_DIR/seed-S): use "
                              f"{_OWN_FLAGS[name]} before --")


def table(recipe: str, summaries: List[dict]) -> str:
    """The results as Markdown: the statistics of the test accuracy (of the
    runs that were evaluated: not with --noevaluate), then one row per run."""
    evaluated = [s["eval_accuracy"] for s in summaries if s.get("eval_accuracy") is not None]
    if evaluated:
        stats = statistics_of(evaluated)
        low, high = stats["interval"]
        head = f"`{recipe}`: n = {stats['n']}, mean {100 * stats['mean']:.2f}%"
        if stats["n"] > 1:  # one run has no spread to state (it would print nan)
            head += (f", standard deviation {100 * stats['std']:.2f} points, 95% interval of "
                     f"the mean {100 * low:.2f}-{100 * high:.2f}% (Student's t)")
    else:
        head = (f"`{recipe}`: {len(summaries)} run(s), none evaluated (--noevaluate): no test "
                f"accuracy")
    lines = [head, "", "| seed | test accuracy | without TTA | wall time | examples/s | device |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        lines.append(f"| {s['seed']} | {percent(s.get('eval_accuracy'))} | "
                     f"{percent(s.get('eval_accuracy_without_tta'))} | "
                     f"{wall_time(s.get('wall_seconds'))} | {s['examples_per_second']:.0f} | "
                     f"{s['device']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Measures the recipe over the seeds; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    own, train_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    fv = _flag_values()
    if cli.wants_help(own):
        return cli.show_help(__doc__, fv)
    return cli.guarded(lambda: _measure(fv, own, train_flags), on_interrupt=(
        "the finished runs are kept, nothing half-written; the same command resumes"))


def _finish(run: subprocess.Popen) -> int:
    """The exit status of a seed's `run`, once it has ended. A stop that
    measure receives (raised as KeyboardInterrupt: cli.guarded) is passed on
    to it as stopping.passed_on says: a SIGTERM or SIGHUP of measure alone
    left the run training on, orphaned, holding its --model_dir."""
    received = []
    while True:
        try:
            return run.wait()
        except KeyboardInterrupt as stop:
            received.append(signal.SIGTERM if isinstance(stop, stopping.Terminated)
                            else signal.SIGINT)
            run.send_signal(stopping.passed_on(received))


def _measure(fv: flags.FlagValues, own, train_flags) -> int:
    positionals = cli.parse("measure", fv, own, positionals=True)
    cli.check_path_flags(fv, "runs_dir", *["ledger"] * bool(fv.ledger))  # --ledger='': none
    if positionals:
        raise ConfigError("unexpected arguments: training flags go after --")
    if not fv.recipe:
        raise ConfigError("--recipe is required: the recipe to measure")
    _refuse_own_flags(train_flags)
    runs_dir = os.path.expanduser(fv.runs_dir or os.path.join("runs", fv.recipe))
    book = os.path.expanduser(fv.ledger)
    if book:  # a damaged or unwritable ledger is found now, not hours later
        files.check_replaceable(book, f"--ledger={quoted(book)}")
        try:
            files.check_writable(os.path.dirname(os.path.abspath(book)), "--ledger")
        except ConfigError as e:  # the default, in an installed package, may be read-only
            raise ConfigError(f"{e}: the ledger {quoted(book)} could not be written there; name "
                              f"another with --ledger, or --ledger='' for none") from None
        if os.path.lexists(book):
            records.load(book)
            closed = files.why_no_access(book, os.W_OK)  # appended to in place, not replaced
            if closed:
                raise ConfigError(f"--ledger={quoted(book)} is not writable ({closed}): make it "
                                  f"writable for this user, or name another with --ledger")
    summaries, finished = [], []
    for seed in seeds_of(fv.seeds):
        model_dir = os.path.join(runs_dir, f"seed-{seed}")
        command = stopping.helper_command("distributed_mpt.train", f"--recipe={fv.recipe}",
                                          f"--seed={seed}", f"--model_dir={model_dir}",
                                          *train_flags)
        print(f"[measure] seed {seed}: {' '.join(command[3:])}", flush=True)
        code = _finish(subprocess.Popen(command))
        if code != ExitCode.OK:
            # A refusal (bad flags, data) would only be met again.
            then = ("run the same command again to resume" if code < 0 or code >= 128 else
                    "mend what its error says, then run the same command again")
            print(f"[measure] seed {seed} ended with {code}; {then}", file=sys.stderr,
                  flush=True)
            return code if code > 0 else 128 - code
        summary_path = os.path.join(model_dir, "summary.json")
        summary = files.read_json(summary_path)
        summaries.append({**summary, "seed": seed})
        finished.append((seed, summary, summary_path))
    text = table(fv.recipe, summaries)
    files.write_text(os.path.join(runs_dir, "results.md"), text)
    files.write_json(os.path.join(runs_dir, "results.json"),
                     {"recipe": fv.recipe, "train_flags": train_flags, "runs": summaries})
    print(text, end="")
    # The ledger holds what recipes reach: a run without a test accuracy
    # (--noevaluate) would leave its figures nothing to say.
    finished = [run for run in finished if run[1].get("eval_accuracy") is not None]
    if book and finished:
        added = records.record_runs(book, fv.recipe, finished, train_flags, " ".join(
            ["python -m distributed_mpt.recipes.measure", *own, "--", *train_flags]),
            fv.conditions, fv.shared)
        print(f"[measure] {sum(r['kind'] == 'run' for r in added)} run(s) added to {book}; "
              f"`python -m distributed_mpt.recipes.ledger --write` renders the figures",
              flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    cli.console_script(main, exit_at_once=False)
