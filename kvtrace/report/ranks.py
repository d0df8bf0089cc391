"""A data-parallel run's report: the run (its ranks, the ranks missing, files
not taken), each rank's replay in a line, the checks across ranks, then the
findings per request, each named with its rank; and the same as JSON."""

from __future__ import annotations

import os
from typing import Callable

import orjson
from rich.console import Console

from .._text import count, number, path_text
from ..findings import Divergence, RequestFindings
from ..results import RanksResult, ReplayResult
from .failures import (also_diverge, divergences_text, print_per_request, print_wrapped,
                       steps_text, stop_text)
from .terminal import dumps, make_console, replay_json


def print_ranks(result: RanksResult, views: dict, max_requests: int | None,
                console: Console | None = None) -> None:
    """``views``: each replayed rank's ReplayView, by rank."""
    console = console or make_console()
    print_wrapped(console, run_line(result), "bold")
    for rank, path, replay, error in result.ranks:
        _rank_line(console, rank, path, replay, error)
    for rank in result.missing:
        print_wrapped(console, f"rank {rank}: missing: no trace of it beside "
                               f"{os.path.basename(result.path)}", "red")
    for path, why in result.others:
        print_wrapped(console, f"not taken: {os.path.basename(path)}: {why}", "yellow")
    print_wrapped(console, across_line(result),
                  "red" if result.across or result.unread else "green")
    findings = [(f"rank {k}", RequestFindings(d.req, d, [], 1)) for k, d in result.across]
    for rank, _, replay, _ in result.ranks:
        if replay is not None:
            findings += [(f"rank {rank}", s) for s in views[rank].per_request]
    shown = print_per_request(console, findings, max_requests)
    rest = also_diverge([s for _, s in findings[shown:]])
    if rest:
        console.print()
        print_wrapped(console, f"{rest}: --max N shows more, --json all", "yellow")
    bad = failed_ranks(result)
    line = (f"{count(len(result.ranks), 'rank')} replayed, {number(len(bad))} with divergences, "
            "stopped or unusable")
    if result.across:
        line += f"; {count(len(result.across), 'divergence')} across ranks"
    if result.missing:
        line += f"; {count(len(result.missing), 'rank')} missing"
    print_wrapped(console, line, "red" if bad or result.across or result.missing else "green")


def run_line(result: RanksResult) -> str:
    """The run in one line: its ranks, how they ran, rank 0's trace."""
    n = len(result.ranks) + len(result.missing)
    how = ("in lockstep (a mixture-of-experts model's)" if result.lockstep else
           "independent (a dense model's; the run's size is not recorded)")
    return f"data-parallel run of {count(n, 'rank')}, {how}: {path_text(result.path)}"


def _rank_line(console: Console, rank: int, path: str, replay: ReplayResult | None,
               error: str | None) -> None:
    name = os.path.basename(path)
    if replay is None:
        print_wrapped(console, f"rank {rank}: {name}: unusable: {error}", "red")
        return
    stop = stop_text(replay)
    verdict = divergences_text(replay.divergences) if replay.divergences else "no divergence"
    print_wrapped(console, f"rank {rank}: {name} · {steps_text(replay)}: {verdict}",
                  "red" if replay.divergences or stop else "green")
    if stop:
        print_wrapped(console, f"  {stop}", "bold red")


def across_line(result: RanksResult) -> str:
    """What the checks across ranks found, and what they checked, in one line."""
    checked = (f"checked: the ranks' headers (DP1), {count(result.requests, 'request')} "
               f"(DP2), {count(result.steps_checked, 'step')}' prefill throttling against "
               + ("the step counter the ranks share (DP3)" if result.lockstep else
                  "an engine core not in lockstep (DP3)"))
    head = (f"ACROSS RANKS: {count(len(result.across), 'divergence')}" if result.across
            else "across ranks: no divergence")
    unread = "".join(f"; rank {k} not read: {why}" for k, why in sorted(result.unread.items()))
    return f"{head}; {checked}{unread}"


def failed_ranks(result: RanksResult) -> list[int]:
    """The ranks whose replay diverged, stopped or could not be read."""
    return [rank for rank, _, replay, error in result.ranks
            if error or replay.divergences or replay.stopped_at is not None]


def ranks_json(result: RanksResult, views: dict,
               keep: Callable[[Divergence], bool] | None = None) -> bytes:
    """The run as JSON: ``run``, each rank's replay as ``replay --json`` gives
    it (``ranks``), and the checks across them (``across_ranks``)."""
    ranks = []
    for rank, path, replay, error in result.ranks:
        doc = ({"trace": path_text(path), "error": error} if replay is None else
               orjson.loads(replay_json(replay, path, keep, views[rank].findings)))
        ranks.append({"rank": rank, **doc})
    return dumps({"run": run_json(result), "ranks": ranks, "across_ranks": {
        "requests": result.requests, "steps_checked": result.steps_checked,
        "not_read": {str(k): v for k, v in sorted(result.unread.items())},
        "divergences": [{"rank": k, **d.to_json(), "why": d.why} for k, d in result.across
                        if keep is None or keep(d)]}})


def run_json(result: RanksResult) -> dict:
    return {"path": path_text(result.path), "size": result.size, "lockstep": result.lockstep,
            "ranks": [{"rank": k, "path": path_text(p)} for k, p, _, _ in result.ranks],
            "missing": result.missing,
            "not_taken": [{"path": path_text(p), "why": why} for p, why in result.others]}
