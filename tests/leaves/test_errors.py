"""Exit codes: each named once in errors.py, with what a restart policy does
with it; the documentation's table is that one; the signals that end a
process say the same as the codes it would exit with. And the one line an
error is reported in."""

import os
import re
import signal
import time
import warnings
from pathlib import Path

import pytest

from distributed_mpt import cli, errors, launch
from distributed_mpt.process import stopping
from distributed_mpt.errors import ExitCode, first_line

RELIABILITY = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_the_documented_table_is_the_one_in_errors_py():
    assert errors.exit_code_table() in RELIABILITY.read_text(), \
        "regenerate docs/reliability.md's table with errors.exit_code_table()"


def test_codes_follow_kubeflows_exit_code_restart_policy():
    # restartPolicy: ExitCode retries 128-255 and gives up on 1-127.
    for code in ExitCode:
        assert code.retryable == (code >= 128), code.name
    assert len({int(code) for code in ExitCode}) == len(ExitCode), "no code means two things"


def test_the_launcher_gives_up_only_on_codes_a_restart_cannot_fix():
    # And on a busy --model_dir: retryable with a backoff, which the
    # launcher's restart at once has not.
    assert {code for code in launch._NOT_RESTARTED if ExitCode(code).retryable} == \
        {ExitCode.MODEL_DIR_BUSY}
    assert {ExitCode.USAGE, ExitCode.DIVERGED} <= set(launch._NOT_RESTARTED)


def test_a_process_ended_by_the_startup_watchdog_reports_the_named_code():
    assert errors.status_of_signal(stopping.PEER_TIMEOUT_SIGNAL) == ExitCode.PEER_TIMEOUT
    assert errors.status_of_signal(stopping.WAITING_WORKER_STOP_SIGNAL) == ExitCode.KILLED
    assert launch.exit_status(-stopping.PEER_TIMEOUT_SIGNAL) == ExitCode.PEER_TIMEOUT


def test_every_code_is_one_a_user_can_read_about():
    for code in ExitCode:
        assert code.meaning and not re.search(r"\s{2}", code.meaning), code.name


def test_first_line():
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(KeyError()) == "KeyError", "an error without a message: its kind"
    assert first_line("x" * 300, 10) == "x" * 10
    assert first_line("\nafter a blank line") == "after a blank line"


def test_first_line_of_an_error_in_a_tf_function_is_its_cause():
    import tensorflow as tf  # here: the rest of this file needs no TensorFlow

    @tf.function
    def gather_out_of_range(values):
        return tf.gather(values, 5)

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        gather_out_of_range(tf.constant([1, 2]))
    assert str(raised.value).startswith("Graph execution error:"), "what TensorFlow says first"
    assert re.match(r"indices.* = 5 is not in \[0, 2\)", first_line(raised.value)), \
        first_line(raised.value)


# What TensorFlow 2.21 raised for tf.gather out of range in a tf.function
# under MirroredStrategy on 2 logical CPUs (its frames shortened).
_TWO_REPLICAS_FAILED = """Graph execution error:

Detected at node replica_1/GatherV2 defined at (most recent call last):
  File "<stdin>", line 7, in <lambda>

Detected at node GatherV2 defined at (most recent call last):
  File "<stdin>", line 7, in <lambda>

2 root error(s) found.
  (0) INVALID_ARGUMENT:  indices = 5 is not in [0, 2)
\t [[{{node replica_1/GatherV2}}]]
  (1) INVALID_ARGUMENT:  indices = 5 is not in [0, 2)
\t [[{{node GatherV2}}]]
0 successful operations.
0 derived errors ignored. [Op:__inference_step_20]"""


def test_first_line_of_errors_on_several_replicas_is_the_first_cause():
    assert first_line(_TWO_REPLICAS_FAILED) == "indices = 5 is not in [0, 2)"



# What autograph (TensorFlow 2.21) made of a TypeError in a user's layer,
# Keras installed as Debian installs it (a folder sysconfig does not name).
_IN_USER_CODE = """in user code:

    File "/home/user/model.py", line 14, in call  *
        raise TypeError("a user's complaint")
    File "/usr/lib/python3/dist-packages/keras/src/layers/layer.py", line 900, in __call__
        outputs = super().__call__(*args, **kwargs)

    TypeError: a user's complaint
"""


def test_an_error_inside_autograph_is_named_at_the_users_line_not_a_librarys():
    assert errors.inside_autograph(_IN_USER_CODE) == (
        "TypeError", "a user's complaint", "/home/user/model.py:14")
    assert errors.inside_autograph("in user code: no frames") is None


def test_quoted_escapes_what_would_reorder_hide_or_not_print_but_keeps_joiners():
    assert errors.quoted("god\u202etac ca\u200bt \udcff") == "god\\u202etac ca\\u200bt \\udcff"
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # written with a ZWNJ
    emoji = "\U0001f469\u200d\U0001f52c"  # a woman scientist: two joined by a ZWJ
    assert errors.quoted(persian) == persian and errors.quoted(emoji) == emoji

@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt(), ExitCode.ABORTED),
                                        (stopping.Terminated(), ExitCode.PREEMPTED)])
def test_an_entry_point_stopped_says_so_and_exits_with_the_stops_code(stop, code, capsys):
    # One mechanism for predict, prepare_data, the benchmark and the scaling
    # projection: Ctrl-C aborts, SIGTERM (raised as Terminated) is a preemption.
    def stopped():
        raise stop

    assert cli.guarded(stopped, on_interrupt="nothing written") == code
    assert capsys.readouterr().err == "interrupted: nothing written\n"
    with pytest.raises(type(stop)):  # an entry point that saves on a stop handles it itself
        cli.guarded(stopped)


def test_libraries_warnings_are_shown_where_a_filter_makes_warnings_errors():
    """PYTHONWARNINGS=error failed a run at its export, on NumPy's warning of
    Keras' np.array(tensor); a user's own filter before `error` still decides."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", UserWarning)  # the user's, before `error`
        cli.libraries_warnings_stay_warnings()
        with warnings.catch_warnings(record=True) as shown:
            warnings.warn_explicit("Keras' own", DeprecationWarning, "x.py", 1, module="keras.src")
        assert [str(w.message) for w in shown] == ["Keras' own"]
        warnings.warn_explicit("ignored", UserWarning, "x.py", 1, module="keras.src")
        with pytest.raises(DeprecationWarning):
            warnings.warn_explicit("the package's", DeprecationWarning, "x.py", 1,
                                   module="distributed_mpt.training")


@pytest.mark.parametrize("raised", [RuntimeError("no"), KeyboardInterrupt(), SystemExit(7)])
def test_an_error_whose_message_raises_is_named_by_its_type(raised):
    """A user's exception whose __str__ raised KeyboardInterrupt or called
    sys.exit() gave a traceback, or ended the run silently with its code."""
    class Unsayable(Exception):
        def __str__(self):
            raise raised

    assert errors.text_of(Unsayable()) == "Unsayable (whose message cannot be shown)"
    assert errors.first_line(Unsayable()) == "Unsayable (whose message cannot be shown)"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_ends_a_command_with_one_line_and_the_stop_code(stop, capsys):
    """predict and prepare-data, past their start, died of SIGTERM and SIGHUP
    without a word (SIGHUP with 129, where a stop is documented as 143)."""
    def stopped():
        os.kill(os.getpid(), stop)
        time.sleep(30)  # the handler raises here
        return ExitCode.OK

    assert cli.guarded(stopped, on_interrupt="nothing written") == ExitCode.PREEMPTED
    assert capsys.readouterr().err == "interrupted: nothing written\n"


def test_a_command_called_from_another_thread_leaves_the_signals_alone(capsys):
    """A library caller's thread (a web server's) may not set handlers:
    Python raises ValueError where it tries."""
    import threading

    codes = []
    thread = threading.Thread(target=lambda: codes.append(
        cli.guarded(lambda: ExitCode.OK, on_interrupt="nothing written")))
    thread.start()
    thread.join()
    assert codes == [ExitCode.OK]
