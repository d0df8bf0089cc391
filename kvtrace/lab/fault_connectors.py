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

``GroupsExampleConnector`` is no fault: ExampleConnector made for vLLM's
    hybrid KV-cache manager (``SupportsHMA``), where each KV-cache group
    (full attention, a sliding window) has a block table of its own. Each
    entry of its metadata holds a slot mapping per group
    (``slot_mappings``); each layer is saved from, and loaded into, its own
    group's blocks, and a block a sliding window has dropped (vLLM's null
    block, 0) is neither.

``IgnoresGroups`` ("groups-ignored"): a ``GroupsExampleConnector`` that
    loads every layer into the first group's blocks, as a connector written
    for one group does: the other groups' blocks are never loaded, and the
    first group's get other layers' bytes.

``SkipsDraftLayers`` ("draft-layers-skipped"): a ``GroupsExampleConnector``
    that saves the layers of an EAGLE draft head and never loads them, as a
    connector that moves the target model's layers alone: after a load the
    draft head reads what its blocks held, and drafts from it. The target's
    output is unchanged (it checks every draft); the drafts are worse.

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

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
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


@dataclass
class GroupsReqMeta(ReqMeta):
    """ExampleConnector's entry, with a slot mapping for each KV-cache group."""

    slot_mappings: list[Any] = field(default_factory=list)


class GroupsExampleConnector(ExampleConnector, SupportsHMA):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._group_of = {name: g for g, group in enumerate(self._kv_cache_config.kv_cache_groups)
                          for name in group.layer_names}

    # -- the scheduler's side ---------------------------------------------------

    def request_finished_all_groups(self, request: Any, block_ids: tuple):
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        """ExampleConnector's entries, in its order, each with every group's
        slot mapping."""
        meta = ExampleConnectorMetadata()
        loading = self._requests_need_load
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids or []
            mm = [f.identifier for f in new_req.mm_features]
            if new_req.req_id in loading:
                meta.requests.append(self._entry(token_ids, new_req.block_ids, False, mm))
            elif not self._found_match_for_prompt(token_ids, mm):
                meta.requests.append(self._entry(token_ids, new_req.block_ids, True, mm))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in cached.resumed_req_ids or req_id not in loading:
                continue
            # The prompt, which the hit was looked up by: ExampleConnector
            # names the load by the tokens so far, and fails on a file it
            # never stored once the output has grown past a block.
            request = loading[req_id]
            meta.requests.append(self._entry(list(request.prompt_token_ids or []),
                                             cached.new_block_ids[i], False,
                                             [f.identifier for f in request.mm_features]))
        loading.clear()
        return meta

    def _entry(self, token_ids: list[int], block_ids: tuple, is_store: bool,
               mm: list[str]) -> GroupsReqMeta:
        per_group = [ReqMeta.make_meta(token_ids, list(ids), self._block_size, is_store, mm)
                     for ids in block_ids]
        first = per_group[0]
        return GroupsReqMeta(first.token_ids, first.slot_mapping, is_store, mm,
                             [m.slot_mapping for m in per_group])

    # -- the worker's side ----------------------------------------------------------

    def slots(self, entry: GroupsReqMeta, layer_name: str) -> Any:
        """The slots of ``layer_name``'s group, in ``entry``."""
        return entry.slot_mappings[self._group_of[layer_name]]

    def loads_layer(self, layer_name: str) -> bool:
        """Whether a load writes ``layer_name``'s KV (every layer's, here)."""
        return True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        import safetensors.torch

        if forward_context.attn_metadata is None:   # as ExampleConnector: no load without one
            return
        bs = self._block_size
        for entry in self._get_connector_metadata().requests:
            if entry.is_store:
                continue
            for name, layer in forward_context.no_compile_layers.items():
                kv = getattr(layer, "kv_cache", None)
                if kv is None or name not in self._group_of or not self.loads_layer(name):
                    continue
                slots = self.slots(entry, name).to(kv.device)
                stored = safetensors.torch.load_file(self._generate_filename_debug(
                    name, entry.token_ids, entry.mm_hashes))["kv_cache"].to(kv.device)
                kept = slots // bs != 0   # a block the window dropped: vLLM's null block
                kv[slots[kept] // bs, :, slots[kept] % bs] = stored[kept]

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        import safetensors.torch

        bs = self._block_size
        for entry in self._get_connector_metadata().requests:
            if entry.is_store and layer_name in self._group_of:
                slots = self.slots(entry, layer_name).to(kv_layer.device)
                rows = kv_layer[slots // bs, :, slots % bs]
                safetensors.torch.save_file({"kv_cache": rows.detach().cpu()},
                                            self._generate_filename_debug(
                                                layer_name, entry.token_ids, entry.mm_hashes))


class IgnoresGroups(GroupsExampleConnector):
    def slots(self, entry: GroupsReqMeta, layer_name: str) -> Any:
        if entry.is_store:
            return super().slots(entry, layer_name)
        return entry.slot_mappings[0]   # the bug: every layer loaded into the first group's blocks


class SkipsDraftLayers(GroupsExampleConnector):
    def loads_layer(self, layer_name: str) -> bool:
        # The bug: the draft head's layers (numbered after the target
        # model's) are saved, never loaded.
        target = self._vllm_config.model_config.hf_config.num_hidden_layers
        return int(layer_name.split(".")[2]) < target
