"""The results ledger (distributed_mpt/recipes/ledger.jsonl) and what is
rendered from it: the README's table and figures, each recipe's headline,
docs/recipes.md's tables of runs. The repository agrees with it, a figure
typed by hand is caught, and a recipe holds its flags and a short header."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_ok, run_module, subprocess_env

LEDGER = "distributed_mpt.recipes.ledger"
RECIPES = REPO / "distributed_mpt" / "recipes"


def test_readme_recipes_and_docs_say_what_the_ledger_says():
    result = run_module(LEDGER, ["--check", "--nocount_tests"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # collecting the tests imports TensorFlow: a minute or more
def test_readme_states_the_number_of_tests_a_fresh_collection_finds():
    result = run_module(LEDGER, ["--check"], timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_recipe_is_its_flags_and_a_header_of_at_most_10_lines():
    for path in sorted(RECIPES.glob("*.flags")):
        lines = path.read_text().splitlines()
        header = [line for line in lines if line.startswith("#")]
        assert lines[:len(header)] == header, f"{path.name}: comments among the flags"
        assert len(header) <= 10, f"{path.name}: a header of {len(header)} lines"
        assert all(line.startswith("--") for line in lines[len(header):]), path.name
        assert any(line.startswith("# Measured") for line in header), path.name
        # --help shows the first line alone: it must say what the recipe is, whole.
        assert header[0].endswith("."), f"{path.name}: its first line stops mid-sentence"


def _copy_of_the_repository(tmp_path):
    """The package, the README and docs/, where the check can be run on edits."""
    for part in ("distributed_mpt", "docs"):
        shutil.copytree(REPO / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    return tmp_path


def _check(copy, *flags):
    import subprocess
    import sys
    from conftest import subprocess_env
    return subprocess.run([sys.executable, "-m", LEDGER, *flags], cwd=copy, text=True,
                          capture_output=True, env=subprocess_env(PYTHONPATH=str(copy)),
                          timeout=300)


def test_a_figure_typed_over_the_ledgers_is_caught_and_rendered_back(tmp_path):
    copy = _copy_of_the_repository(tmp_path)
    readme = (copy / "README.md").read_text()
    assert "**94.10%** mean of 6 runs" in readme
    (copy / "README.md").write_text(readme.replace("**94.10%** mean of 6", "**94.20%** mean of 6"))
    caught = _check(copy, "--check", "--nocount_tests")
    assert caught.returncode == 1 and "README.md disagrees with the ledger" in caught.stdout
    assert_ok(_check(copy, "--write", "--nocount_tests"))
    assert (copy / "README.md").read_text() == readme


def test_a_run_changed_in_the_ledger_changes_every_figure_drawn_from_it(tmp_path):
    copy = _copy_of_the_repository(tmp_path)
    ledger = copy / "distributed_mpt" / "recipes" / "ledger.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    run = next(r for r in records if r.get("id") == "cpu_cnn94_muon/c773f04/seed-0")
    run["eval_accuracy"] = 0.9462  # 94.02% -> 94.62%: the mean of six moves by 0.10
    run["peak_memory_bytes"] = 2_345_678_901  # and its peak memory is known
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    caught = _check(copy, "--check", "--nocount_tests")
    assert caught.returncode == 1
    for path in ("README.md", "distributed_mpt/recipes/cpu_cnn94_muon.flags", "docs/recipes.md"):
        assert f"{path} disagrees with the ledger" in caught.stdout, caught.stdout
    assert_ok(_check(copy, "--write", "--nocount_tests"))
    assert "**94.20%** mean of 6 runs" in (copy / "README.md").read_text()
    header = (copy / "distributed_mpt/recipes/cpu_cnn94_muon.flags").read_text()
    assert "94.20% mean of 6 runs" in header
    assert "peak resident memory 2.35 GB" in " ".join(header.replace("#   ", "").split())
    assert _check(copy, "--check", "--nocount_tests").returncode == 0


def test_a_peak_the_readme_quotes_is_its_sets_largest(tmp_path):
    copy = _copy_of_the_repository(tmp_path)
    quoted = re.search(r"<!-- ledger:peak ([^>]*?) -->(.*?)<!-- /ledger -->",
                       (copy / "README.md").read_text())
    assert quoted and quoted.group(2).endswith(" GB"), "the README quotes no peak"
    ledger = copy / "distributed_mpt" / "recipes" / "ledger.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    runs = [r for r in records if r.get("set") == quoted.group(1)]
    assert runs
    runs[0]["peak_memory_bytes"] = 3_456_789_012
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    caught = _check(copy, "--check", "--nocount_tests")
    assert caught.returncode == 1 and "README.md disagrees with the ledger" in caught.stdout
    assert_ok(_check(copy, "--write", "--nocount_tests"))
    assert f"<!-- ledger:peak {quoted.group(1)} -->3.46 GB<!-- /ledger -->" in (
        copy / "README.md").read_text()


def test_a_damaged_ledger_is_one_error_line(tmp_path):
    copy = _copy_of_the_repository(tmp_path)
    ledger = copy / "distributed_mpt" / "recipes" / "ledger.jsonl"
    ledger.write_text(ledger.read_text() + '{"kind": "run", "id": \n')
    result = _check(copy, "--check", "--nocount_tests")
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert "line" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_record_without_what_its_figures_need_is_one_error_line(tmp_path):
    """A record edited by hand (no run id, a machine without its column, a
    kind misspelt, a seed in words) ended --check, --write and the listing
    with a KeyError's traceback, or was passed over without a word; a line
    too long named --model_dir, which the ledger has not, as the way out."""
    copy = _copy_of_the_repository(tmp_path)
    ledger = copy / "distributed_mpt" / "recipes" / "ledger.jsonl"
    shipped = ledger.read_text()
    line = len(shipped.splitlines()) + 1
    run = json.loads(shipped.splitlines()[-1])
    for added, flags, problem in (
            ({"kind": "run"}, ["--check", "--nocount_tests"], "no 'id'"),
            ({"kind": "machine", "machine": "m", "cpu": "c"}, [], "no 'column'"),
            ({**run, "seed": "one", "id": "x"}, ["--write", "--nocount_tests"],
             "'seed' is a str"),
            ({"kind": "Run"}, ["--check", "--nocount_tests"],
             "kind 'Run', none of machine, run, tests")):
        ledger.write_text(shipped + json.dumps(added) + "\n")
        result = _check(copy, *flags)
        assert result.returncode == 2 and not result.stdout, result.stderr
        assert result.stderr.splitlines() == [f"error: {ledger}: line {line} is damaged "
                                              f"({problem})"]
    ledger.write_text(shipped + "x" * 2**21 + "\n")
    result = _check(copy, "--check", "--nocount_tests")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.rstrip().endswith(
        f"(line {line} is longer than any this program writes, 1,048,576 bytes); mend it, or "
        f"restore it from version control"), result.stderr
    assert (copy / "README.md").read_text() == (REPO / "README.md").read_text()


def test_a_file_quoting_the_ledger_that_is_no_text_file_is_one_error_line(tmp_path):
    """A README that is a FIFO hung --check and --write; one that is a
    directory, or a doc holding bytes of no text, ended them with a traceback."""
    copy = _copy_of_the_repository(tmp_path)
    readme, doc = copy / "README.md", copy / "docs" / "recipes.md"
    shipped = readme.read_text()
    readme.unlink()
    for make, flag, wrong in ((readme.mkdir, "--write", "is a directory, not a regular file"),
                              (lambda: os.mkfifo(readme), "--check", "is a FIFO")):
        make()
        result = _check(copy, flag, "--nocount_tests")
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"error: {readme} {wrong}"), result.stderr
        os.rmdir(readme) if readme.is_dir() else readme.unlink()
    readme.write_text(shipped)
    doc.write_bytes(doc.read_bytes() + b"\xff\xfe")
    result = _check(copy, "--write", "--nocount_tests")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {doc} is damaged (not UTF-8 text"), result.stderr
    assert readme.read_text() == shipped, "nothing written"


def test_the_ledger_lists_a_recipes_runs():
    result = run_module(LEDGER, ["cpu_cnn94_muon"])
    assert_ok(result)
    assert "## cpu_cnn94_muon@c773f04: `cpu_cnn94_muon` (as shipped)" in result.stdout
    assert "| 5 | c773f04 | 94.29% | 93.14% | 559.6 s | 696 |" in result.stdout
    bad = run_module(LEDGER, ["no_such_recipe"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: no_such_recipe is not one")


def test_a_machines_description_has_its_clock(tmp_path):
    # Two Xeons a virtual machine reports alike, but for the clock.
    from distributed_mpt.recipes import records

    cpuinfo = tmp_path / "cpuinfo"
    described = {}
    for mhz in ("2000.000", "2600.000"):
        cpuinfo.write_text(f"model name\t: Intel(R) Xeon(R) Processor\ncpu family\t: 6\n"
                           f"model\t\t: 167\ncpu MHz\t\t: {mhz}\nflags\t\t: avx2 amx_bf16\n")
        described[mhz] = records.describe_machine(str(cpuinfo), str(tmp_path / "no_cpufreq"))
    assert "(family 6, model 167, 2.6 GHz) with AMX_BF16, AVX2" in described["2600.000"]["cpu"]
    assert described["2000.000"]["machine"] != described["2600.000"]["machine"]
    (tmp_path / "max_freq").write_text("3500000\n")  # kHz: cpufreq's, where there is one
    assert ", 3.5 GHz)" in records.describe_machine(str(cpuinfo), str(tmp_path / "max_freq"))["cpu"]


def test_runs_go_to_the_machine_the_ledger_names_for_their_description():
    from distributed_mpt.recipes import records

    here = {"kind": "machine", "machine": "2-cores-of-an-x-family-6-model-167-2-6-ghz-with-avx2",
            "cpu": "...", "column": "..."}
    named = {"kind": "machine", "machine": "xeon-2.6ghz", "described": here["machine"]}
    older = {"kind": "machine", "machine": "2-cores-of-an-x-family-6-model-167-with-avx2"}
    assert records.ledger_machine([named, older], here) == (named, False)
    # Recorded before descriptions had a clock: the same record, not a new one.
    assert records.ledger_machine([older], here) == (older, False)
    assert records.ledger_machine([], here) == (here, True)


def test_a_timed_suite_is_recorded_with_its_machine(tmp_path, capsys):
    """--time_tests runs pytest, times it, and appends the run's record and,
    new to the ledger, this machine's (it once failed only after the whole
    suite had run: a local name hid the records module)."""
    from distributed_mpt.recipes import records, suite

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    one_test = "tests/product/test_layout.py::test_the_walk_sees_lazy_imports"
    assert suite.time_tests("fast", "a test", path=str(ledger), targets=(one_test,)) == 0
    machine, run = (json.loads(line) for line in ledger.read_text().splitlines())
    assert machine == records.describe_machine()  # new to an empty ledger
    assert (run["kind"], run["suite"], run["tests"], run["machine"], run["conditions"]) == (
        "tests", "fast", 1, machine["machine"], "a test")
    assert run["wall_seconds"] > 0 and "1 passed" in run["outcome"]
    assert run["command"] == f"python -m pytest -q {one_test} -m 'not slow'"
    assert "recorded in" in capsys.readouterr().out


def test_a_damaged_ledger_is_found_before_the_suite_runs(tmp_path, monkeypatch):
    """The fast tier takes minutes, the whole suite an hour: the ledger it is
    recorded into is read first."""
    from distributed_mpt import files
    from distributed_mpt.recipes import suite

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"kind": "machine"\n')

    def run(*args, **kwargs):
        raise AssertionError(f"the suite was run: {args}")
    monkeypatch.setattr(suite.subprocess, "run", run)
    with pytest.raises(files.DamagedFileError, match=str(ledger)):
        suite.time_tests("fast", "a test", path=str(ledger), targets=("tests/product/test_layout.py",))


def _ledger_of(runs, tests=()):
    """A ledger of `runs` of cpu_cnn94 as shipped, each (machine, seconds
    or None, minutes or None, session), and `tests` records; its machines
    in the order the runs name them."""
    from distributed_mpt.recipes import records

    flags = records.recipe_flags("cpu_cnn94")
    machines = list(dict.fromkeys([m for m, *_ in runs] + [t["machine"] for t in tests]))
    return records.Ledger(
        [{"kind": "machine", "machine": m, "cpu": f"a CPU called {m}", "column": m} for m in machines]
        + [{"kind": "run", "id": f"run {i}", "recipe": "cpu_cnn94", "set": f"on {machine}",
            "session": session, "against": None, "flags": flags, "machine": machine, "seed": i,
            "commit": None, "eval_accuracy": 0.94, "eval_accuracy_without_tta": 0.93,
            "wall_seconds": seconds, "wall_minutes": minutes}
           for i, (machine, seconds, minutes, session) in enumerate(runs)]
        + [{"kind": "tests", **t} for t in tests])


def test_the_xeons_minutes_are_the_xeons_runs_whatever_the_order_of_the_columns():
    """The README's "The 2.0 GHz Xeon's N min" took the second column's runs."""
    from distributed_mpt.recipes import render

    ledger = _ledger_of([("epyc", 600, None, None), ("zen3", 1200, None, None),
                         ("xeon-amx", 1800, None, None)])
    pattern, figure = render._README_QUOTES[1]
    assert pattern.sub(lambda m: m.group(1) + figure(ledger) + m.group(3),
                       "The 2.0 GHz Xeon's 0 min") == "The 2.0 GHz Xeon's 30 min"


def test_a_session_row_states_its_wall_times_in_one_unit():
    """A row of runs timed in seconds and in minutes says minutes, of each
    (the seconds were printed as they were, labelled min)."""
    from distributed_mpt.recipes import render

    ledger = _ledger_of([("epyc", 600.0, None, "S"), ("epyc", None, 10.5, "S")])
    assert render.session_table(ledger, "S").splitlines()[-1] == (
        "| 1-2 | `cpu_cnn94` seeds 0, 1 | 94.00%, 94.00% (93.00, 93.00) | 10.0, 10.5 min |")


def test_a_timed_suite_states_its_time_in_whole_minutes_and_seconds():
    """119.6 s is 2 min 0 s (it was "1 min 60 s")."""
    from distributed_mpt.recipes import records, suite

    ledger = _ledger_of([], tests=[{"suite": "fast", "tests": 10, "wall_seconds": 119.6,
                                    "date": "2026-12-04", "commit": "abc1234", "machine": "epyc",
                                    "conditions": "quiet"}])
    assert "took 2 min 0 s on a CPU called epyc, quiet" in " ".join(
        suite.lines(ledger, "fast", 10).replace("# ", "").split())
    assert [records.wall_time(s, unit) for s, unit in (
        (None, "s"), (559.64, "s"), (780, "min"), (692.4, "min s"))] == [
        "—", "559.6 s", "13.0 min", "11 min 32 s"]


def test_on_a_tie_the_headline_is_the_set_measured_side_by_side():
    """Two sets of a recipe with as many runs: the one that alternated with
    another recipe speaks for it (its ratio is the headline's), even when the
    other was measured later."""
    from distributed_mpt.recipes import records, render

    def run(i, recipe, machine, session, against):
        return {"kind": "run", "id": f"run {i}", "recipe": recipe, "machine": machine,
                "set": f"{recipe} on {machine}", "session": session, "against": against,
                "flags": records.recipe_flags(recipe), "seed": i, "commit": None,
                "eval_accuracy": 0.94, "eval_accuracy_without_tta": 0.93,
                "wall_seconds": 500.0 + i, "wall_minutes": None}
    ledger = records.Ledger(
        [{"kind": "machine", "machine": m, "cpu": m, "column": m} for m in ("epyc", "xeon")]
        + [run(0, "cpu_cnn94", "epyc", "s", None), run(1, "cpu_cnn94_muon", "epyc", "s", "cpu_cnn94"),
           run(2, "cpu_cnn94_muon", "epyc", "s", "cpu_cnn94"),
           run(3, "cpu_cnn94_muon", "xeon", "t", None), run(4, "cpu_cnn94_muon", "xeon", "t", None)])
    headline = render.headline_set(ledger, "cpu_cnn94_muon")
    assert [r["id"] for r in headline] == ["run 1", "run 2"]
    assert render.time_ratio(ledger, headline) is not None
    assert [r["id"] for r in render.headline_set(ledger, "cpu_cnn94_muon", "xeon")] == ["run 3", "run 4"]


def test_every_figure_the_readme_quotes_is_where_the_renderer_looks():
    """A quoted figure whose words were reworded or wrapped over two lines
    would no longer be rendered, and would drift from the ledger unseen."""
    from distributed_mpt.recipes import render

    readme = (REPO / "README.md").read_text()
    for pattern, _ in render._README_QUOTES:
        assert len(pattern.findall(readme)) == 1, pattern.pattern


def test_a_ledger_on_a_full_disk_is_one_error_and_left_as_it_was(tmpfs):
    """measure adds its runs after the last seed, hours in: a full disk then
    ended it with a traceback. A record longer than the room left is not
    written in part."""
    from distributed_mpt.errors import ConfigError
    from distributed_mpt.recipes import records

    mount_point, _ = tmpfs
    ledger = mount_point / "ledger.jsonl"
    machine = {"kind": "machine", "machine": "m", "cpu": "c", "column": "c"}
    ledger.write_text(json.dumps(machine) + "\n")
    filler = os.open(mount_point / "filler", os.O_WRONLY | os.O_CREAT)  # the disk fills up
    with pytest.raises(OSError, match="No space left"):
        while True:
            os.write(filler, b"\0" * 65536)
    os.close(filler)
    with pytest.raises(ConfigError, match=r"^cannot add to the ledger .* \(No space left on "
                                          r"device\): it is left as it was; make room"):
        records.append(str(ledger), [{**machine, "machine": "n", "cpu": "c" * 8192}])
    assert ledger.read_text() == json.dumps(machine) + "\n"
    assert sorted(p.name for p in mount_point.iterdir()) == ["filler", "ledger.jsonl"]


def test_a_fifo_put_in_place_of_the_ledger_is_one_error_not_a_hang(tmp_path):
    """measure checks its ledger before the first seed and adds to it after
    the last, hours later: a FIFO put there meanwhile blocked the open that
    appends, and measure hung instead of ending with one error."""
    from conftest import deadline
    from distributed_mpt import files
    from distributed_mpt.recipes import records

    ledger = tmp_path / "ledger.jsonl"
    os.mkfifo(ledger)
    machine = {"kind": "machine", "machine": "m", "cpu": "c", "column": "c"}
    with deadline(30), pytest.raises(files.DamagedFileError) as raised:
        records.append(str(ledger), [machine])
    assert str(raised.value) == (f"{ledger} is a FIFO, not a regular file; mend it, or restore "
                                 f"it from version control")


_RECORDING = """
import os, sys, time
from distributed_mpt.recipes import records
directory, who = sys.argv[1], int(sys.argv[2])
summary = os.path.join(directory, f"summary-{who}.json")
open(summary, "w").write("{}")
while not os.path.exists(os.path.join(directory, "go")):
    time.sleep(0.001)
for seed in range(100 * who, 100 * who + 8):
    records.record_runs(os.path.join(directory, "ledger.jsonl"), "mlp",
                        [(seed, {"eval_accuracy": 0.5}, summary)], [], "a test", None)
"""


def test_measurements_ending_at_once_each_add_their_runs_to_the_ledger(tmp_path):
    """Each read the ledger and wrote it back with its own records: of 4
    processes adding 8 runs each (what measure does after its last seed),
    12 of the 32 runs were lost, and each added this machine's record."""
    processes = [subprocess.Popen([sys.executable, "-c", _RECORDING, str(tmp_path), str(who)],
                                  env=subprocess_env(), cwd=REPO) for who in range(4)]
    # All four imported and waiting (each has written its summary), then all go at once.
    ready_by = time.monotonic() + 300
    while len(list(tmp_path.glob("summary-*.json"))) < 4:
        assert time.monotonic() < ready_by, "the four processes were not ready within 300 s"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=300) for p in processes] == [0] * 4
    from distributed_mpt.recipes import records

    ledger = records.load(str(tmp_path / "ledger.jsonl"))
    assert sorted(run["seed"] for run in ledger.runs) == [100 * who + i for who in range(4)
                                                          for i in range(8)]
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 1 + 32  # one machine
