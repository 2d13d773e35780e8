"""Files written whole or not at all, with the umask, and only over a
regular file; files read without trusting them."""

import errno
import io
import json
import os
import stat
import tracemalloc

import pytest

from conftest import deadline, made_a_fifo_when_checked
from distributed_mpt import files, json_lines
from distributed_mpt.errors import ConfigError


def test_write_json_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "summary.json"
    files.write_json(str(path), {"a": 1})
    files.write_json(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_rename_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """As a metrics.jsonl bind-mounted onto itself does (EBUSY)."""
    def busy(source, target):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), source, None, target)

    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(OSError) as raised:
        files.write_text(str(tmp_path / "metrics.jsonl"), "{}\n")
    assert files.why_unwritable(raised.value) == os.strerror(errno.EBUSY)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_write_json_refuses_what_is_not_json_and_writes_nothing(tmp_path, value):
    path = tmp_path / "summary.json"
    path.write_text('{"a": 1}\n')
    with pytest.raises(ValueError):
        files.write_json(str(path), {"loss": value})
    assert path.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_check_writable(tmp_path):
    files.check_writable(str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        files.check_writable(str(tmp_path / "file" / "run"))
    with pytest.raises(ConfigError, match="--model_dir=.*file is a file, not a directory"):
        files.check_writable(str(tmp_path / "file"))
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(ConfigError, match="link is a symbolic link, not a directory"):
        files.check_writable(str(tmp_path / "link"))
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="dangling is a symbolic link to nothing, not a direct"):
        files.check_writable(str(tmp_path / "dangling"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="fifo is a FIFO, not a directory"):
        files.check_writable(str(tmp_path / "fifo"))


def test_kinds_of_paths_are_named(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    kinds = {name: files.kind_of(str(tmp_path / name))
             for name in ("file", "dir", "fifo", "link", "dangling", "loop", "missing")}
    assert kinds == {"file": "a file", "dir": "a directory", "fifo": "a FIFO",
                     "link": "a symbolic link", "dangling": "a symbolic link to nothing",
                     "loop": "a symbolic link in a loop", "missing": "missing"}
    assert files.kind_of("/dev/null") == "a device node"
    assert [files.is_regular_file(str(tmp_path / name)) for name in kinds] == \
        [True, False, False, True, False, False, False], "a symlink to a file is a file"


@pytest.mark.parametrize("kind", ["fifo", "device node", "directory", "symlink"])
def test_write_text_replaces_only_a_regular_file(tmp_path, kind):
    """As root, replacing /dev/null (or a FIFO a reader waits on) with a
    file would break every other program that uses it."""
    path = tmp_path / "metrics.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device node":
        if os.getuid() != 0:
            pytest.skip("only root may make a device node")
        null = os.stat("/dev/null")
        os.mknod(path, stat.S_IFCHR | 0o666, null.st_rdev)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("keep")
        path.symlink_to(tmp_path / "elsewhere")
    mode = os.lstat(path).st_mode
    with pytest.raises(ConfigError, match="not a regular file"):
        files.write_text(str(path), "text")
    assert os.lstat(path).st_mode == mode, "left as it was"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], \
        "no temporary file left"
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_text() == "keep"


@pytest.mark.parametrize("content, problem", [
    (b"\xff{}", "not UTF-8 text at byte 0"),
    (b"", "not JSON"),
    (b"[]", "a JSON list, not an object"),
    (b'{"steps": true}', "'steps' is a bool"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"steps": 1, "loss": NaN}', "not JSON: NaN is not a JSON value"),
])
def test_a_damaged_json_file_is_one_line_naming_it_and_the_remedy(tmp_path, content, problem):
    path = tmp_path / "summary.json"
    path.write_bytes(content)
    with pytest.raises(files.DamagedFileError) as raised:
        files.read_json(str(path), {"steps": int}, remedy="remove it")
    assert str(raised.value).startswith(f"{path} is damaged ({problem}")
    assert str(raised.value).endswith("; remove it") and "\n" not in str(raised.value)


def test_json_that_is_not_there_is_empty_and_a_fifo_is_refused_unread(tmp_path):
    assert files.read_json(str(tmp_path / "missing.json")) == {}
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(files.DamagedFileError, match="is a FIFO, not a regular file"):
        files.read_json(str(tmp_path / "fifo"))  # would block forever if opened
    with pytest.raises(files.DamagedFileError, match="is a FIFO, not a regular file"):
        json_lines.read_jsonl(str(tmp_path / "fifo"))


@pytest.mark.parametrize("read", [files.read_json, json_lines.read_jsonl],
                         ids=["json", "jsonl"])
def test_a_file_made_a_fifo_after_its_check_is_refused_not_waited_on(tmp_path, monkeypatch, read):
    path = tmp_path / "summary.json"
    path.write_text("{}\n")
    made_a_fifo_when_checked(monkeypatch, path)
    with deadline(30), pytest.raises(files.DamagedFileError, match="is a FIFO, not a regular file"):
        read(str(path))
    assert path.is_fifo()


def test_a_small_file_is_read_without_allocating_the_bound(tmp_path):
    # read(MAX_READ_BYTES + 1) allocates its 256 MB before it reads a byte.
    files.write_json(tmp_path / "config.json", {"seed": 0})
    tracemalloc.start()
    try:
        assert files.read_json(str(tmp_path / "config.json")) == {"seed": 0}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"reading a config.json allocated at most {peak:,} bytes")
    assert peak < 1 << 20


def test_a_file_whose_size_says_0_is_read_whole_within_the_bound():
    # As the files of /proc say.
    status = files.read_bounded("/proc/self/status", 1 << 20)
    assert status.startswith(b"Name:") and status.endswith(b"\n")
    with pytest.raises(files.FileTooLargeError):
        files.read_bounded("/proc/self/status", 100)


def test_a_file_with_nothing_to_read_yet_is_an_oserror(tmp_path, monkeypatch):
    """A regular file opened without blocking may have nothing to read yet
    (/proc/kmsg): read() then returns None, which was a TypeError, and a
    traceback where every caller expects an OSError."""
    class NothingYet(io.FileIO):
        def readinto(self, buffer):
            return None  # what a non-blocking read that would block returns

    path = tmp_path / "kmsg"
    path.write_text("")
    monkeypatch.setattr(files, "open", lambda descriptor, mode: io.BufferedReader(
        NothingYet(descriptor, "rb")), raising=False)
    with pytest.raises(OSError) as raised:
        files.read_bounded(str(path), 1 << 20)
    assert raised.value.errno == errno.EAGAIN


def test_written_files_follow_the_umask(tmp_path):
    files.write_json(str(tmp_path / "a.json"), {})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_write_test_removed_by_another_run_still_proves_the_directory_writable(tmp_path,
                                                                                monkeypatch):
    # A run holding the lock removes what looks like a killed run's write
    # test; a second run's own, taken in that moment, is then gone at once.
    # Patched at os.open, which every way of making the file goes through.
    create = os.open

    def created_then_removed(path, *args, **kwargs):
        descriptor = create(path, *args, **kwargs)
        if os.path.basename(path).startswith(files.WRITE_TEST_PREFIX):
            os.remove(path)
        return descriptor

    monkeypatch.setattr(os, "open", created_then_removed)
    files.check_writable(str(tmp_path / "run"))
    assert list((tmp_path / "run").iterdir()) == []


def test_a_measured_infinity_is_written_null_and_read_back_strictly(tmp_path):
    """A loss that overflowed was written `Infinity` into metrics.jsonl, and
    `1e400`, a JSON number, was read back as an infinity and carried on."""
    record = json_lines.finite_values({"step": 3, "loss": float("inf"),
                                       "eval_loss": float("nan"), "accuracy": 0.5})
    assert record == {"step": 3, "loss": None, "eval_loss": None, "accuracy": 0.5}
    files.write_json(tmp_path / "summary.json", record)
    assert files.read_json(tmp_path / "summary.json") == record
    _, problem = files.parse_record('{"step": 1, "elapsed_seconds": 1e400}', {})
    assert problem == "not JSON: 1e400 is too large a number"
