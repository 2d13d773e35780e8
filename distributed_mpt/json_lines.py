"""JSON-lines files (metrics.jsonl, the recipes' ledger), read one line at a
time and without trusting them: a run logs a line per step as long as it
runs, so a resume must read any length of log in bounded memory, and a
damaged line costs that line only; written whole lines at a time, or
nothing (add_lines). And what makes a record writable as JSON at all
(finite_values)."""

import contextlib
import errno
import itertools
import json
import math
import os
import shutil
import stat
from typing import Iterator, List, Optional, Tuple

from distributed_mpt import files
from distributed_mpt.errors import quoted

# Far above any line this program writes (a record of metrics.jsonl is ~200
# bytes): a longer one is not ours, and is refused before it is held whole
# (a file of zeros is one line, as long as the file).
MAX_LINE_BYTES = 1 << 20
_DAMAGE_SAID = 3  # damaged lines named one by one; the rest are counted
_REMEDY = "move it away, or choose another --model_dir"


class JsonLines:
    """The intact records of the JSON-lines file at `path`, each with its line
    (bytes, its newline included), read one line at a time, as often as it
    is iterated: the memory it takes is bounded by MAX_LINE_BYTES, whatever
    the file's length. A damaged line (a line cut short by a killed writer
    included) costs that line only; once the records are read, `problems`
    says what was wrong with them. No file: no records.

    `fields` as for files.read_json; `remedy`, the way out a refusal names.
    Reading raises files.DamagedFileError only if `path` is not a regular
    file or cannot be read, if a line of it is longer than MAX_LINE_BYTES,
    or if it is longer than `limit` bytes (if given)."""

    def __init__(self, path: str, fields: Optional[dict] = None, limit: Optional[int] = None,
                 remedy: str = _REMEDY):
        self.path, self.problems, self._remedy = path, [], remedy
        self._fields, self._limit = fields or {}, limit

    def __iter__(self) -> Iterator[Tuple[dict, bytes]]:
        self.problems, damaged, size = [], 0, 0
        if not os.path.lexists(self.path):
            return
        # Each line as bytes: an undecodable line costs that line only. Only
        # the first damage is said: 33 MB of damaged lines, split at once and
        # each said, took 2.3 GB and 94 s (2 cores of an AVX2 EPYC).
        with files.reading_ours(self.path, self._remedy), files.open_regular(self.path) as f:
            if self._limit is not None and os.fstat(f.fileno()).st_size > self._limit:
                raise files.FileTooLargeError(self._limit)  # now, not once read up to it
            for number in itertools.count(1):
                line = f.readline(MAX_LINE_BYTES + 1)
                size += len(line)
                if self._limit is not None and size > self._limit:
                    raise files.FileTooLargeError(self._limit)
                if len(line) > MAX_LINE_BYTES:
                    raise files.DamagedFileError(
                        f"{quoted(self.path)} is damaged (line {number} is longer than any this "
                        f"program writes, {MAX_LINE_BYTES:,} bytes); {self._remedy}")
                if not line.endswith(b"\n"):
                    if line:
                        self.problems.append("its last line was cut short")
                    break
                try:
                    record, problem = files.parse_record(line[:-1].decode("utf-8"), self._fields)
                except UnicodeDecodeError:
                    problem = "not UTF-8 text"
                if not problem:
                    yield record, line
                    continue
                damaged += 1
                if damaged <= _DAMAGE_SAID:
                    self.problems.append(f"line {number} is damaged ({problem})")
        if damaged > _DAMAGE_SAID:
            self.problems.append(f"{damaged - _DAMAGE_SAID:,} more damaged lines")


def read_jsonl(path: str, fields: Optional[dict] = None,
               remedy: str = _REMEDY) -> Tuple[List[dict], List[str]]:
    """The intact records of a JSON-lines file, and what is wrong with its
    damaged lines, as JsonLines reads them; held whole, so refused
    (files.DamagedFileError) if the file is larger than any this program
    reads whole (files.MAX_READ_BYTES)."""
    lines = JsonLines(path, fields, limit=files.MAX_READ_BYTES, remedy=remedy)
    return [record for record, _ in lines], lines.problems


def finite_values(record: dict) -> dict:
    """`record` with each NaN or infinite number made None (null): a measured
    loss may be infinite, and JSON has no such number (Python would write
    `Infinity`, which standard readers refuse)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def add_lines(fd: int, records: List[dict], path: str) -> None:
    """Adds `records`, a line each, to the JSON-lines file `path` open at `fd`
    for appending, in one write: whole or not at all. A write the disk cut
    short is taken back and raised as ENOSPC naming `path`: a line cut short
    is what a resume, or the next measurement, met instead."""
    data = "".join(json.dumps(record, allow_nan=False) + "\n" for record in records).encode()
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = os.write(fd, data)
    except OSError as e:  # nothing written; the error names the file
        raise OSError(e.errno, e.strerror, path) from None
    if written < len(data):
        os.ftruncate(fd, end)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def open_appending(path: str, remedy: str = _REMEDY) -> int:
    """A descriptor of the JSON-lines file at `path` (made if missing), open
    for appending; files.DamagedFileError, naming `remedy`, if it is not a
    regular file. Opened without blocking: a FIFO put in its place after the
    start's checks blocked the open, and the run hung instead of ending.

    A file with other names (a run copied by `cp -al`, a backup tool's
    hard-linked snapshot) is first replaced by a copy of its own: appended
    in place, the lines went into the original run's log too. A snapshot is
    legitimate, so the copy resumes rather than being refused, and the
    other names keep their file as it was."""
    with contextlib.suppress(FileNotFoundError):
        found = os.lstat(path)
        if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
            with files.replacing(path) as own, open(path, "rb") as shared:
                shutil.copyfileobj(shared, own)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: a FIFO that no one reads, or a socket
            raise
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
    with files.reading_ours(path, remedy):  # its words for what is not a regular file
        raise files.NotRegularFileError(files.kind_of(path))


def append_records(path: str, records: List[dict]) -> None:
    """Adds `records` to the JSON-lines file at `path` (made if missing), as
    add_lines does."""
    fd = open_appending(path)
    try:
        add_lines(fd, records, path)
    finally:
        os.close(fd)
