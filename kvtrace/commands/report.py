"""``kvtrace report``, ``kvtrace export`` and ``kvtrace show``: pictures of a trace."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_DIVERGENT, EXIT_OK, FilePath, echo, refuse_pipes, refuse_to_overwrite
from .progress import progress


@click.command()
@click.argument("trace", type=FilePath())
@click.option("-o", "--out", "out", required=True, type=FilePath(),
              help="The HTML file to write (self-contained; opens with no network).")
@click.option("--against", type=FilePath(), default=None,
              help="Show the divergences of a diff with this trace instead of a replay.")
def report(trace: Path, out: Path, against: Path | None) -> int:
    """Write an HTML report of TRACE: run summary, KV usage, per-request
    timelines and the divergences of a replay (or of a diff with --against).

    Exit 0 when there is no divergence, 1 when there are, 2 for unusable input.
    """
    from kvtrace.report.html import write_html_report

    refuse_to_overwrite(out, trace, against)
    refuse_pipes(trace, against)

    with progress(f"reporting {trace.name}", "steps"):
        divs, source, note = analysis(trace, against)
        rep = write_html_report(trace, out, divs, source=source, against=against, note=note)
    echo(f"wrote {out}" + (f" ({rep.note})" if rep.note else ""))
    return EXIT_DIVERGENT if rep.divergences else EXIT_OK


def analysis(trace: Path, against: Path | None) -> tuple[list, str, str | None]:
    """What a report shows: the divergences of a diff with ``against``, or of a
    replay; where they come from; and, for a trace replay refuses, why there
    are none."""
    from kvtrace.trace import TraceError

    if against is not None:
        from kvtrace.diff import diff_files

        return list(diff_files(trace, against).divergences), "diff", None
    from kvtrace.replay import replay_file

    try:
        return list(replay_file(trace).divergences), "replay", None
    except TraceError as e:
        return [], "replay", f"not replayed: {e}"


@click.command()
@click.argument("trace", type=FilePath())
@click.option("--format", "fmt", type=click.Choice(("perfetto",)), default="perfetto",
              show_default=True, help="Chrome trace-event JSON, which the Perfetto UI opens.")
@click.option("-o", "--out", "out", required=True, type=FilePath())
@click.option("--divergences/--no-divergences", default=True, show_default=True,
              help="Replay TRACE and mark its divergences as instant events.")
def export(trace: Path, fmt: str, out: Path, divergences: bool) -> int:
    """Export TRACE for a timeline viewer: a track per request (waiting, prefill
    chunks, decode, preempted, loading KV), counters for free blocks and
    scheduled tokens, and divergences as instant events."""
    from kvtrace.report.perfetto import export_perfetto

    refuse_to_overwrite(out, trace)

    divs = None
    if divergences:
        refuse_pipes(trace)
        from kvtrace.replay import replay_file

        with progress(f"replaying {trace.name}", "steps") as advance:
            divs = replay_file(trace, progress=advance).divergences
    export_perfetto(trace, out, divergences=divs)
    echo(f"wrote {out}")
    return EXIT_OK


@click.command()
@click.argument("trace", type=FilePath())
@click.option("--request", "request", default=None, metavar="ID",
              help="Show one request's history (an id, or a prefix matching one request).")
def show(trace: Path, request: str | None) -> int:
    """Show TRACE's run summary, or one request's history, in the terminal."""
    from kvtrace.report.show import show as show_trace

    show_trace(trace, request=request)
    return EXIT_OK
