"""Faults of state groups (Mamba, gated delta nets) that leave every count
right and the KV wrong: the shadow-KV check's state reads must name them.

Each is a scheduler subclass of the embedded engine, run with
``record_workload(..., scheduler_cls=...)``; ``FAULTS`` names them and
``FAULT_WORKLOADS`` gives the built-in workload on which each shows. Each notes
in the engine's FaultLog where it changed what the engine did.

* ``state-hash-kept-on-reuse``: a freed state block, still cached under the
  hash of the state it held, is handed out again and keeps that entry: a
  later hit on the prefix adopts a block another request has written since.
  A preempted request that resumes hits its own former state this way.
* ``state-split-off-grid``: prefill chunks are not ended at block boundaries
  (vLLM's split, S:443-556, turned off), so a chunk's state lands in the slot
  of the boundary it stops short of, and that slot is later keyed as the
  state after the whole block: a hit then serves a state of another length
  (the shape of vllm#51113, in vllm#53912).
"""

from __future__ import annotations

from kvtrace.reference import Request
from kvtrace.reference.block_pool import Block, BlockPool
from kvtrace.reference.state_groups import StateGroup

from .scheduler import EngineScheduler


class _KeepsEntries(BlockPool):
    """A pool that hands out a freed state block without dropping its cache
    entry: the block forgets its hash, the cache does not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.states: set[int] = set()   # the state groups
        # block id -> (the hash its stale entry keeps, the state length it names)
        self.stale: dict[int, tuple[bytes, int]] = {}

    def get_new_blocks(self, n: int) -> list[Block]:
        kept, b = [], self.free_queue.head.next
        for _ in range(min(n, self.num_free_blocks)):   # the blocks the pool pops
            if b.block_hash is not None and b.hash_group in self.states:
                kept.append((b, b.block_hash, b.hash_num_tokens))
            b = b.next
        for b, _, _ in kept:   # the block forgets its hash; the cache keeps the entry
            b.block_hash, b.hash_num_tokens = None, 0
        blocks = super().get_new_blocks(n)
        for b, h, length in kept:
            self.stale[b.block_id] = (h, length)
        return blocks


class StateHashKeptOnReuse(EngineScheduler):
    """The pool hands out a freed state block without dropping its cache
    entry (BP:679 evicts it in vLLM): the block forgets its hash, the cache
    does not, and a lookup still finds the block under it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        pool = _KeepsEntries(cfg.num_blocks, cfg.enable_prefix_caching,
                             cfg.profile.free_uncached_to_head)
        pool.states = {g.gid for g in getattr(self.kv, "groups", ()) if isinstance(g, StateGroup)}
        self.use_pool(pool)
        # block id -> (the hash its stale entry keeps, the state length it names)
        self._stale = pool.stale

    def _local_prefix_hit(self, r: Request):
        hits, n = super()._local_prefix_hit(r)
        for group in hits:
            for b in group:
                stale = self._stale.get(b.block_id)
                if stale is not None and b.block_hash != stale[0]:
                    self.fault_log.note(r.request_id, f"hit block {b.block_id} as the state after "
                                                      f"{stale[1]} tokens, a block handed out "
                                                      f"again since")
        return hits, n


class StateSplitOffGrid(EngineScheduler):
    """Prefill chunks end wherever the budget ends, not on a block boundary."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._split, self.state_split = self.state_split, None

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        if self._split is None:
            return out
        bs = self._split.block_size
        for req_id, n in out.num_scheduled_tokens.items():
            r = self.requests.get(req_id)
            if r is None:
                continue
            end = r.num_computed_tokens   # after the step: where its chunk ends
            if end % bs and end < max(r.num_prompt_tokens, r.num_tokens - 1):
                self.fault_log.note(req_id, f"prefill chunk ends at {end}, inside block "
                                            f"{end // bs}: its state lands in that block's "
                                            f"slot, keyed later as the state after "
                                            f"{(end // bs + 1) * bs} tokens")
        return out


FAULTS: dict[str, type[EngineScheduler]] = {
    "state-hash-kept-on-reuse": StateHashKeptOnReuse,
    "state-split-off-grid": StateSplitOffGrid,
}
FAULT_WORKLOADS: dict[str, str] = {
    "state-hash-kept-on-reuse": "hybrid-three-kinds",
    "state-split-off-grid": "hybrid-state",
}
