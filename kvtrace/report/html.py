"""A self-contained HTML report of one trace (or of two, with ``--against``):
the verdict and the first divergence, the run summary, KV usage, the
divergences folded per request, and request timelines.

Everything is inline: CSS, a little JavaScript (a request filter, and a step
range shared by every chart: sliders, drag to zoom) and SVG charts drawn here,
in Python. The page fetches nothing, so it opens offline and can be mailed or
attached to a bug.

Big traces stay small: series are downsampled while the trace is read (see
``figures.Series``), divergence bands are merged runs of steps
(``figures.step_runs``), the table has a row per request, and timelines are
drawn for the first ``max_requests`` requests plus the requests with a
divergence (up to ``max_divergent``).
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from .._text import path_text
from ..findings import Divergence, RequestFindings, Findings, headline, gather, why_first
from ..writing import writing
from .._text import number as _n
from .failures import (causes_line, count, divergences_text, left_out, rule_words, value_text,
                       why_text)
from .figures import MAX_RUNS, RequestTimeline, RunSummary, kv_groups_text, percent, step_runs
from .summary import summarize
from .svg import Band, chart, legend
from .terminal import replayed_up_to

MAX_REQUESTS = 40          # timelines drawn for the first requests by arrival ...
MAX_DIVERGENT = 200        # ... plus this many requests with divergences
MAX_TABLE_ROWS = 500       # requests in the table
MAX_REQ_RUNS = 100         # divergence bands per request chart
MAX_REQ_DOTS = 40          # recorded/expected pairs of dots per request chart
VALUE_CHARS = 120          # a list or mapping is cut here (a text never is)

# Chart colours (the browser test looks for them).
C_COMPUTED = "#4c78a8"
C_KV = "#4c78a8"
C_CACHED = "#54a24b"
C_SCHED = "#54a24b"
C_EXTERNAL = "#b279a2"
C_BLOCKS = "#9d755d"
C_PREEMPT = "#f58518"
C_LOAD = "#72b7b2"
C_DIVERGENCE = "#e45756"
C_FIRST = "#222222"
C_EXPECTED = "#2ca02c"
C_LIVE = "#9d755d"
C_RUNNING = "#b279a2"
BAND_OPACITY = 0.18


@dataclass
class HtmlReport:
    path: str
    summary: RunSummary
    divergences: list[Divergence]
    source: str                      # "replay", "diff" or "given"
    note: str | None = None          # why no divergences could be computed, if so
    timelines: int = 0
    per_request: list[RequestFindings] = field(default_factory=list)
    against: RunSummary | None = None
    stop: str | None = None          # where replay stopped before the trace's end, in words


def write_html_report(trace: str | os.PathLike, out_html: str | os.PathLike,
                      divergences: Iterable[Divergence], source: str = "given",
                      against: str | os.PathLike | None = None, note: str | None = None,
                      per_request: list[RequestFindings] | None = None,
                      max_requests: int = MAX_REQUESTS,
                      max_divergent: int = MAX_DIVERGENT,
                      findings: Findings | None = None, stop: str | None = None,
                      steps_checked: str | None = None,
                      unchecked: str | None = None) -> HtmlReport:
    """Write the report of ``trace`` and its ``divergences`` to ``out_html``.

    ``source`` says where the divergences come from (``replay``, ``diff``
    with ``against``, or ``given``); ``note`` why there are none to show (a
    trace that replay refuses still gets a report, with the reason in their
    place). ``findings`` holds the divergences per request, with the one to
    read first (``kvtrace.findings.gather``), as the terminal shows them;
    ``per_request`` alone will do; given divergences without either are
    gathered here. ``stop``: where replay stopped before the trace's end, and
    ``steps_checked`` how many steps it checked, in words
    (``failures.stop_text``, ``failures.steps_text``); ``unchecked``: what
    replay was asked to check and did not (``failures.unchecked_text``). With ``against``, that
    trace is drawn too, on the same step axis. This renders; the caller runs
    the analysis. Raises ``TraceError`` when a trace is unusable.
    """
    divs = list(divergences)
    if findings is None:
        findings = gather(divs) if per_request is None else _findings_of(divs, list(per_request))
    divergent = [s.req for s in findings.per_request if s.req is not None][:max_divergent]
    s = summarize(trace, keep=divergent, max_timelines=max_requests)
    # B's timelines of the requests that diverge, drawn under A's (same ids)
    sb = None if against is None else summarize(against, keep=divergent, max_timelines=0)
    page = render(s, divs, findings, source=source, against=sb, note=note, stop=stop,
                  steps_checked=steps_checked, unchecked=unchecked)
    # errors: a file name shown in the page may hold bytes that are not UTF-8
    with writing(out_html) as out, out.open("w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(page)
    return HtmlReport(path=os.fspath(out_html), summary=s, divergences=divs, source=source,
                      note=note, timelines=len(s.timelines), per_request=findings.per_request, against=sb,
                      stop=stop)


def _findings_of(divs: list[Divergence], per_request: list[RequestFindings]) -> Findings:
    head = headline(per_request)
    return Findings(per_request, head, why_first(divs, per_request, head))


# --------------------------------------------------------------------------- page


@dataclass
class _Page:
    """What every section needs to know."""
    s: RunSummary
    b: RunSummary | None
    divs: list[Divergence]
    findings: list[RequestFindings]
    head: Divergence | None
    head_index: int | None          # index of the headline's story
    source: str
    steps: int                      # the shared step axis: [0, steps]
    why: str | None = None          # why the headline comes first
    stop: str | None = None         # where replay stopped before the trace's end
    steps_checked: str | None = None
    unchecked: str | None = None    # what replay did not check, in words

    @property
    def rec(self) -> str:
        return "A" if self.source == "diff" else "recorded"

    @property
    def exp(self) -> str:
        return "B" if self.source == "diff" else "expected"

    def first_mark(self) -> tuple[float, str, str] | None:
        d = self.head
        if d is None or d.step is None:
            return None
        return (d.step + 0.5, C_FIRST, f"step {d.step}: first divergence, {d.field} of "
                f"{'(all)' if d.req is None else d.req}: {self.rec} {_plain(d.field, d.recorded)}, "
                f"{self.exp} {_plain(d.field, d.expected)}")


def render(s: RunSummary, divs: list[Divergence], findings: Findings | None = None,
           source: str = "replay", against: RunSummary | None = None,
           note: str | None = None, stop: str | None = None,
           steps_checked: str | None = None, unchecked: str | None = None) -> str:
    """The whole page as a string. ``against``: the other trace's summary."""
    e = html.escape
    findings = gather(divs) if findings is None else findings
    head = findings.headline
    head_index = next((i for i, st in enumerate(findings.per_request) if st.cause is head), None)
    steps = max(1, s.steps, against.steps if against is not None else 0)
    p = _Page(s, against, divs, findings.per_request, head, head_index, source, steps, findings.why, stop,
              steps_checked, unchecked)
    name = os.path.basename(path_text(s.path))
    title = name if against is None else f"{name} against {os.path.basename(path_text(against.path))}"
    by_req: dict[str | None, list[Divergence]] = {}
    for d in divs:
        by_req.setdefault(d.req, []).append(d)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvtrace report: {e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header>",
        f"<h1>kvtrace report <span class=\"file\">{e(title)}</span></h1>",
        _trace_lines(s, "A" if against is not None else None, steps_checked, unchecked),
    ]
    if against is not None:
        parts.append(_trace_lines(against, "B"))
    parts.append("</header><main>")
    parts.append(_headline(p, note))
    parts.append(_axis_bar(steps))
    parts.append(_summary_section(p))
    parts.append(_run_charts(p))
    parts.append(_divergence_section(p, note))
    parts.append(_request_section(p, by_req))
    parts.append("</main>")
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _trace_lines(s: RunSummary, label: str | None, steps_checked: str | None = None,
                 unchecked: str | None = None) -> str:
    """The trace's lines under the title: what it is, its config, and notes.
    ``steps_checked``: the steps replay checked, in words, where it stopped."""
    e = html.escape
    h, cfg = s.header, s.header.config
    path = path_text(s.path)   # a file name is any bytes: shown with \xNN escapes
    tag = f'<span class="tag tag-{label.lower()}">{label}</span> ' if label else ""
    out = [f"<p class=\"sub\">{tag}{e(path)} · engine {e(h.engine)} {e(h.engine_version)} · "
           f"{e(steps_checked or count(s.steps, 'step'))} · {count(s.requests, 'request')}</p>",
           f"<p class=\"sub\">{'&nbsp;' * 5 if label else ''}block size {_n(cfg.block_size)} · "
           f"{_n(cfg.num_blocks)} blocks ({_n(s.usable_blocks)} usable) · token budget "
           f"{_n(cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens)}"
           f" · max_num_seqs {cfg.max_num_seqs} · policy {e(cfg.policy)}"
           f" · prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
           + (f" · connector {e(cfg.connector.name)} ({e(cfg.connector.load_failure_policy)})"
              if cfg.connector else "")
           + (f" · KV cache {e(groups)}" if (groups := kv_groups_text(h.features)) else "") + "</p>"]
    if unchecked:
        out.append(f'<p class="warn">{tag}{e(unchecked)}</p>')
    trunc = replayed_up_to(s.truncation, "read")
    if trunc:
        out.append(f'<p class="warn">{tag}truncated: {e(trunc)}</p>')
    if s.end is not None and (s.end.status != "complete" or s.end.dropped_events):
        out.append(f'<p class="warn">{tag}the recorder closed this trace as \'{e(s.end.status)}\''
                   + (f", {count(s.end.dropped_events, 'event')} dropped" if s.end.dropped_events else "")
                   + (f": {e(s.end.error)}" if s.end.error else "") + "</p>")
    return "\n".join(out)


# --------------------------------------------------------------------------- headline


def _headline(p: _Page, note: str | None) -> str:
    """The verdict, where replay stopped, and the divergence to read first:
    the words of the terminal's first lines (``failures``)."""
    e = html.escape
    divs = p.divs
    who = "B" if p.source == "diff" else "the reference scheduler"
    stop = f'<p class="stop">{e(p.stop[:1].upper() + p.stop[1:])}.</p>' if p.stop else ""
    if not divs:
        if p.stop:
            return ('<section id="headline" class="headline bad"><p class="verdict">No divergence '
                    "in the steps checked, but replay stopped before the trace's end.</p>"
                    f"{stop}</section>")
        if note:
            return f'<section id="headline" class="headline none"><p class="verdict">{e(note)}</p></section>'
        text = ("No divergence: A and B agree." if p.source == "diff" else
                "No divergence: the reference scheduler agrees with every step." if p.source == "replay"
                else "No divergence.")
        return f'<section id="headline" class="headline good"><p class="verdict">{text}</p></section>'
    verb = "A and B differ: " if p.source == "diff" else (
        "Replay disagrees with this trace: " if p.source == "replay" else "")
    d = p.head
    st = p.findings[p.head_index]
    where = f"step {d.step}" if d.step is not None else "before any step"
    causes = causes_line(p.findings)
    out = [f'<section id="headline" class="headline bad" data-step="{"" if d.step is None else d.step}" '
           f'data-req="{"" if d.req is None else e(d.req)}" data-field="{e(d.field)}">',
           f'<p class="verdict">{e(verb + divergences_text(divs))}.</p>',
           f'<p class="causes">{e(causes[:1].upper() + causes[1:])}.</p>' if causes else "",
           stop,
           '<p class="first-div"><span class="label">First divergence</span> '
           f'<b>{where}</b> · request {"(all)" if d.req is None else _req_link(p.s, d.req)} · '
           f'<b>{e(d.field)}</b>: {p.rec} {_value(d.field, d.recorded, "rec")}, '
           f'{p.exp} {_value(d.field, d.expected, "exp")}</p>',
           f'<p class="rule">{_rule(d.rule, full=True)}</p>']
    why = why_text(d)
    if why:
        out.append(f'<p class="why">{e(why)}</p>')
    if p.why:
        out.append(f'<p class="why-first muted">First because: {e(p.why)}.</p>')
    if st.count > 1:
        out.append(f'<p class="muted">then {_n(st.count - 1)} more in {e(_req(d.req))}'
                   + _steps_text(_request_steps(st)) + f"; compared with {who}.</p>")
    links = [f'<a id="to-table" href="#story-{p.head_index}">→ in the table</a>']
    if d.step is not None:
        links.append(f'<a id="to-charts" href="#kv" data-zoom="{d.step}">→ step {d.step} on the charts</a>')
    out.append('<p class="jump">' + " · ".join(links) + "</p>")
    out.append("</section>")
    return "\n".join(out)


def _axis_bar(steps: int) -> str:
    return (f'<div id="axis" data-steps="{steps}"><b>steps</b> '
            f'<input id="zoom-from" type="range" min="0" max="{steps}" value="0" aria-label="first step">'
            f'<input id="zoom-to" type="range" min="0" max="{steps}" value="{steps}" aria-label="last step">'
            f' <span id="zoom-label">0–{steps}</span> <button id="zoom-reset" type="button">all steps</button>'
            ' <span class="muted">or drag across a chart; double-click for all</span></div>')


# --------------------------------------------------------------------------- summary and charts


def _card(label: str, value: str, sub: str = "", cls: str = "") -> str:
    e = html.escape
    return (f'<div class="card {cls}"><div class="label">{e(label)}</div>'
            f'<div class="value">{e(value)}</div>'
            + (f'<div class="subv">{e(sub)}</div>' if sub else "") + "</div>")


def _summary_section(p: _Page) -> str:
    if p.b is None:
        return ('<section id="summary"><h2>Run summary</h2>' + _summary_cards(p.s, p.divs)
                + "</section>")
    e = html.escape
    rows = []
    for label, get in _COMPARED:
        va, vb = get(p.s), get(p.b)
        cls = ' class="differs"' if va != vb else ""
        rows.append(f"<tr{cls}><th>{e(label)}</th><td>{e(va)}</td><td>{e(vb)}</td></tr>")
    return ('<section id="summary"><h2>Run summaries</h2><table class="compare"><thead><tr><th></th>'
            f"<th>{_trace_tag(p.s, 'A')}</th><th>{_trace_tag(p.b, 'B')}</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></section>")


def _kv_text(s: RunSummary) -> str:
    if s.peak_kv_used is None:
        return "—"
    return f"peak {_n(s.peak_kv_used)}/{_n(s.usable_blocks)}, mean {s.mean_kv_used:,.1f}"


_COMPARED = [
    ("requests", lambda s: f"{_n(s.requests)} (finished: "
                           + (", ".join(f"{_n(n)} {r}" for r, n in sorted(s.finished.items()))
                              or "none") + ")"),
    ("steps", lambda s: _n(s.steps)),
    ("tokens scheduled", lambda s: f"{_n(s.scheduled_tokens)} ({_n(s.prefill_tokens)} prefill, "
                                   f"{_n(s.decode_tokens)} decode)"),
    ("preemptions", lambda s: f"{_n(s.preemptions)} ({count(s.preempted_requests, 'request')})"),
    ("prefix hit rate", lambda s: f"{percent(s.prefix_hit_rate)} ({_n(s.local_cached_tokens)} of "
                                  f"{count(s.prompt_tokens, 'prompt token')})"),
    ("external hit rate", lambda s: f"{percent(s.external_hit_rate)} "
                                    f"({count(s.external_cached_tokens, 'token')})"),
    ("KV blocks in use", _kv_text),
    ("connector", lambda s: f"{count(s.lookups, 'lookup')}, {count(s.loads, 'load')} "
                            f"({count(s.load_tokens, 'token')}), {_n(s.failed_recving)} failed"
                            if s.lookups or s.loads else "—"),
]


def _trace_tag(s: RunSummary, label: str) -> str:
    name = os.path.basename(path_text(s.path))
    return (f'<span class="trace-name" data-trace="{label}"><span class="tag tag-{label.lower()}">{label}</span> '
            f"{html.escape(name)}</span>")


def _summary_cards(s: RunSummary, divs: list[Divergence] | None) -> str:
    fin = ", ".join(f"{_n(n)} {r}" for r, n in sorted(s.finished.items())) or "none"
    cards = [
        _card("requests", _n(s.requests), f"finished: {fin}"),
        _card("steps", _n(s.steps), f"{count(s.scheduled_tokens, 'token')} scheduled "
                                    f"({_n(s.prefill_tokens)} prefill, {_n(s.decode_tokens)} decode)"),
        _card("preemptions", _n(s.preemptions), f"{count(s.preempted_requests, 'request')} preempted",
              "hot" if s.preemptions else ""),
        _card("prefix hit rate", percent(s.prefix_hit_rate),
              f"{_n(s.local_cached_tokens)} of {count(s.prompt_tokens, 'prompt token')} from the "
              "local cache"),
        _card("external hit rate", percent(s.external_hit_rate),
              f"{count(s.external_cached_tokens, 'prompt token')} from the connector"),
        _card("KV usage", "—" if s.peak_kv_used is None
              else f"peak {_n(s.peak_kv_used)}/{_n(s.usable_blocks)}",
              "" if s.mean_kv_used is None else f"mean {s.mean_kv_used:,.1f} blocks "
                                                f"({percent(s.mean_kv_used / max(1, s.usable_blocks))})"),
    ]
    if s.lookups or s.loads:
        cards.append(_card("connector", count(s.lookups, "lookup"),
                           f"{_n(s.lookups_not_ready)} not ready, {_n(s.lookups_async)} async; "
                           f"{count(s.loads, 'load')} ({count(s.load_tokens, 'token')}); "
                           f"{_n(s.failed_recving)} failed, {count(s.invalid_blocks, 'invalid block')}"))
    if divs is not None:
        reqs = {d.req for d in divs if d.req is not None}
        cards.append(_card("divergences", f"{len(divs):,}",
                           f"in {count(len(reqs), 'request')}" if divs else "none",
                           "bad" if divs else "good"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _div_bands(steps: Iterable[int], max_runs: int) -> list[Band]:
    out = []
    for a, b in step_runs(steps, max_runs):
        title = f"step {a}: divergence" if a == b else f"steps {a}–{b}: divergences"
        out.append(Band(a, b + 1, C_DIVERGENCE, title, "div-band", BAND_OPACITY))
    return out


def _preempt_lines(steps: list[int]) -> list[tuple]:
    out = []
    for a, b in step_runs(steps):
        out.append((a + 0.5, C_PREEMPT, f"step {a}: preemption" if a == b
                    else f"steps {a}–{b}: preemptions", "3,3"))
    return out


def _run_charts(p: _Page) -> str:
    div_steps = [d.step for d in p.divs if d.step is not None]
    first = p.first_mark()
    sides = [(p.s, "A" if p.b is not None else None, True)]
    if p.b is not None:
        sides.append((p.b, "B", False))
    marks = [(C_DIVERGENCE, "steps with divergences" + (" (A's steps)" if p.b is not None else ""),
              "band")]
    if first is not None:
        marks.append((C_FIRST, "first divergence", "flag"))
    marks.append((C_PREEMPT, "preemption", "dash"))
    out = ['<section id="kv"><h2>KV usage and load</h2>']

    def each(title: str, draw) -> None:
        out.append(f"<h3>{title}</h3>")
        for s, label, marked in sides:
            if label:
                out.append(f'<div class="trace-chart" data-trace="{label}">'
                           + f'<span class="tag tag-{label.lower()}">{label}</span>')
            bands = _div_bands(div_steps, MAX_RUNS) if marked else []
            out.append(draw(s, bands, first if marked else None))
            if label:
                out.append("</div>")

    def kv(s, bands, fm):
        if not len(s.kv_used):
            return '<p class="muted">The trace does not record num_free_blocks: no KV usage chart.</p>'
        return chart("chart kv-chart", 0, p.steps, s.usable_blocks,
                     [dict(points=s.kv_used.points(), color=C_KV, kind="area", label="blocks in use")],
                     hlines=[(s.usable_blocks, "#888", f"{count(s.usable_blocks, 'usable block')}")],
                     vlines=_preempt_lines(s.preemption_steps), bands=bands, first=fm,
                     y_label="blocks", height=200)

    def tokens(s, bands, fm):
        budget = s.header.config.max_num_scheduled_tokens or s.header.config.max_num_batched_tokens
        return chart("chart tokens-chart", 0, p.steps, max(budget, s.sched_tokens.max or 0),
                     [dict(points=s.sched_tokens.points(), color=C_SCHED, kind="area",
                           label="scheduled tokens")],
                     hlines=[(budget, "#888", f"token budget {_n(budget)}")],
                     vlines=_preempt_lines(s.preemption_steps), bands=bands, first=fm,
                     y_label="tokens", height=150)

    def reqs(s, bands, fm):
        return chart("chart requests-chart", 0, p.steps, max(1, s.live.max or 0, s.running.max or 0),
                     [dict(points=s.live.points(), color=C_LIVE, kind="step",
                           label="live (arrived, not finished)"),
                      dict(points=s.running.points(), color=C_RUNNING, kind="step", label="scheduled")],
                     vlines=_preempt_lines(s.preemption_steps), bands=bands, first=fm,
                     y_label="requests", height=130)

    each("KV blocks in use (after each step)", kv)
    out.append(legend([(C_KV, "blocks in use", "area")] + marks))
    each("Tokens scheduled per step", tokens)
    out.append(legend([(C_SCHED, "scheduled tokens", "area")] + marks))
    each("Requests", reqs)
    out.append(legend([(C_LIVE, "live (arrived, not finished)", "line"),
                       (C_RUNNING, "scheduled in the step", "line")] + marks))
    out.append("</section>")
    return "\n".join(out)


# --------------------------------------------------------------------------- the table


def _divergence_section(p: _Page, note: str | None) -> str:
    e = html.escape
    out = ['<section id="divergences"><h2>Divergences</h2>']
    if p.source == "diff":
        out.append(f'<p class="muted">From <code>kvtrace diff</code>: A is '
                   f"{e(os.path.basename(path_text(p.s.path)))}, B is "
                   f"{e(os.path.basename(path_text(p.b.path))) if p.b is not None else 'the other trace'}. "
                   "A divergence's step is A's.</p>")
    elif p.source == "replay":
        out.append('<p class="muted">From <code>kvtrace replay</code>: recorded is this trace, '
                   "expected is the reference scheduler.</p>")
    if note:
        out.append(f'<p class="warn">{e(note)}</p>')
    if p.stop:
        out.append(f'<p class="warn stop">Only the steps before the stop were checked: '
                   f'{e(p.stop)}.</p>')
    if not p.divs:
        out.append('<p class="ok">No divergence.</p></section>' if not note else "</section>")
        return "\n".join(out)
    out.append(f'<p class="muted">One row per request: its likely cause (the earliest divergence in '
               f"cause-and-effect order), with the rest folded under it. "
               f"{count(len(p.divs), 'divergence')}, {count(len(p.findings), 'row')}.</p>")
    out.append(f'<table class="divs"><thead><tr><th>step</th><th>request</th><th>field</th>'
               f"<th>{p.rec}</th><th>{p.exp}</th><th>rule</th><th>count</th></tr></thead>")
    index = {id(st.cause): i for i, st in enumerate(p.findings)}
    for i, st in enumerate(p.findings[:MAX_TABLE_ROWS]):
        out.append(_request_rows(p, i, st, index))
    out.append("</table>")
    if len(p.findings) > MAX_TABLE_ROWS:
        out.append(f'<p class="muted">… and {e(left_out(p.findings[MAX_TABLE_ROWS:]))} '
                   "(use <code>--json</code> on replay or diff for all of them)</p>")
    out.append("</section>")
    return "\n".join(out)


def _request_rows(p: _Page, i: int, st: RequestFindings, index: dict) -> str:
    e = html.escape
    d = st.cause
    cls = "story headline" if i == p.head_index else "story"
    rows = [f'<tbody class="{cls}" id="story-{i}" data-step="{"" if d.step is None else d.step}">',
            f"<tr class=\"story\"><td class=\"num\">{'—' if d.step is None else d.step}</td>"
            f"<td class=\"rq\">{'(all)' if d.req is None else _req_link(p.s, d.req)}</td>"
            f"<td>{e(d.field)}</td>"
            f"<td>{_value(d.field, d.recorded, 'rec')}</td><td>{_value(d.field, d.expected, 'exp')}</td>"
            f"<td>{_rule(d.rule)}</td><td class=\"num\">{st.count:,}</td></tr>"]
    more = []
    if i == p.head_index:
        more.append('<div class="first-tag">first divergence: the likely cause of what follows</div>')
    if st.after is not None:
        a = st.after
        j = index.get(id(a))
        target = f'<a href="#story-{j}">{e(_req(a.req))}</a>' if j is not None else e(_req(a.req))
        said = "likely follows from" if a.step == d.step else "may follow from"
        more.append(f'<div class="after">{said} {target}'
                    + (f" at step {a.step}" if a.step is not None else "") + "</div>")
    why = why_text(d)
    if why:
        more.append(f'<div class="why">{e(why)}</div>')
    if st.folds:
        n = st.count - 1
        summary = f"+ {_n(n)} more in {e(_req(st.req))}" + _steps_text(_request_steps(st))
        items = []
        for f in st.folds:
            fd = f.first
            items.append(f"<li>+ {_n(f.count)} more <b>{e(fd.field)}</b>" + _steps_text((f.first_step, f.last_step))
                         + f" · {_rule(fd.rule, inline=True)} · first: {p.rec} "
                         f"{_value(fd.field, fd.recorded, 'rec')}, "
                         f"{p.exp} {_value(fd.field, fd.expected, 'exp')}"
                         + (f" <span class=\"muted\">(line {fd.line})</span>" if fd.line is not None else "")
                         + "</li>")
        more.append(f'<details class="folds"><summary>{summary}</summary><ul>{"".join(items)}</ul></details>')
    if more:
        rows.append(f'<tr class="story-more"><td></td><td colspan="6">{"".join(more)}</td></tr>')
    rows.append("</tbody>")
    return "".join(rows)


def _request_steps(st: RequestFindings) -> tuple[int | None, int | None]:
    steps = [x for x in [st.cause.step] + [f.first_step for f in st.folds] + [f.last_step for f in st.folds]
             if x is not None]
    return (min(steps), max(steps)) if steps else (None, None)


def _steps_text(span: tuple[int | None, int | None]) -> str:
    a, b = span
    if a is None:
        return ""
    return f", step {a}" if a == b else f", steps {a}–{b}"


def _rule(rule: str, full: bool = False, inline: bool = False) -> str:
    """A rule's id ("1.3") with its text as a second line (or a tooltip)."""
    e = html.escape
    rid, sep, text = rule_words(rule).partition(": ")
    if not sep:
        return f'<span class="rule-id">{e(rule)}</span>'
    if full:
        return f'rule <span class="rule-id">{e(rid)}</span>: {e(text)}'
    if inline:
        return f'<span class="rule-id" title="{e(text)}">{e(rid)}</span>'
    return (f'<span class="rule-id" title="{e(text)}">{e(rid)}</span>'
            f'<div class="rule-text">{e(text)}</div>')


def _value(field: str, v: Any, cls: str) -> str:
    """A value of ``field`` in the terminal's words (``failures.value_text``);
    in full when it is text (a kv-content finding is a sentence), else cut
    at ``VALUE_CHARS`` with the whole of it as a tooltip."""
    e = html.escape
    if isinstance(v, str):
        return f'<span class="{cls}">{e(value_text(field, v))}</span>'
    whole = value_text(field, v)
    short = _plain(field, v)
    tip = f' title="{e(whole)}"' if whole != short else ""
    return f'<span class="{cls}"{tip}>{e(short)}</span>'


def _plain(field: str, v: Any) -> str:
    """A value in the terminal's words, cut at ``VALUE_CHARS``."""
    text = value_text(field, v)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 1] + "…"


def _req(req: str | None) -> str:
    return "the step-wide counts" if req is None else req


def _req_link(s: RunSummary, req: str) -> str:
    tl = s.timelines.get(req)
    if tl is None:
        return html.escape(req)
    return f'<a href="#req-{tl.index}">{html.escape(req)}</a>'


# --------------------------------------------------------------------------- timelines


def _request_section(p: _Page, by_req: dict[str | None, list[Divergence]]) -> str:
    s = p.s
    tls = sorted(s.timelines.values(), key=lambda t: t.index)
    out = ['<section id="requests"><h2>Request timelines'
           + (' <span class="muted">(A; B under each request that diverges)</span>'
              if p.b is not None else "") + "</h2>",
           '<p class="controls"><label>filter by request id <input id="req-filter" type="search" '
           'placeholder="request id"></label> <label><input id="only-div" type="checkbox"> '
           "only requests with divergences</label></p>"]
    if s.timelines_left_out:
        out.append(f'<p class="muted">{len(tls)} of {s.requests} requests drawn: the first by arrival '
                   f"and those with divergences.</p>")
    out.append(legend([(C_COMPUTED, "num_computed_tokens", "line"),
                       (C_CACHED, "cached (local hit at admission)", "line"),
                       (C_EXTERNAL, "external (connector hit at admission)", "line"),
                       (C_BLOCKS, "blocks (right axis)", "dash"),
                       (C_PREEMPT, "preemption", "dash"), (C_LOAD, "KV load", "band"),
                       (C_DIVERGENCE, "steps with divergences", "band"),
                       (C_DIVERGENCE, p.rec, "dot"), (C_EXPECTED, p.exp, "ring"),
                       (C_FIRST, "first divergence", "flag")]))
    for tl in tls:
        out.append(_request_card(p, tl, by_req.get(tl.req, [])))
    out.append("</section>")
    return "\n".join(out)


def _request_card(p: _Page, tl: RequestTimeline, divs: list[Divergence]) -> str:
    """A request's card: its figures and its chart; with ``--against``, the
    same request's chart in B under it, where B has a request of that id."""
    e = html.escape
    s = p.s
    end = (tl.finish_step + 1) if tl.finish_step is not None else max(s.steps, tl.arrival_step + 1)
    status = (f"finished ({tl.finish_reason}) at step {tl.finish_step}" if tl.finish_reason
              else "not finished in the trace")
    stats = ""
    if tl.prefill_stats is not None:
        ps = tl.prefill_stats
        stats = (f"prompt stats: prompt {_n(ps.num_prompt_tokens)}, local "
                 f"{_n(ps.num_local_cached_tokens)}, external {_n(ps.num_external_cached_tokens)}, "
                 f"computed {_n(ps.num_computed_tokens)}, cache creation "
                 f"{_n(ps.num_cache_creation_tokens)}")
    elif tl.legacy is not None:
        stats = (f"legacy counters: num_cached_tokens {_n(tl.legacy.num_cached_tokens)}, "
                 f"num_external_computed_tokens {_n(tl.legacy.num_external_computed_tokens)}")
    cls = "req has-div" if divs else "req"
    zoom = (f' <button class="zoom-to" type="button" data-from="{max(0, tl.arrival_step - 1)}" '
            f'data-to="{min(p.steps, end + 1)}">zoom to steps {tl.arrival_step}–{end}</button>')
    out = [f'<div class="{cls}" id="req-{tl.index}" data-req="{e(tl.req)}">',
           f"<h3>{e(tl.req)}" + (f' <span class="badge">{count(len(divs), "divergence")}'
                                  '</span>' if divs else "") + zoom + "</h3>",
           f'<p class="meta">arrived before step {tl.arrival_step} · prompt '
           f"{count(tl.prompt_len, 'token')} · max_tokens {_n(tl.max_tokens)} · priority "
           f"{tl.priority} · scheduled in {count(tl.steps_scheduled, 'step')} "
           f"({count(tl.tokens_scheduled, 'token')}) · {count(tl.num_preemptions, 'preemption')} · "
           f"{e(status)}</p>"]
    if stats:
        out.append(f'<p class="meta">{e(stats)}</p>')
    other = p.b.timelines.get(tl.req) if p.b is not None else None
    if other is not None:
        out.append(f'<p class="meta">{_trace_tag(s, "A")}</p>')
    out.append(_request_chart(p, s, tl, divs))
    if other is not None:
        out.append(f'<p class="meta">{_trace_tag(p.b, "B")} · scheduled in '
                   f"{count(other.steps_scheduled, 'step')} ({count(other.tokens_scheduled, 'token')})"
                   f" · {count(other.num_preemptions, 'preemption')}</p>")
        out.append(_request_chart(p, p.b, other, divs, trace_b=True))
    if tl.marks:
        out.append(f"<details><summary>{count(len(tl.marks), 'event')}</summary><ul class=\"marks\">")
        for m in tl.marks:
            out.append(f'<li class="mk-{e(m.kind)}"><b>step {m.step}</b> {e(m.kind)}'
                       + (f": {e(m.text)}" if m.text else "") + "</li>")
        if tl.marks_left_out:
            out.append(f"<li>… and {_n(tl.marks_left_out)} more</li>")
        out.append("</ul></details>")
    out.append("</div>")
    return "\n".join(out)


def _request_chart(p: _Page, s: RunSummary, tl: RequestTimeline, divs: list[Divergence],
                   trace_b: bool = False) -> str:
    """A request's chart in trace ``s``: its counts and blocks over the steps,
    its loads and preemptions, and its divergences as bands (A's steps; in B's
    chart too, where a diff names them) and dots (A's chart only)."""
    bs = s.header.config.block_size
    end = (tl.finish_step + 1) if tl.finish_step is not None else max(s.steps, tl.arrival_step + 1)
    ymax = max(tl.computed.max or 0, (tl.blocks.max or 0) * bs, tl.cached.max or 0,
               tl.external.max or 0, tl.prompt_len, 1)
    for d in divs:
        for v in (d.recorded, d.expected):
            if _is_num(v) and d.field in _DOT_FIELDS and 0 <= v <= 4 * ymax:
                ymax = max(ymax, v)
    blocks_pts = [(x, y * bs) for x, y in tl.blocks.points()]
    series = [
        dict(points=blocks_pts, color=C_BLOCKS, kind="step", dash="4,3", label="blocks × block size"),
        dict(points=tl.cached.points(), color=C_CACHED, kind="step", label="cached"),
        dict(points=tl.external.points(), color=C_EXTERNAL, kind="step", label="external"),
        dict(points=tl.computed.points(), color=C_COMPUTED, kind="step", label="num_computed_tokens",
             width=2),
    ]
    vlines, bands, dots = [], [], []
    wait_start = None
    for m in tl.marks:
        if m.kind == "preempted":
            vlines.append((m.step + 0.5, C_PREEMPT, f"step {m.step}: {m.text}", "3,2"))
        elif m.kind == "async-wait":
            wait_start = m.step if wait_start is None else wait_start
        elif m.kind in ("admitted", "resumed") and wait_start is not None:
            bands.append(Band(wait_start, m.step, C_LOAD, f"steps {wait_start}–{m.step}: asynchronous KV load"))
            wait_start = None
        elif m.kind == "load":
            bands.append(Band(m.step, m.step + 1, C_LOAD, f"step {m.step}: {m.text}"))
        elif m.kind == "load-failed":
            vlines.append((m.step + 0.5, C_DIVERGENCE, f"step {m.step}: {m.text}", "1,2"))
    if wait_start is not None:
        bands.append(Band(wait_start, end, C_LOAD, f"from step {wait_start}: asynchronous KV load"))
    bands += _div_bands([d.step for d in divs if d.step is not None], MAX_REQ_RUNS)
    seen: set = set()
    for d in divs:   # the plotted count only: its recorded and expected values
        key = (d.step, d.recorded, d.expected)
        if (trace_b or d.step is None or d.field not in _DOT_FIELDS or not _is_num(d.recorded)
                or not _is_num(d.expected) or key in seen or len(seen) >= MAX_REQ_DOTS):
            continue
        seen.add(key)
        title = (f"step {d.step}: {d.field} {p.rec} {value_text(d.field, d.recorded)}, "
                 f"{p.exp} {value_text(d.field, d.expected)}")
        dots.append((d.step + 0.5, d.recorded, C_DIVERGENCE, title, True))
        dots.append((d.step + 0.5, d.expected, C_EXPECTED, title, False))
    return chart("chart req-chart" + (" req-chart-b" if trace_b else ""), 0, p.steps, ymax,
                 series, vlines=vlines, bands=bands, dots=dots,
                 first=p.first_mark(), first_light=p.head is None or p.head.req != tl.req,
                 x_end=end, y_label="tokens", right_scale=bs, right_label="blocks", height=150)


_DOT_FIELDS = {"num_computed_tokens", "state.num_computed_tokens"}   # the blue line


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CSS = """
:root{--fg:#222;--muted:#666;--bad:#e45756;--good:#2ca02c}
*{box-sizing:border-box}
html{scroll-padding-top:84px}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--fg);margin:0;background:#fafafa}
header{padding:12px 24px 8px;background:#fff;border-bottom:1px solid #ddd}
h1{font-size:20px;margin:0 0 4px} h1 .file{font-weight:400;color:var(--muted)}
h2{font-size:17px;margin:20px 0 8px} h3{font-size:14px;margin:12px 0 4px}
main{padding:0 24px 40px;max-width:1180px}
.sub,.muted{color:var(--muted);margin:2px 0}
.warn{color:#8a5a00;background:#fff4d6;padding:4px 8px;border-radius:4px}
.ok{color:var(--good)}
.headline{margin:14px 0 6px;padding:8px 14px;border-radius:6px;background:#fff;border:1px solid #ddd;border-left:6px solid #999}
.headline.bad{border-left-color:var(--bad);background:#fff7f6}
.headline.good{border-left-color:var(--good)}
.headline p{margin:3px 0}
.headline .verdict{font-size:16px;font-weight:600}
.headline .first-div{font-size:15px}
.headline .label{background:#222;color:#fff;border-radius:3px;padding:0 6px;font-size:12px;margin-right:4px}
.headline .rule{color:#444}
.headline .stop{color:var(--bad);font-weight:600}
.jump a{font-weight:600}
.why{color:#1a5e2a}
#axis{position:sticky;top:0;z-index:5;background:#fafafa;border-bottom:1px solid #ddd;padding:6px 0;display:flex;align-items:center;gap:8px;flex-wrap:wrap}
#axis input[type=range]{width:200px}
#zoom-label{font-variant-numeric:tabular-nums;min-width:90px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(128px,1fr));gap:8px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:5px 10px}
.card .label{color:var(--muted);font-size:11px;text-transform:uppercase;letter-spacing:.03em}
.card .value{font-size:20px;font-weight:600}
.card .subv{font-size:11px;line-height:1.3;color:var(--muted)}
.card.bad .value{color:var(--bad)} .card.good .value{color:var(--good)} .card.hot .value{color:#c46a00}
.tag{display:inline-block;border-radius:3px;padding:0 6px;font-size:12px;font-weight:700;color:#fff;background:#555}
.tag-a{background:#4c78a8} .tag-b{background:#9d755d}
.trace-chart{position:relative;margin:2px 0}
.trace-chart>.tag{position:absolute;left:4px;top:2px}
table.compare{border-collapse:collapse;background:#fff;font-size:13px}
table.compare th,table.compare td{border:1px solid #ddd;padding:3px 10px;text-align:left}
table.compare tbody th{font-weight:400;color:var(--muted)}
table.compare tr.differs td{background:#fff4d6;font-weight:600}
svg.chart{display:block;background:#fff;border:1px solid #eee;max-width:100%;height:auto;cursor:crosshair;user-select:none}
svg .tick{font-size:11px;fill:#666} svg .axis{font-size:11px;fill:#444}
svg .sel{fill:#4c78a8;fill-opacity:.15;stroke:#4c78a8}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;color:#444;margin:4px 0 8px}
.legend .sw{vertical-align:middle}
table.divs{border-collapse:collapse;background:#fff;width:100%;font-size:13px}
table.divs th,table.divs td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
table.divs thead th{background:#f3f3f3}
tbody.story tr.story{background:#fdf3f2}
tbody.story.headline tr.story{background:#fbd9d5}
tbody.story tr.story-more td{border-top:none;font-size:12px;padding-top:0}
tbody.story:target td{background:#fff3b0}
.rule-id{font-weight:600;white-space:nowrap}
.rule-text{font-size:12px;color:var(--muted)}
.after{color:#8a5a00} .first-tag{color:#222;font-weight:600}
details.folds summary{cursor:pointer;color:#444}
details.folds ul{margin:2px 0;padding-left:18px}
td.rq{white-space:nowrap} td.num{text-align:right;font-variant-numeric:tabular-nums}
.rec{color:#b22222;font-family:ui-monospace,monospace;overflow-wrap:anywhere}
.exp{color:#1a7f37;font-family:ui-monospace,monospace;overflow-wrap:anywhere}
.req{background:#fff;border:1px solid #ddd;border-radius:6px;padding:4px 12px 8px;margin:8px 0}
.req.has-div{border-color:var(--bad);box-shadow:0 0 0 1px var(--bad)}
.req .meta{font-size:12px;color:var(--muted);margin:0}
.req h3 button{font-size:11px;margin-left:8px}
.badge{background:var(--bad);color:#fff;border-radius:10px;padding:0 8px;font-size:12px;font-weight:400}
ul.marks{font-size:12px;margin:4px 0;padding-left:18px}
.hidden{display:none}
code{background:#f0f0f0;padding:0 3px;border-radius:3px}
"""

_JS = """
(function(){
  var f=document.getElementById('req-filter'), o=document.getElementById('only-div');
  if(!f||!o){return;}
  function apply(){
    var q=f.value.trim().toLowerCase(), cards=document.querySelectorAll('.req');
    for(var i=0;i<cards.length;i++){
      var c=cards[i], id=(c.getAttribute('data-req')||'').toLowerCase();
      var show=(!q||id.indexOf(q)>=0)&&(!o.checked||c.classList.contains('has-div'));
      c.classList.toggle('hidden',!show);
    }
  }
  f.addEventListener('input',apply); o.addEventListener('change',apply);
})();
(function(){
  var bar=document.getElementById('axis'); if(!bar){return;}
  var N=+bar.getAttribute('data-steps'), lo=0, hi=N, NS='http://www.w3.org/2000/svg';
  var from=document.getElementById('zoom-from'), to=document.getElementById('zoom-to');
  var label=document.getElementById('zoom-label');
  var charts=Array.prototype.slice.call(document.querySelectorAll('svg.chart'));
  function nice(span,target){
    if(span<=0){return 1;}
    var raw=span/target, mag=Math.pow(10,Math.floor(Math.log10(raw))), ms=[1,2,2.5,5,10];
    for(var i=0;i<ms.length;i++){if(raw<=ms[i]*mag){return ms[i]*mag;}}
    return 10*mag;
  }
  function el(name,attrs,text){
    var n=document.createElementNS(NS,name);
    for(var k in attrs){n.setAttribute(k,attrs[k]);}
    if(text!==undefined){n.textContent=text;}
    return n;
  }
  function draw(c){
    var L=+c.dataset.l, T=+c.dataset.t, pw=+c.dataset.pw, ph=+c.dataset.ph;
    c.querySelector('svg.plot').setAttribute('viewBox',lo+' 0 '+(hi-lo)+' '+ph);
    var g=c.querySelector('g.xticks'); while(g.firstChild){g.removeChild(g.firstChild);}
    var st=Math.max(1,Math.round(nice(hi-lo,10)));
    for(var t=Math.ceil(lo/st)*st;t<=hi+1e-9;t+=st){
      var x=(L+(t-lo)/(hi-lo)*pw).toFixed(1), a=x>L+pw-20?'end':'middle';
      g.appendChild(el('line',{x1:x,x2:x,y1:T+ph,y2:T+ph+4,stroke:'#999'}));
      g.appendChild(el('text',{x:x,y:T+ph+16,'text-anchor':a,'class':'tick'},String(t)));
    }
  }
  function set(a,b){
    a=Math.max(0,Math.min(N-1,Math.floor(+a))); b=Math.min(N,Math.max(a+1,Math.ceil(+b)));
    lo=a; hi=b; from.value=a; to.value=b; label.textContent=a+'\\u2013'+b;
    charts.forEach(draw);
  }
  window.kvtraceZoom=set;
  from.addEventListener('input',function(){set(from.value,Math.max(hi,+from.value+1));});
  to.addEventListener('input',function(){set(Math.min(lo,+to.value-1),to.value);});
  document.getElementById('zoom-reset').addEventListener('click',function(){set(0,N);});
  var links=document.querySelectorAll('[data-zoom]');
  for(var i=0;i<links.length;i++){links[i].addEventListener('click',function(){
    var k=+this.getAttribute('data-zoom'), w=Math.max(8,Math.round(N/20)); set(k-w,k+w+1);});}
  var btns=document.querySelectorAll('button.zoom-to');
  for(var j=0;j<btns.length;j++){btns[j].addEventListener('click',function(){
    set(this.getAttribute('data-from'),this.getAttribute('data-to'));});}
  var drag=null;
  function step(c,ev){
    var r=c.getBoundingClientRect(), vb=c.viewBox.baseVal, x=(ev.clientX-r.left)*vb.width/r.width;
    var L=+c.dataset.l, pw=+c.dataset.pw; x=Math.max(L,Math.min(L+pw,x));
    return {x:x,k:lo+(x-L)/pw*(hi-lo)};
  }
  charts.forEach(function(c){
    c.addEventListener('mousedown',function(ev){
      var p=step(c,ev), T=+c.dataset.t, ph=+c.dataset.ph;
      var r=el('rect',{'class':'sel',x:p.x,y:T,width:0,height:ph}); c.appendChild(r);
      drag={c:c,p:p,r:r}; ev.preventDefault();
    });
    c.addEventListener('dblclick',function(){set(0,N);});
  });
  window.addEventListener('mousemove',function(ev){
    if(!drag){return;}
    var q=step(drag.c,ev);
    drag.r.setAttribute('x',Math.min(q.x,drag.p.x)); drag.r.setAttribute('width',Math.abs(q.x-drag.p.x));
  });
  window.addEventListener('mouseup',function(ev){
    if(!drag){return;}
    var q=step(drag.c,ev), d=drag; drag=null; d.c.removeChild(d.r);
    if(Math.abs(q.x-d.p.x)>4){set(Math.min(q.k,d.p.k),Math.max(q.k,d.p.k));}
  });
})();
"""
