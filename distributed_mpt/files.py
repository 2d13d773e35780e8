"""Files written whole or not at all, and read without trusting them.

A reader (a user, a dashboard, the next run) never sees half a file: each is
written under a temporary name in the same directory and renamed into place,
which is atomic on POSIX file systems. Only a regular file, or nothing, is
ever replaced: a device node, a FIFO or a socket at a path the package
writes is refused, never turned into a file (as root, `/dev/null` would
have been). Files are read as this program writes them, strictly: a FIFO,
a huge or undecodable file is one clear error naming the file, never a
hang or a traceback.
"""

import contextlib
import errno
import json
import math
import os
import secrets
import stat
import sys
import tempfile
from typing import Optional, Tuple

from distributed_mpt.errors import ConfigError, UserError, first_line, quoted, text_of

# Prefixes of the temporary names this module writes under, each followed
# by owner_tag(): what a killed run can leave behind (training/outputs.py
# clears it, and only what carries the tag of a run that held the lock).
TEMPORARY_PREFIX = ".tmp-"          # write_text, before its rename
WRITE_TEST_PREFIX = ".write-test-"  # check_writable

# Far above any file this program reads whole (a JSON-lines file, which
# grows as long as a run logs, is read a line at a time: json_lines.py): a
# bigger one is not ours, and is refused before it is read.
MAX_READ_BYTES = 1 << 28

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# A write that fails the same way until the file system changes: no space or
# quota, a read-only mount, no permission (a directory of another user), a
# busy file (one mounted on itself), a file too large for it.
_CANNOT_WRITE = (*_DISK_FULL, errno.EROFS, errno.EACCES, errno.EPERM, errno.EBUSY, errno.EFBIG)


_owner_tag = (0, "")


def owner_tag() -> str:
    """This process's mark on the temporary names it makes: its pid and a
    random part (`4242-9f3ab2c1`), which the lock file records while the
    process holds a --model_dir (process/run_lock.py). A name without the tag
    of a run that held the lock is the user's, whatever it looks like."""
    global _owner_tag
    if _owner_tag[0] != os.getpid():  # a forked child is another writer
        _owner_tag = (os.getpid(), f"{os.getpid()}-{secrets.token_hex(4)}")
    return _owner_tag[1]


class DamagedFileError(UserError):
    """A file is not what this program wrote there, or not a file at all."""


def warn(message: str) -> None:
    """One `warning:` line on stderr: something was repaired, the work goes on."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def kind_of(path: str) -> str:
    """What the existing `path` is, in words: for error lines."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        try:
            target = os.stat(path).st_mode
        except OSError as e:  # a loop, or a target this user may not reach, is no missing one
            return {errno.ELOOP: "a symbolic link in a loop", errno.EACCES: "a symbolic link "
                    "into a folder closed to this user"}.get(e.errno, "a symbolic link to nothing")
        # What it leads to, where that is what is wrong (a FIFO, a folder).
        return "a symbolic link" + ("" if stat.S_ISREG(target) else f" to {_kind_of_mode(target)}")
    return _kind_of_mode(mode)


def _kind_of_mode(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device node" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")


class NotRegularFileError(Exception):
    """read_bounded found no regular file at a path; `kind` says what it
    found, in words ("a FIFO", "a symbolic link to nothing", ...)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class FileTooLargeError(Exception):
    """read_bounded found a file of more bytes than it was allowed to read."""


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the regular file at `path` (a symbolic link to one
    included), at most `limit` of them. Raises NotRegularFileError for
    anything else (open_regular), FileTooLargeError for a larger file,
    OSError if it cannot be read.

    What is read is what the file holds: read(limit) would allocate `limit`
    bytes at once (256 MB for a config.json of 1 kB)."""
    with open_regular(path) as f:
        expected = os.fstat(f.fileno()).st_size
        if expected > limit:
            raise FileTooLargeError(limit)
        # All it holds, and a byte more to see that it ends there; the rest if it holds
        # more than its size says: it grew, or lives in /proc (whose sizes say 0).
        chunks = [_read_now(f, expected + 1)]
        size = len(chunks[0])
        while expected < size <= limit and chunks[-1]:
            chunks.append(_read_now(f, min(1 << 16, limit + 1 - size)))
            size += len(chunks[-1])
    if size > limit:
        raise FileTooLargeError(limit)
    return b"".join(chunks)


@contextlib.contextmanager
def open_regular(path: str):
    """The regular file at `path` (a symbolic link to one included), open for
    reading bytes. Raises NotRegularFileError for anything else, OSError if
    it cannot be opened.

    A FIFO would block the open, a device node never end: neither is opened,
    and what was opened (without blocking) is checked again, in case the
    path changed in between."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP) and os.path.islink(path):  # leads nowhere
            raise NotRegularFileError(kind_of(path)) from None
        raise
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(_kind_of_mode(mode))
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(descriptor, "rb") as f:
        opened = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(opened):
            raise NotRegularFileError(_kind_of_mode(opened))
        yield f


def _read_now(f, size: int) -> bytes:
    """f.read(size), which returns None where a file opened without blocking
    has nothing yet (a kernel file such as /proc/kmsg): an OSError here."""
    data = f.read(size)
    if data is None:
        raise BlockingIOError(errno.EAGAIN, "it has nothing to read until something is "
                                            "written to it")
    return data


def why_unreadable_file(path: str) -> Optional[str]:
    """None if `path` is a regular file this user may read; else, to follow its name, "is
    not a file" (missing, a folder, a FIFO) or "cannot be read (Permission denied)"."""
    try:
        with open_regular(path):
            return None
    except (NotRegularFileError, OSError) as e:  # in a folder it may not search: not missing
        missing = getattr(e, "errno", errno.ENOENT) == errno.ENOENT
        return "is not a file" if missing else f"cannot be read ({e.strerror})"


def is_regular_file(path: str) -> bool:
    """True if `path` is a regular file, or a symbolic link to one."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing, a dangling symlink, a loop
        return False


def check_replaceable(path: str, what: str = "") -> None:
    """Raises ConfigError unless `path` is absent or a regular file (not a
    symbolic link): what write_text may replace. `what` names the flag or
    file, for the error line."""
    if os.path.lexists(path) and (os.path.islink(path) or not is_regular_file(path)):
        raise ConfigError(f"{what or quoted(path)} is {kind_of(path)}, not a regular file: this "
                          f"program writes only files of its own; choose another path")


def check_writable(directory: str, flag: str = "--model_dir", create: bool = True) -> None:
    """Proves `directory` writable, creating it if missing, or raises ConfigError naming `flag`,
    the flag that chose it. Without `create` a missing one is left to be made when written
    (a refusal that follows leaves no folder behind): the folder above it is asked instead."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{flag}={quoted(directory)} is {kind_of(directory)}, not a directory: "
                          f"choose a directory (it is created if missing)")
    mask = umask()
    # Its files and folders would be closed to their owner, this program (root reads them).
    if mask & 0o700 and os.geteuid() != 0:
        raise ConfigError(f"the umask {mask:04o} denies this user the files it writes: set one "
                          f"that leaves the owner's rights, such as 022 (`umask 022`)")
    if not create and not os.path.lexists(directory):
        above = os.path.abspath(directory)
        while not os.path.lexists(above):
            above = os.path.dirname(above)
        why = why_no_access(above, os.W_OK | os.X_OK) if os.path.isdir(above) else \
            os.strerror(errno.ENOTDIR)
    else:
        try:
            os.makedirs(directory, exist_ok=True)
            descriptor, path = tempfile.mkstemp(dir=directory,
                                                prefix=f"{WRITE_TEST_PREFIX}{owner_tag()}-")
            os.close(descriptor)
            # Gone already is fine: a run holding the directory's lock may have
            # removed it as a killed run's debris; it was written, which is the test.
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            why = None
        except OSError as e:  # /proc answers a new name with "No such file or directory"
            why = e.strerror if e.errno in _CANNOT_WRITE else \
                f"cannot make {'a file in it' if os.path.isdir(directory) else 'it'}: {e.strerror}"
    if why:
        raise ConfigError(f"{flag}={quoted(directory)} is not writable ({why}); "
                          f"choose a directory you can write to")


def umask() -> int:
    """The process's umask, read where Linux shows it: os.umask reads it only by
    setting it, and a file another thread makes meanwhile would get mode 0666."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    os.umask(mask := os.umask(0))
    return mask


def why_no_access(path: str, mode: int) -> Optional[str]:
    """Why this process lacks the `mode` (os.R_OK, W_OK, X_OK, or'ed) of access to the existing
    `path`, in the C library's words, or None. Asked, not tried: no debris if killed."""
    if os.access(path, mode):
        return None
    try:  # a read-only mount, where all but writing is allowed
        read_only = os.access(path, mode & ~os.W_OK) and os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError as e:  # gone since it was looked at
        return e.strerror
    return os.strerror(errno.EROFS if read_only else errno.EACCES)


def is_disk_full(error: Exception) -> bool:
    """True if `error` is a write that found no space (or quota) left."""
    # TensorFlow reports a failed write as ResourceExhaustedError (as it does out-of-memory)
    # with the C library's message, and _CANNOT_WRITE names the full disk first.
    return why_unwritable(error) in map(os.strerror, _DISK_FULL)


def why_unwritable(error: Exception) -> Optional[str]:
    """The C library's reason if `error` is a write that fails the same way
    until the file system changes (_CANNOT_WRITE), else None; TensorFlow's
    errors carry it in their message."""
    if isinstance(error, OSError):
        return os.strerror(error.errno) if error.errno in _CANNOT_WRITE else None
    return next((os.strerror(code) for code in _CANNOT_WRITE
                 if os.strerror(code) in text_of(error)), None)


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` atomically (see `replacing`)."""
    with replacing(path) as f:
        f.write(text.encode("utf-8"))


@contextlib.contextmanager
def replacing(path: str):
    """A file to write `path`'s new bytes into, which replaces `path`
    atomically (temporary file, fsync, rename) when the block ends without
    an exception; else no temporary file is left. Refuses (ConfigError) to
    replace anything but a regular file."""
    check_replaceable(path)
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("wb", dir=directory, delete=False,
                                     prefix=f"{TEMPORARY_PREFIX}{owner_tag()}-") as f:
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            os.remove(f.name)
            raise
    # Temporary files are private (0600); the result is for everyone the
    # umask allows, like any file the user writes.
    try:
        os.chmod(f.name, 0o666 & ~umask())
        os.replace(f.name, path)
    except BaseException:  # a file mounted on itself (EBUSY), say: no temporary file left
        with contextlib.suppress(OSError):
            os.remove(f.name)
        raise


def write_json(path: str, data) -> None:
    """Writes `data` as pretty, standard JSON to `path` atomically (a NaN or
    an infinity is a bug upstream: ValueError, not a file other readers
    refuse)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_text(path: str, remedy: str) -> Optional[str]:
    """The text of the regular file at `path`, decoded strictly as UTF-8;
    None if there is nothing there. Anything else (a FIFO, a directory, a
    huge or undecodable file) raises DamagedFileError, which names the file
    and `remedy`, the way out."""
    if not os.path.lexists(path):
        return None
    with reading_ours(path, remedy):
        raw = read_bounded(path, MAX_READ_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"{quoted(path)} is damaged (not UTF-8 text at byte {e.start}); "
                               f"{remedy}") from None


def read_json(path: str, fields: Optional[dict] = None,
              remedy: str = "restore an intact copy, or move it away") -> dict:
    """The JSON object in `path`, as this program writes it; {} if there is
    no file. `fields` maps keys the object must have to their type (or a
    tuple of types). Raises DamagedFileError, naming the file, what is wrong
    and `remedy`, if it is anything else."""
    text = read_text(path, remedy)
    if text is None:
        return {}
    data, problem = parse_record(text, fields or {})
    if problem:
        raise DamagedFileError(f"{quoted(path)} is damaged ({problem}); {remedy}")
    return data


@contextlib.contextmanager
def reading_ours(path: str, remedy: str):
    """Where a file this program writes at `path` is read: a refusal of
    open_regular or read_bounded, or an OSError, raised in the block becomes
    DamagedFileError, naming the file, what is wrong and `remedy`."""
    try:
        yield
    except NotRegularFileError as e:
        raise DamagedFileError(f"{quoted(path)} is {e.kind}, not a regular file; {remedy}") from None
    except FileTooLargeError as e:
        raise DamagedFileError(f"{quoted(path)} is larger than any file this program writes "
                               f"({e.args[0]:,} bytes); {remedy}") from None
    except OSError as e:
        raise DamagedFileError(f"cannot read {quoted(path)} ({e.strerror}); {remedy}") from None


def parse_record(text: str, fields: dict) -> Tuple[Optional[dict], Optional[str]]:
    """The JSON object in `text` and None, or None and what is wrong."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as e:
        return None, f"not JSON: {first_line(e, 80)}"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    problem = missing_fields(data, fields)
    return (None, problem) if problem else (data, None)


def missing_fields(data: dict, fields: dict) -> Optional[str]:
    """What of `fields` (key: type) the object `data` lacks, or None."""
    for key, kind in fields.items():
        if key not in data:
            return f"no {key!r}"
        # JSON has no integers apart from numbers: true is not a step.
        if not isinstance(data[key], kind) or (isinstance(data[key], bool) and kind is not bool):
            return f"{key!r} is a {type(data[key]).__name__}"
    return None


def _refuse_constant(name: str):
    """NaN and Infinity are not JSON, and this program never writes them."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number, which `1e400` is, but not one Python can hold: it would
    become an infinity, carried into every record after it."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{quoted(text, 40)} is too large a number")
    return value
