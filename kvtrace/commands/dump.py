"""``kvtrace dump DIR``: keep the segments a flight recorder holds now."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ._common import EXIT_OK, UsageProblem, echo


@click.command()
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
def command(folder: Path) -> int:
    """Ask the recorder writing the segment directory FOLDER ('kvtrace record
    --ring') to pin the segment under way, the one before it and the next one:
    they are never deleted. It pins them at its next step and says so."""
    from kvtrace.flight.segments import DUMP_SIGNAL, PID

    try:
        text = (folder / PID).read_bytes()[:64].decode("ascii", "replace").strip()
    except OSError:
        raise UsageProblem(f"{folder}: no recorder is writing here (no {PID})") from None
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 2 ** 22):
        raise UsageProblem(f"{folder / PID}: not a process id: {text[:40]!r}")
    pid = int(text)
    if not _records_here(pid):
        raise UsageProblem(f"{folder}: process {pid} is not a kvtrace recorder (a recorder "
                           f"killed leaves {PID} behind)")
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        raise UsageProblem(f"{folder}: its recorder (pid {pid}) has ended") from None
    except PermissionError:
        raise UsageProblem(f"{folder}: its recorder (pid {pid}) is another user's") from None
    echo(f"asked the recorder (pid {pid}) to pin its segments in {folder}")
    return EXIT_OK


def _records_here(pid: int) -> bool:
    """Whether process ``pid`` runs kvtrace (its command line names it):
    never signal a process that took a dead recorder's pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kvtrace" in f.read()
    except FileNotFoundError:
        return False
    except OSError:   # no /proc here: the pid file is all there is
        return True
