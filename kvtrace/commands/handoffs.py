"""``kvtrace diff --match handoff`` of more than two traces, or of directories
of them: the handoffs of a fleet of prefill and decode engines
(kvtrace/diff/handoffs.py), one report."""

from __future__ import annotations

from pathlib import Path

from ._common import EXIT_DIVERGENT, EXIT_NOTHING, EXIT_OK, UsageProblem, print_bytes, say
from .progress import progress

ENDINGS = (".jsonl.gz", ".jsonl.zst", ".jsonl")


def traces_named(paths: list[Path]) -> list[Path]:
    """``paths`` with each directory replaced by the traces it holds (its
    files named ``*.jsonl``, ``*.jsonl.gz`` or ``*.jsonl.zst``, in name order)."""
    out: list[Path] = []
    for p in paths:
        if str(p) == "-":
            raise UsageProblem("'-' (standard input) is read alone; a fleet's handoffs are "
                               "diffed from files")
        if not p.is_dir():
            out.append(p)
            continue
        found = sorted(q for q in p.iterdir() if q.name.endswith(ENDINGS)
                       and not q.name.startswith(".") and q.is_file())
        if not found:
            raise UsageProblem(f"{p} is a directory that holds no trace (no *.jsonl, "
                               "*.jsonl.gz or *.jsonl.zst)")
        out += found
    return out


def diff_fleet(paths: list[Path], match: str, as_json: bool, select) -> int:
    """Diff the handoffs of every trace ``paths`` name; print; return the exit code."""
    from kvtrace.diff.handoffs import diff_handoffs
    from kvtrace.report.handoffs import handoffs_json, print_handoffs

    if match not in ("auto", "handoff"):
        raise UsageProblem(f"--match {match} pairs two traces; more than two, or directories, "
                           "are paired by handoff (--match handoff)")
    if len(paths) == 1 and not paths[0].is_dir():
        raise UsageProblem("Missing argument 'B': diff compares trace A with trace B, or "
                           "the traces of a fleet (a directory of them) by handoff")
    traces = traces_named(paths)
    if len(traces) < 2:
        raise UsageProblem(f"{paths[0]} holds one trace: a handoff diff needs a prefill side "
                           "and a decode side")
    with progress(f"diffing the handoffs of {len(traces)} traces", "steps",
                  files=traces) as advance:
        result = diff_handoffs(traces, progress=advance)
    if as_json:
        print_bytes(handoffs_json(result, select.keep if select else None))
    else:
        print_handoffs(result, select.max_requests, select.keep if select else None)
    if result.divergences:
        return EXIT_DIVERGENT
    if not result.compared:
        say(f"nothing compared: no handoffs of the {len(traces)} traces pair up (no decode-side "
            "request names a prefill-side request of them in its kv_transfer_params' "
            "remote_request_id)")
        return EXIT_NOTHING
    return EXIT_OK
