"""``kvtrace show``: the run summary, or one request's history, in the terminal."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .figures import HistoryRow, Mark, RequestTimeline, RunSummary, Series, kv_groups_text, percent
from .summary import summarize
from .terminal import make_console, replayed_up_to

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


class UnknownRequest(LookupError):
    """The request id is not in the trace. ``str()`` is the one-line message."""

    exit_code = 2


def show(trace: str | os.PathLike, request: str | None = None, console: Console | None = None,
         collapse_decode: bool = True) -> RunSummary:
    """Print the run summary of ``trace``; with ``request``, also that request's history.

    ``request`` is a request id, or a prefix of exactly one (vLLM ids end in a
    random suffix: ``0-a3c1`` finds ``0-a3c17fc3``). Runs of decode steps with
    nothing else happening are printed as one row unless ``collapse_decode`` is
    false. Raises ``TraceError`` for an unusable trace and ``UnknownRequest``
    when no request, or more than one, matches.
    """
    console = console or make_console()
    if request is None:
        s = summarize(trace, max_timelines=0)
        print_summary(s, console)
        return s
    s = summarize(trace, keep=lambda r: r.startswith(request), max_timelines=0,
                  history=lambda r: r.startswith(request))
    tl = s.timelines.get(request)
    if tl is None:
        matches = sorted(s.timelines, key=lambda r: s.timelines[r].index)
        if not matches:
            raise UnknownRequest(f"{trace}: no request {request!r} in the trace "
                                 f"({s.requests} requests)")
        if len(matches) > 1:
            shown = ", ".join(matches[:8]) + (" …" if len(matches) > 8 else "")
            raise UnknownRequest(f"{trace}: {len(matches)} requests start with {request!r}: {shown}")
        tl = s.timelines[matches[0]]
    print_summary(s, console, brief=True)
    print_request(s, tl, console, collapse_decode=collapse_decode)
    return s


# --------------------------------------------------------------------------- summary


def sparkline(series: Series, hi: float, width: int = SPARK_WIDTH) -> str:
    """The series as one line of block characters, ``width`` wide at most."""
    pts = series.points()
    if not pts or hi <= 0:
        return ""
    x0, x1 = pts[0][0], pts[-1][0]
    n = min(width, x1 - x0 + 1)
    cols = [None] * n
    for x, y in pts:
        i = min(n - 1, (x - x0) * n // max(1, x1 - x0 + 1))
        cols[i] = y if cols[i] is None else max(cols[i], y)
    last = 0.0
    out = []
    for v in cols:
        last = last if v is None else v
        out.append(SPARK[min(len(SPARK) - 1, max(0, int(last / hi * (len(SPARK) - 1) + 0.5)))])
    return "".join(out)


def print_summary(s: RunSummary, console: Console, brief: bool = False) -> None:
    h = s.header
    cfg = h.config
    console.print(Text(f"{s.path} · engine {h.engine} {h.engine_version} · {s.steps} steps · "
                       f"{s.requests} requests", style="bold"))
    note = replayed_up_to(s.truncation, "read")
    if note:
        console.print(Text(f"truncated: {note}", style="yellow"))
    if s.end is not None and (s.end.status != "complete" or s.end.dropped_events):
        console.print(Text(f"the recorder closed this trace as '{s.end.status}'"
                           + (f", {s.end.dropped_events} events dropped" if s.end.dropped_events else "")
                           + (f": {s.end.error}" if s.end.error else ""), style="yellow"))
    if brief:
        return
    budget = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("config", f"block size {cfg.block_size}, {cfg.num_blocks} blocks ({s.usable_blocks} usable), "
                        f"token budget {budget}, max_num_seqs {cfg.max_num_seqs}, policy {cfg.policy}, "
                        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
                        + (f", connector {cfg.connector.name} ({cfg.connector.load_failure_policy})"
                           if cfg.connector else ""))
    groups = kv_groups_text(h.features)
    if groups:
        t.add_row("KV cache", groups)
    fin = ", ".join(f"{n} {r}" for r, n in sorted(s.finished.items())) or "none"
    unfinished = s.requests - sum(s.finished.values())
    t.add_row("requests", f"{s.requests} (finished: {fin}"
                          + (f"; {unfinished} not finished" if unfinished else "") + f"); "
                          f"at most {s.max_live} at once")
    t.add_row("steps", f"{s.steps}: {s.scheduled_tokens} tokens scheduled "
                       f"({s.prefill_tokens} prefill, {s.decode_tokens} decode)")
    t.add_row("preemptions", f"{s.preemptions} (requests preempted: {s.preempted_requests})")
    t.add_row("prefix hit rate", f"{percent(s.prefix_hit_rate)} ({s.local_cached_tokens} of "
                                 f"{s.prompt_tokens} prompt tokens from the local cache)")
    t.add_row("external hit rate", f"{percent(s.external_hit_rate)} ({s.external_cached_tokens} prompt "
                                   "tokens from the connector)")
    if s.stats_requests < s.requests:
        t.add_row("", Text(f"prompt stats for {s.stats_requests} of {s.requests} requests", style="dim"))
    if s.lookups or s.loads:
        t.add_row("connector", f"{s.lookups} lookups ({s.lookups_not_ready} not ready, {s.lookups_async} "
                               f"async), {s.loads} loads ({s.load_tokens} tokens), {s.finished_recving} "
                               f"async loads finished, {s.failed_recving} failed, "
                               f"{s.invalid_blocks} invalid blocks")
    if s.drafts_scheduled:
        t.add_row("drafts", f"{s.drafts_scheduled} scheduled, {s.drafts_accepted} accepted "
                            f"({percent(s.drafts_accepted / s.drafts_scheduled)})")
    if s.structured:
        # The scheduler looks at a grammar when the request comes up in the waiting pass.
        waited = (f", grammar found compiled {s.grammar_wait_steps / s.grammar_ready:.1f} steps "
                  "after arrival on average" if s.grammar_ready else "")
        t.add_row("structured outputs", f"{s.structured} requests{waited}, {s.grammar_failed} "
                                        f"failed to compile, {s.grammar_rejected} refused "
                                        "the tokens sampled")
    if s.embeds:
        t.add_row("prompt embeddings", f"{s.embeds} requests ({s.embeds_mixed} mixed with token ids)")
    if s.peak_kv_used is not None:
        t.add_row("KV usage", f"peak {s.peak_kv_used}/{s.usable_blocks} blocks, mean "
                              f"{s.mean_kv_used:.1f} ({percent(s.mean_kv_used / max(1, s.usable_blocks))})")
        t.add_row("", Text(sparkline(s.kv_used, s.usable_blocks), style="cyan"))
    else:
        t.add_row("KV usage", Text("not recorded (no num_free_blocks)", style="dim"))
    t.add_row("tokens/step", Text(sparkline(s.sched_tokens, budget), style="green"))
    console.print(t)


# --------------------------------------------------------------------------- one request


def print_request(s: RunSummary, tl: RequestTimeline, console: Console,
                  collapse_decode: bool = True) -> None:
    bs = s.header.config.block_size
    console.print(Text(f"request {tl.req}", style="bold"))
    console.print(f"arrival: before step {tl.arrival_step} (line {tl.arrival_line}), prompt "
                  f"{tl.prompt_len} tokens, max_tokens {tl.max_tokens}, priority {tl.priority}, "
                  f"arrival_time {tl.arrival_time:.3f}")
    table = Table(header_style="bold", expand=False)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("computed", justify="right")
    table.add_column("scheduled", justify="right")
    table.add_column("new blocks")
    table.add_column("blocks", justify="right")
    table.add_column("detail")
    for row in _rows(tl, collapse_decode):
        table.add_row(*row)
    console.print(table)
    if tl.finish_reason:
        console.print(f"finish: {tl.finish_reason} at step {tl.finish_step}")
    else:
        console.print(Text("finish: not finished in the trace", style="yellow"))
    console.print(f"scheduled in {tl.steps_scheduled} steps, {tl.tokens_scheduled} tokens; "
                  f"{tl.num_preemptions} preemptions; block size {bs}")
    if tl.prefill_stats is not None:
        p = tl.prefill_stats
        console.print(f"prompt stats (step {tl.stats_step}): num_prompt_tokens {p.num_prompt_tokens}, "
                      f"num_local_cached_tokens {p.num_local_cached_tokens}, num_external_cached_tokens "
                      f"{p.num_external_cached_tokens}, num_cached_tokens {p.num_cached_tokens}, "
                      f"num_computed_tokens {p.num_computed_tokens}, num_cache_creation_tokens "
                      f"{p.num_cache_creation_tokens}")
    if tl.legacy is not None:
        console.print(f"legacy counters (step {tl.stats_step}): num_cached_tokens "
                      f"{tl.legacy.num_cached_tokens}, num_external_computed_tokens "
                      f"{tl.legacy.num_external_computed_tokens}")
    if tl.prefill_stats is None and tl.legacy is None:
        console.print(Text("prompt stats: none recorded", style="dim"))


_MARK_STYLE = {"preempted": "bold yellow", "load": "cyan", "async-wait": "cyan", "load-done": "cyan",
               "load-failed": "bold red", "finished": "green", "aborted": "red", "not-ready": "dim",
               "lookup": "cyan", "arrival": "bold"}


def _rows(tl: RequestTimeline, collapse: bool):
    """Marks and scheduled steps merged in step order, decode runs collapsed."""
    marks = [m for m in tl.marks if m.kind not in ("admitted", "resumed")]
    split = {m.step: m.text.split(" (", 1)[1].split(")", 1)[0] for m in tl.marks
             if m.kind in ("admitted", "resumed") and " (" in m.text}
    hist = tl.history or []
    items: list[tuple[int, int, object]] = []
    for i, m in enumerate(marks):
        # At one step: lookups and loads before the scheduling, finishes after it.
        order = 2 if m.kind in ("finished", "aborted", "load-done", "load-failed") else 0
        items.append((m.step, order, m))
    for r in hist:
        items.append((r.step, 1, r))
    items.sort(key=lambda t: (t[0], t[1]))
    run: list[HistoryRow] = []
    marked = {m.step for m in marks}

    def flush():
        if not run:
            return []
        if len(run) == 1:
            out = [_hist_row(run[0], split)]
        else:
            a, b = run[0], run[-1]
            nb = sum(len(r.new_blocks) for r in run)
            drafts = sum(r.drafts for r in run)
            spec = (f", {sum(r.accepted or 0 for r in run)} of {drafts} drafts accepted"
                    if drafts else "")
            out = [(f"{a.step}–{b.step}", Text("decode", style="dim"), f"{a.computed}→{b.computed_after}",
                    str(sum(r.scheduled for r in run)), f"{nb} blocks" if nb else "", str(b.blocks),
                    Text(f"{len(run)} decode steps{spec}", style="dim"))]
        run.clear()
        return out

    for step, _, it in items:
        if isinstance(it, HistoryRow):
            plain = (collapse and it.how == "running" and it.phase == "decode" and it.step not in marked)
            if plain and (not run or run[-1].step == it.step - 1):
                run.append(it)
                continue
            yield from flush()
            if plain:
                run.append(it)
                continue
            yield _hist_row(it, split)
        else:
            yield from flush()
            yield _mark_row(it)
    yield from flush()


def _hist_row(r: HistoryRow, split: dict[int, str]):
    how = {"new": "admitted", "resumed": "resumed", "running": "scheduled"}[r.how]
    style = "bold" if r.how != "running" else ""
    blocks = ", ".join(map(str, r.new_blocks[:12])) + (" …" if len(r.new_blocks) > 12 else "")
    detail = f"{r.phase}" + (f", {r.status}" if r.status != "RUNNING" else "")
    if r.drafts:
        detail += (f", {r.accepted} of {r.drafts} drafts accepted" if r.accepted is not None
                   else f", {r.drafts} drafts")
    if r.how != "running" and r.step in split:
        source = split[r.step]
        detail += f", {source}" if source.endswith("last turn") else f", hit: {source}"
    return (str(r.step), Text(how, style=style), f"{r.computed}→{r.computed_after}", str(r.scheduled),
            blocks, str(r.blocks), detail)


def _mark_row(m: Mark):
    return (str(m.step), Text(m.kind, style=_MARK_STYLE.get(m.kind, "")), "", "", "", "", m.text)
