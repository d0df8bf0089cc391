"""The data-path checks: what the KV audit's digests of real block bytes
(``kv_audit`` records) say about the bytes behind the scheduler's counts.

Rules (docs/reference/checks.md, "The KV data path"):

* D1: every external hit the scheduler admitted is loaded into the blocks the
  request reads, before the step that reads them. Flagged: a block the
  scheduler admitted as an external hit whose bytes the step did not change
  and that holds neither bytes saved for its block hash nor the bytes it was
  last filled or loaded with for that hash.
* D2: a block loaded for a block hash holds bytes that were saved for that
  hash (bit-exact: a connector copies bytes). Flagged: a load that changed the
  block to bytes no save of the hash had. Not checked where no save of the
  hash was seen (a black-box connector, or a store filled before the trace).
* D3: a block served as a local prefix hit holds the bytes it was last filled
  or loaded with (nothing overwrote it since), for the hash it is served as.

No comparison is made across recomputation: KV computed twice for the same
tokens, in different batches, need not be bit-identical. Loaded bytes are
compared with saved bytes (copies), and a block's bytes with that same
block's earlier bytes; never two computations with each other.

Within a step: loads, then saves, then filled blocks, then hits (a step's
hit may be a block it filled, or one its loads wrote over).
"""

from __future__ import annotations

from collections import Counter

from kvtrace.findings import Divergence
from kvtrace.trace import events as ev

D1 = "D1: an external hit the scheduler admits is loaded into the request's blocks before it reads them"
D2 = "D2: a block loaded for a block hash holds the bytes saved for that hash"
D3 = "D3: a block served as a prefix hit holds the bytes it was filled or loaded with"


WRONG = "loaded wrongly"   # how a block came to hold bytes that a load flagged here wrote


class _Shard:
    """What one shard of the KV cache (one tensor-parallel rank's heads)
    saved and holds."""

    __slots__ = ("saved", "held")

    def __init__(self) -> None:
        self.saved: dict[str, set[int]] = {}   # block hash -> digests saved for it
        # block id -> (block hash, digest, step, how) as it was last filled or loaded
        self.held: dict[int, tuple[str, int, int, str]] = {}


class DataPath:
    """Feed it a trace's ``kv_audit`` records in order; it collects divergences
    and counts what it checked. Each tensor-parallel rank's records (``rank``)
    are judged against that rank's own saves and bytes: a rank holds other
    heads, so other bytes. Likewise each KV-cache group's (``group``): its
    blocks hold its own layers' bytes, and its block hashes are its own."""

    def __init__(self) -> None:
        self.shards: dict[tuple[int | None, int | None], _Shard] = {}   # (rank, group)
        self.checked: Counter = Counter()
        self.divergences: list[Divergence] = []
        self.audit: dict | None = None   # check_file's summary

    def _shard(self, e: ev.KVAudit) -> tuple[_Shard, str]:
        """The shard of the KV cache ``e``'s blocks are in, with ``e``
        counted; and how a row names it ("" with one rank and one group)."""
        shard = self.shards.get((e.rank, e.group))
        if shard is None:
            shard = self.shards[(e.rank, e.group)] = _Shard()
        if e.rank is not None:
            self.checked[f"rank {e.rank} records"] += 1
        if e.group is not None:
            self.checked[f"group {e.group} records"] += 1
        if e.stopped is not None:
            who = "" if e.rank is None else f"rank {e.rank} "
            self.checked[f"stopped: {who}at step {e.step} ({e.stopped})"] += 1
        return shard, "".join(f" of {name} {v}" for name, v in (("group", e.group),
                                                                 ("rank", e.rank))
                              if v is not None)

    def feed(self, e: ev.KVAudit, line: int | None = None) -> list[Divergence]:
        found = []
        shard, of = self._shard(e)
        for req, block, h, before, after, asked, _ in e.loaded:
            saved = shard.saved.get(h)
            held = shard.held.get(block)
            flagged = len(found)
            if not h:
                judged = False
            elif (saved is not None and after in saved) or (
                    held is not None and held[:2] == (h, after) and held[3] != WRONG):
                judged = True   # the saved bytes, or those it rightly held for the hash
            elif asked and before == after:
                judged = True
                found.append(Divergence(
                    e.step, req, "kv-load", f"block {block}{of} not loaded (its bytes did not change)",
                    f"the bytes saved for block hash {h}", D1, "kv-data", e.seq, line))
            elif saved is not None:
                judged = True
                found.append(Divergence(
                    e.step, req, "kv-load", f"block {block}{of} loaded with other bytes",
                    f"the bytes saved for block hash {h} "
                    f"({len(saved)} {'save' if len(saved) == 1 else 'saves'})",
                    D2, "kv-data", e.seq, line))
            else:
                judged = False   # bytes changed, and no save of the hash was seen
            self.checked["loads" if judged else "unchecked loads"] += 1
            # A load flagged here leaves bytes that are no proof of the hash:
            # loading them again is judged again. A load of no known hash
            # leaves nothing to compare a later hit with.
            if h:
                shard.held[block] = (h, after, e.step, "loaded" if len(found) == flagged else WRONG)
            else:
                shard.held.pop(block, None)
        for _, block, h, d in e.saved:
            shard.saved.setdefault(h, set()).add(d)
            self.checked["saves"] += 1
        for _, block, h, d in e.cached:
            if h:
                shard.held[block] = (h, d, e.step, "filled")
                self.checked["filled"] += 1
            else:   # filled with no hash known yet: nothing to compare it with later
                shard.held.pop(block, None)
        for req, block, h, d in e.hits:
            held = shard.held.get(block)
            if held is None:   # nothing seen of this block: nothing to compare with
                self.checked["unchecked hits"] += 1
                continue
            self.checked["hits"] += 1
            if held[0] != h:
                found.append(Divergence(
                    e.step, req, "kv-hit", f"block {block}{of} holds block hash {held[0]} "
                    f"({held[3]} at step {held[2]})", f"block hash {h}", D3, "kv-data", e.seq, line))
            elif held[1] != d:
                found.append(Divergence(
                    e.step, req, "kv-hit", f"block {block}{of} overwritten since step {held[2]}",
                    f"the bytes {held[3]} at step {held[2]}", D3, "kv-data", e.seq, line))
        self.divergences.extend(found)
        return found


def summary(checked: Counter, header: ev.Header) -> dict | None:
    """What the checks checked, as a replay's result says it; None without
    a KV audit. With tensor parallelism, the engine's number of ranks too
    (``tensor_parallel_size``), beside each rank's records (``rank R
    records``): a rank that sent none shows; likewise the KV-cache groups
    (``kv_cache_groups``, ``group G records``)."""
    out = dict(checked)
    tp = header.features.tensor_parallel_size
    if out and tp is not None and tp > 1:
        out["tensor_parallel_size"] = tp
    groups = header.features.kv_cache_groups or ()
    if any(k.startswith("group ") for k in out) and len(groups) > 1:
        out["kv_cache_groups"] = len(groups)
    return out or None


def check_file(path) -> DataPath:
    """The data-path checks alone, over every ``kv_audit`` record of the trace
    at ``path`` (for a replay that runs another scheduler); its ``audit``
    says what they checked (``summary``)."""
    from kvtrace.trace import TraceReader

    dp = DataPath()
    with TraceReader(path) as reader:
        for e in reader:
            if type(e) is ev.KVAudit:
                dp.feed(e, reader.last_line)
        dp.audit = summary(dp.checked, reader.header)
    return dp

