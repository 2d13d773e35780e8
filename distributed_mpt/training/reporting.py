"""Progress as a person, a dashboard and a script see it: one line per
interval on stdout, TensorBoard scalars, `metrics.jsonl`, and on Kubeflow
Trainer the TrainJob's status. Only the chief reports; the other workers
stay quiet.

A line comes at least every PROGRESS_SECONDS whatever the run is doing: a
thread watches the clock and, when the main thread is held longer (tracing
the first step, a step slower than that, an evaluation, a checkpoint), says
what is under way and for how long.
"""

import contextlib
import json
import os
import sys
import threading
import time
from typing import Optional

import tensorflow as tf

from distributed_mpt import files
from distributed_mpt.config import PROGRESS_SECONDS
from distributed_mpt.cluster.trainjob_progress import TrainJobStatus

# What every record of metrics.jsonl holds; a line without them is damaged.
_RECORD_FIELDS = {"step": int, "elapsed_seconds": (int, float)}
# What the TrainJob's status shows of a record, as the console does.
_STATUS_METRICS = ("loss", "accuracy", "eval_loss", "eval_accuracy", "learning_rate")


class Reporter:
    """Writes one record per logged step to every sink (chief only)."""

    def __init__(self, model_dir: str, enabled: bool, total_steps: int, resumed_from_step: int,
                 started: float, evaluates_at_end: bool):
        """started: the run's start on the `time.monotonic()` clock; every
        record carries the seconds since, plus those of the earlier runs it
        resumes (as metrics.jsonl has them), for time-to-accuracy curves.
        evaluates_at_end: whether the run logs a final evaluation."""
        self._enabled = enabled
        self._total_steps = total_steps
        # On a terminal, a status line is rewritten after every loop call;
        # logs (Kubernetes, SLURM, a file) get whole lines only.
        self._terminal = enabled and sys.stdout.isatty()
        self._live_line_shown = False
        self._started = started
        self._metrics_path = os.path.join(model_dir, "metrics.jsonl")
        self._earlier_seconds = 0.0
        self._status = None
        self._printing = threading.Lock()
        self._last_line = time.monotonic()
        self._activity: Optional[str] = None
        self._activity_since = 0.0
        if not enabled:
            self._writer = tf.summary.create_noop_writer()
            return
        records, damage = files.read_jsonl(self._metrics_path, _RECORD_FIELDS)
        if damage:  # a damaged line costs that line only
            files.warn(f"{self._metrics_path}: {'; '.join(damage[:3])}; rewritten without "
                       f"{'it' if len(damage) == 1 else 'them'} ({len(records)} records kept)")
        # The time of the earlier runs counts, all of it: also that of the
        # records dropped below, which was spent, if on steps now redone.
        self._earlier_seconds = max((r["elapsed_seconds"] for r in records), default=0.0)
        # Records past the resumed step describe steps that will be redone,
        # and so does the final evaluation of a run resumed at its last step
        # (stopped while it exported), if it evaluates: keep the log
        # consistent with the checkpoint, one record per step and kind.
        kept = [r for r in records if r["step"] <= resumed_from_step and not (
            evaluates_at_end and r["step"] == total_steps and "eval_loss" in r)]
        files.write_text(self._metrics_path,
                         "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
        self._writer = tf.summary.create_file_writer(os.path.join(model_dir, "tensorboard"))
        self._status = TrainJobStatus.from_environment()
        self._closed = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="progress").start()

    def last_logged(self, key: str) -> dict:
        """The newest record of metrics.jsonl that has a number at `key`; {}
        if none (a record edited to hold anything else is passed over)."""
        records = files.read_jsonl(self._metrics_path)[0] if self._enabled else []
        return next((r for r in reversed(records) if isinstance(r.get(key), (int, float))), {})

    def say(self, message: str) -> None:
        """Prints a line on the chief."""
        if self._enabled:
            self._print(message)

    @contextlib.contextmanager
    def doing(self, activity: str):
        """Says `activity` (e.g. "evaluating") is under way in the block: if
        it holds the run past PROGRESS_SECONDS without a line, a line says so."""
        self._activity, self._activity_since = activity, time.monotonic()
        try:
            yield
        finally:
            self._activity = None

    def live(self, step: int) -> None:
        """Shows the step reached on the status line (terminals only)."""
        if self._terminal:
            with self._printing:
                sys.stdout.write(f"\r\x1b[Kstep {step}/{self._total_steps}")
                sys.stdout.flush()
                self._live_line_shown = True

    def log(self, step: int, record: dict, eta_seconds: float = None) -> None:
        """Reports the metrics of the interval ending at `step`; the printed
        line also says how long the rest of the training should take."""
        if not self._enabled:
            return
        elapsed = self._earlier_seconds + time.monotonic() - self._started
        record = files.finite_values({"step": step, **record,
                                      "elapsed_seconds": round(elapsed, 3)})
        with open(self._metrics_path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        with self._writer.as_default(step=step):
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    tf.summary.scalar(name, value)
        self._writer.flush()
        if self._status is not None:
            self._status.update(100 * step / self._total_steps, eta_seconds,
                                {k: record[k] for k in _STATUS_METRICS
                                 if record.get(k) is not None})
        width = len(str(self._total_steps))
        parts = [f"step {step:>{width}}/{self._total_steps}"]
        for name, fmt in (("epoch", ".2f"), ("loss", ".4f"), ("accuracy", ".4f"),
                          ("eval_loss", ".4f"), ("eval_accuracy", ".4f"),
                          ("eval_accuracy_without_tta", ".4f"),
                          ("learning_rate", ".4g"), ("loss_scale", ".0f"),
                          ("examples_per_second", ".0f")):
            if record.get(name) is not None:
                parts.append(f"{name.replace('_per_second', '/s')} {record[name]:{fmt}}")
        if eta_seconds is not None:
            parts.append(f"ETA {format_seconds(eta_seconds)}")
        self._print("  ".join(parts))

    def close(self) -> None:
        if self._enabled:
            self._closed.set()
            if self._status is not None:
                self._status.close()
        self._writer.close()

    def _print(self, line: str) -> None:
        with self._printing:
            if self._live_line_shown:
                sys.stdout.write("\r\x1b[K")
                self._live_line_shown = False
            print(line, file=sys.stdout, flush=True)
            self._last_line = time.monotonic()

    def _heartbeat(self) -> None:
        """A line when the main thread has been held past PROGRESS_SECONDS."""
        while not self._closed.wait(1.0):
            activity, now = self._activity, time.monotonic()
            if activity and now - self._last_line >= PROGRESS_SECONDS:
                try:
                    self._print(f"{activity}: {now - self._activity_since:.0f} s so far")
                except Exception:  # noqa: BLE001 - the console is console.py's to report
                    return


def format_seconds(seconds: float) -> str:
    """H:MM:SS."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
