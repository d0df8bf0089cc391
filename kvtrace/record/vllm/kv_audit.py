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
loads, keyed by the step's connector metadata object. The worker's side of the
connector gets that object in ``bind_connector_metadata``, before any load:
the digests of the blocks a load writes are taken there ("before"); and gives
it back in ``clear_connector_metadata``, after the forward pass, the loads and
the saves: there every digest is taken, in one batch on the KV cache's device,
and the event goes to the trace. So the audit runs where the connector's
worker side shares the engine core's process: vLLM's in-process engine, or an
engine core with the uniproc executor (``LLM``, ``vllm serve`` on one device).

A digest is a 64-bit hash of a block's bytes in every layer's KV cache (a
signed 64-bit integer): each layer's bytes are read as 64-bit words (bytes,
where a layer's block is no multiple of 8 of them); each word is multiplied
by a fixed random odd word of its position between xor-shifts (xor-shift,
multiply by the position's word, xor-shift, multiply, xor-shift, all modulo
2^64, so that every bit of the word reaches every bit); the mixed words are summed modulo 2^64, the layers folded in order.
The same bytes give the same digest on any device; bytes that differ give
another one but for a chance of about 2^-60 (without the mixing, a sum of
weighted words would miss two flips of the same high bit half the time).

A connector's own metadata is read when it has ExampleConnector's shape
(``requests``, each with ``slot_mapping`` and ``is_store``): ``view``
"metadata". Any other connector is a black box (``view`` "bytes"): a block it
loaded is one whose bytes the step changed, and its saves are not known.

Speculative decoding (a proposer with no draft head, such as n-gram, under
synchronous scheduling): a step's drafts write KV past the tokens it computes
for sure; a block counts as filled by the step whose own tokens (drafts left
out) reach its end, when every position in it holds KV of accepted tokens.
Every block a step's drafts write into is written with an empty hash, so
that replay forgets what it held: a block completed by accepted drafts, which
the scheduler caches at the output, is not digested, and a later hit on it is
not compared.

Not audited (the audit is off, and says so in the log): several KV-cache
groups (the audit reads one block table at one block size), an EAGLE or MTP
head, drafts under asynchronous scheduling (a step is scheduled before the
previous step's drafts are accepted or rejected), and a KV cache whose block
dimension cannot be told (none, or several, of the scheduler's number of
blocks). No connector of
vLLM 0.32 that moves KV bytes runs here with several groups or an EAGLE head:
ExampleConnector does not support the hybrid KV-cache manager, so vLLM turns
it off (a sliding-window model then runs as one group, which is audited; a
state model fails at start-up, ``Failed to promote local KV cache specs to
one unified type``), the connectors that support it (SimpleCPUOffloadConnector,
OffloadingConnector) need CUDA streams, and with an EAGLE head
ExampleConnector fails looking up a file it never stored.

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
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtrace.trace.events import KVAudit as KVAuditEvent

if TYPE_CHECKING:
    import torch
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

ENV = "KVTRACE_KV_AUDIT"   # "0": off; "1" or unset: on wherever it can run
_FOLD = 0x5851F42D4C957F2D   # odd: folds one layer's sum into the next
_MIX = 0x2545F4914F6CDD1D   # odd, below 2^63: a signed 64-bit integer as it is
_BATCH = 256   # blocks digested at once: the copies stay small beside the cache


def hash_hex(h: BlockHash | BlockHashWithGroupId) -> str:
    """A vLLM block hash as the trace writes it: its first 16 hex digits."""
    raw = getattr(h, "block_hash", h)   # BlockHashWithGroupId
    return bytes(raw)[:8].hex() if isinstance(raw, (bytes, bytearray)) else str(raw)[:16]


class BlockDigests:
    """Digests of whole blocks of a set of per-layer KV cache tensors."""

    def __init__(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        import torch

        self.torch = torch
        self.layers = []   # (tensor, its block dimension)
        seen = set()
        for t in layers:
            if t.data_ptr() in seen and t.shape in [x.shape for x, _ in self.layers]:
                continue
            seen.add(t.data_ptr())
            # vLLM's layouts put the blocks first ([blocks, heads, ...], the
            # CPU's) or second ([2, blocks, ...], K and V first).
            dims = [d for d, n in enumerate(t.shape[:2]) if n == num_blocks]
            if len(dims) != 1:
                raise ValueError(f"a KV cache tensor of shape {tuple(t.shape)} has "
                                 f"{'no' if not dims else 'more than one'} dimension of "
                                 f"{num_blocks} blocks among its first two")
            self.layers.append((t, dims[0]))
        self.device = self.layers[0][0].device
        self._weights: dict[int, torch.Tensor] = {}

    def _w(self, n: int) -> torch.Tensor:
        w = self._weights.get(n)
        if w is None:
            g = self.torch.Generator().manual_seed(0x6B76 + n)
            w = (self.torch.randint(-(1 << 62), 1 << 62, (n,), generator=g,
                                    dtype=self.torch.int64) * 2 + 1).to(self.device)
            self._weights[n] = w
        return w

    def __call__(self, blocks: list[int]) -> list[int]:
        out: list[int] = []
        for at in range(0, len(blocks), _BATCH):
            out += self._digest(blocks[at:at + _BATCH])
        return out

    def _digest(self, blocks: list[int]) -> list[int]:
        if not blocks:
            return []
        torch = self.torch
        idx = torch.as_tensor(blocks, dtype=torch.int64, device=self.device)
        acc = None
        for t, dim in self.layers:
            x = t.index_select(dim, idx)   # a copy: the products below overwrite it
            if dim:
                x = x.movedim(dim, 0)
            x = x.contiguous().view(torch.uint8).reshape(len(blocks), -1)
            x = x.view(torch.int64) if x.shape[1] % 8 == 0 else x.to(torch.int64)
            x ^= (x >> 31) & 0x1FFFFFFFF   # a logical shift of 64-bit words: high bits down
            x.mul_(self._w(x.shape[1]))    # then up again, by a weight of the word's position
            x ^= (x >> 29) & 0x7FFFFFFFF
            x.mul_(_MIX)
            x ^= (x >> 32) & 0xFFFFFFFF
            s = x.sum(dim=1)
            acc = s if acc is None else acc * _FOLD + s
        return acc.tolist()


def _kv_layers(conn: KVConnectorBase_V1) -> list[torch.Tensor]:
    """The worker's per-layer KV cache tensors, from vLLM's static forward
    context (the layers that hold one)."""
    cfg = getattr(conn, "_vllm_config", None)
    if cfg is None:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    out = []
    for layer in cfg.compilation_config.static_forward_context.values():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):   # older releases: one per virtual engine
            kv = kv[0] if kv else None
        if kv is not None and hasattr(kv, "data_ptr") and kv.numel():
            out.append(kv)
    return out


def _metadata_view(meta: KVConnectorMetadata,
                   block_size: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """(blocks loaded, blocks saved), a list per entry, when the connector's
    metadata has ExampleConnector's shape; None for a black box."""
    reqs = getattr(meta, "requests", None)
    if not isinstance(reqs, list) or not all(hasattr(r, "slot_mapping") and hasattr(r, "is_store")
                                             for r in reqs):
        return None
    loads, saves = [], []
    for r in reqs:
        per_block = Counter(int(s) // block_size for s in r.slot_mapping.tolist())
        full = [b for b, n in per_block.items() if n == block_size]   # in the entry's order
        (saves if r.is_store else loads).append(full)
    return loads, saves


class _Plan:
    """One step's blocks to digest, worked out on the scheduler's thread."""

    __slots__ = ("step", "asked", "cached", "hits", "before", "targets", "saves", "view",
                 "issued")

    def __init__(self, step: int):
        self.step = step
        self.issued: list[tuple[str, int, str]] = []   # async loads issued: (req, block, hash)
        self.asked: dict[int, tuple[str, str]] = {}    # block -> (req, hash)
        self.cached: list[tuple[str, int, str]] = []   # (req, block, hash)
        self.hits: list[tuple[str, int, str]] = []
        self.before: dict[int, int] = {}
        self.targets: list[tuple[str, int, str, bool, bool]] = []   # req, block, hash, asked, said
        self.saves: list[tuple[str, int, str]] = []
        self.view = "bytes"


class _Tables:
    """Block tables and block hashes of a step's requests, read when first
    needed (a long context's table is read only in a step that needs it)."""

    def __init__(self, kvm: KVCacheManager, requests: dict[str, Request], order: list[str]) -> None:
        self.kvm, self.requests, self.order = kvm, requests, order
        self._tables: dict[str, list[int]] = {}

    def table(self, rid: str) -> list[int]:
        t = self._tables.get(rid)
        if t is None:
            t = self._tables[rid] = list(self.kvm.get_block_ids(rid)[0])
        return t

    def hashes(self, rid: str, lo: int, hi: int) -> list[str]:
        req = self.requests.get(rid)
        got = req.block_hashes[lo:hi] if req is not None else ()
        return [hash_hex(h) for h in got]

    def blocks(self, rid: str, lo: int, hi: int) -> list[tuple[str, int, str]]:
        """(req, block, hash) of the request's blocks lo..hi-1 that hold a hash."""
        table = self.table(rid)
        return [(rid, b, h) for b, h in zip(table[lo:hi], self.hashes(rid, lo, hi))]

    def owner(self, blocks: list[int]) -> str | None:
        """The request whose table starts with ``blocks`` (a connector's entry)."""
        for rid in self.order:
            if self.table(rid)[:len(blocks)] == blocks:
                return rid
        return None


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
        if (c + n) // bs > c // bs:   # the step fills a block
            filled = tables.blocks(rid, c // bs, (c + n) // bs)
            # Blocks with no hash yet (under async scheduling a decode's last
            # token is a placeholder now): an empty hash, compared with nothing.
            table = tables.table(rid)[len(filled) + c // bs:(c + n) // bs]
            cached += filled + [(rid, b, "") for b in table]
        if k:   # the blocks its drafts write into: an empty hash, forgotten
            drafted = tables.table(rid)[(c + n) // bs:-(-(c + n + k) // bs)]
            cached += [(rid, b, "") for b in drafted]
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


def _said(p: _Plan, tables: _Tables, meta: KVConnectorMetadata,
          bs: int) -> dict[int, tuple[str, str]]:
    """block -> (req, hash) of every block the connector's own metadata says
    it loads, when it has ExampleConnector's shape (then the plan's view is
    "metadata", and its saves are those the metadata names); else none."""
    said: dict[int, tuple[str, str]] = {}
    view = _metadata_view(meta, bs)
    if view is None:
        return said
    p.view = "metadata"
    entries_loaded, entries_saved = view
    for blocks in entries_loaded:
        rid = tables.owner(blocks)
        named = tables.blocks(rid, 0, len(blocks)) if rid else []
        for i, b in enumerate(blocks):
            said[b] = named[i][::2] if i < len(named) else ("", "")
    for blocks in entries_saved:
        rid = tables.owner(blocks)
        if rid is not None:
            p.saves += tables.blocks(rid, 0, len(blocks))
    return said


class KVAudit:
    """One recorder's audit (see the module doc)."""

    def __init__(self, rec: Recorder, sched: Scheduler, conn: KVConnectorBase_V1) -> None:
        self.rec = rec
        self.conn = conn
        self.block_size = int(sched.cache_config.block_size)
        self.num_blocks = int(sched.kv_cache_manager.block_pool.num_gpu_blocks)
        self.kvm = sched.kv_cache_manager
        self.digests: BlockDigests | None = None
        self.off = False   # set when the KV cache cannot be read
        self._plans: dict[int, tuple[KVConnectorMetadata, _Plan]] = {}
        self._bound: _Plan | None = None
        # Asynchronous loads issued and not yet received: request ->
        # [(block, hash, its digest when the load was issued)].
        self._pending: dict[str, list[tuple[int, str, int]]] = {}
        self._recving: set[str] = set()    # the step's transfer results: received
        self._failed: set[str] = set()     # and failed
        self._invalid: set[int] = set()    # blocks the step's loads failed to write

    # -- the scheduler's thread --------------------------------------------------

    def plan(self, step: int, out: SchedulerOutput, sched: Scheduler, lookups: list[Lookup],
             loads: list[KVLoad]) -> None:
        """At the end of ``schedule()``: which blocks the step's execution must
        digest, and whose they are (read now, while the tables are this step's)."""
        meta = getattr(out, "kv_connector_metadata", None)
        if meta is None or self.off:
            return
        bs = self.block_size
        p = _Plan(step)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cd = out.scheduled_cached_reqs
        computed.update(zip(cd.req_ids, cd.num_computed_tokens))
        admitted = [r.req_id for r in out.scheduled_new_reqs] + list(cd.resumed_req_ids or ())
        # Admitted requests first: a connector's entries are theirs, mostly.
        tables = _Tables(self.kvm, sched.requests,
                         list(dict.fromkeys(admitted + [r for r in computed if r in sched.requests])))
        p.cached = _filled(tables, computed, out, sched.requests, bs)
        p.hits = _local_hits(tables, admitted, lookups, bs)
        p.asked = _loads_asked(tables, computed, lookups, loads, bs)
        p.issued = _loads_issued(tables, computed, lookups, loads, bs)
        said = _said(p, tables, meta, bs)
        for b in dict.fromkeys([*p.asked, *said]):
            req, h = p.asked.get(b) or said[b]
            p.targets.append((req, b, h, b in p.asked, b in said))
        self._plans[id(meta)] = (meta, p)
        if len(self._plans) > 64:   # steps the worker never ran (engine error paths)
            self._plans.pop(next(iter(self._plans)))

    # -- the worker's side ---------------------------------------------------------

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Before the step's loads: the digests of the blocks they write."""
        got = self._plans.pop(id(meta), None)
        self._bound = None
        if got is None or got[0] is not meta:
            return
        p = got[1]
        if self.digests is None:
            if self.off:
                return
            try:
                layers = _kv_layers(self.conn)
                if not layers:
                    raise ValueError("no layer holds a KV cache tensor")
                self.digests = BlockDigests(layers, self.num_blocks)
            except Exception as e:   # the audit stops; the recording goes on
                self.off = True
                logger.warning("kvtrace: no KV audit (%s: %s)", type(e).__name__, e)
                return
        if p.targets:
            p.before = dict(zip([t[1] for t in p.targets],
                                self.digests([t[1] for t in p.targets])))
        if p.issued:   # before the worker starts them
            for (req, b, h), d in zip(p.issued, self.digests([t[1] for t in p.issued])):
                self._pending.setdefault(req, []).append((b, h, d))
        self._bound = p

    def transferred(self, recving: Iterable[str] | None, failed: Iterable[str] | None) -> None:
        """The worker's transfer results of the step (before ``clear``)."""
        self._recving, self._failed = set(recving or ()), set(failed or ())

    def load_errors(self, blocks: Iterable[int] | None) -> None:
        """The blocks the step's loads failed to write (before ``clear``)."""
        self._invalid = set(blocks or ())

    def _received(self) -> list[tuple[str, int, str, int]]:
        """(req, block, hash, digest before) of the asynchronous loads the
        step's worker reports received: a failed one, or a block its loads
        failed to write, is left to the scheduler's recovery, not judged."""
        recving, failed, invalid = self._recving, self._failed, self._invalid
        self._recving, self._failed, self._invalid = set(), set(), set()
        for req in failed:
            self._pending.pop(req, None)
        return [(req, b, h, before) for req in recving - failed
                for b, h, before in self._pending.pop(req, ()) if b not in invalid]

    def clear(self) -> None:
        p, self._bound = self._bound, None
        if p is None or self.digests is None:
            return
        received = self._received()
        groups = (p.targets, received, p.saves, p.cached, p.hits)
        flat = [e[1] for g in groups for e in g]
        if not flat:
            return
        got = iter(self.digests(flat))
        loaded = []
        for req, b, h, asked, said in p.targets:
            after = next(got)
            before = p.before[b]
            loaded.append((req, b, h, before, after, asked,
                           said if p.view == "metadata" else after != before))
        for req, b, h, before in received:   # asked, in the step that reported it received
            after = next(got)
            loaded.append((req, b, h, before, after, True, after != before))
        saved = [(r, b, h, next(got)) for r, b, h in p.saves]
        cached = [(r, b, h, next(got)) for r, b, h in p.cached]
        hits = [(r, b, h, next(got)) for r, b, h in p.hits]
        self.rec.sink.put(KVAuditEvent(seq=0, step=p.step, view=p.view, loaded=loaded,
                                       saved=saved, cached=cached, hits=hits))


def _schedules_ahead(sched: Scheduler) -> bool:
    """Whether ``sched`` is vLLM's AsyncScheduler, which schedules a step
    before the output of the one before comes back."""
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except Exception:
        return bool(getattr(sched.vllm_config.scheduler_config, "async_scheduling", False))
    return isinstance(sched, AsyncScheduler)


def _watch_transfers(conn: KVConnectorBase_V1, audit: KVAudit, rec: Recorder) -> None:
    """Show the audit what the worker reports received (asynchronous loads)
    and which blocks its loads failed to write, as the engine asks: through
    ``get_transfer_results`` (vLLM 0.32) or ``get_finished`` (before it)."""
    name = "get_transfer_results" if hasattr(conn, "get_transfer_results") else "get_finished"
    orig = getattr(conn, name)

    def transfers(*args: object, **kwargs: object):
        result = orig(*args, **kwargs)
        if rec.active:
            if name == "get_finished":
                recving, failed = (result or (None, None))[1], ()
            else:
                recving, failed = result.finished_recving, result.failed_recving
            rec.guard(f"kv audit ({name})", audit.transferred, recving, failed)
        return result

    orig_errors = conn.get_block_ids_with_load_errors

    def get_block_ids_with_load_errors(*args: object, **kwargs: object):
        result = orig_errors(*args, **kwargs)
        if rec.active:
            rec.guard("kv audit (get_block_ids_with_load_errors)", audit.load_errors, result)
        return result

    setattr(conn, name, transfers)
    conn.get_block_ids_with_load_errors = get_block_ids_with_load_errors


def refusal(sched: Scheduler, worker_conn: KVConnectorBase_V1 | None) -> str | None:
    """Why the audit cannot run for this engine, or None."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    if worker_conn is None:
        return "the connector's worker side is not in this process"
    if getattr(type(worker_conn), "kvtrace_moves_no_data", False):
        return "the connector moves no data"
    try:
        if len(sched.kv_cache_config.kv_cache_groups) != 1:
            return "several KV-cache groups (the audit reads one block table)"
    except AttributeError:
        return "no KV cache config"
    if getattr(sched, "use_eagle", False):
        return "an EAGLE or MTP head"
    if getattr(sched, "num_spec_tokens", 0) and _schedules_ahead(sched):
        return "drafts under asynchronous scheduling"
    return None


def install(sched: Scheduler, rec: Recorder) -> KVAudit | None:
    """Start the audit for the recorder ``rec`` of ``sched`` when it can run:
    wrap the worker-side connector's ``bind_connector_metadata`` and
    ``clear_connector_metadata``. An error in the audit stops recording,
    never the engine."""
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
    audit = KVAudit(rec, sched, worker_conn)
    orig_bind = worker_conn.bind_connector_metadata
    orig_clear = worker_conn.clear_connector_metadata

    def bind_connector_metadata(meta: KVConnectorMetadata, *args: object, **kwargs: object) -> None:
        if rec.active:
            rec.guard("kv audit (bind_connector_metadata)", audit.bind, meta)
        return orig_bind(meta, *args, **kwargs)

    def clear_connector_metadata(*args: object, **kwargs: object) -> None:
        result = orig_clear(*args, **kwargs)
        if rec.active:
            rec.guard("kv audit (clear_connector_metadata)", audit.clear)
        return result

    worker_conn.bind_connector_metadata = bind_connector_metadata
    worker_conn.clear_connector_metadata = clear_connector_metadata
    _watch_transfers(worker_conn, audit, rec)
    logger.info("kvtrace: auditing the KV cache's bytes (%s)", type(worker_conn).__name__)
    return audit
