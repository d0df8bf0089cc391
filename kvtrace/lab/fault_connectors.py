"""vLLM connector subclasses that move KV bytes wrongly, for testing the KV
audit (``kv_audit``). Each is vLLM's own ``ExampleConnector`` (it stores every
new prompt's KV in a directory and loads it back on an external hit) with one
bug put back. Configure one as ``kv_connector`` with
``kv_connector_module_path="kvtrace.lab.fault_connectors"``.

``DropsResumedLoad`` ("resumed-load-dropped", the shape of LMCache issue
    #2007): ``update_state_after_alloc`` for a request resumed after a
    preemption is dropped. The scheduler has counted the external hit as
    computed; nothing loads it; the request reads whatever its new blocks
    held. Every count agrees with a correct run.

``AsyncExampleConnector`` is no fault: ExampleConnector with its loads
    asynchronous, as production connectors (LMCache, NIXL, Mooncake) make
    them. An external hit is answered ``load_kv_async=True``; the request
    waits in WAITING_FOR_REMOTE_KVS; the worker copies the stored bytes into
    its blocks in the next step it runs (with a forward pass or without one)
    and reports the request in ``finished_recving`` at that step's end.

``MisreadsPackedLayout`` ("packed-layout-misread", the shape of
    dynamo#14416 / LMCache#4463): vLLM's KV cache rows are packed, each
    head's K then V in one row (``[blocks, heads, block size, 2 * head
    size]`` on the CPU); the connector copies each stored row as if it held K
    alone, so a load writes the K half of every row and leaves the V half as
    the block held it. Every count agrees with a correct run.

``RankedExampleConnector`` is no fault: ExampleConnector made right for
    tensor parallelism. Each rank's worker holds its own heads of the KV
    cache; vLLM's ExampleConnector names a prompt's files by its tokens
    alone, so every rank writes the same file and one rank's shard is
    loaded into the others. This one keeps a directory per rank under each
    prompt's (the scheduler still finds the prompt's directory).

``LoadsAnotherRanksShard`` ("tp-shard-mixup"): a ``RankedExampleConnector``
    whose rank 1 loads rank 0's files: its blocks get the other heads' K
    and V, of the right shape. Every count agrees with a correct run, and
    rank 0's shard is right.

``ReportsUnloaded`` ("async-load-unloaded"): an ``AsyncExampleConnector``
    whose worker reports its first load received without copying a byte of
    it (a transfer that completes in the connector's books only). The
    scheduler resumes the request with the hit counted as computed, and the
    request reads whatever its blocks held.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)


class DropsResumedLoad(ExampleConnector):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if getattr(request, "num_preemptions", 0) > 0:
            return   # the bug: a resumed request's load is dropped
        return super().update_state_after_alloc(request, blocks, num_external_tokens)


@dataclass
class AsyncLoadMetadata(ExampleConnectorMetadata):
    """ExampleConnector's metadata (its saves) and the asynchronous loads
    issued in the step: (request id, what to load)."""

    loads: list[tuple[str, ReqMeta]] = field(default_factory=list)


class AsyncExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._async_loads: dict[str, tuple[Any, list[int]]] = {}   # scheduler: issued now
        self._received: set[str] = set()                          # worker: loaded this step

    # -- the scheduler's side ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if num_external_tokens > 0:   # every block the request holds: the load covers its prefix
            self._async_loads[request.request_id] = (request, list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: Any) -> AsyncLoadMetadata:
        base = super().build_connector_meta(scheduler_output)   # its saves; it loads nothing
        meta = AsyncLoadMetadata(requests=base.requests)
        for rid, (request, block_ids) in self._async_loads.items():
            meta.loads.append((rid, ReqMeta.make_meta(
                request.prompt_token_ids or [], block_ids, self._block_size, is_store=False,
                mm_hashes=[f.identifier for f in request.mm_features])))
        self._async_loads.clear()
        return meta

    # -- the worker's side --------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        for rid, load in getattr(meta, "loads", ()):
            if self.copies(rid):
                self._copy(forward_context, load)
            self._received.add(rid)

    def copies(self, rid: str) -> bool:
        """Whether the worker moves the bytes of ``rid``'s load (always, here)."""
        return True

    def _copy(self, forward_context: Any, load: ReqMeta) -> None:
        copy_load(self, forward_context, load)

    def get_finished(self, finished_req_ids: set[str]):
        done, self._received = self._received, set()
        return None, (done or None)


class ReportsUnloaded(AsyncExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._skipped = False

    def copies(self, rid: str) -> bool:
        if self._skipped:
            return True
        self._skipped = True   # the bug: the first load is reported received, never copied
        return False


def copy_load(connector: ExampleConnector, forward_context: Any, load: ReqMeta,
              half: bool = False) -> None:
    """The stored bytes of ``load`` into the KV cache of every layer, as
    ExampleConnector's own load writes them, with or without a forward pass;
    ``half``: only the first half of each row (the K of a packed row)."""
    import safetensors.torch

    bs = connector._block_size
    for name, layer in forward_context.no_compile_layers.items():
        kv = getattr(layer, "kv_cache", None)
        if kv is None:
            continue
        blocks = (load.slot_mapping // bs).to(kv.device)
        offsets = (load.slot_mapping % bs).to(kv.device)
        stored = safetensors.torch.load_file(connector._generate_filename_debug(
            name, load.token_ids, load.mm_hashes))["kv_cache"].to(kv.device)
        if half:
            width = stored.shape[-1] // 2
            kv[blocks, :, offsets, :width] = stored[..., :width]
        else:
            kv[blocks, :, offsets] = stored


class MisreadsPackedLayout(ExampleConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if forward_context.attn_metadata is None:   # as ExampleConnector: no load without one
            return
        for load in self._get_connector_metadata().requests:
            if not load.is_store:
                copy_load(self, forward_context, load, half=True)   # the bug: K alone


def corrupt_stored_prompt(connector: Any, prompt: list[int], block: int = 1) -> str:
    """Change one byte of block ``block`` of ``prompt``'s stored KV, in the first
    layer's file of ``connector``'s (an ExampleConnector's) store; returns the
    file. The storage layer's corruption: the next load of that prompt copies
    bytes that differ from those saved."""
    import os

    import safetensors.torch
    import torch

    bs = connector._block_size
    aligned = (len(prompt) - 1) // bs * bs
    folder = connector._generate_foldername_debug(torch.tensor(prompt)[:aligned], [],
                                                  create_folder=False)
    name = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    path = os.path.join(folder, name)
    tensors = safetensors.torch.load_file(path)
    kv = tensors["kv_cache"]
    flat = kv[block * bs].view(-1).view(torch.uint8)
    flat[0] ^= 0x40
    safetensors.torch.save_file(tensors, path)
    return path


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:   # the scheduler's side: no parallel state in its process
        return 0


class RankedExampleConnector(ExampleConnector):
    def _generate_foldername_debug(self, token_ids: Any, mm_hashes: list[str],
                                   create_folder: bool = False) -> str:
        folder = super()._generate_foldername_debug(token_ids, mm_hashes, create_folder)
        if self._role != KVConnectorRole.WORKER:
            return folder   # the scheduler looks for the prompt's directory
        folder = os.path.join(folder, f"rank{self.rank_read()}")
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    def rank_read(self) -> int:
        """The rank whose files this worker reads and writes now."""
        return _tensor_parallel_rank()


class LoadsAnotherRanksShard(RankedExampleConnector):
    _loading = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._loading = True
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            self._loading = False

    def rank_read(self) -> int:
        rank = super().rank_read()
        return 0 if self._loading and rank == 1 else rank   # the bug: rank 1 loads rank 0's
