"""Where a state-group fault first breaks vLLM's rules, worked out from a
trace's own records (its arrivals, steps and outputs), never from a replay.
Each rule holds for every step of a correct engine on a model of gated delta
net state groups (Qwen3-Next's layout, prefix caching on: ``align``); a
fault breaks it first at ``(step, request, field)``, the field a replay
should flag there.

* ``state-hit-attention-kept``: an admission from c computed tokens holds,
  in a full-attention group at a slot from c // block_size on, only blocks
  it was just given, which no other live request holds.
* ``state-freed-in-flight``: with a connector that loads KV under async
  scheduling (``defer_block_free``), a block a preempted request held while
  the step that last scheduled it was in flight (its output not yet
  recorded) is not handed out again before that output.
* ``state-chunk-off-boundary``: a prefill chunk never runs past the
  request's last block boundary before its end, a chunk that starts inside
  a block stops at the next boundary, and one that does not end the prefill
  ends on a boundary (the block no wider than the step's chunk limit).
* ``state-key-outlives-eviction``: an admission from a local hit of c > 0
  tokens, with no external hit after it, holds, in each state group at slot c // block_size - 1, a block
  last handed out for that group's slot, to a request whose first c tokens
  are the admitted request's.

The rules read traces of state groups without prefill checkpoint blocks (a
Mamba2 checkpoint lets a prompt's last chunk run past its last boundary).
"""

from __future__ import annotations

from pathlib import Path

from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader


class _Trace:
    """A trace read in order, with each request's tokens and tables so far."""

    def __init__(self, path: Path):
        with TraceReader(path) as r:
            self.header = r.header
            self.events = list(r)
        self.block_size = self.header.config.block_size
        self.groups = self.header.features.kv_cache_groups
        self.state_gids = [i for i, g in enumerate(self.groups) if g.kind == "MambaSpec"]
        self.fa_gids = [i for i, g in enumerate(self.groups) if g.kind == "FullAttentionSpec"]
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.lookups: dict[str, ev.Lookup] = {}   # each request's last lookup

    def hit_of(self, e: ev.Step, s: ev.ScheduledNew) -> tuple[int, bool]:
        """An admission's local hit, and whether an external hit follows it:
        from its lookup in this step, or the one that started its async load;
        without a connector, every computed token is a local hit."""
        if self.header.config.connector is None:
            return s.num_computed_tokens, False
        lk = next((lk for lk in e.lookups if lk.req == s.req), None) or self.lookups.get(s.req)
        return (lk.local, bool(lk.ext)) if lk is not None else (0, False)

    def tables_of(self, s) -> list[list[int]]:
        first = s.block_ids if isinstance(s, (ev.ScheduledNew, ev.RequestState)) else s.new_block_ids
        return [list(first), *[list(t) for t in (s.more_groups or [[]] * (len(self.groups) - 1))]]

    def seen(self, e) -> None:
        """What a record tells after it is checked: arrivals, tokens, tables."""
        if isinstance(e, ev.Arrival):
            self.tokens[e.req] = list(e.prompt_token_ids)
            self.prompt_len[e.req] = len(e.prompt_token_ids)
        if isinstance(e, ev.Output):
            for req, toks in e.sampled.items():
                self.tokens.setdefault(req, []).extend(toks)
        if isinstance(e, ev.Step):
            self.lookups.update((lk.req, lk) for lk in e.lookups)
        if isinstance(e, (ev.Step, ev.Output)):
            for st in e.states:
                if st.status.startswith("FINISHED"):
                    self.tables.pop(st.req, None)
                else:
                    self.tables[st.req] = self.tables_of(st)
        if isinstance(e, ev.Output):
            for req in e.finished:
                self.tables.pop(req, None)

    def field(self, gid: int, running: bool) -> str:
        if gid:
            return "more_groups"
        return "new_block_ids" if running else "block_ids"


def first_violation(path: Path, fault: str) -> tuple[int, str, str] | None:
    """(step, request, field) where the trace first breaks the rule ``fault``
    breaks, or None where it never does."""
    return _RULES[fault](_Trace(path))


def _attention_kept(t: _Trace):
    bs = t.block_size
    for e in t.events:
        if isinstance(e, ev.Step):
            for s in (*e.new, *e.resumed):
                tables = t.tables_of(s)
                for g in t.fa_gids:
                    others = {b for req, ts in t.tables.items() if req != s.req for b in ts[g]}
                    if any(b and b in others for b in tables[g][s.num_computed_tokens // bs:]):
                        return e.step, s.req, t.field(g, False)
        t.seen(e)
    return None


def _fresh(t: _Trace, e: ev.Step, s, after: list[list[int]] | None
           ) -> list[tuple[int, int, int]]:
    """(group, slot, block) of each block a scheduled entry was just given:
    an admission's slots past its local hit (an external hit's blocks
    included), a running request's new entries (placed at the end of its
    table, ``after``)."""
    out = []
    tables = t.tables_of(s)
    first = 0 if isinstance(s, ev.ScheduledRunning) else t.hit_of(e, s)[0] // t.block_size
    for g, entries in enumerate(tables):
        if isinstance(s, ev.ScheduledRunning):
            start = len(after[g]) - len(entries) if after else 0
            out += [(g, start + i, b) for i, b in enumerate(entries) if b]
        else:
            out += [(g, first + i, b) for i, b in enumerate(entries[first:]) if b]
    return out


def _freed_in_flight(t: _Trace):
    if not t.header.features.defer_block_free:
        return None   # every free is at once
    last_sched: dict[str, int] = {}
    processed: set[int] = set()
    waiting: dict[int, int] = {}   # block -> the step whose output frees it
    for e in t.events:
        if isinstance(e, ev.Step):
            for req in e.preempted:
                step = last_sched.get(req)
                if step is not None and step not in processed:
                    for table in t.tables.get(req, ()):
                        waiting.update((b, step) for b in table if b)
            for s in (*e.running, *e.new, *e.resumed):
                for g, _, b in _fresh(t, e, s, None):
                    if b in waiting:
                        return e.step, s.req, t.field(g, isinstance(s, ev.ScheduledRunning))
            for s in (*e.running, *e.new, *e.resumed):
                last_sched[s.req] = e.step
        if isinstance(e, ev.Output):
            processed.add(e.step)
            waiting = {b: w for b, w in waiting.items() if w > e.step}
        t.seen(e)
    return None


def _chunk_off_boundary(t: _Trace):
    bs = t.block_size
    cfg = t.header.config
    limit = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
    if cfg.long_prefill_token_threshold:
        limit = min(limit, cfg.long_prefill_token_threshold)
    for e in t.events:
        if isinstance(e, ev.Step):
            num_tokens = {st.req: st.num_tokens for st in e.states}
            for s in (*e.running, *e.new, *e.resumed):
                total = num_tokens.get(s.req, len(t.tokens[s.req]))
                prefill_end = max(t.prompt_len[s.req], total - 1)
                start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
                if start >= prefill_end:
                    continue
                last = (total - 1) // bs * bs
                if (start < last < end
                        or (start % bs and start < (start // bs + 1) * bs < end)
                        or (end < prefill_end and end % bs and bs <= limit)):
                    return e.step, s.req, "num_scheduled_tokens"
        t.seen(e)
    return None


def _key_outlives_eviction(t: _Trace):
    bs = t.block_size
    written: dict[int, tuple[int, str, int]] = {}   # block -> (group, request, slot) handed out for
    for e in t.events:
        if isinstance(e, ev.Step):
            after = {st.req: t.tables_of(st) for st in e.states}
            for s in e.running:
                for g, slot, b in _fresh(t, e, s, after.get(s.req)):
                    written[b] = (g, s.req, slot)
            for s in (*e.new, *e.resumed):
                # The local hit's state; where an external hit follows, the
                # state its load brings is the one kept.
                c, external = t.hit_of(e, s)
                c = 0 if external else c
                tables = t.tables_of(s)
                for g in t.state_gids if c > 0 else ():
                    slot = c // bs - 1
                    g2, owner, slot2 = written.get(tables[g][slot], (None, None, None))
                    if (g2, slot2) != (g, slot) or t.tokens[owner][:c] != t.tokens[s.req][:c]:
                        return e.step, s.req, "num_computed_tokens"
                for g, slot, b in _fresh(t, e, s, None):
                    written[b] = (g, s.req, slot)
        t.seen(e)
    return None


_RULES = {
    "state-hit-attention-kept": _attention_kept,
    "state-freed-in-flight": _freed_in_flight,
    "state-chunk-off-boundary": _chunk_off_boundary,
    "state-key-outlives-eviction": _key_outlives_eviction,
}
FAULTS = tuple(_RULES)
