"""From captured events to the schema's records, in two halves: ``Resolver``
in the engine's process reads what only it can read (block ids, from the block
lists a snapshot holds; statuses, announced once per status class), and
``Records`` in the writer builds each record by field name.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvtrace.record.capture import RawOutput, RawStep, Snapshot, all_groups, status_name
from kvtrace.trace.events import RequestState, ScheduledNew, ScheduledRunning

_NEW_FIELDS = ScheduledNew.__struct_fields__
_RUNNING_FIELDS = ScheduledRunning.__struct_fields__
_STATE_FIELDS = RequestState.__struct_fields__
_STEP_STATES = RawStep._fields.index("states")
_OUTPUT_STATES = RawOutput._fields.index("states")



class BlockTables:
    """Block ids from the block lists that snapshots hold.

    With one full-attention group, the KV manager's list of a request's blocks only
    grows (``append``/``extend``), or is dropped when the request frees its blocks.
    So the ids are kept per request with the list they were read from: the same
    list at a known length gives ids already read, and a longer one adds only the
    blocks appended since (after checking that its first and last known blocks
    are unchanged). Anything else is read again in full. The id lists handed out
    are never mutated afterwards, since records hold them."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[list, list[int]]] = {}
        self.reads = 0  # lists read from their first block

    def ids(self, rid: str, blocks: Any, n: int) -> list[int]:
        known = self.known.get(rid)
        if known is not None and known[0] is blocks:
            ids = known[1]
            m = len(ids)
            if m == n:
                return ids
            if m > n:
                return ids[:n]
            if m and ids[0] == blocks[0].block_id and ids[-1] == blocks[m - 1].block_id:
                ids = ids + [b.block_id for b in blocks[m:n]]
                self.known[rid] = (blocks, ids)
                return ids
        self.reads += 1
        if not n:
            self.known.pop(rid, None)
            return []
        ids = [b.block_id for b in blocks[:n]]
        self.known[rid] = (blocks, ids)
        return ids

    def forget(self, rids: Any) -> None:
        for rid in rids:
            self.known.pop(rid, None)


class Resolver:
    """In the engine's process: what only it can read. ``RawStep`` and
    ``RawOutput`` become plain tuples tagged ``"step"`` / ``"output"`` with
    block ids in place of block lists. A status class not seen before is
    announced first, as ``("statuses", [[value, schema name], ...])``: statuses
    travel as their enum values. Other events pass unchanged."""

    def __init__(self) -> None:
        self.blocks = BlockTables()
        self._status_classes: set[type] = set()

    def __call__(self, item: Any, out: list) -> None:
        # The event's fields as a plain tuple, its states read (cheaper than
        # _replace; the writer makes the named tuple again from the JSON array).
        t = type(item)
        if t is RawStep:
            states = self._states(item.states, out)
            if item.finished:  # gone from the engine: forget them (after this step's states)
                self.blocks.forget(item.finished)
            out.append(("step", item[:_STEP_STATES] + (states,) + item[_STEP_STATES + 1:]))
        elif t is RawOutput:
            states = self._states(item.states, out)
            out.append(("output", item[:_OUTPUT_STATES] + (states,) + item[_OUTPUT_STATES + 1:]))
        else:
            out.append(item)

    def _states(self, raw: Snapshot, out: list) -> tuple:
        """(counters, block ids): the snapshot with its blocks read."""
        rids, counters, blocks, lengths = raw
        if counters:
            cls = type(counters[0][1])
            if cls not in self._status_classes:
                self._status_classes.add(cls)
                out.append(("statuses", _status_table(cls)))
        if lengths is None:
            return counters, blocks
        known = self.blocks.known
        ids = []
        for rid, b, n in zip(rids, blocks, lengths):
            k = known.get(rid)   # the common case, BlockTables.ids's first, inline
            ids.append(k[1] if k is not None and k[0] is b and len(k[1]) == n
                       else self.blocks.ids(rid, b, n))
        return counters, ids


def _status_table(cls: type) -> list:
    try:
        table = [[m.value, status_name(m.name)] for m in cls]  # vLLM's RequestStatus (an IntEnum)
        orjson.dumps(table)
        return table
    except Exception:
        return []


# --------------------------------------------------------------------------- records (writer)


class Records:
    """What ``TraceWriter.write`` serializes for each resolved item: a
    ``("step", RawStep)`` or ``("output", RawOutput)`` pair (or the lists JSON
    made of it, read back into the named tuple) becomes a dict with the
    schema's field names and order; events, or the dicts JSON made of them, get
    their sequence number from ``next_seq``. Returns None for the
    ``"statuses"`` announcement, which takes no sequence number."""

    def __init__(self) -> None:
        self.statuses: dict[Any, str] = {}

    def __call__(self, item: Any, next_seq) -> Any:
        if type(item) is dict:
            item["seq"] = next_seq()
            return item
        if type(item) not in (tuple, list):
            item.seq = next_seq()
            return item
        tag = item[0]
        if tag == "step":
            return self.step(RawStep(*item[1]), next_seq())
        if tag == "output":
            return self.output(RawOutput(*item[1]), next_seq())
        if tag == "statuses":
            self.statuses.update({value: name for value, name in item[1]})
            return None
        raise ValueError(f"unknown item {tag!r}")

    def states(self, raw: Any) -> list[dict]:
        counters, ids = raw
        names = self.statuses
        return [_grouped(dict(zip(_STATE_FIELDS, (rid, names.get(st) or _unknown_status(st),
                                                  c, t, p, b))), "block_ids")
                for (rid, st, c, t, p), b in zip(counters, ids)]

    def step(self, s: RawStep, seq: int) -> dict:
        rids, ncts, nbis, nst = s.running
        d = {"seq": seq, "step": s.step,
             "new": [_grouped(dict(zip(_NEW_FIELDS, t)), "block_ids") for t in s.new],
             "resumed": [_grouped(dict(zip(_NEW_FIELDS, t)), "block_ids") for t in s.resumed],
             "running": [_grouped(dict(zip(_RUNNING_FIELDS,
                                           (rid, c, nst.get(rid, 0), all_groups(nb)))),
                                  "new_block_ids")
                         for rid, c, nb in zip(rids, ncts, nbis)],
             "preempted": s.preempted, "finished": s.finished, "lookups": s.lookups,
             "loads": s.loads, "states": self.states(s.states),
             "num_free_blocks": s.num_free_blocks, "kind": "step"}
        if s.rare:   # the rare fields go last, and only when they hold something
            d.update(s.rare)
        return d

    def output(self, o: RawOutput, seq: int) -> dict:
        rids, toks, index = o.sampled
        sampled = {}
        if toks:
            n = len(toks)
            for rid in rids:
                i = index.get(rid)
                if i is not None and i < n and len(toks[i]):
                    sampled[rid] = toks[i]
        d = {"seq": seq, "step": o.step, "sampled": sampled, "connector": o.connector,
             "finished": o.finished, "states": self.states(o.states), "kind": "output"}
        if o.rare:
            d.update(o.rare)
        return d


def _grouped(d: dict, key: str) -> dict:
    """``d`` with ``d[key]`` split as the schema has it: group 0's ids under
    ``key`` and, with several KV-cache groups, the others' under ``more_groups``
    (left out when they are all empty)."""
    ids = d[key]
    if ids and type(ids[0]) is list:
        d[key] = ids[0]
        if any(ids[1:]):
            d["more_groups"] = ids[1:]
    return d


def _unknown_status(st: Any) -> str:
    return status_name(getattr(st, "name", str(st)))
