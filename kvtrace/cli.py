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
import sys
import traceback

import click

from kvtrace.commands import COMMANDS
from kvtrace.commands._common import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, quiet_stdout, say
from kvtrace.outputs import WRITE_ERRORS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtrace", prog_name="kvtrace")
def cli() -> None:
    """Record, replay and diff the KV-cache scheduling decisions of vLLM V1."""


for _name, _command in COMMANDS.items():
    cli.add_command(_command, _name)


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Never shows a traceback unless KVTRACE_DEBUG=1."""
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
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    debug = os.environ.get("KVTRACE_DEBUG", "") not in ("", "0")
    if sys.stdout is None:   # the shell closed it (>&-): the report would be lost
        say("standard output is closed: nowhere to write the report")
        return EXIT_BAD_INPUT
    try:
        rv = cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
        return rv if isinstance(rv, int) else EXIT_OK
    except click.exceptions.Exit as e:
        return e.exit_code
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


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


if __name__ == "__main__":
    main()
