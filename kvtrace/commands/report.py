"""``kvtrace report``, ``kvtrace export`` and ``kvtrace show``: pictures of a trace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvtrace.writing import check_writable

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

    Exit 0 when there is no divergence, 1 when there are or replay stopped
    before the trace's end, 2 for unusable input.
    """
    from kvtrace.report.html import write_html_report

    refuse_to_overwrite(out, trace, against)
    refuse_pipes(trace, against)
    check_writable(out)   # before the replay or diff, which can take minutes

    with progress(f"reporting {trace.name}", "steps", files=(trace, trace, against)):
        found = analysis(trace, against)
        rep = write_html_report(trace, out, found.divergences, findings=found.findings,
                                source=found.source, against=against, note=found.note,
                                stop=found.stop, steps_checked=found.steps_checked,
                                unchecked=found.unchecked)
    echo(f"wrote {out}" + (f" ({rep.note})" if rep.note else "")
         + (f"; {found.stop}" if found.stop else ""))
    return EXIT_DIVERGENT if rep.divergences or found.stop else EXIT_OK


@dataclass
class Analysis:
    """What a report shows: the divergences of a diff or a replay; the same
    findings per request, with the one to read first (``kvtrace.findings.gather``);
    where they come from; for a trace replay refuses, why there are none
    (``note``); where replay stopped before the trace's end (``stop``), and
    the steps it checked then (``steps_checked``), in the terminal's words."""

    divergences: list
    findings: Any
    source: str
    note: str | None = None
    stop: str | None = None
    steps_checked: str | None = None
    unchecked: str | None = None   # what replay did not check, in words


def analysis(trace: Path, against: Path | None) -> Analysis:
    """The divergences of a diff with ``against``, or of a replay, findings."""
    from kvtrace.findings import gather
    from kvtrace.report.failures import steps_text, stop_text, unchecked_text
    from kvtrace.trace import TraceError

    if against is not None:
        from kvtrace.diff import diff_files

        divs = list(diff_files(trace, against).divergences)
        return Analysis(divs, gather(divs), "diff")
    from kvtrace.replay import replay_file

    try:
        result = replay_file(trace)
    except TraceError as e:
        return Analysis([], gather([]), "replay", f"not replayed: {e}")
    divs = list(result.divergences)
    stop = stop_text(result)
    return Analysis(divs, gather(divs), "replay", stop=stop,
                    steps_checked=steps_text(result) if stop else None,
                    unchecked=unchecked_text(result))


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

    divs = checked = None
    if divergences:
        refuse_pipes(trace)
        from kvtrace.replay import replay_file

        from kvtrace.report.failures import stop_text

        with progress(f"replaying {trace.name}", "steps", files=(trace,)) as advance:
            result = replay_file(trace, progress=advance)
        divs = result.divergences
        checked = {"steps_checked": result.steps, "steps_in_trace": result.steps_in_trace,
                   "stopped_at": None if result.stopped_at is None else result.stopped_at.to_json()}
        if result.stopped_at is not None:   # the divergences end there: say so
            say(f"{trace}: {stop_text(result)}")
    if not tables:
        from kvtrace.report.perfetto import TIME_AXIS, export_perfetto

        from ._common import show_progress

        with progress(f"exporting {trace.name}", "steps", files=(trace,)):
            export_perfetto(trace, out, divergences=divs, checked=checked)
        if show_progress():   # a person at a terminal; the file's metadata says it too
            say(TIME_AXIS)
        echo(f"wrote {out}")
        return EXIT_OK
    from kvtrace.report.table_files import write_tables
    from kvtrace.report.terminal import replayed_up_to

    with progress(f"exporting {trace.name}", "steps", files=(trace,)) as advance:
        done = write_tables(trace, out, divs, fmt=fmt, progress=advance, checked=checked)
    if done.truncation:
        say(f"{trace}: {replayed_up_to(done.truncation, verb='exported')}")
    from kvtrace._text import count

    echo(f"wrote {out}: {count(len(done.rows), 'table')}, {count(sum(done.rows.values()), 'row')}")
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
              help="With --step or --request: the replay checks what every KV slot holds "
                   "(as replay does).")
def show(trace: Path, request: str | None, step: int | None, kv_check: bool) -> int:
    """Show TRACE's run summary, one request's history, or one step, in the terminal.

    With --request or --step, TRACE is replayed and the divergences found are
    marked where they show. Exit 0, or 2 for an unusable trace, a request that
    names no request or several, or a step past the end of the trace.
    """
    if step is None and request is None:
        from kvtrace.report.show import show as show_trace

        with progress(f"reading {trace.name}", "steps", files=(trace,)):
            show_trace(trace)
        return EXIT_OK
    if step is None:
        from kvtrace.report.show import print_request, print_summary, read_request
        from kvtrace.report.terminal import make_console
        from kvtrace.trace.io import not_regular

        with progress(f"reading {trace.name}", "steps", files=(trace,)):
            s, tl = read_request(trace, request)
        if not_regular(trace):   # a pipe is read once: no replay
            divs, note = None, ("not replayed: the trace came through a pipe, which is read "
                                "once; save it to a file to see them marked")
        else:
            divs, note = _replayed(trace, kv_check)
        console = make_console()
        print_summary(s, console, brief=True)
        print_request(s, tl, console, divergences=divs, note=note)
        return EXIT_OK
    refuse_pipes(trace)   # read up to the step, then replayed
    from kvtrace.report.at_step import read_step
    from kvtrace.report.show import show_step

    with progress(f"reading up to step {step}: {trace.name}", "steps", files=(trace,)):
        view = read_step(trace, step, request)
    divs, note = _replayed(trace, kv_check, until=step)
    show_step(view, divs, note=note)
    return EXIT_OK


def _replayed(trace: Path, kv_check: bool, until: int | None = None
              ) -> tuple[list | None, str | None]:
    """The divergences of a replay of ``trace``, or None and why: a trace
    replay refuses (a feature the reference does not model, a bad later record),
    or a replay that stopped before step ``until`` (before the trace's end when
    None): never "none" for a step not checked."""
    from kvtrace.replay import replay_file
    from kvtrace.report.failures import stop_text
    from kvtrace.trace import TraceError

    with progress(f"replaying {trace.name}", "steps", files=(trace,)) as advance:
        try:
            result = replay_file(trace, device="auto" if kv_check else None, progress=advance)
        except TraceError as e:
            return None, f"not replayed: {e}"
    stop = result.stopped_at
    if stop is not None and (until is None or until > stop.step):
        said = stop_text(result)
        return result.divergences, (said if until is None else f"not replayed: {said}")
    return result.divergences, None
