"""The KV audit: digests of the KV cache's real bytes, taken in the process
that owns the cache, at the moments that decide whether a connector moved the
bytes that the scheduler's counts promise.

The scheduler's side of a trace says what the scheduler asked a connector to
load; only the bytes say whether it did. Per step, ``KVAudit`` records
(``kvtrace.trace.events.KVAudit``):

* ``loaded``: every block a load should write (an external hit the scheduler
  admitted, whole blocks only) or did write (by the connector's own metadata),
  with its digest before the step and after its loads;
* ``saved``: every block the connector's metadata says it saves, after the
  forward pass filled it;
* ``cached``: every block the step's forward pass filled (a block that
  becomes a prefix-cache entry; its hash empty where not known yet);
* ``hits``: every block a request admitted in the step took as a local prefix
  hit.

How: at the end of ``schedule()``, on the scheduler's thread, ``plan`` works out
the step's blocks from its ``SchedulerOutput`` and the recorder's lookups and
loads, and hangs them on the step's connector metadata (``kv_shard``'s
``PLAN_ATTR``, builtins only). Every worker that holds a KV cache gets the
metadata in ``bind_connector_metadata``, before any load, and digests its
own shard of the cache there and in ``clear_connector_metadata``, after the
forward pass, the loads and the saves (``kv_shard.ShardAudit``). Its record
comes back to the trace through the engine core's channel (``kv_channel``):
straight to the sink from a worker in the engine core's process (the
uniproc executor: ``LLM``, ``vllm serve`` on one device), through a file per
rank from a worker in a process of its own (tensor parallelism, the
multi-process executor). A metadata object that takes no attribute
(``__slots__``, a frozen dataclass) turns the audit off, and the log says so.

A digest (``kv_digest.BlockDigests``) is a 64-bit hash of a block's bytes in
every layer's KV cache.

A connector's own metadata is read when it has ExampleConnector's shape
(``requests``, each with ``slot_mapping`` and ``is_store``): ``view``
"metadata". Any other connector is a black box (``view`` "bytes"): a block it
loaded is one whose bytes the step changed, and its saves are not known.

Speculative decoding under synchronous scheduling (n-gram, or an EAGLE or
MTP head, whose layers have KV of their own, digested with the target's): a
step's drafts write KV past the tokens it computes for sure; a block counts
as filled by the step whose own tokens (drafts left out) reach its end, when
every position in it holds KV of accepted tokens (the head writes its KV of
a position in the step that accepts the token after it). Every block a
step's drafts write into is written with an empty hash, so that replay
forgets what it held: a block completed by accepted drafts, which the
scheduler caches at the output, is not digested, and a later hit on it is
not compared. vLLM's ExampleConnector names a resumed request's load by the
tokens so far, and fails on a file it never stored once the output has grown
past a block (drafts make that likely); the lab's ``GroupsExampleConnector``
names it by the prompt.

Several KV-cache groups of tokens (full attention, sliding windows; vLLM's
hybrid KV-cache manager): each group has its own block table and its own
layers. The plan has an entry per group (its index and layer names), and a
worker digests each group's blocks over that group's layers alone, a record
per group. A block a sliding window has dropped (vLLM's null block, 0) is in
no list. The connector must support the hybrid manager (``SupportsHMA``):
vLLM turns it off for ExampleConnector, so a sliding-window model then runs
as one group (audited as such); ``kvtrace.lab.fault_connectors``'
``GroupsExampleConnector`` supports it.

Not audited (the audit is off, and says so in the log): a state group
(``MambaSpec``: a state per request, not blocks of tokens), groups of
different block sizes, pipeline parallelism (each stage holds other layers),
drafts under asynchronous scheduling (a step is scheduled
before the previous step's drafts are accepted or rejected), a KV cache
whose block dimension cannot be told (none, or several, of the scheduler's
number of blocks), and a worker on another machine than the engine core (its
records cannot reach the channel; replay names its rank as sending none). A
worker whose audit stops (its cache cannot be read) says so in a last record.

Asynchronous loads (``load_async``: the request waits in
WAITING_FOR_REMOTE_KVS): the blocks a load writes are digested when the step
that issues it binds its metadata, before the worker starts it; and again at
the end of the step whose worker reports it received (``finished_recving``,
through ``get_transfer_results`` or ``get_finished``), where they go into
``loaded`` as asked. A load the worker reports failed, and a block its loads
failed to write (``get_block_ids_with_load_errors``), is left out: the
scheduler recovers those. A block a step fills whose
hash is not known yet (the last token of a decode under async scheduling is
a placeholder when the step is scheduled) is written with an empty hash:
replay then compares nothing on it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvtrace.record.vllm import kv_shard
from kvtrace.record.vllm.kv_channel import Channel
from kvtrace.record.vllm.kv_shard import ENV, PLAN_ATTR

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata)
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHash, BlockHashWithGroupId
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from kvtrace.record.vllm.recorder import Recorder
    from kvtrace.trace.events import KVLoad, Lookup

logger = logging.getLogger("kvtrace.record")



def hash_hex(h: BlockHash | BlockHashWithGroupId) -> str:
    """A vLLM block hash as the trace writes it: its first 16 hex digits."""
    raw = getattr(h, "block_hash", h)   # BlockHashWithGroupId
    return bytes(raw)[:8].hex() if isinstance(raw, (bytes, bytearray)) else str(raw)[:16]


NULL_BLOCK = 0   # vLLM's null block: where a sliding window has dropped a request's block
# The kinds of KV-cache group whose blocks hold tokens' K and V, audited
# beside others; a state group (MambaSpec) holds a state per request.
_TOKEN_SPECS = frozenset({"FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec"})


def _metadata_view(meta: KVConnectorMetadata, block_size: int,
                   group: int | None) -> tuple[list[list[int]], list[list[int]]] | None:
    """(blocks loaded, blocks saved), a list per entry, when the connector's
    metadata has ExampleConnector's shape (with several KV-cache groups, a
    slot mapping per group, ``slot_mappings``); None for a black box."""
    reqs = getattr(meta, "requests", None)
    if not isinstance(reqs, list) or not all(hasattr(r, "slot_mapping") and hasattr(r, "is_store")
                                             for r in reqs):
        return None
    if group is not None and not all(len(getattr(r, "slot_mappings", ())) > group for r in reqs):
        return None
    loads, saves = [], []
    for r in reqs:
        slots = (r.slot_mapping if group is None else r.slot_mappings[group]).tolist()
        # The block of each whole chunk of slots, by position, so that the
        # list lines up with the request's table (null blocks included).
        whole = len(slots) // block_size * block_size
        (saves if r.is_store else loads).append(
            [int(s) // block_size for s in slots[:whole:block_size]])
    return loads, saves


class _Plan:
    """One step's blocks of one KV-cache group to digest, worked out on the
    scheduler's thread."""

    __slots__ = ("asked", "cached", "hits", "targets", "saves", "view", "issued")

    def __init__(self) -> None:
        self.issued: list[tuple[str, int, str]] = []   # async loads issued: (req, block, hash)
        self.asked: dict[int, tuple[str, str]] = {}    # block -> (req, hash)
        self.cached: list[tuple[str, int, str]] = []   # (req, block, hash)
        self.hits: list[tuple[str, int, str]] = []
        self.targets: list[tuple[str, int, str, bool, bool]] = []   # req, block, hash, asked, said
        self.saves: list[tuple[str, int, str]] = []
        self.view = "bytes"


class _Tables:
    """One KV-cache group's block tables, and the block hashes, of a step's
    requests, read when first needed (a long context's table is read only
    in a step that needs it). A block a sliding window has dropped (the null
    block) is left out of every list."""

    def __init__(self, kvm: KVCacheManager, requests: dict[str, Request], order: list[str],
                 group: int = 0) -> None:
        self.kvm, self.requests, self.order, self.group = kvm, requests, order, group
        self._tables: dict[str, list[int]] = {}

    def table(self, rid: str) -> list[int]:
        t = self._tables.get(rid)
        if t is None:
            t = self._tables[rid] = list(self.kvm.get_block_ids(rid)[self.group])
        return t

    def hashes(self, rid: str, lo: int, hi: int) -> list[str]:
        req = self.requests.get(rid)
        got = req.block_hashes[lo:hi] if req is not None else ()
        return [hash_hex(h) for h in got]

    def blocks(self, rid: str, lo: int, hi: int) -> list[tuple[str, int, str]]:
        """(req, block, hash) of the request's blocks lo..hi-1 that hold a hash."""
        table = self.table(rid)
        return [(rid, b, h) for b, h in zip(table[lo:hi], self.hashes(rid, lo, hi))
                if b != NULL_BLOCK]

    def owner(self, blocks: list[int], taken: set[str]) -> str | None:
        """The request whose table starts with ``blocks`` (a connector's
        entry): one not ``taken`` by an entry before, if there is one."""
        found = [rid for rid in self.order if self.table(rid)[:len(blocks)] == blocks]
        return next((rid for rid in found if rid not in taken), found[0] if found else None)


def _filled(tables: _Tables, computed: dict[str, int], out: SchedulerOutput,
            requests: dict[str, Request],
            bs: int) -> list[tuple[str, int, str]]:
    """(req, block, hash) of every block the step's forward pass fills, and,
    with an empty hash, the blocks its drafts write into (forgotten)."""
    nst = out.num_scheduled_tokens
    spec = out.scheduled_spec_decode_tokens or {}
    cached: list[tuple[str, int, str]] = []
    for rid, c in computed.items():
        k = len(spec.get(rid, ()))
        n = nst.get(rid, 0) - k
        if rid not in requests:
            continue
        lo, hi = c // bs, (c + n) // bs
        table = tables.table(rid)
        if hi > lo:   # the step fills a block
            # Blocks with no hash yet (under async scheduling a decode's last
            # token is a placeholder now): an empty hash, compared with nothing.
            hashes = tables.hashes(rid, lo, hi)
            cached += [(rid, b, hashes[i] if i < len(hashes) else "")
                       for i, b in enumerate(table[lo:hi]) if b != NULL_BLOCK]
        if k:   # the blocks its drafts write into: an empty hash, forgotten
            cached += [(rid, b, "") for b in table[hi:-(-(c + n + k) // bs)] if b != NULL_BLOCK]
    return cached


def _local_hits(tables: _Tables, admitted: list[str], lookups: list[Lookup],
                bs: int) -> list[tuple[str, int, str]]:
    """(req, block, hash) of every block an admitted request took as a local
    prefix hit."""
    local = {lk.req: lk.local for lk in lookups}
    hits: list[tuple[str, int, str]] = []
    for rid in admitted:
        if local.get(rid, 0) >= bs:
            hits += tables.blocks(rid, 0, local[rid] // bs)
    return hits


def _loads_asked(tables: _Tables, computed: dict[str, int], lookups: list[Lookup],
                 loads: list[KVLoad],
                 bs: int) -> dict[int, tuple[str, str]]:
    """block -> (req, hash) of every whole block the scheduler asked the
    connector to load synchronously: the request is scheduled now, and reads
    them."""
    sync = {lk.req for lk in lookups if not lk.load_async}
    asked: dict[int, tuple[str, str]] = {}
    for ld in loads:
        if ld.req in computed and ld.req in sync:
            for req, b, h in tables.blocks(ld.req, -(-ld.start // bs), ld.end // bs):
                asked[b] = (req, h)
    return asked


def _loads_issued(tables: _Tables, computed: dict[str, int], lookups: list[Lookup],
                  loads: list[KVLoad], bs: int) -> list[tuple[str, int, str]]:
    """(req, block, hash) of every whole block the scheduler asked the
    connector to load asynchronously in this step: the request waits for it
    (WAITING_FOR_REMOTE_KVS), and reads it once the worker reports it
    received (``finished_recving``)."""
    pending = {lk.req for lk in lookups if lk.load_async}
    issued: list[tuple[str, int, str]] = []
    for ld in loads:
        if ld.req in pending and ld.req not in computed:
            issued += tables.blocks(ld.req, -(-ld.start // bs), ld.end // bs)
    return issued


def _said(p: _Plan, tables: _Tables, meta: KVConnectorMetadata, bs: int,
          group: int | None) -> dict[int, tuple[str, str]]:
    """block -> (req, hash) of every block the connector's own metadata says
    it loads, when it has ExampleConnector's shape (then the plan's view is
    "metadata", and its saves are those the metadata names); else none."""
    said: dict[int, tuple[str, str]] = {}
    view = _metadata_view(meta, bs, group)
    if view is None:
        return said
    p.view = "metadata"
    entries_loaded, entries_saved = view
    taken: set[str] = set()
    for blocks in entries_loaded:
        rid = tables.owner(blocks, taken)
        hashes = tables.hashes(rid, 0, len(blocks)) if rid else []
        taken.add(rid)
        for i, b in enumerate(blocks):
            if b != NULL_BLOCK:
                said[b] = (rid, hashes[i]) if i < len(hashes) else ("", "")
    for blocks in entries_saved:
        rid = tables.owner(blocks, taken)
        if rid is not None:
            taken.add(rid)
            p.saves += tables.blocks(rid, 0, len(blocks))
    return said


class KVAudit:
    """One recorder's audit, the engine core's side (see the module doc)."""

    def __init__(self, sched: Scheduler) -> None:
        self.block_size = int(sched.cache_config.block_size)
        self.num_blocks = int(sched.kv_cache_manager.block_pool.num_gpu_blocks)
        self.kvm = sched.kv_cache_manager
        # Each KV-cache group's index and layers; one group: None and all layers.
        groups = _groups(sched)
        self.groups: list[tuple[int | None, list[str] | None]] = (
            [(None, None)] if len(groups) <= 1 else
            [(g, list(group.layer_names)) for g, group in enumerate(groups)])
        self.off = False   # set when a step's metadata takes no plan
        self.channel: Channel | None = None   # opened by install
        self.workers_apart = True   # the workers are in processes of their own

    def plan(self, step: int, out: SchedulerOutput, sched: Scheduler, lookups: list[Lookup],
             loads: list[KVLoad]) -> None:
        """At the end of ``schedule()``: which blocks the step's execution must
        digest, and whose they are (read now, while the tables are this step's),
        hung on the step's connector metadata for its workers."""
        meta = getattr(out, "kv_connector_metadata", None)
        if meta is None or self.off:
            return
        try:
            groups = []
            for g, layers in self.groups:
                p = self.blocks(out, sched, lookups, loads, meta, g)
                groups.append({"group": g, "layers": layers, "view": p.view,
                               "targets": p.targets, "issued": p.issued, "saves": p.saves,
                               "cached": p.cached, "hits": p.hits})
        except Exception:   # a metadata of an unexpected shape: the audit stops, not the recording
            self.off = True
            logger.exception("kvtrace: no KV audit from step %d (its plan failed)", step)
            return
        try:
            setattr(meta, PLAN_ATTR, {
                "step": step, "num_blocks": self.num_blocks,
                "to": self.channel.path if self.channel is not None else "", "groups": groups})
        except Exception as e:   # __slots__, a frozen dataclass, a validating __setattr__
            self.off = True
            logger.info("kvtrace: no KV audit (the connector's metadata, %s, takes no "
                        "attribute: %s: %s)", type(meta).__name__, type(e).__name__, e)

    def blocks(self, out: SchedulerOutput, sched: Scheduler, lookups: list[Lookup],
               loads: list[KVLoad], meta: KVConnectorMetadata, group: int | None) -> _Plan:
        """The step's plan for one KV-cache group: the blocks its workers
        digest, and whose they are."""
        bs = self.block_size
        p = _Plan()
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cd = out.scheduled_cached_reqs
        computed.update(zip(cd.req_ids, cd.num_computed_tokens))
        admitted = [r.req_id for r in out.scheduled_new_reqs] + list(cd.resumed_req_ids or ())
        # Admitted requests first: a connector's entries are theirs, mostly.
        tables = _Tables(self.kvm, sched.requests,
                         list(dict.fromkeys(admitted + [r for r in computed if r in sched.requests])),
                         group or 0)
        p.cached = _filled(tables, computed, out, sched.requests, bs)
        p.hits = _local_hits(tables, admitted, lookups, bs)
        p.asked = _loads_asked(tables, computed, lookups, loads, bs)
        p.issued = _loads_issued(tables, computed, lookups, loads, bs)
        said = _said(p, tables, meta, bs, group)
        for b in dict.fromkeys([*p.asked, *said]):
            req, h = p.asked.get(b) or said[b]
            p.targets.append((req, b, h, b in p.asked, b in said))
        return p

    def collect(self) -> None:
        """The records that workers in other processes have sent (none
        where the worker is in this process: it hands them to the sink)."""
        if self.channel is not None and self.workers_apart:
            self.channel.collect()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def _groups(sched: Scheduler) -> list:
    """The engine's KV-cache groups (vLLM's ``KVCacheGroupSpec``s)."""
    cfg = getattr(sched, "kv_cache_config", None)
    return list(getattr(cfg, "kv_cache_groups", None) or ())


def _schedules_ahead(sched: Scheduler) -> bool:
    """Whether ``sched`` is vLLM's AsyncScheduler, which schedules a step
    before the output of the one before comes back."""
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except Exception:
        return bool(getattr(sched.vllm_config.scheduler_config, "async_scheduling", False))
    return isinstance(sched, AsyncScheduler)


def refusal(sched: Scheduler, worker_conn: KVConnectorBase_V1 | None = None) -> str | None:
    """Why the audit cannot run for this engine, or None. ``worker_conn``:
    the connector's worker side, where it is in this process."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    if any(getattr(type(c), "kvtrace_moves_no_data", False)
           for c in (getattr(sched, "connector", None), worker_conn)):
        return "the connector moves no data"
    try:
        groups = sched.kv_cache_config.kv_cache_groups
    except AttributeError:
        return "no KV cache config"
    for group in groups:
        kind = type(getattr(group, "kv_cache_spec", None)).__name__
        # One group of any kind of attention is audited; beside others, the
        # kinds known to hold blocks of tokens. A state is never.
        if "Mamba" in kind or (len(groups) > 1 and kind not in _TOKEN_SPECS):
            return (f"a KV-cache group of kind {kind} (the audit follows blocks of tokens: "
                    f"full attention and sliding windows)")
        if len(groups) > 1 and int(group.kv_cache_spec.block_size) != int(
                sched.cache_config.block_size):
            return "KV-cache groups of different block sizes"
    pc = getattr(getattr(sched, "vllm_config", None), "parallel_config", None)
    if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
        return "pipeline parallelism (each stage holds other layers)"
    if getattr(sched, "num_spec_tokens", 0) and _schedules_ahead(sched):
        return "drafts under asynchronous scheduling"
    return None


def install(sched: Scheduler, rec: Recorder) -> KVAudit | None:
    """Start the audit for the recorder ``rec`` of ``sched`` when it can run:
    each step's plan goes to the workers on the connector's metadata, and
    their records come back through a channel (``kv_channel``). A worker in
    this process is watched here (``kv_shard.watch``); one in a process of
    its own watches its connector when vLLM's factory makes it
    (``kv_shard.install_factory_hook``, from the plugin)."""
    if getattr(sched, "connector", None) is None:
        return None
    worker_conn = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker_conn = get_kv_transfer_group()
    except Exception:
        worker_conn = None
    why = refusal(sched, worker_conn)
    if why is not None:
        logger.info("kvtrace: no KV audit (%s)", why)
        return None
    audit = KVAudit(sched)
    audit.channel = Channel(rec.sink.put)
    if worker_conn is not None:
        kv_shard.watch(worker_conn)
        audit.workers_apart = False
    logger.info("kvtrace: auditing the KV cache's bytes (%s)", type(sched.connector).__name__)
    return audit
