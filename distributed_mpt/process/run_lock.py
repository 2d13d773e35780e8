"""One run per --model_dir, held for the life of the run.

The chief takes an exclusive `flock` on `<model_dir>/.lock` and holds it for
the life of the run. The operating system drops the lock when the process
ends, however it ends (exit, exception, SIGKILL, OOM killer), so a killed run
never blocks its successor and there is no stale lock to clear by hand. The
file itself stays; while the lock is held it names the holder (host, pid,
start time), so that a refused run can say who has the directory, and the
owner tag its temporary names carry (files.owner_tag): a killed holder's
record stays, and proves to its successor which leftovers are its. A file
there that holds anything else is the user's, and is refused, not emptied.

What the lock guarantees, and where:
- One machine (any local file system, or a pod's volume on one node's
  disk): a second run is refused at once.
- NFS: the Linux client turns `flock` into a whole-file byte-range lock that
  the server holds (NFSv4, or NFSv3 with lockd), so runs on different hosts
  exclude each other. Mounted with `nolock` or `local_lock=flock|all`, and
  on several FUSE file systems (gcsfuse, s3fs, some SMB mounts), the lock
  is local to one host: runs on two hosts both get it and are NOT excluded.
  Use one run per directory there.
- Kubernetes: a restarted container or a replacement pod is a new process;
  the old process's lock went with it, so the successor starts. A pod on a
  node that lost the network keeps its NFSv4 lock until the server's lease
  expires (90 s by default; under NFSv3 until that node restarts): the new
  chief is refused until then. After that the server hands the lock on even
  if the old process still runs: a lock is not a fence, and it cannot stop a
  cut-off process from writing.
"""

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
from typing import Optional

from distributed_mpt import files
from distributed_mpt.errors import ConfigError, ExitCode, UserError, quoted

LOCK_NAME = ".lock"
# Listings of a directory to remove before it is left as it is (see
# RunLock._remove_model_dir).
_REMOVAL_ROUNDS = 5
# A holder record is about 120 bytes; a longer file is not one.
_RECORD_BYTES = 4096


class ModelDirBusyError(UserError):
    """Another run holds --model_dir (retryable: it may end)."""

    exit_code = ExitCode.MODEL_DIR_BUSY


class ModelDirLostError(ConfigError):
    """--model_dir, or its lock file, was removed or moved under the run."""

    @classmethod
    def of_the_chief(cls) -> "ModelDirLostError":
        """The error of a worker whose chief lost its lock (check_still_held).
        Its --model_dir is not named: this worker's flag may name the shared
        directory otherwise (another mount point), or a directory of its own."""
        return cls(f"the chief lost its lock: its --model_dir or the {LOCK_NAME} file in it was "
                   f"removed or moved during this run (the chief's own line names the "
                   f"directory): every worker stops; put it back (or start afresh) and run the "
                   f"same command again")


class Writes:
    """The run's writes into --model_dir once the lock may be lost. A worker
    alone raises the loss where a write finds it. One of several keeps it
    (`lost`), writes nothing more, and goes on with its peers to where they
    all learn it (the stop agreement of the next step, the agreement at the
    run's end): had it left at once, its peers would fail in their next
    collective as if a node was lost (exit 141, which is retried). So is a
    user's mistake a write raises once training is over (`finishing`; a
    user's model failing in the export): kept as `failed`, to the run's end."""

    def __init__(self, check_held, alone: bool, request_stop=lambda model_dir_lost: None):
        """check_held(): raises ModelDirLostError if the lock is lost
        (RunLock.check_still_held); request_stop(model_dir_lost=True) (the
        Trainer's) puts a loss a write found into the next step's agreement."""
        self.check_held, self._alone, self._request_stop = check_held, alone, request_stop
        self.lost: Optional[ModelDirLostError] = None
        self.failed: Optional[UserError] = None
        self.finishing = False  # set once the last step is done

    def __call__(self, write, *args, **kwargs):
        """write(*args, **kwargs)'s result; None, not written, once the lock
        is lost or a write after training failed (of several workers)."""
        if self.lost is None and self.failed is None:
            try:
                return write(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a write that failed as the directory went is its loss
                try:
                    self.check_held()
                except ModelDirLostError as lost:
                    if self._alone:
                        raise
                    self.lost = lost
                    self._request_stop(model_dir_lost=True)
                    return None
                if self._alone or not self.finishing or not isinstance(e, UserError):
                    raise
                self.failed = e
        return None


class RunLock:
    """The exclusive right of one process to write into a model directory.

    Use as a context manager, or call `release()`; a process that dies
    releases it anyway.
    """

    def __init__(self, model_dir: str):
        """Takes the lock at once or raises ModelDirBusyError naming the
        holder (ConfigError if the file system cannot lock). `model_dir`
        must exist."""
        self.path = os.path.join(model_dir, LOCK_NAME)
        # O_NOFOLLOW: the lock file is never a symlink to somewhere else.
        # Python's descriptors are not inherited by child processes, so no
        # child can keep the lock alive after this process is gone.
        try:
            # O_NONBLOCK: opening a FIFO put there must not wait for a writer.
            # Its mode is the umask's: a team's run directory (umask 002) is the team's to resume.
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                               0o666)
        except OSError as e:
            remedy = ("make it writable for this user, or remove it if no run of --model_dir "
                      "is under way" if e.errno in (errno.EACCES, errno.EPERM)  # another user's
                      else "remove it if it is not a plain file")
            raise ConfigError(f"cannot open the lock file {quoted(self.path)} ({e.strerror}); "
                              f"{remedy}") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):  # a FIFO, a device: not a lock file
            os.close(self._fd)
            raise ConfigError(f"the lock file {quoted(self.path)} is not a regular file; move it "
                              f"away")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(self._fd)
            os.close(self._fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ModelDirBusyError(
                    f"--model_dir={model_dir} is in use by another run ({holder}); wait for "
                    f"it to end, stop it, or choose another --model_dir") from None
            raise ConfigError(
                f"cannot lock {self.path} ({e.strerror}): the file system of --model_dir "
                f"offers no locks; choose a --model_dir on a local disk or NFSv4") from None
        # What is there is ours to replace only if a run wrote it: empty (a
        # run released it), or the record of a holder that was killed, whose
        # owner tag proves which temporary files it left (training/outputs.py).
        found = _read_record(self._fd)
        if found is None:
            links = os.fstat(self._fd).st_nlink
            os.close(self._fd)
            if links > 1:  # a copy by `cp -al` or a backup tool's snapshot: empty, yet shared
                raise ConfigError(f"{quoted(self.path)} is a hard link ({links} names share the "
                                  f"file, as in a copy made by `cp -al` or a backup tool's "
                                  f"snapshot), and a run writes its lock there: remove this "
                                  f"name (the other names keep the file), and run again")
            raise ConfigError(f"{quoted(self.path)} holds something this program did not write "
                              f"there (a lock file is empty or names the run holding it): move "
                              f"it away, and run again")
        self.previous_tags = [found["tag"]] if isinstance(found.get("tag"), str) else []
        # Written only once the lock is ours, so the file always names the
        # current holder (or, for a moment, nobody).
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tag": files.owner_tag()}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(holder) + "\n").encode(), 0)

    def is_in_place(self) -> bool:
        """Whether `path` still names the file this process locked: `rm -rf`
        or `mv` of the directory, or `rm .lock`, leave the lock on a file no
        other run can find, and the next run would take the directory too."""
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        held = os.fstat(self._fd)
        return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)

    def check_still_held(self) -> None:
        """Raises ModelDirLostError if the directory was removed or moved, or its
        lock file removed, since it was locked (see is_in_place): a run that
        went on writing would recreate it, or share it with the next run."""
        if not self.is_in_place():
            raise ModelDirLostError(
                f"--model_dir={quoted(os.path.dirname(self.path))} or its {LOCK_NAME} file was "
                f"removed or moved during this run: stopping, as another run could take "
                f"the directory; put it back (or start afresh) and run the same command again")

    def release(self, remove_model_dir_if_unused: bool = False, own_files=()) -> None:
        """Gives the directory up (closing the file drops the lock). With
        `remove_model_dir_if_unused`, for a directory this run created, the
        directory goes too if it holds nothing but the lock file and
        `own_files` (names of files or directories) and this process's
        temporary files (a write the stop cut short: their names carry its
        owner tag): removed while the lock is still held, so no other run
        can have taken it."""
        if self._fd is None:
            return
        # A directory no longer ours (removed, moved, another run's) stays as
        # it is: moved back, its lock file's owner tag shows a run which of the
        # temporary files this run left are debris.
        if self.is_in_place() and not (remove_model_dir_if_unused and
                                       self._remove_model_dir(own_files)):
            # Emptied while still held: the file names a holder only while
            # there is one, and a finished run run again leaves it as it was.
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None

    def _remove_model_dir(self, own_files) -> bool:
        """Removes the directory if it holds nothing but the lock file,
        `own_files` and this process's temporary files; returns whether it
        is gone. A stop's undo runs beside the main thread, which may still
        be writing one of them (a temporary file renamed to the marker
        between the listing and its removal): what vanished or appeared
        meanwhile is looked at again, a few times."""
        model_dir = os.path.dirname(self.path)
        ours = tuple(prefix + files.owner_tag() + "-" for prefix in (files.TEMPORARY_PREFIX,
                                                                      files.WRITE_TEST_PREFIX))
        for round_ in range(_REMOVAL_ROUNDS):
            try:
                left = set(os.listdir(model_dir))
            except FileNotFoundError:
                return True
            writing = {name for name in left if name.startswith(ours)}
            if not left - writing <= {LOCK_NAME, *own_files} or (round_ and LOCK_NAME in left):
                return False  # something else is there (another run's lock): leave the directory
            try:
                for name in sorted(left - {LOCK_NAME}) + [LOCK_NAME]:  # the lock file last
                    path = os.path.join(model_dir, name)
                    try:
                        if os.path.isdir(path) and not os.path.islink(path):
                            shutil.rmtree(path)
                        else:
                            os.remove(path)
                    except FileNotFoundError:
                        pass  # renamed or removed meanwhile: the next listing shows where
                os.rmdir(model_dir)
                return True
            except OSError:
                continue  # a file appeared meanwhile: list again
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.release()


class ReadOnly:
    """In place of the lock on a --model_dir on a read-only mount that holds
    a finished run: no process writes there through it, so there is nothing
    to exclude. Run again, the run only looks, and says it is finished as on
    a writable mount; anything else stops at its first write, where
    `check_still_held` raises `refusal` (why the directory is not writable)."""

    def __init__(self, refusal: ConfigError):
        self.refusal = refusal

    def check_still_held(self) -> None:
        """Raises the refusal: this run may write nothing."""
        raise self.refusal

    def is_in_place(self) -> bool:
        """Nothing was taken away: a failure is not to be put down to that."""
        return True

    def release(self, **unused) -> None:
        """Nothing is held."""


def finished_read_only(model_dir: str, finished: str) -> Optional[ReadOnly]:
    """A ReadOnly for `model_dir` if it is on a read-only mount and holds the
    file `finished` (the record a finished run leaves), else None."""
    path = os.path.join(model_dir, finished)
    if not (os.path.isfile(path) and os.statvfs(model_dir).f_flag & os.ST_RDONLY):
        return None
    try:
        files.check_writable(model_dir)
    except ConfigError as refusal:
        return ReadOnly(refusal)
    return None


def _read_record(fd: int):
    """The holder record in the lock file: {} if it is empty, None if it
    holds anything else (a user's file, a hard link to one)."""
    if os.fstat(fd).st_nlink > 1:  # emptying it would empty another name's file
        return None
    text = os.pread(fd, _RECORD_BYTES + 1, 0)
    if not text:
        return {}
    try:
        record = json.loads(text.decode())
    except ValueError:  # UnicodeDecodeError too
        return None
    if len(text) > _RECORD_BYTES or not isinstance(record, dict) or \
            not {"host", "pid", "since"} <= set(record):
        return None
    return record


def _read_holder(fd: int) -> str:
    """'pid P on host H since T' from the lock file, as far as it says."""
    try:
        holder = json.loads(os.pread(fd, _RECORD_BYTES, 0).decode())
        return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"
