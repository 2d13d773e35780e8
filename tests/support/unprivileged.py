"""The entry points run by a user without root's rights: as `nobody`, through
setpriv (util-linux), from a test that runs as root (as CI does). Root reads
and writes every file whatever its mode, so what a user meets in another
user's directory, or a folder closed to them, shows only this way.

`unavailable()` says why a test cannot run here, for it to skip with."""

import functools
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

from conftest import REPO, subprocess_env

NOBODY_UID = 65534  # nobody's, and nogroup's or nobody's group (RHEL names it so)
NOBODY = [f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups"]


def _env() -> dict:
    # This copy of the package first, then the libraries of the test's own
    # environment: a system interpreter of the same version takes them.
    return subprocess_env(PYTHONPATH=os.pathsep.join([str(REPO), *site.getsitepackages()]))


@functools.lru_cache(maxsize=None)
def _python() -> Tuple[str, str]:
    """An interpreter of this Python version that nobody may run and that
    imports the package and its libraries, and ""; or "" and why there is
    none. A pyenv's or a virtual environment's may lie in root's home,
    closed to others."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    why = ""
    for python in dict.fromkeys([sys.executable, shutil.which(version) or "",
                                 f"/usr/bin/{version}", f"/usr/local/bin/{version}"]):
        # Its helper processes run sys.executable again: as nobody, too.
        probe = ["setpriv", *NOBODY, python, "-c", "import distributed_mpt, numpy, subprocess, "
                 "sys; subprocess.run([sys.executable, '-c', ''], check=True)"]
        if not python:
            continue
        try:
            result = subprocess.run(probe, capture_output=True, text=True, timeout=300,
                                    env=_env())
        except subprocess.TimeoutExpired:
            why = f"{python} did not start within 300 s as nobody"
            continue
        if result.returncode == 0:
            return python, ""
        lines = result.stderr.strip().splitlines()
        why = f"{python} as nobody: {lines[-1] if lines else f'exit {result.returncode}'}"
    return "", why


def unavailable() -> str:
    """Why these tests cannot run here; "" if they can."""
    if os.geteuid() != 0:
        return "needs root, to run a command as the user nobody"
    if not shutil.which("setpriv"):
        return "needs setpriv (util-linux), to run a command as the user nobody"
    python, why = _python()
    if not python:
        return (f"the user nobody may run no Python {sys.version_info.major}."
                f"{sys.version_info.minor} that imports this package (from {REPO}) and NumPy; "
                f"the last tried: {why}")
    return ""


def scratch() -> Path:
    """A new folder nobody may reach and owns (pytest's tmp_path lies in
    root's own folder, mode 700); the caller removes it."""
    folder = Path(tempfile.mkdtemp(prefix="distributed-mpt-nobody-"))
    folder.chmod(0o755)
    os.chown(folder, NOBODY_UID, NOBODY_UID)
    return folder


def chown_tree(path: Path, uid: int) -> None:
    """Gives `path` and everything under it to `uid` (and its group)."""
    for entry in [path, *path.rglob("*")]:
        os.chown(entry, uid, uid, follow_symlinks=False)


def run_as_nobody(module: str, args, home: Path, umask=None, network: bool = True,
                  group: int = 0, cwd=None) -> subprocess.CompletedProcess:
    """`python -m module args` as the user nobody, with `home` as HOME (and
    working directory, unless `cwd`), a member of `group` too if given;
    without `network`, in a network namespace of its own, which has none."""
    env = {**_env(), "HOME": str(home)}
    offline = [] if network else ["unshare", "--net"]
    user = [*NOBODY[:2], f"--groups={group}"] if group else NOBODY
    return subprocess.run([*offline, "setpriv", *user, _python()[0], "-m", module,
                           *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd or home,
                          umask=-1 if umask is None else umask)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
