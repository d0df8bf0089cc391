"""Comparisons between what the engine recorded and what the reference decided,
and the invariants of section 5 of the semantics doc, checked on the recording
itself. Each function returns a list of Divergence; none of them changes state."""

from __future__ import annotations

from typing import Callable

from kvtrace.findings import Divergence, DivergenceKind
from kvtrace.reference import Request, RequestOutput, Scheduler, SchedulerOutput, Status
from kvtrace.reference.request import LegacyAdmission
from kvtrace.trace import events as ev


# --------------------------------------------------------------------------- step


def compare_step(rec: ev.Step, out: SchedulerOutput, sched: Scheduler, line: int | None
                 ) -> list[Divergence]:
    """The recorded SchedulerOutput against the reference's, field by field."""
    divs: list[Divergence] = []

    def d(req, field, recorded, expected, rule, kind="counter"):
        divs.append(Divergence(rec.step, req, field, recorded, expected, rule, kind, rec.seq, line))

    if not (_same(rec.new, out.new) and _same(rec.resumed, out.resumed)
            and _same(rec.running, out.running, "new_block_ids")):
        _compare_scheduled(rec, out, d, grouped=sched.kv_groups)
    if rec.preempted or out.preempted_req_ids:
        for req in sorted(set(rec.preempted) ^ out.preempted_req_ids):
            d(req, "preempted", req in rec.preempted, req in out.preempted_req_ids,
              "2.1: the victim is the last running request (FCFS) or the lowest priority")
    if rec.spec or out.spec:
        recorded, expected = rec.spec or {}, out.spec
        for req in _union(recorded, expected):
            if recorded.get(req) != expected.get(req):
                d(req, "spec", recorded.get(req), expected.get(req),
                  "2.1: the drafts scheduled are those past the last token (S:861-876); "
                  "a padded decode gets -1s (S:1131-1153)")
    if rec.finished or out.finished_req_ids:
        for req in sorted(set(rec.finished) ^ out.finished_req_ids):
            d(req, "finished_req_ids", req in rec.finished, req in out.finished_req_ids,
              "2.3: finished_req_ids lists requests freed since the last step")
    divs.extend(compare_states(rec.step, rec.states, sched, {}, rec.seq, line))
    if rec.num_free_blocks is not None and rec.num_free_blocks != sched.kv.pool.num_free_blocks:
        d(None, "num_free_blocks", rec.num_free_blocks, sched.kv.pool.num_free_blocks,
          "B5: free blocks = blocks with no reference", kind="block")
    return divs


def _same(recorded: list, expected: list, blocks: str = "block_ids") -> bool:
    """The common case, decided without building anything: the same requests in
    the same order, with the same counts and tables. ``blocks`` names the recorded
    table: ``block_ids`` (new, resumed) or ``new_block_ids`` (running)."""
    if len(recorded) != len(expected):
        return False
    for s, e in zip(recorded, expected):
        if (s.req != e.req_id or s.num_computed_tokens != e.num_computed_tokens
                or s.num_scheduled_tokens != e.num_scheduled_tokens
                or getattr(s, blocks) != e.block_ids
                or (s.more_groups is not e.more_groups and s.more_groups != e.more_groups)):
            return False
    return True


def _compare_scheduled(rec: ev.Step, out: SchedulerOutput, d, grouped: bool = False) -> None:
    """Request by request, whatever the order: what differs, and where. With
    KV-cache groups (``grouped``), a table that holds the null block differs
    under the groups' rule."""
    recorded: dict[str, tuple[str, ev.ScheduledNew | ev.ScheduledRunning]]
    recorded = {s.req: ("new", s) for s in rec.new}
    recorded.update({s.req: ("resumed", s) for s in rec.resumed})
    recorded.update({s.req: ("running", s) for s in rec.running})
    expected = {s.req_id: ("new", s) for s in out.new}
    expected.update({s.req_id: ("resumed", s) for s in out.resumed})
    expected.update({s.req_id: ("running", s) for s in out.running})

    for req in _union(recorded, expected):
        r, e = recorded.get(req), expected.get(req)
        if r is None or e is None:
            d(req, "scheduled", r[1].num_scheduled_tokens if r else None,
              e[1].num_scheduled_tokens if e else None,
              "2.1/2.2: which requests a step schedules", kind="counter")
            continue
        (rq, rs), (eq, es) = r, e
        if rs.num_computed_tokens != es.num_computed_tokens:
            d(req, "num_computed_tokens", rs.num_computed_tokens, es.num_computed_tokens,
              _nct_rule(eq))
        if rs.num_scheduled_tokens != es.num_scheduled_tokens:
            d(req, "num_scheduled_tokens", rs.num_scheduled_tokens, es.num_scheduled_tokens,
              "2.1/2.2: chunk = min(remaining, threshold, token budget)")
        if rq != eq:
            d(req, "queue", rq, eq, "2.3: new, resumed or running")
        rec_blocks = rs.new_block_ids if isinstance(rs, ev.ScheduledRunning) else rs.block_ids
        if rec_blocks != es.block_ids:
            field = "block_ids" if rq != "running" else "new_block_ids"
            d(req, field, rec_blocks, es.block_ids,
              _GROUPS_RULE if grouped and (0 in rec_blocks or 0 in es.block_ids)
              else "4.5: block ids follow the free-queue discipline", kind="block")
        if rs.more_groups != es.more_groups:
            d(req, "more_groups", rs.more_groups, es.more_groups, _GROUPS_RULE, kind="block")


def _nct_rule(queue: str) -> str:
    if queue == "running":
        return "1.3: num_computed_tokens advances by the scheduled tokens"
    return "1.3: admission sets num_computed_tokens = local + external hit (T-1 after a full async load)"


def _union(a: dict, b: dict) -> list:
    return list(dict.fromkeys([*a, *b]))


def compare_states(step: int, states: list[ev.RequestState], sched: Scheduler,
                   extra: dict[str, Request], seq: int, line: int | None) -> list[Divergence]:
    divs = []
    live, tables = sched.requests, sched.kv.req_to_ids
    # Several KV-cache groups: the other groups' tables too.
    more = sched.kv.more_ids if sched.kv_groups else None
    for s in states:
        r = live.get(s.req) or extra.get(s.req)
        if r is None:
            divs.append(Divergence(step, s.req, "state", s.status, None,
                                   "1.4: the reference holds no such live request", "counter", seq, line))
            continue
        blocks = tables.get(s.req, [])     # read only: no copy
        if (s.num_computed_tokens == r.num_computed_tokens and s.num_tokens == r.num_tokens
                and s.status == _STATUS_NAMES[r.status] and s.num_preemptions == r.num_preemptions
                and s.block_ids == blocks and (more is None or s.more_groups == more(s.req))):
            continue
        blocks = list(blocks)   # a divergence keeps it; the table changes later
        if more is not None and s.more_groups != more(s.req):
            divs.append(Divergence(step, s.req, "state.more_groups", s.more_groups, more(s.req),
                                   _GROUPS_RULE, "block", seq, line))
        want = (_STATUS_NAMES[r.status], r.num_computed_tokens, r.num_tokens, r.num_preemptions, blocks)
        got = (s.status, s.num_computed_tokens, s.num_tokens, s.num_preemptions, s.block_ids)
        for field, g, w, rule, kind in zip(_STATE_FIELDS, got, want, _STATE_RULES, _STATE_KINDS):
            if g != w:
                if field == "state.block_ids" and blocks and r.is_finished:
                    rule = _DELAYED_FREE_RULE
                elif field == "state.block_ids" and more is not None and (0 in s.block_ids or 0 in blocks):
                    rule = _GROUPS_RULE
                divs.append(Divergence(step, s.req, field, g, w, rule, kind, seq, line))
    return divs


_STATUS_NAMES = {s: s.name for s in Status}
_STATE_FIELDS = ("status", "state.num_computed_tokens", "num_tokens", "num_preemptions",
                 "state.block_ids")
_STATE_RULES = ("1.4: status transitions", "1.3: every write to num_computed_tokens",
                "1.1: num_tokens = prompt + outputs", "I6", "4.5/4.7: the block table")
_STATE_KINDS: tuple[DivergenceKind, ...] = ("counter", "counter", "counter", "counter", "block")
_GROUPS_RULE = ("4.9: each KV-cache group's table: blocks before a sliding window, and "
                "states before a request's last, are given back as the null block 0, a hit "
                "holds in every group")
_DELAYED_FREE_RULE = ("3.5: a finished request keeps its blocks while the connector sends them "
                      "(request_finished answered delay_free) until finished_sending")


# --------------------------------------------------------------------------- output


def compare_output(rec: ev.Output, results: list[RequestOutput], sched: Scheduler,
                   touched: list[Request], line: int | None) -> list[Divergence]:
    divs = []
    expected = {r.req_id: r.finish_reason for r in results if r.finish_reason}
    for req in _union(rec.finished, expected):
        if rec.finished.get(req) != expected.get(req):
            divs.append(Divergence(rec.step, req, "finish_reason", rec.finished.get(req),
                                   expected.get(req), "3: check_stop and load-failure policy",
                                   "counter", rec.seq, line))
    divs.extend(compare_states(rec.step, rec.states, sched, {r.request_id: r for r in touched},
                               rec.seq, line))
    return divs


def accepted_drafts(rec: ev.Output, spec: dict[str, list[int]], line: int | None,
                    filled_by_runner: bool = False) -> list[Divergence]:
    """Speculative decoding: a request's sampled tokens are the drafts accepted,
    in order, then one token of the model's own (at the first rejected draft, or
    after the last), so all but the last are its first drafts; a padding draft
    (-1) is never accepted (S:2110-2128). The shadow-KV check takes the accepted
    drafts' KV as the request's own tokens on this ground. ``filled_by_runner``
    (async scheduling): the scheduled drafts are placeholders that the model
    runner filled in, unseen here, so only their number bounds the tokens."""
    divs = []
    for req, drafts in spec.items():
        sampled = rec.sampled.get(req)
        if not sampled:
            continue
        accepted = sampled[:-1]
        if len(accepted) > len(drafts) or (not filled_by_runner
                                           and accepted != drafts[:len(accepted)]):
            divs.append(Divergence(
                rec.step, req, "sampled", sampled,
                f"at most {len(drafts) + 1} tokens, all but the last the drafts {drafts}",
                "SD1: the sampled tokens are the drafts accepted and one more", "invariant",
                rec.seq, line))
    return divs


CONNECTOR_CACHE = ("5.4: the connector's prefix-cache stats count the tokens each admission "
                   "queried past its local hit, and the external hit; a request that reads no "
                   "prefix cache queries nothing (S:983-984, S:1294-1311, MS:121-160)")


def connector_cache(rec: ev.Output, expected, line: int | None) -> list[Divergence]:
    """The connector's prefix-cache stats the output's ``make_stats`` took,
    against the reference's count of the admissions since the output before."""
    got = rec.connector_cache
    for name in ev.CacheStats.__struct_fields__:
        if getattr(got, name) != getattr(expected, name):
            unread = expected.unread
            why = (f"{', '.join(unread)} {'reads' if len(unread) == 1 else 'read'} no prefix "
                   "cache, and queries nothing" if unread else None)
            return [Divergence(rec.step, unread[0] if len(unread) == 1 else None,
                               f"connector_cache.{name}", getattr(got, name),
                               getattr(expected, name), CONNECTOR_CACHE, "stats", rec.seq, line,
                               why)]
    return []


def compare_prompt_stats(rec: ev.PromptStats, expected: RequestOutput | None, ref: Request | None,
                         line: int | None) -> list[Divergence]:
    divs: list[Divergence] = []

    def d(field, recorded, want, rule, kind="stats"):
        divs.append(Divergence(rec.step, rec.req, field, recorded, want, rule, kind, rec.seq, line))

    ps = rec.prefill_stats
    if ps is not None:
        want = expected.prefill_stats if expected else None
        if want is None:
            d("prefill_stats", "present", None, "1.2: stats ride on the first output only")
        else:
            for name in ("num_prompt_tokens", "num_local_cached_tokens", "num_external_cached_tokens",
                         "num_cached_tokens", "num_computed_tokens", "num_cache_creation_tokens"):
                if getattr(ps, name) != getattr(want, name):
                    d(f"prefill_stats.{name}", getattr(ps, name), getattr(want, name),
                      "5.3: PrefillStats describe the last lookup before the first preemption")
                    break
        _prefill_invariants(ps, d)
    lg = rec.legacy
    if lg is not None and not _legacy_invariants(lg, expected, ref, d) and ref is not None:
        _from_the_lookup_that_set_them(lg, expected, ref, d)
    return divs


def _prefill_invariants(ps: ev.PrefillStats, d) -> None:
    L, E, P = ps.num_local_cached_tokens, ps.num_external_cached_tokens, ps.num_prompt_tokens
    if L < 0 or E < 0 or L + E > P:
        d("prefill_stats", (L, E, P), "0 <= L, 0 <= E, L + E <= P", "5.3: L, E >= 0, L + E <= P (MS:327-340)", "invariant")
    elif ps.num_cached_tokens != L + E or ps.num_computed_tokens != P - L - E:
        d("prefill_stats", (ps.num_cached_tokens, ps.num_computed_tokens), (L + E, P - L - E),
          "5.3: cached = L + E, computed = P - L - E", "invariant")


def stats_invariants(rec: ev.PromptStats, prompt_len: int | None, line: int | None = None
                     ) -> list[Divergence]:
    """The prompt stats' invariants that need no reference: PrefillStats'
    bounds and sums (5.3), the legacy counters' L1 and L2, and, given the
    prompt's length, L3 and L4 (L3's allowance for a recomputed last token
    needs it)."""
    divs: list[Divergence] = []

    def d(field, recorded, want, rule, kind="stats"):
        divs.append(Divergence(rec.step, rec.req, field, recorded, want, rule, kind, rec.seq, line))

    if rec.prefill_stats is not None:
        _prefill_invariants(rec.prefill_stats, d)
    lg = rec.legacy
    if lg is not None and (prompt_len is not None or lg.num_cached_tokens < 0
                           or lg.num_external_computed_tokens < 0):
        _legacy_invariants(lg, None, None, d, prompt_len)
    return divs


def _legacy_invariants(lg: ev.LegacyCounters, expected: RequestOutput | None, ref: Request | None,
                       d, prompt_len: int | None = None) -> bool:
    """L1 to L4: whether one of the legacy counters' invariants broke. The
    counters are checked by their invariants and by consistency with the
    lookup that set them (L5, L6), not against one release's exact rule
    (bug-classes.md). ``prompt_len``: the prompt's length where no reference
    request says it."""
    nc, ne = lg.num_cached_tokens, lg.num_external_computed_tokens
    P = ref.num_prompt_tokens if ref else prompt_len
    want = expected.legacy_counters if expected else None
    rec_ = 1 if P is not None and nc + 1 == P else 0
    if nc < 0:
        d("legacy.num_cached_tokens", nc, _valid_or(want and want[0], nc, ">= 0"),
          "L1: num_cached_tokens >= 0 when emitted; -1 is the unset sentinel (PR #37354)", "invariant")
    elif ne < 0:
        d("legacy.num_external_computed_tokens", ne, _valid_or(want and want[1], ne, ">= 0"),
          "L2: num_external_computed_tokens >= 0 (issue #36533, PR #36638)", "invariant")
    elif ne > nc + rec_:
        d("legacy.num_external_computed_tokens", ne, f"<= {nc + rec_}",
          "L3: num_external_computed_tokens <= num_cached_tokens (+ 1 when the last prompt "
          f"token is recomputed), so local_cache_hit ({nc + rec_ - ne}) >= 0 "
          f"(PR #36752){_lookups_named(nc, ne, ref)}", "invariant")
    elif P is not None and nc + rec_ > P:
        w = want[0] if want is not None else None   # recomputed is 1 only at P - 1
        fits = w is not None and 0 <= w <= P and w != nc
        d("legacy.num_cached_tokens", nc, w if fits else f"<= {P - rec_}",
          "L4: num_cached_tokens + recomputed <= prompt_len", "invariant")
    else:
        return False
    return True


def _valid_or(value: int | None, recorded: int, bound: str) -> int | str:
    """The reference's count where it is a valid one other than the recorded
    one; else the bound the recorded count breaks."""
    return value if value is not None and value >= 0 and value != recorded else bound


def _from_the_lookup_that_set_them(lg: ev.LegacyCounters, expected: RequestOutput | None,
                                   ref: Request, d) -> None:
    """L5 and L6. The pair is that of one admission's lookup: the first (the
    maintainers' rule, "both at the first scheduled prefill") or the last
    before the first output (PR #36752's, "both at each admission"); lookups
    that admitted nothing count for neither. Where both rules give one pair,
    the reference knows each count (L6)."""
    nc, ne = lg.num_cached_tokens, lg.num_external_computed_tokens
    want = expected.legacy_counters if expected else None
    admissions = ref.legacy_admissions
    if not admissions:
        return   # never admitted: nothing set the counters but the sentinel (L1)
    first, last = admissions[0], admissions[-1]
    pairs = [_pair(first), _pair(last)]
    if (nc, ne) in pairs:
        return
    if pairs[0] == pairs[1]:
        step = ref.lookup_history[first.lookup][0]
        lost = ref.lookup_history[first.lookup][2] - first.num_external_computed_tokens
        if nc != first.num_cached_tokens:
            d("legacy.num_cached_tokens", nc, first.num_cached_tokens,
              "L6: a request admitted once before its first output takes both counters from "
              f"that admission: num_cached_tokens = its num_computed_tokens "
              f"({first.num_cached_tokens}, from the lookup at step {step})", "invariant")
        if ne != first.num_external_computed_tokens:
            less = f", less {lost} tokens its failed loads took off" if lost else ""
            d("legacy.num_external_computed_tokens", ne, first.num_external_computed_tokens,
              "L6: a request admitted once before its first output takes both counters from "
              f"that admission: num_external_computed_tokens = the external hit of the lookup "
              f"at step {step}{less}", "invariant")
        return
    # Several admissions: the pair closest to the recorded one, by its cached count.
    near = pairs[1] if nc == pairs[1][0] and nc != pairs[0][0] else pairs[0]
    d("legacy.num_external_computed_tokens" if nc == near[0] else "legacy.num_cached_tokens",
      (nc, ne), near,
      f"L5: both counters come from one admission's lookup{_lookups_named(nc, ne, ref)}"
      + (" (PR #36752)" if want == (nc, ne) else
         f"; the first admission (step {ref.lookup_history[first.lookup][0]}) gives "
         f"{pairs[0]}, the last (step {ref.lookup_history[last.lookup][0]}) {pairs[1]}"),
      "invariant")


def _pair(a: LegacyAdmission) -> tuple[int, int]:
    return a.num_cached_tokens, a.num_external_computed_tokens


def _lookups_named(nc: int, ne: int, ref: Request | None) -> str:
    """Where each counter came from: the lookup that set it, as the reference
    followed the release's rule, where the reference's count is the recorded
    one; else an admission that gave it."""
    if ref is None or not ref.lookup_history:
        return ""
    history, admissions = ref.lookup_history, ref.legacy_admissions
    first = admissions[0].lookup if admissions else None

    def from_(k: int | None, count: int, value: int, of_admission) -> int | None:
        if k is not None and count == value:
            return k
        return next((a.lookup for a in admissions if of_admission(a) == count), None)

    parts = []
    k = from_(ref.legacy_cached_from, nc, ref.legacy_num_cached_tokens, lambda a: a.num_cached_tokens)
    if k is not None:
        first_ = " (its first admission)" if k == first and len(admissions) > 1 else ""
        parts.append(f"num_cached_tokens {nc} from the lookup at step {history[k][0]}{first_}")
    k = from_(ref.legacy_external_from, ne, ref.legacy_num_external_computed_tokens,
              lambda a: a.num_external_computed_tokens)
    if k is not None:
        step, _, ext, _ = history[k]
        resumed = " (a resume after preemption)" if first is not None and k > first else ""
        less = f", {ext} less {ext - ne} tokens a failed load took off" if ne < ext else ""
        parts.append(f"num_external_computed_tokens {ne} from the lookup at step "
                     f"{step}{resumed}{less}")
    return ": " + ", ".join(parts) if parts else ""


# --------------------------------------------------------------------------- invariants


def stale_tokens(rec: ev.Output, before: dict[str, int], line: int | None) -> list[Divergence]:
    """Async scheduling: ``before`` holds, for each request whose token this
    output's step sampled from KV a failed load had left unloaded (the failure
    was reported while the step was in flight), its token count before the
    output. That token must be discarded, not kept (upstream vLLM issues 45138
    and 49250; fix in PRs 45146 and 49252)."""
    states = {st.req: st for st in rec.states}
    divs = []
    for req, n in before.items():
        st = states.get(req)
        if st is not None and st.num_tokens > n:
            divs.append(Divergence(
                rec.step, req, "num_tokens", st.num_tokens, n,
                "I8: a token sampled from KV a failed load left unloaded is discarded",
                "invariant", rec.seq, line))
    return divs


def step_invariants(rec: ev.Step, cfg: ev.SchedulerConfig, prev_preemptions: dict[str, int],
                    line: int | None, in_flight: dict[str, int] | None = None,
                    reads_no_cache: Callable[[str], bool] = lambda req: False,
                    windowed: tuple[bool, ...] = ()) -> list[Divergence]:
    """Section 5 checks that need only the recording, in this order: the
    scheduled tokens (I5), each request's state (B1, I1, I4, I6), the null
    block (4.5), the state a request resumes from (B6), the connector's
    answers (I7) and the loads of external hits (I9). ``in_flight`` (async
    scheduling) counts, per request, the output placeholders it held when this
    step was scheduled: one for each step before it, with no output recorded
    yet, that samples a token for it. ``reads_no_cache(req)``: whether the
    request arrived with ``skip_reading_prefix_cache`` (its connector answers
    count for nothing). ``windowed``: for each KV-cache group, where it may
    hold the null block (``null_blocks``): in its tables (a sliding window's
    blocks given back), or also in a running request's new blocks (a state
    group's skipped slots)."""
    divs: list[Divergence] = []

    def d(req, field, recorded, expected, rule, kind="invariant"):
        divs.append(Divergence(rec.step, req, field, recorded, expected, rule, kind, rec.seq, line))

    sched = _scheduled_tokens(rec, cfg, d)
    _request_states(rec, cfg, sched, prev_preemptions, in_flight, d)
    if _hands_out_null_block(rec, windowed):
        d(None, "block_ids", 0, f"1..{cfg.num_blocks - 1}", "4.5: block 0 is the null block", "block")
    if IN_NEW_BLOCKS in windowed and rec.lookups:
        _resumes_from_a_state(rec, windowed, cfg.block_size, d)
    _connector_answers(rec, d)
    _loads_cover_hits(rec, reads_no_cache, d)
    return divs


def _scheduled_tokens(rec: ev.Step, cfg: ev.SchedulerConfig, d) -> dict[str, int]:
    """I5: the step schedules no more tokens than its budget, more than none
    to each request it schedules, and each request once. Returns the tokens
    scheduled, per request."""
    scheduled: list[ev.ScheduledNew | ev.ScheduledRunning] = [*rec.new, *rec.resumed, *rec.running]
    sched = {s.req: s.num_scheduled_tokens for s in scheduled}
    total = sum(sched.values())
    budget = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
    if total > budget:
        d(None, "total_num_scheduled_tokens", total, budget, "I5: sum of scheduled tokens <= budget")
    if sched and min(sched.values()) <= 0:
        for req, n in sched.items():
            if n <= 0:
                d(req, "num_scheduled_tokens", n, "> 0", "I5: every scheduled request has n > 0")
    if len(sched) != len(scheduled):
        seen: set[str] = set()
        for s in scheduled:
            if s.req in seen:
                d(s.req, "scheduled", "twice", "once", "I5: a request is scheduled at most once per step")
            seen.add(s.req)
    return sched


def _request_states(rec: ev.Step, cfg: ev.SchedulerConfig, sched: dict[str, int],
                    prev_preemptions: dict[str, int], in_flight: dict[str, int] | None, d) -> None:
    """Each request's state after schedule(), in one pass (its findings in the
    order of the states): a scheduled request's table covers its computed
    tokens (B1), which are no more than its tokens (I1: c <= T, plus the
    output placeholders of the steps in flight (AS:25-47) and the drafts
    scheduled); a waiting or preempted request holds nothing (I4); its
    preemptions count up by one each time it is preempted (I6, which
    ``prev_preemptions`` carries from step to step)."""
    max_len, block_size = cfg.max_model_len, cfg.block_size
    preempted = rec.preempted
    spec = rec.spec
    for s in rec.states:
        if s.req in sched:
            need = -(-min(s.num_computed_tokens, max_len) // block_size)
            if len(s.block_ids) < need:
                d(s.req, "state.block_ids", len(s.block_ids), f">= {need}",
                  "B1: the table covers every computed token", "block")
            most = s.num_tokens + (in_flight.get(s.req, 0) if in_flight is not None else 0)
            if spec:
                most += len(spec.get(s.req, ()))
            if s.num_computed_tokens > most:
                drafts = len(spec.get(s.req, ())) if spec else 0
                d(s.req, "state.num_computed_tokens", s.num_computed_tokens, f"<= {most}",
                  ("I1: c <= T after schedule()" if in_flight is None else
                   "I1: c <= T + output placeholders of the steps in flight after schedule()")
                  if not drafts else "I1: c <= T + the drafts scheduled, after schedule()")
        # I4; a request whose async load completed may wait holding its loaded
        # blocks, at T - 1 computed tokens: 0 for a one-token prompt (S:3171-3172).
        loaded_one = s.status == "WAITING" and s.num_tokens == 1 and s.num_computed_tokens == 0
        if (s.status in ("WAITING", "PREEMPTED") and (s.num_computed_tokens == 0) != (not s.block_ids)
                and not loaded_one):
            d(s.req, "state.num_computed_tokens", (s.status, s.num_computed_tokens, len(s.block_ids)),
              "num_computed_tokens 0 and no blocks, or a completed async load",
              "I4: a waiting or preempted request holds nothing")
        before = prev_preemptions.get(s.req, 0)
        want = before + 1 if preempted and s.req in preempted else before
        if s.num_preemptions != want:
            d(s.req, "num_preemptions", s.num_preemptions, want,
              "I6: +1 per appearance in preempted_req_ids")
        if s.num_preemptions != before:
            prev_preemptions[s.req] = s.num_preemptions


def blocks_held(rec: ev.Step, cfg: ev.SchedulerConfig, block_sizes: tuple[int | None, ...],
                unshared: Callable[[str], bool] = lambda req: False,
                line: int | None = None) -> list[Divergence]:
    """Block checks of one step record that need no reference, on the tables
    its states hold at one moment (after schedule()):

    * 4.5: a block in two places at once is a prefix-cache block that both
      requests hit, so at the same position in both (its hash chains every
      block before it); a block at two positions is handed out twice. And a
      cached block is a full one: at a position past a request's tokens it
      is that request's own, shared with no other. ``block_sizes``: per
      KV-cache group, its block size, None for a group not checked (a state
      group); ``unshared(req)``: whether the request's tokens only grow (the
      second check is made for those alone).
    * B5: the blocks held and the free ones together fit in the pool (less
      the null block): a held block has a reference, a free one none.

    The null block 0 stands anywhere."""
    divs: list[Divergence] = []
    where: dict[tuple[int, int], tuple[str, int, int]] = {}   # (group, block) -> (req, pos, tokens)
    held: set[int] = set()
    for s in rec.states:
        tables = (s.block_ids, *(s.more_groups or ()))
        for g, table in enumerate(tables):
            held.update(table)
            bs = block_sizes[g] if g < len(block_sizes) else None
            if bs is None:
                continue
            for pos, b in enumerate(table):
                if not b:
                    continue
                other = where.get((g, b))
                if other is None:
                    where[g, b] = (s.req, pos, s.num_tokens)
                    continue
                o_req, o_pos, o_tokens = other
                past = [(r, p) for r, p, n in ((s.req, pos, s.num_tokens), other)
                        if (p + 1) * bs > n and unshared(r)]
                if o_pos != pos or past:
                    why = (f"{o_req} holds it at position {o_pos}" if o_pos != pos else
                           f"position {past[0][1]} is past {past[0][0]}'s tokens: a block no "
                           "prefix hit shares")
                    divs.append(Divergence(
                        rec.step, s.req, f"group {g} block {b}" if g else f"block {b}",
                        f"held at position {pos} by {s.req}", f"only {o_req}'s ({why})",
                        "4.5: a block two requests hold is a prefix-cache block, at one "
                        "position in both", "block", rec.seq, line))
    held.discard(0)
    free = rec.num_free_blocks
    if free is not None and len(held) + free > cfg.num_blocks - 1:
        divs.append(Divergence(
            rec.step, None, "num_free_blocks", free,
            f"<= {cfg.num_blocks - 1 - len(held)} = {cfg.num_blocks} blocks - the null block "
            f"- {len(held)} held", "B5: a held block is not free", "block", rec.seq, line))
    return divs


def _hands_out_null_block(rec: ev.Step, windowed: tuple) -> bool:
    """4.5: whether a table of the step holds the null block 0 where its group
    may not (``windowed``): a state's, a new or resumed request's, or a running
    request's new blocks. Ids past the pool are refused by the reader; handing
    out the null block is an engine bug."""
    if (_null_in_tables(rec.states, windowed) or _null_in_tables(rec.new, windowed)
            or _null_in_tables(rec.resumed, windowed)):
        return True
    for s in rec.running:
        if (0 in s.new_block_ids or s.more_groups) and _holds_null(
                s.new_block_ids, s.more_groups, tuple(w == IN_NEW_BLOCKS for w in windowed)):
            return True
    return False


def _null_in_tables(tables: list, windowed: tuple) -> bool:
    """Whether one of these block tables (``block_ids``, ``more_groups``)
    holds the null block where its group may not."""
    for s in tables:
        if (0 in s.block_ids or s.more_groups) and _holds_null(s.block_ids, s.more_groups, windowed):
            return True
    return False


def _connector_answers(rec: ev.Step, d) -> None:
    """I7: a connector answers a lookup with no fewer than 0 tokens."""
    for lk in rec.lookups:
        if lk.ext is not None and lk.ext < 0:
            d(lk.req, "lookup.ext", lk.ext, ">= 0",
              "I7: a connector's answer is >= 0 tokens (a negative one takes local hit "
              "tokens back)")


IN_TABLES, IN_NEW_BLOCKS = "tables", "new blocks"


def null_blocks(features: ev.SchedulerFeatures) -> tuple[str | None, ...]:
    """Per KV-cache group, where it may hold the null block 0: a sliding
    window's tables, in place of blocks given back (ST:645-710); an aligned
    state group's tables and a running request's new blocks too, at the
    slots it keeps no state in (ST:1824-1852); None: nowhere."""
    out: list[str | None] = []
    for g in features.kv_cache_groups or ():
        if g.kind == "MambaSpec" and g.mamba_cache_mode == "align":
            out.append(IN_NEW_BLOCKS)
        else:
            out.append(IN_TABLES if g.sliding_window is not None else None)
    return tuple(out)


def _resumes_from_a_state(rec: ev.Step, windowed: tuple, block_size: int, d) -> None:
    """B6: a request admitted from a lookup at c > 0 computed tokens holds,
    in each aligned state group, a block at the slot of the state after c
    tokens, cdiv(c, block_size) - 1: its local hit's state, or the block its
    external hit loads that state into (ST:267-367). A hit taken from full
    attention alone, past the state a state group holds, leaves the null
    block there: the request would resume from a state never written
    (LMCache #4247's shape; vLLM's own such lookup, for a connector that
    restores states, falls back when the connector finds nothing, S:1029-1037)."""
    looked_up = {lk.req for lk in rec.lookups}
    states = [g for g, w in enumerate(windowed) if w == IN_NEW_BLOCKS]
    for s in (*rec.new, *rec.resumed):
        c = s.num_computed_tokens
        if c <= 0 or s.req not in looked_up:
            continue
        slot = -(-c // block_size) - 1
        tables = [s.block_ids, *(s.more_groups or ())]
        for g in states:
            table = tables[g] if g < len(tables) else []
            if slot >= len(table) or table[slot] == 0:
                d(s.req, f"group {g} state slot {slot}",
                  table[slot] if slot < len(table) else None, "a state block",
                  "B6: a request resumes from the state of its whole hit", "block")


def _holds_null(ids: list[int], more: list[list[int]] | None, windowed: tuple) -> bool:
    """Whether a table holds the null block 0 where its group may not (a
    truthy entry of ``windowed`` allows it; ``null_blocks`` says where)."""
    if 0 in ids and not (windowed and windowed[0]):
        return True
    return any(0 in g and not (len(windowed) > i and windowed[i])
               for i, g in enumerate(more or (), 1))


def admitted_hits(rec: ev.Step, reads_no_cache: Callable[[str], bool]) -> list[tuple[str, int, int]]:
    """``(req, start, end)`` for each request admitted in ``rec`` (or left
    waiting for its async load) whose last lookup the connector answered with
    an external hit: the tokens that must be loaded. A request that reads no
    prefix cache has that answer forced to nothing (S:983-984)."""
    admitted = {s.req for s in [*rec.new, *rec.resumed]}
    admitted |= {s.req for s in rec.states if s.status == "WAITING_FOR_REMOTE_KVS"}
    last_lookup = {lk.req: lk for lk in rec.lookups}
    hits = []
    for req in sorted(admitted):
        lk = last_lookup.get(req)
        if lk is not None and lk.ext is not None and lk.ext > 0 and not reads_no_cache(req):
            hits.append((req, lk.local, lk.local + lk.ext))
    return hits


def _loads_cover_hits(rec: ev.Step, reads_no_cache: Callable[[str], bool], d) -> None:
    """Every external hit that was admitted must be loaded (bug class e)."""
    if rec.loads is None:
        return
    for req, start, end in admitted_hits(rec, reads_no_cache):
        covered = any(ld.req == req and ld.start <= start and ld.end >= end for ld in rec.loads)
        if not covered:
            got = [(ld.start, ld.end) for ld in rec.loads if ld.req == req] or None
            d(req, "kv_load", got, [start, end],
              "I9: an admitted external hit must be loaded (LMCache #1969, PR #2007)")
