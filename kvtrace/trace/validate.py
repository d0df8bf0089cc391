"""Checks that need more than one line: a record against the header and against
the records before it.

``decode`` checks each record on its own (types, fields, signs). ``Validator``
then checks what only the whole file can say is wrong, so that every consumer of
``TraceReader`` (replay and diff alike) refuses the same unusable input:

* block ids, those of every KV-cache group (``more_groups``) included, must
  exist in the header's pool (``0 .. num_blocks-1``; block 0 is vLLM's null
  block, whose use is an engine bug that replay reports as a divergence rather
  than a broken file);
* token counts and positions may not exceed what the header allows anywhere
  (``max_model_len`` plus the whole KV cache): a larger one is a corrupt file;
* ``num_free_blocks`` may not exceed ``num_blocks``;
* every request named by a step, an output or a prompt_stats record must have
  arrived earlier in the file (aborts are exempt: vLLM's ``finish_requests``
  ignores ids it does not know, and the recorder writes the call as made);
* ``step`` numbers strictly increase; an output names a step whose record came
  before it and that has had no output yet, and outputs come in step order (also
  under async scheduling; a step may get no output, on an engine's error path);
  a prompt_stats record names a step already recorded;
* a ``step_failed`` record (a ``schedule()`` that raised) is the step after the
  last one, names requests that arrived, and only the ``end`` record follows it.

Each check raises ``SchemaError`` with the problem; the reader adds file and line.
Memory follows the live requests. Finished requests, which records may still
name (their prompt stats, the next step's ``finished``, a delayed
``finished_sending``, or an engine bug that schedules one again), are remembered
in fixed memory by ``FinishedRequests``.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Final

from mypy_extensions import mypyc_attr

from . import events as ev
from .events import SchemaError, clip

FINISHED_STATUSES = frozenset(s for s in ev.STATUSES if s.startswith("FINISHED_"))
RECENT_FINISHED = 1024   # finished requests a keyframe names (records after it may name them)


_REQ = attrgetter("req")
_NEW_COUNTS = attrgetter("num_computed_tokens", "num_scheduled_tokens")
_NEW_BLOCKS = attrgetter("block_ids")
_RUNNING_BLOCKS = attrgetter("new_block_ids")
_STATE_COUNTS = attrgetter("num_computed_tokens", "num_tokens")
_STATE_BLOCKS = attrgetter("block_ids")


class FinishedRequests:
    """Every request id that has finished, in 1 MiB whatever their number: a Bloom
    filter of 2^23 bits and 4 probes. It never forgets a finished request. It may
    take an id that never arrived for a finished one, with probability about
    5e-6 after 100k finished requests and 2% after a million; such a record is
    then read, and replay reports the request as unknown to the reference rather
    than the file as unusable."""

    BITS: Final = 1 << 23
    PROBES: Final = 4

    def __init__(self) -> None:
        self.bits = bytearray(self.BITS >> 3)

    def _probes(self, req: str) -> list[int]:
        h = hash(req) & 0xFFFF_FFFF_FFFF_FFFF
        first, step, mask = h, (h >> 32) | 1, self.BITS - 1
        return [(first + k * step) & mask for k in range(self.PROBES)]

    def add(self, req: str) -> None:
        bits = self.bits
        for i in self._probes(req):
            bits[i >> 3] |= 1 << (i & 7)

    def __contains__(self, req: str) -> bool:
        bits = self.bits
        return all(bits[i >> 3] >> (i & 7) & 1 for i in self._probes(req))


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class Validator:
    def __init__(self, header: ev.Header):
        cfg = header.config
        self.num_blocks = cfg.num_blocks
        # The tables a record holds beyond group 0's (``more_groups``): one per
        # group the header names; None where it names none (any count reads).
        f = header.features
        named = max(len(f.kv_cache_groups or ()), f.num_kv_cache_groups or 0)
        self.more_tables = named - 1 if named else None
        self.token_limit = cfg.max_model_len + cfg.num_blocks * cfg.block_size
        self.max_model_len = cfg.max_model_len
        self.lora = bool(header.features.lora)
        # A prompt of embeddings has a digest per block of the size vLLM hashes
        # at: hash_block_size, with several KV-cache groups (replay refuses
        # those; the trace still reads for show and diff).
        self.hash_block_size = header.features.hash_block_size or cfg.block_size
        self.live: set[str] = set()
        self.sessions: set[str] = set()   # live streaming-input sessions: arrive in chunks
        self.finished = FinishedRequests()
        # The last requests finished, in order: what a keyframe says of them.
        self.recent: deque[str] = deque(maxlen=RECENT_FINISHED)
        self.last_step = -1
        self.last_output_step = -1
        # The recorded steps after the last output, in order: those that may
        # still get theirs (one or two in flight, under async scheduling).
        self.awaiting: deque[int] = deque()
        self.failed_step: int | None = None   # a step whose schedule() raised: the engine's last
        self.keyframe_step: int | None = None   # a keyframe's, until its step's record

    # -- entry -------------------------------------------------------------------

    def check(self, e) -> None:
        if self.keyframe_step is not None:   # the record after a keyframe is its step's
            kf, self.keyframe_step = self.keyframe_step, None
            if not (isinstance(e, (ev.Step, ev.StepFailed)) and e.step == kf):
                raise SchemaError(f"a record of kind '{e.kind}' after the keyframe for step "
                                  f"{kf}: a keyframe comes right before its step's record")
        if self.failed_step is not None and not isinstance(e, ev.End):
            raise SchemaError(f"a record of kind '{e.kind}' after step {self.failed_step}, whose "
                              "schedule() raised: only the 'end' record may follow a step_failed")
        if isinstance(e, ev.Arrival):
            if e.req in self.sessions:   # the next input chunk of a session, or its end
                return
            if e.req in self.live:   # an id comes back only once its request has finished
                raise SchemaError(f"request {clip(repr(e.req))} arrives twice")
            # The engine refuses a prompt that leaves no room for the token it
            # samples; a pooling request samples none.
            room = self.max_model_len if e.pooling else self.max_model_len - 1
            if len(e.prompt_token_ids) > room:
                raise SchemaError(f"a prompt of {len(e.prompt_token_ids)} tokens leaves no room "
                                  f"for an output token within the header's max_model_len "
                                  f"{self.max_model_len}")
            if e.lora is not None and not self.lora:   # vLLM refuses it (input_processor.py:285)
                raise SchemaError(f"request {clip(repr(e.req))} names a LoRA adapter, but the header's "
                                  "features say LoRA is off")
            if e.prompt_embeds is not None:
                blocks = -(-len(e.prompt_token_ids) // self.hash_block_size)
                if len(e.prompt_embeds) != blocks:
                    raise SchemaError(f"field 'prompt_embeds' holds {len(e.prompt_embeds)} "
                                      f"digests for a prompt of {len(e.prompt_token_ids)} tokens: "
                                      f"one per block of {self.hash_block_size} makes {blocks}")
            self.live.add(e.req)
            if e.resumable:
                self.sessions.add(e.req)
        elif isinstance(e, ev.Abort):
            for req in e.reqs:
                self._finish(req)
        elif isinstance(e, ev.RequestFinished):
            self._known(e.req, "req")
        elif isinstance(e, ev.Step):
            self._step(e)
        elif isinstance(e, ev.Output):
            self._output(e)
        elif isinstance(e, ev.StepFailed):
            self._failed_step(e)
        elif isinstance(e, ev.Drafts):
            if e.step > self.last_output_step:
                raise SchemaError(f"drafts for step {e.step}, whose output has not come "
                                  f"(the last output is for step {self.last_output_step})")
            for req in e.drafts:
                self._known(req, "drafts")
        elif isinstance(e, ev.KVAudit):
            if e.step > self.last_step:
                raise SchemaError(f"kv_audit for step {e.step}, which has not been scheduled "
                                  f"(the last step is {self.last_step})")
            for name in ("loaded", "saved", "cached", "hits"):
                self._blocks([x[1] for x in getattr(e, name)], name)
        elif isinstance(e, ev.Keyframe):
            self._keyframe(e)
        elif isinstance(e, ev.PromptStats):
            if e.step > self.last_step:
                raise SchemaError(f"prompt_stats for step {e.step}, which has not been scheduled "
                                  f"(the last step is {self.last_step})")
            self._known(e.req, "req")

    # -- records -----------------------------------------------------------------

    def _step(self, s: ev.Step) -> None:
        if s.step <= self.last_step:
            raise SchemaError(f"step {s.step} does not follow step {self.last_step}: "
                              "step numbers must increase")
        for name, items in (("new", s.new), ("resumed", s.resumed)):
            if items and not self._fine(items, _NEW_COUNTS, _NEW_BLOCKS):
                for x in items:
                    self._known(x.req, f"{name}.req")
                    self._tokens(x.num_computed_tokens, f"{name}.num_computed_tokens")
                    self._tokens(x.num_scheduled_tokens, f"{name}.num_scheduled_tokens")
                    self._blocks(x.block_ids, f"{name}.block_ids")
                    self._groups(x.more_groups, f"{name}.more_groups")
        if s.running and not self._fine(s.running, _NEW_COUNTS, _RUNNING_BLOCKS):
            for r in s.running:
                self._known(r.req, "running.req")
                self._tokens(r.num_computed_tokens, "running.num_computed_tokens")
                self._tokens(r.num_scheduled_tokens, "running.num_scheduled_tokens")
                self._blocks(r.new_block_ids, "running.new_block_ids")
                self._groups(r.more_groups, "running.more_groups")
        for req in s.preempted:
            self._known(req, "preempted")
        for req in s.finished:
            self._known(req, "finished")
        self._asked(s)
        for req in s.spec or ():
            self._known(req, "spec")
        self._states(s.states)
        if s.num_free_blocks is not None and s.num_free_blocks > self.num_blocks:
            raise SchemaError(f"field 'num_free_blocks' is {s.num_free_blocks}, more than the "
                              f"{self.num_blocks} blocks of the header's pool")
        self.last_step = s.step
        self.awaiting.append(s.step)

    def _keyframe(self, k: ev.Keyframe) -> None:
        """A keyframe comes before its step; a trace that starts with one (a
        segment) starts from what it says of the records before it."""
        if k.step <= self.last_step:
            raise SchemaError(f"a keyframe for step {k.step}, which has been scheduled "
                              f"(the last step is {self.last_step}): a keyframe comes "
                              "before its step")
        self.keyframe_step = k.step
        if self.last_step == -1 and not self.live:
            self.live, self.sessions = set(k.live), set(k.sessions)
            for req in k.finished:
                self._finish_id(req)
            self.awaiting = deque(k.awaiting)
            self.last_output_step = k.last_output_step
            self.last_step = k.step - 1

    def for_keyframe(self) -> dict:
        """What a keyframe written now says of the records so far (``_keyframe``)."""
        return {"live": sorted(self.live), "sessions": sorted(self.sessions),
                "finished": list(self.recent), "awaiting": list(self.awaiting),
                "last_output_step": self.last_output_step}

    def _failed_step(self, f: ev.StepFailed) -> None:
        """A step whose ``schedule()`` raised: the step after the last one, asking
        about requests that arrived; the engine stops there."""
        if f.step <= self.last_step:
            raise SchemaError(f"step_failed for step {f.step}, which does not follow step "
                              f"{self.last_step}: step numbers must increase")
        self._asked(f)
        self.failed_step = f.step

    def _asked(self, s: ev.Step | ev.StepFailed) -> None:
        """What a step asked: its lookups, its loads, the grammars it found compiled."""
        for lk in s.lookups:
            self._known(lk.req, "lookups.req")
            self._tokens(lk.local, "lookups.local")
            if lk.ext is not None:
                self._tokens(lk.ext, "lookups.ext")
        for ld in s.loads or ():
            self._known(ld.req, "loads.req")
            self._tokens(ld.start, "loads.start")
            self._tokens(ld.end, "loads.end")
        for req in s.grammar or ():
            self._known(req, "grammar")

    def _output(self, o: ev.Output) -> None:
        if o.step > self.last_step:
            raise SchemaError(f"output for step {o.step}, which has not been scheduled "
                              f"(the last step is {self.last_step})")
        if o.step <= self.last_output_step:
            raise SchemaError(f"output for step {o.step} after the output for step "
                              f"{self.last_output_step}: outputs come once per step, in step order")
        awaiting = self.awaiting
        while awaiting and awaiting[0] < o.step:   # steps whose output never came
            awaiting.popleft()
        if not awaiting or awaiting[0] != o.step:
            raise SchemaError(f"output for step {o.step}, which has no step record before it "
                              "(steps are recorded before their outputs)")
        awaiting.popleft()
        self.last_output_step = o.step
        for req in o.sampled:
            self._known(req, "sampled")
        for req in o.finished:
            self._known(req, "finished")
        for req in o.grammar_rejected or ():
            self._known(req, "grammar_rejected")
        for req in o.pooled or ():
            self._known(req, "pooled")
        c = o.connector
        if c is not None:
            for name in ("finished_recving", "finished_sending", "failed_recving"):
                for req in getattr(c, name):
                    self._known(req, f"connector.{name}")
            self._blocks(c.invalid_block_ids, "connector.invalid_block_ids")
        self._states(o.states)
        for req in o.finished:
            if req not in self.sessions:   # a session's turn ends; it waits for more input
                self._finish(req)
        for st in o.states:
            if st.status in FINISHED_STATUSES:
                self._finish(st.req)

    def _finish(self, req: str) -> None:
        if req in self.live:
            self.live.discard(req)
            self.sessions.discard(req)
            self._finish_id(req)

    def _finish_id(self, req: str) -> None:
        self.finished.add(req)
        self.recent.append(req)

    def _fine(self, items: list, counts, blocks) -> bool:
        """Whether every item of a list of requests passes the checks below,
        checked inline: a live request, counts within the token limit, block
        ids within the pool. False sends the list through the checks item by
        item, which name the problem (a finished request is fine there)."""
        live, limit, pool = self.live, self.token_limit, self.num_blocks
        for x in items:
            a, b = counts(x)
            ids = blocks(x)
            if x.req not in live or a > limit or b > limit or (ids and max(ids) >= pool):
                return False
            more = x.more_groups
            if more is not None and self.more_tables is not None and len(more) != self.more_tables:
                return False
            if more and any(g and max(g) >= pool for g in more):
                return False
        return True

    def _states(self, states: list[ev.RequestState]) -> None:
        if not states or self._fine(states, _STATE_COUNTS, _STATE_BLOCKS):
            return
        for st in states:
            self._known(st.req, "states.req")
            self._tokens(st.num_computed_tokens, "states.num_computed_tokens")
            self._tokens(st.num_tokens, "states.num_tokens")
            self._blocks(st.block_ids, "states.block_ids")
            self._groups(st.more_groups, "states.more_groups")

    # -- values ------------------------------------------------------------------

    def _known(self, req: str, name: str) -> None:
        if req not in self.live and req not in self.finished:
            raise SchemaError(f"field '{name}' names request {clip(repr(req))}, which never "
                              "arrived")

    def _tokens(self, n: int, name: str) -> None:
        if n > self.token_limit:
            raise SchemaError(f"field '{name}' is absurd: {n} tokens, more than max_model_len "
                              f"plus the whole KV cache ({self.token_limit})")

    def _groups(self, groups: list[list[int]] | None, name: str) -> None:
        if groups is not None and self.more_tables is not None and len(groups) != self.more_tables:
            tables = "block table" if len(groups) == 1 else "block tables"
            raise SchemaError(f"'{name}' holds {len(groups)} {tables}: the header's "
                              f"{self.more_tables + 1} KV-cache groups give {self.more_tables} "
                              "beyond group 0's")
        for ids in groups or ():
            self._blocks(ids, name)

    def _blocks(self, ids: list[int], name: str) -> None:
        if not ids or max(ids) < self.num_blocks:
            return
        for b in ids:
            if b >= self.num_blocks:
                raise SchemaError(f"block id {b} in '{name}' is out of range: the header's pool "
                                  f"has ids 0..{self.num_blocks - 1} (num_blocks = {self.num_blocks})")
