"""``--fault NAME``: the five bug classes of bug-classes.md, and seven of
hybrid KV caches (a hit one group cannot serve, a window's block given back
while read, a state group's lagging state taken as restored, full
attention's blocks kept past a state hit, a preempted request's states freed
while a step writes them, prefill chunks off the block grid, a state's key
kept after its block is handed out again), put back into the embedded
engine. Each is a scheduler subclass overriding one or two of the
reference's rule methods, or (no-reload-after-preempt) a store behaviour.
The reference itself stays correct, which is what lets replay find them.

Every fault notes in the engine's FaultLog each place where it really changed
what the engine did, so tests can check a replay's findings independently.
"""

from __future__ import annotations

from kvtrace.catalog import EMBEDDED_FAULT_WORKLOADS
from kvtrace.reference import Request
from kvtrace.reference.block_pool import Block, BlockPool
from kvtrace.reference.attention_groups import SlidingWindowGroup
from kvtrace.reference.state_groups import StateGroup, StateSplit

from .scheduler import EngineScheduler


def _from_one_lookup(r: Request, num_cached: int, num_external: int) -> bool:
    """Could one lookup have produced this legacy pair? (An async full hit gives
    one token back, so its cached count is one less than the hit.)"""
    for _, local, ext, load_async in r.lookup_history:
        hit = local + ext
        if ext == num_external and (num_cached == hit or (load_async and num_cached == hit - 1)):
            return True
    return False


class StaleCachedOnPreempt(EngineScheduler):
    """vLLM PR #36752: the legacy num_cached_tokens is set once (first admission)
    but num_external_computed_tokens is re-assigned at every lookup, the resume
    after a preemption included, so the emitted pair can come from two lookups.
    The log names the emitted pairs that no single lookup produced."""

    def _record_lookup(self, r: Request, num_local: int, num_external: int, load_async: bool) -> None:
        super()._record_lookup(r, num_local, num_external, load_async)
        r.legacy_num_external_computed_tokens = num_external

    def _on_counters_emitted(self, r: Request, num_cached: int, num_external: int) -> None:
        if r.num_preemptions > 0 and not _from_one_lookup(r, num_cached, num_external):
            self.fault_log.note(r.request_id, f"emitted legacy pair ({num_cached}, {num_external}): "
                                              f"the external count of a lookup after preemption")


class NegativeExternalOnInvalidBlocks(EngineScheduler):
    """vLLM issue #36533: a block load failure subtracts every affected token,
    locally computed ones included, from num_external_computed_tokens. The log
    names the emitted counts that went negative."""

    def _truncate_for_invalid_block(self, r: Request, block_index: int, pre: int) -> None:
        super()._truncate_for_invalid_block(r, block_index, pre)
        if r.prefill_stats is not None:   # not sent yet
            r.legacy_num_external_computed_tokens -= pre - block_index * self.block_size

    def _on_counters_emitted(self, r: Request, num_cached: int, num_external: int) -> None:
        if num_external < 0:
            self.fault_log.note(r.request_id, f"emitted legacy num_external_computed_tokens "
                                              f"{num_external} after a block load failure")


class StaleComputedAfterFailedSchedule(EngineScheduler):
    """vLLM PR #18957: the local hit of a request whose admission failed is
    memoised and reused at the next attempt, though eviction changed the cache.
    The log names the admissions that used a stale memo."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memo: dict[str, tuple[list, int]] = {}
        self._stale: dict[str, str] = {}   # req -> how its last lookup differed

    def _local_prefix_hit(self, r: Request):
        fresh = super()._local_prefix_hit(r)
        memo = self._memo.setdefault(r.request_id, fresh)
        memo_ids = [b.block_id for b in memo[0]]
        fresh_ids = [b.block_id for b in fresh[0]]
        if memo_ids != fresh_ids or memo[1] != fresh[1]:
            self._stale[r.request_id] = (f"admitted with a memoised hit of {memo[1]} tokens "
                                         f"{memo_ids}; a fresh lookup gives {fresh[1]} {fresh_ids}")
        else:
            self._stale.pop(r.request_id, None)
        return memo

    def _on_admitted(self, r: Request) -> None:
        self._memo.pop(r.request_id, None)
        note = self._stale.pop(r.request_id, None)
        if note is not None:
            self.fault_log.note(r.request_id, note)
        super()._on_admitted(r)


class AsyncLoadOvershoot(EngineScheduler):
    """vLLM PR #34616: after an async load, num_computed_tokens is derived from
    the number of allocated blocks, overshooting a load that ends mid-block."""

    def _finish_remote_kv_load(self, r: Request) -> None:
        failed = r.request_id in self.failed_recving_ids
        super()._finish_remote_kv_load(r)
        if failed:
            return
        n = min(len(self.kv.get_block_ids(r.request_id)) * self.block_size, r.num_tokens)
        if n == r.num_tokens:
            n -= 1
        if n != r.num_computed_tokens:
            self.fault_log.note(r.request_id, f"num_computed_tokens {r.num_computed_tokens} -> {n} "
                                              f"after the async load")
            r.num_computed_tokens = n


class HybridHitNotServed(EngineScheduler):
    """With several KV-cache groups, a prefix hit is the full-attention group's
    own, though another group cannot serve it: that group's table gets the
    null block where it has no cached block."""

    def _local_prefix_hit(self, r: Request):
        hits, n = super()._local_prefix_hit(r)
        kv = self.kv
        groups = getattr(kv, "groups", ())
        full = [g for g in groups if g.skipped_tokens(1 << 62) == 0]
        if not full or not kv.enable_caching or r.skip_reading_prefix_cache:
            return hits, n
        (own,), length = full[0].find_hit(r.block_hashes, r.num_tokens - 1, [full[0].gid])
        if length <= n:
            return hits, n
        num_blocks = length // self.block_size
        out = []
        for g in groups:
            (found,), _ = g.find_hit(r.block_hashes, length, [g.gid])
            found = found[:num_blocks]
            out.append(found + [kv.pool.null_block] * (num_blocks - len(found)))
        self.fault_log.note(r.request_id, f"admitted with the full-attention group's hit of "
                                          f"{length} tokens; every group serves {n}")
        r.shared_prefix_boundary = 0
        return tuple(out), length


class StateHitNotRestored(EngineScheduler):
    """LMCache #4247's shape (vLLM 0.26): with a connector, a lookup takes
    full attention's own hit as the local hit though a state group keeps no
    state that far, and the connector restores none: where the connector
    finds nothing more, the request resumes from a state never written."""

    def _local_prefix_hit(self, r: Request):
        hits, n = super()._local_prefix_hit(r)
        if self.connector is None or not getattr(self.kv, "has_states", False):
            return hits, n
        own, local, lags = self.kv.get_computed_blocks_for_connector(r)
        if not lags or local <= n:
            return hits, n
        self.fault_log.note(r.request_id, f"took full attention's hit of {local} tokens; every "
                                          f"group holds {n}")
        return own, local


class WindowFreedEarly(EngineScheduler):
    """A sliding-window group gives back one block more than the window
    allows: the last block before the next token's window, still read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        groups = getattr(self.kv, "groups", [])
        for i, g in enumerate(groups):
            if isinstance(g, SlidingWindowGroup):   # made again, as the manager made it
                groups[i] = _FreesEarly(g.gid, self.config.kv_groups[g.gid], g.pool,
                                        g.block_size, g.retention)
                groups[i].note = self.fault_log.note


class _FreesEarly(SlidingWindowGroup):
    """A sliding-window group that gives back one block more than its window allows."""

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1 + self.block_size)

    def _window_start(self, num_computed: int) -> int:
        """The first block of the window of token ``num_computed``, by the rule."""
        return super().skipped_tokens(num_computed) // self.block_size

    def remove_skipped(self, req_id: str, num_computed: int) -> None:
        table = self.tables.get(req_id) or []
        first, null = self._window_start(num_computed), self.pool.null_block
        held = table[first] if first < len(table) else None
        super().remove_skipped(req_id, num_computed)
        if held is not None and held is not null and table[first] is null:
            self.note(req_id, f"gave back block {held.block_id} of group {self.gid}, "
                              f"inside the window of token {num_computed}")

    def adopt_hits(self, req_id, hits, num_computed) -> None:
        super().adopt_hits(req_id, hits, num_computed)
        first, null = self._window_start(num_computed), self.pool.null_block
        table = self.tables[req_id]
        if first < len(hits) and hits[first] is not null and table[first] is null:
            self.note(req_id, f"dropped hit block {hits[first].block_id} of group "
                              f"{self.gid}, inside the window of token {num_computed}")


def _state_groups(kv) -> list:
    return [g for g in getattr(kv, "groups", ()) if isinstance(g, StateGroup)]


class StateHitAttentionKept(EngineScheduler):
    """A hit cut back to the last state every state group holds keeps full
    attention's own blocks past it: the coordinator's fixed point forgets to
    truncate full attention's hit to the length all groups agree on
    (KC:796-931). The request computes on from the state's length, writing
    tokens into cached blocks that other requests share."""

    def _local_prefix_hit(self, r: Request):
        hits, n = super()._local_prefix_hit(r)
        kv = self.kv
        if not _state_groups(kv) or not kv.enable_caching or r.skip_reading_prefix_cache:
            return hits, n
        out = [list(h) for h in hits] if hits else [[] for _ in kv.groups]
        kept = 0
        for g in kv.groups:
            if g.skipped_tokens(1 << 62) != 0:   # full attention only
                continue
            (own,), length = g.find_hit(r.block_hashes, r.num_tokens - 1, [g.gid])
            if length > n:
                out[g.gid] = own
                kept = max(kept, length)
        if not kept:
            return hits, n
        self.fault_log.note(r.request_id, f"kept full attention's hit of {kept} tokens past "
                                          f"the {n} every group holds")
        return tuple(out), n


class StateFreedInFlight(EngineScheduler):
    """A preempted request's state blocks go back to the pool at once, though
    a step still in flight writes its state into them: only its attention
    blocks wait for that step, as a connector that loads KV needs
    (S:2759-2801). Another request may be handed those blocks, and a load
    fill them, while the step writes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._preempting: Request | None = None

    def _preempt_request(self, r: Request, drop_stale_output: bool = False,
                         listed: bool = True) -> None:
        self._preempting = r
        try:
            super()._preempt_request(r, drop_stale_output, listed)
        finally:
            self._preempting = None

    def _free_request_blocks(self, r: Request) -> None:
        if r is self._preempting and not self._blocks_can_be_freed(r):
            pool, freed = self.kv.pool, []
            for g in _state_groups(self.kv):
                table = g.pop(r.request_id)
                freed += [b.block_id for b in table if b is not pool.null_block]
                pool.free_blocks(reversed(table))
            if freed:
                self.fault_log.note(r.request_id, f"freed state blocks {freed} while a step in "
                                                  f"flight still writes them")
        super()._free_request_blocks(r)


class StateChunkOffBoundary(EngineScheduler):
    """Prefill chunks are not split at block boundaries (S:443-556): the
    scheduler does not see that its state groups keep states aligned. A
    chunk cut by the budget ends off the block grid, and one runs past the
    prompt's last boundary, so the state a slot is keyed for (after (p + 1) *
    block_size tokens) is another position's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        split, note = self.state_split, self.fault_log.note
        if split is None:
            return

        class Unsplit(StateSplit):
            """The scheduler's chunk split, never applied."""

            def chunk(self, r: Request, start: int, n: int) -> int:
                aligned = super().chunk(r, start, n)
                if aligned != n:
                    note(r.request_id, f"scheduled tokens [{start}, {start + n}); the block "
                                       f"grid ends the chunk at {start + aligned}")
                return n

        self.state_split = Unsplit(split.block_size, split.max_prefill_tokens, split.checkpoints,
                                   split.checkpoint_alignment)


class _KeepsStateKeys(BlockPool):
    """A pool that drops a state block's hash, not the cache's entry for it."""

    states: set[int] = set()   # the state groups

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None and b.hash_group in self.states:
            b.block_hash, b.hash_num_tokens = None, 0   # the cache's entry stays
            return
        super()._evict(b)


class StateKeyOutlivesEviction(EngineScheduler):
    """A state block handed out again keeps its key in the prefix cache: the
    pool drops the block's hash but not the cache's entry for a state group
    (BP:729-750). A later lookup of that prefix is served the block, which
    holds another request's state by then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._served: dict[str, str] = {}   # req -> the stale state its last lookup served
        states = {g.gid for g in _state_groups(self.kv)}
        if not states or not self.kv.enable_caching:
            return
        cfg = self.config
        pool = _KeepsStateKeys(cfg.num_blocks, cfg.enable_prefix_caching,
                               cfg.profile.free_uncached_to_head)
        pool.states = states
        self.use_pool(pool)

    def _local_prefix_hit(self, r: Request):
        hits, n = super()._local_prefix_hit(r)
        self._served.pop(r.request_id, None)
        for g in _state_groups(self.kv):
            found = hits[g.gid] if hits else []
            if found and found[-1].block_hash != r.block_hashes[len(found) - 1]:
                self._served[r.request_id] = (f"served block {found[-1].block_id} of group "
                                              f"{g.gid} as the state after {n} tokens; it "
                                              f"holds another prefix's")
                break
        return hits, n

    def _on_admitted(self, r: Request) -> None:
        note = self._served.pop(r.request_id, None)
        if note is not None:
            self.fault_log.note(r.request_id, note)
        super()._on_admitted(r)


# Fault name -> scheduler class. no-reload-after-preempt lives in the store.
SCHEDULERS: dict[str | None, type[EngineScheduler]] = {
    None: EngineScheduler,
    "stale-cached-on-preempt": StaleCachedOnPreempt,
    "negative-external-on-invalid-blocks": NegativeExternalOnInvalidBlocks,
    "stale-computed-after-failed-schedule": StaleComputedAfterFailedSchedule,
    "no-reload-after-preempt": EngineScheduler,
    "async-load-overshoot": AsyncLoadOvershoot,
    "hybrid-hit-not-served": HybridHitNotServed,
    "window-freed-early": WindowFreedEarly,
    "state-hit-not-restored": StateHitNotRestored,
    "state-hit-attention-kept": StateHitAttentionKept,
    "state-freed-in-flight": StateFreedInFlight,
    "state-chunk-off-boundary": StateChunkOffBoundary,
    "state-key-outlives-eviction": StateKeyOutlivesEviction,
}
STORE_FAULTS = {"no-reload-after-preempt"}
FAULTS = tuple(name for name in SCHEDULERS if name is not None)

# The built-in workload on which each fault shows (one table, in kvtrace.catalog).
FAULT_WORKLOADS: dict[str, str] = EMBEDDED_FAULT_WORKLOADS


def scheduler_class(fault: str | None) -> type[EngineScheduler]:
    try:
        return SCHEDULERS[fault]
    except KeyError:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}") from None
