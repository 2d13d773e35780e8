"""docs/pytorch_side_by_side.py, the comparison with upstream airbench94 in
PyTorch (not a dependency: its measurements are not run here, and no speed
is asserted). Its command line is checked before PyTorch is imported."""

import subprocess
import sys

from conftest import REPO, assert_one_error_line, subprocess_env

SCRIPT = REPO / "docs" / "pytorch_side_by_side.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=subprocess_env(), cwd=REPO)


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
