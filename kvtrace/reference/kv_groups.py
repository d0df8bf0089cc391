"""The KV-cache manager for several KV-cache groups, or for one sliding-window
or state group (semantics doc 4.9): vLLM's hybrid coordinator over one manager
per group (KC: kv_cache_coordinator.py, ST: single_type_kv_cache_manager.py,
KM: kv_cache_manager.py).

Every group draws blocks from the one pool and keeps its own table per
request. Three kinds of group are modelled: full attention and sliding window
(attention_groups.py), and a state group (Mamba, linear attention:
state_groups.py).

A hit must hold in every group: the groups are asked in turn, full attention
first, each at most the length the last one answered, until none shortens it
(KC:796-931). With prefix caching all groups share ``block_size`` (the
baseline refuses others), so every length is block-aligned; without it, a
group may have a block of its own, of which the scheduler's block is a
multiple (KC:115-119).

It answers the scheduler as ``KVCacheManager`` does; a hit is a tuple of
per-group block lists, and ``get_block_ids`` is group 0's table, the other
groups' in ``more_ids``.
"""

from __future__ import annotations

from typing import Sequence

from mypy_extensions import mypyc_attr

from .attention_groups import FullAttentionGroup, SlidingWindowGroup
from .block_pool import Block, BlockPool
from .config import GroupSpec, SchedulerConfig
from .kv_manager import KVCacheManager, PoolOperations, cdiv
from .request import Request
from .state_groups import StateGroup


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class GroupedKVCacheManager(PoolOperations):
    """``KVCacheManager``'s answers over several groups (KC:95-460, KM:264-660)."""

    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.watermark_blocks = config.watermark_blocks
        self.num_spec_tokens = config.num_spec_tokens
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching,
                              config.profile.free_uncached_to_head)
        self.retention = config.prefix_cache_retention
        self.groups: list[FullAttentionGroup] = [self._group(gid, spec, config)
                                                 for gid, spec in enumerate(config.kv_groups)]
        # Groups of one spec are looked up together; full attention first (KC:708-765).
        by_spec: dict[GroupSpec, list[int]] = {}
        for gid, spec in enumerate(config.kv_groups):
            by_spec.setdefault(spec, []).append(gid)
        self.lookup_order = sorted(by_spec.values(), key=lambda gids: not self._full_attention(gids))
        # A speculative step's blocks are reserved in the attention groups only:
        # a state group keeps its speculative blocks already (S:347-357).
        self.spec_step_block_sizes = tuple(g.block_size for g in self.groups if g.spec_step_blocks)
        self.has_states = any(spec.state is not None for spec in config.kv_groups)

    def _group(self, gid: int, spec: GroupSpec, config: SchedulerConfig) -> FullAttentionGroup:
        block_size = spec.block_size or self.block_size
        if spec.state is not None:
            return StateGroup(gid, spec, self.pool, block_size, config.prefix_cache_retention,
                              config.profile.rekeys_boundary_state)
        if spec.sliding_window is not None:
            return SlidingWindowGroup(gid, spec, self.pool, block_size,
                                      config.prefix_cache_retention)
        return FullAttentionGroup(gid, spec, self.pool, block_size)

    # -- lookups ---------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[Block], ...], int]:
        """The longest hit every group can serve, capped so that a token is left
        to compute (KM:264-321, KC:846-961). A full-attention group that hit
        further than the others names that point the request's shared-prefix
        boundary, where the sliding-window groups keep a window for later hits."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            request.shared_prefix_boundary = 0
            return (), 0
        hashes = request.block_hashes
        hit_length = request.num_tokens - 1
        hits: list[list[Block] | None] = [None] * len(self.groups)
        lengths = [0] * len(self.groups)
        longest = 0
        simple = len(self.lookup_order) == 2 and self._full_attention(self.lookup_order[0])
        while True:
            length = hit_length
            for gids in self.lookup_order:
                first = gids[0]
                if hits[first] is not None and self._full_attention(gids):
                    length = min(length, lengths[first])   # full attention: a prefix of its hit
                    continue
                found, length = self.groups[first].find_hit(hashes, length, gids)
                for g, blocks in zip(gids, found):
                    hits[g], lengths[g] = blocks, length
                longest = max(longest, length)
            if length >= hit_length:
                break
            hit_length = length
            if simple:
                break
        out = tuple(h or [] for h in hits)
        for gids in self.lookup_order:
            if self._full_attention(gids):
                for g in gids:
                    del out[g][cdiv(hit_length, self.groups[g].block_size):]
        request.shared_prefix_boundary = longest if longest > hit_length else 0
        return (out if any(out) else ()), hit_length

    def get_computed_blocks_for_connector(self, request: Request
                                          ) -> tuple[tuple[list[Block], ...], int, bool]:
        """The lookup under a connector that restores a state group's lagging
        state (KM:323-369, KC:933-977): each group's hit on its own, full
        attention's taken as the local hit, and whether a group lags behind it.
        A group that hits further than full attention (whose blocks were
        evicted) makes it the hit every group holds."""
        fa = self.lookup_order[0]
        if not (self.has_states and len(self.groups) > 1 and self._full_attention(fa)):
            return (*self.get_computed_blocks(request), False)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            request.shared_prefix_boundary = 0
            return (), 0, False
        hits: list[list[Block]] = [[] for _ in self.groups]
        lengths = [0] * len(self.groups)
        for gids in self.lookup_order:
            found, length = self.groups[gids[0]].find_hit(request.block_hashes,
                                                          request.num_tokens - 1, gids)
            for g, blocks in zip(gids, found):
                hits[g], lengths[g] = blocks, length
        local = lengths[fa[0]]
        if max(lengths) > local:
            return (*self.get_computed_blocks(request), False)
        request.shared_prefix_boundary = 0
        return (tuple(hits) if any(hits) else ()), local, min(lengths) < local

    def _full_attention(self, gids: list[int]) -> bool:
        return type(self.groups[gids[0]]) is FullAttentionGroup

    def new_step_starts(self) -> None:
        """A step starts (KC:470-473)."""
        for g in self.groups:
            g.new_step_starts()

    def get_block_ids(self, req_id: str) -> list[int]:
        """Group 0's table."""
        return [b.block_id for b in self.groups[0].tables.get(req_id, ())]

    def more_ids(self, req_id: str) -> list[list[int]] | None:
        """The other groups' tables, or None when they are all empty."""
        out = [[b.block_id for b in g.tables.get(req_id, ())] for g in self.groups[1:]]
        return out if any(out) else None

    def split_ids(self, blocks: tuple[list[Block], ...]) -> tuple[list[int], list[list[int]] | None]:
        """Newly allocated blocks (``allocate_slots``'s answer) as ids: group 0's, the others'."""
        ids = [[b.block_id for b in g] for g in blocks]
        return ids[0], (ids[1:] if any(ids[1:]) else None)

    @property
    def req_to_ids(self) -> dict[str, list[int]]:
        return {req_id: [b.block_id for b in t] for req_id, t in self.groups[0].tables.items()}

    def estimate_cached_tokens(self, req_id: str) -> int:
        """The hash-covered prefix every group holds (KM:751-780)."""
        return min(max((b.hash_num_tokens for b in g.tables.get(req_id, ())), default=0)
                   for g in self.groups)

    # -- allocation ------------------------------------------------------------

    def _blocks_needed(self, req_id: str, num_tokens: int, hits: Sequence[list[Block]],
                       num_computed: int, admission: bool = False, main: int = 0,
                       prefill_end: int = 0) -> int:
        return sum(g.blocks_needed(req_id, num_tokens, hits[g.gid] if hits else [],
                                   num_computed, admission, main, prefill_end)
                   for g in self.groups)

    def _prefill_end(self, request: Request) -> int:
        """Where the request's prefill ends, as the scheduler splits chunks
        (KM:518-520); state groups read it only when the retention interval
        is 0 (KC:233-234)."""
        if self.retention != 0:
            return 0
        return max(request.num_prompt_tokens, request.num_tokens - 1)

    def remaining_blocks(self, request: Request) -> int:
        """Blocks the request still needs to hold its whole sequence (S:3060-3076)."""
        full = min(request.num_tokens, self.max_model_len)
        num_tokens = full
        if self.num_spec_tokens:
            num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens
        return self._blocks_needed(request.request_id, num_tokens, (),
                                   request.num_computed_tokens, True, full,
                                   self._prefill_end(request))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hits: Sequence[list[Block]] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        full_sequence_must_fit: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[Block], ...] | None:
        """``KVCacheManager.allocate_slots`` in every group (KM:371-618). Blocks
        before a sliding window, and states before the last, are given back
        first, on the tokens whose output is in, even when the new blocks then
        do not fit. State groups count the main model's tokens, lookahead slots
        left out."""
        req_id = request.request_id
        num_local = request.num_computed_tokens + num_new_computed_tokens
        num_external = num_external_computed_tokens
        total = min(num_local + num_external, self.max_model_len)
        watermark = self._watermark(request, has_scheduled_reqs)
        prefill_end = self._prefill_end(request)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = self._blocks_needed(req_id, full, hits, total, True, full, prefill_end)
            if needed + watermark > self.pool.num_free_blocks:
                return None
        main = total + num_new_tokens
        need_slots = min(main + num_lookahead_tokens, self.max_model_len)
        for g in self.groups:
            g.remove_skipped(req_id, max(0, total - request.num_in_flight_tokens))
        needed = self._blocks_needed(req_id, need_slots, hits, num_local + num_external, False,
                                     main, prefill_end)
        if needed + watermark > self.pool.num_free_blocks - reserved_blocks:
            return None
        if hits or num_external > 0:
            self._admit_prefix(req_id, hits, num_local, num_external)
        new = tuple(g.allocate(req_id, need_slots, main) for g in self.groups)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return new

    def _admit_prefix(self, req_id: str, hits: Sequence[list[Block]], num_local: int,
                      num_external: int) -> None:
        """Every group adopts its hits before any takes blocks for the external
        tokens, so no pop evicts another group's hit (KC:245-292). A request
        the groups track already adopts and loads nothing."""
        if any(req_id in g.num_cached for g in self.groups):
            assert not hits
            return
        for g in self.groups:
            g.adopt_hits(req_id, hits[g.gid] if hits else [], num_local + num_external)
        if num_external > 0:
            for g in self.groups:
                g.adopt_external(req_id, num_local, num_external)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make full blocks hash-visible in every group (KC:340-378); a
        sliding-window or state group keeps what a hit ending at the prompt's
        replay boundary (its last token but one) and at the request's
        shared-prefix boundary needs. Several groups are told the tokens up to
        a block boundary (KC:767-794), one group all of them (KC:346-352),
        which a state group's boundary state reads (state_groups.py)."""
        if not self.enable_caching:
            return
        if len(self.groups) > 1:
            num_tokens = num_tokens // self.block_size * self.block_size
        boundaries: tuple[int, ...] = (request.num_prompt_tokens - 1,)
        if request.shared_prefix_boundary:
            boundaries += (request.shared_prefix_boundary,)
        for g in self.groups:
            g.cache(request, num_tokens, boundaries)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Give back what is before each window, on the tokens whose output is
        in: before a finished request's table goes to the connector (S:3023-3031)."""
        done = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        for g in self.groups:
            g.remove_skipped(request.request_id, done)

    def free(self, request: Request) -> None:
        """Release every group's table, group by group, each tail first."""
        for g in self.groups:
            self.pool.free_blocks(reversed(g.pop(request.request_id)))

    def pop_blocks(self, request: Request) -> list:
        """Forget the tables without freeing them; ``free_blocks`` later (KC:408-426)."""
        out: list[Block] = []
        for g in self.groups:
            out.extend(g.pop(request.request_id))
        return out

