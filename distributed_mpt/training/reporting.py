"""Progress as a person, a dashboard and a script see it: one line per
interval on stdout, TensorBoard scalars, and `metrics.jsonl`. Only the chief
reports; the other workers stay quiet."""

import json
import os
import sys
import time

import tensorflow as tf

from distributed_mpt import files


# What every record of metrics.jsonl holds; a line without them is damaged.
_RECORD_FIELDS = {"step": int, "elapsed_seconds": (int, float)}


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
        files.write_text(self._metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        self._writer = tf.summary.create_file_writer(os.path.join(model_dir, "tensorboard"))

    def last_logged(self, key: str) -> dict:
        """The newest record of metrics.jsonl that has `key`; {} if none."""
        records = files.read_jsonl(self._metrics_path)[0] if self._enabled else []
        return next((r for r in reversed(records) if key in r), {})

    def say(self, message: str) -> None:
        """Prints a line on the chief."""
        if self._enabled:
            self._clear_live_line()
            print(message, flush=True)

    def live(self, step: int) -> None:
        """Shows the step reached on the status line (terminals only)."""
        if self._terminal:
            sys.stdout.write(f"\r\x1b[Kstep {step}/{self._total_steps}")
            sys.stdout.flush()
            self._live_line_shown = True

    def _clear_live_line(self) -> None:
        if self._live_line_shown:
            sys.stdout.write("\r\x1b[K")
            self._live_line_shown = False

    def log(self, step: int, record: dict, eta_seconds: float = None) -> None:
        """Reports the metrics of the interval ending at `step`; the printed
        line also says how long the rest of the training should take."""
        if not self._enabled:
            return
        elapsed = self._earlier_seconds + time.monotonic() - self._started
        record = {"step": step, **record, "elapsed_seconds": round(elapsed, 3)}
        with open(self._metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        with self._writer.as_default(step=step):
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    tf.summary.scalar(name, value)
        self._writer.flush()
        width = len(str(self._total_steps))
        parts = [f"step {step:>{width}}/{self._total_steps}"]
        for name, fmt in (("epoch", ".2f"), ("loss", ".4f"), ("accuracy", ".4f"),
                          ("eval_loss", ".4f"), ("eval_accuracy", ".4f"),
                          ("eval_accuracy_without_tta", ".4f"),
                          ("learning_rate", ".4g"), ("loss_scale", ".0f"),
                          ("examples_per_second", ".0f")):
            if name in record:
                parts.append(f"{name.replace('_per_second', '/s')} {record[name]:{fmt}}")
        if eta_seconds is not None:
            minutes, seconds = divmod(round(eta_seconds), 60)
            parts.append(f"ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
        self._clear_live_line()
        print("  ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._writer.close()
