"""docs/pytorch_side_by_side.py, the comparison with upstream airbench94 in
PyTorch (not a dependency: its measurements are not run here, and no speed
is asserted). Its command line is checked before PyTorch is imported."""

import subprocess
import sys

import pytest

from conftest import REPO, assert_one_error_line, subprocess_env

SCRIPT = REPO / "docs" / "pytorch_side_by_side.py"


def _run(*args, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=subprocess_env(**env), cwd=REPO)


def _inputs(tmp_path):
    """--airbench and --data_dir as the script checks them (never run)."""
    data = tmp_path / "data"
    (data / "cifar-10-batches-bin").mkdir(parents=True)
    airbench = tmp_path / "airbench94.py"
    airbench.write_text("raise SystemExit('must not be imported')\n")
    return f"--airbench={airbench}", f"--data_dir={data}"


def test_help_says_how_to_run_it_and_what_differs_from_upstream():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for word in ("--airbench", "--data_dir", "--precision", "--benchmark", "legacy/airbench94.py",
                 ".cuda()", ".half()"):
        assert word in result.stdout, word


def test_bad_arguments_are_one_error_line_before_anything_runs(tmp_path):
    data = tmp_path / "data"
    (data / "cifar-10-batches-bin").mkdir(parents=True)
    airbench = tmp_path / "airbench94.py"
    airbench.write_text("raise SystemExit('must not be imported')\n")
    assert_one_error_line(_run(f"--data_dir={data}"), "--airbench")
    assert_one_error_line(_run(f"--airbench={tmp_path / 'absent.py'}", f"--data_dir={data}"),
                          "legacy/airbench94.py")
    assert_one_error_line(_run(f"--airbench={airbench}", f"--data_dir={tmp_path}"),
                          "cifar-10-batches-bin")
    assert_one_error_line(_run(f"--airbench={airbench}", f"--data_dir={data}", "--rounds=0"),
                          "--rounds")
    assert_one_error_line(_run(f"--airbench={airbench}", f"--data_dir={data}",
                               "--precision=float16"), "--precision")


def test_a_python_without_pytorch_is_told_before_anything_runs(tmp_path):
    import importlib.metadata

    try:
        importlib.metadata.version("torch")
        pytest.skip("PyTorch is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    assert_one_error_line(_run(*_inputs(tmp_path), "--benchmark=false"),
                          "PyTorch is not installed in this Python")


def test_the_figures_say_their_cpu_and_pytorch(tmp_path):
    """Printed before the first round (whose package benchmark, `false`,
    fails here): the CPU, as /proc/cpuinfo names it, and PyTorch's version,
    as its installation's metadata says (a stand-in's, without PyTorch)."""
    site = tmp_path / "site"
    (site / "torch-9.8.7.dist-info").mkdir(parents=True)
    (site / "torch-9.8.7.dist-info" / "METADATA").write_text("Name: torch\nVersion: 9.8.7\n")
    result = _run(*_inputs(tmp_path), "--benchmark=false", PYTHONPATH=str(site))
    print(result.stdout + result.stderr)
    assert_one_error_line(result, "the package's benchmark exited 1", exit_code=1)
    model = next(line.partition(":")[2].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name"))
    (header,) = result.stdout.splitlines()
    assert "PyTorch 9.8.7;" in header and f"cores of an {model};" in header, header
