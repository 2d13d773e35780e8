"""The benchmark: every section's figures, failures reported as such, flags.

Behaviour only: no test asserts a speed or the value of a ratio, which
depend on the machine and its load.
"""

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import run_module
from distributed_mpt import config
from distributed_mpt.benchmark import cells, cli, sections
from distributed_mpt.benchmark.sections import SECTIONS


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


def test_a_failing_section_is_reported_failed_and_the_exit_status_is_1(tmp_path, monkeypatch,
                                                                       capsys):
    def run_cell(cell):  # float32 trains, the mixed policy breaks
        if cell.precision != "float32":
            raise RuntimeError(f"{cell.describe()}: exited 1: error: ValueError: boom")
        return {"examples_per_second": 100.0, "runs": [100.0], "steps": 2, "replicas": 1,
                "peak_memory_bytes": 2**20}

    monkeypatch.setattr(sections, "run_cell", run_cell)
    output = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--precisions=float32", "--sections=training,mixed_precision",
                     f"--output={output}"]) == 1
    report = json.loads(output.read_text())
    _assert_figures(report, ["training"])
    assert report["sections"]["mixed_precision"]["failed"].endswith("exited 1: error: ValueError: boom")
    printed = capsys.readouterr()
    assert "mixed_precision: " in printed.out and "  FAILED: " in printed.out
    assert "error: section mixed_precision FAILED: " in printed.err


def test_a_cell_that_fails_in_its_process_raises_its_last_error_line():
    too_large = cells.Cell("mlp", "float32", batch_size=64, model_width=8, examples=32, repeats=1)
    with pytest.raises(RuntimeError, match=r"exited 1: error: ConfigError: the global batch of 64"):
        cells.run_cell(too_large)


def test_bad_flags_are_one_error_line_and_exit_2(tmp_path, capsys):
    output = tmp_path / "bench.json"
    for flag, message in (
            ("--models=vgg", f"--models: vgg not one of {', '.join(config.MODELS)}"),
            ("--repeats=x", "flag --repeats=x: invalid literal for int() with base 10: 'x'")):
        assert cli.main([flag, f"--output={output}"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert not output.exists()


def test_help_describes_every_section_and_has_no_hidden_flag(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name, section in SECTIONS.items():
        assert f"  {name}: {section.about.split()[0]}" in text
    assert not [name for name in cli._flag_values() if name.startswith("_")]
    assert "minutes on 2 CPU cores" in text
