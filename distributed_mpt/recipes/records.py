"""The results ledger's records: every measured run of a recipe, one JSON
object a line in `ledger.jsonl` beside the recipes (the runs of a session in
the order they ran); read, checked, summed up and added to here (ledger.py
lists it and renders from it, measure.py adds to it).

Three kinds of record (`kind`):
  machine  `machine` (its key), `cpu` (what it is), `column` (the README
           column it is counted in: machines of one CPU class share one).
  run      `id`, `recipe`, `flags` (what the run's flagfile and command set,
           without where the data and the run live), `set` (the runs that
           are summed up together: one recipe, machine and flags), `session`
           (runs made in one sitting, in the ledger's order; null if alone),
           `against` (the recipe it alternated with, whose runs in the same
           sessions give its time ratio), `command`, `commit` (the code run;
           null if not known), `recorded_in` (the commit that first stated
           the figures), `date`, `machine`, `precision`, `seed`,
           `eval_accuracy`, `eval_accuracy_without_tta`, `wall_seconds` (or
           `wall_minutes` where only those were recorded), `examples_per_second`,
           `peak_memory_bytes` (the training process's peak resident memory),
           `shared` (other processes used the cores), `conditions`, `notes`;
           `evaluations` and `finished` where a run logged a curve or stopped early.
  tests    a timed run of the test suite: `suite`, `tests`, `wall_seconds`,
           `command`, `commit`, `recorded_in`, `date`, `machine`, `conditions`.
A field not known is null: nothing here is estimated.
"""

import contextlib
import fcntl
import json
import math
import os
import re
import statistics
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from distributed_mpt import files, json_lines
from distributed_mpt.errors import ConfigError
from distributed_mpt.json_lines import read_jsonl

PATH = str(resources.files(__package__) / "ledger.jsonl")
# The source checkout the package is in, when it is one: its README.md and
# docs/ quote the ledger, its tests/ are what --time_tests runs.
REPO = Path(__file__).resolve().parents[2]

# Flags that say where the data and the run live, or which seed: not what a
# recipe is. A run's `flags` leave them out, and so does a recipe compared
# with them.
_PLACE = frozenset({"data_dir", "download", "model_dir", "adopt_model_dir", "seed"})

# Two-sided 95% quantiles of Student's t for n - 1 degrees of freedom
# (n = 2..30); beyond, the normal's 1.96 is within 4%.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
          2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
          2.060, 2.056, 2.052, 2.048, 2.045)


def statistics_of(values: List[float]) -> dict:
    """n, mean, sample standard deviation, the 95% interval of the mean
    (Student's t), min and max."""
    n, mean = len(values), statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else math.nan
    half = (_T_975[n - 2] if n <= 30 else 1.96) * std / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": mean, "std": std, "interval": (mean - half, mean + half),
            "min": min(values), "max": max(values)}


def flags_of_text(text: str) -> Dict[str, object]:
    """The flags a flagfile (or a command's `--flag` words, one a line) sets:
    {name: value as written}, `--name` True and `--noname` False, the last
    of a name winning as absl has it; without the place flags (_PLACE)."""
    found = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("--"):
            continue
        name, equals, value = line[2:].partition("=")
        if not equals:
            name, value = (name[2:], False) if name.startswith("no") else (name, True)
        found[name] = value
    return {name: value for name, value in found.items() if name not in _PLACE}


def recipe_flags(recipe: str) -> Dict[str, object]:
    """What the shipped recipe sets now."""
    from distributed_mpt import recipes
    with open(recipes.path(recipe)) as f:
        return flags_of_text(f.read())


def as_flag(name: str, value) -> str:
    """`--name=value`, `--name` or `--noname`."""
    return f"--{name}" if value is True else f"--no{name}" if value is False else \
        f"--{name}={value}"


def variant(flags: dict, recipe: str) -> str:
    """How `flags` differ from what `recipe` sets now, as the flags that
    would make it so ("--activation=silu"); "" if they do not."""
    shipped = recipe_flags(recipe)
    differ = [as_flag(name, flags[name]) if name in flags else f"without --{name}"
              for name in [*shipped, *(n for n in flags if n not in shipped)]
              if flags.get(name) != shipped.get(name)]
    if len(differ) > 3:
        return f"another recipe's flags ({len(differ)} differ)"
    return " ".join(differ)


def wall_seconds(run: dict) -> Optional[float]:
    """The run's wall time in seconds, from whichever unit it was recorded in."""
    if run.get("wall_seconds") is not None:
        return run["wall_seconds"]
    return None if run.get("wall_minutes") is None else 60 * run["wall_minutes"]


def recorded_unit(run: dict) -> str:
    """The unit its wall time was recorded in: "s", or "min" where only minutes were."""
    return "s" if run.get("wall_seconds") is not None else "min"


def percent(value: Optional[float]) -> str:
    """An accuracy as the ledger's tables write it: 94.10%, or — for none."""
    return "—" if value is None else f"{100 * value:.2f}%"


def wall_time(seconds: Optional[float], unit: str = "min", digits: int = 1,
              with_unit: bool = True) -> str:
    """A wall time as every file the ledger renders states one: in `unit`
    "s" or "min" to `digits` decimals ("13.0 min"), or "min s", whole
    minutes and seconds ("11 min 32 s"); "—" if it is not known."""
    if seconds is None:
        return "—"
    if unit == "min s":
        whole = round(seconds)
        return f"{whole // 60} min {whole % 60} s"
    value = seconds / 60 if unit == "min" else seconds
    return f"{value:.{digits}f}" + (f" {unit}" if with_unit else "")


# A ledger is mended by hand, or restored from version control.
_REMEDY = "mend it, or restore it from version control"
_TEXT, _NUMBER = (str, type(None)), (int, float, type(None))
# What each kind of record must hold for the figures to be drawn from it,
# and of which type (None: null): a record edited by hand without one ended
# --check, --write and the listing with a KeyError's traceback.
_FIELDS = {
    "machine": {"machine": str, "cpu": str, "column": str},
    "run": {"id": str, "recipe": str, "set": str, "machine": str, "flags": dict, "seed": int,
            "session": _TEXT, "against": _TEXT, "eval_accuracy": _NUMBER,
            "eval_accuracy_without_tta": _NUMBER},
    "tests": {"suite": str, "tests": int, "machine": str},
}


class Ledger:
    """The records of a ledger file, by kind, checked against each other."""

    def __init__(self, records: List[dict], path: str = PATH):
        self.path = path
        for line, record in enumerate(records, 1):  # a ledger's records are its lines
            fields = _FIELDS.get(record["kind"])
            problem = (files.missing_fields(record, fields) if fields else
                       f"kind {record['kind']!r}, none of {', '.join(_FIELDS)}")
            if problem:
                raise files.DamagedFileError(f"{path}: line {line} is damaged ({problem})")
        self.machines = {r["machine"]: r for r in records if r["kind"] == "machine"}
        self.runs = [r for r in records if r["kind"] == "run"]
        self.tests = [r for r in records if r["kind"] == "tests"]
        self.sets: Dict[str, List[dict]] = {}
        for run in self.runs:
            self.sets.setdefault(run["set"], []).append(run)
        self._check()

    def _check(self) -> None:
        ids = [run["id"] for run in self.runs]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{self.path}: run ids repeat: "
                              f"{sorted({i for i in ids if ids.count(i) > 1})}")
        for name, runs in self.sets.items():
            first = runs[0]
            for run in runs:
                if run["machine"] not in self.machines:
                    raise ConfigError(f"{self.path}: run {run['id']} names machine "
                                      f"{run['machine']!r}, which has no machine record")
                for key in ("recipe", "machine", "flags", "against"):
                    if run.get(key) != first.get(key):
                        raise ConfigError(f"{self.path}: set {name!r} mixes runs of different "
                                          f"{key} ({first['id']}, {run['id']}): a set is one "
                                          f"recipe's flags on one machine")

    def column(self, run: dict) -> str:
        return self.machines[run["machine"]]["column"]

    def baselines(self, runs: List[dict]) -> List[dict]:
        """The runs of the recipe `runs` alternated with, in their sessions."""
        against, sessions = runs[0].get("against"), {r["session"] for r in runs}
        return [r for r in self.runs if against and r["recipe"] == against
                and r["session"] in sessions and r["session"] is not None]

    def pair_ratios(self, runs: List[dict]) -> List[float]:
        """Each run's wall time over that of the last run of the recipe it
        alternated with before it in its session."""
        ratios = []
        for run in runs:
            before = self.runs[:self.runs.index(run)]
            last = [r for r in before if r in self.baselines([run])]
            if last and wall_seconds(run) and wall_seconds(last[-1]):
                ratios.append(wall_seconds(run) / wall_seconds(last[-1]))
        return ratios


def load(path: str = PATH) -> Ledger:
    """The ledger in `path`. DamagedFileError if a line is damaged: the ledger is
    the repository's, written by hand and by measure.py, never cut short."""
    records, problems = read_jsonl(path, {"kind": str}, _REMEDY)
    if problems:
        raise files.DamagedFileError(f"{path}: {'; '.join(problems)}")
    if not records and not os.path.exists(path):
        raise ConfigError(f"there is no ledger at {path}")
    return Ledger(records, path)


def append(path: str, records: List[dict]) -> List[dict]:
    """Adds `records` at the end of the ledger in `path` (a new ledger if
    there is none), whole or not at all, and returns those added: a machine
    or a run the ledger holds by then is not added again. Under an exclusive
    lock on the ledger: two measurements ending at once each read it and
    wrote it back with their own records only, and one's were lost."""
    try:
        fd = json_lines.open_appending(path, _REMEDY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held, problems = read_jsonl(path, {"kind": str}, _REMEDY)
            if problems:
                raise files.DamagedFileError(f"{path}: {'; '.join(problems)}; mend it before "
                                             f"appending")
            keys = {r.get("id") or r.get("machine") for r in held if r["kind"] != "tests"}
            records = [r for r in records
                       if r["kind"] == "tests" or (r.get("id") or r["machine"]) not in keys]
            Ledger(held + records, path)  # the result is consistent
            json_lines.add_lines(fd, records, path)
        finally:
            os.close(fd)
    except OSError as e:  # a full disk, after hours of measuring, was a traceback
        if not files.why_unwritable(e):
            raise
        raise ConfigError(f"cannot add to the ledger {path} ({files.why_unwritable(e)}): it is "
                          f"left as it was; make room and run the same command again") from None
    return records


def code_commit() -> str:
    """The package's code: its git commit (with -dirty for uncommitted
    changes) in a checkout, else its version."""
    import subprocess
    from distributed_mpt import __version__
    try:
        described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                                   cwd=os.path.dirname(__file__), capture_output=True,
                                   text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        described = None
    if described and described.returncode == 0 and described.stdout.strip():
        return described.stdout.strip()
    return f"distributed_mpt {__version__}"


def record_runs(path: str, recipe: str, finished: List[tuple], train_flags: List[str],
                command: str, conditions: Optional[str], shared: bool = False) -> List[dict]:
    """Adds to the ledger in `path` a record for each (seed, summary,
    summary path) of `finished` runs of `recipe` that it does not hold yet
    (a measurement run again reads its finished runs back: they are not
    measured twice), and this machine's record if it is new. Returns the
    records added."""
    import datetime
    existing = read_jsonl(path, {"kind": str}, _REMEDY)[0]
    commit = code_commit()
    given = []
    for arg in train_flags:  # `--name value`, as absl takes it too, becomes `--name=value`
        if given and not arg.startswith("-") and "=" not in given[-1]:
            given[-1] += "=" + arg
        else:
            given.append(arg)
    run_flags = {**recipe_flags(recipe), **flags_of_text("\n".join(given))}
    label = variant(run_flags, recipe)
    if len(label.split()) > 3:  # a set's name, not a list (nor "another recipe's flags (5 differ)")
        import hashlib
        digest = hashlib.sha1(json.dumps(run_flags, sort_keys=True).encode()).hexdigest()
        label = f"flags {digest[:8]}"
    machine, is_new = ledger_machine([r for r in existing if r.get("kind") == "machine"])
    records = [machine] if is_new else []
    ids = {r.get("id") for r in existing}
    ends = [datetime.datetime.fromtimestamp(os.path.getmtime(summary_path), datetime.timezone.utc)
            for *_, summary_path in finished]
    first_end = ends[0].strftime("%Y-%m-%d %H:%M UTC") if ends else None
    for (seed, summary, _), ended in zip(finished, ends):
        run_id = f"{recipe}/{ended.strftime('%Y-%m-%dT%H:%M:%SZ')}/seed-{seed}"
        if run_id in ids:
            continue
        records.append({
            "kind": "run", "id": run_id, "recipe": recipe,
            "set": f"{recipe}@{commit} on {machine['machine']}" + (f" {label}" if label else ""),
            "session": f"{recipe} measured by measure.py, {first_end}", "against": None,
            "command": command, "commit": commit, "recorded_in": None,
            "date": ended.date().isoformat(), "machine": machine["machine"],
            "precision": summary.get("precision"), "seed": seed,
            **{key: summary.get(key) for key in ("eval_accuracy", "eval_accuracy_without_tta",
                                                 "wall_seconds", "examples_per_second",
                                                 "peak_memory_bytes")},
            "shared": shared or None, "conditions": conditions, "notes": None, "flags": run_flags})
    return append(path, records) if any(r["kind"] == "run" for r in records) else []


def ledger_machine(known: List[dict], described: Optional[dict] = None) -> Tuple[dict, bool]:
    """(the ledger's record of this machine, whether it is new to the
    ledger) among the machine records `known`: the one whose id is this
    machine's description (`describe_machine`, or `described`), or whose
    "described" field names it (a machine the ledger names by hand, as
    "xeon-amx-2.6ghz"), or, recorded before descriptions had a clock, whose
    id is the description without it; else the description, new."""
    machine = described or describe_machine()
    clockless = re.sub(r"-[0-9]+-[0-9]+-ghz(?=-)", "", machine["machine"])
    for candidate in (machine["machine"], clockless):
        for record in known:
            if candidate in (record["machine"], record.get("described")):
                return record, False
    return machine, True


def describe_machine(cpuinfo: str = "/proc/cpuinfo",
                     max_frequency: str = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
                     ) -> dict:
    """A machine record for this host, from /proc/cpuinfo: its CPU's model,
    family and model numbers, clock, cores this process may use, and its
    widest vector and bfloat16 instructions. The clock tells apart CPUs that
    report the same model (a virtual machine's "Intel(R) Xeon(R) Processor",
    family 6, model 167, at 2.0 and at 2.6 GHz): the highest frequency cpufreq
    states, else /proc/cpuinfo's "cpu MHz" (fixed in a virtual machine)."""
    fields = {}
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = ", ".join(i.upper() for i in ("avx512_bf16", "amx_bf16", "avx512f", "avx2")
                    if i in flags) or "no AVX2"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open(max_frequency) as f:
            megahertz = int(f.read()) / 1000
    except (OSError, ValueError):
        try:
            megahertz = float(fields.get("cpu MHz", ""))
        except ValueError:
            megahertz = None
    clock = f", {megahertz / 1000:.1f} GHz" if megahertz else ""
    cpu = (f"{cores} cores of an {fields.get('model name', 'unknown CPU')} (family "
           f"{fields.get('cpu family', '?')}, model {fields.get('model', '?')}{clock}) with {isa}")
    return {"kind": "machine", "machine": re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-"),
            "cpu": cpu, "column": cpu}
