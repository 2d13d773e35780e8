"""The test suite's size and time, as the README states them: the count from
a fresh collection of tests/, the time from the last timed run the ledger
records (a `tests` record: when, at which commit, on what, beside what).

    python -m distributed_mpt.recipes.ledger --time_tests=fast --conditions=quiet

runs the fast tier timed and records it; `--check`/`--write` count afresh.
"""

import datetime
import re
import subprocess
import sys
import textwrap
import time
from typing import Optional

from distributed_mpt.errors import ConfigError
from distributed_mpt.recipes import records
from distributed_mpt.recipes.records import REPO, Ledger, wall_seconds, wall_time
# The README's lines on each suite: what finds them there, and how they begin.
_SUITES = {"all": (re.compile(r"# The tests \(.*?\n(?=pip install)", re.DOTALL),
                   "The tests (what CI runs, via .ci/run, in two test processes; the "
                   "network-namespace tests need root, and say why they skip without): "),
           "fast": (re.compile(r"# The fast tier.*?\n(?=python -m pytest -q tests -m)",
                               re.DOTALL),
                    "The fast tier, for every change: all but the tests of several workers, "
                    "network namespaces and pods and the longest single runs (marked slow): ")}
_SELECT = {"all": [], "fast": ["-m", "not slow"]}
_COLLECTED = re.compile(r"(\d+)/(\d+) tests collected|(\d+) tests? collected")


def count_tests() -> dict:
    """{"fast": n, "all": n}, from a fresh collection of tests/ (one
    collection: pytest says how many of all it selected)."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *_SELECT["fast"], "tests"],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    match = _COLLECTED.search(collected.stdout)
    if collected.returncode != 0 or not match:
        raise ConfigError(f"pytest --collect-only failed: {collected.stdout[-500:]}")
    fast = int(match.group(1) or match.group(3))
    return {"fast": fast, "all": int(match.group(2) or fast)}


def lines(ledger: Ledger, suite: str, count: int) -> str:
    """The README's lines on a suite: its size now, and its last timed run."""
    timed = [t for t in ledger.tests if t["suite"] == suite]
    text = _SUITES[suite][1] + f"{count} tests"
    if timed:
        last = timed[-1]
        # Minutes where only those were recorded, else to the second.
        took = wall_time(wall_seconds(last), "min" if last.get("wall_seconds") is None else "min s",
                         digits=0)
        when = last["date"] + (f", {last['commit']}" if last["commit"] else "") \
            if last["date"] else f"recorded in {last['recorded_in']}"
        text += (f"; the last timed run, of {last['tests']} tests ({when}), took {took} on "
                 f"{ledger.machines[last['machine']]['cpu']}, {last['conditions']}")
    else:
        text += "; its time not yet measured"
    return "\n".join(textwrap.wrap(text + ":", 92, initial_indent="# ",
                                   subsequent_indent="# ")) + "\n"


def render(ledger: Ledger, readme: str, counts: Optional[dict]) -> str:
    """`readme` with its suite lines rendered; `counts` None: as it states them."""
    for suite, (pattern, _) in _SUITES.items():
        count = counts[suite] if counts is not None else \
            int(re.search(r"(\d+) tests", pattern.search(readme).group(0)).group(1))
        readme = pattern.sub(lambda m: lines(ledger, suite, count), readme)
    return readme


def time_tests(suite: str, conditions: str, path: str = records.PATH,
               targets: tuple = ("tests",)) -> int:
    """Runs a suite (of `targets`: the whole of tests/ but in a test),
    timed, and records the run in the ledger in `path` (with this machine's
    record, if the ledger has none yet); returns pytest's code."""
    ledger = records.load(path)  # a damaged ledger is found now, not after the suite has run
    command = [sys.executable, "-m", "pytest", "-q", *targets, *_SELECT[suite]]
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - start
    sys.stdout.write(result.stdout[-2000:])
    outcome = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    tests = sum(int(n) for n in re.findall(r"(\d+) (?:passed|failed|skipped|xfailed|xpassed|"
                                           r"errors?)", outcome))
    machine, is_new = records.ledger_machine(list(ledger.machines.values()))
    new = [machine] if is_new else []
    new.append({"kind": "tests", "suite": suite, "tests": tests,
                "wall_seconds": round(seconds, 1),
                "command": f"python -m pytest -q {' '.join(targets)}" + (
                    " -m 'not slow'" if _SELECT[suite] else ""),
                "commit": records.code_commit(), "recorded_in": None,
                "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                "machine": machine["machine"], "conditions": conditions,
                "outcome": outcome})
    records.append(ledger.path, new)
    print(f"recorded in {ledger.path}: {tests} tests in {seconds:.0f} s ({outcome})")
    return result.returncode
