"""Exit codes: each named once in errors.py, with what a restart policy does
with it; the documentation's table is that one; the signals that end a
process say the same as the codes it would exit with."""

import re
from pathlib import Path

from distributed_mpt import errors, launch
from distributed_mpt.process import stopping
from distributed_mpt.errors import ExitCode

RELIABILITY = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def test_the_documented_table_is_the_one_in_errors_py():
    assert errors.exit_code_table() in RELIABILITY.read_text(), \
        "regenerate docs/reliability.md's table with errors.exit_code_table()"


def test_codes_follow_kubeflows_exit_code_restart_policy():
    # restartPolicy: ExitCode retries 128-255 and gives up on 1-127.
    for code in ExitCode:
        assert code.retryable == (code >= 128), code.name
    assert len({int(code) for code in ExitCode}) == len(ExitCode), "no code means two things"


def test_the_launcher_gives_up_only_on_codes_a_restart_cannot_fix():
    assert all(not ExitCode(code).retryable for code in launch._PERMANENT)


def test_a_process_ended_by_the_peer_watchdog_reports_the_named_code():
    assert errors.status_of_signal(stopping.PEER_TIMEOUT_SIGNAL) == ExitCode.PEER_TIMEOUT
    assert errors.status_of_signal(stopping.WAITING_WORKER_STOP_SIGNAL) == ExitCode.KILLED
    assert launch.exit_status(-stopping.PEER_TIMEOUT_SIGNAL) == ExitCode.PEER_TIMEOUT


def test_every_code_is_one_a_user_can_read_about():
    for code in ExitCode:
        assert code.meaning and not re.search(r"\s{2}", code.meaning), code.name
