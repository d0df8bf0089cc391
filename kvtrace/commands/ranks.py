"""``kvtrace replay RUN`` where RUN is rank 0's trace of a data-parallel run:
every rank's trace (found beside it, kvtrace/trace/ranks.py) replayed, the
checks across ranks (kvtrace/diff/ranks.py), one report."""

from __future__ import annotations

from pathlib import Path

from kvtrace._text import count

from ._common import (EXIT_BAD_INPUT, EXIT_DIVERGENT, EXIT_INTERNAL, EXIT_NOTHING, EXIT_OK,
                      print_bytes, say)
from .progress import progress


def run_of(trace: Path):
    """The data-parallel run whose rank 0 recorded ``trace``, or None."""
    from kvtrace.trace.files import is_stdin, not_regular
    from kvtrace.trace.ranks import find_run

    if is_stdin(trace) or trace.is_dir() or not_regular(trace):
        return None
    return find_run(trace)


def replay_run(run, as_json: bool, device: str | None, jobs: int, profile: str | None,
               select) -> int:
    """Replay every rank of ``run`` and check them across; print the report;
    return the exit code (1 also for a missing rank: a rank not checked is no pass)."""
    from kvtrace.diff.ranks import check_ranks
    from kvtrace.replay.many import InternalError, replay_many
    from kvtrace.report.ranks import failed_ranks, print_ranks, ranks_json
    from kvtrace.results import RanksResult

    order = sorted(run.ranks)
    with progress(f"replaying {count(len(order), 'rank')}", "done", total=len(order)) as advance:
        replays = replay_many([run.ranks[k] for k in order], device, profile, jobs, advance)
    checks = check_ranks(run.ranks, run.lockstep)
    result = RanksResult(str(run.path), run.size, run.lockstep,
                         [(k, p, r, e) for k, (p, r, e) in zip(order, replays)], run.missing,
                         run.others, checks.divergences, checks.requests, checks.steps_checked,
                         checks.unread)
    views = {k: select.view(r.divergences) for k, _, r, _ in result.ranks if r is not None}
    if as_json:
        print_bytes(ranks_json(result, views, select.keep if select else None))
    else:
        print_ranks(result, views, select.max_requests)
    errors = [e for _, _, _, e in result.ranks if e]
    for err in errors:
        say(err)
    if any(isinstance(e, InternalError) for e in errors):
        return EXIT_INTERNAL
    if errors:
        return EXIT_BAD_INPUT
    if failed_ranks(result) or result.across or result.missing:
        return EXIT_DIVERGENT
    return EXIT_NOTHING if not any(r.steps for _, _, r, _ in result.ranks) else EXIT_OK
