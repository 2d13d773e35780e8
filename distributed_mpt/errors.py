"""Errors a user can fix, and the exit codes the launchers and Kubernetes act on.

Every exit code of the package is declared here, once, with what it tells a
restart policy. They follow the convention of Kubeflow's
`restartPolicy: ExitCode`: 1-127 are permanent (restarting cannot help),
128-255 are retryable. A code 128 + N is what a shell and Kubernetes report
for a process that signal N ended, and the codes above 128 are chosen so
that a process killed by that signal and one exiting on purpose say the
same thing.
"""

# Nothing that loads an extension module (`typing` does): process/start_guard.py
# imports this module before its guard is in place, and a Ctrl-C is Python's until then.
import enum
import os
import re
import signal
import sysconfig


# The signals that stop a run at a step boundary, with a checkpoint (PREEMPTED
# below): process/stopping.py handles them, and a user's model may not take
# them over (core/models/contract.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def status_of_signal(signum: int) -> int:
    """The exit status a shell and Kubernetes report for a process that
    signal `signum` ended."""
    return 128 + signum


class ExitCode(enum.IntEnum):
    """An exit status, whether a restart can help (`retryable`), and why."""

    def __new__(cls, code: int, meaning: str):
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    @property
    def retryable(self) -> bool:
        """Whether a restart policy should start the process again."""
        return self >= 128

    OK = 0, ("training finished, or a finished run was found (and its export written again "
             "if it was missing or incomplete)")
    CRASHED = 1, ("an unforeseen error, with a traceback (Python's own status), or a benchmark "
                  "section that failed (the report says which and why); a restart would meet it "
                  "again, though the local launcher retries it")
    USAGE = 2, ("bad flags, cluster description, data or --model_dir contents, or a full disk: "
                "one `error:` line says what to fix; a restart would fail the same way")
    DIVERGED = 3, ("the loss, or an evaluation's, became NaN or infinite; the last good "
                   "checkpoint is kept (the last step's, if the evaluation at the end), nothing "
                   "exported; retrying at the same learning rate diverges again")
    ABORTED = status_of_signal(signal.SIGINT), (
        "Ctrl-C pressed twice: aborted at once, saving no checkpoint of its own (a shell reports "
        "Ctrl-C so); a restart resumes from the latest checkpoint")
    KILLED = status_of_signal(signal.SIGKILL), (
        "SIGKILL: a worker asked to stop while TensorFlow started (its import, the wait for its "
        "peers: the start-up watchdog ends it so, nothing was trained yet), or the OOM killer, "
        "or Kubernetes after the grace period")
    PEER_LOST = status_of_signal(signal.SIGPIPE), (
        "a peer of a multi-worker job was lost mid-run (it stopped, or the connection broke: "
        "the line names the peer TensorFlow's error names, and a peer's own output says why it "
        "stopped); a restart of the group resumes from the latest checkpoint")
    PEER_TIMEOUT = status_of_signal(signal.SIGALRM), (
        "the peers of a multi-worker job were not all up within --peer_timeout_seconds; "
        "they may still be scheduled")
    PREEMPTED = status_of_signal(signal.SIGTERM), (
        "stopped by SIGTERM, Ctrl-C, SIGHUP, SIGUSR1 or SIGUSR2 after saving a checkpoint at the "
        "step reached, or before training started; a restart resumes from that step")
    MODEL_DIR_BUSY = 144, (
        "another run holds --model_dir; on Kubernetes a replacement chief waiting for a lost "
        "node's NFS lock to expire (about 90 s): a restart with backoff gets it")


def exit_code_table() -> str:
    """The exit codes as a Markdown table (docs/reliability.md holds a copy,
    which a test keeps equal)."""
    rows = ["| code | name | a restart policy | meaning |", "| --- | --- | --- | --- |"]
    for code in ExitCode:
        policy = "—" if code == ExitCode.OK else "retry" if code.retryable else "do not retry"
        rows.append(f"| {int(code)} | `{code.name}` | {policy} | {code.meaning} |")
    return "\n".join(rows) + "\n"


# An error raised inside a tf.function opens with "Graph execution error:",
# then where each failing op was defined (a header, indented frames, a node
# name); the cause comes after them. TensorFlow 2.21's atomic_function.py
# and error_interpolation.py write these lines.
_GRAPH_ERROR = "Graph execution error:"
_WHERE_DEFINED = re.compile(r"\s|Detected at node |Node: '|<stack traces unavailable>")
# Errors on several devices at once (MirroredStrategy's replicas) follow a
# count, each indented and numbered with its status code: "  (0) CODE: cause".
_ROOT_ERRORS = re.compile(r"\d+ root error\(s\) found\.")
_ROOT_ERROR = re.compile(r"\s+\(\d+\) (?:[A-Z_]+:\s*)?(.*)")


def text_of(value) -> str:
    """str(value), or what it is where str() fails: a user's model may raise
    an error whose __str__ raises, or returns no string."""
    try:
        return str(value)
    # BaseException: a __str__ that raises KeyboardInterrupt or calls
    # sys.exit() gave a traceback, or ended the run without a word.
    except BaseException:  # noqa: BLE001 - whatever its own code raises
        return f"{type(value).__name__} (whose message cannot be shown)"


def first_line(error, limit: int = 200) -> str:
    """The first line of an error or message that says what went wrong, at
    most `limit` characters: what fits into one `error:` line (TensorFlow's
    messages run to pages, and open with where the failing op was defined)."""
    every_line = [line for line in text_of(error).splitlines() if line.strip()]
    lines = every_line
    if lines and lines[0] == _GRAPH_ERROR:
        lines = [line for line in lines[1:] if not _WHERE_DEFINED.match(line)] or lines
    if lines and _ROOT_ERRORS.fullmatch(lines[0]):
        lines = [m.group(1) for m in map(_ROOT_ERROR.fullmatch, every_line) if m] or lines
    if not lines:
        lines = [type(error).__name__ if isinstance(error, BaseException) else ""]
    return lines[0][:limit]


# Autograph (a tf.function's, as a training step is) replaces the message of
# what the code it converts raises: "in user code:", the frames (each a
# "File" line and its code), then the original "Type: message", indented.
# TensorFlow 2.21's autograph/pyct/error_utils.py writes it.
_AUTOGRAPH = "in user code:"
_AUTOGRAPH_FRAME = re.compile(r'    File "(.+)", line (\d+), in ')
# Installed code is in the interpreter's library or a folder named
# site-packages or dist-packages (a venv's, the user site's, Debian's
# /usr/lib/python3/dist-packages, which sysconfig does not name).
_INSTALLED = {"site-packages", "dist-packages"}


def inside_autograph(error) -> "tuple[str, str, str | None] | None":
    """(type name, message, "file:line" of the innermost frame in neither an
    installed library nor this package) of what autograph's message wraps
    in `error`; None if it wraps nothing."""
    lines = text_of(error).splitlines()
    if not lines or lines[0] != _AUTOGRAPH:
        return None
    at, frames = 1, []
    while at < len(lines) and (not lines[at].strip() or _AUTOGRAPH_FRAME.match(lines[at])):
        frame = _AUTOGRAPH_FRAME.match(lines[at])
        if frame:
            frames.append(frame.groups())
        at += 2 if frame else 1  # a frame's code line follows it
    name, _, message = "\n".join(line[4:] for line in lines[at:]).partition(": ")
    if not message or not name.isidentifier():
        return None
    ours = [os.path.join(directory, "") for directory in (
        *(sysconfig.get_path(kind) for kind in ("stdlib", "platstdlib")),
        os.path.dirname(os.path.abspath(__file__)))]
    users = [f"{quoted(path)}:{line}" for path, line in frames
             if os.path.isabs(path) and not path.startswith(tuple(ours))
             and not _INSTALLED.intersection(path.split(os.sep))]
    return name, message, users[-1] if users else None


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Beyond ASCII, by category: controls, line and paragraph separators, the
# surrogates that stand for a file name's bytes that are not UTF-8 (a
# strict UTF-8 stdout cannot print them), and format characters (Cf): the
# bidi overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder
# the rest of a terminal's line, and the zero-width ones, which hide that
# two names differ. Not the zero-width joiners, which Persian and Indic
# words and emoji sequences are written with.
_UNPRINTABLE_CATEGORIES = ("Cc", "Cf", "Cs", "Zl", "Zp")
_JOINERS = ("\u200c", "\u200d")
QUOTE_LIMIT = 200


def quoted(value, limit: int = QUOTE_LIMIT) -> str:
    """`value` (a path, a flag's value, a line of a file, a class name) as
    an error line or an answer may echo it: control and format characters
    escaped (as \\n, \\u202e; a file name's byte that is not UTF-8 as Python
    holds it, 0xE9 as \\udce9, the one spelling of every message), so that
    a newline in a file name cannot forge a line of output, an escape
    sequence drive the terminal, nor a right-to-left override reorder what
    follows it; and at most `limit` characters
    (`--flagfile=/proc/self/environ` must not print the environment). Plain
    short text stays as it is."""
    # Escaping only lengthens: the first limit + 1 characters decide.
    text = text_of(value)[:limit + 1]
    if text.isascii():
        text = _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
    else:
        import unicodedata  # here: an extension module (see the imports above)

        text = "".join(c.encode("unicode_escape").decode() if c not in _JOINERS and
                       unicodedata.category(c) in _UNPRINTABLE_CATEGORIES else c for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def too_long_to_open(path: str) -> str:
    """`path`, which the system refused as too long (ENAMETOOLONG), for an
    error line: cut in its middle, not at its end (its last names say which
    it is), with its length and the limit it passes (PATH_MAX for the whole,
    NAME_MAX for one of its names)."""
    encoded = os.fsencode(path)
    longest = max(encoded.split(b"/"), key=len)
    name_max = os.pathconf("/", "PC_NAME_MAX")
    if len(longest) > name_max:
        said = f"a name of {len(longest):,} bytes in it, more than the {name_max:,} a name may be"
    else:
        said = (f"a path of {len(encoded):,} bytes, where this system opens fewer than "
                f"{os.pathconf('/', 'PC_PATH_MAX'):,}")
    shown = quoted(path, len(path) * 10)  # \U0010ffff: 10 characters for 1
    if len(shown) > QUOTE_LIMIT:
        shown = shown[:60] + "..." + shown[63 - QUOTE_LIMIT:]
    return f"{shown} ({said})"


class UserError(Exception):
    """An error caused by input the user controls; printed as one line."""

    exit_code = ExitCode.USAGE


class ConfigError(UserError):
    """A flag is missing, malformed or contradicts another flag."""


class ClusterError(UserError):
    """The cluster description (TF_CONFIG, indexed Job, SLURM) is unusable."""


class DataUnavailableError(UserError):
    """The dataset is not in --data_dir, is damaged there, or cannot be downloaded."""


class CheckpointMismatchError(UserError):
    """--model_dir holds checkpoints of a different model."""


class ConsoleError(UserError):
    """Standard output or error cannot be written: a full disk, a device error."""


class DivergedError(UserError):
    """The loss became NaN or infinite and did not recover."""

    exit_code = ExitCode.DIVERGED


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    exit_code = ExitCode.PREEMPTED
