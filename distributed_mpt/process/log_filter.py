"""A quiet start: TensorFlow's C++ log lines are kept off the console.

TensorFlow 2.21 logs from C++ straight to file descriptor 2 (`I0000 ...`,
`W0000 ...`, and on machines without a GPU `E0000 ... failed call to
cuInit`), and most of those lines ignore TF_CPP_MIN_LOG_LEVEL because they
are written before absl's logging is initialized. So the process's own
descriptor 2 goes through a small filter process that drops those lines
(other errors pass) and passes everything else through unchanged.
DMPT_VERBOSE=1 keeps them all.

The filter is a process, not a thread: TensorFlow holds the GIL while it
waits for multi-worker peers, and a thread could not drain the pipe then. It
ignores the stop signals (start_guard.py) and ends when every
writer has closed the pipe, so the last lines of a process that is killed or
aborts still arrive.
"""

import contextlib
import os
import re
import subprocess
import sys

from distributed_mpt.process import stopping

VERBOSE_ENV = "DMPT_VERBOSE"

# A C++ (or absl) log line: severity, date, time, thread id, file:line].
# Info and warning lines go; of the errors only the CUDA probe's on machines
# without a GPU, and oneDNN's notice that it leaves bfloat16 or float16 to
# Eigen (the model runs): the others (gRPC, the coordination service) explain a
# failure, and fatal lines say why the process is about to die.
_LOG_LINE = rb"\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./-]+:\d+\]"
_TENSORFLOW_LINE = re.compile(
    rb"^(?:[IW]" + _LOG_LINE + rb"|E" + _LOG_LINE + rb" .*cuInit"
    # A bfloat16 or float16 model on a CPU without AVX-512: it runs, on Eigen's kernels.
    rb"|E" + _LOG_LINE + rb" oneDNN supports DT_(?:BFLOAT16|HALF) only on platforms with AVX-512\."
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|To enable the following instructions: .* rebuild TensorFlow"
    rb"|This TensorFlow binary is optimized to use available CPU instructions"
    # The continuation of the coordination service's "Example stragglers:".
    rb"|/job:\w+/replica:\d+/task:\d+$"
    # The continuation of the allocator's out-of-memory warning and of its
    # dump's statistics: the op's error, which follows, says what was refused.
    rb"|If the cause is memory fragmentation maybe the environment variable 'TF_GPU_ALLOCATOR"
    rb"|Current allocation summary follows\.$"
    rb"|(?:Limit|InUse|MaxInUse|NumAllocs|MaxAllocSize|Reserved|PeakReserved|LargestFreeBlock):"
    rb" {3,}[\d.]+(?:[KMGT]i)?B?$)")
# The line after an op's failure (a warning line) that names its node, and
# an empty line after a dropped one (the allocator's dump ends with one):
# gone with the line they continue; in a traceback's message they stay.
_NODE_LINE = re.compile(rb"\t \[\[|\r?\n$")
# A Python traceback in the message of a dropped line of status UNKNOWN, right after
# it (what a model's tf.numpy_function raised, in the warnings of the op and of the
# rendezvous it aborts): its frames are indented or empty, and its exception's line,
# the first that is neither, ends it. The process's own traceback stays, even right
# after: one traceback goes, and only after a line that names a Python exception.
_UNKNOWN = re.compile(rb".*\] .*\bUNKNOWN: [\w.]+: ")
_TRACEBACK = re.compile(rb"Traceback \(most recent call last\):\r?\n$")
_FRAME = re.compile(rb"[ \t]|\r?\n$")

_filter_process = None
_original_stderr = None


@contextlib.contextmanager
def filtering():
    """Routes this process's stderr through the filter for the block, unless
    DMPT_VERBOSE is set or it is already routed, and flushes and restores it
    however the block ends; at the end, waits (briefly) until the filter has
    passed on every line written. Enter before TensorFlow is imported."""
    global _filter_process, _original_stderr
    if _filter_process is None and os.environ.get(VERBOSE_ENV, "") in ("", "0"):
        sys.stderr.flush()
        try:
            _filter_process = subprocess.Popen(
                stopping.helper_command("distributed_mpt.process.log_filter"),
                stdin=subprocess.PIPE, stdout=2, stderr=subprocess.DEVNULL)
        except OSError:
            pass  # no filter: the lines are noise, never a reason to fail
        else:
            _original_stderr = os.dup(2)
            os.dup2(_filter_process.stdin.fileno(), 2)
            _filter_process.stdin.close()
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:  # stderr put back even if stdout cannot be written (console.py)
            if _filter_process is not None:
                sys.stderr.flush()
                os.dup2(_original_stderr, 2)
                os.close(_original_stderr)
                # Child processes that still hold the pipe (a watchdog about to
                # exit) keep it open a little longer: do not wait for them.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    _filter_process.wait(timeout=2)
                _filter_process = _original_stderr = None


# A piece of output: a line, or a progress bar's update (ended by \r).
_PIECE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def _filter(source, sink) -> None:
    """Copies `source` to `sink` piece by piece as it comes, without
    TensorFlow's lines, until `source` ends. If `sink` goes away (nobody
    reads stderr any more), the rest is read and dropped, so that writers
    never block or fail."""
    pending, sink_open, dropped, unknown, traceback = b"", True, False, False, False
    while True:
        chunk = source.read1(1 << 16)
        if not chunk:
            break
        pending += chunk
        end = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        complete, pending = pending[:end], pending[end:]
        for piece in _PIECE.findall(complete):
            if traceback:
                traceback = unknown = bool(_FRAME.match(piece))  # its exception's line ends it
                continue
            traceback = unknown and bool(_TRACEBACK.match(piece))
            dropped = bool(_TENSORFLOW_LINE.match(piece) or dropped and _NODE_LINE.match(piece)
                           or traceback)
            unknown = dropped and bool(_UNKNOWN.match(piece))
            sink_open = sink_open and (dropped or _write(sink, piece))
    if pending and sink_open and not _TENSORFLOW_LINE.match(pending):
        _write(sink, pending)


def _write(sink, piece: bytes) -> bool:
    """Writes `piece`; False once `sink` is gone."""
    try:
        sink.write(piece)
        sink.flush()
        return True
    except OSError:
        return False


if __name__ == "__main__":  # ignoring the stop signals (start_guard.py)
    _filter(sys.stdin.buffer, sys.stdout.buffer)
