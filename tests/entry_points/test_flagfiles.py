"""Every entry point's --flagfile, given what is no flagfile: a FIFO (absl
waits on it forever), a device, a folder, a binary file. Each is one
`error:` line naming the file, exit 2, whichever program reads it."""

import importlib

import pytest

from conftest import SMOKE_FLAGS, deadline, make_path, run_in_process

PROGRAMS = {"train": ("distributed_mpt.train", ["--model_dir=unused"]),
            "predict": ("distributed_mpt.predict", ["--model_dir=unused", "--evaluate"]),
            "benchmark": ("distributed_mpt.benchmark.cli", ["--tiny"]),
            "prepare-data": ("distributed_mpt.prepare_data", []),
            "scaling": ("distributed_mpt.benchmark.scaling", [])}


def _binary(path):
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    return path


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("kind, said", [("FIFO", "is a FIFO, not a regular file"),
                                        ("device", "is a device node, not a regular file"),
                                        ("directory", "is a directory, not a regular file"),
                                        ("binary", "is damaged (not UTF-8 text at byte 0)")])
def test_a_flagfile_that_is_no_text_file_is_one_error_line(program, kind, said, tmp_path):
    module, others = PROGRAMS[program]
    path = _binary(tmp_path / "flags") if kind == "binary" else make_path(kind, tmp_path / "flags")
    with deadline(60):  # a FIFO opened would block: fail instead
        result = run_in_process(importlib.import_module(module).main,
                                [f"--flagfile={path}", *others])
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert f"{path} {said}; --flagfile takes a text file of flags" in result.stderr


@pytest.mark.parametrize("program, flag", [("train", "model_dir"), ("train", "data_dir"),
                                           ("predict", "model_dir")])
@pytest.mark.parametrize("written", ["$HOME", "${HOME}"])
def test_a_variable_no_shell_expanded_in_a_path_is_one_error_line(program, flag, written,
                                                                  tmp_path, monkeypatch):
    # A flagfile's lines reach the program as written: training made a
    # folder named `$HOME` in the working directory, and trained there.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    flagfile = tmp_path / "run.flags"
    flagfile.write_text(f"--{flag}={written}/runs/a\n")
    module = PROGRAMS[program][0]
    others = ["--evaluate"] if program == "predict" else [*SMOKE_FLAGS, "--train_steps=2"]
    if flag == "data_dir":
        others.append(f"--model_dir={tmp_path / 'run'}")
    result = run_in_process(importlib.import_module(module).main,
                            [f"--flagfile={flagfile}", *others])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (f"error: --{flag}={written}/runs/a holds {written}, which no shell "
                             f"expanded (in a flagfile, or quoted): write the path out\n")
    assert list((tmp_path / "work").iterdir()) == [], "nothing made"
