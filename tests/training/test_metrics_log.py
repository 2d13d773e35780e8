"""metrics.jsonl on a disk that fills up: whole lines only, and the error
names the file."""

import errno
import json
import os
import time

import pytest


def test_a_metrics_line_the_full_disk_cuts_short_is_taken_back_and_named(tmpfs):
    """A line that crossed into a page the full disk did not have was
    written in part: a resume warned of the torn line, and the run's error
    named --model_dir, not the file it could not write."""
    from distributed_mpt.json_lines import read_jsonl
    from distributed_mpt.training.loop import Reporter

    mount_point, _ = tmpfs
    metrics = mount_point / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    # An earlier run's records, up to a few bytes short of a page.
    record = {"step": 1, "elapsed_seconds": 1.0, "padding": ""}
    line = json.dumps(record) + "\n"
    text = line * 40
    padding = "-" * (4090 - len(text) - len(line))
    metrics.write_text(text + json.dumps({**record, "padding": padding}) + "\n")
    before = metrics.read_bytes()
    assert len(before) == 4090
    reporter = Reporter(str(metrics.parent), True, 100, 1, time.monotonic(), False)
    try:
        filler = os.open(mount_point / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):  # the disk fills up
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        with pytest.raises(OSError) as raised:
            reporter.log(2, {"loss": 0.5, "accuracy": 0.75})
    finally:
        reporter.close()
    assert metrics.read_bytes() == before
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(metrics)
    assert read_jsonl(str(metrics)) == ([json.loads(x) for x in before.splitlines()], [])
