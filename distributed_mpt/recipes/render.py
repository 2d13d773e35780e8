"""What the README, the recipes' headers and docs/recipes.md say about the
measured runs, rendered from the results ledger (records.py), and the check
that they say it: `python -m distributed_mpt.recipes.ledger --check` (what a
test runs) or `--write`.

Where the figures go:
  the README      its "What to expect" table, between <!-- ledger:table -->
                  and <!-- /ledger -->; the quick start's ratio; the test
                  suite's size and its last timed run (a fresh collection
                  counts the tests)
  a recipe        the "# Measured" lines of its header
  docs/*.md       every <!-- ledger:KIND ARGS -->...<!-- /ledger --> span:
                  headline RECIPE, stats SETS, mean SETS, each SETS, plain
                  SETS, minutes SETS, seconds SETS, peak SETS (the largest peak
                  resident memory), ratio SET, session NAME (SETS: set names
                  joined by "+", optionally " seeds=A-B")
"""

import itertools
import re
import sys
import textwrap
from pathlib import Path
from typing import List, Optional

from distributed_mpt import files, recipes
from distributed_mpt.errors import ConfigError
from distributed_mpt.recipes import CIFAR10_TRAIN_EXAMPLES, records, suite
from distributed_mpt.recipes.records import (REPO, Ledger, statistics_of, variant, wall_seconds,
                                             wall_time)

# The machine whose run the README's "The 2.0 GHz Xeon's N min" states (its table's
# Xeon column).
XEON = "xeon-amx"
# A variant of a recipe measured over this many seeds is shown beside it in
# the README (the record's SiLU beside cpu_cnn94_muon's GELU); single runs
# of a variant (the ablations) stay in the ledger and docs/recipes.md.
_README_VARIANT_RUNS = 5
_MARKED = re.compile(r"(<!-- ledger:([^>]*?) -->)(.*?)(<!-- /ledger -->)", re.DOTALL)
_MEASURED = re.compile(r"^# Measured.*\n(?:#   .*\n)*", re.MULTILINE)


def _mean(value: float) -> str:
    """A mean in percent to 2 decimals, or 3 where the third is a 5 (93.995:
    rounding would put it on one side of 94.0 or the other)."""
    return f"{value:.3f}" if round(value * 1000) % 10 == 5 else f"{value:.2f}"


def _accuracy(runs: List[dict], key: str = "eval_accuracy") -> Optional[dict]:
    values = [100 * r[key] for r in runs if r.get(key) is not None]
    return statistics_of(values) if values else None


def _walls(runs: List[dict]) -> List[float]:
    return [wall_seconds(r) for r in runs if wall_seconds(r) is not None]


def _select(ledger: Ledger, spec: str) -> List[dict]:
    """The runs of "SET+SET seeds=A-B"."""
    names, _, seeds = spec.partition(" seeds=")
    runs = []
    for name in names.split("+"):
        if name not in ledger.sets:
            raise ConfigError(f"the ledger has no set {name!r}")
        runs += ledger.sets[name]
    if seeds:
        first, last = (int(s) for s in seeds.split("-"))
        runs = [r for r in runs if first <= r["seed"] <= last]
    return runs


def headline_set(ledger: Ledger, recipe: str, column: Optional[str] = None) -> List[dict]:
    """The runs that speak for `recipe` (on `column`'s machines): of the sets
    of its flags as shipped, the one with the most runs; on a tie, one run
    alternating with another recipe (its time is then a ratio measured side
    by side, which the headline states), then the latest."""
    candidates = [runs for runs in ledger.sets.values() if runs[0]["recipe"] == recipe
                  and not variant(runs[0]["flags"], recipe)
                  and (column is None or ledger.column(runs[0]) == column)]
    return max(reversed(candidates), key=lambda runs: (len(runs), bool(ledger.baselines(runs))),
               default=[])


def time_ratio(ledger: Ledger, runs: List[dict]) -> Optional[float]:
    """The runs' mean wall time over that of the recipe they alternated with
    in their sessions (None if they did not)."""
    baselines = ledger.baselines(runs)
    if not baselines or not _walls(runs):
        return None
    return statistics_of(_walls(runs))["mean"] / statistics_of(_walls(baselines))["mean"]


def _unfinished(run: dict) -> str:
    """A run stopped before its end: its rate, what its epochs would take, its curve."""
    rate = run["examples_per_second"]
    epochs = float(records.recipe_flags(run["recipe"]).get("epochs", 0))
    curve = ", ".join(f"{100 * e['eval_accuracy']:.1f}% after {e['epoch']} epochs"
                      for e in run.get("evaluations", []))
    return (f"{rate} examples/s, so {epochs:g} epochs take about "
            f"{epochs * CIFAR10_TRAIN_EXAMPLES / rate / 3600:.1f} h; {curve} (one run, stopped "
            f"at step {run['steps']})")


def _per_session(ledger: Ledger, runs: List[dict]) -> str:
    """ (15.4, 13.0 min in its 2 sessions: ...)" where the runs span sessions."""
    sessions = list(dict.fromkeys(r["session"] for r in runs if r["session"]))
    if len(sessions) < 2:
        return ""
    means = [statistics_of(_walls([r for r in runs if r["session"] == s]))["mean"]
             for s in sessions]
    return (" (" + ", ".join(wall_time(m, with_unit=False) for m in means) +
            f" min in its {len(sessions)} "
            f"sessions: the machine's speed varies by the day)")


def _peaks(runs: List[dict]) -> List[int]:
    """The peak resident memory of each run that recorded one."""
    return [r["peak_memory_bytes"] for r in runs if r.get("peak_memory_bytes")]


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def summary(ledger: Ledger, runs: List[dict], bold: bool = False, long: bool = False,
            where: bool = False, brief: bool = False) -> str:
    """A set in a phrase: what it reached, in what time, and how fast
    against the recipe it alternated with; `long`: with the 95% interval
    and the time of each session; `where`: on which CPU; `brief`: without
    the commit (a recipe header's other machines, which must fit 10 lines)."""
    first, stars = runs[0], "**" if bold else ""
    accuracy, walls, ratio = _accuracy(runs), _walls(runs), time_ratio(ledger, runs)
    if accuracy is None:
        text = _unfinished(first)
    elif accuracy["n"] == 1:
        text = f"{stars}{_mean(accuracy['mean'])}%{stars} in 1 run"
    else:
        low, high = accuracy["interval"]
        text = (f"{stars}{_mean(accuracy['mean'])}%{stars} mean of {accuracy['n']} runs "
                f"({accuracy['min']:.2f}-{accuracy['max']:.2f}%" +
                (f"; sd {accuracy['std']:.2f}, 95% interval {low:.2f}-{high:.2f}%)" if long
                 else f", sd {accuracy['std']:.2f})"))
    if walls and accuracy is not None:
        text += f", {wall_time(statistics_of(walls)['mean'])}{' mean' if len(walls) > 1 else ''}"
        text += _per_session(ledger, runs) if long else ""
    peaks = _peaks(runs)
    if peaks and accuracy is not None:
        measured = (f" (the largest of {len(peaks)} runs)" if len(peaks) == len(runs) > 1 else
                    f" (measured in {len(peaks)} of its {len(runs)} runs)"
                    if len(peaks) < len(runs) else "")
        text += f", peak resident memory {_gigabytes(max(peaks))}{measured}"
    if ratio is not None:
        text += (f", {stars}{ratio:.2f}x{stars} the time of `{first['against']}`, run "
                 f"alternating with it")
        if long:
            baseline = statistics_of(_walls(ledger.baselines(runs)))["mean"]
            text += f" (`{first['against']}`: {wall_time(baseline)} mean in those sessions)"
    if where:
        text += f", on {ledger.machines[first['machine']]['cpu']} ({first['precision']})"
    commits = list(dict.fromkeys(r["commit"] for r in runs if r["commit"]))
    if commits and not brief:
        text += f", at {' and '.join(commits)}"
    if any(r.get("shared") for r in runs):
        text += ", the machine shared" if brief else ", other work sharing the machine"
    return text


def headline(ledger: Ledger, recipe: str) -> str:
    """The recipe's headline: its headline set and where it was measured."""
    runs = headline_set(ledger, recipe)
    return summary(ledger, runs, where=True) if runs else "not measured"


def recipe_block(ledger: Ledger, recipe: str) -> str:
    """The "# Measured" lines of the recipe's header."""
    lines = [f"# Measured (every run, from the results ledger: python -m "
             f"distributed_mpt.recipes.ledger {recipe}):"]
    best = headline_set(ledger, recipe)
    text = headline(ledger, recipe) + "."
    others = [(column, headline_set(ledger, recipe, column)) for column in _columns(ledger)]
    others = [f"on a {column.replace('`', '')}: {summary(ledger, runs, brief=True)}"
              for column, runs in others if runs and runs is not best]
    if others:
        text += " Also " + "; ".join(others) + "."
    lines += textwrap.wrap(text, 84, initial_indent="#   ", subsequent_indent="#   ")
    return "\n".join(lines) + "\n"


def _columns(ledger: Ledger) -> List[str]:
    """The machines a recipe ran on (one that only timed the tests is no column)."""
    ran = {run["machine"] for run in ledger.runs}
    return list(dict.fromkeys(m["column"] for name, m in ledger.machines.items() if name in ran))


def _expected(recipe: str) -> str:
    """What the recipe's header expects elsewhere ("# Expected ...: TEXT")."""
    with open(recipes.path(recipe)) as f:
        for line in f:
            if line.startswith("# Expected"):
                return line.split(":", 1)[1].strip()
    return "—"


def table(ledger: Ledger) -> str:
    """The README's "What to expect" table: a row per recipe, a column per CPU."""
    columns = _columns(ledger)
    names = sorted(recipes.names(), key=lambda n: -(_accuracy(headline_set(ledger, n)) or
                                                    {"mean": 0})["mean"])
    lines = ["| recipe | " + " | ".join(columns) + " | expected elsewhere |",
             "| --- " * (len(columns) + 2) + "|"]
    for name in names:
        best, cells = headline_set(ledger, name), []
        for column in columns:
            sets = [runs for runs in ledger.sets.values() if runs[0]["recipe"] == name
                    and ledger.column(runs[0]) == column]
            shipped = sorted((s for s in sets if not variant(s[0]["flags"], name)),
                             key=lambda s: (s is not best, -len(s), -ledger.runs.index(s[-1])))
            variants = {}  # newest first, by what differs
            for s in reversed(sets):
                if variant(s[0]["flags"], name) and len(s) >= _README_VARIANT_RUNS:
                    variants.setdefault(variant(s[0]["flags"], name), []).append(s)
            parts = [summary(ledger, s, bold=s is best, long=True) for s in shipped] + [
                f"with `{label}`: " + "; ".join(summary(ledger, s) for s in group)
                for label, group in variants.items()]
            cells.append("; ".join(parts) if parts else "not measured")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {_expected(name)} |")
    return "\n".join(lines)


def session_table(ledger: Ledger, session: str) -> str:
    """The runs of one session in the order they ran, consecutive runs of
    one set in one row."""
    runs = [r for r in ledger.runs if r["session"] == session]
    if not runs:
        raise ConfigError(f"the ledger has no session {session!r}")
    rows, order = [], 1
    for _, consecutive in itertools.groupby(runs, key=lambda run: run["set"]):
        group = list(consecutive)
        differs = variant(group[0]["flags"], group[0]["recipe"])
        label = f"`{group[0]['recipe']}` " + (f"`{differs}`, " if differs else "")
        label += ("seed " if len(group) == 1 else "seeds ") + ", ".join(str(r["seed"])
                                                                         for r in group)
        plain = ", ".join(f"{100 * r['eval_accuracy_without_tta']:.2f}" for r in group)
        # One unit a row: seconds if every run of it was timed in seconds.
        unit = "s" if all(records.recorded_unit(r) == "s" for r in group) else "min"
        walls = ", ".join(wall_time(wall_seconds(r), unit, with_unit=False) for r in group)
        span = str(order) if len(group) == 1 else f"{order}-{order + len(group) - 1}"
        rows.append(f"| {span} | {label} | " + ", ".join(f"{100 * r['eval_accuracy']:.2f}%"
                                                        for r in group) +
                    f" ({plain}) | {walls} {unit} |")
        order += len(group)
    return "\n".join(["| order | run | test accuracy (without TTA) | wall time |",
                      "| --- | --- | --- | --- |", *rows])


def fragment(ledger: Ledger, kind: str, argument: str) -> str:
    """The text of a <!-- ledger:KIND ARGUMENT --> span."""
    if kind == "table":
        return "\n" + table(ledger) + "\n"
    if kind == "headline":
        return headline(ledger, argument)
    if kind == "session":
        return "\n" + session_table(ledger, argument) + "\n"
    runs = _select(ledger, argument)
    accuracy = _accuracy(runs)
    if kind == "stats":
        low, high = accuracy["interval"]
        return (f"n = {accuracy['n']}, mean **{_mean(accuracy['mean'])}%**, sd "
                f"{accuracy['std']:.2f}, 95% interval of the mean {low:.2f}-{high:.2f}%, every "
                f"run at least {accuracy['min']:.2f}%")
    if kind == "each":
        if len(runs) == 1:
            return f"{100 * runs[0]['eval_accuracy']:.2f}%"
        return (f"**{_mean(accuracy['mean'])}%** (" +
                ", ".join(f"{100 * r['eval_accuracy']:.2f}" for r in runs) + ")")
    if kind == "mean":
        return f"{_mean(accuracy['mean'])}% mean of {accuracy['n']}"
    if kind == "seconds":
        return wall_time(statistics_of(_walls(runs))["mean"], "s")
    if kind == "plain":
        return f"{_mean(_accuracy(runs, 'eval_accuracy_without_tta')['mean'])}%"
    if kind == "peak":
        if not _peaks(runs):
            raise ConfigError(f"no run of {argument!r} in the ledger recorded its peak memory")
        return _gigabytes(max(_peaks(runs)))
    if kind == "minutes":
        walls = statistics_of(_walls(runs))
        return wall_time(walls["min"]) if walls["n"] == 1 else \
            f"{wall_time(walls['min'], with_unit=False)}-{wall_time(walls['max'])}"
    if kind == "ratio":
        pairs, base = ledger.pair_ratios(runs), _walls(ledger.baselines(runs))
        mean, base_mean = statistics_of(_walls(runs))["mean"], statistics_of(base)["mean"]
        return (f"{wall_time(mean, 's')} against {wall_time(base_mean, 's')}, "
                f"**{mean / base_mean:.3f}x** (each run "
                f"against the `{runs[0]['against']}` run before it: {min(pairs):.2f}-"
                f"{max(pairs):.2f})")
    raise ConfigError(f"<!-- ledger:{kind} --> is not a kind of figure the ledger renders")


def render_marked(ledger: Ledger, text: str) -> str:
    def one(match):
        kind, _, argument = match.group(2).partition(" ")
        return match.group(1) + fragment(ledger, kind, argument) + match.group(4)
    return _MARKED.sub(one, text)


# Figures the README states outside the table, in its words: (pattern whose
# group 2 is the figure, the figure from the ledger).
_README_QUOTES: List[tuple] = [
    # The quick start: how much longer cpu_cnn94 takes than cpu_cnn94_muon.
    (re.compile(r"(airbench94 whole, which took )([0-9.]+)(x)"),
     lambda ledger: "{:.2f}".format(
         1 / time_ratio(ledger, headline_set(ledger, "cpu_cnn94_muon")))),
    # Below the table: cpu_cnn94's run on the Xeon, in whole minutes.
    (re.compile(r"(The 2\.0 GHz Xeon's )([0-9]+)( min)"), lambda ledger: wall_time(
        statistics_of(_walls(headline_set(ledger, "cpu_cnn94", ledger.machines[XEON]["column"])))
        ["mean"], digits=0, with_unit=False)),
]


def quoting(path: Path) -> str:
    """The text of `path`, a file that quotes the ledger: DamagedFileError
    if it is anything but UTF-8 text in a regular file (a directory, a
    FIFO, which hung --check and --write, or bytes of no text ended them
    with a traceback)."""
    text = files.read_text(str(path), "restore it from version control")
    if text is None:
        raise files.DamagedFileError(f"{path} is gone; restore it from version control")
    return text


def rendered(ledger: Ledger, counts: Optional[dict]) -> dict:
    """{path: its text as the ledger has it} for every file that quotes it."""
    text = render_marked(ledger, quoting(REPO / "README.md"))
    for pattern, figure in _README_QUOTES:
        text = pattern.sub(lambda m: m.group(1) + figure(ledger) + m.group(3), text)
    out = {REPO / "README.md": suite.render(ledger, text, counts)}
    for path in sorted((REPO / "docs").glob("*.md")):
        out[path] = render_marked(ledger, quoting(path))
    for name in recipes.names():
        path = Path(recipes.path(name))
        old = quoting(path)
        if not _MEASURED.search(old):
            raise ConfigError(f"{path} has no '# Measured' line for the ledger's figures")
        out[path] = _MEASURED.sub(lambda m: recipe_block(ledger, name), old, count=1)
    return out


def main(write: bool, collect: bool = True) -> int:
    """Checks (or, `write`, makes) every file that quotes the ledger agree
    with it; `collect`: count the tests afresh. Returns the exit code: 1 if
    a check found files that disagree."""
    if not (REPO / "README.md").exists():
        raise ConfigError(f"--check and --write work in a source checkout; {REPO} has no "
                          f"README.md")
    ledger = records.load()
    differ = {path: text for path, text in rendered(ledger, suite.count_tests() if collect
                                                    else None).items()
              if quoting(path) != text}
    for path, text in differ.items():
        if write:
            files.write_text(str(path), text)
            print(f"wrote {path.relative_to(REPO)}")
        else:
            print(f"{path.relative_to(REPO)} disagrees with the ledger; "
                  f"`python -m distributed_mpt.recipes.ledger --write` renders it:")
            import difflib
            sys.stdout.writelines(list(difflib.unified_diff(
                quoting(path).splitlines(True), text.splitlines(True), n=0))[2:40])
    return 1 if differ and not write else 0
