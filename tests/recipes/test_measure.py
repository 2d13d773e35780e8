"""`python -m distributed_mpt.recipes.measure`: a recipe over several seeds,
one command, resumable, and the table of what the runs reached."""

import fcntl
import json
import os
import signal

import pytest

from conftest import WatchedProcess, assert_ok, run_module
from distributed_mpt.process.run_lock import LOCK_NAME
from distributed_mpt.errors import ConfigError

# The MLP recipe, shortened as a user would shorten it, on synthetic data.
SHORT = ["--", "--dataset=synthetic", "--synthetic_examples=512", "--train_steps=6",
         "--per_replica_batch_size=32", "--noexport", "--steps_per_loop=3"]


@pytest.mark.slow
def test_measures_each_seed_and_tabulates_the_runs_then_reads_them_back(tmp_path):
    runs, ledger = tmp_path / "runs", tmp_path / "ledger.jsonl"
    first = run_module("distributed_mpt.recipes.measure",
                       ["--recipe=mlp", "--seeds=0-2", f"--runs_dir={runs}",
                        f"--ledger={ledger}", "--conditions=a test", "--shared", *SHORT],
                       timeout=900)
    assert_ok(first)
    results = json.loads((runs / "results.json").read_text())["runs"]
    assert [r["seed"] for r in results] == [0, 1, 2]
    table = (runs / "results.md").read_text()
    assert table.startswith("`mlp`: n = 3, mean ") and "95% interval of the mean" in table
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 2 + 3

    # Started again: every seed is a finished run, read back, not trained again.
    # Each run is a record of the ledger, with what it set and where it ran.
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    machine, *recorded = records
    assert machine["kind"] == "machine" and "cores of" in machine["cpu"]
    assert [(r["kind"], r["recipe"], r["seed"]) for r in recorded] == [("run", "mlp", s)
                                                                      for s in (0, 1, 2)]
    for record, summary in zip(recorded, results):
        assert record["eval_accuracy"] == summary["eval_accuracy"]
        assert record["wall_seconds"] == summary["wall_seconds"]
        assert record["peak_memory_bytes"] == summary["peak_memory_bytes"] > 0
        assert record["machine"] == machine["machine"] and record["conditions"] == "a test"
        assert record["shared"] is True  # --shared: the figures will say so
        assert record["flags"]["train_steps"] == "6" and record["flags"]["model"] == "mlp"
        assert "data_dir" not in record["flags"] and record["commit"]

    # Started again: every seed is a finished run, read back, not trained again,
    # nor recorded twice.
    again = run_module("distributed_mpt.recipes.measure",
                       ["--recipe=mlp", "--seeds=0-2", f"--runs_dir={runs}",
                        f"--ledger={ledger}", *SHORT], timeout=900)
    assert_ok(again)
    assert again.stdout.count("holds a finished run") == 3
    assert (runs / "results.md").read_text() == table
    assert [json.loads(line) for line in ledger.read_text().splitlines()] == records


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_of_measure_alone_stops_its_run_with_a_checkpoint(tmp_path, stop):
    """`kill` of measure's pid (or SIGHUP, its terminal gone) ended measure at
    once, without a word, and its seed's run trained on, orphaned, holding
    its --model_dir: the stop is passed on, and measure says how it ended."""
    runs, ledger = tmp_path / "runs", tmp_path / "ledger.jsonl"
    measure = WatchedProcess("distributed_mpt.recipes.measure", [
        "--recipe=mlp", "--seeds=0,1", f"--runs_dir={runs}", f"--ledger={ledger}",
        *SHORT[:3], "--train_steps=100000", "--per_replica_batch_size=32", "--noexport",
        "--steps_per_loop=3", "--log_every_steps=3"])
    child = None
    try:
        measure.wait_for(r"^step +\d+/100000", timeout=300)
        pid = measure.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            child = int(f.read().split()[0])
        measure.process.send_signal(stop)
        assert measure.finish(timeout=120) == 143, measure.output()
        assert measure.output().splitlines()[-1] == (
            "[measure] seed 0 ended with 143; run the same command again to resume")
        assert "checkpoint saved" in measure.output()
        with pytest.raises(ProcessLookupError):  # ended, and measure reaped it
            os.kill(child, 0)
        child = None  # its pid may be another process's now
        with open(runs / "seed-0" / LOCK_NAME) as lock:  # the next run may take it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not ledger.exists() and not (runs / "seed-1").exists()
    finally:
        if child is not None:  # an orphan would train on after the test
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_damaged_ledger_is_refused_before_any_training(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"kind": "machine"\n')
    result = run_module("distributed_mpt.recipes.measure",
                        ["--recipe=mlp", f"--runs_dir={tmp_path / 'runs'}",
                         f"--ledger={ledger}", *SHORT])
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert str(ledger) in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("where", ["/proc/ledger.jsonl", "a file/ledger.jsonl", "a directory"])
def test_a_ledger_that_cannot_be_written_is_refused_before_any_training(tmp_path, where):
    """The records are written after the last seed, hours later: a ledger
    that cannot be written there (the default, in a read-only installation)
    is found before the first."""
    (tmp_path / "a file").write_text("")
    (tmp_path / "a directory").mkdir()
    ledger = tmp_path / where
    result = run_module("distributed_mpt.recipes.measure",
                        ["--recipe=mlp", "--seeds=0", f"--runs_dir={tmp_path / 'runs'}",
                         f"--ledger={ledger}", *SHORT])
    print(result.stdout + result.stderr)
    assert result.returncode == 2 and result.stderr.startswith("error: --ledger=")
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_runs_without_a_test_accuracy_are_tabulated_and_kept_out_of_the_ledger(tmp_path):
    """--noevaluate: the table has their times (table() raised a TypeError),
    and the ledger, of what recipes reach, no record of them."""
    runs, ledger = tmp_path / "runs", tmp_path / "ledger.jsonl"
    ledger.write_text("")
    result = run_module("distributed_mpt.recipes.measure",
                        ["--recipe=mlp", "--seeds=0", f"--runs_dir={runs}", f"--ledger={ledger}",
                         *SHORT, "--noevaluate"], timeout=900)
    assert_ok(result)
    table = (runs / "results.md").read_text()
    print(table)
    assert table.startswith("`mlp`: 1 run(s), none evaluated (--noevaluate): no test accuracy\n")
    assert [line.split(" | ")[1:3] for line in table.splitlines() if line.startswith("| 0 ")] == [["—", "—"]]
    assert ledger.read_text() == ""


def test_bad_seeds_are_one_error_line(tmp_path):
    result = run_module("distributed_mpt.recipes.measure",
                        ["--recipe=mlp", "--seeds=0-x", f"--runs_dir={tmp_path}"])
    assert result.returncode == 2 and result.stderr.startswith("error: --seeds=0-x")


@pytest.mark.parametrize("seeds", ["0-99999999999999", "\u0661-\u0662", "0x1,2", "1_0", "1-2-3"])
def test_seeds_are_decimal_and_counted_before_they_are_made(seeds):
    """A range of 10^14 seeds was made, as a list, before it was counted."""
    from distributed_mpt.recipes.measure import seeds_of

    with pytest.raises(ConfigError, match=r"^--seeds="):
        seeds_of(seeds)


def test_a_seed_named_twice_is_refused_and_a_range_of_one_is_not():
    """--seeds=1,1 trained seed 1, read it back as a second run, and its
    table stated n = 2 and a spread of one run."""
    from distributed_mpt.recipes.measure import seeds_of

    with pytest.raises(ConfigError, match=r"^--seeds=1,2,1 names a seed twice$"):
        seeds_of("1,2,1")
    assert seeds_of("3-3") == [3]


def test_a_run_refused_for_its_flags_is_not_said_to_resume(tmp_path, capfd):
    """A seed's run that exits 2 (bad flags) was followed by 'run the same
    command again to resume', which would meet the same refusal."""
    from distributed_mpt.recipes import measure

    assert measure.main(["--recipe=mlp", "--seeds=0", f"--runs_dir={tmp_path / 'runs'}",
                         "--ledger=", "--", "--train_steps=x"]) == 2
    err = capfd.readouterr().err
    assert "error: flag --train_steps=x: x is not a whole number" in err, err
    assert err.splitlines()[-1] == ("[measure] seed 0 ended with 2; mend what its error says, "
                                    "then run the same command again"), err


def test_one_run_is_tabulated_without_a_spread_it_does_not_have():
    from distributed_mpt.recipes.measure import table

    run = {"seed": 0, "eval_accuracy": 0.941, "eval_accuracy_without_tta": 0.9294,
           "wall_seconds": 338.6, "examples_per_second": 1175.2, "device": "a CPU"}
    one = table("cpu_cnn94_muon", [run])
    assert one.startswith("`cpu_cnn94_muon`: n = 1, mean 94.10%\n"), one
    assert "nan" not in one and "| 0 | 94.10% | 92.94% |" in one
    two = table("cpu_cnn94_muon", [run, {**run, "seed": 1, "eval_accuracy": 0.939}])
    assert "n = 2, mean 94.00%, standard deviation 0.14 points, 95% interval" in two, two


@pytest.mark.parametrize("given, own", [(["--seed=7"], "--seeds"), (["--seed", "7"], "--seeds"),
                                         (["--model_dir=one"], "--runs_dir"),
                                         (["-recipe=cpu_cnn"], "--recipe")])
def test_a_training_flag_that_measure_gives_each_seed_is_refused_before_any_training(
        tmp_path, capsys, given, own):
    """After `--`, --seed won over each seed's own: every seed trained
    alike and the ledger held one run as several seeds; --model_dir trained
    them all into one directory."""
    from distributed_mpt.recipes import measure

    runs = tmp_path / "runs"
    assert measure.main(["--recipe=mlp", "--seeds=0-1", f"--runs_dir={runs}",
                         f"--ledger={tmp_path / 'ledger.jsonl'}", *SHORT, *given]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: --"), errors
    assert errors[0].endswith(f"use {own} before --"), errors
    assert not runs.exists() and list(tmp_path.iterdir()) == []
