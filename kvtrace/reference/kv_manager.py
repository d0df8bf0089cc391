"""The KV-cache manager for one full-attention group (semantics doc 4.6, 4.7).

It owns each request's block table and how many of its leading blocks are
hash-visible (``num_cached_block``), and turns "this request needs n more
tokens" into block-pool operations.
"""

from __future__ import annotations

from typing import Any, Sequence

from mypy_extensions import mypyc_attr

from .block_pool import Block, BlockPool
from .config import SchedulerConfig
from .request import Request, Status

# A request's blocks as the scheduler passes them from one call of its KV-cache
# manager to another (a hit, an allocation's new blocks): a list with one
# KV-cache group (this module), a tuple of a list per group with several
# (kv_groups.py). The scheduler holds either manager and never looks inside.
Blocks = Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class PoolOperations:
    """What the manager of one group and that of several (kv_groups.py)
    share: the watermark, and the pool's own operations."""

    pool: BlockPool
    watermark_blocks: int

    def _watermark(self, request: Request, has_scheduled_reqs: bool) -> int:
        """Headroom kept free when admitting waiting or preempted requests (KM:509-516)."""
        if self.watermark_blocks and has_scheduled_reqs and request.status in (Status.WAITING,
                                                                               Status.PREEMPTED):
            return self.watermark_blocks
        return 0

    def free_blocks(self, table: list[Block]) -> None:
        """Release a table, tail first, so a chain's tail is evicted before its head."""
        self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.pool.evict_blocks(block_ids)


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class KVCacheManager(PoolOperations):
    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.watermark_blocks = config.watermark_blocks
        self.num_spec_tokens = config.num_spec_tokens
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.eagle_block_drop = config.eagle_block_drop
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching,
                              config.profile.free_uncached_to_head)
        self.spec_step_block_sizes = (self.block_size,)   # a speculative step's blocks (S:347-357)
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.req_to_ids: dict[str, list[int]] = {}        # the same tables, as block ids
        self.num_cached_block: dict[str, int] = {}

    # -- lookups ---------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached blocks at the head of the request's hash chain,
        capped so that at least one token is left to compute (KM:264-321). With
        EAGLE the last block of a hit is dropped: the drafter needs the hidden
        states of the tokens before the first one computed (ST:816-828)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        hits = []
        for h in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        if self.eagle_block_drop and hits:
            hits.pop()
        return hits, len(hits) * self.block_size

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self.req_to_ids.get(req_id, ()))

    def more_ids(self, req_id: str) -> None:
        """Other groups' tables: there are none (kv_groups.py has several)."""
        return None

    def remove_skipped_blocks(self, request: Request) -> None:
        """Full attention gives nothing back before a request finishes."""

    def new_step_starts(self) -> None:
        """Nothing to forget when a step starts (state groups have, kv_groups.py)."""

    def _extend(self, req_id: str, table: list[Block], blocks: Sequence[Block]) -> None:
        table.extend(blocks)
        self.req_to_ids.setdefault(req_id, []).extend(b.block_id for b in blocks)

    def estimate_cached_tokens(self, req_id: str) -> int:
        """Largest hash-covered prefix among the request's blocks (KM:751-780)."""
        return max((b.hash_num_tokens for b in self.req_to_blocks.get(req_id, ())), default=0)

    # -- allocation ------------------------------------------------------------

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, hits: Sequence[Block]) -> int:
        """New blocks needed for ``num_tokens`` slots, counting hits on free
        blocks, which leave the free queue too (ST:175-265)."""
        required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(req_id, ()))
        if req_id in self.num_cached_block:
            return max(required - held, 0)
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return max(required - (len(hits) + held), 0) + free_hits

    def remaining_blocks(self, request: Request) -> int:
        """Blocks the request still needs to hold its whole sequence, and with
        speculative decoding one decode step with every draft and the drafter's
        lookahead slots past it (S:3060-3076)."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        if self.num_spec_tokens:
            num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens
        return self.num_blocks_to_allocate(request.request_id, num_tokens, [])

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hits: Sequence[Block] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        full_sequence_must_fit: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> list[Block] | None:
        """Give the request slots for ``num_new_tokens`` more tokens, and
        ``num_lookahead_tokens`` past them for the drafter (never cached). Returns
        the newly allocated blocks, or None (and changes nothing) when they do not
        fit. With ``full_sequence_must_fit``, the whole sequence must fit, not just
        this chunk (KM:522-539).

        Table layout after the first admission: [hits][external][new][lookahead].
        """
        req_id = request.request_id
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = self.num_blocks_to_allocate(req_id, full, hits)
            if needed + self._watermark(request, has_scheduled_reqs) > self.pool.num_free_blocks:
                return None
        table = self.req_to_blocks.get(req_id)
        if table is not None and not hits and not num_external_computed_tokens:
            # A request that already holds blocks: top up its table (ST:229-235).
            return self._top_up(request, table, num_new_tokens, delay_cache_blocks, reserved_blocks,
                                has_scheduled_reqs, num_lookahead_tokens)
        local = request.num_computed_tokens + num_new_computed_tokens
        total = min(local + num_external_computed_tokens, self.max_model_len)
        need_slots = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)

        needed = self.num_blocks_to_allocate(req_id, need_slots, hits)
        watermark = self._watermark(request, has_scheduled_reqs)
        if needed + watermark > self.pool.num_free_blocks - reserved_blocks:
            return None

        table = self.req_to_blocks.setdefault(req_id, [])
        self._admit_prefix(req_id, table, hits, local, num_external_computed_tokens)
        new_blocks = self.pool.get_new_blocks(max(0, cdiv(need_slots, self.block_size) - len(table)))
        self._extend(req_id, table, new_blocks)

        if not delay_cache_blocks:
            self.cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return new_blocks

    def _admit_prefix(self, req_id: str, table: list[Block], hits: Sequence[Block], local: int,
                      num_external: int) -> None:
        """First admission: adopt the hits, then give the external tokens blocks.
        All touches happen before any pop, so a pop cannot evict a hit. A request
        the manager tracks already, looked up again (a one-token prompt whose full
        async hit left it at num_computed_tokens 0, S:3171-3172), adopts and loads
        nothing (KC:283-289): its table only grows to cover the slots asked for."""
        if req_id in self.num_cached_block and num_external > 0:
            assert not hits
            return
        if not (hits or num_external > 0):
            return
        assert not table
        self.pool.touch(hits)
        self._extend(req_id, table, hits)
        self.num_cached_block[req_id] = len(table)
        if num_external > 0:
            n_ext = cdiv(local + num_external, self.block_size) - len(table)
            self._extend(req_id, table, self.pool.get_new_blocks(max(0, n_ext)))

    def _top_up(self, request: Request, table: list[Block], num_new_tokens: int,
                delay_cache_blocks: bool, reserved_blocks: int, has_scheduled_reqs: bool,
                num_lookahead_tokens: int) -> list[Block] | None:
        """allocate_slots for a request that holds a table and adopts nothing: the
        arithmetic of allocate_slots with no hits and no external tokens, kept
        apart because it is by far the most common call (every running request,
        every step)."""
        total = min(request.num_computed_tokens, self.max_model_len)
        need_slots = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        needed = max(cdiv(need_slots, self.block_size) - len(table), 0)
        watermark = self._watermark(request, has_scheduled_reqs)
        if needed + watermark > self.pool.num_free_blocks - reserved_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(needed) if needed else []
        if new_blocks:
            self._extend(request.request_id, table, new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make every full block among the first ``num_tokens`` tokens hash-visible."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self.num_cached_block.get(req_id, 0)
        # Only blocks whose hash exists (they lag with lookahead hashes, ST:502-503).
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(request.block_hashes, self.req_to_blocks[req_id],
                                    num_cached, num_full, self.block_size)
        self.num_cached_block[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the table now."""
        self.free_blocks(self.pop_blocks(request))

    def pop_blocks(self, request: Request) -> list[Block]:
        """Forget the request's table without freeing it; ``free_blocks`` later."""
        self.req_to_ids.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])
