"""``kvtrace diff A B``: compare two traces request by request."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_DIVERGENT, EXIT_OK, FilePath, print_bytes
from .progress import progress


@click.command()
@click.argument("a", type=FilePath(stdin=True))
@click.argument("b", type=FilePath(stdin=True))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--match", type=click.Choice(("auto", "id", "id-prefix", "arrival", "handoff")),
              default="auto", show_default=True,
              help="Pair requests by id, by id without vLLM's random suffix, by order of "
                   "arrival, or (handoff) each decode-side request with the prefill-side "
                   "request its kv_transfer_params name. auto: handoff for a KV producer's "
                   "trace and a KV consumer's, else what most of the first 1000 arrivals "
                   "share.")
def command(a: Path, b: Path, as_json: bool, match: str) -> int:
    """Compare trace A with trace B, request by request.

    Requests are aligned by id and by their own scheduling history, so traces
    whose global step numbering differs still line up. Values from A are shown
    as "recorded", values from B as "expected". Exit 0 when they agree, 1 when
    they differ, 2 when a file is unusable.

    The two sides of a disaggregated deployment (a prefill engine's trace and a
    decode engine's) are paired by handoff instead: each decode request with
    the prefill request it reads, checked for the same prompt, the blocks kept
    and sent, and the tokens loaded.
    """
    from kvtrace.diff import diff_files
    from kvtrace.report import terminal

    with progress(f"diffing {a.name} with {b.name}", "steps", files=(a, b)) as advance:
        result = diff_files(a, b, match=match, progress=advance)
    if as_json:
        print_bytes(terminal.diff_json(result))
    else:
        terminal.print_diff(result)
    return EXIT_DIVERGENT if result.divergences else EXIT_OK
