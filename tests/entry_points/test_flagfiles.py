"""Every entry point's --flagfile, given what is no flagfile: a FIFO (absl
waits on it forever), a device, a folder, a binary file. Each is one
`error:` line naming the file, exit 2, whichever program reads it."""

import importlib

import pytest

from conftest import deadline, make_path, run_in_process

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
