"""One pass over a trace: the run summary and per-request timelines.

``summarize(path)`` reads a trace with ``TraceReader`` once and returns a
``RunSummary``: counts (requests, steps, preemptions, finishes), prompt-token
accounting (local and external hit rates), lookups and loads, and step series
(KV blocks in use, scheduled tokens, running and live requests). It also keeps
a ``RequestTimeline`` for the requests a caller asks for: the first
``max_timelines`` by arrival, plus every id in ``keep``.

Memory grows with the number of requests alive at once, not with the length of
the trace: a request's state is dropped when it finishes, series are
downsampled as they grow (``Series``, min/max buckets), and the marks of one
timeline are capped. Only a timeline built with ``history=True`` (one request,
for ``kvtrace show --request``) keeps every step the request was scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .._text import count, number as _n
from ..trace import events as ev
from ..trace.io import TraceReader
from .figures import HistoryRow, RequestTimeline, RunSummary

MAX_RUN_MARKS = 2000        # preemption steps kept for the run-level charts


# --------------------------------------------------------------------------- pass


@dataclass(slots=True)
class _Live:
    """What the pass holds for a request between its arrival and its finish."""
    prompt_len: int
    num_tokens: int
    computed: int = 0
    blocks: int = 0
    preempted_once: bool = False
    local: int | None = None          # the last lookup's local hit
    ext: int | None = None            # ... and its answer
    tl: RequestTimeline | None = None
    reads_no_cache: bool = False      # skip_reading_prefix_cache: the answer counts for nothing
    session: bool = False             # a streaming-input session: its turns end, it goes on


def phase_of(computed: int, scheduled: int, prompt_len: int, num_tokens: int) -> str:
    """Whether a scheduled chunk is a prefill (prompt or recomputed tokens) or a decode."""
    if computed < prompt_len or computed < num_tokens - 1:
        return "prefill"
    return "decode"


def summarize(path: str | os.PathLike, keep: Iterable[str] | Callable[[str], bool] | None = None,
              max_timelines: int = 50, history: Callable[[str], bool] | None = None,
              reader: TraceReader | None = None) -> RunSummary:
    """Read ``path`` once and summarize it.

    A timeline is kept for the first ``max_timelines`` requests in arrival order
    and for every request in ``keep`` (a collection of ids or a predicate).
    ``history`` says which requests also keep every scheduled step.
    Raises ``TraceError`` for unusable input, like every reader of traces.
    """
    if keep is None:
        want = lambda r: False  # noqa: E731
    elif callable(keep):
        want = keep
    else:
        ids = set(keep)
        want = ids.__contains__
    hist = history or (lambda r: False)
    r = reader or TraceReader(path)
    s = RunSummary(path=str(path), header=r.header)
    p = _Pass(s, want, max_timelines, hist)
    with r:
        for e in r:
            s.events += 1
            p.feed(e, r.last_line)
    s.truncation = r.truncation
    s.end = r.end
    s.last_line = r.last_line
    return s


class _Pass:
    def __init__(self, s: RunSummary, want, max_timelines: int, hist):
        self.s = s
        self.want = want
        self.max_timelines = max_timelines
        self.hist = hist
        self.live: dict[str, _Live] = {}
        self.usable = s.usable_blocks
        self.spec: dict[int, dict[str, int]] = {}   # step -> drafts scheduled per request, until its output
        self.grammar_since: dict[str, int] = {}     # structured output -> its first step, until compiled

    def feed(self, e, line: int) -> None:
        if isinstance(e, ev.Step):
            self._step(e)
        elif isinstance(e, ev.Output):
            self._output(e)
        elif isinstance(e, ev.Arrival):
            self._arrival(e, line)
        elif isinstance(e, ev.PromptStats):
            self._stats(e)
        elif isinstance(e, ev.Abort):
            for req in e.reqs:
                self._finish(req, self.s.steps, e.reason)

    # -- records ----------------------------------------------------------------

    def _arrival(self, e: ev.Arrival, line: int) -> None:
        s = self.s
        session = self.live.get(e.req)
        if session is not None:   # a streaming-input session's next chunk, or its end of input
            if session.tl is not None:
                session.tl.mark(s.steps, "input", f"{count(len(e.prompt_token_ids), 'more prompt token')}"
                                if e.resumable else "end of input")
            return
        index = s.requests
        s.requests += 1
        lv = _Live(prompt_len=len(e.prompt_token_ids), num_tokens=len(e.prompt_token_ids),
                   reads_no_cache=e.skip_reading_prefix_cache, session=e.resumable)
        if index < self.max_timelines or self.want(e.req) or self.hist(e.req):
            tl = RequestTimeline(req=e.req, index=index, prompt_len=lv.prompt_len,
                                 max_tokens=e.max_tokens, priority=e.priority,
                                 arrival_time=e.arrival_time, arrival_step=s.steps,
                                 arrival_line=line)
            if self.hist(e.req):
                tl.history = []
            tl.computed.add(s.steps, 0)
            tl.blocks.add(s.steps, 0)
            tl.mark(s.steps, "arrival", f"prompt {count(lv.prompt_len, 'token')}, max_tokens "
                                           f"{_n(e.max_tokens)}")
            s.timelines[e.req] = tl
            lv.tl = tl
        self.live[e.req] = lv
        s.max_live = max(s.max_live, len(self.live))
        if e.structured_output:
            s.structured += 1
            self.grammar_since[e.req] = s.steps
        if e.prompt_embeds is not None:
            s.embeds += 1
            s.embeds_mixed += e.prompt_is_token_ids is not None

    def _step(self, e: ev.Step) -> None:
        s = self.s
        k = e.step
        s.steps = k + 1
        states = {st.req: st for st in e.states}
        for req, outcome in (e.grammar or {}).items():
            since = self.grammar_since.pop(req, None)
            if outcome == "error":
                s.grammar_failed += 1
            elif since is not None:
                s.grammar_ready += 1
                s.grammar_wait_steps += k - since
        if e.spec:
            drafts = {req: sum(t >= 0 for t in ids) for req, ids in e.spec.items()}
            self.spec[k] = drafts
            s.drafts_scheduled += sum(drafts.values())
        for lk in e.lookups:
            s.lookups += 1
            lv = self.live.get(lk.req)
            if lk.ext is None:
                s.lookups_not_ready += 1
            else:
                s.lookup_local_tokens += lk.local
                s.lookup_external_tokens += lk.ext
                if lk.load_async:
                    s.lookups_async += 1
            if lv is None:
                continue
            again = (lv.local, lv.ext) == (lk.local, lk.ext)
            lv.local, lv.ext = lk.local, lk.ext
            # An async hit parks the request only when its admission got blocks:
            # the state after the step says so (a failed attempt leaves it WAITING).
            st = states.get(lk.req)
            parked = lk.load_async and (st.status == "WAITING_FOR_REMOTE_KVS" if st is not None
                                        else not again)
            if lv.tl is not None and (not again or parked):
                if lv.reads_no_cache and lk.ext != 0:   # forced to nothing (S:983-984)
                    answer = "not ready" if lk.ext is None else f"external {_n(lk.ext)}"
                    lv.tl.mark(k, "lookup", f"local {_n(lk.local)}, connector's answer ({answer}) "
                                            "not used: the request reads no prefix cache")
                elif lk.ext is None:
                    lv.tl.mark(k, "not-ready", f"local {_n(lk.local)}, connector not ready")
                elif parked:
                    lv.tl.mark(k, "async-wait", f"local {_n(lk.local)}, external {_n(lk.ext)} loading "
                                                "asynchronously (WAITING_FOR_REMOTE_KVS)")
                elif lk.load_async:
                    lv.tl.mark(k, "lookup", f"local {_n(lk.local)}, external {_n(lk.ext)} to load "
                                            "asynchronously; not admitted: still WAITING")
                else:
                    lv.tl.mark(k, "lookup", f"local {_n(lk.local)}, external {_n(lk.ext)}")
        for ld in e.loads or ():
            s.loads += 1
            s.load_tokens += max(0, ld.end - ld.start)
            lv = self.live.get(ld.req)
            if lv is not None and lv.tl is not None:
                lv.tl.mark(k, "load", f"load tokens [{ld.start}, {ld.end})")
        for req in e.preempted:
            s.preemptions += 1
            if len(s.preemption_steps) < MAX_RUN_MARKS:
                s.preemption_steps.append(k)
            lv = self.live.get(req)
            if lv is None:
                continue
            if not lv.preempted_once:
                lv.preempted_once = True
                s.preempted_requests += 1
            if lv.tl is not None:
                lv.tl.num_preemptions += 1
                lv.tl.mark(k, "preempted", f"preempted with {count(lv.computed, 'token')} "
                                              "computed")
        total = 0
        for how, items in (("new", e.new), ("resumed", e.resumed), ("running", e.running)):
            for it in items:
                total += it.num_scheduled_tokens
                self._scheduled(k, how, it, states.get(it.req))
        s.scheduled_tokens += total
        s.sched_tokens.add(k, total)
        s.running.add(k, len(e.new) + len(e.resumed) + len(e.running))
        # Unscheduled requests whose state the step reports (preempted, waiting for a load).
        scheduled = {it.req for it in e.new} | {it.req for it in e.resumed} | {it.req for it in e.running}
        for req, st in states.items():
            lv = self.live.get(req)
            if lv is None or req in scheduled:
                continue
            self._apply_state(k, lv, st)
        if e.num_free_blocks is not None:
            used = self.usable - e.num_free_blocks
            s.kv_used.add(k, used)
            s.peak_kv_used = used if s.peak_kv_used is None else max(s.peak_kv_used, used)
            s.kv_used_sum += used
            s.kv_samples += 1
        for req in e.finished:
            if req in self.live:
                self._finish(req, k, None)
        s.live.add(k, len(self.live))

    def _scheduled(self, k: int, how: str, it, st: ev.RequestState | None) -> None:
        lv = self.live.get(it.req)
        if lv is None:
            return
        s = self.s
        pre = it.num_computed_tokens
        n = it.num_scheduled_tokens
        num_tokens = st.num_tokens if st is not None else lv.num_tokens
        phase = phase_of(pre, n, lv.prompt_len, num_tokens)
        if phase == "prefill":
            s.prefill_tokens += n
        else:
            s.decode_tokens += n
        if isinstance(it, ev.ScheduledNew):
            # A request admitted after an async load already holds its loaded blocks.
            new_blocks = list(it.block_ids[lv.blocks:])
            nblocks = len(it.block_ids)
        else:
            new_blocks = list(it.new_block_ids)
            nblocks = lv.blocks + len(new_blocks)
        tl = lv.tl
        if how in ("new", "resumed"):
            # The admission's split of computed tokens: local prefix hit, external hit.
            local = lv.local if lv.local is not None else pre
            ext = (lv.ext or 0) if lv.local is not None and not lv.reads_no_cache else 0
            if tl is not None:
                tl.cached.add(k, local)
                tl.external.add(k, ext)
                what = "admitted" if how == "new" else "resumed"
                # A session's next turn looks nothing up: it goes on from its own KV.
                source = (f"{_n(pre)} kept from its last turn" if lv.local is None and lv.session
                          and pre else f"local {_n(local)}, external {_n(ext)}")
                tl.mark(k, what, f"{what} with {count(pre, 'token')} computed ({source}), "
                                 f"{_n(n)} scheduled, {count(len(it.block_ids), 'block')}")
            lv.local = lv.ext = None
        lv.blocks = nblocks
        lv.computed = pre + n
        lv.num_tokens = num_tokens
        status = "RUNNING"
        if st is not None:
            lv.computed = st.num_computed_tokens
            lv.blocks = len(st.block_ids)
            status = st.status
        if tl is not None:
            tl.computed.add(k, lv.computed)
            tl.blocks.add(k, lv.blocks)
            if tl.first_step is None:
                tl.first_step = k
            tl.last_step = k
            tl.steps_scheduled += 1
            tl.tokens_scheduled += n
            if tl.history is not None:
                tl.history.append(HistoryRow(step=k, how=how, phase=phase, computed=pre, scheduled=n,
                                             new_blocks=new_blocks, blocks=lv.blocks,
                                             computed_after=lv.computed, status=status,
                                             drafts=self.spec.get(k, {}).get(it.req, 0)))

    def _accepted(self, e: ev.Output, drafts: dict[str, int]) -> None:
        """The drafts each request's output accepted: all its sampled tokens but the last."""
        for req, n in drafts.items():
            sampled = e.sampled.get(req)
            if not sampled or not n:
                continue
            acc = min(len(sampled) - 1, n)
            self.s.drafts_accepted += acc
            lv = self.live.get(req)
            hist = lv.tl.history if lv is not None and lv.tl is not None else None
            if hist and hist[-1].step == e.step:
                hist[-1].accepted = acc

    def _apply_state(self, k: int, lv: _Live, st: ev.RequestState) -> None:
        lv.computed = st.num_computed_tokens
        lv.blocks = len(st.block_ids)
        lv.num_tokens = st.num_tokens
        if lv.tl is not None:
            lv.tl.computed.add(k, lv.computed)
            lv.tl.blocks.add(k, lv.blocks)

    def _output(self, e: ev.Output) -> None:
        k = e.step
        if e.grammar_rejected:
            self.s.grammar_rejected += len(e.grammar_rejected)
        if self.spec:
            self._accepted(e, self.spec.pop(k, {}))
            for old in [j for j in self.spec if j < k]:   # steps whose output never came
                del self.spec[old]
        for st in e.states:
            lv = self.live.get(st.req)
            if lv is not None:
                lv.num_tokens = st.num_tokens
                lv.computed = st.num_computed_tokens
                lv.blocks = len(st.block_ids)
        c = e.connector
        if c is not None:
            s = self.s
            s.finished_recving += len(c.finished_recving)
            s.failed_recving += len(c.failed_recving)
            s.invalid_blocks += len(c.invalid_block_ids)
            for req in c.failed_recving:
                lv = self.live.get(req)
                if lv is not None and lv.tl is not None:
                    lv.tl.mark(k, "load-failed", "the connector reports the load failed")
            for req in c.finished_recving:
                lv = self.live.get(req)
                if lv is not None and lv.tl is not None and req not in c.failed_recving:
                    lv.tl.mark(k, "load-done", "asynchronous load finished")
            if c.invalid_block_ids:
                bad = set(c.invalid_block_ids)
                for req, st in ((st.req, st) for st in e.states):
                    lv = self.live.get(req)
                    if lv is not None and lv.tl is not None and bad.intersection(st.block_ids):
                        lv.tl.mark(k, "load-failed",
                                   f"blocks {sorted(bad.intersection(st.block_ids))} failed to load")
        for req, reason in e.finished.items():
            lv = self.live.get(req)
            if lv is not None and lv.session:   # a turn ends; the session waits for more input
                if lv.tl is not None:
                    lv.tl.mark(k, "turn", f"turn ends ({reason})")
                continue
            self._finish(req, k, reason)
        for st in e.states:
            if st.status.startswith("FINISHED") and st.req in self.live:
                self._finish(st.req, k, st.status[len("FINISHED_"):].lower())

    def _stats(self, e: ev.PromptStats) -> None:
        s = self.s
        lv = self.live.get(e.req)
        tl = s.timelines.get(e.req)
        ps = e.prefill_stats
        if ps is not None:
            s.stats_requests += 1
            s.prompt_tokens += max(0, ps.num_prompt_tokens)
            s.local_cached_tokens += max(0, ps.num_local_cached_tokens)
            s.external_cached_tokens += max(0, ps.num_external_cached_tokens)
            s.cache_creation_tokens += max(0, ps.num_cache_creation_tokens)
        elif e.legacy is not None:
            lg = e.legacy
            prompt = lv.prompt_len if lv is not None else (tl.prompt_len if tl is not None else 0)
            if lg.num_cached_tokens >= 0:
                s.stats_requests += 1
                s.prompt_tokens += prompt
                ext = min(max(0, lg.num_external_computed_tokens), lg.num_cached_tokens)
                s.external_cached_tokens += ext
                s.local_cached_tokens += lg.num_cached_tokens - ext
        if tl is not None:
            tl.prefill_stats = ps
            tl.legacy = e.legacy
            tl.stats_step = e.step

    def _finish(self, req: str, k: int, reason: str | None) -> None:
        self.grammar_since.pop(req, None)
        lv = self.live.pop(req, None)
        if lv is None:
            return
        s = self.s
        reason = reason or "freed"
        if reason == "abort":
            s.aborted += 1
        s.finished[reason] += 1
        if lv.tl is not None:
            lv.tl.finish_reason = reason
            lv.tl.finish_step = k
            lv.tl.mark(k, "aborted" if reason == "abort" else "finished", f"finished: {reason}")
            lv.tl.blocks.add(k + 1, 0)
