"""distributed-mpt-prepare-data as a careless user meets it: where it cannot
write, and what it leaves behind (no network here: tensorflow-datasets'
download is replaced by a tiny binary release, as tests/core does)."""

import os

import pytest

from conftest import SMOKE_FLAGS, assert_one_error_line, run_in_process


def _prepare(args):
    from distributed_mpt.prepare_data import main
    return run_in_process(main, args)


def _train(args):
    from distributed_mpt.train import main
    return run_in_process(main, args)


@pytest.mark.skipif(os.geteuid() != 0, reason="as root: another user is refused /proc outright")
@pytest.mark.parametrize("run, args, said", [
    (_prepare, ["--data_dir=/proc"],
     "--data_dir=/proc is not writable (cannot make a file in it: No such file or directory)"),
    (_train, [*SMOKE_FLAGS, "--model_dir=/proc/run"],
     "--model_dir=/proc/run is not writable (cannot make it: No such file or directory)")])
def test_a_directory_in_a_pseudo_file_system_is_refused_for_what_fails(run, args, said):
    # Was "--data_dir=/proc is not writable (No such file or directory)", of
    # a directory that exists: the C library's reason for the file or folder
    # that could not be made there, given as the directory's.
    assert_one_error_line(run(args), said)
