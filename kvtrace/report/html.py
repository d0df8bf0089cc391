"""A self-contained HTML report of one trace: run summary, KV usage, request
timelines and divergences.

Everything is inline: CSS, a few lines of JavaScript (a request filter) and SVG
charts drawn here, in Python. The page fetches nothing, so it opens offline
and can be mailed or attached to a bug.

Big traces stay small: series are downsampled while the trace is read (see
``figures.Series``), and timelines are drawn for the first ``max_requests``
requests plus every request with a divergence (up to ``max_divergent``).
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

from .._text import path_text
from ..findings import Divergence
from ..outputs import writing
from .figures import RequestTimeline, RunSummary, kv_groups_text, percent
from .summary import summarize
from .svg import chart, legend
from .terminal import format_value, replayed_up_to

MAX_REQUESTS = 40          # timelines drawn for the first requests by arrival ...
MAX_DIVERGENT = 200        # ... plus this many requests with divergences
MAX_TABLE_ROWS = 500       # divergence rows in the table
MAX_DIV_MARKS = 400        # divergence lines on the run-level charts

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
C_EXPECTED = "#2ca02c"
C_LIVE = "#9d755d"
C_RUNNING = "#b279a2"


@dataclass
class HtmlReport:
    path: str
    summary: RunSummary
    divergences: list[Divergence]
    source: str                      # "replay", "diff" or "given"
    note: str | None = None          # why no divergences could be computed, if so
    timelines: int = 0


def write_html_report(trace: str | os.PathLike, out_html: str | os.PathLike,
                      divergences: Iterable[Divergence], source: str = "given",
                      against: str | os.PathLike | None = None, note: str | None = None,
                      max_requests: int = MAX_REQUESTS,
                      max_divergent: int = MAX_DIVERGENT) -> HtmlReport:
    """Write the report of ``trace`` and its ``divergences`` to ``out_html``.

    ``source`` says where the divergences come from (``replay``, ``diff``
    with ``against``, or ``given``); ``note`` why there are none to show (a
    trace that replay refuses still gets a report, with the reason in their
    place). This renders; the caller runs the analysis. Raises ``TraceError``
    when the trace is unusable.
    """
    divs = list(divergences)
    divergent: list[str] = []
    seen: set = set()
    for d in sorted(divs, key=_div_key):
        if d.req is not None and d.req not in seen:
            seen.add(d.req)
            if len(divergent) < max_divergent:
                divergent.append(d.req)
    s = summarize(trace, keep=divergent, max_timelines=max_requests)
    page = render(s, divs, source=source, against=None if against is None else path_text(against),
                  note=note)
    # errors: a file name shown in the page may hold bytes that are not UTF-8
    with writing(out_html) as out, out.open("w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(page)
    return HtmlReport(path=os.fspath(out_html), summary=s, divergences=divs, source=source,
                      note=note, timelines=len(s.timelines))


def _div_key(d: Divergence):
    return (d.step is None, d.step or 0, d.seq is None, d.seq or 0)


# --------------------------------------------------------------------------- page


def render(s: RunSummary, divs: list[Divergence], source: str = "replay",
           against: str | None = None, note: str | None = None) -> str:
    """The whole page as a string."""
    e = html.escape
    h = s.header
    cfg = h.config
    path = path_text(s.path)   # a file name is any bytes: shown with \xNN escapes
    name = os.path.basename(path)
    divs = sorted(divs, key=_div_key)
    by_req: dict[str | None, list[Divergence]] = {}
    for d in divs:
        by_req.setdefault(d.req, []).append(d)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvtrace report: {e(name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header>",
        f"<h1>kvtrace report <span class=\"file\">{e(name)}</span></h1>",
        f"<p class=\"sub\">{e(path)} · engine {e(h.engine)} {e(h.engine_version)} · "
        f"{s.steps} steps · {s.requests} requests</p>",
        f"<p class=\"sub\">block size {cfg.block_size} · {cfg.num_blocks} blocks "
        f"({s.usable_blocks} usable) · token budget {cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens}"
        f" · max_num_seqs {cfg.max_num_seqs} · policy {e(cfg.policy)}"
        f" · prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
        + (f" · connector {e(cfg.connector.name)} ({e(cfg.connector.load_failure_policy)})"
           if cfg.connector else "")
        + (f" · KV cache {e(groups)}" if (groups := kv_groups_text(h.features)) else "") + "</p>",
    ]
    trunc = replayed_up_to(s.truncation, "read")
    if trunc:
        parts.append(f'<p class="warn">truncated: {e(trunc)}</p>')
    if s.end is not None and (s.end.status != "complete" or s.end.dropped_events):
        parts.append(f'<p class="warn">the recorder closed this trace as \'{e(s.end.status)}\''
                     + (f", {s.end.dropped_events} events dropped" if s.end.dropped_events else "")
                     + (f": {e(s.end.error)}" if s.end.error else "") + "</p>")
    parts.append("</header><main>")
    parts.append(_summary_cards(s, divs))
    parts.append(_run_charts(s, divs))
    parts.append(_divergence_section(s, divs, source, against, note))
    parts.append(_request_section(s, by_req))
    parts.append("</main>")
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _card(label: str, value: str, sub: str = "", cls: str = "") -> str:
    e = html.escape
    return (f'<div class="card {cls}"><div class="label">{e(label)}</div>'
            f'<div class="value">{e(value)}</div>'
            + (f'<div class="subv">{e(sub)}</div>' if sub else "") + "</div>")


def _summary_cards(s: RunSummary, divs: list[Divergence]) -> str:
    fin = ", ".join(f"{n} {r}" for r, n in sorted(s.finished.items())) or "none"
    cards = [
        _card("requests", str(s.requests), f"finished: {fin}"),
        _card("steps", str(s.steps), f"{s.scheduled_tokens} tokens scheduled "
                                     f"({s.prefill_tokens} prefill, {s.decode_tokens} decode)"),
        _card("preemptions", str(s.preemptions), f"{s.preempted_requests} requests preempted",
              "hot" if s.preemptions else ""),
        _card("prefix hit rate", percent(s.prefix_hit_rate),
              f"{s.local_cached_tokens} of {s.prompt_tokens} prompt tokens from the local cache"),
        _card("external hit rate", percent(s.external_hit_rate),
              f"{s.external_cached_tokens} prompt tokens from the connector"),
        _card("KV usage", "—" if s.peak_kv_used is None else f"peak {s.peak_kv_used}/{s.usable_blocks}",
              "" if s.mean_kv_used is None else f"mean {s.mean_kv_used:.1f} blocks "
                                                f"({percent(s.mean_kv_used / max(1, s.usable_blocks))})"),
    ]
    if s.lookups or s.loads:
        cards.append(_card("connector", f"{s.lookups} lookups",
                           f"{s.lookups_not_ready} not ready, {s.lookups_async} async; {s.loads} loads "
                           f"({s.load_tokens} tokens); {s.failed_recving} failed, "
                           f"{s.invalid_blocks} invalid blocks"))
    reqs = {d.req for d in divs if d.req is not None}
    cards.append(_card("divergences", str(len(divs)),
                       f"in {len(reqs)} requests" if divs else "none", "bad" if divs else "good"))
    return '<section id="summary"><h2>Run summary</h2><div class="cards">' + "".join(cards) + "</div></section>"


def _run_charts(s: RunSummary, divs: list[Divergence]) -> str:
    x1 = max(1, s.steps)
    div_steps = sorted({d.step for d in divs if d.step is not None})
    if len(div_steps) > MAX_DIV_MARKS:
        div_steps = div_steps[:: math.ceil(len(div_steps) / MAX_DIV_MARKS)]
    vlines = [(k, C_PREEMPT, f"step {k}: preemption", "2,2") for k in s.preemption_steps]
    vlines += [(k, C_DIVERGENCE, f"step {k}: divergence", "") for k in div_steps]
    out = ['<section id="kv"><h2>KV usage and load</h2>']
    legend_marks = legend([(C_PREEMPT, "preemption", "dash"), (C_DIVERGENCE, "divergence", "line")])
    if len(s.kv_used):
        out.append('<h3>KV blocks in use (after each step)</h3>')
        out.append(chart(
            "chart kv-chart", 0, x1, s.usable_blocks,
            [dict(points=s.kv_used.points(), color=C_KV, kind="area", label="blocks in use")],
            hlines=[(s.usable_blocks, "#888", f"{s.usable_blocks} usable blocks")],
            vlines=vlines, y_label="blocks", height=220))
        out.append(legend([(C_KV, "blocks in use", "area")]) + legend_marks)
    else:
        out.append('<p class="muted">The trace does not record num_free_blocks: no KV usage chart.</p>')
    budget = s.header.config.max_num_scheduled_tokens or s.header.config.max_num_batched_tokens
    out.append('<h3>Tokens scheduled per step</h3>')
    out.append(chart(
        "chart tokens-chart", 0, x1, max(budget, s.sched_tokens.max or 0),
        [dict(points=s.sched_tokens.points(), color=C_SCHED, kind="area", label="scheduled tokens")],
        hlines=[(budget, "#888", f"token budget {budget}")], vlines=vlines, y_label="tokens",
        height=160))
    out.append(legend([(C_SCHED, "scheduled tokens", "area")]) + legend_marks)
    out.append('<h3>Requests</h3>')
    out.append(chart(
        "chart requests-chart", 0, x1, max(1, s.live.max or 0, s.running.max or 0),
        [dict(points=s.live.points(), color=C_LIVE, kind="step", label="live (arrived, not finished)"),
         dict(points=s.running.points(), color=C_RUNNING, kind="step", label="scheduled")],
        vlines=vlines, y_label="requests", height=140))
    out.append(legend([(C_LIVE, "live (arrived, not finished)", "line"),
                        (C_RUNNING, "scheduled in the step", "line")]))
    out.append("</section>")
    return "\n".join(out)


def _divergence_section(s: RunSummary, divs: list[Divergence], source: str,
                        against: str | None, note: str | None) -> str:
    e = html.escape
    out = ['<section id="divergences"><h2>Divergences</h2>']
    if source == "diff":
        out.append(f'<p class="muted">From <code>kvtrace diff</code> against {e(against or "")}: '
                   "recorded is this trace, expected is the other.</p>")
    elif source == "replay":
        out.append('<p class="muted">From <code>kvtrace replay</code>: recorded is this trace, '
                   "expected is the reference scheduler.</p>")
    if note:
        out.append(f'<p class="warn">{e(note)}</p>')
    if not divs:
        out.append('<p class="ok">No divergence.</p></section>' if not note else "</section>")
        return "\n".join(out)
    first = divs[0]
    out.append('<p class="first">First divergence: '
               + (f"step {first.step}" if first.step is not None else "outside any step")
               + (f", request {_req_link(s, first.req)}" if first.req is not None else "")
               + f", field <b>{e(first.field)}</b>: recorded <span class=\"rec\">"
               f"{e(format_value(first.recorded, 80))}</span>, expected <span class=\"exp\">"
               f"{e(format_value(first.expected, 80))}</span> <span class=\"muted\">({e(first.rule)})</span></p>")
    out.append('<table class="divs"><thead><tr><th>step</th><th>request</th><th>field</th>'
               "<th>recorded</th><th>expected</th><th>rule</th><th>kind</th><th>line</th></tr></thead><tbody>")
    for d in divs[:MAX_TABLE_ROWS]:
        out.append(
            f'<tr class="divergence" data-step="{"" if d.step is None else d.step}">'
            f"<td class=\"num\">{'—' if d.step is None else d.step}</td>"
            f"<td class=\"rq\">{'(all)' if d.req is None else _req_link(s, d.req)}</td>"
            f"<td>{e(d.field)}</td>"
            f'<td class="rec">{e(format_value(d.recorded, 80))}</td>'
            f'<td class="exp">{e(format_value(d.expected, 80))}</td>'
            f"<td>{e(d.rule)}</td><td>{e(d.kind)}</td>"
            f"<td class=\"num\">{'' if d.line is None else d.line}</td></tr>")
    out.append("</tbody></table>")
    if len(divs) > MAX_TABLE_ROWS:
        out.append(f'<p class="muted">… and {len(divs) - MAX_TABLE_ROWS} more '
                   "(use <code>--json</code> on replay or diff for all of them)</p>")
    out.append("</section>")
    return "\n".join(out)


def _req_link(s: RunSummary, req: str) -> str:
    tl = s.timelines.get(req)
    if tl is None:
        return html.escape(req)
    return f'<a href="#req-{tl.index}">{html.escape(req)}</a>'


def _request_section(s: RunSummary, by_req: dict[str | None, list[Divergence]]) -> str:
    tls = sorted(s.timelines.values(), key=lambda t: t.index)
    out = ['<section id="requests"><h2>Request timelines</h2>',
           '<p class="controls"><label>filter by request id <input id="req-filter" type="search" '
           'placeholder="request id"></label> <label><input id="only-div" type="checkbox"> '
           "only requests with divergences</label></p>"]
    shown = len(tls)
    if s.timelines_left_out:
        out.append(f'<p class="muted">{shown} of {s.requests} requests drawn: the first by arrival '
                   f"and those with divergences.</p>")
    out.append(legend([(C_COMPUTED, "num_computed_tokens", "line"),
                        (C_CACHED, "cached (local hit at admission)", "line"),
                        (C_EXTERNAL, "external (connector hit at admission)", "line"),
                        (C_BLOCKS, "blocks (right axis)", "dash"),
                        (C_PREEMPT, "preemption", "dash"), (C_LOAD, "KV load", "band"),
                        (C_DIVERGENCE, "divergence (recorded)", "dot"),
                        (C_EXPECTED, "expected", "ring")]))
    for tl in tls:
        out.append(_request_card(s, tl, by_req.get(tl.req, [])))
    out.append("</section>")
    return "\n".join(out)


def _request_card(s: RunSummary, tl: RequestTimeline, divs: list[Divergence]) -> str:
    e = html.escape
    bs = s.header.config.block_size
    x0 = tl.arrival_step
    end = (tl.finish_step + 1) if tl.finish_step is not None else max(s.steps, x0 + 1)
    x1 = max(end, x0 + 1)
    ymax = max(tl.computed.max or 0, (tl.blocks.max or 0) * bs, tl.cached.max or 0,
               tl.external.max or 0, tl.prompt_len, 1)
    for d in divs:
        for v in (d.recorded, d.expected):
            if _is_num(v) and d.field in _TOKEN_FIELDS and 0 <= v <= 4 * ymax:
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
            vlines.append((m.step, C_PREEMPT, f"step {m.step}: {m.text}", "3,2"))
        elif m.kind == "async-wait":
            wait_start = m.step if wait_start is None else wait_start
        elif m.kind in ("admitted", "resumed") and wait_start is not None:
            bands.append((wait_start, m.step, C_LOAD, f"steps {wait_start}–{m.step}: asynchronous KV load"))
            wait_start = None
        elif m.kind == "load":
            bands.append((m.step, m.step + 1, C_LOAD, f"step {m.step}: {m.text}"))
        elif m.kind == "load-failed":
            vlines.append((m.step, C_DIVERGENCE, f"step {m.step}: {m.text}", "1,2"))
    if wait_start is not None:
        bands.append((wait_start, x1, C_LOAD, f"from step {wait_start}: asynchronous KV load"))
    for d in divs:
        if d.step is None:
            continue
        title = (f"step {d.step}: {d.field} recorded {format_value(d.recorded, 60)}, "
                 f"expected {format_value(d.expected, 60)} ({d.rule})")
        vlines.append((d.step, C_DIVERGENCE, title, ""))
        if d.field in _TOKEN_FIELDS and _is_num(d.recorded) and _is_num(d.expected):
            dots.append((d.step, d.recorded, C_DIVERGENCE, "recorded " + title, True))
            dots.append((d.step, d.expected, C_EXPECTED, "expected " + title, False))
        else:
            dots.append((d.step, ymax, C_DIVERGENCE, title, True))
    status = (f"finished ({tl.finish_reason}) at step {tl.finish_step}" if tl.finish_reason
              else "not finished in the trace")
    stats = ""
    if tl.prefill_stats is not None:
        p = tl.prefill_stats
        stats = (f"prompt stats: P {p.num_prompt_tokens}, local {p.num_local_cached_tokens}, "
                 f"external {p.num_external_cached_tokens}, computed {p.num_computed_tokens}, "
                 f"cache creation {p.num_cache_creation_tokens}")
    elif tl.legacy is not None:
        stats = (f"legacy counters: num_cached_tokens {tl.legacy.num_cached_tokens}, "
                 f"num_external_computed_tokens {tl.legacy.num_external_computed_tokens}")
    cls = "req has-div" if divs else "req"
    out = [f'<div class="{cls}" id="req-{tl.index}" data-req="{e(tl.req)}">',
           f"<h3>{e(tl.req)}" + (f' <span class="badge">{len(divs)} divergence'
                                  f'{"s" if len(divs) != 1 else ""}</span>' if divs else "") + "</h3>",
           f'<p class="meta">arrived before step {tl.arrival_step} · prompt {tl.prompt_len} tokens · '
           f"max_tokens {tl.max_tokens} · priority {tl.priority} · scheduled in {tl.steps_scheduled} steps "
           f"({tl.tokens_scheduled} tokens) · {tl.num_preemptions} preemptions · {e(status)}</p>"]
    if stats:
        out.append(f'<p class="meta">{e(stats)}</p>')
    out.append(chart("chart req-chart", x0, x1, ymax, series, vlines=vlines, bands=bands, dots=dots,
                      y_label="tokens", right_scale=bs, right_label="blocks", height=170))
    if divs:
        out.append('<ul class="req-divs">')
        for d in divs[:20]:
            out.append(f'<li><b>step {"—" if d.step is None else d.step}</b> {e(d.field)}: recorded '
                       f'<span class="rec">{e(format_value(d.recorded, 80))}</span>, expected '
                       f'<span class="exp">{e(format_value(d.expected, 80))}</span> '
                       f'<span class="muted">{e(d.rule)}</span></li>')
        if len(divs) > 20:
            out.append(f"<li>… and {len(divs) - 20} more</li>")
        out.append("</ul>")
    if tl.marks:
        out.append(f"<details><summary>{len(tl.marks)} events</summary><ul class=\"marks\">")
        for m in tl.marks:
            out.append(f'<li class="mk-{e(m.kind)}"><b>step {m.step}</b> {e(m.kind)}'
                       + (f": {e(m.text)}" if m.text else "") + "</li>")
        if tl.marks_left_out:
            out.append(f"<li>… and {tl.marks_left_out} more</li>")
        out.append("</ul></details>")
    out.append("</div>")
    return "\n".join(out)


_TOKEN_FIELDS = {"num_computed_tokens", "num_scheduled_tokens", "num_tokens"}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CSS = """
:root{--fg:#222;--muted:#666;--bad:#e45756;--good:#2ca02c}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--fg);margin:0;background:#fafafa}
header{padding:14px 24px;background:#fff;border-bottom:1px solid #ddd}
h1{font-size:20px;margin:0 0 4px} h1 .file{font-weight:400;color:var(--muted)}
h2{font-size:17px;margin:22px 0 8px} h3{font-size:14px;margin:14px 0 4px}
main{padding:0 24px 40px;max-width:1180px}
.sub,.muted{color:var(--muted);margin:2px 0}
.warn{color:#8a5a00;background:#fff4d6;padding:4px 8px;border-radius:4px}
.ok{color:var(--good)}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px;max-width:260px}
.card .label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.03em}
.card .value{font-size:22px;font-weight:600}
.card .subv{font-size:12px;color:var(--muted)}
.card.bad .value{color:var(--bad)} .card.good .value{color:var(--good)} .card.hot .value{color:#c46a00}
svg.chart{display:block;background:#fff;border:1px solid #eee;max-width:100%;height:auto}
svg .tick{font-size:11px;fill:#666} svg .axis{font-size:11px;fill:#444}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;color:#444;margin:4px 0 8px}
.legend .sw{vertical-align:middle}
table.divs{border-collapse:collapse;background:#fff;width:100%;font-size:13px}
table.divs th,table.divs td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
table.divs tr.divergence{background:#fdecea}
td.rq{white-space:nowrap} td.num{text-align:right;font-variant-numeric:tabular-nums}
.rec{color:#b22222;font-family:ui-monospace,monospace} .exp{color:#1a7f37;font-family:ui-monospace,monospace}
.first{background:#fdecea;border-left:4px solid var(--bad);padding:6px 10px}
.req{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 12px 10px;margin:10px 0}
.req.has-div{border-color:var(--bad);box-shadow:0 0 0 1px var(--bad)}
.req .meta{font-size:12px;color:var(--muted);margin:0}
.badge{background:var(--bad);color:#fff;border-radius:10px;padding:0 8px;font-size:12px;font-weight:400}
ul.marks,ul.req-divs{font-size:12px;margin:4px 0;padding-left:18px}
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
"""
