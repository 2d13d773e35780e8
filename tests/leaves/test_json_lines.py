"""JSON-lines files read a line at a time: a damaged line costs that line
only, a log of any length is read in bounded memory, and what no writer of
this program makes (a line longer than any record, a file of zeros) is one
error naming the file."""

import os
import tracemalloc

import pytest

from conftest import deadline
from distributed_mpt import files
from distributed_mpt.json_lines import MAX_LINE_BYTES, JsonLines, append_records, read_jsonl


@pytest.mark.parametrize("tail, damage, after", [
    (b'{"ste', "its last line was cut short", []),
    (b'\xff\xfe\n{"step": 4}\n', "line 3 is damaged (not UTF-8 text)", [{"step": 4}]),
    (b"[3]\n", "line 3 is damaged (a JSON list, not an object)", []),
    (b'{"step": "3"}\n', "line 3 is damaged ('step' is a str)", []),
    (b'{"loss": 1}\n', "line 3 is damaged (no 'step')", []),
    (b"\n", "line 3 is damaged (not JSON", []),
    (b'{"step": NaN}\n', "line 3 is damaged (not JSON: NaN is not a JSON value", []),
])
def test_a_damaged_metrics_line_is_named(tmp_path, tail, damage, after):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + tail)
    records, problems = read_jsonl(str(path), {"step": int})
    assert records == [{"step": 1}, {"step": 2}, *after]
    assert len(problems) == 1 and problems[0].startswith(damage), problems


def test_a_damaged_metrics_line_costs_that_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"ste\n{"step": 3}\n\xff\xfe\n{"step": 5}\n{"step": 6')
    records, problems = read_jsonl(str(path), {"step": int})
    assert records == [{"step": 1}, {"step": 3}, {"step": 5}], "the records after it are kept"
    assert [p.split(" (")[0] for p in problems] == [
        "line 2 is damaged", "line 4 is damaged", "its last line was cut short"]
    assert read_jsonl(str(tmp_path / "missing.jsonl")) == ([], [])


def test_many_damaged_lines_are_counted_not_each_said(tmp_path):
    """Each damaged line was kept as a sentence: 33 MB of them took 2.3 GB
    and 94 s to resume; three are said, and how many more."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"{}\n" * 100_000 + b'{"step": 1}\n')
    tracemalloc.start()
    try:
        records, problems = read_jsonl(str(path), {"step": int})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"100,000 damaged lines read with at most {peak:,} bytes allocated")
    assert records == [{"step": 1}]
    assert problems == [f"line {n} is damaged (no 'step')" for n in (1, 2, 3)] + [
        "99,997 more damaged lines"]
    assert peak < 20 * path.stat().st_size, "not a sentence, nor an object, per line"


def _log(steps: int) -> bytes:
    """What a run logging every step writes (~170 bytes a record)."""
    return b"".join(b'{"step": %d, "epoch": 0.03125, "loss": 2.3025850929940455, "accuracy": '
                    b'0.09375, "learning_rate": 0.008181, "examples_per_second": 764.2, '
                    b'"elapsed_seconds": %d.125}\n' % (step, step) for step in range(1, steps + 1))


def test_a_log_of_any_length_is_read_in_bounded_memory(tmp_path):
    """metrics.jsonl was read whole, and refused past 256 MB: a run logging
    every step could not resume after about 1.3 M steps."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_log(60_000))  # 10 MB
    log = JsonLines(str(path), {"step": int})
    tracemalloc.start()
    try:
        last = steps = 0
        for record, line in log:
            steps, last = steps + 1, record["step"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"a log of {path.stat().st_size:,} bytes read with at most {peak:,} bytes allocated")
    assert (steps, last, log.problems) == (60_000, 60_000, [])
    assert peak < 1 << 20, "a line at a time, not the file"


def test_a_line_longer_than_any_record_is_refused_before_it_is_held(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_log(2) + b"[" * (MAX_LINE_BYTES + 1) + b"\n")
    with pytest.raises(files.DamagedFileError) as raised:
        list(JsonLines(str(path)))
    assert str(raised.value) == (
        f"{path} is damaged (line 3 is longer than any this program writes, "
        f"{MAX_LINE_BYTES:,} bytes); move it away, or choose another --model_dir")


def test_a_sparse_file_of_zeros_is_refused_without_reading_it(tmp_path):
    """64 GiB of zeros on no disk at all: one line, as long as the file."""
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        f.truncate(1 << 36)
    with deadline(60), pytest.raises(files.DamagedFileError, match="line 1 is longer than any"):
        list(JsonLines(str(path)))


def test_a_file_read_whole_is_still_bounded(tmp_path, monkeypatch):
    """read_jsonl holds every record (the recipes' ledger): past
    MAX_READ_BYTES it is refused, as before."""
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(_log(100))
    monkeypatch.setattr(files, "MAX_READ_BYTES", os.path.getsize(path) - 1)
    with pytest.raises(files.DamagedFileError, match="is larger than any file this program "):
        read_jsonl(str(path))
    assert len(list(JsonLines(str(path)))) == 100, "read a line at a time, it has no bound"


@pytest.mark.parametrize("reader", [False, True], ids=["no reader", "a reader"])
def test_a_fifo_put_in_place_of_a_log_is_refused_not_waited_on(tmp_path, reader):
    """metrics.jsonl replaced by a FIFO after the start's checks: the open
    to append a record waited for a reader, and the run hung (with one, the
    record went down the pipe). Now one error names it."""
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    held = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    try:
        with deadline(30), pytest.raises(files.DamagedFileError) as raised:
            append_records(str(path), [{"step": 1}])
    finally:
        if held is not None:
            os.close(held)
    assert str(raised.value) == (f"{path} is a FIFO, not a regular file; move it away, or "
                                 f"choose another --model_dir")


def test_a_hard_linked_log_is_appended_to_under_its_own_name_only(tmp_path):
    """A log shared by hard links (a run copied by `cp -al`; the recipes'
    ledger in a snapshot) took each line under every name."""
    shared, other = tmp_path / "metrics.jsonl", tmp_path / "snapshot.jsonl"
    shared.write_bytes(b'{"step": 1}\n')
    os.link(shared, other)
    append_records(str(shared), [{"step": 2}])
    assert other.read_bytes() == b'{"step": 1}\n' and os.stat(other).st_nlink == 1
    assert shared.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
