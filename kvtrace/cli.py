"""The ``kvtrace`` command: parse arguments, call one function, turn errors into exit codes.

Exit codes: 0 no divergence (or a successful recording), 1 divergences (or a
recorded engine that failed), 2 unusable
input or bad usage, 3 an internal error (KVTRACE_DEBUG=1 prints its traceback).
Engines, recorders and the replayer are imported only by the command that needs
them, so ``kvtrace diff`` never loads torch or vLLM.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback

import click

from kvtrace.commands import COMMANDS
from kvtrace.commands._common import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, quiet_stdout, say
from kvtrace.writing import WRITE_ERRORS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtrace", prog_name="kvtrace")
def cli() -> None:
    """Record, replay and diff the KV-cache scheduling decisions of vLLM V1."""


for _name, _command in COMMANDS.items():
    cli.add_command(_command, _name)


class Stopped(BaseException):
    """SIGTERM or SIGHUP, raised where the program is, as Ctrl-C raises
    KeyboardInterrupt, so that the command unwinds the same way: its output put
    in place (a replayed trace ending ``interrupted``) or thrown away, its worker
    processes stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)   # "SIGTERM"
        self.signum = signum


# After the first signal, more within this many seconds (a second Ctrl-C) are
# ignored: they would break off the unwinding the first one started.
UNWIND_GRACE_S = 2.0


_last_signal = [float("-inf")]   # when the first signal came


def _unwind_on_signals() -> None:
    last = _last_signal

    def handler(signum, frame):
        now = time.monotonic()
        if now - last[0] < UNWIND_GRACE_S:
            return
        last[0] = now
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:   # nohup, a background job
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Never shows a traceback unless KVTRACE_DEBUG=1."""
    _unwind_on_signals()
    for stream in (sys.stdout, sys.stderr):   # a terminal that is not UTF-8 gets escapes
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    code = run(argv)
    try:   # here, not at exit, where Python would only complain about it
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
    except OSError as e:
        say(f"standard output: {e.strerror or e}")
        code = EXIT_BAD_INPUT
    except (AttributeError, ValueError):   # closed
        pass
    if _last_signal[0] > float("-inf"):
        # Unwound after a signal: everything is written and stopped. Python's
        # own exit would first give the signals their default action back, and
        # a second Ctrl-C then would kill the process and lose the exit code.
        os._exit(code)
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    debug = os.environ.get("KVTRACE_DEBUG", "") not in ("", "0")
    if sys.stdout is None:   # the shell closed it (>&-): the report would be lost
        say("standard output is closed: nowhere to write the report")
        return EXIT_BAD_INPUT
    try:
        # Not cli.main: on Ctrl-C it prints a blank line of its own first.
        with cli.make_context("kvtrace", list(sys.argv[1:] if argv is None else argv)) as ctx:
            rv = cli.invoke(ctx)
        return rv if isinstance(rv, int) else EXIT_OK
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.NoArgsIsHelpError as e:   # bare ``kvtrace``: the help, as -h gives it
        click.echo(e.ctx.get_help())
        return EXIT_OK
    except click.ClickException as e:  # usage errors: click's message on one line, exit 2
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        say(_one_line(e.format_message()) + hint)
        return e.exit_code
    except click.exceptions.Abort:
        say("interrupted")
        return 130
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Stopped as e:
        say(f"stopped by {e}")
        return 128 + e.signum
    except BrokenPipeError:
        quiet_stdout()
        return EXIT_OK
    except OSError as e:
        if e.filename is None and e.errno in WRITE_ERRORS:
            # The machine's, not kvtrace's: a full disk under no file of ours
            # (the files kvtrace writes, standard output included, name themselves).
            if debug:
                traceback.print_exc()
            say(f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})")
            return EXIT_BAD_INPUT
        if e.filename is None:
            return _internal(e, debug)
        # A file named on the command line that cannot be read or written.
        if debug:
            traceback.print_exc()
        say(f"{e.filename}: {e.strerror or _one_line(str(e))}")
        return EXIT_BAD_INPUT
    except Exception as e:
        return _internal(e, debug)


def _internal(e: Exception, debug: bool) -> int:
    """An error with its own exit code (a trace that cannot be used, arguments
    that do not fit), else an internal error."""
    if debug:
        traceback.print_exc()
    code = getattr(e, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        say(_one_line(str(e)) or type(e).__name__)
        return code
    hint = "" if debug else " (set KVTRACE_DEBUG=1 for the traceback)"
    say(f"internal error: {type(e).__name__}: {_one_line(str(e))}{hint}")
    return EXIT_INTERNAL


# The longest error line: one that quotes a value of a trace (a request id may
# be megabytes long) keeps its start and its end.
MAX_MESSAGE = 1000


def _one_line(msg: str) -> str:
    text = " ".join(msg.split())
    if len(text) <= MAX_MESSAGE:
        return text
    return (f"{text[:MAX_MESSAGE - 300]} … ({len(text) - MAX_MESSAGE + 100:,} characters left "
            f"out) … {text[-200:]}")


if __name__ == "__main__":
    main()
