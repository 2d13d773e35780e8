"""What every entry point does the same way: its flags (absl) with numbers
parsed strictly, `--help`/`--helpfull`, bad input as one `error:` line and
exit 2, and a console that may go away (process/console.py).

Numbers are ASCII decimals, as the cluster variables are: Python's int() and
float() would take `0x10`, `1_000`, `١٢` (Arabic-Indic digits), `nan` and
`inf`, none of which a user means for a step count or a learning rate.
"""

import contextlib
import math
import os
import re
import sys
import threading
import warnings
from typing import Callable, List, Optional, Tuple

from absl import flags

from distributed_mpt import files
from distributed_mpt.core.models.process_state import working_directory
from distributed_mpt.errors import ConfigError, ExitCode, UserError, first_line, quoted
from distributed_mpt.process import stopping

HELP_FLAGS = ("-h", "--help", "-help", "--helpfull", "-helpfull")

# absl files a flag under the module that called DEFINE: without this, every
# number flag defined through define_integer/define_float would be listed in
# --help under "distributed_mpt.cli", apart from its entry point's others.
flags.disclaim_key_flags()

_INTEGER = re.compile(r"[+-]?[0-9]+")
_NOT_BOOLEAN = re.compile(r"\('Non-boolean argument to boolean flag', (.*)\)$")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class _StrictIntegerParser(flags.IntegerParser):
    def convert(self, argument):
        if isinstance(argument, str) and not is_decimal_integer(argument):
            raise ValueError(f"{_shown(argument)} is not a whole number in decimal digits")
        return super().convert(argument)


class _StrictFloatParser(flags.FloatParser):
    def convert(self, argument):
        if isinstance(argument, str) and not _FLOAT.fullmatch(argument.strip()):
            raise ValueError(f"{_shown(argument)} is not a decimal number")
        value = super().convert(argument)
        if not math.isfinite(value):  # `1e400` is written in decimals, and is infinity
            raise ValueError(f"{quoted(argument, 40)} is too large for a number")
        return value


def _shown(argument: str) -> str:
    """A flag's value as its error line echoes it: `--epochs=` gave
    "flag --epochs=:  is not a decimal number"."""
    return quoted(argument, 40) if argument.strip() else "an empty value"


def is_decimal_integer(text: str) -> bool:
    """Whether `text` is a whole number in ASCII decimal digits."""
    return bool(_INTEGER.fullmatch(text.strip()))


def define_integer(fv: flags.FlagValues, name: str, default, help: str, lower=None,
                   upper=None) -> None:
    """An integer flag in `fv` that takes decimal digits only."""
    flags.DEFINE(_StrictIntegerParser(lower, upper), name, default, help, flag_values=fv,
                 serializer=flags.ArgumentSerializer())


def define_float(fv: flags.FlagValues, name: str, default, help: str, lower=None,
                 upper=None) -> None:
    """A float flag in `fv` that takes a finite decimal number only."""
    flags.DEFINE(_StrictFloatParser(lower, upper), name, default, help, flag_values=fv,
                 serializer=flags.ArgumentSerializer())


def wants_help(argv: List[str]) -> bool:
    return bool(set(HELP_FLAGS) & set(argv))


def show_help(doc: str, fv: flags.FlagValues, epilogue: str = "") -> int:
    """Prints the entry point's docstring, its flags and `epilogue`; returns 0."""
    print(doc + "\nFlags:\n" + fv.get_help() + ("\n\n" + epilogue if epilogue else ""))
    return ExitCode.OK


_FLAGFILE = ("--flagfile", "-flagfile")
# Far above any flagfile (the shipped recipes are under 2 kB), even one of a 100 kB path.
MAX_FLAGFILE_BYTES = 1 << 20


# Flagfiles read for one command, counted as absl reads them: again wherever
# one is named. Far above any real use (a recipe named by a flagfile named by
# another); six files that each named the next 20 times were 64 million reads
# (a hang), and a chain of a thousand a RecursionError's traceback.
MAX_FLAGFILES_READ = 256


def check_flagfiles(args, seen=(), read=None) -> None:
    """Raises ConfigError unless every --flagfile in `args`, and every one
    that those name, is a regular file of UTF-8 text, MAX_FLAGFILES_READ at
    most (`read`: how many so far). absl opens whatever it is given: it
    waits forever on a FIFO, raises UnicodeDecodeError on a binary file, and
    echoes a line it cannot read as a flag (a --flagfile of
    /proc/self/environ: the environment, secrets and all)."""
    args, read = list(args), [0] if read is None else read
    for i, arg in enumerate(args):
        if arg == "--":
            return
        if arg in _FLAGFILE and i + 1 < len(args):  # with none, absl says so
            path = args[i + 1]
        elif arg.startswith(tuple(f"{name}=" for name in _FLAGFILE)):
            path = arg.split("=", 1)[1]
        else:
            continue
        if not path.strip():  # absl read no file and said nothing: the run took the defaults
            raise _empty("flagfile", path)
        path = os.path.expanduser(path)
        if path in seen:  # absl warns of a cycle and goes on
            continue
        read[0] += 1
        if read[0] > MAX_FLAGFILES_READ:
            raise ConfigError(f"--flagfile={quoted(path)} is flagfile {read[0]:,} of this "
                              f"command, where at most {MAX_FLAGFILES_READ} are read (each "
                              f"counted every time it is named): nest fewer, or name each once")
        # A log or a data set given by mistake: absl took 6 s and 160 MB for a million
        # lines (2 cores of an AVX2-only AMD EPYC, Zen 3).
        size = os.path.getsize(path) if files.is_regular_file(path) else 0
        if size > MAX_FLAGFILE_BYTES:
            raise ConfigError(f"--flagfile={quoted(path)} holds {size:,} bytes, where a flagfile "
                              f"holds a few thousand (at most {MAX_FLAGFILE_BYTES:,} are read): "
                              f"is it the file you meant?")
        try:
            text = files.read_text(path, "--flagfile takes a text file of flags, one a line, "
                                         "in UTF-8")
        except files.DamagedFileError as e:
            raise ConfigError(str(e)) from None
        if text is None:  # a missing file is absl's to report
            continue
        if "\x00" in text:  # /proc/self/environ: not a flagfile
            raise ConfigError(f"--flagfile={quoted(path)} holds NUL bytes: a flagfile is a text "
                              f"file of flags, one a line")
        if text.startswith("\ufeff"):  # absl reads it as part of a flag
            raise ConfigError(f"--flagfile={quoted(path)} begins with a byte order mark (as some "
                              f"Windows editors save UTF-8): save it without one")
        lines = [line.strip() for line in text.splitlines()]
        for line in lines:
            kept = _kept_from_a_shell(line)
            if kept:  # training made a folder `"runs`, `a  # first try` or `a \`
                raise ConfigError(f"{quoted(line)} in --flagfile={quoted(path)} {kept[0]}, which "
                                  f"a flagfile keeps as part of the value (no shell reads it): "
                                  f"{kept[1]}")
        check_flagfiles(lines, (*seen, path), read)


def _kept_from_a_shell(line: str) -> Optional[Tuple[str, str]]:
    """What a flagfile's `line` holds that a shell would have taken away from
    its value (quotes around it, a comment or a line's continuation after
    it), and the fix."""
    flag, _, value = line.partition("=")
    if not (flag.startswith("-") and value):
        return None
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        return "is in quotes", "write it without them"
    if re.search(r"\s#", value):
        return "holds a comment", "put it on a line of its own, starting with #"
    if value.endswith("\\"):
        return "ends in a backslash", "end the line without one"
    return None


def _empty(name: str, value: str) -> ConfigError:
    # Not "leave it out": --model_dir is required.
    return ConfigError(f"--{name}={quoted(value)} is empty: give a path (an unset shell variable "
                       f"gives an empty value)")


# A name's bytes that the locale's encoding (ASCII under LC_ALL=C with
# PYTHONUTF8=0, or UTF-8 for a Latin-1 name) could not decode arrive as
# surrogates (os.fsdecode), which no UTF-8 encoder takes.
_SURROGATE = re.compile("[\ud800-\udfff]")
# `$NAME` or `${NAME}`: what a shell would have expanded.
_VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def check_path_flags(fv: flags.FlagValues, *names: str) -> None:
    """Raises ConfigError if a path flag `names` of `fv` is given empty (an
    unset shell variable: `--output=$OUT` wrote no file and said nothing) or
    holds a variable of the environment, as `$HOME/runs`: no shell expands a
    flagfile's lines (nor a quoted argument), and training made a folder
    named `$HOME` in the working directory. An unset name is taken as part
    of the path."""
    for name in names:
        value = fv[name].value or ""
        if fv[name].present and not value.strip():
            raise _empty(name, value)
        if _SURROGATE.search(value):  # TensorFlow's file system then raised with a traceback
            raise ConfigError(f"--{name}={quoted(value)} is not UTF-8 text, the only paths "
                              f"this program takes: set a UTF-8 locale (LC_ALL=C.UTF-8) or "
                              f"PYTHONUTF8=1 if the name is UTF-8, else rename it")
        if value and not os.path.isabs(os.path.expanduser(value)) and not working_directory():
            raise ConfigError(f"--{name}={quoted(value)} is relative to the working directory, "
                              f"which was deleted: cd to one that exists, or give a full path")
        if value == "-":  # elsewhere standard output or input; here it made a file named -
            raise ConfigError(f"--{name}=- would be a file or folder named '-' (this program "
                              f"writes and reads no standard stream there): give a path, ./- for "
                              f"that name")
        for match in _VARIABLE.finditer(value):
            variable = match.group(1) or match.group(2)
            if variable != "_" and variable in os.environ:  # $_: what a shell sets for itself
                raise ConfigError(f"--{name}={quoted(value)} holds {match.group()}, which no "
                                  f"shell expanded (in a flagfile, or quoted): write the path out")


def parse(program: str, fv: flags.FlagValues, argv: List[str],
          positionals: bool = False) -> List[str]:
    """Parses `argv` (without the program name) into `fv`; returns the
    positional arguments, which only a program that takes them (`positionals`)
    may be given. Raises ConfigError with one line (absl's, or ours)."""
    check_flagfiles(argv)
    try:
        rest = fv([program, *argv])[1:]
    except (flags.Error, ValueError) as e:  # ValueError: `--nodownload=1`
        # quoted: absl echoes what it was given (a --flagfile of
        # /proc/self/environ: the environment), control characters and all.
        said = quoted(first_line(e, limit=10_000).removeprefix("ERROR:: "))
        # absl's BooleanParser raises ValueError(message, value), shown as a tuple.
        said = _NOT_BOOLEAN.sub(r"\1 is neither true nor false", said)
        # A file named -photo.png reads as a flag, which absl names without its dash.
        files_like_flags = [a for a in argv if positionals and a.startswith("-")
                            and not a.startswith("--") and os.path.lexists(a)]
        if files_like_flags:
            said += (f" (for the file {quoted(files_like_flags[0])}, give "
                     f"{quoted('./' + files_like_flags[0])}, or put -- before the files)")
        raise ConfigError(said) from None
    if rest and not positionals:
        raise ConfigError(f"unexpected argument(s) {quoted(' '.join(rest))}: all options are "
                          f"--flags")
    return rest


def run_main(doc: str, fv: flags.FlagValues, body: Callable[[flags.FlagValues, List[str]], int],
             argv: Optional[List[str]] = None, on_interrupt: Optional[str] = None) -> int:
    """An entry point's `main`: with a help flag in `argv` (None: the command
    line's), `doc` and the flags of `fv`; else `body(fv, argv)` as `guarded` runs it."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        return show_help(doc, fv)
    return guarded(lambda: body(fv, argv), on_interrupt)


def guarded(main: Callable[[], int], on_interrupt: Optional[str] = None) -> int:
    """`main()`'s exit code; a UserError it raises becomes one `error:`
    line on stderr and that error's exit code. With `on_interrupt` (what a
    stop leaves behind, e.g. "nothing written"), Ctrl-C or a stop signal
    raised as one ends it with one line saying so and what it left: ABORTED
    for Ctrl-C, PREEMPTED for SIGTERM and the other stop signals."""
    libraries_warnings_stay_warnings()
    # Every stop signal then raises as Ctrl-C does, caught below: SIGTERM and
    # SIGHUP had their default, and ended predict without a word (and SIGHUP
    # with 129, where a stop is documented as 143).
    # Only the main thread may set handlers (a library caller's thread keeps its own).
    owns_signals = threading.current_thread() is threading.main_thread()
    stops = (stopping.stops_interrupting() if on_interrupt is not None and owns_signals
             else contextlib.nullcontext())
    try:
        with stops:
            return main()
    except UserError as e:
        stopping.say_decided_error(e)
        return e.exit_code
    except KeyboardInterrupt as e:
        if on_interrupt is None:
            raise
        return interrupted(e, on_interrupt)


def interrupted(stop: KeyboardInterrupt, left: str) -> int:
    """One line saying the run was stopped and what it `left`; the exit code
    of the stop: ABORTED for Ctrl-C, PREEMPTED for SIGTERM and the others."""
    print(f"interrupted: {left}", file=sys.stderr, flush=True)
    # stopping.stops_interrupting raises SIGTERM and the other stop signals as Terminated.
    return ExitCode.PREEMPTED if isinstance(stop, stopping.Terminated) else ExitCode.ABORTED


# The libraries' own warnings, which neither the user nor the package can fix:
# Keras 3.15 writes a .keras file (and reads a variable) through
# np.array(tensor), of which NumPy 2 warns (see tests/pytest.ini).
_LIBRARIES = r"(keras|tensorflow|tf_keras|numpy|absl|google|h5py|ml_dtypes|optree|PIL)(\.|$)"


def libraries_warnings_stay_warnings() -> None:
    """Where PYTHONWARNINGS=error (or -W error, or a filter of its own) makes
    warnings exceptions, those that the libraries' code raises are shown
    instead: they failed a run after its training, at the export, with a
    traceback. A run's own code, and a user's model, still fail on theirs.
    Placed before the first filter that makes them errors, not first: a
    user's own filter before it (PYTHONWARNINGS=error,ignore::Deprecation...
    puts `ignore` first) still decides."""
    actions = [action for action, *_ in warnings.filters]
    if "error" in actions:
        warnings.filterwarnings("default", module=_LIBRARIES)  # goes first: moved
        warnings.filters.insert(actions.index("error"), warnings.filters.pop(0))


def console_script(main: Callable[[], int], exit_at_once: bool = True) -> None:
    """Runs an entry point's `main()` as a console script: with a console
    that may go away, and (`exit_at_once`) without TensorFlow's teardown
    once every output is written (stopping.exit_now)."""
    from distributed_mpt.process import console

    code = console.run_with_console(main)
    if exit_at_once:
        stopping.exit_now(code)
    sys.exit(code)
