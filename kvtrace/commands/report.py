"""``kvtrace report``, ``kvtrace export`` and ``kvtrace show``: pictures of a trace."""

from __future__ import annotations

from pathlib import Path

import click

from kvtrace.outputs import check_writable

from ._common import (EXIT_DIVERGENT, EXIT_OK, READS_TWICE, FilePath, echo, refuse_pipes,
                      refuse_to_overwrite, say)
from .progress import progress


@click.command()
@click.argument("trace", type=FilePath(no_dash=READS_TWICE))
@click.option("-o", "--out", "out", required=True, type=FilePath(),
              help="The HTML file to write (self-contained; opens with no network).")
@click.option("--against", type=FilePath(no_dash=READS_TWICE), default=None,
              help="Show the divergences of a diff with this trace instead of a replay, "
                   "and draw both traces on one step axis.")
def report(trace: Path, out: Path, against: Path | None) -> int:
    """Write an HTML report of TRACE: the first divergence, run summary, KV
    usage, per-request timelines and the divergences of a replay (or of a diff
    with --against), folded per request.

    Exit 0 when there is no divergence, 1 when there are, 2 for unusable input.
    """
    from kvtrace.report.html import write_html_report

    refuse_to_overwrite(out, trace, against)
    refuse_pipes(trace, against)

    with progress(f"reporting {trace.name}", "steps", files=(trace, trace, against)):
        divs, told, source, note = analysis(trace, against)
        rep = write_html_report(trace, out, divs, stories=told, source=source, against=against,
                                note=note)
    echo(f"wrote {out}" + (f" ({rep.note})" if rep.note else ""))
    return EXIT_DIVERGENT if rep.divergences else EXIT_OK


def analysis(trace: Path, against: Path | None) -> tuple[list, list, str, str | None]:
    """What a report shows: the divergences of a diff with ``against``, or of a
    replay; the same told per request (``kvtrace.findings.stories``); where
    they come from; and, for a trace replay refuses, why there are none."""
    from kvtrace.findings import stories
    from kvtrace.trace import TraceError

    if against is not None:
        from kvtrace.diff import diff_files

        divs = list(diff_files(trace, against).divergences)
        return divs, stories(divs), "diff", None
    from kvtrace.replay import replay_file

    try:
        divs = list(replay_file(trace).divergences)
    except TraceError as e:
        return [], [], "replay", f"not replayed: {e}"
    return divs, stories(divs), "replay", None


@click.command()
@click.argument("trace", type=FilePath(no_dash=READS_TWICE))
@click.option("--format", "fmt", type=click.Choice(("perfetto", "parquet", "arrow")),
              default="perfetto", show_default=True,
              help="perfetto: Chrome trace-event JSON, which the Perfetto UI opens. parquet: "
                   "a directory of Parquet tables (steps, request_steps, ...) for pandas, "
                   "polars or DuckDB; arrow: the same as Arrow IPC files. Both need pyarrow.")
@click.option("-o", "--out", "out", required=True, type=click.Path(),
              help="The file to write (perfetto), or the new directory (parquet, arrow).")
@click.option("--divergences/--no-divergences", default=True, show_default=True,
              help="Replay TRACE and add its divergences (instant events, or a table).")
def export(trace: Path, fmt: str, out: str, divergences: bool) -> int:
    """Export TRACE for a timeline viewer (a track per request: waiting, prefill
    chunks, decode, preempted, loading KV; counters for free blocks and
    scheduled tokens; divergences as instant events), or as tables that join
    on step and request (docs/guide/export.md)."""
    if not out:
        raise click.BadParameter("an empty file name", param_hint="'-o' / '--out'")
    out = Path(out)
    tables = fmt != "perfetto"
    if tables:
        from kvtrace.report.table_files import check_out_dir, require_pyarrow

        require_pyarrow(fmt)
    elif out.is_dir():
        raise click.BadParameter(f"File {str(out)!r} is a directory.", param_hint="'-o' / '--out'")

    refuse_to_overwrite(out, trace)
    if tables:
        check_out_dir(out)
    check_writable(out)   # before the replay, which can take minutes

    divs = None
    if divergences:
        refuse_pipes(trace)
        from kvtrace.replay import replay_file

        with progress(f"replaying {trace.name}", "steps", files=(trace,)) as advance:
            divs = replay_file(trace, progress=advance).divergences
    if not tables:
        from kvtrace.report.perfetto import TIME_AXIS, export_perfetto

        from ._common import show_progress

        with progress(f"exporting {trace.name}", "steps", files=(trace,)):
            export_perfetto(trace, out, divergences=divs)
        if show_progress():   # a person at a terminal; the file's metadata says it too
            say(TIME_AXIS)
        echo(f"wrote {out}")
        return EXIT_OK
    from kvtrace.report.table_files import write_tables
    from kvtrace.report.terminal import replayed_up_to

    with progress(f"exporting {trace.name}", "steps", files=(trace,)) as advance:
        done = write_tables(trace, out, divs, fmt=fmt, progress=advance)
    if done.truncation:
        say(f"{trace}: {replayed_up_to(done.truncation, verb='exported')}")
    echo(f"wrote {out}: {len(done.rows)} tables, {sum(done.rows.values()):,} rows")
    return EXIT_OK


@click.command()
@click.argument("trace", type=FilePath(stdin=True))
@click.option("--request", "request", default=None, metavar="ID",
              help="Show one request's history (an id, or a prefix matching one request); "
                   "with --step, that request at the step.")
@click.option("--step", "step", type=click.IntRange(min=0), default=None, metavar="N",
              help="Show step N: the batch, the queues, the free blocks, each live request's "
                   "block table, and the divergences a replay finds at that step.")
@click.option("--kv-check/--no-kv-check", default=True, show_default=True,
              help="With --step: the replay checks what every KV slot holds (as replay does).")
def show(trace: Path, request: str | None, step: int | None, kv_check: bool) -> int:
    """Show TRACE's run summary, one request's history, or one step, in the terminal.

    Exit 0, or 2 for an unusable trace, a request that names no request or
    several, or a step past the end of the trace.
    """
    if step is None:
        from kvtrace.report.show import show as show_trace

        with progress(f"reading {trace.name}", "steps", files=(trace,)):
            show_trace(trace, request=request)
        return EXIT_OK
    refuse_pipes(trace)   # read up to the step, then replayed
    from kvtrace.replay import replay_file
    from kvtrace.report.at_step import read_step
    from kvtrace.report.show import show_step
    from kvtrace.trace import TraceError

    with progress(f"reading up to step {step}: {trace.name}", "steps", files=(trace,)):
        view = read_step(trace, step, request)
    note = None
    with progress(f"replaying {trace.name}", "steps", files=(trace,)) as advance:
        try:
            divs = replay_file(trace, device="auto" if kv_check else None,
                               progress=advance).divergences
        except TraceError as e:   # a feature the reference does not model, or a bad later record
            divs, note = [], f"not replayed: {e}"
    show_step(view, divs, note=note)
    return EXIT_OK
