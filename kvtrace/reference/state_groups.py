"""State groups: vLLM's ``MambaManager`` (ST:1415-2115) for the KV-cache
groups of Mamba, Mamba2, gated delta net and other linear-attention layers,
and the scheduler's split of prefill chunks at block boundaries (S:443-556).

A state group keeps a request's recurrent state: one block holds the state
after some prefix of its tokens. Two cache modes:

* ``none`` (prefix caching off): one block for the running state and one per
  speculative block, for the request's whole life. The group's block spans
  max_model_len tokens, so nothing is ever given back (ST:1697-1712).
* ``align``: the table is positional. Slot p holds the state after
  (p + 1) * block_size tokens, and the null block 0 where no state is kept.
  A request holds its running state (and its speculative blocks) in its last
  slots; a chunk writes the state it ends on into a new slot, and the slot
  before is given back once the step that read it is processed. Prefill
  chunks end on block boundaries (``StateSplit``), so every state written is
  one a later request may hit.

A hit is one state: the rightmost state cached in the group at or before the
length asked for, null blocks before it (ST:1454-1531). Which states stay
hash-visible follows the retention interval, as for a sliding window: with
vLLM's default 0, the state at the prompt's replay boundary and at the
request's shared-prefix boundary only (ST:1533-1590). The coordinator's fixed
point reconciles a state hit with the other groups' (kv_groups.py).

A state becomes hash-visible when the chunk that ends on it is scheduled,
before the forward pass writes it; a request whose hit is such a state waits
for the next step (ST:1688-1697), and the waiting pass stops there (S:1275).

The hash unit is the block here (the baseline refuses finer hashes, whose
partial hits and copy-on-write this module does not model).
"""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from .block_pool import Block, BlockPool
from .config import GroupSpec, SchedulerConfig
from .attention_groups import FullAttentionGroup
from .kv_manager import cdiv
from .request import Request


def checkpoint_position(num_tokens: int, block_size: int) -> int:
    """The last block boundary before ``num_tokens``, leaving one token to
    compute on a resend (KI:1110-1122, without EAGLE)."""
    return max((num_tokens - 1) // block_size * block_size, 0)


def checkpoint_fits(start: int, end: int, position: int, block_size: int,
                    alignment: int | None) -> bool:
    """Whether the chunk [start, end) can write the state at ``position`` into
    a checkpoint block inside it: the chunk starts on a boundary, the
    checkpoint's slot is past the slot the chunk starts from, and ``position``
    is a block or more into the chunk, before its end, at the layer's
    alignment (KI:1125-1145)."""
    if alignment is None:
        return False
    return (start % block_size == 0
            and cdiv(end, block_size) - 2 > (start - 1) // block_size
            and start + block_size <= position < end
            and (position - start) % alignment == 0)


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class StateGroup(FullAttentionGroup):
    """One state group's tables (MambaManager, ST:1415-2115). Only the state
    of the last computed token is needed: ``skipped_tokens`` is all but one
    (ST:1954-1959), which the inherited rules for hits on admission and for a
    connector's tokens read as 'the last slot only'."""

    spec_step_blocks = False   # it keeps its speculative blocks itself (S:347-357)

    def __init__(self, gid: int, spec: GroupSpec, pool: BlockPool, block_size: int,
                 retention: int | None, rekeys_boundary_state: bool):
        super().__init__(gid, spec, pool, block_size)
        state = spec.state
        assert state is not None
        self.align = state.mode == "align"
        self.spec_blocks = state.speculative_blocks
        self.has_checkpoints = self.align and state.checkpoint_blocks > 0
        self.checkpoint_alignment = state.checkpoint_alignment
        self.retention = retention
        self.rekeys_boundary_state = rekeys_boundary_state
        # States made hash-visible in this step (ST:1428-1452).
        self.cached_this_step: set[bytes] = set()
        # Per request, in align mode: slots below this are given back, whether
        # it has had its first allocation, and this step's checkpoint
        # (position, slot).
        self.retired: dict[str, int] = {}
        self.allocated: set[str] = set()
        self.checkpoints: dict[str, tuple[int, int]] = {}

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens whose states are no longer needed: all but the last."""
        return max(num_computed - 1, 0)

    def new_step_starts(self) -> None:
        """A step starts: no state is cached in it yet (ST:2008)."""
        self.cached_this_step.clear()

    # -- lookups -----------------------------------------------------------------

    def find_hit(self, hashes: list[bytes], max_length: int, gids: list[int]
                 ) -> tuple[list[list[Block]], int]:
        """The rightmost state cached in each of ``gids`` at or before
        ``max_length`` tokens, null blocks before it (ST:1505-1531)."""
        null = self.pool.null_block
        for i in range(max_length // self.block_size - 1, -1, -1):
            found = self.pool.get_cached_blocks(hashes[i], gids)
            if found is not None:
                return [[null] * i + [b] for b in found], (i + 1) * self.block_size
        return [[] for _ in gids], 0

    def cache_mask(self, start: int, end: int, boundaries: tuple[int, ...]) -> list[bool] | None:
        """Which states of slots [start, end) become hash-visible: with a
        retention interval, the last of each interval's blocks; and those
        ending at each of ``boundaries``, block-floored (ST:1533-1590). Every
        one under dense retention (None)."""
        if self.retention is None:
            return None
        bs = self.block_size
        mask = [False] * (end - start)
        if self.retention:
            per_segment = self.retention // bs
            if per_segment <= 1:
                return None
            for i in range((start + per_segment) // per_segment * per_segment - 1, end, per_segment):
                mask[i - start] = True
        for boundary in boundaries:
            i = boundary // bs - 1
            if start <= i < end:
                mask[i - start] = True
        return mask

    def cache(self, request: Request, num_tokens: int, boundaries: tuple[int, ...]) -> None:
        """Make states hash-visible (the full-attention rule with this group's
        mask); each one keyed here is cached this step (ST:1961-2006)."""
        req_id = request.request_id
        before = self.num_cached.get(req_id, 0)
        super().cache(request, num_tokens, boundaries)
        if self.align:
            self._key_boundary_state_again(request, num_tokens)
        table = self.tables[req_id]
        for b in table[before:self.num_cached.get(req_id, 0)]:
            if b.block_hash is not None:
                self.cached_this_step.add(b.block_hash)

    def _key_boundary_state_again(self, request: Request, num_tokens: int) -> None:
        """vLLM 0.32 keys the state at the prompt's last block boundary again
        whenever the tokens cached end there (a chunk ending there, or the
        chunk after it), though the mask above has keyed it already; that
        makes it cached this step, so a sibling that hits it in the same step
        waits (ST:2064-2113). vLLM 0.33 leaves a state keyed there alone
        (ST:2112-2115). (A prefill checkpoint is keyed by the mask's rule too:
        ST:2011-2061 change nothing while the hash unit is the block.)"""
        bs = self.block_size
        if (not self.rekeys_boundary_state or num_tokens <= 0 or num_tokens % bs
                or num_tokens != checkpoint_position(request.num_prompt_tokens, bs)):
            return
        i = num_tokens // bs - 1
        table = self.tables[request.request_id]
        if i < len(table) and table[i] is not self.pool.null_block:
            self.cached_this_step.add(request.block_hashes[i])

    # -- allocation --------------------------------------------------------------

    def blocks_needed(self, req_id: str, num_tokens: int, hits: list[Block], num_computed: int,
                      admission: bool, main: int = 0, prefill_end: int = 0) -> int:
        """New blocks for a chunk (ST:1676-1778). A hit on a state cached
        this step cannot be taken: more blocks than the pool holds. Without
        alignment: the running state and the speculative blocks. Aligned: a
        slot per block of the main model's ``main`` tokens and the
        speculative blocks, less those held or hit, but at most one new
        state, one checkpoint, and on the first allocation the speculative
        blocks; lookahead slots never count. Records the checkpoint the chunk
        writes, unless it only checks an admission."""
        if hits and hits[-1].block_hash in self.cached_this_step:
            return len(self.pool.blocks) + 1
        bs, null = self.block_size, self.pool.null_block
        if not self.align:
            return super().blocks_needed(req_id, num_tokens + bs * self.spec_blocks, hits,
                                         num_computed, admission)
        table = self.tables.get(req_id, ())
        new = cdiv(main, bs) + self.spec_blocks - len(hits) - len(table)
        position = checkpoint_position(main, bs)
        if not self._checkpoint_inside(req_id, num_computed, main, position, prefill_end):
            position = 0
        if not admission:
            if position:
                self.checkpoints[req_id] = (position, cdiv(main, bs) - 2)
            else:
                self.checkpoints.pop(req_id, None)
        if new > 0:
            first = 0 if req_id in self.allocated else self.spec_blocks
            new = min(new, 1 + (position > 0) + first)
        return new + sum(1 for b in hits if b.ref_cnt == 0 and b is not null)

    def _checkpoint_inside(self, req_id: str, start: int, end: int, position: int,
                           prefill_end: int) -> bool:
        """Whether the chunk [start, end), reaching the prefill's end, writes
        the state at ``position`` into a checkpoint block of its own, in a slot
        that is empty, null or a speculative block's (ST:1643-1674).
        ``prefill_end`` is 0 unless the retention interval is 0: then every
        chunk that can does (KC:233-234)."""
        if not (self.has_checkpoints and end >= prefill_end
                and checkpoint_fits(start, end, position, self.block_size,
                                    self.checkpoint_alignment)):
            return False
        slot = cdiv(end, self.block_size) - 2
        table = self.tables.get(req_id, ())
        return slot >= 0 and (slot >= len(table) or table[slot] is self.pool.null_block
                              or (req_id in self.allocated
                                  and slot >= len(table) - self.spec_blocks))

    def allocate(self, req_id: str, num_tokens: int, main: int = 0) -> list[Block]:
        """Slots for the chunk (ST:1780-1906); returns the table's new entries.
        Aligned: null blocks up to the slot of the state the chunk ends on,
        leaving the checkpoint's slot; a running request's speculative blocks
        that this leaves behind move to the end (their slots become null);
        then new blocks for the slots still missing."""
        bs, null = self.block_size, self.pool.null_block
        if not self.align:
            return super().allocate(req_id, num_tokens + bs * self.spec_blocks)
        table = self.tables.setdefault(req_id, [])
        required = cdiv(main, bs) + self.spec_blocks
        checkpoint = int(req_id in self.checkpoints)
        if required <= len(table) and not checkpoint:
            self.allocated.add(req_id)
            return []
        prev = len(table)
        state_slot = required - self.spec_blocks - 1
        table.extend([null] * (state_slot - checkpoint - prev))
        if req_id in self.allocated:
            for i in range(prev - self.spec_blocks, prev):
                if i >= state_slot - checkpoint:
                    break
                table.append(table[i])
                table[i] = null
        new = self.pool.get_new_blocks(max(required - len(table), 0))
        out = table[prev:] + new
        table.extend(new)
        self.allocated.add(req_id)
        return out

    def remove_skipped(self, req_id: str, num_processed: int) -> None:
        """Aligned: give back every state before the one the next token
        starts from, those in slots below (processed - 1) // block_size not
        given back before, last first, past null blocks (ST:1592-1641).
        Without alignment the one state stays."""
        table = self.tables.get(req_id)
        if not self.align or num_processed <= 1 or not table:
            return
        first = self.retired.get(req_id, 0)
        last = min((num_processed - 1) // self.block_size, len(table))
        if first >= last:
            return
        null = self.pool.null_block
        freed = []
        for i in range(last - 1, first - 1, -1):
            if table[i] is not null:
                freed.append(table[i])
                table[i] = null
        if freed:
            self.pool.free_blocks(freed)
        self.retired[req_id] = last

    def pop(self, req_id: str) -> list[Block]:
        self.allocated.discard(req_id)
        self.retired.pop(req_id, None)
        self.checkpoints.pop(req_id, None)
        return super().pop(req_id)


# The embedded engine's state-chunk-off-boundary fault overrides its split.
@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class StateSplit:
    """The scheduler's split of prefill chunks with state groups in align
    mode (S:443-556): a chunk that does not end the prefill ends on a block
    boundary; none runs past the last boundary before the request's end, past
    the next boundary when it starts inside a block, or past the request's
    shared-prefix boundary, block-floored; a chunk that ends the prefill may
    instead write the state at its last boundary into a checkpoint block,
    when every state group has one (Mamba2)."""

    block_size: int
    max_prefill_tokens: int                 # a chunk's most tokens: budget, long-prefill threshold
    checkpoints: bool                       # every state group has a checkpoint block
    checkpoint_alignment: int | None        # the first state group's

    @classmethod
    def of(cls, config: SchedulerConfig) -> "StateSplit | None":
        """The split, when a state group keeps its states aligned (S:375-394)."""
        states = [g.state for g in config.kv_groups if g.state is not None]
        if not any(s.mode == "align" for s in states):
            return None
        threshold = config.long_prefill_token_threshold
        budget = config.token_budget
        return cls(config.block_size, min(budget, threshold) if threshold > 0 else budget,
                   all(s.checkpoint_blocks > 0 for s in states), states[0].checkpoint_alignment)

    def chunk(self, r: Request, start: int, n: int) -> int:
        """How many of ``n`` tokens from ``start`` the chunk keeps (0: none,
        which stops a waiting pass and passes over a running request)."""
        prefill_end = max(r.num_prompt_tokens, r.num_tokens - 1)
        if start >= prefill_end:
            return n
        bs = self.block_size
        last_cached = checkpoint_position(r.num_tokens, bs)
        end = start + n
        inside = (self.checkpoints and end >= prefill_end
                  and checkpoint_fits(start, end, checkpoint_position(prefill_end, bs), bs,
                                      self.checkpoint_alignment))
        if inside:
            last_cached = 0
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.max_prefill_tokens:
                end = aligned
        junction = r.shared_prefix_boundary
        stops = ((start // bs + 1) * bs if start % bs and not inside else 0,
                 last_cached,
                 start + (junction - start) // bs * bs if start < junction < end else 0)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)
