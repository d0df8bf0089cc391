"""The tables of one attention group, as vLLM's single-type managers keep them
(ST: single_type_kv_cache_manager.py):

* full attention: the table only grows; a hit is the longest run of cached
  blocks from the start;
* sliding window (``w`` tokens): a block wholly before the window of the next
  token is given back and replaced by the null block 0; a hit is the rightmost
  run of ``cdiv(w - 1, block_size)`` cached blocks, with null blocks before it;
  and only the blocks a later hit can use are made hash-visible.

A state group builds on the full-attention one (state_groups.py); the
manager that asks every group in turn is kv_groups.py.
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .block_pool import Block, BlockPool
from .config import GroupSpec
from .kv_manager import cdiv
from .request import Request


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class FullAttentionGroup:
    """One group's tables (ST:48-729, FullAttentionManager ST:729-830)."""

    # The scheduler reserves a speculative step's blocks in this group (S:347-357).
    spec_step_blocks = True

    def __init__(self, gid: int, spec: GroupSpec, pool: BlockPool, block_size: int):
        self.gid = gid
        self.pool = pool
        self.block_size = block_size
        self.admission_blocks = spec.admission_blocks
        self.tables: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}     # leading blocks hash-visible (running requests)

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens no later token attends to: none under full attention."""
        return 0

    def find_hit(self, hashes: list[bytes], max_length: int, gids: list[int]
                 ) -> tuple[list[list[Block]], int]:
        """The longest run of cached blocks from the start, in each of ``gids``."""
        runs: list[list[Block]] = [[] for _ in gids]
        for h in hashes[: max_length // self.block_size]:
            found = self.pool.get_cached_blocks(h, gids)
            if found is None:
                break
            for run, b in zip(runs, found):
                run.append(b)
        return runs, len(runs[0]) * self.block_size

    def cache_mask(self, start: int, end: int, boundaries: tuple[int, ...]) -> list[bool] | None:
        """Which of blocks [start, end) become hash-visible: every one."""
        return None

    # -- allocation --------------------------------------------------------------

    def blocks_needed(self, req_id: str, num_tokens: int, hits: list[Block],
                      num_computed: int, admission: bool, main: int = 0,
                      prefill_end: int = 0) -> int:
        """New blocks for ``num_tokens`` slots (ST:175-265): those not held or
        hit, less those before the window, plus hits on free blocks. (A state
        group also reads the main model's tokens and the prefill's end.)"""
        required = cdiv(num_tokens, self.block_size)
        if admission and self.admission_blocks is not None:
            required = min(required, self.admission_blocks)
        held = len(self.tables.get(req_id, ()))
        if req_id in self.num_cached:
            return max(required - held, 0)
        skipped = self.skipped_tokens(num_computed) // self.block_size
        new = max(required - max(skipped, len(hits) + held), 0)
        kept = hits[max(0, skipped - held):]
        return new + sum(1 for b in kept if b.ref_cnt == 0 and b is not self.pool.null_block)

    def adopt_hits(self, req_id: str, hits: list[Block], num_computed: int) -> None:
        """First admission: the hits, with null blocks for those before the
        window (ST:267-322)."""
        table = self.tables.setdefault(req_id, [])
        assert not table
        skipped = self.skipped_tokens(num_computed) // self.block_size
        kept = hits[skipped:]
        self.pool.touch(kept)
        table.extend([self.pool.null_block] * skipped)
        table.extend(kept)
        self.num_cached[req_id] = len(table)

    def adopt_external(self, req_id: str, num_local: int, num_external: int) -> None:
        """Blocks for the connector's tokens that are inside the window (ST:326-367)."""
        total = num_local + num_external
        skipped = self.skipped_tokens(total)
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return
        table = self.tables.setdefault(req_id, [])
        table.extend(self.pool.get_new_blocks(max(0, cdiv(total, self.block_size) - len(table))))

    def allocate(self, req_id: str, num_tokens: int, main: int = 0) -> list[Block]:
        """New blocks up to ``num_tokens`` slots (ST:369-410)."""
        table = self.tables.setdefault(req_id, [])
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return new

    def remove_skipped(self, req_id: str, num_processed: int) -> None:
        """Give back the blocks wholly before the window, last first, stopping at
        one already given back (ST:645-710)."""
        skipped = self.skipped_tokens(num_processed)
        table = self.tables.get(req_id)
        if skipped <= 0 or not table:
            return
        null = self.pool.null_block
        freed = []
        for i in range(min(skipped // self.block_size, len(table)) - 1, -1, -1):
            if table[i] is null:
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)

    def cache(self, request: Request, num_tokens: int, boundaries: tuple[int, ...]) -> None:
        """Make the table's full blocks among the first ``num_tokens`` tokens
        hash-visible (ST:476-534), those whose hash exists (they lag with
        lookahead hashes, ST:502-503)."""
        req_id = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached.get(req_id, 0)
        if num_cached >= num_full:
            return
        mask = self.cache_mask(num_cached, num_full, boundaries)
        self.pool.cache_full_blocks(request.block_hashes, self.tables[req_id], num_cached,
                                    num_full, self.block_size, self.gid, mask)
        self.num_cached[req_id] = num_full

    def pop(self, req_id: str) -> list[Block]:
        self.num_cached.pop(req_id, None)
        return self.tables.pop(req_id, [])

    def new_step_starts(self) -> None:
        """Nothing to forget when a step starts (a state group has, ST:2008)."""


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class SlidingWindowGroup(FullAttentionGroup):
    """A sliding-window group (SlidingWindowManager, ST:933-1170)."""

    def __init__(self, gid: int, spec: GroupSpec, pool: BlockPool, block_size: int,
                 retention: int | None):
        super().__init__(gid, spec, pool, block_size)
        assert spec.sliding_window is not None
        self.window = spec.sliding_window
        self.retention = retention
        # Cached blocks a hit needs in a row: those the next token's window reads.
        self.hit_blocks = cdiv(self.window - 1, block_size)

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens before the window of token ``num_computed`` (ST:1135-1170)."""
        return max(0, num_computed - self.window + 1)

    def find_hit(self, hashes: list[bytes], max_length: int, gids: list[int]
                 ) -> tuple[list[list[Block]], int]:
        """The rightmost run of ``hit_blocks`` cached blocks ending by
        ``max_length``, null blocks before it; failing that, a shorter run at
        the start (ST:956-1050)."""
        n = max_length // self.block_size
        out = [[self.pool.null_block] * n for _ in gids]
        run = 0
        for i in range(n - 1, -1, -1):
            found = self.pool.get_cached_blocks(hashes[i], gids)
            if found is None:
                run = 0
                continue
            for o, b in zip(out, found):
                o[i] = b
            run += 1
            if run >= self.hit_blocks:
                for o in out:
                    del o[i + run:]
                return out, (i + run) * self.block_size
        for o in out:
            del o[run:]
        return out, run * self.block_size

    def cache_mask(self, start: int, end: int, boundaries: tuple[int, ...]) -> list[bool] | None:
        """Only blocks a later hit can use become hash-visible: the window's
        blocks ending at each multiple of the retention interval, and at each of
        ``boundaries`` (ST:1054-1133). With dense retention (None), a window
        ends on every block."""
        need, bs = self.hit_blocks, self.block_size
        segment = bs if self.retention is None else (self.retention or None)
        mask = [False] * (end - start)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            for i in range(start, end):
                if i % per_segment >= per_segment - need:
                    mask[i - start] = True
        if self.retention is not None:
            for boundary in boundaries:
                last = boundary // bs
                for j in range(max(start, last - need), min(end, last)):
                    mask[j - start] = True
        return mask
