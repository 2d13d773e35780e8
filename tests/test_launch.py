"""The shell recipes in launch/: syntax, lint, and what they actually run.

No TensorFlow and no package install needed: the trainer, ssh and srun are
replaced by small fakes on PATH that record what they were given, so these
tests check the commands and TF_CONFIGs the scripts build, the pass-through
of extra flags, and multi_node.sh's process handling (output prefixes, exit
status, stopping the other workers when one fails or on Ctrl-C).
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time

import pytest

LAUNCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "launch"
SCRIPTS = ["single_gpu.sh", "single_node.sh", "multi_node.sh", "slurm.sbatch"]
MULTI_NODE = LAUNCH_DIR / "multi_node.sh"
HOSTS = ["node-a", "node-b.cluster.example", "10.0.0.7"]

# Worker index from TF_CONFIG, then either fail, sleep or report what it got.
FAKE_TRAINER = r"""#!/usr/bin/env bash
[[ ${TF_CONFIG:-} =~ \"index\":([0-9]+) ]] && index=${BASH_REMATCH[1]} || index=none
[[ -n ${FAKE_PID_DIR:-} ]] && echo $$ > "$FAKE_PID_DIR/worker$index"
echo "pwd=$PWD"
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"
echo "TF_CONFIG=${TF_CONFIG-unset}"
echo "DMPT_PORT=${DMPT_PORT-unset}"
echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED-unset}"
printf 'arg=%s\n' "$@"
echo "to stderr" >&2
if [[ $index == "${FAKE_FAIL_INDEX:-x}" ]]; then exit 3; fi
if [[ -n ${FAKE_SLEEP:-} ]]; then sleep "$FAKE_SLEEP"; fi
exit "${FAKE_EXIT:-0}"
"""

# Like ssh without a terminal: runs the command with sh in a session of its
# own, as sshd does, and does not stop it when the ssh process is killed.
FAKE_SSH = r"""#!/usr/bin/env bash
while [[ $1 == -* ]]; do
  if [[ $1 == -o ]]; then shift; fi
  shift
done
host=$1; shift
echo "$host $*" >> "$FAKE_SSH_LOG"
setsid -w sh -c "$*"
"""

FAKE_SRUN = r"""#!/usr/bin/env bash
for ((i = 1; i <= $#; i++)); do
  [[ ${!i} == distributed-mpt-train ]] && break
  printf 'srun-arg=%s\n' "${!i}"
done
shift $((i - 1))
exec "$@"
"""


def _write_executable(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def fakes(tmp_path):
    """A bin dir with fake trainer/ssh/srun, a recipe file and a base env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write_executable(bin_dir / "distributed-mpt-train", FAKE_TRAINER)
    _write_executable(bin_dir / "ssh", FAKE_SSH)
    _write_executable(bin_dir / "srun", FAKE_SRUN)
    recipe = tmp_path / "recipe.flags"
    recipe.write_text("--model=mlp\n")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DRY_RUN", "TF_CONFIG"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RECIPE=str(recipe), HOME=str(tmp_path / "home"),
               FAKE_SSH_LOG=str(tmp_path / "ssh.log"), FAKE_PID_DIR=str(pid_dir), SSH_OPTS="-o BatchMode=yes")
    yield {"dir": tmp_path, "env": env, "recipe": recipe, "pids": pid_dir}
    for pid_file in pid_dir.iterdir():  # never leave a sleeping fake behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _host_file(directory: pathlib.Path, lines) -> pathlib.Path:
    path = directory / "hosts.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def _run(args, env, cwd, timeout=20):
    return subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- static checks ----------------------------------------------------------


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_executable_bash_that_parses(name):
    path = LAUNCH_DIR / name
    assert os.access(path, os.X_OK), f"{name} is not executable"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in path.read_text()
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_header_states_needs_and_an_example(name):
    header = (LAUNCH_DIR / name).read_text().split("set -euo pipefail")[0]
    for word in ("Needs:", "hardware", "software", "storage", "Example"):
        assert word in header, f"{name}'s header does not say {word!r}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_shellcheck_clean(name):
    # -x follows the sourced launch/common.sh (run from the repo root).
    result = subprocess.run(["shellcheck", "-x", str(LAUNCH_DIR / name)], capture_output=True,
                            text=True, cwd=LAUNCH_DIR.parent)
    assert result.returncode == 0, result.stdout + result.stderr


# --- single_gpu.sh, single_node.sh, slurm.sbatch ---------------------------


def _trainer_args(stdout: str):
    return [line[len("arg="):] for line in stdout.splitlines() if line.startswith("arg=")]


def test_single_gpu_runs_one_device_on_the_chosen_gpu(fakes):
    result = _run([LAUNCH_DIR / "single_gpu.sh", "--epochs=2", "--seed=7"],
                  {**fakes["env"], "GPU": "1"}, fakes["dir"])
    assert result.returncode == 0, result.stderr
    assert "CUDA_VISIBLE_DEVICES=1" in result.stdout
    assert _trainer_args(result.stdout) == [
        "--strategy=one_device", f"--flagfile={fakes['recipe']}",
        f"--data_dir={fakes['dir']}/home/tensorflow_datasets", "--model_dir=runs/cifar10-recipe",
        "--epochs=2", "--seed=7"]


def test_single_node_runs_mirrored_and_passes_flags_through(fakes):
    result = _run([LAUNCH_DIR / "single_node.sh", "--per_replica_batch_size=64"],
                  {**fakes["env"], "GPUS": "0,1", "MODEL_DIR": "/tmp/m", "DATA_DIR": "/d"}, fakes["dir"])
    assert result.returncode == 0, result.stderr
    assert "CUDA_VISIBLE_DEVICES=0,1" in result.stdout
    assert _trainer_args(result.stdout) == [
        "--strategy=mirrored", f"--flagfile={fakes['recipe']}", "--data_dir=/d",
        "--model_dir=/tmp/m", "--per_replica_batch_size=64"]


@pytest.mark.parametrize("recipe, message", [
    ("missing/recipe.flags", "no such file"),
    ("resnet9", "cannot import distributed_mpt"),
])
def test_bad_recipe_fails_with_one_clear_line(fakes, recipe, message):
    env = {**fakes["env"], "RECIPE": recipe, "PYTHON": "false"}
    result = _run([LAUNCH_DIR / "single_gpu.sh"], env, fakes["dir"])
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "arg=" not in result.stdout


def test_slurm_batch_script_runs_srun_without_tf_config(fakes):
    env = {**fakes["env"], "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "8",
           "TF_CONFIG": '{"cluster": {}}', "DMPT_PORT": "3456"}
    result = _run(["bash", LAUNCH_DIR / "slurm.sbatch", "--epochs=1"], env, fakes["dir"])
    assert result.returncode == 0, result.stderr
    srun_args = [l[len("srun-arg="):] for l in result.stdout.splitlines() if l.startswith("srun-arg=")]
    assert srun_args == ["--ntasks-per-node=1", "--label", "--kill-on-bad-exit=1",
                         "--cpus-per-task=8"]
    assert "TF_CONFIG=unset" in result.stdout and "DMPT_PORT=3456" in result.stdout
    assert _trainer_args(result.stdout) == [
        "--strategy=multi_worker", f"--flagfile={fakes['recipe']}",
        f"--data_dir={fakes['dir']}/home/tensorflow_datasets",
        f"--model_dir={fakes['dir']}/runs/cifar10-recipe", "--nodownload", "--epochs=1"]


def test_slurm_batch_script_refuses_to_run_outside_a_job(fakes):
    result = _run(["bash", LAUNCH_DIR / "slurm.sbatch"], fakes["env"], fakes["dir"])
    assert result.returncode != 0 and "not inside a SLURM job" in result.stderr


# --- multi_node.sh ----------------------------------------------------------


def _shell_words(command: str) -> list:
    """Words and operators (`;`, `&&`, `{`) of a shell command line."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _tf_config_of(remote_command: str) -> dict:
    (assignment,) = [w for w in _shell_words(remote_command) if w.startswith("TF_CONFIG=")]
    return json.loads(assignment[len("TF_CONFIG="):])


def test_multi_node_dry_run_prints_one_ssh_command_per_host(fakes):
    hosts = _host_file(fakes["dir"], ["# cluster", HOSTS[0], "", f"  {HOSTS[1]}  # second", HOSTS[2]])
    env = {**fakes["env"], "DRY_RUN": "1", "PORT": "4567"}
    extra = ["--epochs=3", "--learning_rate=0.2", "--model_dir=/shared/run with space"]
    result = _run([MULTI_NODE, hosts, *extra], env, fakes["dir"])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 3 and all(line.startswith("ssh ") for line in lines), result.stdout
    for index, (line, host) in enumerate(zip(lines, HOSTS)):
        words = shlex.split(line)
        assert words[-2] == host
        remote_words = _shell_words(words[-1])
        assert _tf_config_of(words[-1]) == {
            "cluster": {"worker": [f"{h}:4567" for h in HOSTS]},
            "task": {"type": "worker", "index": index}}
        start = remote_words.index("distributed-mpt-train")
        trainer = remote_words[start:remote_words.index(";", start)]
        assert trainer[1] == "--strategy=multi_worker"
        assert trainer[-len(extra):] == extra
    assert not (fakes["dir"] / "ssh.log").exists(), "DRY_RUN must not run ssh"


@pytest.mark.parametrize("lines", [[], ["", "   ", "# only a comment"]])
def test_multi_node_rejects_an_empty_host_list(fakes, lines):
    result = _run([MULTI_NODE, _host_file(fakes["dir"], lines)], {**fakes["env"], "DRY_RUN": "1"}, fakes["dir"])
    assert result.returncode != 0
    assert "lists no hosts" in result.stderr
    assert result.stdout == ""


def test_multi_node_rejects_a_missing_host_file(fakes):
    result = _run([MULTI_NODE, fakes["dir"] / "nope.txt"], {**fakes["env"], "DRY_RUN": "1"}, fakes["dir"])
    assert result.returncode != 0
    assert "not found" in result.stderr and "nope.txt" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    ([], "usage:"),
    (["--epochs=3"], "must be the host file"),
])
def test_multi_node_needs_a_host_file_first(fakes, args, message):
    result = _run([MULTI_NODE, *args], {**fakes["env"], "DRY_RUN": "1"}, fakes["dir"])
    assert result.returncode != 0 and message in result.stderr


def test_multi_node_rejects_what_is_not_a_hostname(fakes):
    hosts = _host_file(fakes["dir"], ["a", "me@b"])
    result = _run([MULTI_NODE, hosts], {**fakes["env"], "DRY_RUN": "1"}, fakes["dir"])
    assert result.returncode != 0 and "hosts.txt:2: 'me@b' is not a hostname" in result.stderr


def test_multi_node_rejects_a_host_listed_twice(fakes):
    hosts = _host_file(fakes["dir"], ["a", "b", "a"])
    result = _run([MULTI_NODE, hosts], {**fakes["env"], "DRY_RUN": "1"}, fakes["dir"])
    assert result.returncode != 0 and "already listed on line 1" in result.stderr


needs_setsid = pytest.mark.skipif(shutil.which("setsid") is None, reason="the fake ssh needs setsid")


@needs_setsid
def test_multi_node_runs_every_worker_and_prefixes_its_output(fakes):
    hosts = _host_file(fakes["dir"], HOSTS)
    env = {**fakes["env"], "REMOTE_ENV": "CUDA_VISIBLE_DEVICES=0,1"}
    result = _run([MULTI_NODE, hosts, "--epochs=1", "--seed=it's 3"], env, fakes["dir"])
    assert result.returncode == 0, result.stderr
    for index in range(3):
        own = [l[len(f"[worker {index}] "):] for l in result.stdout.splitlines()
               if l.startswith(f"[worker {index}] ")]
        assert "to stderr" in own
        assert f"pwd={fakes['dir']}" in own
        assert "CUDA_VISIBLE_DEVICES=0,1" in own and "PYTHONUNBUFFERED=1" in own
        (tf_config,) = [l[len("TF_CONFIG="):] for l in own if l.startswith("TF_CONFIG=")]
        assert json.loads(tf_config)["task"] == {"type": "worker", "index": index}
        assert _trainer_args("\n".join(own))[-2:] == ["--epochs=1", "--seed=it's 3"]
    assert all(re.match(r"\[worker \d\] ", line) for line in result.stdout.splitlines())


@needs_setsid
def test_multi_node_exits_with_worker_0s_status(fakes):
    hosts = _host_file(fakes["dir"], HOSTS)
    result = _run([MULTI_NODE, hosts], {**fakes["env"], "FAKE_FAIL_INDEX": "0"}, fakes["dir"])
    assert result.returncode == 3
    assert "worker 0 (node-a) exited with status 3" in result.stderr


@needs_setsid
def test_multi_node_stops_the_others_when_one_worker_fails(fakes):
    hosts = _host_file(fakes["dir"], HOSTS)
    env = {**fakes["env"], "FAKE_FAIL_INDEX": "1", "FAKE_SLEEP": "30"}
    start = time.monotonic()
    result = _run([MULTI_NODE, hosts], env, fakes["dir"], timeout=15)
    assert time.monotonic() - start < 10
    assert result.returncode != 0
    assert "worker 1 (node-b.cluster.example) exited with status 3" in result.stderr
    for index in (0, 2):
        assert not _alive(int((fakes["pids"] / f"worker{index}").read_text()))


@needs_setsid
def test_multi_node_ctrl_c_stops_the_remote_workers(fakes):
    hosts = _host_file(fakes["dir"], HOSTS)
    env = {**fakes["env"], "FAKE_SLEEP": "30"}
    launcher = subprocess.Popen([str(MULTI_NODE), str(hosts)], env=env, cwd=fakes["dir"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while len(list(fakes["pids"].iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int((fakes["pids"] / f"worker{i}").read_text()) for i in range(3)]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=10)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert "interrupted: stopping all workers" in stderr
    assert not any(_alive(pid) for pid in pids)
    assert "kill -TERM" in (fakes["dir"] / "ssh.log").read_text()
