"""The content check's model of state groups (Mamba, Mamba2, gated delta nets):
which state each scheduled request starts from, and which states it writes,
through which slot of its state table. It follows vLLM 0.32's model runner,
which reads and writes states where the scheduler's tables alone do not say
(docs/design/content-check.md gives the reasons).

A state is named by the prefix it follows: "the state after L tokens" of a
request. A step that computes positions [c, c + n) of a request starts from
the state after c tokens (none when c is 0), and writes the state after c + n:

* ``align`` (prefix caching): slot p of the table holds the state after
  (p + 1) * block_size tokens. The model runner keeps, per request, the slot
  it wrote last (``mamba_state_idx``), forgotten when the request finishes,
  is preempted or resumes; without it the state is at slot (c - 1) //
  block_size. Before the forward pass it copies that state into the slot of
  the state the step ends on, cdiv(c + n, block_size) - 1, and the forward
  pass reads and writes that slot (MU:1446-1549, MA:1163-1195). So the step
  reads the state after c from the slot written last and writes the state
  after c + n at cdiv(c + n, block_size) - 1. A state group with a prefill
  checkpoint block (Mamba2) also writes, in a prefill chunk where vLLM's rule
  allows it, the state at the chunk's last block boundary into slot
  cdiv(c + n, block_size) - 2 (MC:21-58, the rule ``StateSplit`` follows).
* ``none`` (no prefix caching): the request's one state block, slot 0.

With speculative decoding each state group keeps ``num_speculative_blocks``
more blocks after the running state. A decode (a row with drafts, or a
one-token step past the prompt: MR:2195-2231) writes the state after each of
its tokens, c + 1 + t into slot t past the running state's, and starts from
the slot of the state after its last accepted token: offset
``num_accepted_tokens - 1``, the tokens the previous step sampled, 1 after a
step that sampled nothing or a new request (MR:1544-1589, GC:564-567). The
states after drafts become the request's own only once the output accepts
them: those are written then (``late``); a rejected draft's state is not
written in the shadow cache, whose slot keeps a state of another length. In
``align`` mode the runner also copies, after the output, the state at a block
boundary the accepted tokens crossed into that boundary's slot (MU:369-500).

Citations: MU ``v1/worker/mamba_utils.py``, MA
``v1/attention/backends/utils.py``, MR ``v1/worker/gpu_model_runner.py``, GC
``model_executor/layers/mamba/ops/cpu/gdn_attention.py``, MC
``model_executor/layers/mamba/checkpoint.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.reference.state_groups import checkpoint_fits, checkpoint_position
from kvtrace.trace import events as ev


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """One state group, as the content check needs it."""

    gid: int
    align: bool
    block_size: int
    spec_blocks: int
    checkpoint: bool
    checkpoint_alignment: int | None

    @classmethod
    def of(cls, gid: int, g: ev.KVCacheGroup) -> "StateLayout | None":
        if g.kind != "MambaSpec":
            return None
        return cls(gid, g.mamba_cache_mode != "none", g.block_size, g.num_speculative_blocks or 0,
                   bool(g.num_prefill_checkpoint_blocks), g.prefill_checkpoint_alignment)


# An operation on a state: (what, group, length, group's table, table slot),
# what "load", "read" or "write" (ShadowCore.queue's ``states``, by group).
Op = tuple[str, int, int, list[int], int]


class StateModel:
    """What vLLM's model runner keeps per request for its state groups, fed
    in a synchronous engine's order (step N, output N, step N + 1)."""

    def __init__(self, layouts: list[StateLayout]):
        self.layouts = layouts
        self.spec = any(s.spec_blocks for s in layouts)
        self.align = any(s.align for s in layouts)
        self.last_slot: dict[str, int] = {}    # mamba_state_idx (align)
        self.accepted: dict[str, int] = {}     # num_accepted_tokens
        self.prompt: dict[str, int] = {}       # num_prompt_tokens
        # Per step: each decode's (c, the running state's slot per group), for the
        # states its output accepts.
        self.decodes: dict[int, dict[str, tuple[int, dict[int, int]]]] = {}

    def forget(self, req: str) -> None:
        """The request finished, was preempted or resumes: the runner starts it
        afresh (MU:1398-1413; a request added to the batch has 1 accepted)."""
        self.last_slot.pop(req, None)
        self.accepted.pop(req, None)

    def drop(self, req: str) -> None:
        self.forget(req)
        self.prompt.pop(req, None)

    def loads(self, end: int, table) -> list[Op]:
        """A connector's load of a request's positions up to ``end``: the state
        after ``end`` tokens, where the step that computes on from there reads
        it."""
        if end <= 0:
            return []
        return [("load", s.gid, end, table(s.gid), (end - 1) // s.block_size if s.align else 0)
                for s in self.layouts]

    def step(self, step: int, req: str, c: int, n: int, drafts: int, table) -> list[Op]:
        """The state reads and writes of ``req`` computing [c, c + n) with
        ``drafts`` drafts; ``table(gid)`` is its table in a group."""
        decode = self.spec and ((drafts > 0 and n == drafts + 1)
                                or (drafts == 0 and n == 1 and c >= self.prompt.get(req, 0)))
        offset = self.accepted.get(req, 1) - 1
        self.accepted[req] = 1   # until its output says how many it sampled
        ops: list[Op] = []
        bases: dict[int, int] = {}
        for s in self.layouts:
            t = table(s.gid)
            bs = s.block_size
            if s.align:
                last = self.last_slot.get(req, (c - 1) // bs)
                base = _cdiv(c + n, bs) - 1
                read = last + offset
            else:
                base = 0
                read = offset if decode else 0
            if c > 0:
                ops.append(("read", s.gid, c, t, read))
            ops.append(("write", s.gid, c + 1 if decode else c + n, t, base))
            bases[s.gid] = base
            if s.align and s.checkpoint:
                at = checkpoint_position(c + n, bs)
                if checkpoint_fits(c, c + n, at, bs, s.checkpoint_alignment):
                    ops.append(("write", s.gid, at, t, _cdiv(c + n, bs) - 2))
        if self.align:
            self.last_slot[req] = _cdiv(c + n, self.layouts[0].block_size) - 1
        if decode and n > 1:
            self.decodes.setdefault(step, {})[req] = (c, bases)
        return ops

    def output(self, step: int, req: str, sampled: int, accepted: int, table) -> list[Op]:
        """``req`` sampled ``sampled`` tokens in ``step``'s output, of which the
        request keeps ``accepted`` drafts: the states after them, and in align
        mode the state at a block boundary they crossed, copied to its slot."""
        self.accepted[req] = max(sampled, 1)
        row = self.decodes.get(step, {}).pop(req, None)
        if row is None:
            return []
        c, bases = row
        ops: list[Op] = []
        for s in self.layouts:
            t, base = table(s.gid), bases[s.gid]
            ops += [("write", s.gid, c + 1 + k, t, base + k) for k in range(1, accepted + 1)]
            if s.align:   # MU:451-487
                boundary = (c + 1 + accepted) // s.block_size * s.block_size
                dest = boundary // s.block_size - 1
                if boundary >= c + 1 and (dest != base or boundary > c + 1):
                    ops.append(("write", s.gid, boundary, t, dest))
                if boundary >= c + 1 and dest == base:
                    self.accepted[req] = 1
        return ops

    def step_done(self, step: int) -> None:
        """A step whose output never comes (an engine error path): its decodes go."""
        self.decodes.pop(step, None)
