"""The keyframe codec (kvtrace/snapshot.py): a graph of kvtrace objects as JSON
data and back, with its sharing, and nothing built that is not kvtrace's."""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import orjson
import pytest

from kvtrace import snapshot
from kvtrace.reference.block_pool import BlockPool


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


@dataclass(eq=False)
class Node:
    name: str
    friends: list = field(default_factory=list)
    extra: object = None


class Slotted:
    __slots__ = ("a", "b")


MINE = (*snapshot.OWN, __name__)   # this file's classes may be written too


def _round(root, **kw):
    data = orjson.loads(orjson.dumps(snapshot.encode(root, modules=MINE, **kw)))   # as JSON text
    return data, snapshot.decode(data, modules=MINE,
                                 **{k: v for k, v in kw.items() if k == "externals"})


def test_a_graph_comes_back_with_its_sharing_and_cycles():
    a, b = Node("a"), Node("b")
    a.friends, b.friends = [b], [a]          # a cycle
    s = Slotted()
    s.a, s.b = a, b"\x00\xff"
    root = Node("root", [a, b, a], {"t": (1, "x"), "set": {1, 2}, "fs": frozenset({"f"}),
                                    "q": deque([1, 2], maxlen=5), "enum": Colour.BLUE,
                                    "c": Counter({"k": 2}), "od": OrderedDict(z=1, a=2),
                                    "slots": s, "cls": Node, "keys": {(1, 2): 3, 4: None}})
    _, got = _round(root)
    assert got.friends[0] is got.friends[2]                 # one object, twice
    assert got.friends[0].friends[0] is got.friends[1]
    assert got.friends[1].friends[0] is got.friends[0]      # the cycle
    x = got.extra
    assert x["t"] == (1, "x") and x["set"] == {1, 2} and x["fs"] == frozenset({"f"})
    assert x["q"] == deque([1, 2]) and x["q"].maxlen == 5
    assert x["enum"] is Colour.BLUE and x["cls"] is Node
    assert type(x["c"]) is Counter and x["c"]["k"] == 2
    assert type(x["od"]) is OrderedDict and list(x["od"]) == ["z", "a"]
    assert x["slots"].a is got.friends[0] and x["slots"].b == b"\x00\xff"
    assert x["keys"] == {(1, 2): 3, 4: None}


def test_the_reference_s_outputs_come_back_whole():
    """A scheduler output held between steps (async scheduling) and its
    requests: compiled, these dataclasses write their __init__ out, and their
    __new__ runs it, so they are made whole from their fields."""
    from kvtrace.reference.interface import (ModelOutput, RequestOutput, ScheduledRequest,
                                             SchedulerOutput)

    req = ScheduledRequest("r1", 16, 4, [3, 4], [[7]])
    out = SchedulerOutput([req], [], [ScheduledRequest("r2", 0, 8, [])], {"r1": 4, "r2": 8},
                          {"r3"}, set(), {"r1": [5, -1]})
    root = Node("root", [out, req, RequestOutput("r1", [9], "stop"), ModelOutput({"r1": [9]})])
    _, got = _round(root)
    g_out, g_req, g_ro, g_mo = got.friends
    assert g_out == out and g_req == req and g_out.new[0] is g_req   # the sharing too
    assert g_ro == RequestOutput("r1", [9], "stop") and g_mo == ModelOutput({"r1": [9]})


class MadeWhole:
    """A class whose ``__new__`` runs its ``__init__``, required arguments and
    all, as a compiled dataclass with its __init__ written out does."""

    def __new__(cls, name, parts):
        obj = super().__new__(cls)
        obj.name, obj.parts = name, parts
        return obj

    def __init__(self, name, parts):
        self.name, self.parts = name, parts


def test_an_object_that_cannot_be_made_empty_is_made_from_its_fields():
    leaf = Node("leaf")
    whole = MadeWhole("w", [leaf, (1, 2)])
    _, got = _round(Node("root", [whole, leaf, whole]))
    g_whole, g_leaf, again = got.friends
    assert type(g_whole) is MadeWhole and g_whole is again
    assert g_whole.name == "w" and g_whole.parts == [g_leaf, (1, 2)] and g_whole.parts[0] is g_leaf


def test_externals_are_named_not_written():
    config = object()
    data, got = _round(Node("n", extra=config), externals={"config": config})
    assert got.extra is config
    assert data["objects"][0]["f"]["extra"] == {"ext": "config"}


def test_a_mutable_container_held_twice_is_refused():
    shared = [1, 2]
    with pytest.raises(snapshot.SnapshotError, match="shared by two owners"):
        snapshot.encode(Node("n", [Node("a", shared), Node("b", shared)]), modules=MINE)


def test_a_foreign_object_is_refused_with_where_it_is():
    from pathlib import Path

    with pytest.raises(snapshot.SnapshotError, match=r"pathlib.*\(in .*Node\.extra\)"):
        snapshot.encode(Node("n", extra=Path("/")), modules=MINE)


@pytest.mark.parametrize("name", ["os:system", "subprocess:Popen", "builtins:object"])
def test_decoding_builds_no_class_but_kvtrace_s(name):
    data = {"root": {"r": 0}, "objects": [{"o": name, "f": {}}], "packed": {}}
    with pytest.raises(snapshot.SnapshotError, match="not kvtrace's"):
        snapshot.decode(data)


@pytest.mark.parametrize("data, match", [
    ({"root": {"zz": 1}, "objects": []}, "no known tag"),
    ({"root": {"r": 5}, "objects": []}, "not readable"),
    ({"objects": []}, "no root"),
    ({"root": {"r": 0}, "objects": [{"o": "kvtrace.snapshot:NoSuch", "f": {}}]},
     "does not have"),
    ({"root": {"r": 0}, "objects": [{"o": f"{__name__}:Slotted", "f": {}}]},
     "not kvtrace's"),   # a class of this file: not one a keyframe may name by default
    ({"root": {"r": 0}, "objects": [{"o": "kvtrace.reference.block_pool:Block",
                                     "f": {"zz": 1}}]}, "field 'zz'"),
])
def test_a_damaged_state_is_one_error(data, match):
    with pytest.raises(snapshot.SnapshotError, match=match):
        snapshot.decode(data)


def test_the_pool_packs_into_columns_and_comes_back_whole():
    pool = BlockPool(64, enable_caching=True)
    taken = pool.get_new_blocks(10)
    pool.cache_full_blocks([bytes([i]) * 4 for i in range(10)], taken, 0, 6, 16)
    pool.touch(taken[:2])
    pool.free_blocks(reversed(taken[2:8]))      # some hashed blocks to the tail, in order
    root = Node("tables", [taken[0], taken[9]])
    data = snapshot.encode(root, packed={"pool": (pool, lambda p: (p.columns(), p.blocks))},
                           modules=MINE)
    assert len(orjson.dumps(data["packed"]["pool"])) < 20 * len(pool.blocks)

    def unpack(c):
        p = BlockPool.from_columns(c)
        return p, p.blocks

    got_pool = None

    def keep(c):
        nonlocal got_pool
        got_pool, blocks = unpack(c)
        return got_pool, blocks

    got = snapshot.decode(orjson.loads(orjson.dumps(data)), unpack={"pool": keep}, modules=MINE)
    assert got.friends[0] is got_pool.blocks[taken[0].block_id]
    assert got_pool.free_queue.ids() == pool.free_queue.ids()
    assert [b.ref_cnt for b in got_pool.blocks] == [b.ref_cnt for b in pool.blocks]
    for h in pool.cached:
        assert list(got_pool.cached[h]) == list(pool.cached[h])
        assert got_pool.get_cached_block(h).block_id == pool.get_cached_block(h).block_id
    # the same next allocations, in the same order
    assert ([b.block_id for b in got_pool.get_new_blocks(20)]
            == [b.block_id for b in pool.get_new_blocks(20)])
