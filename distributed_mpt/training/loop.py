"""The paced training loop: calls of the compiled steps, each about a second
long, with progress lines, evaluations, checkpoints, divergence checks and
stops between them, on every worker alike.

Progress as a person, a dashboard and a script see it (Reporter): one line
per interval on stdout, TensorBoard scalars, `metrics.jsonl`, and on
Kubeflow Trainer the TrainJob's status. Only the chief reports; the other
workers stay quiet. A line comes at least every PROGRESS_SECONDS whatever
the run is doing: a thread watches the clock and, when the main thread is
held longer (tracing the first step, a step slower than that, an
evaluation, a checkpoint), says what is under way and for how long.
"""

import contextlib
import math
import os
import sys
import threading
import time

import tensorflow as tf

from distributed_mpt.config import TrainConfig
from distributed_mpt.core import precision
from distributed_mpt.core.steps import NO_TOTALS, LoopTotals, Trainer
from distributed_mpt.cluster.strategy import PEER_ERRORS
from distributed_mpt.core.models import blame
from distributed_mpt.core.models.contract import FirstStepError, cause
from distributed_mpt.errors import DivergedError, Preempted, UserError, quoted
from distributed_mpt.cluster.trainjob_progress import TrainJobStatus
from distributed_mpt.json_lines import JsonLines, append_records, finite_values
from distributed_mpt.process import stopping
from distributed_mpt.process.run_lock import ModelDirLostError, Writes
from distributed_mpt.training import PROGRESS_SECONDS, outputs
from distributed_mpt.training.build import check_evaluation, divergence_advice
from distributed_mpt.training.checkpoints import Checkpoints
from distributed_mpt.training.plan import RunPlan

# With dynamic loss scaling, overflowing steps are skipped and the scale
# halves; this many in a row means the loss itself is not finite.
_NONFINITE_STEPS_WITH_LOSS_SCALING = 100

# A loop call's target length: a progress line waits for the call under way
# (a stop request only for the step under way), so calls are kept this short
# (up to --steps_per_loop steps each), whatever the model or device.
_CALL_SECONDS = 1.0


class TrainingLoop:
    """Trains from a step to the last one: logging, evaluating every
    `eval_every_epochs`, checkpointing, and watching for divergence and
    stop requests."""

    def __init__(self, trainer: Trainer, config: TrainConfig, plan: RunPlan,
                 checkpoints: Checkpoints, reporter: "Reporter", train_input, writes: Writes):
        """train_input(split, start_step, end_step, crop_size): the
        distributed input of one of the plan's input phases. writes: the
        progress lines and checkpoints go through it (run_lock.Writes)."""
        self._trainer, self._checkpoints, self._reporter = trainer, checkpoints, reporter
        self._config, self._plan, self._train_input = config, plan, train_input
        self._write = writes

    def run(self, train_split, test_split, start_step: int):
        """Returns the last interval's metrics and the throughput in examples
        per second (the first call excluded, as it includes tracing, unless
        it was the only one)."""
        trainer, plan, run = self._trainer, self._plan, self._config.run
        self._nonfinite_run, self._last_saved = 0, start_step  # check_evaluation's too
        if start_step >= plan.total_steps:
            # Trained before, but stopped before its summary was written
            # (SIGKILL during the export): the log has the training figures.
            last = self._reporter.last_logged("loss")
            return last, last.get("examples_per_second")
        iterator, phase_end, crop_size, current = None, start_step, None, start_step
        interval, interval_start = NO_TOTALS, time.perf_counter()
        timed_examples, timed_seconds, metrics, lines = 0, 0.0, {}, 0
        # The wall clock of the last line, evaluations and checkpoints
        # included: the promise of a line every PROGRESS_SECONDS is kept in it.
        last_line = time.perf_counter()
        # This worker's pace in the last call, sent with the next one; and
        # every worker's mean, which comes back the same to all of them.
        seconds_per_step = agreed_seconds_per_step = 0.0
        # Evaluation at the end is train_and_evaluate's; this is for the curve.
        eval_every_steps = (self._config.evaluation.eval_every_epochs * plan.steps_per_epoch
                            or plan.total_steps)
        boundaries = (run.log_every_steps, run.checkpoint_every_steps, eval_every_steps,
                      plan.steps_per_epoch)
        first_call = None
        while current < plan.total_steps:
            if current == phase_end:  # the first call, or the images change size (early crops)
                iterator = None  # the last phase's pipeline stops before the next starts
                phase_end, crop_size = plan.input_phase(current)
                iterator = iter(self._train_input(train_split, current, phase_end, crop_size))
            num_steps = min(phase_end, current + _steps_per_call(agreed_seconds_per_step,
                                                                 run.steps_per_loop),
                            *((current // b + 1) * b for b in boundaries)) - current
            call_started = time.perf_counter()
            with self._reporter.doing(_call_activity(current, num_steps, plan.total_steps,
                                                     agreed_seconds_per_step)), \
                    self._users_model(first_call is None and start_step == 0, current, num_steps):
                totals = trainer.train(iterator, num_steps, seconds_per_step, crop_size)
            if totals.stop_requests > 0:  # agreed by every worker, at a step boundary
                self._stop(totals, int(trainer.step.numpy()), current)
            call_seconds = time.perf_counter() - call_started
            seconds_per_step = call_seconds / num_steps
            agreed_seconds_per_step = totals.seconds_per_step
            if first_call is None:
                first_call = (num_steps * plan.global_batch_size, call_seconds)
            else:
                timed_examples += num_steps * plan.global_batch_size
                timed_seconds += call_seconds
            current += num_steps
            interval += totals
            self._check_finite(totals, num_steps, current)
            # A line now if the next call, about as long as this one, would
            # end past the promised interval.
            due = time.perf_counter() - last_line + call_seconds >= PROGRESS_SECONDS
            if (current % run.log_every_steps == 0 or current % plan.steps_per_epoch == 0 or
                    current == plan.total_steps or due or lines < 2):
                # The first line comes after the first call, so that a slow
                # start (tracing) shows; it has no ETA, as tracing is in it.
                # The second, after the first call timed alone, has one.
                metrics = self._log(current, interval, time.perf_counter() - interval_start,
                                    with_eta=lines > 0)
                interval, interval_start, lines = NO_TOTALS, time.perf_counter(), lines + 1
                last_line = interval_start
            else:
                self._reporter.live(current)

            if current % eval_every_steps == 0 and current < plan.total_steps:
                eval_started = time.perf_counter()
                with self._reporter.doing(f"evaluating on the {len(test_split)} test images",
                                          say=True):
                    result = trainer.evaluate(test_split)
                self.check_evaluation(result, current)  # before its checkpoint: that stays good
                self._write(self._reporter.log, current,
                            {"epoch": current / plan.steps_per_epoch, **result})
                interval_start += time.perf_counter() - eval_started  # not training time

            if current % run.checkpoint_every_steps == 0 or current == plan.total_steps:
                save_started = time.perf_counter()
                with self._reporter.doing(f"saving the checkpoint of step {current}"):
                    self._write(self._checkpoints.save, current)
                self._last_saved = current
                interval_start += time.perf_counter() - save_started  # not training time
        # A loss in the last step's writes, where no step is left to agree
        # at, is agreed where the workers leave together (plan.leave_together).
        if not timed_seconds:
            timed_examples, timed_seconds = first_call
        return metrics, timed_examples / timed_seconds

    def _users_model(self, new_runs_first: bool, current: int, num_steps: int):
        """What names a user's model failing in this call (blame.py); not the package's."""
        spec = self._config.model.spec
        if not spec.is_users:
            return contextlib.nullcontext()
        if new_runs_first:
            return _users_model_named(spec.name)
        kept = (f"the run's checkpoints are kept, the latest of step {self._last_saved}"
                if self._last_saved else "no checkpoint was saved yet")
        steps = (f"training step {current + 1}" if num_steps == 1
                 else f"training steps {current + 1}-{current + num_steps}")
        return blame.named_if_its_own(spec.name, self._trainer.model, steps, kept)

    def _stop(self, totals: LoopTotals, reached: int, call_start: int) -> None:
        """Saves the step `reached` (a stop cut the call that began at
        `call_start` short) and raises Preempted (if the chief lost --model_dir:
        ModelDirLostError, on every worker, saving nothing). The steps since the
        last progress line go unlogged; the resumed run logs from `reached` on."""
        if totals.model_dir_lost:
            raise self._write.lost or ModelDirLostError.of_the_chief()
        self._check_finite(totals, reached - call_start, reached)  # never a NaN checkpoint
        self._checkpoints.save(reached)
        stopping.enter(stopping.Phase.FINISHING)  # a second Ctrl-C loses nothing now
        self._reporter.say(f"stopped by a signal at step {reached}; checkpoint saved: "
                           f"run the same command again to resume")
        raise Preempted(f"stopped at step {reached} after a checkpoint")

    def _check_finite(self, totals: LoopTotals, num_steps: int, current: int) -> None:
        """Raises DivergedError on a non-finite loss (without loss scaling) or
        too many skipped steps in a row (with it)."""
        plan = self._plan
        self._nonfinite_run = (self._nonfinite_run + num_steps
                               if round(totals.nonfinite_steps) == num_steps else 0)
        if (totals.nonfinite_steps > 0 and not plan.loss_scaling) or \
                self._nonfinite_run >= _NONFINITE_STEPS_WITH_LOSS_SCALING:
            kept, remedy = divergence_advice(plan, self._last_saved)
            if self._nonfinite_run == current:  # step 1 too: its loss is of the initial weights
                raise DivergedError(
                    f"the loss was NaN or infinite from the first step on, whose loss no update "
                    f"has touched: the model's output for its initial weights is not finite "
                    f"(its initializers, or arithmetic such as a log or a division), which no "
                    f"learning rate causes; {kept}")
            raise DivergedError(f"the loss became NaN or infinite by step {current}; {kept}: {remedy}")

    def check_evaluation(self, result: dict, step: int) -> None:
        """build.check_evaluation of the model at `step`, this loop's last checkpoint told."""
        check_evaluation(self._trainer.model, self._plan, result, step, self._last_saved)

    def _log(self, step: int, interval: LoopTotals, seconds: float, with_eta: bool) -> dict:
        """Reports the interval's metrics; returns them."""
        plan, optimizer = self._plan, self._trainer.optimizer
        examples = interval.examples
        metrics = {"epoch": step / plan.steps_per_epoch,
                   "loss": interval.loss_sum / examples if examples else math.nan,
                   "accuracy": interval.correct / examples if examples else math.nan,
                   "learning_rate": float(optimizer.learning_rate),
                   "examples_per_second": examples / seconds if seconds else 0.0,
                   "skipped_steps": round(interval.nonfinite_steps)}
        if plan.loss_scaling:  # float32 and bfloat16 have no scale to show
            metrics["loss_scale"] = precision.loss_scale(optimizer)
        eta = ((plan.total_steps - step) * plan.global_batch_size / metrics["examples_per_second"]
               if with_eta and examples and seconds else None)
        self._write(self._reporter.log, step, metrics, eta_seconds=eta)
        return metrics


def _call_activity(current: int, num_steps: int, total_steps: int,
                   seconds_per_step: float) -> str:
    """What a loop call does, for a line while it runs past PROGRESS_SECONDS."""
    if current == 0 or not seconds_per_step:
        return f"compiling the training step and taking step {current + 1} of {total_steps}"
    steps = f"{current + 1}-{current + num_steps}" if num_steps > 1 else str(current + 1)
    eta = format_seconds((total_steps - current) * seconds_per_step)
    return (f"training step {steps} of {total_steps} (a step took {seconds_per_step:.1f} s "
            f"before; ETA {eta} at that pace)")


def _steps_per_call(step_seconds: float, steps_per_loop: int) -> int:
    """Steps for a call of about _CALL_SECONDS at `step_seconds` a step (the
    same on every worker, so that they all call the loop alike); one while
    the pace is not known yet (0)."""
    return max(1, min(steps_per_loop, int(_CALL_SECONDS / step_seconds) if step_seconds else 1))


# What the console shows of a record, in this order and format; and the
# TrainJob's status, as the console does.
_SHOWN = {"epoch": ".2f", "loss": ".4f", "accuracy": ".4f", "eval_loss": ".4f",
          "eval_accuracy": ".4f", "eval_accuracy_without_tta": ".4f", "learning_rate": ".4g",
          "loss_scale": ".0f", "examples_per_second": ".0f"}
_STATUS_METRICS = ("loss", "accuracy", "eval_loss", "eval_accuracy", "learning_rate")


class Reporter:
    """Writes one record per logged step to every sink (chief only)."""

    def __init__(self, model_dir: str, enabled: bool, total_steps: int, resumed_from_step: int,
                 started: float, evaluates_at_end: bool, check_held=lambda: None):
        """started: the run's start on the `time.monotonic()` clock; every
        record carries the seconds since, plus those of the earlier runs it
        resumes (as metrics.jsonl has them), for time-to-accuracy curves.
        evaluates_at_end: whether the run logs a final evaluation.
        check_held(): raises if --model_dir is no longer this run's."""
        self._enabled, self._check_held, self._total_steps = enabled, check_held, total_steps
        # On a terminal, a status line is rewritten after every loop call;
        # logs (Kubernetes, SLURM, a file) get whole lines only.
        # The run's stdout, kept: a user's model code running in the export
        # has what it prints sent to stderr (contract.users_code), not ours.
        self._stdout = sys.stdout
        self._terminal = enabled and self._stdout.isatty()
        self._live_line_shown, self._started = False, started
        self._metrics_path = os.path.join(model_dir, "metrics.jsonl")
        self._earlier_seconds, self._status = 0.0, None
        self._printing, self._last_line = threading.Lock(), time.monotonic()
        self._activity, self._activity_since = None, 0.0  # see doing()
        if not enabled:
            self._writer = tf.summary.create_noop_writer()
            return
        # Records past the resumed step describe steps that will be redone,
        # and so does the final evaluation of a run resumed at or past its
        # end (stopped while it exported; not an earlier end's), if it
        # evaluates: keep the log consistent with the checkpoint, one per step and kind.
        redone = resumed_from_step if evaluates_at_end and resumed_from_step >= total_steps else -1
        self._earlier_seconds = outputs.keep_metrics(self._metrics_path, lambda r: (
            r["step"] <= resumed_from_step and not (r["step"] == redone and "eval_loss" in r)))
        # Made here, as the umask says: TensorFlow's mode 755 shut a team (umask 002) out of it.
        os.makedirs(os.path.join(model_dir, "tensorboard"), exist_ok=True)
        self._writer = tf.summary.create_file_writer(os.path.join(model_dir, "tensorboard"))
        self._status = TrainJobStatus.from_environment()
        self._closed = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="progress").start()

    def last_logged(self, key: str) -> dict:
        """The newest record of metrics.jsonl that has a number at `key`; {}
        if none (a record edited to hold anything else is passed over). A
        record at a time: a log of 1.3 M records is too large to hold whole."""
        last = {}
        for record, _ in JsonLines(self._metrics_path) if self._enabled else ():
            last = record if isinstance(record.get(key), (int, float)) else last
        return last

    def say(self, message: str) -> None:
        """Prints a line on the chief."""
        if self._enabled:
            self._print(message)

    @contextlib.contextmanager
    def doing(self, activity: str, say: bool = False):
        """Says `activity` (e.g. "evaluating") is under way in the block: if
        it holds the run past PROGRESS_SECONDS without a line, a line says so;
        `say`: a line says it at once too."""
        if say:
            self.say(activity)
        self._activity, self._activity_since = activity, time.monotonic()
        try:
            yield
        finally:
            self._activity = None

    def live(self, step: int) -> None:
        """Shows the step reached on the status line (terminals only)."""
        if self._terminal:
            with self._printing:
                print(f"\r\x1b[Kstep {step}/{self._total_steps}", end="", flush=True)
                self._live_line_shown = True

    def log(self, step: int, record: dict, eta_seconds: float = None) -> None:
        """Reports the metrics of the interval ending at `step`; the printed
        line also says how long the rest of the training should take."""
        if not self._enabled:
            return
        elapsed = self._earlier_seconds + time.monotonic() - self._started
        record = finite_values({"step": step, **record, "elapsed_seconds": round(elapsed, 3)})
        self._check_held()
        append_records(self._metrics_path, [record])
        with self._writer.as_default(step=step):
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    tf.summary.scalar(name, value)
        self._writer.flush()
        if self._status is not None:
            self._status.update(100 * step / self._total_steps, eta_seconds,
                                {k: record[k] for k in _STATUS_METRICS
                                 if record.get(k) is not None})
        parts = [f"step {step:>{len(str(self._total_steps))}}/{self._total_steps}"]
        parts += [f"{name.replace('_per_second', '/s')} {record[name]:{fmt}}"
                  for name, fmt in _SHOWN.items() if record.get(name) is not None]
        if eta_seconds is not None:
            parts.append(f"ETA {format_seconds(eta_seconds)}")
        self._print("  ".join(parts))

    def close(self, early: bool = False) -> None:
        """Ends the reports; `early`: the run was stopped or failed (TrainJobStatus.close)."""
        if self._enabled:
            self._closed.set()
            if self._status is not None:
                self._status.close(early)
        self._writer.close()

    def _print(self, line: str) -> None:
        with self._printing:
            if self._live_line_shown:
                self._stdout.write("\r\x1b[K")
                self._live_line_shown = False
            print(line, file=self._stdout, flush=True)
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


@contextlib.contextmanager
def _users_model_named(name: str):
    """A user's model (--model=`name`) that fails in the first call of the
    step of a run from step 0 is one line naming it (FirstStepError), not a
    traceback: what the contract's trace cannot find (an assertion or a
    kernel that only running meets, a float16 variable under
    mixed_float16). What a restart may cure (a peer's failure, TensorFlow's
    internal errors) stays as it is; so does a failure after a resume
    (something trained)."""
    try:
        yield
    except PEER_ERRORS as e:
        # A peer whose own first step failed (the model's code, on its own
        # shard of the data) is lost to this worker without its cause.
        e.add_note(f"in the run's first training step, where a peer's --model={quoted(name)} "
                   f"may have failed (its own log would say so)")
        raise
    # TensorFlow's errors that say nothing of the model: a device's or the
    # runtime's (a restart may go on where they struck).
    except (UserError, tf.errors.InternalError, tf.errors.UnknownError, tf.errors.DataLossError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code, in the first step only
        raise FirstStepError(f"--model={quoted(name)} failed in the run's first training step "
                             f"({cause(e)})") from None
