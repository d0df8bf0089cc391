"""The KV audit's worker side: digests of one worker's shard of the KV cache.

Every worker that holds a KV cache (one, or one per tensor-parallel rank,
each in a process of its own) wraps its connector's worker side with a
``ShardAudit``. The step's plan comes with the step: the engine core's
audit (``kv_audit.KVAudit.plan``) hangs it on the connector's metadata, as
the attribute ``kvtrace_audit_plan``, and the metadata reaches every worker
with the ``SchedulerOutput``. The plan is made of builtins only (lists,
tuples, strings, integers), so a worker without kvtrace unpickles it like
any other metadata, and ignores it.

* ``bind_connector_metadata``: before the step's loads, the digests of the
  blocks they write (and of the blocks of asynchronous loads issued now);
* ``get_transfer_results``/``get_finished``, ``get_block_ids_with_load_errors``:
  what this worker reports received, failed, or not written;
* ``clear_connector_metadata``: after the forward pass, the loads and the
  saves, every digest of the step, in one batch; the ``kv_audit`` record
  goes to the trace (``kv_channel.deliver``).

With tensor parallelism each record names its worker's rank (``rank``):
each rank holds its own heads, so each has its own bytes, its own saves
and its own loads, judged apart at replay.

An error here stops this worker's audit (logged), never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtrace.record.vllm import kv_channel
from kvtrace.record.vllm.kv_digest import BlockDigests, kv_layers
from kvtrace.trace.events import KVAudit as KVAuditEvent

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata)

logger = logging.getLogger("kvtrace.record")

ENV = "KVTRACE_KV_AUDIT"   # "0": off; "1" or unset: on wherever it can run
PLAN_ATTR = "kvtrace_audit_plan"
_WATCHED = "_kvtrace_shard_audit"


def tensor_parallel_rank() -> int | None:
    """This worker's tensor-parallel rank; None with one rank."""
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        if get_tensor_model_parallel_world_size() > 1:
            return int(get_tensor_model_parallel_rank())
    except Exception:   # no parallel state (a model-free engine, a test)
        pass
    return None


class ShardAudit:
    """One worker's audit (see the module doc)."""

    def __init__(self, conn: KVConnectorBase_V1) -> None:
        self.conn = conn
        # The digests of each KV-cache group's layers (None: every layer's).
        self.digesters: dict[tuple[str, ...] | None, BlockDigests] = {}
        self.off = False
        self.rank: int | None = None
        self._bound: dict | None = None
        self._last: tuple[str, int] | None = None   # the channel and step of the last plan
        self._before: dict[tuple[int | None, int], int] = {}   # (group, block) -> digest
        # Asynchronous loads issued and not yet received: (group, request) ->
        # [(block, hash, its digest when the load was issued)].
        self._pending: dict[tuple[int | None, str], list[tuple[int, str, int]]] = {}
        self._recving: set[str] = set()    # the step's transfer results: received
        self._failed: set[str] = set()     # and failed
        self._invalid: set[int] = set()    # blocks the step's loads failed to write

    def _digester(self, layers: list[str] | None, num_blocks: int) -> BlockDigests:
        key = tuple(layers) if layers is not None else None
        d = self.digesters.get(key)
        if d is None:
            found = kv_layers(self.conn, layers)
            if not found:
                raise ValueError("no layer holds a KV cache tensor")
            d = self.digesters[key] = BlockDigests(found, num_blocks)
        return d

    def stop(self, exc: BaseException) -> None:
        """Stop this worker's audit: the log says why, and so does the
        trace, in a last record, where the plan named a channel."""
        if not self.off:
            logger.warning("kvtrace: no KV audit on this worker from here (%s: %s)",
                           type(exc).__name__, exc)
            if self._last is not None:
                to, step = self._last
                kv_channel.deliver(to, self.rank, KVAuditEvent(
                    seq=0, step=step, rank=self.rank,
                    stopped=f"{type(exc).__name__}: {exc}"[:500]))
        self.off = True
        self._bound = None

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Before the step's loads: the digests of the blocks they write."""
        plan = getattr(meta, PLAN_ATTR, None)
        self._bound = None
        if type(plan) is not dict:
            return
        if self._last is None:   # the first plan: the parallel state is up
            self.rank = tensor_parallel_rank()
        self._last = (plan["to"], plan["step"])
        self._before = {}
        for gp in plan["groups"]:
            g = gp["group"]
            digests = self._digester(gp["layers"], plan["num_blocks"])
            targets = [t[1] for t in gp["targets"]]
            if targets:
                self._before.update(((g, b), d) for b, d in zip(targets, digests(targets)))
            issued = gp["issued"]
            if issued:   # before the worker starts them
                for (req, b, h), d in zip(issued, digests([t[1] for t in issued])):
                    self._pending.setdefault((g, req), []).append((b, h, d))
        self._bound = plan

    def transferred(self, recving: Iterable[str] | None, failed: Iterable[str] | None) -> None:
        """The worker's transfer results of the step (before ``clear``)."""
        self._recving, self._failed = set(recving or ()), set(failed or ())

    def load_errors(self, blocks: Iterable[int] | None) -> None:
        """The blocks the step's loads failed to write (before ``clear``)."""
        self._invalid = set(blocks or ())

    def _received(self, groups: list) -> dict:
        """group -> (req, block, hash, digest before) of the asynchronous
        loads the step's worker reports received: a failed one, or a block
        its loads failed to write, is left to the scheduler's recovery, not
        judged."""
        recving, failed, invalid = self._recving, self._failed, self._invalid
        self._recving, self._failed, self._invalid = set(), set(), set()
        for g in groups:
            for req in failed:
                self._pending.pop((g, req), None)
        return {g: [(req, b, h, before) for req in recving - failed
                    for b, h, before in self._pending.pop((g, req), ()) if b not in invalid]
                for g in groups}

    def clear(self) -> None:
        p, self._bound = self._bound, None
        if p is None:
            return
        received = self._received([gp["group"] for gp in p["groups"]])
        for gp in p["groups"]:
            self._clear_group(p, gp, received[gp["group"]])

    def _clear_group(self, p: dict, gp: dict, received: list) -> None:
        g = gp["group"]
        groups = (gp["targets"], received, gp["saves"], gp["cached"], gp["hits"])
        flat = [e[1] for grp in groups for e in grp]
        if not flat:
            return
        got = iter(self._digester(gp["layers"], p["num_blocks"])(flat))
        metadata = gp["view"] == "metadata"
        loaded = []
        for req, b, h, asked, said in gp["targets"]:
            after = next(got)
            before = self._before[(g, b)]
            loaded.append((req, b, h, before, after, asked, said if metadata else after != before))
        for req, b, h, before in received:   # asked, in the step that reported it received
            after = next(got)
            loaded.append((req, b, h, before, after, True, after != before))
        saved = [(r, b, h, next(got)) for r, b, h in gp["saves"]]
        cached = [(r, b, h, next(got)) for r, b, h in gp["cached"]]
        hits = [(r, b, h, next(got)) for r, b, h in gp["hits"]]
        kv_channel.deliver(p["to"], self.rank, KVAuditEvent(
            seq=0, step=p["step"], view=gp["view"], rank=self.rank, group=g, loaded=loaded,
            saved=saved, cached=cached, hits=hits))


def shard_audit(conn: Any) -> ShardAudit | None:
    """The ``ShardAudit`` that watches ``conn``, if one does."""
    return getattr(conn, _WATCHED, None)


def watch(conn: KVConnectorBase_V1) -> ShardAudit:
    """Wrap the worker-side connector ``conn`` (once): its metadata's plans
    are digested from here. A connector given no plan runs as it was."""
    got = shard_audit(conn)
    if got is not None:
        return got
    audit = ShardAudit(conn)

    def guarded(fn, *args: object) -> None:
        if audit.off:
            return
        try:
            fn(*args)
        except Exception as e:
            audit.stop(e)

    orig_bind = conn.bind_connector_metadata
    orig_clear = conn.clear_connector_metadata

    def bind_connector_metadata(meta: KVConnectorMetadata, *args: object, **kwargs: object):
        guarded(audit.bind, meta)
        return orig_bind(meta, *args, **kwargs)

    def clear_connector_metadata(*args: object, **kwargs: object):
        result = orig_clear(*args, **kwargs)
        guarded(audit.clear)
        return result

    # Asynchronous loads: what the worker reports received, as the engine
    # asks: through get_transfer_results (vLLM 0.32) or get_finished (before).
    name = "get_transfer_results" if hasattr(conn, "get_transfer_results") else "get_finished"
    orig_transfers = getattr(conn, name)

    def transfers(*args: object, **kwargs: object):
        result = orig_transfers(*args, **kwargs)
        if name == "get_finished":
            guarded(audit.transferred, (result or (None, None))[1], ())
        else:
            guarded(audit.transferred, result.finished_recving, result.failed_recving)
        return result

    orig_errors = conn.get_block_ids_with_load_errors

    def get_block_ids_with_load_errors(*args: object, **kwargs: object):
        result = orig_errors(*args, **kwargs)
        guarded(audit.load_errors, result)
        return result

    conn.bind_connector_metadata = bind_connector_metadata
    conn.clear_connector_metadata = clear_connector_metadata
    setattr(conn, name, transfers)
    conn.get_block_ids_with_load_errors = get_block_ids_with_load_errors
    setattr(conn, _WATCHED, audit)
    return audit


def install_factory_hook() -> bool:
    """Watch every worker-side connector vLLM's factory makes in this
    process (a worker of a multi-process executor makes its own). Returns
    False if already done."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    orig = KVConnectorFactory.__dict__["create_connector"]
    fn = orig.__func__ if isinstance(orig, classmethod) else orig
    if getattr(fn, _WATCHED, False):
        return False

    def create_connector(cls: type, *args: object, **kwargs: object):
        conn = fn(cls, *args, **kwargs)
        role = kwargs.get("role", args[1] if len(args) > 1 else None)
        if role == KVConnectorRole.WORKER and _audits(conn):
            try:
                watch(conn)
            except Exception:
                logger.exception("kvtrace: could not watch the connector's worker side; "
                                 "no KV audit on this worker")
        return conn

    setattr(create_connector, _WATCHED, True)
    create_connector.__wrapped__ = fn  # type: ignore[attr-defined]
    KVConnectorFactory.create_connector = classmethod(create_connector)
    return True


def _audits(conn: object) -> bool:
    import os

    return (os.environ.get(ENV, "1").strip() != "0"
            and not getattr(type(conn), "kvtrace_moves_no_data", False))
