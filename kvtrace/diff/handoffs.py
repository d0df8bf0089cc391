"""``diff_handoffs``: the handoffs of a fleet of prefill and decode servers.

A deployment of prefill/decode disaggregation runs several prefill engines
and several decode engines (servers, or the data-parallel ranks of one), each
recorded to a trace of its own; a proxy sends each request to a prefill
engine, then to a decode engine with the transfer parameters the prefill side
handed back. Each decode-side request of every trace is paired here with the
prefill-side request its ``kv_transfer_params`` name (``remote_request_id``)
in whichever trace holds it, and the pair is checked as ``handoff.py``
checks one (the same prompt, the blocks kept and handed over, no more loaded
than computed, the send reported finished), and a prefill-side request read
by two decode-side requests is named. vLLM's request ids carry a random
suffix, so one id names one request across the fleet; where several prefill
traces still hold the id, the prefill engine named by ``remote_engine_id`` (the
prefill side's own parameters name it) decides, and failing that the pair is
reported as ambiguous.

Each trace's role is its header's KV role: a KV producer's requests are
prefill-side, a KV consumer's decode-side, and a ``kv_both`` engine's may be
either. Prefill-side requests handed over that no decode request reads, and
decode requests that name a request no trace holds, are listed per trace.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..findings import Divergence
from ..results import HandoffsResult, HandoffTrace
from ..trace.files import shown
from ..trace.io import TraceReader
from .handoff import (CONSUMER, PRODUCER, NotAPair, Side, first_problem, read_again, read_side,
                      side_role)

_AMBIGUOUS = ("handoff: a decode-side request reads one prefill-side request, named by "
              "remote_request_id (and remote_engine_id)")


def diff_handoffs(paths: list[str | os.PathLike],
                  progress: Callable[[int], None] | None = None) -> HandoffsResult:
    """Pair the decode-side requests of ``paths`` with the prefill-side
    requests of any of them and check each pair. Raises ``TraceError`` for an
    unusable file, ``NotAPair`` for a trace named twice or one without a KV
    connector."""
    _distinct(paths)
    traces, sides = [], []
    done = 0
    for path in paths:
        trace, side = _read(path, progress, done)
        done += side.steps
        traces.append(trace)
        sides.append(side)
    result = HandoffsResult(traces)
    index = _holders(sides)
    read: dict[tuple[int, str], tuple[int, str]] = {}   # (trace, prefill req) -> its reader
    for i, side in enumerate(sides):
        for dec in side.decode:
            _pair(result, sides, index, read, i, dec)
    for j, side in enumerate(sides):
        unread = [req for req, pre in side.prefill.items() if pre.params and (j, req) not in read]
        if unread:
            result.unread[j] = unread
    return result


def _distinct(paths: list[str | os.PathLike]) -> None:
    for k, a in enumerate(paths):
        for b in paths[k + 1:]:
            try:
                same = os.path.samefile(a, b)
            except (OSError, ValueError):
                same = False
            if same:
                raise NotAPair(f"{shown(a)} and {shown(b)} are the same trace: --match handoff "
                               "pairs each trace's requests with the other traces'")


def _read(path: str | os.PathLike, progress, done: int) -> tuple[HandoffTrace, Side]:
    with TraceReader(path) as r:
        role = side_role(r.header)
        if role is None:
            raise NotAPair(f"{shown(path)} has no KV connector: --match handoff pairs KV "
                           "producers' traces (the prefill side) with KV consumers' (the "
                           "decode side)")
        tick = None if progress is None else (lambda n: progress(done + n))
        side = read_side(r, tick)
        trace = HandoffTrace(str(path), r.header, {PRODUCER: "prefill", CONSUMER: "decode"}.get(
            role, "both"), side.steps, sum(1 for p in side.prefill.values() if p.params),
            len(side.decode), r.truncation, r.end)
    return trace, side


def _holders(sides: list[Side]) -> dict[str, list[int]]:
    """Each prefill-side request id -> the traces that hold it."""
    index: dict[str, list[int]] = {}
    for j, side in enumerate(sides):
        for req in side.prefill:
            index.setdefault(req, []).append(j)
    return index


def _pair(result: HandoffsResult, sides: list[Side], index: dict[str, list[int]],
          read: dict[tuple[int, str], tuple[int, str]], i: int, dec: Any) -> None:
    """Pair decode request ``dec`` of trace ``i`` and check the pair."""
    src = dec.params.get("remote_request_id")
    holders = index.get(src, []) if isinstance(src, str) else []
    if len(holders) > 1:
        engine = dec.params.get("remote_engine_id")
        holders = [j for j in holders if engine is not None
                   and (sides[j].prefill[src].params or {}).get("remote_engine_id") == engine]
    if not holders and not index.get(src):
        result.unknown.setdefault(i, []).append(dec.req)
        return
    if len(holders) != 1:
        where = ", ".join(shown(result.traces[j].path) for j in index[src])
        result.divergences.append((i, None, Divergence(
            None, dec.req, "remote_request_id", src, f"one prefill-side request; {where} hold one",
            _AMBIGUOUS, "diff", dec.seq, dec.line)))
        return
    j = holders[0]
    result.compared += 1
    if (j, src) in read:
        k, first = read[(j, src)]
        div = read_again(dec, src, first + ("" if k == i else
                                            f" of {shown(result.traces[k].path)}"))
    else:
        div = first_problem(dec, src, sides[j].prefill[src], sides[j])
        read[(j, src)] = (i, dec.req)
    if div is not None:
        result.divergences.append((i, j, div))
