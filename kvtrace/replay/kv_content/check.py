"""Feeds the shadow KV cache from what the engine recorded.

The content check uses only the recording: the engine's own block tables,
num_computed_tokens, loads and accepted tokens. So it checks a trace on its own
terms, and flags wrong KV even where every counter agrees with the reference.

Under async scheduling the engine schedules step N+1 before step N's output
comes back, and step N+1 writes the KV of the token that output brings. The
check then holds each step back until the outputs of the steps before it have
arrived, and takes steps and outputs in the order a synchronous engine would
have made them (step N, output N, step N+1); the results of a held step come
back with a later call (an output is taken as soon as it can be, so that a
request it finishes is gone before an arrival reuses its id). An abort is
applied once the last step recorded before it has been checked: the engine still runs that step's writes, and a request
scheduled later may read them (a prefix hit on blocks the aborted request was
filling).

A prompt given as embeddings (``prompt_embeds``) has token id 0 at each
position given as embeddings. The KV there comes from the embeddings, not from
a token, so such a position's "token" is a stand-in drawn from the digest of
its block's rows (``content_tokens``), outside the range of token ids: a
slot written from embeddings and read as another request's token 0, or as
other embeddings, is wrong KV. Two requests read each other's slots only
through a prefix hit, on blocks of equal digests, so a stand-in per block is
enough. A request's LoRA adapter changes its KV at every position: its first
position's token (or stand-in) is replaced by a stand-in drawn from it and the
adapter's path, and every fingerprint of the request, a sum that starts there,
is the adapter's own. A slot written under one adapter and read under another
is wrong KV.

With several KV-cache groups, each group's layers write and read through the
group's own table. The check follows each group as a request of its own: the
same tokens, with a first-position stand-in drawn from the group's index (group
0 keeps the tokens as they are), so a slot one group wrote and another reads is
wrong KV. A sliding-window group's reads start at the window of the first
position computed: the blocks before it are given back (the null block 0 takes
their place), and nothing reads them.

A streaming-input session keeps its id, blocks and KV from turn to turn. When
a turn ends, its tokens are cut back to those whose KV is written (the
recorded ``num_computed_tokens``: the last sampled token is never written), or
under vLLM 0.33 to all but the last sampled token, and
the next chunk's tokens follow them, when the engine takes that chunk: at the
turn's end if it came during the turn, else when it comes.
"""

from __future__ import annotations

import re
from collections import deque
from hashlib import blake2b

from kvtrace.findings import Divergence
from kvtrace.trace import events as ev

from ..checks import admitted_hits
from .states import StateLayout, StateModel
from .core import Table
from .device import open_shadow


def _stand_in(data: bytes) -> int:
    """A stand-in token drawn from ``data``, in 2^62 .. 2^63: token ids are at
    most 2^40, and the shadow cache holds int64."""
    h = blake2b(data, digest_size=8).digest()
    return (1 << 62) | (int.from_bytes(h, "little") & ((1 << 62) - 1))


def content_tokens(a: ev.Arrival, block_size: int) -> list[int]:
    """The arrival's prompt as the shadow cache takes it: a stand-in at each
    position given as embeddings, one per block, from its digest; and with a
    LoRA adapter, the first position's token, or stand-in, and the adapter's
    path in one stand-in."""
    tokens = list(a.prompt_token_ids)
    if a.prompt_embeds is not None:
        _embeds(tokens, a, block_size)
    if a.lora is not None:
        tokens[0] = _stand_in(f"lora {a.lora['path']} {tokens[0]}".encode())
    return tokens


def _embeds(tokens: list[int], a: ev.Arrival, block_size: int) -> None:
    as_ids = ev.mask_from_runs(a.prompt_is_token_ids, len(tokens))
    for i, digest in enumerate(a.prompt_embeds):
        stand_in = _stand_in(digest.encode())
        for p in range(i * block_size, min((i + 1) * block_size, len(tokens))):
            if not as_ids[p]:
                tokens[p] = stand_in


# Joins a request's id and a KV-cache group's index into the name the shadow
# cache knows that group's copy of the request by.
_GROUP = "\x1f"


def _in_group(tokens: list[int], group: int) -> list[int]:
    """A request's tokens as KV-cache group ``group`` (above 0) holds them."""
    out = list(tokens)
    if out:
        out[0] = _stand_in(f"group {group} {out[0]}".encode())
    return out


_WRITER = re.compile("(written by|loaded for) (.*?) at step ")


def _in_words(d: Divergence) -> None:
    """A divergence of a KV-cache group's copy of a request, as a person reads
    it: the request's own id, its group named before the words (but group 0),
    and a writer's copy named by its request, with its group when another."""
    name = d.req
    req, _, group = name.partition(_GROUP)
    d.req = req

    def writer(m: re.Match) -> str:
        name, _, of = m[2].partition(_GROUP)
        other = f" (group {of or 0})" if (of or "0") != (group or "0") else ""
        return f"{m[1]} {name}{other} at step "

    d.recorded = _WRITER.sub(writer, d.recorded)
    d.expected = d.expected.replace(name, req)
    if group:
        d.recorded = f"group {group}: {d.recorded}"


FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED",
            "FINISHED_IGNORED", "FINISHED_ERROR")


def _attention_sizes(groups) -> set[int]:
    return {g.block_size for g in groups or () if g.kind != "MambaSpec"}


def shadow_block_size(cfg: ev.SchedulerConfig, groups) -> int:
    """The slots per block of the shadow cache: the attention groups' block
    size (a state group without prefix caching has blocks of max_model_len
    tokens, and a block id is one page whichever group holds it), else the
    trace's."""
    sizes = _attention_sizes(groups)
    return sizes.pop() if len(sizes) == 1 else cfg.block_size


def unchecked(header: ev.Header) -> str | None:
    """What the content check cannot check on this trace, in a sentence; None
    when it checks everything it reads."""
    if len(_attention_sizes(header.features.kv_cache_groups)) > 1:
        return ("the shadow-KV check does not run on attention groups of different block "
                "sizes; every group's block table and every count are checked")
    return None


class ContentCheck:
    # Async scheduling: steps held at most, should an output never come (an engine
    # error path); the oldest step still waiting for one then goes on without it.
    MAX_HELD = 64

    def __init__(self, cfg: ev.SchedulerConfig, device: str = "auto",
                 async_scheduling: bool = False, keep_counts: bool = False,
                 session_keeps_sampled: bool = False, windows: tuple[int | None, ...] = (),
                 groups: list[ev.KVCacheGroup] | None = None):
        """``groups``: the header's KV-cache groups (None: one full-attention
        group, or the groups ``windows`` gives, each one's sliding window or
        None for full attention)."""
        self.kv = open_shadow(cfg.num_blocks, shadow_block_size(cfg, groups), device)
        if groups:
            windows = tuple(g.sliding_window for g in groups)
        self.windows = tuple(w or 0 for w in windows) or (0,)
        self.more_groups = range(1, len(self.windows))
        layouts = [StateLayout.of(g, spec) for g, spec in enumerate(groups or ())]
        # State groups (states.py), and the groups attention reads.
        self.states = StateModel([s for s in layouts if s]) if any(layouts) else None
        self.attention = [g for g in range(len(self.windows)) if not any(layouts) or not layouts[g]]
        self.more_attention = [g for g in self.attention if g]
        self.more_tables: dict[str, list[Table]] = {}   # groups 1, 2, ...: their tables
        self.block_size = cfg.block_size
        self.has_connector = cfg.connector is not None
        self.max_model_len = cfg.max_model_len
        self.tables: dict[str, Table] = {}     # the engine's table per live request
        self.reads_no_cache: set[str] = set()       # live requests that skip the prefix cache
        # Live streaming-input sessions: the chunks given and not taken yet (None:
        # the end of the input), and those waiting for their next chunk.
        self.sessions: dict[str, deque[list[int] | None]] = {}
        self.between_turns: set[str] = set()
        # A turn keeps its tokens up to the last sampled one (vLLM 0.33), not
        # only those whose KV is written.
        self.session_keeps_sampled = session_keeps_sampled
        self.assumed_loads = False                  # loads inferred from lookups, not recorded
        self.async_scheduling = async_scheduling
        self._held: deque[tuple] = deque()          # (step, line, tag, aborts after it, in flight)
        self._held_outputs: deque[ev.Output] = deque()
        self._awaiting: set[int] = set()            # steps that scheduled work, output not in
        self._ready: list = []                      # results of steps released meanwhile
        self._drafts: dict[int, dict[str, int]] = {}   # per step, the drafts it scheduled per request
        # Async scheduling: per step, the drafts its output rejected per request,
        # and the sessions whose turn it ended.
        self._rejected: dict[int, dict[str, int]] = {}
        self._turn_ended: dict[int, set[str]] = {}
        # With keep_counts, (slots checked, states checked, loads assumed) as each
        # step is queued, in step order, for a caller that reports them per step
        # (the worker).
        self.counts: deque[tuple[int, int, bool]] | None = deque() if keep_counts else None

    @property
    def device(self) -> str:
        return str(self.kv.device)

    @property
    def slots_checked(self) -> int:
        return self.kv.slots_checked

    @property
    def states_checked(self) -> int:
        return self.kv.states_checked

    def arrival(self, a: ev.Arrival) -> None:
        chunks = self.sessions.get(a.req)
        if chunks is not None:   # a live session's next chunk, or the end of its input
            chunks.append(list(a.prompt_token_ids) if a.resumable else None)
            if a.req in self.between_turns:
                self._next_turn(a.req)
            return
        if a.resumable:
            self.sessions[a.req] = deque()
        most = min(len(a.prompt_token_ids) + a.max_tokens, self.max_model_len)
        tokens = content_tokens(a, self.block_size)
        self.kv.add_request(a.req, tokens, most, self.windows[0])
        for g in self.more_groups:
            self.kv.add_request(a.req + _GROUP + str(g), _in_group(tokens, g), most,
                                self.windows[g])
        if a.skip_reading_prefix_cache:
            self.reads_no_cache.add(a.req)
        if self.states is not None:
            self.states.prompt[a.req] = len(tokens)

    def abort(self, reqs: list[str]) -> None:
        if self._held:   # async scheduling: after the step recorded before it
            self._held[-1][3].extend(reqs)
            return
        for req in reqs:
            self._drop(req)

    def step(self, rec: ev.Step, line: int | None, tag: object = None
             ) -> list[tuple[object, list[Divergence]]]:
        """Queue the step's check. Returns the steps checked meanwhile, as (tag,
        divergences) in step order; ``flush`` returns the rest."""
        if not self.async_scheduling:
            return self._step(rec, line, tag)
        self._held.append((rec, line, tag, [], tuple(self._awaiting)))
        if rec.new or rec.resumed or rec.running:
            self._awaiting.add(rec.step)
        if len(self._held) > self.MAX_HELD and self._awaiting:
            self._awaiting.discard(min(self._awaiting))
        self._release()
        out, self._ready = self._ready, []
        return out

    def _release(self, everything: bool = False) -> None:
        """Take held steps and outputs in a synchronous engine's order: an output
        before any later step, and a step once no earlier step's output is still
        to come (``everything``: at the end, whatever is held). The steps'
        results wait in ``_ready``."""
        out = self._ready
        held, outputs = self._held, self._held_outputs
        while held or outputs:
            if outputs and (not held or outputs[0].step < held[0][0].step):
                self._output(outputs.popleft())
            elif held and (everything or min(self._awaiting, default=held[0][0].step)
                           >= held[0][0].step):
                rec, line, tag, aborted, in_flight = held.popleft()
                out += self._step(rec, line, tag, *self._came_back(in_flight))
                for req in aborted:
                    self._drop(req)
            else:
                break

    def _came_back(self, in_flight: tuple[int, ...]) -> tuple[dict[str, int], set[str]]:
        """Async scheduling: what the outputs of ``in_flight``, the steps still to
        come back when a step was scheduled, changed for it by the time the
        model runner ran it. Per request, the drafts they rejected: the step
        counts them as computed, and the model runner writes its tokens that
        many positions lower (the scheduler takes them back only later,
        S:2119-2128). And the sessions whose turn they ended: the engine drops
        the step's output for them (S:2471-2477); its KV writes land at or past
        where the turn was cut back, and the next turn writes those positions
        again before any step reads them, so the check leaves the step's work
        for them out. It leaves out, too, the work of requests with drafts in
        a step whose output never came (the trace ends first, as when the
        engine failed): where the model runner put their tokens is unknown."""
        back: dict[str, int] = {}
        ended: set[str] = set()
        for step in in_flight:
            for req, n in self._rejected.get(step, {}).items():
                back[req] = back.get(req, 0) + n
            ended |= self._turn_ended.get(step, set())
            if step in self._awaiting:   # only at the end: see _release
                ended |= {req for req, n in self._drafts.get(step, {}).items() if n}
        if in_flight:
            for seen in (self._rejected, self._turn_ended):
                for old in [k for k in seen if k < min(in_flight)]:
                    del seen[old]
        return back, ended

    def _step(self, rec: ev.Step, line: int | None, tag: object, rolled_back: dict | None = None,
              turn_ended: set[str] = frozenset()) -> list[tuple[object, list[Divergence]]]:
        for req in rec.preempted:
            self.tables.pop(req, None)
            self.more_tables.pop(req, None)
            if self.states is not None:
                self.states.forget(req)
        kv = self.kv   # a request that finished (or never arrived) gets no table
        for s in (*rec.new, *rec.resumed):
            if s.req in kv:
                self.tables[s.req] = Table(s.block_ids)
        for s in rec.running:
            if s.req in kv:
                table = self.tables.get(s.req)
                if table is None:
                    table = self.tables[s.req] = Table()
                table.extend(s.new_block_ids)
        for st in rec.states:
            if st.req in kv:
                self.tables[st.req] = Table(st.block_ids)
        if self.more_groups:
            self._more_tables(rec)
        loads = [(ld.req, ld.start, ld.end, self.tables.get(ld.req, []))
                 for ld in self._loads(rec) if ld.req in self.kv]
        scheduled = [(s.req, s.num_computed_tokens, s.num_scheduled_tokens, self.tables.get(s.req, []))
                     for s in (*rec.new, *rec.resumed) if s.req in self.kv]
        back = rolled_back or {}
        scheduled += [(s.req, s.num_computed_tokens - back.get(s.req, 0), s.num_scheduled_tokens,
                       self.tables.get(s.req, [])) for s in rec.running
                      if s.req in self.kv and s.req not in turn_ended]
        if rec.spec:
            self._drafts[rec.step] = {req: len(ids) for req, ids in rec.spec.items() if req in kv}
            if len(self._drafts) > self.MAX_HELD:   # outputs that never came (engine error paths)
                del self._drafts[min(self._drafts)]
        states = ()
        if self.states is not None:
            states = self._state_ops(rec, loads, scheduled)
            loads, scheduled = self._in_groups(loads), self._in_groups(scheduled)
        elif self.more_groups:
            loads, scheduled = self._in_groups(loads), self._in_groups(scheduled)
        ready = self.kv.queue(rec.step, loads, scheduled, (tag, rec.seq, line), states)
        if self.counts is not None:
            self.counts.append((self.kv.slots_checked, self.kv.states_checked, self.assumed_loads))
        return self._placed(ready)

    def _more_tables(self, rec: ev.Step) -> None:
        """The step's tables of KV-cache groups 1, 2, ..."""
        kv, empty = self.kv, [[] for _ in self.more_groups]
        for s in (*rec.new, *rec.resumed, *rec.states):
            if s.req in kv:
                self.more_tables[s.req] = [Table(t) for t in s.more_groups or empty]
        for s in rec.running:
            if s.req in kv and s.more_groups:
                tables = self.more_tables.get(s.req)
                if tables is None:
                    tables = self.more_tables[s.req] = [Table() for _ in self.more_groups]
                for table, new in zip(tables, s.more_groups):
                    table.extend(new)

    def _in_groups(self, items: list[tuple]) -> list[tuple]:
        """(request, a, b, group 0's table) items, as each group attention reads
        takes them: its copy of the request, through its table."""
        out = list(items) if self.attention[:1] == [0] else []
        for req, a, b, _table in items:
            tables = self.more_tables.get(req)
            for g in self.more_attention:
                out.append((req + _GROUP + str(g), a, b, tables[g - 1] if tables else []))
        return out

    def _table(self, req: str, g: int) -> list[int]:
        """The request's table in KV-cache group ``g``."""
        if not g:
            return self.tables.get(req, [])
        tables = self.more_tables.get(req)
        return tables[g - 1] if tables else []

    def _name(self, req: str, g: int) -> str:
        """The shadow cache's name of the request's copy in group ``g``."""
        return req + _GROUP + str(g) if g else req

    def _state_ops(self, rec: ev.Step, loads: list[tuple], scheduled: list[tuple]) -> list[tuple]:
        """The step's state loads, reads and writes (states.py), as the
        shadow cache takes them."""
        sm = self.states
        for s in rec.resumed:
            sm.forget(s.req)
        drafts = rec.spec or {}
        ops = []
        for req, _start, end, _t in loads:
            ops += [(w, self._name(req, g), n, t, i)
                    for w, g, n, t, i in sm.loads(end, lambda g, r=req: self._table(r, g))]
        for req, c, n, _t in scheduled:
            ops += [(w, self._name(req, g), m, t, i)
                    for w, g, m, t, i in sm.step(rec.step, req, c, n, len(drafts.get(req, ())),
                                                 lambda g, r=req: self._table(r, g))]
        while len(sm.decodes) > self.MAX_HELD:   # outputs that never came (engine error paths)
            sm.step_done(min(sm.decodes))
        return ops

    def _names(self, req: str) -> list[str]:
        """The shadow cache's names of the request: one per KV-cache group."""
        return [req] + [req + _GROUP + str(g) for g in self.more_groups]

    def flush(self) -> list[tuple[object, list[Divergence]]]:
        """Check every queued step."""
        if self.async_scheduling:
            self._release(everything=True)
        out, self._ready = self._ready, []
        return out + self._placed(self.kv.flush())

    def _placed(self, ready: list) -> list[tuple[object, list[Divergence]]]:
        out = []
        for (tag, seq, line), divs in ready:
            for d in divs:
                d.seq, d.line = seq, line
                if self.more_groups:
                    _in_words(d)
            out.append((tag, divs))
        return out

    def close(self) -> None:
        """Nothing to stop: the check runs in this process (see ContentWorker)."""

    def output(self, rec: ev.Output) -> None:
        if not self.async_scheduling:
            return self._output(rec)
        self._awaiting.discard(rec.step)
        self._held_outputs.append(rec)
        self._release()

    def _output(self, rec: ev.Output) -> None:
        states = {s.req: s for s in rec.states}
        drafts = self._drafts.pop(rec.step, None)
        accepted = []
        late_states = []
        for req, tokens in rec.sampled.items():
            if req not in self.kv:
                continue
            st = states.get(req)
            # The engine drops a step's tokens for a request hit by a load failure:
            # its recorded token count says how many it kept.
            num_drafts = drafts.get(req, 0) if drafts else 0
            before = self.kv.num_tokens(req) if st is not None or num_drafts else 0
            keep = len(tokens) if st is None else max(0, st.num_tokens - before)
            if keep:
                self.kv.append_tokens(req, tokens[:keep])
                for g in self.more_groups:
                    self.kv.append_tokens(req + _GROUP + str(g), tokens[:keep])
            # The step wrote the KV of its drafts; the sampled tokens are the drafts
            # accepted and one more (SD1), so the accepted ones hold the request's own
            # tokens: those of them it keeps (a stop may cut the sampled tokens short).
            num_accepted = 0
            if num_drafts:
                num_accepted = min(num_drafts, len(tokens) - 1, keep)
                if num_accepted > 0:
                    accepted.append((req, before, before + num_accepted, self.tables.get(req, [])))
                    if self.more_groups or self.states is not None:
                        accepted[-1:] = self._in_groups(accepted[-1:])
                if self.async_scheduling:
                    rejected = num_drafts - max(len(tokens) - 1, 0)
                    self._rejected.setdefault(rec.step, {})[req] = rejected
            if self.states is not None:
                late_states += [(self._name(req, g), n, t, i) for _, g, n, t, i in self.states.output(
                    rec.step, req, len(tokens), max(num_accepted, 0),
                    lambda g, r=req: self._table(r, g))]
        if accepted or late_states:
            self.kv.queue_late_writes(rec.step, accepted, late_states)
        for st in rec.states:
            if st.status in FINISHED:
                self._drop(st.req)
        turns = rec.turn_ends()
        if turns and self.async_scheduling:
            self._turn_ended[rec.step] = set(turns)
        for req in rec.finished:
            if req in turns and req in self.sessions:
                self._turn_end(req, turns[req])
            else:
                self._drop(req)

    def _turn_end(self, req: str, st: ev.RequestState) -> None:
        """A session's turn stopped: back to the tokens whose KV is written; then
        its next chunk if one has come (the engine took it at the stop, or will
        take it when it comes: the same tokens either way), else wait for it."""
        keep = st.num_computed_tokens
        if self.session_keeps_sampled:
            keep = self.kv.num_tokens(req) - 1
        for name in self._names(req):
            self.kv.truncate(name, keep)
        self.between_turns.add(req)
        if self.sessions[req]:
            self._next_turn(req)

    def _next_turn(self, req: str) -> None:
        chunk = self.sessions[req].popleft()
        self.between_turns.discard(req)
        if chunk is None:
            self._drop(req)
        else:
            for name in self._names(req):
                self.kv.append_tokens(name, chunk)
            if self.states is not None:
                self.states.prompt[req] = self.kv.num_tokens(req)

    def _loads(self, rec: ev.Step) -> list[ev.KVLoad]:
        if rec.loads is not None:
            return rec.loads
        if not self.has_connector:
            return []
        # No load plan in the trace: assume every admitted external hit was loaded.
        self.assumed_loads = True
        return [ev.KVLoad(req, start, end)
                for req, start, end in admitted_hits(rec, self.reads_no_cache.__contains__)]

    def _drop(self, req: str) -> None:
        self.tables.pop(req, None)
        self.more_tables.pop(req, None)
        if self.states is not None:
            self.states.drop(req)
        self.reads_no_cache.discard(req)
        self.sessions.pop(req, None)
        self.between_turns.discard(req)
        if req in self.kv:
            for name in self._names(req):
                self.kv.drop_request(name)
