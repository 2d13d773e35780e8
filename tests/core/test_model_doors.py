"""What a user's model file (--model=path.py:function) may do to the
process, and where its code runs after training (the export), through the
real training entry point: set back with a warning, or refused with one
`error:` line, exit 2 and nothing half-written."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_ok, assert_one_error_line, subprocess_env, train

_FLAT = ("import keras\n\n\n"
         "def _flat(info):\n"
         "    images = keras.Input(info.image_shape, dtype='uint8')\n"
         "    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))\n"
         "    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))\n\n\n")
FLAGS = ["--dataset=synthetic", "--synthetic_examples=256", "--per_replica_batch_size=32",
         "--precision=float32", "--warmup_epochs=0", "--noevaluate", "--train_steps=2",
         "--steps_per_loop=2", "--log_every_steps=2"]


def _model(tmp_path, body: str, head: str = "") -> str:
    source = tmp_path / "doors_model.py"
    source.write_text(head + _FLAT + "def net(info):\n" + body + "    return _flat(info)\n")
    return f"--model={source}:net"


@pytest.mark.parametrize("head, warnings_env", [
    ("warnings.simplefilter('error')", None),
    # Under -W error, the filter that keeps the libraries' warnings warnings
    # (cli.libraries_warnings_stay_warnings) removed: set back behind the
    # error filter, so that the export failed all the same (found by review).
    ("warnings.resetwarnings()", "error"),
    ("warnings.resetwarnings()\nwarnings.simplefilter('error')", "error")])
def test_a_model_file_that_makes_warnings_errors_is_set_back_and_the_run_exports(
        tmp_path, head, warnings_env):
    """warnings.simplefilter("error") in a model file: training and
    evaluation finished, then Keras' own DeprecationWarning failed the
    export with a traceback, exit 1, no summary.json."""
    run = tmp_path / "run"
    result = train([*FLAGS, _model(tmp_path, "    pass\n", head=f"import warnings\n{head}\n"),
                    f"--model_dir={run}"],
                   **({"env": subprocess_env(PYTHONWARNINGS=warnings_env)} if warnings_env else {}))
    assert_ok(result)
    assert "Traceback" not in result.stderr
    assert 'changed the warnings filters that make warnings errors (warnings.simplefilter(' \
           '"error")), or that keep them warnings (warnings.resetwarnings()), which the run ' \
           'relies on: set back' in result.stderr
    assert (run / "summary.json").is_file() and (run / "export" / "model.keras").is_file()


def test_a_umask_the_model_sets_is_set_back_and_the_runs_files_keep_their_modes(tmp_path):
    """os.umask(0o777) in the model function: exit 0, and every file of
    the run (config.json, checkpoints, the export) was mode 000. In a
    process of its own: the umask is the whole process's."""
    run = tmp_path / "run"
    result = train([*FLAGS, _model(tmp_path, "    import os\n    os.umask(0o777)\n"),
                    f"--model_dir={run}"], timeout=300)
    assert_ok(result)
    assert "changed the umask (os.umask), which gives the run's files their modes, which the " \
           "run relies on: set back" in result.stderr
    for path in (run / "config.json", run / "summary.json", run / "export" / "model.keras"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o600 == 0o600, path


@pytest.mark.parametrize("body, what", [
    ("    import tempfile\n    tempfile.tempdir = '/nonexistent-dmpt-tmp'\n",
     "the folder of temporary files (tempfile.tempdir)"),
    ("    import sys\n    sys.setrecursionlimit(120)\n",
     "Python's recursion limit (sys.setrecursionlimit)")])
def test_a_temporary_folder_or_recursion_limit_the_model_sets_is_set_back(tmp_path, body, what):
    """tempfile.tempdir set to a missing folder, or sys.setrecursionlimit(120),
    in the model function: the error line blamed the model's first training
    step, with a cause that did not say why (found by review)."""
    run = tmp_path / "run"
    result = train([*FLAGS, _model(tmp_path, body), f"--model_dir={run}"], timeout=300)
    assert_ok(result)
    assert f"changed {what}, which the run relies on: set back" in result.stderr
    assert (run / "summary.json").is_file() and (run / "export" / "model.keras").is_file()


def test_a_recursion_limit_the_model_raises_is_kept(tmp_path):
    """sys.setrecursionlimit(10000), as very deep Keras models need: raised,
    it was set back to 1000 with a warning (found in review)."""
    run = tmp_path / "run"
    result = train([*FLAGS, _model(tmp_path, "    import sys\n    sys.setrecursionlimit(10000)\n"),
                    "--noexport", f"--model_dir={run}"], timeout=300)
    assert_ok(result)
    assert "recursion limit" not in result.stderr


def test_a_model_that_sets_keras_float_type_itself_is_refused_and_set_back(tmp_path):
    """keras.config.set_floatx("float16"): the policy was set back, not
    the float type, and the error line blamed the first training step
    (TypeError of a Pack op's types)."""
    import keras

    run = tmp_path / "run"
    result = train([*FLAGS, _model(tmp_path, "    keras.config.set_floatx('float16')\n"),
                    f"--model_dir={run}"])
    assert_one_error_line(result, "sets Keras' default float type (keras.config.set_floatx) "
                                  "itself (float16), which the run keeps float32 (its "
                                  "variables'), computing in the precision --precision sets")
    assert keras.config.floatx() == "float32", "set back"
    assert not run.exists()


def test_a_model_file_path_that_is_not_utf8_is_said_as_for_every_path_flag(tmp_path):
    """It said "does not import (UnicodeEncodeError: ... surrogates not
    allowed)"."""
    source = os.fsencode(tmp_path) + b"/bad\xff.py"
    with open(source, "w") as f:
        f.write(_FLAT + "def net(info):\n    return _flat(info)\n")
    result = subprocess.run(
        [sys.executable, "-m", "distributed_mpt.train", *FLAGS, b"--model=" + source + b":net",
         f"--model_dir={tmp_path / 'run'}"], capture_output=True, timeout=300, cwd=REPO,
        env=subprocess_env(PYTHONUTF8="0"))
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: --model={tmp_path}/bad\\udcff.py:net is not UTF-8 text, the only paths this "
        f"program takes: set a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1 if the name is "
        f"UTF-8, else rename it"], stderr
    assert not (tmp_path / "run").exists()


# A get_config() that works once (the check before training) and raises
# the second time (the export's save, on the chief only).
_FAILS_IN_THE_EXPORT = (
    "import keras\n\n\nclass Net(keras.Model):\n"
    "    def __init__(self, classes, **kwargs):\n"
    "        super().__init__(**kwargs)\n"
    "        self.classes, self.calls = classes, 0\n"
    "        self.flat, self.dense = keras.layers.Flatten(), keras.layers.Dense(classes)\n"
    "        self.scale = keras.layers.Rescaling(1 / 255)\n\n"
    "    def call(self, images, training=False):\n"
    "        return self.dense(self.flat(self.scale(images)))\n\n"
    "    def get_config(self):\n"
    "        self.calls += 1\n"
    "        if self.calls > 1:\n"
    "            raise RuntimeError('get_config the second time')\n"
    "        return {**super().get_config(), 'classes': self.classes}\n\n\n"
    "def net(info):\n    return Net(info.num_classes)\n")


def test_a_model_whose_code_fails_in_the_export_is_one_error_line_and_a_run_again_finishes(
        tmp_path):
    """A get_config() that works once (the check before training) and
    raises the second time (the export's save): a traceback, exit 1."""
    source = tmp_path / "once.py"
    source.write_text(_FAILS_IN_THE_EXPORT)
    run = tmp_path / "run"
    result = train([*FLAGS, f"--model={source}:net", f"--model_dir={run}"])
    assert_one_error_line(result, "failed in the export, after training; run again with "
                                  "--noexport to finish (a change to the model's source makes "
                                  "another network: it trains anew, in another --model_dir) "
                                  "(RuntimeError: get_config the second time)")
    assert not (run / "export").exists()
    assert [p.name for p in run.iterdir() if p.name.startswith(".export")] == [], "no staging"
    again = train([*FLAGS, f"--model={source}:net", f"--model_dir={run}", "--noexport"])
    assert_ok(again)
    assert "nothing is left to train" in again.stdout and (run / "summary.json").is_file()
    # What the line says of a fixed model: it "ran again, fixed", and was refused.
    fixed = tmp_path / "fixed.py"
    fixed.write_text(_FAILS_IN_THE_EXPORT.replace("self.calls > 1", "self.calls > 9"))
    assert_one_error_line(train([*FLAGS, f"--model={fixed}:net", f"--model_dir={run}"]),
                          "is not the network the run in --model_dir")


def test_the_error_line_starts_a_line_after_a_prompt_the_model_wrote(tmp_path):
    """--model=builtins:input writes its prompt (the dataset's info)
    without a newline: the error line was glued to its end."""
    result = subprocess.run(
        [sys.executable, "-m", "distributed_mpt.train", *FLAGS, "--model=builtins:input",
         f"--model_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
        cwd=REPO, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert_one_error_line(result, "--model=builtins:input failed to build its model (EOFError")
    assert "DatasetInfo(" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64's system call numbers")
@pytest.mark.parametrize("flags, line, held_in", [
    # The flags' refusal: held in its write of the error line to stderr (fd 2).
    (["--model=no_such_model"], "error: --model=no_such_model is not one of", "1 0x2 "),
    # The run's (training/run.py): its line goes through the log filter's
    # child process, which the main thread waits for, asleep (clock_nanosleep),
    # for at most 2 s (log_filter): the signal comes in that window.
    (["--dataset=synthetic", "--model=mlp", "--model_dir={file}"],
     "error: --model_dir={file} is a file, not a directory", "230 ")])
def test_a_stop_signal_after_the_error_line_leaves_its_exit_code(tmp_path, flags, line, held_in):
    """SIGTERM while the error line was being written made a refused run
    (exit 2, a mistake) exit 143, which says "retry", its line glued to
    the error line. stderr is a pipe kept full, so the command is held
    writing its error line when the signal comes (by the system call its
    main thread is in: x86_64's numbers)."""
    import fcntl
    import time

    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, b"." * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(write, True)
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    process = subprocess.Popen(
        [sys.executable, "-m", "distributed_mpt.train", f"--model_dir={tmp_path / 'run'}",
         *[flag.format(file=file) for flag in flags]],
        stdout=subprocess.DEVNULL, stderr=write, cwd=REPO, env=subprocess_env())
    os.close(write)
    try:
        deadline = time.monotonic() + 120
        # Its main thread held by the error line, the first thing it writes to stderr.
        while not open(f"/proc/{process.pid}/syscall").read().startswith(held_in):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        time.sleep(1)  # for a handler to act
        written = b""
        while chunk := os.read(read, 65536):
            written += chunk
        assert process.wait(timeout=60) == 2, written[-2000:]
    finally:
        process.kill()
        os.close(read)
    stderr = written.lstrip(b".").decode()
    assert stderr.startswith(line.format(file=file)) and stderr.count("\n") == 1, stderr


@pytest.mark.slow  # two workers
def test_a_chiefs_model_failing_in_the_export_ends_every_worker_with_2(tmp_path):
    """The chief's export, after training, raised the user's error: the
    chief exited 2 alone, and its peer, waiting for it at the end of the
    run, failed with `lost a peer` and exit 141, which a launcher or
    Kubernetes retries (the same mistake again). Both now exit 2."""
    from conftest import WatchedProcess
    from distributed_mpt.launch import free_ports, worker_tf_configs

    source, run = tmp_path / "once.py", tmp_path / "run"
    source.write_text(_FAILS_IN_THE_EXPORT)
    flags = [*FLAGS, f"--model={source}:net", "--communication=ring",
             "--peer_timeout_seconds=300", f"--model_dir={run}"]
    started = time.monotonic()
    workers = [WatchedProcess("distributed_mpt.train", flags, env=subprocess_env(
        TF_CONFIG=tf_config)) for tf_config in worker_tf_configs(free_ports(2))]
    # Generous: two TensorFlow start-ups on a loaded machine, then a few seconds.
    codes = [worker.finish(timeout=400) for worker in workers]
    output = "\n---\n".join(worker.output()[-3000:] for worker in workers)
    print(f"both workers ended {time.monotonic() - started:.1f} s after they started")
    assert codes == [2, 2], (codes, output)
    said = [[line for line in worker.output().splitlines() if line.startswith("error:")]
            for worker in workers]
    assert len(said[0]) == 1 and "failed in the export, after training" in said[0][0], output
    assert said[1] == ["error: the chief failed to finish the run after training (its own "
                       "error line says why): every worker stops with it"], output
    assert "lost a peer" not in output and "Traceback" not in output, output
    assert not (run / "export").exists() and not (run / "summary.json").exists()

