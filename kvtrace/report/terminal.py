"""Render divergences for people (a rich table) and for machines (JSON).

Reporters only consume results, typed as kvtrace.results defines them: a
``ReplayResult``, a ``DiffResult``, or a ``VllmReplayResult`` with the diff of
its decisions. They never read traces.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import orjson
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from .._text import CONTROL_ESCAPES_BUT_LAYOUT, count, number, path_text, plural
from ..findings import Divergence, RequestFindings, Findings, first_per_request, by_request, gather
from ..results import DiffResult, ReplayResult, VllmReplayResult
from ..trace import events as ev
from .failures import (also_diverge, causes_line, divergences_text, first_line,
                       print_per_request, print_wrapped, steps_text, stop_brief, stop_text,
                       unchecked_text)
from ..writing import blamed_on, silence

MAX_ROWS = 50
MAX_REQUESTS_SHOWN = 10
MAX_VALUE_CHARS = 48


@dataclass(slots=True)
class ReplayView:
    """What a replay's terminal report shows: the findings per request of the divergences
    selected (all, or those of --request and --field), the one to read first
    and why (``findings``: of every divergence, whatever is selected), at most
    how many requests, and the selection in words (None: all)."""

    per_request: list[RequestFindings] = field(default_factory=list)
    findings: Findings | None = None
    max_requests: int | None = None
    filtered: str | None = None

    @property
    def headline(self) -> Divergence | None:
        return self.findings.headline if self.findings is not None else None


class _PlainConsole(Console):
    """A console that prints text as text: no markup (a request id like
    ``[/x]`` is shown, not parsed) and no control characters from the data
    (the console's own styles and cursor moves pass)."""

    def on_broken_pipe(self) -> None:
        """The reader went away (``| head``): print nothing more, and let the
        command end with its own exit code (rich would exit with 1, which means
        divergences)."""
        self.quiet = True
        silence(self.file)

    def _check_buffer(self) -> None:
        # a full disk under a redirected output: name it
        with blamed_on("standard error" if self.stderr else "standard output"):
            super()._check_buffer()

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        text = super()._render_buffer(
            seg if seg.control else Segment(_shown(seg.text), seg.style, seg.control)
            for seg in buffer)
        # A table pads its cells to the column's width: no line ends in spaces.
        return _TRAILING_SPACES.sub(r"\1\n", text)


_TRAILING_SPACES = re.compile(r" +((?:\x1b\[[0-9;]*m)*)\n")


def _shown(text: str) -> str:
    """Control characters as escapes; so are the bytes of a file name that are
    not UTF-8 (Python gives them as surrogates, which no UTF-8 stream takes)."""
    text = text.translate(CONTROL_ESCAPES_BUT_LAYOUT)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = path_text(text)
    return text


PIPE_WIDTH = 100   # the width of output that goes to no terminal, unless COLUMNS says


def make_console(stderr: bool = False) -> Console:
    """A console that is plain (no colour) when the output is not a terminal,
    and then ``PIPE_WIDTH`` wide, unless COLUMNS says otherwise."""
    c = _PlainConsole(stderr=stderr, highlight=False, markup=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = _PlainConsole(stderr=stderr, highlight=False, markup=False, width=PIPE_WIDTH)
    return c


# --------------------------------------------------------------------------- values


def format_value(v: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A short, readable form of a recorded or expected value."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        s = "[" + ", ".join(format_value(x, limit) for x in v) + "]"
        if len(s) > limit:
            head = s[: limit - 12].rsplit(",", 1)[0]
            s = f"{head}, … ({count(len(v), 'item')})]"
    elif isinstance(v, dict):
        s = ", ".join(f"{k}={format_value(x, limit)}" for k, x in v.items())
    else:
        s = str(v)
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return s


def replayed_up_to(truncation: str | None, verb: str = "replayed") -> str | None:
    """The note a truncated trace gets: "replayed up to line N: <why>"."""
    if not truncation:
        return None
    if "no 'end' record" in truncation:
        return truncation
    m = re.search(r"line (\d+) is cut off", truncation)
    if m:
        return f"{verb} up to line {int(m.group(1)) - 1}: {truncation}"
    m = re.search(r"after line (\d+)", truncation)
    if m:
        return f"{verb} up to line {m.group(1)}: {truncation}"
    return f"{verb} up to the cut: {truncation}"


def _trace_line(path: str, header: ev.Header, steps: str | None, profile: str | None = None) -> str:
    """The trace, its engine, the profile followed and ``steps`` (in words)."""
    engine = getattr(header, "engine", "?")
    version = getattr(header, "engine_version", "")
    parts = [str(path), f"engine {engine} {version}".rstrip()]
    if profile is not None:
        parts.append(f"profile {profile}")
    if steps is not None:
        parts.append(steps)
    return " · ".join(parts)


# --------------------------------------------------------------------------- replay


def print_replay(result: ReplayResult, path: str, view: "ReplayView",
                 console: Console | None = None) -> None:
    """The verdict and the first divergence, where replay stopped before the
    trace's end, then one block per diverging request (``view.per_request``),
    then the notes and a closing line."""
    console = console or make_console()
    divs: list[Divergence] = list(result.divergences)
    steps = getattr(result, "steps", None)
    stop = stop_text(result)
    if divs:
        print_wrapped(console, f"FAILED: {divergences_text(divs)}", "bold red")
        if view.headline is not None:
            print_wrapped(console, "first: " + first_line(view.headline, with_line=True), "red")
        line = causes_line(view.findings.per_request if view.findings is not None else view.per_request)
        if line:
            print_wrapped(console, line, "red")
    else:   # the verdict first, as with divergences
        print_wrapped(console, _replay_summary(divs, steps, stopped=stop is not None),
                      "bold red" if stop else "yellow" if steps == 0 else "green")
    if stop:
        print_wrapped(console, stop, "bold red")
    print_wrapped(console, _trace_line(path, result.header, steps_text(result),
                                       getattr(result, "profile", None)), "bold")
    for note in (getattr(result, "profile_note", None), unchecked_text(result),
                 _prefixed("truncated: ", replayed_up_to(getattr(result, "truncation", None))),
                 end_note(getattr(result, "end", None))):
        if note:
            print_wrapped(console, note, "yellow")
    shown = print_per_request(console, view.per_request, view.max_requests)
    if divs:
        console.print()
        if view.filtered:
            n = sum(s.count for s in view.per_request)
            print_wrapped(console, f"{number(n)} of the {count(len(divs), 'divergence')} "
                                   f"{plural(n, 'matches', 'match')} {view.filtered}", "yellow")
        rest = also_diverge(view.per_request[shown:])
        if rest:
            print_wrapped(console, f"{rest}: --max N shows more, --request ID one, --json all",
                          "yellow")
        print_wrapped(console, "kvtrace explain RULE tells what a rule encodes, with an "
                               "example; kvtrace show TRACE --step N shows a step.", "dim")
        print_wrapped(console, _closing(result, view.headline), "red")
    elif stop:
        print_wrapped(console, _closing(result, None), "red")
    fault = (getattr(result.header, "meta", None) or {}).get("fault")
    if fault and not divs and steps and not stop:
        print_wrapped(console, f"note: this trace was recorded with the fault {fault} planted, "
                               "and replay found nothing: either the fault never fired in "
                               "this workload (record says so when it does not), or replay "
                               "missed it.", "yellow")
    line = audit_line(getattr(result, "audit", None))
    if line:
        console.print(Text(line))


def _prefixed(prefix: str, text: str | None) -> str | None:
    return None if text is None else prefix + text


def print_rerun(run: VllmReplayResult, out: str, first: dict | None, result: DiffResult,
                data_path: list | None = None, audit: dict | None = None,
                console: Console | None = None) -> None:
    """A trace re-run through vLLM's own scheduler (``run``), the first step
    where it decided otherwise (``first``), and the diff of its decisions
    with the recording (``result``); then the data-path checks of the
    recording's KV audit (``data_path``, what they checked: ``audit``)."""
    console = console or make_console()
    console.print(f"replayed through {run.scheduler_cls} (vLLM {run.vllm_version}): "
                  f"{count(run.steps, 'step')} in {run.seconds:.2f} s; its decisions are in {out}")
    stop = rerun_stop(run, result)
    if stop:
        print_wrapped(console, stop, "bold red")
    for note in [*run.notes, *run.unanswered_lookups[:5], *run.unused_lookups[:5],
                 *run.dropped_samples[:5]]:
        console.print(f"note: {note}")
    if first is not None:
        def said(v):
            return "not scheduled" if v is None else v

        console.print(f"first step where this scheduler decides otherwise: step {first['step']}, "
                      f"request {first['req']}, {first['field']}: recorded "
                      f"{said(first['recorded'])}, this scheduler {said(first['vllm'])}",
                      style="red")
    else:
        console.print(f"the {count(run.steps, 'step')} replayed: the same decisions as recorded"
                      if stop else "every step: the same decisions as recorded",
                      style="yellow" if stop else "green")
    print_diff(result, console)
    _print_audit(console, data_path or [], audit)


def _print_audit(console: Console, divs: list, audit: dict | None) -> None:
    """The data-path checks' divergences, when they were not in the replay's
    own list, and the line on what they checked."""
    line = audit_line(audit)
    if line is None:
        return
    if divs:
        print_per_request(console, by_request(divs), MAX_REQUESTS_SHOWN)
        console.print()
    console.print(Text(line))
    console.print(Text(f"data path: {count(len(divs), 'divergence')}"
                       if divs else "data path: no divergence", style="red" if divs else "green"))


def rerun_stop(run: VllmReplayResult, result: DiffResult) -> str | None:
    """Where the scheduler under test stopped before the trace's end, in
    words; None when it replayed the whole trace."""
    if not getattr(run, "stopped", None):
        return None
    in_trace = getattr(result, "steps_a", None)
    left = f"; {number(run.steps)} of the trace's {count(in_trace, 'step')} replayed" \
        if in_trace is not None else ""
    return f"replay stopped: the scheduler raised {run.stopped}{left}"


def rerun_json(result: DiffResult, first: dict | None, data_path: list | None = None,
               audit: dict | None = None, run: VllmReplayResult | None = None) -> bytes:
    doc = result.to_json()
    doc["first_step_difference"] = first
    if run is not None:   # the scheduler under test: how far it went, where it stopped
        doc["steps_checked"] = run.steps
        doc["steps_in_trace"] = getattr(result, "steps_a", None)
        doc["stopped"] = getattr(run, "stopped", None)
    if audit:
        doc["kv_audit"] = audit
        doc["data_path_divergences"] = [d.to_json() for d in data_path or []]
    return dumps(doc)


def audit_line(checked: dict | None) -> str | None:
    """One line on what the data-path checks checked; None without a KV audit."""
    if not checked:
        return None
    more = checked.get("unchecked loads")
    hits = checked.get("hits", 0)
    return (f"KV audit: checked {number(checked.get('loads', 0))} loaded, "
            f"{number(checked.get('saves', 0))} saved, {number(checked.get('filled', 0))} filled, "
            f"{number(hits)} prefix-hit {plural(hits, 'block')} (D1-D3)"
            + _parts_audited(checked, "group", "kv_cache_groups", lambda n: "in KV-cache groups")
            + _parts_audited(checked, "rank", "tensor_parallel_size",
                             lambda n: f"over the shards of tensor-parallel {plural(n, 'rank')}")
            + (f"; {count(more, 'loaded block')} had no save to compare with" if more else "")
            + (f"; {count(blind, 'prefix-hit block')} had nothing seen before to compare with"
               if (blind := checked.get("unchecked hits")) else "")
            + "".join(f"; the audit stopped: {k.split(': ', 1)[1]}, its later steps not audited"
                      for k in sorted(checked) if k.startswith("stopped: ")))


def _parts_audited(checked: dict, part: str, total: str, lead) -> str:
    """Which parts of the KV cache (its groups, or its tensor-parallel
    ranks' shards) the audit's counts are of (``"<part> N records"``), led
    by ``lead(how many)``; and any part of the engine (``checked[total]`` of
    them) that sent no record."""
    seen = sorted(int(k.split()[1]) for k in checked if k.startswith(f"{part} ")
                  and k.endswith(" records"))
    out = f", {lead(len(seen))} {', '.join(map(str, seen))}" if seen else ""
    n = checked.get(total) or 0
    missing = [p for p in range(n) if p not in seen]
    if missing:
        out += (f"; {plural(len(missing), part)} {', '.join(map(str, missing))} of {n} "
                f"sent no record (not audited)")
    return out


def end_note(end: ev.End | None) -> str | None:
    """What a trace's end record says, when the recording did not end cleanly."""
    if end is None or (end.status == "complete" and not end.dropped_events):
        return None
    why = f": {end.error}" if end.error else ""
    dropped = f", {count(end.dropped_events, 'event')} dropped" if end.dropped_events else ""
    if end.status == "continued":   # a flight recorder's segment
        return f"a segment: the recording goes on in the next one{dropped}{why}"
    return f"the recorder closed this trace as '{end.status}'{dropped}{why}"


def _replay_summary(divs: list[Divergence], steps: int | None = None,
                    first: Divergence | None = None, stopped: bool = False) -> str:
    """The verdict in one line: the counts and, where there are divergences,
    the one to read first (``first``, the headline: ``kvtrace.findings.gather``)."""
    if not divs and stopped:
        return (f"STOPPED: no divergence in the {count(steps or 0, 'step')} checked, but "
                "replay stopped before the trace's end")
    if not divs and steps == 0:
        return "nothing to check: the trace holds no step (a recorder that captured nothing?)"
    if not divs:
        return "no divergence: the trace matches the reference scheduler"
    line = divergences_text(divs)
    if first is not None:
        where = f"step {first.step}" if first.step is not None else "outside any step"
        who = f", request {first.req}" if first.req is not None else ""
        line += f"; first at {where}{who}, field {first.field}"
    return line


def _closing(result: ReplayResult, first: Divergence | None) -> str:
    """A replay's last line: the verdict, and where replay stopped, if it did."""
    stop = stop_brief(result)
    line = _replay_summary(list(result.divergences), result.steps, first, stop is not None)
    return f"{line}; {stop}" if stop and result.divergences else line


def likely_cause_json(findings: Findings | None) -> dict | None:
    """The divergence to read first, as ``--json`` gives it: the divergence's
    own fields, how its expected value comes about (``derivation``) and why it
    comes first (``why_first``)."""
    if findings is None or findings.headline is None:
        return None
    d = findings.headline
    return {**d.to_json(), "derivation": d.why, "why_first": findings.why}


def replay_json(result: ReplayResult, path: str, keep: Callable[[Divergence], bool] | None = None,
                findings: Findings | None = None) -> bytes:
    """The replay as JSON; ``keep`` selects the divergences listed (all when None).
    ``findings``: the divergences per request and their headline
    (``kvtrace.findings.gather``; gathered here when not given)."""
    return _dumps(_replay_doc(result, path, keep, findings))


def _replay_doc(result: ReplayResult, path: str, keep=None, findings: Findings | None = None) -> dict:
    header = result.header
    if findings is None:
        findings = gather(list(result.divergences))
    stop = getattr(result, "stopped_at", None)
    doc = {
        "trace": path_text(path),
        "engine": getattr(header, "engine", None),
        "engine_version": getattr(header, "engine_version", None),
        "profile": getattr(result, "profile", None),
        "profile_note": getattr(result, "profile_note", None),
        "steps": getattr(result, "steps", None),
        "steps_checked": result.steps_checked,
        "steps_in_trace": getattr(result, "steps_in_trace", None),
        "stopped_at": None if stop is None else stop.to_json(),
        "truncation": getattr(result, "truncation", None),
        "likely_cause": likely_cause_json(findings),
        "divergences": [d.to_json() for d in first_per_request(list(result.divergences))
                        if keep is None or keep(d)],
    }
    if result.from_keyframe is not None:
        doc["from_keyframe"] = result.from_keyframe
    if result.gaps:
        doc["gaps"] = [list(g) for g in result.gaps]
    if getattr(result, "audit", None):
        doc["kv_audit"] = result.audit
    doc["kv_content"] = {"device": getattr(result, "device", None),
                         "slots_checked": getattr(result, "slots_checked", 0),
                         "states_checked": getattr(result, "states_checked", 0),
                         "not_checked": getattr(result, "content_unchecked", None)}
    return doc


def print_replay_many(results: list, views: dict, max_requests: int | None,
                      console: Console | None = None) -> None:
    """Several traces replayed together: a line per trace, then the findings per request of
    every trace's divergences, each request named with its trace's file name.
    ``views``: each replayed trace's ReplayView, by path."""
    console = console or make_console()
    names = _names_of([str(p) for p, _, _ in results])
    findings: list[tuple[str, RequestFindings]] = []   # each trace's findings per request, trace by trace
    for path, result, error in results:
        if error:
            print_wrapped(console, f"{path}: unusable: {error}", "red")
            continue
        view = views[str(path)]
        line = _trace_line(path, result.header, steps_text(result),
                           getattr(result, "profile", None))
        note = replayed_up_to(result.truncation)
        stop = stop_text(result)
        verdict = _replay_summary(result.divergences, result.steps, view.headline, stop is not None)
        print_wrapped(console, f"{line}: {verdict}"
                      + (f" (truncated: {note})" if note else ""),
                      "red" if result.divergences or stop else "green")
        if stop:
            print_wrapped(console, stop, "bold red")
        findings.extend((names[str(path)], s) for s in view.per_request)
    shown = print_per_request(console, findings, max_requests)
    rest = also_diverge([s for _, s in findings[shown:]])
    if rest:
        console.print()
        print_wrapped(console, f"{rest}: --max N shows more, --json all", "yellow")
    bad = sum(1 for _, r, e in results if e or r.divergences or r.stopped_at)
    console.print(Text(f"{count(len(results), 'trace')}, {number(bad)} with divergences, stopped "
                       "or unusable", style="red" if bad else "green"))


def _names_of(paths: list[str]) -> dict[str, str]:
    """How each trace is named beside its requests: its file name, or the path
    as given where two traces share a file name (rank0/t.gz, rank1/t.gz)."""
    base = [os.path.basename(p) for p in paths]
    return {p: b if base.count(b) == 1 else p for p, b in zip(paths, base)}


def replay_many_json(results: list, keep: Callable[[Divergence], bool] | None = None,
                     views: dict | None = None) -> bytes:
    """Several traces' replays as JSON; ``views``: each one's ReplayView, by path."""
    docs = []
    for path, result, error in results:
        if error:
            docs.append({"trace": path_text(path), "error": error})
        else:
            view = (views or {}).get(str(path))
            docs.append(_replay_doc(result, str(path), keep,
                                    view.findings if view is not None else None))
    return _dumps({"traces": docs})


# --------------------------------------------------------------------------- diff


def print_diff(result: DiffResult, console: Console | None = None, max_rows: int = MAX_ROWS) -> None:
    console = console or make_console()
    for tag, path, header, steps, trunc, end in (
        ("A", result.path_a, result.header_a, result.steps_a, result.truncation_a, result.end_a),
        ("B", result.path_b, result.header_b, result.steps_b, result.truncation_b, result.end_b),
    ):
        console.print(Text(f"{tag}: {_trace_line(path, header, None if steps is None else count(steps, 'step'))}", style="bold"))
        if trunc:
            console.print(Text(f"   truncated: {replayed_up_to(trunc, 'read')}",
                               style="yellow"))
        note = end_note(end)
        if note:
            console.print(Text(f"   {note}", style="yellow"))
    matched_by = getattr(result, "matched_by", "id")
    if matched_by == "handoff":
        p, d = ("A", "B") if result.prefill_side == "a" else ("B", "A")
        console.print(f"prefill side = {p}, decode side = {d}; each decode request paired with "
                      "the prefill request its kv_transfer_params name (remote_request_id)")
    else:
        paired = {"id": "by request id", "id-prefix": "by request id without vLLM's random suffix",
                  "arrival": "by order of arrival"}.get(matched_by, "")
        console.print(f"requests paired {paired}")
    s = result.summary()
    divs = list(result.divergences)
    if divs:
        first = next((d for d in divs if d.req is not None), divs[0])
        print_wrapped(console, f"DIFFERENT: {_diff_count(s, matched_by)}; first: "
                      + first_line(first, ("A", "B")), "bold red")
    # One divergence per request already, in A's order: configs, then requests.
    print_per_request(console, [RequestFindings(d.req, d, [], 1) for d in divs[:max_rows]], None,
                  words=("A", "B"))
    if divs:
        console.print()
    if len(divs) > max_rows:
        console.print(Text(f"… and {number(len(divs) - max_rows)} more (--json lists them all)",
                           style="yellow"))
    n, bad = s["requests_compared"], s["divergent_requests"]
    line = f"{count(n, 'request')} compared, {number(bad)} {plural(bad, 'diverges', 'diverge')}"
    if matched_by == "handoff":
        line = (f"{count(n, 'handoff')} compared (decode request and its prefill), "
                f"{number(bad)} {plural(bad, 'diverges', 'diverge')}")
        unread, unknown = ((s["only_in_a"], s["only_in_b"]) if result.prefill_side == "a"
                           else (s["only_in_b"], s["only_in_a"]))
        if unread:
            line += f"; handed over, read by no decode request: {_names(unread)}"
        if unknown:
            line += f"; reading a prefill request the other trace lacks: {_names(unknown)}"
    else:
        if s["only_in_a"]:
            line += f"; only in A: {_names(s['only_in_a'])}"
        if s["only_in_b"]:
            line += f"; only in B: {_names(s['only_in_b'])}"
    line += f"; steps: A {number(s['steps_a'])}, B {number(s['steps_b'])}"
    if s["cut_short"]:
        line += f"; {count(len(s['cut_short']), 'request')} compared only up to a trace's cut"
    # The earliest in A (requests only in B, which have no place in A, come last).
    first = next((d for d in result.divergences if d.req is not None), None)
    if first is not None and first.line is not None:
        where = f"step {first.step}, line {first.line}" if first.step is not None else f"line {first.line}"
        line += f"; first divergence at {where} of A, request {first.req}, field {first.field}"
        if first.in_b is not None and first.in_b[1] is not None:
            line += f" (line {first.in_b[1]} of B)"
    print_wrapped(console, line, "red" if result.divergences else "green")
    if bad:
        print_wrapped(console, DIFF_VS_REPLAY, "dim")


def _diff_count(s: dict, matched_by: str) -> str:
    n, bad = s["requests_compared"], s["divergent_requests"]
    what = "handoff" if matched_by == "handoff" else "request"
    return f"{number(bad)} of {count(n, what)} {plural(bad, 'diverges', 'diverge')}"


DIFF_VS_REPLAY = ("diff counts a request when anything in its history differs between A and "
                  "B, knock-on effects of another request's divergence included; "
                  "kvtrace replay counts the requests whose engine decisions break a rule, "
                  "so its count can be smaller.")


def _names(reqs: list[str], limit: int = 8) -> str:
    shown = ", ".join(reqs[:limit])
    return shown + (f" … ({number(len(reqs))} in all)" if len(reqs) > limit else "")


def diff_json(result: DiffResult) -> bytes:
    return _dumps(result.to_json())


def dumps(doc: dict) -> bytes:
    """A JSON document as the reports print one."""
    return _dumps(doc)


def _dumps(doc: dict) -> bytes:
    return orjson.dumps(doc, default=str, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
