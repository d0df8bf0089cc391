"""KV transfer through a connector: the external hit of a lookup, async loads
and their completion, load failures (whole loads and single blocks), finished
transfers, and the deferred frees of a connector that loads KV under async
scheduling (semantics doc 3, 7; S:2759-2801, S:3123-3356)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .async_output import AsyncOutput
from .interface import ModelOutput, SchedulerAssertion, in_order
from .request import Request, Status


@mypyc_attr(allow_interpreted_subclasses=True)
class KVTransfer(AsyncOutput):
    """A part of the Scheduler (feature.py): its config, connector, KV manager and queues are ``self``'s."""

    # ---------------------------------------------------------------- lookups and loads

    def _external_hit(self, r: Request, num_local: int) -> tuple[int | None, bool]:
        """The connector's hit beyond the local one, and whether it loads
        asynchronously; None when it cannot tell yet (the request is asked again)."""
        if self.connector is None:
            return 0, False
        ext, load_async = self.connector.get_num_new_matched_tokens(r, num_local)
        if r.skip_reading_prefix_cache and self.config.profile.skip_reading_skips_connector:
            return 0, False
        return ext, load_async

    def _blocks_reserved_for_loads(self) -> int:
        """An async load keeps the blocks that in-flight prefills still need,
        and with speculative decoding the blocks of one whole decode step
        (S:1241-1251)."""
        if not self.config.profile.async_loads_reserve_blocks:
            return 0
        return (sum(self.kv.remaining_blocks(x) for x in self.inflight_prefills)
                + self.spec_decode_step_blocks())

    def _finish_remote_kv_load(self, r: Request) -> None:
        """An async load completed: its blocks become hash-visible, and a load that
        covered every token gives one back, to be recomputed (S:3123-3173)."""
        failed = r.request_id in self.failed_recving_ids
        if failed:
            if r.num_computed_tokens:
                self.kv.cache_blocks(r, r.num_computed_tokens)
            else:
                self.kv.free(r)   # nothing valid; the retry may hit locally
            self.failed_recving_ids.discard(r.request_id)
        else:
            self.kv.cache_blocks(r, r.num_computed_tokens)
        legacy = self.config.profile.legacy_counters
        if r.num_computed_tokens == r.num_tokens and not (failed and legacy):
            r.num_computed_tokens = r.num_tokens - 1
        if legacy and not failed and r.legacy_num_cached_tokens < 0:
            r.legacy_num_cached_tokens = r.num_computed_tokens   # 0.18 scheduler.py:2045-2046
            r.legacy_cached_from = len(r.lookup_history) - 1

    def _transfers_finished(self, model: ModelOutput) -> None:
        """Loads and sends the worker reports finished. vLLM goes through these
        sets in its own process's order, which frees the blocks of the finished
        requests among them in that order: the order the trace lists them in
        (sorted in traces recorded before it kept vLLM's order)."""
        for req_id in (in_order(model.finished_recving, model.recving_order)
                       if model.finished_recving else ()):
            r = self.requests[req_id]
            if r.status == Status.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(req_id)
            else:
                self._free_blocks(r, "S:3230 a finished load for a request that neither waits "
                                     "for it nor has finished")
        for req_id in (in_order(model.finished_sending, model.sending_order)
                       if model.finished_sending else ()):
            self._free_blocks(self.requests[req_id], "S:2747 a finished send for a request "
                                                     "that has not finished")

    # ---------------------------------------------------------------- load failures

    def _load_failures(self, model: ModelOutput, num_scheduled: dict[str, int]) -> set[str]:
        """The requests whose loads failed, whole or by block."""
        failed: set[str] = set()
        if model.failed_recving:
            failed |= self._handle_failed_recving(model.failed_recving)
        if model.invalid_block_ids:
            failed |= self._handle_invalid_blocks(model.invalid_block_ids, num_scheduled)
        return failed

    def _handle_failed_recving(self, req_ids: set[str]) -> set[str]:
        """Whole async loads that failed (S:3341)."""
        affected = set()
        for req_id in req_ids:
            r = self.requests.get(req_id)
            if r is not None and r.status == Status.WAITING_FOR_REMOTE_KVS:
                affected.add(req_id)
                if self.config.load_failure_policy == "recompute":
                    r.num_computed_tokens = 0
                    self.failed_recving_ids.add(req_id)
        return set() if self.config.load_failure_policy == "recompute" else affected

    def _handle_invalid_blocks(self, invalid: set[int], num_scheduled: dict[str, int]) -> set[str]:
        """Blocks that failed to load: async loads first, then running requests
        (S:3356). Each pass claims shared blocks afresh (S:3274): a block an async load
        claimed is claimed again by the first running request that holds it.
        vLLM refuses them with several KV-cache groups (S:3365-3374)."""
        if self.config.kv_groups and len(self.config.kv_groups) > 1:
            raise SchedulerAssertion(None, "S:3365 a block-level load failure with several "
                                           "KV-cache groups (vLLM raises RuntimeError)", "RuntimeError")
        loading = [r for r in self.kv_holding_waiting if r.status == Status.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._truncate_requests(loading, invalid, num_scheduled)
        sync_failed, to_evict = self._truncate_requests(self.running, invalid, num_scheduled)
        if not (async_failed or sync_failed):
            return set()
        if self.config.load_failure_policy == "fail":
            self.kv.evict_blocks(to_evict)
            return async_failed | sync_failed
        self.failed_recving_ids |= async_failed
        return sync_failed

    def _truncate_requests(self, requests, invalid: set[int],
                           num_scheduled: dict[str, int]) -> tuple[set[str], set[int]]:
        """Cut each request back to its first failed block (S:3237-3339). A block
        another request already claimed in this call is shared: the claimer
        recomputes it, and this request keeps its pre-step count."""
        affected: set[str] = set()
        to_evict: set[int] = set()
        claimed: set[int] = set()
        for r in requests:
            table = self.kv.get_block_ids(r.request_id)
            if (self.config.profile.invalid_block_base == "cached"
                    and r.status != Status.WAITING_FOR_REMOTE_KVS):
                pre = r.legacy_num_cached_tokens   # legacy: the count at its first admission
            else:
                pre = r.num_computed_tokens - num_scheduled.get(r.request_id, 0)
            hit = truncated = False
            for idx, block_id in enumerate(table[: -(-pre // self.block_size)]):
                if block_id not in invalid:
                    continue
                hit = True
                if block_id in claimed:
                    continue
                claimed.add(block_id)
                if truncated:
                    continue
                truncated = True
                self._truncate_for_invalid_block(r, idx, pre)
                to_evict.update(table[idx:])
            if hit:
                if not truncated:
                    r.num_computed_tokens = pre
                affected.add(r.request_id)
        return affected, to_evict

    def _truncate_for_invalid_block(self, r: Request, block_index: int, pre: int) -> None:
        """A block of r failed to load: r is computed only up to that block (S:3315).
        A legacy engine takes the tokens it lost off num_external_computed_tokens
        too, local ones included (upstream issue 36533)."""
        r.num_computed_tokens = block_index * self.block_size
        r.invalid_block_hits += 1
        if self.config.profile.legacy_counters:
            r.take_off_legacy_external(pre - r.num_computed_tokens)   # 0.18 scheduler.py:2195

    # ---------------------------------------------------------------- deferred frees

    def _blocks_can_be_freed(self, r: Request) -> bool:
        """No step that may still write the request's blocks is in flight."""
        return not self.config.defer_block_free or r.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, r: Request) -> None:
        """Free the request's blocks now, or once the steps writing them are done."""
        if self._blocks_can_be_freed(r):
            self.kv.free(r)
            return
        table = self.kv.pop_blocks(r)
        if table:
            self.deferred_frees.append((self.sched_step_seq, table))

    def _step_processed(self) -> None:
        """Every write of a processed step, and of those before it, is done:
        tables whose last writing step that is go back, in the order freed."""
        self.processed_step_seq += 1
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            self.kv.free_blocks(self.deferred_frees.popleft()[1])
