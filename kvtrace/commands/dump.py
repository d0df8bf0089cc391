"""``kvtrace dump DIR``: keep the segments a flight recorder holds now."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_OK, UsageProblem, echo


@click.command()
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
def command(folder: Path) -> int:
    """Ask the recorder writing the segment directory FOLDER ('kvtrace record
    --ring', or a vLLM engine's writer process under KVTRACE_RING) to pin the
    segment under way, the one before it and the next one: they are never
    deleted. It pins them at its next record, or at once while it idles, and
    says so."""
    from kvtrace.record.folder import NoRecorder, ask_pin

    try:
        pid = ask_pin(folder)
    except NoRecorder as e:
        raise UsageProblem(str(e)) from None
    except PermissionError:
        raise UsageProblem(f"{folder}: its recorder is another user's") from None
    echo(f"asked the recorder (pid {pid}) to pin its segments in {folder}")
    return EXIT_OK
