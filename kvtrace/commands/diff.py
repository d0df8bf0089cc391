"""``kvtrace diff A B``: compare two traces request by request."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_DIVERGENT, EXIT_NOTHING, EXIT_OK, FilePath, echo, print_bytes, say
from .progress import progress
from .replay import Selection

MAX_SHOWN = 50   # diverging requests shown unless --max says


@click.command()
@click.argument("a", type=FilePath(stdin=True, dir_okay=True))
@click.argument("b", type=FilePath(stdin=True, dir_okay=True), required=False)
@click.argument("more", nargs=-1, type=FilePath(dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--match", type=click.Choice(("auto", "id", "id-prefix", "arrival", "handoff")),
              default="auto", show_default=True,
              help="Pair requests by id, by id without vLLM's random suffix, by order of "
                   "arrival, or (handoff) each decode-side request with the prefill-side "
                   "request its kv_transfer_params name. auto: handoff for a KV producer's "
                   "trace and a KV consumer's, else what most of the first 1000 arrivals "
                   "share.")
@click.option("--request", "requests", multiple=True, metavar="ID",
              help="Show only this request's divergence (repeatable). The exit code still "
                   "counts every divergence.")
@click.option("--field", "fields", multiple=True, metavar="NAME",
              help="Show only divergences of this field, e.g. num_computed_tokens (repeatable; "
                   "'state.' matches every field that starts so).")
@click.option("--first", "first_only", is_flag=True,
              help="Show only the first diverging request.")
@click.option("--max", "max_shown", type=click.IntRange(min=1), default=MAX_SHOWN,
              show_default=True, metavar="N", help="Show at most N diverging requests.")
def command(a: Path, b: Path | None, more: tuple[Path, ...], as_json: bool, match: str,
            requests: tuple[str, ...], fields: tuple[str, ...], first_only: bool,
            max_shown: int) -> int:
    """Compare trace A with trace B, request by request.

    Requests are aligned by id and by their own scheduling history, so traces
    whose global step numbering differs still line up. Values from A are shown
    as "recorded", values from B as "expected". Exit 0 when they agree, 1 when
    they differ, 2 when a file is unusable (or, with --match handoff, the two
    cannot be a prefill side and a decode side), 4 when no request was
    compared.

    The two sides of a disaggregated deployment (a prefill engine's trace and a
    decode engine's) are paired by handoff instead: each decode request with
    the prefill request it reads, checked for the same prompt, the blocks kept
    and sent, and the tokens loaded. More than two traces, or directories of
    them (a fleet of prefill and decode engines; one directory may hold them
    all), are paired so across all of them, each finding named with its two
    traces.
    """
    from kvtrace.diff import diff_files
    from kvtrace.report import terminal

    select = Selection(requests, fields, 1 if first_only else max_shown)
    if more or a.is_dir() or b is None or b.is_dir():
        from .handoffs import diff_fleet

        return diff_fleet([a, *([b] if b else []), *more], match, as_json, select)
    with progress(f"diffing {a.name} with {b.name}", "steps", files=(a, b)) as advance:
        result = diff_files(a, b, match=match, progress=advance)
    divs = list(result.divergences)
    kept = [d for d in divs if select.keep(d)] if select else divs
    if as_json:
        doc = result.to_json()
        if select:
            doc["divergences"] = [d.to_json() for d in kept]
            doc["selection"] = select.words()
        print_bytes(terminal.dumps(doc))
    else:
        # The divergences shown; the counts and the exit code are the whole diff's.
        shown = result if kept is divs else _with(result, kept)
        terminal.print_diff(shown, max_rows=select.max_requests)
        if select:
            note = f"shown: {len(kept)} of {len(divs)} divergences ({select.words()})"
            first = next((d for d in divs if d.req is not None), None)
            if first is not None and (not kept or kept[0] is not first):
                note += (f"; the diff's first: step {first.step}, {first.req}, field "
                         f"{first.field}")
            echo(note)
    return _exit_code(result, a, b)


def _exit_code(result, a: Path, b: Path) -> int:
    """1 for divergences, 4 (said on stderr) when nothing was compared, else 0."""
    if result.divergences:
        return EXIT_DIVERGENT
    if not result.requests_compared:
        from kvtrace.trace.files import shown

        what = "handoffs" if result.matched_by == "handoff" else "requests"
        say(f"nothing compared: no {what} of {shown(a)} and {shown(b)} pair up" + (
            " (no decode-side request names a request of the prefill side in its "
            "kv_transfer_params' remote_request_id)" if result.matched_by == "handoff" else ""))
        return EXIT_NOTHING
    return EXIT_OK


def _with(result, divergences: list):
    """The diff's result showing only ``divergences``."""
    from dataclasses import replace

    return replace(result, divergences=divergences)
