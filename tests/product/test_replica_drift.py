"""docs/replica_drift.py, the measurement behind the README's statement of how
far 2 replicas drift from 1 over a run: it trains the runs it compares and
prints their table (here on files in CIFAR-10's format and a tiny network;
the figures are the README's, from real CIFAR-10)."""

import subprocess
import sys

import pytest

from conftest import REPO, assert_one_error_line, subprocess_env, write_cifar10_binary

SCRIPT = REPO / "docs" / "replica_drift.py"


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(), cwd=REPO)


def test_bad_arguments_are_one_error_line_before_anything_trains(tmp_path):
    write_cifar10_binary(tmp_path / "data")
    out = tmp_path / "runs"
    assert_one_error_line(_run(f"--data_dir={tmp_path}", f"--out={out}"), "cifar-10-batches-bin")
    assert_one_error_line(_run(f"--data_dir={tmp_path / 'data'}", "--seeds=0,x", f"--out={out}"),
                          "--seeds")
    assert_one_error_line(_run(f"--data_dir={tmp_path / 'data'}", "--recipe=absent",
                               f"--out={out}"), "--recipe=absent")
    assert_one_error_line(_run(f"--data_dir={tmp_path / 'data'}", f"--out={out}",
                               "--train_flags=--per_replica_batch_size=x"),
                          "is not a positive whole number")
    assert_one_error_line(_run("--seeds=0"), "--data_dir")
    assert not out.exists()


@pytest.mark.slow  # three short trainings
def test_it_trains_one_and_two_replicas_and_the_control_and_tabulates_their_drift(tmp_path):
    write_cifar10_binary(tmp_path / "data")
    out = tmp_path / "runs"
    args = [f"--data_dir={tmp_path / 'data'}", "--seeds=0", f"--out={out}",
            "--train_flags=--model_width=4 --train_steps=6 --per_replica_batch_size=64 "
            "--warmup_epochs=0 --eval_tta=none --bn_recalibration=off --noexport "
            "--precision=float32"]
    result = _run(*args, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = ["one-0", "two-0", "one-1thread-0"]
    assert sorted(p.name for p in out.iterdir()) == sorted(runs)
    table = result.stdout[result.stdout.index("global batch 64, 6 steps"):]
    assert table.splitlines()[1].split() == ["steps", "two-0", "one-1thread-0"]
    spans = [line.split()[0] for line in table.splitlines()[2:6]]
    assert spans == ["1-1", "2-2", "3-4", "5-6"]
    for run in runs:  # every run's accuracy, and its distance from one replica's
        row = next(line.split() for line in table.splitlines() if line.startswith(run + " "))
        assert 0 <= float(row[1]) <= 1 and 0 <= float(row[2]) < 10, row  # nan fails too
        if run == "one-0":
            assert float(row[2]) == 0, row
    # A second call reuses the finished runs: it trains nothing again.
    again = _run(*args, timeout=300)
    assert again.returncode == 0 and "+ " not in again.stdout, again.stdout
