"""A fleet's handoff diff: a line per trace (its side, its steps, what it
handed over or pulled), each diverging handoff named with the decode trace
and the prefill trace it joins, then what no trace pairs; and the same as
JSON."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

from rich.console import Console
from rich.text import Text

from .._text import count, number, path_text, plural
from ..findings import Divergence, RequestFindings
from ..results import HandoffsResult
from .failures import first_line, print_per_request, print_wrapped
from .terminal import dumps, make_console

PAIRED = ("each decode-side request paired with the prefill-side request its "
          "kv_transfer_params name (remote_request_id), in whichever trace holds it")


def print_handoffs(result: HandoffsResult, max_rows: int | None,
                   keep: Callable[[Divergence], bool] | None = None,
                   console: Console | None = None) -> None:
    """``keep``: the divergences shown (all when None); the counts are all of them."""
    console = console or make_console()
    names = trace_names(result)
    for k, t in enumerate(result.traces):
        what = [count(t.steps, "step")]
        if t.handed_over or t.role != "decode":
            what.append(f"{number(t.handed_over)} handed over")
        if t.pulls or t.role != "prefill":
            what.append(f"{count(t.pulls, 'pull')}")
        line = f"{t.role}: {names[k]} · {t.header.engine} {t.header.engine_version} · " + \
            ", ".join(what)
        if t.truncation or (t.end is not None and t.end.status != "complete"):
            line += f" ({t.truncation or 'ended ' + t.end.status})"
        print_wrapped(console, line, "bold")
    print_wrapped(console, PAIRED)
    divs = result.divergences
    if divs:
        i, j, first = divs[0]
        said = plural(result.divergent, "diverges", "diverge")
        print_wrapped(console, f"DIFFERENT: {number(result.divergent)} of "
                               f"{count(result.compared, 'handoff')} {said}; first: "
                               f"{pair_name(result, i, j, first.line)}, "
                               + first_line(first, ("decode", "prefill")), "bold red")
    # The line is the decode trace's: said with its name, not as A's.
    findings = [(pair_name(result, i, j, d.line), RequestFindings(d.req, replace(d, line=None),
                                                                   [], 1))
                for i, j, d in divs if keep is None or keep(d)]
    print_per_request(console, findings, max_rows, words=("decode", "prefill"))
    if max_rows is not None and len(findings) > max_rows:
        console.print(Text(f"… and {number(len(findings) - max_rows)} more (--json lists "
                           "them all)", style="yellow"))
    print_wrapped(console, closing_line(result), "red" if divs else "green")


def trace_names(result: HandoffsResult) -> list[str]:
    """Each trace's file name, or its path where two share a file name."""
    base = [os.path.basename(t.path) for t in result.traces]
    return [b if base.count(b) == 1 else t.path for b, t in zip(base, result.traces)]


def pair_name(result: HandoffsResult, decode: int, prefill: int | None,
              line: int | None = None) -> str:
    """The two traces of a handoff: "decode d1.jsonl.gz line 12, prefill p0.jsonl.gz"."""
    names = trace_names(result)
    at = f" line {line}" if line is not None else ""
    return f"decode {names[decode]}{at}" + (f", prefill {names[prefill]}" if prefill is not None
                                            else "")


def closing_line(result: HandoffsResult) -> str:
    names = trace_names(result)
    line = (f"{count(result.compared, 'handoff')} compared across "
            f"{count(len(result.traces), 'trace')}, {number(result.divergent)} "
            f"{plural(result.divergent, 'diverges', 'diverge')}")
    for k, reqs in sorted(result.unread.items()):
        line += f"; handed over in {names[k]}, read by no decode request: {_some(reqs)}"
    for k, reqs in sorted(result.unknown.items()):
        line += f"; reading a prefill request no trace holds, in {names[k]}: {_some(reqs)}"
    return line


def _some(reqs: list[str], limit: int = 8) -> str:
    shown = ", ".join(reqs[:limit])
    return shown + (f" … ({number(len(reqs))} in all)" if len(reqs) > limit else "")


def handoffs_json(result: HandoffsResult,
                  keep: Callable[[Divergence], bool] | None = None) -> bytes:
    paths = [path_text(t.path) for t in result.traces]
    traces = [{"path": paths[k], "role": t.role, "engine": t.header.engine,
               "engine_version": t.header.engine_version, "steps": t.steps,
               "handed_over": t.handed_over, "pulls": t.pulls, "truncation": t.truncation,
               "end": None if t.end is None else {"status": t.end.status, "error": t.end.error}}
              for k, t in enumerate(result.traces)]
    return dumps({"traces": traces, "summary": {
        "matched_by": "handoff", "handoffs_compared": result.compared,
        "divergent_handoffs": result.divergent,
        "unread": {paths[k]: reqs for k, reqs in sorted(result.unread.items())},
        "unknown": {paths[k]: reqs for k, reqs in sorted(result.unknown.items())}},
        "divergences": [{**d.to_json(), "decode_trace": paths[i],
                         "prefill_trace": None if j is None else paths[j]}
                        for i, j, d in result.divergences if keep is None or keep(d)]})
