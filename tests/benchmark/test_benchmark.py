"""The benchmark: every section's figures, failures reported as such, flags.

Behaviour only: no test asserts a speed or the value of a ratio, which
depend on the machine and its load.
"""

import dataclasses
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, WatchedProcess, run_module, subprocess_env
from distributed_mpt.benchmark import cells, cli, roof, sections
from distributed_mpt.benchmark.sections import SECTIONS
from distributed_mpt.core import models
from distributed_mpt.errors import ExitCode

# What a cell measures, for tests in which none is measured.
FIGURES = {"examples_per_second": 100.0, "runs": [100.0], "steps": 2, "replicas": 1,
           "peak_memory_bytes": 2**20}

def _assert_figures(report: dict, names) -> None:
    """Each named section has rows, and each row every figure SECTIONS gives
    it, as a positive finite number."""
    for name in names:
        section = report["sections"][name]
        assert "failed" not in section, f"{name} failed: {section['failed']}"
        assert section["rows"], f"{name} has no rows"
        for row in section["rows"]:
            for figure in SECTIONS[name].figures:
                value = row.get(figure)
                assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, \
                    f"{name}: {figure} = {value!r} in {row}"


@pytest.mark.slow
def test_tiny_run_of_the_entry_point_reports_every_section(tmp_path):
    output = tmp_path / "bench.json"
    script = Path(sys.executable).with_name("distributed-mpt-benchmark")  # distributed_mpt.benchmark:run
    result = run_module("distributed_mpt.benchmark", ["--tiny", f"--output={output}"],
                        timeout=1200, wrapper=script if script.exists() else None)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert set(report["sections"]) == set(SECTIONS)
    _assert_figures(report, SECTIONS)
    assert report["machine"]["mixed_policy"] in ("mixed_float16", "mixed_bfloat16")
    for name in SECTIONS:
        assert f"\n{name}: " in result.stdout, result.stdout


def _cell_processes(parent: int) -> list:
    """The pids of the cell processes `parent` has started and not reaped."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat_file.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat_file.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"distributed_mpt.benchmark.cells" in command:
            pids.append(int(stat_file.parent.name))
    return pids


def test_a_stopped_benchmark_leaves_no_cell_running(tmp_path):
    """SIGTERM (Kubernetes, SLURM, kill) stops it as Ctrl-C does: the cell
    being measured is ended with it, not left running for minutes."""
    output = tmp_path / "bench.json"
    benchmark = WatchedProcess("distributed_mpt.benchmark", ["--tiny", f"--output={output}"])
    try:
        benchmark.wait_for(r"\[roof\]", timeout=120)
        deadline = time.monotonic() + 60
        while not (cells := _cell_processes(benchmark.process.pid)):
            assert time.monotonic() < deadline, benchmark.output()[-3000:]
            time.sleep(0.05)
        benchmark.process.send_signal(signal.SIGTERM)
        code = benchmark.finish(timeout=60)
    finally:
        benchmark.process.kill()
    left = [pid for pid in cells if Path(f"/proc/{pid}").exists()]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert code == ExitCode.PREEMPTED and "interrupted: nothing written" in benchmark.output()
    assert not left and not output.exists()


def test_a_stop_after_the_output_is_written_says_it_was_written(tmp_path, monkeypatch, capsys):
    """A stop while the report is printed (a paused console, say), after
    --output is written, said `interrupted: nothing written`: the file was there."""
    report = cli.format_report

    def format_report(results):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here
        return report(results)

    monkeypatch.setattr(sections, "run_cell", lambda cell: dict(FIGURES))
    monkeypatch.setattr(cli, "format_report", format_report)
    output = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--sections=training", f"--output={output}"]) == ExitCode.PREEMPTED
    assert json.loads(output.read_text())["sections"]["training"]["rows"]
    assert capsys.readouterr().err.splitlines()[-1] == f"interrupted: wrote {output}"


def test_a_failing_section_is_reported_failed_and_the_exit_status_is_1(tmp_path, monkeypatch,
                                                                       capsys):
    def run_cell(cell):  # one replica trains, several break
        if cell.strategy != "default":
            raise RuntimeError(f"{cell.describe()}: exited 1: error: ValueError: boom")
        return dict(FIGURES)

    monkeypatch.setattr(sections, "run_cell", run_cell)
    output = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--sections=training,scaling", f"--output={output}"]) == 1
    report = json.loads(output.read_text())
    _assert_figures(report, ["training"])
    assert report["sections"]["scaling"]["failed"].endswith("exited 1: error: ValueError: boom")
    printed = capsys.readouterr()
    assert "scaling: " in printed.out and "  FAILED: " in printed.out
    assert "error: section scaling FAILED: " in printed.err


def test_an_output_that_cannot_be_written_after_measuring_is_one_error_line(tmp_path, monkeypatch,
                                                                            capsys):
    output = tmp_path / "gone" / "bench.json"
    output.parent.mkdir()

    def run_cell(cell):  # measures, while the output's directory is removed
        if output.parent.exists():
            output.parent.rmdir()
        return dict(FIGURES)

    monkeypatch.setattr(sections, "run_cell", run_cell)
    assert cli.main(["--tiny", "--sections=training", f"--output={output}"]) == ExitCode.USAGE
    printed = capsys.readouterr()
    assert "training: " in printed.out, "the figures are not lost: the report has them"
    errors = [line for line in printed.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot write --output={output} (No such file or directory): "
                      f"the report above is all there is"]


@pytest.mark.parametrize("cpu_instructions, measured", [
    ((), ["float32"]), (("avx512_bf16",), ["float32", "mixed_bfloat16"])])
def test_by_default_float32_and_what_auto_picks_are_measured(tmp_path, monkeypatch, capsys,
                                                             cpu_instructions, measured):
    """No emulated precision by default: on a CPU without bfloat16
    instructions a mixed_bfloat16 cell of resnet9 took over 15 minutes."""
    from distributed_mpt.core import precision

    precisions = []

    def run_cell(cell):
        precisions.append(cell.precision)
        return dict(FIGURES)

    monkeypatch.setattr(sections, "run_cell", run_cell)
    monkeypatch.setattr(precision, "cpu_bfloat16_instructions", lambda: cpu_instructions)
    output = tmp_path / "bench.json"
    assert cli.main(["--models=mlp", "--batch_sizes=32", "--sections=training,mixed_precision",
                     f"--output={output}"]) == 0
    assert precisions == measured
    mixed = json.loads(output.read_text())["sections"]["mixed_precision"]
    if len(measured) == 1:
        assert "float32: this CPU has no bfloat16 instructions" in mixed["not_measured"]
        assert "  not measured: --precisions has no mixed_bfloat16" in capsys.readouterr().out
    else:
        assert [r["precision"] for r in mixed["rows"]] == ["mixed_bfloat16"]


def test_a_cell_run_by_hand_is_one_error_line_without_a_warning_of_python_s():
    """docs/performance.md runs a cell by hand (`python -m
    distributed_mpt.benchmark.cells Cell JSON`): the package imported the
    module first, and Python warned of that (a RuntimeWarning) on every run."""
    result = run_module("distributed_mpt.benchmark.cells", ["Cell", json.dumps(dict(
        model="mlp", precision="float32", batch_size=64, model_width=8, examples=32, repeats=1))])
    assert result.returncode == ExitCode.CRASHED, result.stderr[-3000:]
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith("error: ConfigError: the global batch of 64")


@pytest.fixture
def nothing_measured(monkeypatch):
    """Fails the test if anything is measured."""

    def run_cell(cell):
        raise AssertionError(f"{cell.describe()} was measured")

    monkeypatch.setattr(sections, "run_cell", run_cell)


def test_bad_flags_are_one_error_line_and_exit_2_before_measuring(tmp_path, capsys,
                                                                   nothing_measured):
    output = tmp_path / "bench.json"
    for flags, message in (
            (["--models=vgg", f"--output={output}"],
             f"--models: vgg given; choose from {', '.join(models.MODELS)}"),
            (["--sections=", f"--output={output}"],
             f"--sections: nothing given; choose from {', '.join(SECTIONS)}"),
            (["--repeats=x", f"--output={output}"],
             "flag --repeats=x: x is not a whole number in decimal digits"),
            (["--batch_sizes=0x20", f"--output={output}"],
             "--batch_sizes=0x20 must be whole numbers in decimal digits"),
            (["--model_width=1_0", f"--output={output}"],
             "flag --model_width=1_0: 1_0 is not a whole number in decimal digits"),
            ([f"--output={tmp_path}"],
             f"flag --output={tmp_path}: is a directory, not a regular file: name a file to write"),
            (["--repeats=99999999999999", f"--output={output}"],
             f"flag --repeats=99999999999999: 99999999999999 is not an integer in the range "
             f"[1, {cells.MAX_REPEATS}]"),
            ([f"--output={tmp_path}/missing/bench.json"],
             f"flag --output={tmp_path}/missing/bench.json: is in a directory that does not "
             f"exist; create it first")):
        assert cli.main(flags) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert list(tmp_path.iterdir()) == []


def test_an_output_name_too_long_for_the_file_system_is_one_error_line_before_measuring(
        tmp_path, capsys, nothing_measured):
    # Found by the write, it came after minutes of measuring.
    assert cli.main(["--tiny", f"--output={tmp_path / ('a' * 300 + '.json')}"]) == ExitCode.USAGE
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: --output=/"), errors
    assert errors[0].endswith("(a name of 305 bytes in it, more than the 255 a name may be) "
                              "cannot be written (File name too long): name another file"), errors
    assert list(tmp_path.iterdir()) == [], "nothing written"


def _special_files(directory: Path) -> dict:
    """One of each kind of file that is not a regular file, by kind."""
    import socket

    made = {"a FIFO": directory / "fifo", "a socket": directory / "socket",
            "a symbolic link to nothing": directory / "dangling"}
    os.mkfifo(made["a FIFO"])
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(made["a socket"]))
    listener.close()  # the socket file stays
    made["a symbolic link to nothing"].symlink_to(directory / "nowhere")
    try:  # as /dev/null is made: root only
        os.mknod(directory / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["a device node"] = directory / "null"
    except PermissionError:
        pass
    return made


def test_an_output_that_is_not_a_regular_file_is_refused_before_measuring(
        tmp_path, capsys, nothing_measured):
    """The JSON is renamed over --output: a device node (as root,
    --output=/dev/null would have replaced the system's), a FIFO or a socket
    was replaced by a regular file. Each is left alone, before any measuring."""
    special = _special_files(tmp_path)
    before = {path: os.lstat(path) for path in special.values()}
    for kind, path in special.items():
        assert cli.main(["--tiny", f"--output={path}"]) == ExitCode.USAGE, kind
        assert capsys.readouterr().err.splitlines() == [
            f"error: flag --output={path}: is {kind}, not a regular file: name a file to write"]
    for path, status in before.items():
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode) == (status.st_ino, status.st_mode), f"{path} was replaced"
    assert sorted(tmp_path.iterdir()) == sorted(special.values()), "nothing written beside them"
    print(f"refused: {', '.join(special)}")


def test_an_output_that_becomes_a_fifo_while_measuring_is_left_alone(tmp_path, monkeypatch, capsys):
    output = tmp_path / "bench.json"

    def run_cell(cell):  # measures, while someone puts a FIFO at --output
        if not output.exists():
            os.mkfifo(output)
        return dict(FIGURES)

    monkeypatch.setattr(sections, "run_cell", run_cell)
    assert cli.main(["--tiny", "--sections=training", f"--output={output}"]) == ExitCode.USAGE
    printed = capsys.readouterr()
    assert "training: " in printed.out, "the figures are not lost: the report has them"
    assert [line for line in printed.err.splitlines() if line.startswith("error:")] == [
        f"error: --output={output} is now a FIFO: not replaced; the report above is all there is"]
    assert stat.S_ISFIFO(os.lstat(output).st_mode) and list(tmp_path.iterdir()) == [output]


def test_an_output_through_a_symbolic_link_writes_the_file_it_names(tmp_path, monkeypatch,
                                                                   capsys):
    """A link to a regular file passes the check before measuring; after the
    run the file it names is written, and the link stays a link (it was a
    refusal after the whole run, and the figures were lost)."""
    target = tmp_path / "results" / "bench.json"
    target.parent.mkdir()
    target.write_text("{}\n")
    link = tmp_path / "latest.json"
    link.symlink_to(target)

    monkeypatch.setattr(sections, "run_cell", lambda cell: dict(FIGURES))
    assert cli.main(["--tiny", "--sections=training", f"--output={link}"]) == ExitCode.OK
    assert "error" not in capsys.readouterr().err
    assert link.is_symlink() and link.resolve() == target
    assert json.loads(target.read_text())["sections"]["training"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["bench.json"], "no temporary file"


def test_a_cell_runs_the_installed_package_not_one_in_the_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: a
    `./distributed_mpt/` there ran in place of the package. A cell that fails
    raises its last error line."""
    planted = tmp_path / "distributed_mpt"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         "raise SystemExit('error: the planted package ran')\n")
    monkeypatch.chdir(tmp_path)
    too_large = cells.Cell("mlp", "float32", batch_size=64, model_width=8, examples=32, repeats=1)
    # The installed package's own refusal of this cell: it ran, the planted one did not.
    with pytest.raises(RuntimeError, match=r"exited 1: error: ConfigError: the global batch of 64"):
        cells.run_cell(too_large)
    assert not marker.exists()


def test_help_describes_every_section_and_flag_and_measures_nothing(capsys, nothing_measured):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name, section in SECTIONS.items():
        assert f"  {name}: {section.about.split()[0]}" in text
    flag_names = list(cli._flag_values())
    assert not [name for name in flag_names if name.startswith("_")]
    assert all(f"--{name}" in text for name in flag_names)


def test_each_cell_is_set_against_the_roof_of_its_compute_dtype(tmp_path, monkeypatch):
    def run_cell(cell):
        if isinstance(cell, roof.Roof):  # the bfloat16 roof is twice the float32 one
            peak = {"float32": 4e11, "bfloat16": 8e11}[cell.dtype]
            return {"rows": [{"kernel": "matmul", "flops_per_second": peak / 2},
                             {"kernel": "conv", "flops_per_second": peak}]}
        return {**FIGURES, "training_flops_per_example": 1e9}

    monkeypatch.setattr(sections, "run_cell", run_cell)
    output = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--precisions=float32,mixed_bfloat16", "--sections=roof,compute",
                     f"--output={output}"]) == 0
    report = json.loads(output.read_text())["sections"]
    assert [(r["precision"], r["kernel"]) for r in report["roof"]["rows"]] == [
        ("float32", "matmul"), ("float32", "conv"), ("bfloat16", "matmul"), ("bfloat16", "conv")]
    assert [(r["precision"], r["flops_per_second"], r["fraction_of_roof"])
            for r in report["compute"]["rows"]] == [("float32", 1e11, 0.25),
                                                     ("mixed_bfloat16", 1e11, 0.125)]


def test_flops_are_counted_from_the_convolutions_and_dense_layers():
    import keras

    images = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same")(images)  # 8*8*4 outputs x 3*3*2 weights
    x = keras.layers.MaxPooling2D()(x)  # not counted: no multiply-adds
    x = keras.layers.Conv2D(6, 1, groups=2)(x)  # 4*4*6 outputs x 1*1*(4/2) weights
    x = keras.layers.Dense(3)(keras.layers.Flatten()(x))  # 3 outputs x 96 weights
    assert roof.forward_flops(keras.Model(images, x)) == 2 * (4608 + 192 + 288)


def test_a_multi_worker_cell_without_fixed_steps_is_refused_when_made():
    """Its workers must make the same calls: none may judge its own speed."""
    with pytest.raises(ValueError, match="a multi_worker cell needs its steps fixed"):
        cells.Cell("mlp", "float32", 32, strategy="multi_worker", replicas=2)
    assert cells.Cell("mlp", "float32", 32, strategy="multi_worker", replicas=2, steps=2).workers == 2
    assert cells.Cell("mlp", "float32", 32, strategy="mirrored", replicas=2).workers == 0


def test_the_best_rate_times_every_window_with_one_call_at_least():
    calls = []
    rate = roof.best_rate(lambda: calls.append(1), 10, repeats=3, seconds=0)
    assert len(calls) == 3 and rate > 0 and math.isfinite(rate)


def test_an_output_that_is_the_programs_own_log_is_refused(tmp_path):
    """`--output=/dev/stdout >> run.log`: the JSON was renamed over run.log,
    its earlier lines gone, and the report printed after it lost with the
    old file."""
    log = tmp_path / "run.log"
    log.write_text("yesterday's results\n")
    with open(log, "a") as appended:
        result = subprocess.run([sys.executable, "-m", "distributed_mpt.benchmark", "--tiny",
                                 "--output=/dev/stdout"], stdout=appended, stderr=subprocess.PIPE,
                                text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert result.returncode == ExitCode.USAGE
    assert result.stderr.splitlines()[-1] == (
        "error: flag --output=/dev/stdout: is this program's standard output, which the report "
        "goes to: name a file of its own for the JSON")
    assert log.read_text() == "yesterday's results\n"


@dataclasses.dataclass(frozen=True)
class Killed:
    """A measurement whose process dies of a signal: a run_cell's cell."""

    module = "a_broken_measurement"  # written by the test below; not a field

    def describe(self) -> str:
        return "a cell that is killed"


@dataclasses.dataclass(frozen=True)
class Hangs(Killed):
    """A measurement whose process never ends."""

    def describe(self) -> str:
        return "a cell that hangs"


def test_a_cell_killed_by_a_signal_or_out_of_time_is_reported_as_such(tmp_path, monkeypatch):
    """A cell the OOM killer ended (SIGKILL) after seconds was reported as
    stopped after its 900 s time limit; one that hangs is stopped at it."""
    (tmp_path / "a_broken_measurement.py").write_text(
        "import os, signal, sys, time\n"
        "if sys.argv[1] == 'Killed':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    with pytest.raises(RuntimeError, match=r"^a cell that is killed: exited -9: killed by SIGKILL "
                                           r"\(out of memory\?\)$"):
        cells.run_cell(Killed())
    monkeypatch.setattr(cells, "CHILD_TIMEOUT_SECONDS", 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^a cell that hangs: stopped after 1 s, its time "
                                           r"limit$"):
        cells.run_cell(Hangs())
    assert time.monotonic() - started < 60, "bounded by its time limit"


def test_a_value_given_twice_is_measured_and_reported_once(tmp_path, monkeypatch):
    measured = []

    def run_cell(cell):
        measured.append(cell)
        return dict(FIGURES)

    monkeypatch.setattr(sections, "run_cell", run_cell)
    output = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--sections=training,training", "--models=mlp,mlp",
                     "--batch_sizes=32,032", "--precisions=float32,float32",
                     f"--output={output}"]) == 0
    rows = json.loads(output.read_text())["sections"]["training"]["rows"]
    assert [(r["model"], r["precision"], r["batch_size"]) for r in rows] == [
        ("mlp", "float32", 32)] and len(measured) == 1
