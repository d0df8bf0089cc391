"""The block pool: ids, reference counts, the free queue and the prefix-cache map
(semantics doc 4.3 to 4.5).

The free queue's order decides which block id the engine hands out next, so it is
an explicit doubly linked list, as in the engine:

* allocation pops from the head, and evicts the popped block's hash;
* a freed block with no hash goes to the head (reused first), but to the tail
  under the legacy profile;
* a freed block with a hash goes to the tail (evicted last, LRU);
* a prefix hit on a free block takes it out of the middle.
"""

from __future__ import annotations

from typing import Iterable

from mypy_extensions import mypyc_attr

from .interface import SchedulerAssertion


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_num_tokens", "hash_group", "prev",
                 "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.hash_num_tokens = 0          # tokens covered by the chain ending at this block
        self.hash_group = 0               # the KV-cache group whose hash it holds
        self.prev: Block | None = None    # free-queue links
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt})"


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)   # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[Block]:
        out: list[Block] = []
        for _ in range(n):
            b = self.head.next
            assert b is not None and b is not self.tail, "free queue is empty"
            self.remove(b)
            out.append(b)
        return out

    def remove(self, b: Block) -> None:
        prev, next = b.prev, b.next
        assert prev is not None and next is not None, "the block is not in the free queue"
        prev.next, next.prev = next, prev
        b.prev = b.next = None
        self.num_free -= 1

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put ``blocks`` at the head, keeping their order (blocks[0] is popped first)."""
        after = self.head
        for b in blocks:
            self._insert_after(after, b)
            after = b

    def append_n(self, blocks: list[Block]) -> None:
        for b in blocks:
            last = self.tail.prev
            assert last is not None
            self._insert_after(last, b)

    def _insert_after(self, at: Block, b: Block) -> None:
        next = at.next
        assert next is not None
        b.prev, b.next = at, next
        next.prev = b
        at.next = b
        self.num_free += 1

    def ids(self) -> list[int]:
        out: list[int] = []
        b = self.head.next
        while b is not None and b is not self.tail:
            out.append(b.block_id)
            b = b.next
        return out


@mypyc_attr(allow_interpreted_subclasses=True)   # so a keyframe can rebuild it (snapshot.py)
class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, free_uncached_to_head: bool = True):
        self.enable_caching = enable_caching
        self.free_uncached_to_head = free_uncached_to_head
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Block 0 is taken at once as the null block; it is never handed out.
        self.null_block = self.free_queue.popleft_n(1)[0]
        # hash -> {block_id: block}, insertion ordered; a hit takes the first.
        self.cached: dict[bytes, dict[int, Block]] = {}
        # The same for each other KV-cache group: a hash is looked up per group.
        self.more_cached: dict[int, dict[bytes, dict[int, Block]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: bytes, group: int = 0) -> Block | None:
        entry = (self.cached if group == 0 else self._hashes(group)).get(block_hash)
        return next(iter(entry.values())) if entry else None

    def get_cached_blocks(self, block_hash: bytes, groups: list[int]) -> list[Block] | None:
        """The block cached under ``block_hash`` in each of ``groups``; None
        when one of them has none."""
        found = []
        for g in groups:
            b = self.get_cached_block(block_hash, g)
            if b is None:
                return None
            found.append(b)
        return found

    def _hashes(self, group: int) -> dict[bytes, dict[int, Block]]:
        return self.cached if group == 0 else self.more_cached.setdefault(group, {})

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:   # vLLM raises ValueError: the engine fails here
            raise SchedulerAssertion(None, f"BP:679 cannot get {n} free blocks from the pool "
                                           f"({self.num_free_blocks} free)", "ValueError")
        blocks = self.free_queue.popleft_n(n)
        for b in blocks:
            if self.enable_caching:
                self._evict(b)
            assert b.ref_cnt == 0
            b.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """A prefix hit: one more reference, and out of the free queue if it was free."""
        for b in blocks:
            if b.ref_cnt == 0 and b is not self.null_block:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference from each block; ``ordered`` is in eviction order."""
        to_head: list[Block] = []
        to_tail: list[Block] = []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and b is not self.null_block:
                uncached = b.block_hash is None or not self.enable_caching
                # Legacy profile: every freed block goes to the tail.
                (to_head if uncached and self.free_uncached_to_head else to_tail).append(b)
        self.free_queue.prepend_n(to_head)
        self.free_queue.append_n(to_tail)

    def cache_full_blocks(self, block_hashes: list[bytes], blocks: list[Block],
                          num_cached: int, num_full: int, block_size: int, group: int = 0,
                          mask: list[bool] | None = None) -> None:
        """Make blocks[num_cached:num_full] hash-visible for ``group``, those
        ``mask`` (if any) marks True."""
        cached = self.cached if group == 0 else self._hashes(group)
        for i in range(num_cached, num_full):
            b = blocks[i]
            if b is self.null_block or (mask is not None and not mask[i - num_cached]):
                continue
            if b.block_hash is not None:
                self._evict(b)
            b.block_hash = block_hashes[i]
            b.hash_num_tokens = (i + 1) * block_size
            b.hash_group = group
            cached.setdefault(b.block_hash, {})[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, if no block is in use; the free queue keeps its
        order (BP:827-866)."""
        if self.num_free_blocks != len(self.blocks) - 1:   # the null block is always in use
            return False
        self.cached.clear()
        self.more_cached.clear()
        for b in self.blocks:
            b.block_hash, b.hash_num_tokens = None, 0
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop hashes only; reference counts are untouched."""
        for i in block_ids:
            self._evict(self.blocks[i])

    def _evict(self, b: Block) -> None:
        if b.block_hash is None:
            return
        cached = self.cached if b.hash_group == 0 else self._hashes(b.hash_group)
        entry = cached[b.block_hash]
        del entry[b.block_id]
        if not entry:
            del cached[b.block_hash]
        b.block_hash, b.hash_num_tokens = None, 0

    # -- keyframes ---------------------------------------------------------------

    def columns(self) -> dict:
        """The pool as plain data, a few bytes a block: reference counts, the
        free queue's order (as runs of consecutive ids), and each hashed block
        with its hash and the map entries in their order (a hit takes the first)."""
        free = self.free_queue.ids()
        runs: list[list[int]] = []
        for i in free:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        maps = [(0, self.cached), *self.more_cached.items()]
        return {
            "num_blocks": len(self.blocks), "enable_caching": self.enable_caching,
            "free_uncached_to_head": self.free_uncached_to_head,
            "null_block": self.null_block.block_id,
            "ref_cnt": [b.ref_cnt for b in self.blocks],
            "free": runs,
            "hashed": [[b.block_id, b.block_hash.hex(), b.hash_num_tokens, b.hash_group]
                       for b in self.blocks if b.block_hash is not None],
            "maps": [[g, [[h.hex(), list(entry)] for h, entry in m.items()]] for g, m in maps],
        }

    @classmethod
    def from_columns(cls, c: dict) -> "BlockPool":
        """The pool ``columns`` wrote."""
        pool = cls(c["num_blocks"], c["enable_caching"], c["free_uncached_to_head"])
        for b, n in zip(pool.blocks, c["ref_cnt"], strict=True):
            b.ref_cnt = n
        if sum(n for _, n in c["free"]) > len(pool.blocks):
            raise ValueError("the free queue holds more blocks than the pool")
        free = [i for first, n in c["free"] for i in range(first, first + n)]
        if len(set(free)) != len(free) or not all(0 <= i < len(pool.blocks) for i in free):
            raise ValueError("the free queue names a block twice, or one the pool lacks")
        pool.free_queue.popleft_n(pool.free_queue.num_free)   # emptied, then refilled in order
        pool.free_queue.append_n([pool.blocks[i] for i in free])
        pool.null_block = pool.blocks[c["null_block"]]
        for i, h, num_tokens, group in c["hashed"]:
            if not 0 <= i < len(pool.blocks):
                raise ValueError(f"a hashed block {i} the pool lacks")
            b = pool.blocks[i]
            b.block_hash, b.hash_num_tokens, b.hash_group = bytes.fromhex(h), num_tokens, group
        pool.cached, pool.more_cached = {}, {}
        for g, entries in c["maps"]:
            m = {bytes.fromhex(h): {i: pool.blocks[i] for i in ids} for h, ids in entries}
            if g == 0:
                pool.cached = m
            else:
                pool.more_cached[g] = m
        return pool
