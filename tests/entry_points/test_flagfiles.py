"""Every entry point's --flagfile, given what is no flagfile: a FIFO (absl
waits on it forever), a device, a folder, a binary file. Each is one
`error:` line naming the file, exit 2, whichever program reads it."""

import importlib
import os
import subprocess
import sys

import pytest

from conftest import (REPO, SMOKE_FLAGS, assert_ok, deadline, make_path, run_in_process,
                      subprocess_env)

PROGRAMS = {"train": ("distributed_mpt.train", ["--model_dir=unused"]),
            "predict": ("distributed_mpt.predict", ["--model_dir=unused", "--evaluate"]),
            "benchmark": ("distributed_mpt.benchmark.cli", ["--tiny"]),
            "prepare-data": ("distributed_mpt.prepare_data", []),
            "scaling": ("distributed_mpt.benchmark.scaling", []),
            "launch": ("distributed_mpt.launch", ["--", "--model_dir=unused"])}


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


@pytest.mark.parametrize("content, said", [
    # A log given by mistake: absl read it all, 6 s and 160 MB a million lines.
    (b"--model=mlp\n" * 100_000, "holds 1,200,000 bytes, where a flagfile holds a few thousand "
                                 "(at most 1,048,576 are read): is it the file you meant?"),
    # absl took the mark for part of the first flag: "unexpected argument(s) \ufeff--model=mlp".
    ("\ufeff--model=mlp\n".encode(), "begins with a byte order mark (as some Windows editors "
                                     "save UTF-8): save it without one")])
def test_a_flagfile_too_large_or_with_a_byte_order_mark_is_one_error_line(content, said,
                                                                        tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_bytes(content)
    from distributed_mpt.train import main

    result = run_in_process(main, [f"--flagfile={flagfile}", f"--model_dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert result.stderr == f"error: --flagfile={flagfile} {said}\n"
    assert not (tmp_path / "run").exists()


def _chain(tmp_path, length, times=1):
    """Flagfiles 0..length, each naming the next `times` times; the last sets a flag."""
    for i in range(length):
        (tmp_path / f"{i}.flags").write_text(f"--flagfile={tmp_path / f'{i + 1}.flags'}\n" * times)
    (tmp_path / f"{length}.flags").write_text("--train_steps=2\n")
    return tmp_path / "0.flags"


@pytest.mark.parametrize("length, times, last", [
    # absl reads a flagfile again wherever it is named: 20**6, 64 million reads, a hang.
    (6, 20, 6),
    # A chain of a thousand ended in a RecursionError's traceback.
    (1000, 1, 256)])
def test_flagfiles_that_name_flagfiles_without_end_are_one_error_line(length, times, last,
                                                                      tmp_path):
    from distributed_mpt.train import main

    flagfile = _chain(tmp_path, length, times)
    with deadline(60):
        result = run_in_process(main, [f"--flagfile={flagfile}", f"--model_dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert result.stderr == (f"error: --flagfile={tmp_path / f'{last}.flags'} is flagfile 257 of "
                             f"this command, where at most 256 are read (each counted every time "
                             f"it is named): nest fewer, or name each once\n")
    assert not (tmp_path / "run").exists()
    # A few nested, each named once, are read as before.
    assert_ok(run_in_process(main, [f"--flagfile={_chain(tmp_path, 3)}", *SMOKE_FLAGS,
                                    f"--model_dir={tmp_path / 'run'}"]))


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


@pytest.mark.parametrize("program, flag", [("train", "data_dir"), ("predict", "data_dir"),
                                           ("prepare-data", "data_dir"),
                                           ("benchmark", "output"), ("train", "flagfile"),
                                           ("predict", "flagfile"), ("benchmark", "flagfile")])
@pytest.mark.parametrize("value", ["", "  "])
def test_a_path_flag_given_empty_is_one_error_line(program, flag, value, tmp_path, monkeypatch,
                                                   capsys):
    # `--data_dir=$DATA` with DATA unset: prepare-data downloaded into
    # ~/tensorflow_datasets, the benchmark measured and wrote no file.
    # `--flagfile=$FLAGS` was read as no flagfile: training ran on the defaults.
    from distributed_mpt.benchmark import sections

    monkeypatch.setattr(sections, "run_cell", lambda cell: pytest.fail("measured"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    module, others = PROGRAMS[program]
    if program == "train":
        others = [*SMOKE_FLAGS, "--train_steps=2", f"--model_dir={tmp_path / 'run'}"]
    elif program == "predict":
        others = [f"--model_dir={tmp_path}", "--evaluate"]
    code = importlib.import_module(module).main([f"--{flag}={value}", *others])
    assert code == 2
    assert capsys.readouterr().err == (f"error: --{flag}={value} is empty: give a path (an unset "
                                       f"shell variable gives an empty value)\n")
    assert list(tmp_path.iterdir()) == [], "nothing made"


@pytest.mark.parametrize("program, flag", [("train", "model_dir"), ("predict", "model_dir"),
                                           ("prepare-data", "data_dir"),
                                           ("benchmark", "output"), ("scaling", "svg")])
def test_a_path_flag_of_a_dash_is_one_error_line(program, flag, tmp_path, monkeypatch, capsys):
    # `--output=-` wrote the benchmark's JSON to a file named '-', not to
    # standard output as elsewhere; `--model_dir=-` trained into a folder '-'.
    from distributed_mpt.benchmark import sections

    monkeypatch.setattr(sections, "run_cell", lambda cell: pytest.fail("measured"))
    monkeypatch.chdir(tmp_path)
    module, others = PROGRAMS[program]
    others = {"train": [*SMOKE_FLAGS, "--train_steps=2"], "predict": ["--evaluate"]}.get(
        program, others)
    code = importlib.import_module(module).main([f"--{flag}=-", *others])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --{flag}=- would be a file or folder named '-'"), err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == [], "one line, nothing made"


def test_a_dollar_underscore_in_a_path_is_taken_as_written(monkeypatch):
    # Every shell sets $_ for itself: '/data/exp$_' was refused as unexpanded.
    from absl import flags

    from distributed_mpt import cli

    monkeypatch.setenv("_", "/usr/bin/env")
    fv = flags.FlagValues()
    flags.DEFINE_string("model_dir", None, "", flag_values=fv)
    fv(["prog", "--model_dir=/data/exp$_/x"])
    cli.check_path_flags(fv, "model_dir")


@pytest.mark.parametrize("locale, encoding", [("C", "utf-8"), ("C.UTF-8", "latin-1")])
def test_a_path_flag_that_is_not_utf8_is_one_error_line(locale, encoding, tmp_path):
    # Under LC_ALL=C (and PYTHONUTF8=0) the name café, and under any locale
    # a Latin-1 name, reaches Python as surrogates, which TensorFlow's file
    # system cannot take: training made the directory, then raised ValueError
    # ("Error converting unicode string") with a traceback.
    model_dir = os.fsencode(tmp_path) + b"/" + "café".encode(encoding)
    result = subprocess.run(
        [sys.executable, "-m", "distributed_mpt.train", *SMOKE_FLAGS, "--train_steps=2",
         b"--model_dir=" + model_dir], capture_output=True, timeout=300, cwd=REPO,
        env=subprocess_env(LC_ALL=locale, PYTHONUTF8="0"))
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: --model_dir={tmp_path}/caf\\udc{'c3' if encoding == 'utf-8' else 'e9'}"
        + ("\\udca9" if encoding == "utf-8" else "") + " is not UTF-8 text, the only paths "
        "this program takes: set a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1 if the name is "
        "UTF-8, else rename it"], stderr
    assert list(tmp_path.iterdir()) == [], "nothing made"


@pytest.mark.parametrize("program", ["train", "prepare-data"])
def test_a_relative_path_in_a_deleted_working_directory_is_one_error_line(program, tmp_path):
    # The shell's directory removed under it (rm -r in another terminal):
    # train and prepare-data ended in FileNotFoundError with a traceback.
    gone = tmp_path / "gone"
    gone.mkdir()
    flag = "model_dir" if program == "train" else "data_dir"
    others = [*SMOKE_FLAGS, "--train_steps=2"] if program == "train" else []
    script = (f"import os, runpy, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
              f"sys.argv = ['{program}', '--{flag}=runs/a', *{others!r}]; "
              f"runpy.run_module({PROGRAMS[program][0]!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, env=subprocess_env(), cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (f"error: --{flag}=runs/a is relative to the working directory, "
                             f"which was deleted: cd to one that exists, or give a full path\n")


def test_a_path_with_a_hash_in_its_name_is_taken(tmp_path, monkeypatch):
    # A name a person gives, on the command line: what reads as a comment
    # in a flagfile (below) was refused here too, with words about flagfiles.
    monkeypatch.chdir(tmp_path)
    from distributed_mpt.train import main

    assert_ok(run_in_process(main, ["--model_dir=runs/try # 2", *SMOKE_FLAGS, "--train_steps=2"]))
    assert (tmp_path / "runs" / "try # 2" / "summary.json").exists()


_QUOTES = "is in quotes, which a flagfile keeps as part of the value (no shell reads it): " \
          "write it without them"
_COMMENT = "holds a comment, which a flagfile keeps as part of the value (no shell reads it): " \
           "put it on a line of its own, starting with #"


@pytest.mark.parametrize("line, said", [
    ('--model_dir="runs/a"', _QUOTES), ("--data_dir='photos'", _QUOTES),
    ("--model_dir=runs/a  # first try", _COMMENT), ("--model_dir=runs/a #first try", _COMMENT),
    ("--model_dir=runs/a \\", "ends in a backslash, which a flagfile keeps as part of the value "
                              "(no shell reads it): end the line without one")])
def test_a_path_in_a_flagfile_written_as_for_a_shell_is_one_error_line(line, said, tmp_path,
                                                                       monkeypatch):
    # A flagfile's line reaches the program whole: training made a folder
    # named `"runs` (or `a  # first try`) in the working directory, and trained there.
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    flagfile = tmp_path / "run.flags"
    flagfile.write_text(line + "\n")
    from distributed_mpt.train import main

    result = run_in_process(main, [f"--flagfile={flagfile}", *SMOKE_FLAGS, "--train_steps=2"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == f"error: {line} in --flagfile={flagfile} {said}\n"
    assert list((tmp_path / "work").iterdir()) == [], "nothing made"
