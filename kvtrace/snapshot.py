"""A keyframe's state: a graph of kvtrace objects as plain JSON data, and back.

A scheduler's state is a graph: a request sits in a queue, in a set of
prefills and in the running list at once; a block is in the free queue's
linked list, in the prefix-cache map and in request tables. ``encode`` writes
every kvtrace object once, in a table, and refers to it by its index
wherever it occurs, so the graph comes back with the same sharing (and no
recursion follows a linked list). Containers are written inline:

    object      {"o": "module:Class", "f": {field: value}}  (in "objects")
    reference   {"r": index}
    tuple, set, frozenset, deque      {"t": [...]}, {"s": [...]}, {"fs": [...]},
                {"q": [...]}
    dict        {"d": [[key, value], ...]}  (insertion order kept)
    bytes       {"x": "hex"}
    enum        {"e": "module:Class", "v": "NAME"}
    class       {"c": "module:Class"}
    external    {"ext": "name"}  (an object the caller supplies again on decode)

Lists, strings, numbers, booleans and None are themselves. Only classes of
kvtrace's own modules and a few of the standard library's containers are
named, and decoding builds no other class: a keyframe is data, never code.
A mutable container held by two objects would come back as two; ``encode``
refuses that rather than lose the sharing.
"""

from __future__ import annotations

import enum
import importlib
from collections import Counter, OrderedDict, deque
from typing import Any, Callable

import msgspec

__all__ = ["SnapshotError", "encode", "decode"]

OWN = ("kvtrace.",)   # the modules whose classes a keyframe may name
_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)   # exactly these: an IntEnum member is an int, and is not plain
_DICT_TAGS: dict[type, dict] = {Counter: {"C": 1}, OrderedDict: {"O": 1}}


class SnapshotError(ValueError):
    """A state that cannot be written, or a keyframe that cannot be read."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _fields(obj: object) -> dict[str, Any]:
    names = _field_names.get(type(obj))
    if names is None:
        names = _field_names[type(obj)] = _names_of(type(obj))
    out = {}
    for name in names:
        v = getattr(obj, name, _UNSET)
        if v is not _UNSET:   # a slot never set
            out[name] = v
    d = getattr(obj, "__dict__", None)
    if d:
        out.update(d)
    return out


_field_names: dict[type, tuple[str, ...]] = {}
_UNSET = object()


def _names_of(cls: type) -> tuple[str, ...]:
    """The fields a ``cls`` object may hold beside its ``__dict__``: a msgspec
    Struct's, then its classes' slots."""
    names: list[str] = []
    struct_fields = getattr(cls, "__struct_fields__", ())
    if isinstance(struct_fields, tuple):
        names.extend(struct_fields)
    for klass in cls.__mro__:
        # A class compiled with mypyc (kvtrace/compile.py) names its fields in
        # __mypyc_attrs__ (its own and its bases'), one that is not in __slots__.
        slots = klass.__dict__.get("__mypyc_attrs__", klass.__dict__.get("__slots__", ()))
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in names and not name.startswith("__"):
                names.append(name)
    return tuple(names)


def _all_plain(items) -> bool:
    """Whether every item is a str, int, float, bool or None (no subclass)."""
    return set(map(type, items)) <= _PLAIN_TYPES


class _Encoder:
    def __init__(self, externals: dict[int, str], skip: dict[type, frozenset[str]],
                 packed: dict[str, tuple[object, Callable]], modules: tuple[str, ...]):
        self.externals = externals
        self.modules = modules
        # A packed object is written as its own plain data; it and its members
        # are referred to by name ({"p": name}) and place ({"m": [name, i]}).
        self.packed: dict[str, Any] = {}
        self.aliases: dict[int, dict] = {}
        self.members: dict[str, dict[int, int]] = {}   # name -> id of a member -> its place
        for name, (obj, pack) in packed.items():
            data, members = pack(obj)
            self.packed[name] = data
            self.aliases[id(obj)] = {"p": name}
            self.members[name] = {id(m): i for i, m in enumerate(members)}
        # What an external, a packed object or a member is written as, by id.
        self.named: dict[int, dict] = {}
        for name, places in self.members.items():
            self.named.update((i, {"m": [name, at]}) for i, at in places.items())
        self.named.update(self.aliases)
        self.named.update((i, {"ext": name}) for i, name in externals.items())
        self.class_names: dict[type, str] = {}
        self.skip = skip
        self.index: dict[int, int] = {}
        self.objects: list[dict | None] = []
        self.pending: list[object] = []
        self.seen: set[int] = set()   # containers written, to refuse sharing

    def ref(self, obj: object) -> dict:
        i = self.index.get(id(obj))
        if i is None:
            i = self.index[id(obj)] = len(self.objects)
            self.objects.append(None)
            self.pending.append(obj)
        return {"r": i}

    def value(self, v: Any) -> Any:
        t = type(v)
        if t in _PLAIN_TYPES or isinstance(v, _PLAIN) and not isinstance(v, enum.Enum):
            return v
        named = self.named.get(id(v))
        if named is not None:
            return named
        if t is list:
            self._own(v)
            kinds = set(map(type, v))
            if kinds <= _PLAIN_TYPES:   # token ids: the bulk of a keyframe, copied at C speed
                return list(v)
            if kinds == {bytes}:   # block hashes
                return [{"x": x.hex()} for x in v]
            return [self.value(x) for x in v]
        if t is dict or t is Counter or t is OrderedDict:
            self._own(v)
            return {"d": [[self.value(k), self.value(x)] for k, x in v.items()],
                    **_DICT_TAGS.get(t, {})}
        if t is tuple:
            return {"t": list(v) if _all_plain(v) else [self.value(x) for x in v]}
        if t is set or t is frozenset:
            if t is set:
                self._own(v)
            return {"s" if t is set else "fs": [self.value(x) for x in _ordered(v)]}
        if t is deque:
            self._own(v)
            return {"q": [self.value(x) for x in v], **({"m": v.maxlen} if v.maxlen else {})}
        if t is bytes:
            return {"x": v.hex()}
        if isinstance(v, enum.Enum):
            return {"e": self._class(t), "v": v.name}
        if isinstance(v, type):
            return {"c": self._class(v)}
        if t.__module__.startswith(self.modules):
            return self.ref(v)
        raise SnapshotError(f"cannot write a {_name(t)} into a keyframe")

    def _own(self, c: object) -> None:
        if id(c) in self.seen:
            raise SnapshotError(f"a {type(c).__name__} is shared by two owners")
        self.seen.add(id(c))

    def _class(self, cls: type) -> str:
        name = self.class_names.get(cls)
        if name is None:
            if not cls.__module__.startswith(self.modules):
                raise SnapshotError(f"cannot name {_name(cls)} in a keyframe")
            name = self.class_names[cls] = _name(cls)
        return name

    def run(self, root: object) -> dict:
        top = self.value(root)
        while self.pending:
            obj = self.pending.pop()
            skip = self.skip.get(type(obj), frozenset())
            fields = {}
            for k, v in _fields(obj).items():
                if k in skip:
                    continue
                if type(v) in _PLAIN_TYPES:   # most fields: no call
                    fields[k] = v
                    continue
                try:
                    fields[k] = self.value(v)
                except SnapshotError as e:
                    if " (in " in str(e):
                        raise
                    raise SnapshotError(f"{e} (in {_name(type(obj))}.{k})") from None
            self.objects[self.index[id(obj)]] = {"o": self._class(type(obj)), "f": fields}
        return {"root": top, "objects": self.objects, "packed": self.packed}


def encode(root: object, externals: dict[str, object] | None = None,
           skip: dict[type, frozenset[str]] | None = None,
           packed: dict[str, tuple[object, Callable]] | None = None,
           modules: tuple[str, ...] = OWN) -> dict:
    """``root``'s graph as JSON data. ``externals`` names objects written as a
    name only (a config the reader makes again); ``skip`` leaves fields of a
    class out. ``packed`` names objects that pack themselves: name -> (object,
    pack), where ``pack(object)`` gives (plain data, members): the members are
    objects it holds that others refer to (a pool's blocks). ``modules``: the
    modules whose objects are written (kvtrace's)."""
    ext = {id(v): k for k, v in (externals or {}).items()}
    return _Encoder(ext, skip or {}, packed or {}, modules).run(root)


def _mine(module: str, modules: tuple[str, ...]) -> bool:
    return module.startswith(modules) or module + "." in modules


def _resolve(name: object, modules: tuple[str, ...]) -> Any:
    """The class ``module:Qualname`` names: one defined in one of
    ``modules`` (never one a kvtrace module merely imports, nor a builtin
    reached through an attribute), and only through class names."""
    if type(name) is not str:
        raise SnapshotError(f"a keyframe names a class by {str(name)[:40]!r}, not a string")
    module, _, qual = name.partition(":")
    if not _mine(module, modules):
        raise SnapshotError(f"a keyframe names {name[:80]}, which is not kvtrace's")
    parts = qual.split(".")
    if not qual or any(not p.isidentifier() or p.startswith("__") for p in parts):
        raise SnapshotError(f"a keyframe names {name[:80]}, which is not a class of kvtrace's")
    try:
        obj: Any = importlib.import_module(module)
        for part in parts:
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        raise SnapshotError(f"a keyframe names {name[:80]}, which this kvtrace does not have") from None
    if (not isinstance(obj, type) or not _mine(obj.__module__, modules)
            or obj.__qualname__ != qual):
        raise SnapshotError(f"a keyframe names {name[:80]}, which is not a class of kvtrace's")
    return obj


def _empty(cls: type) -> object | None:
    """An empty object of ``cls`` to fill in, or None where it is made whole
    from its fields: a msgspec Struct, or a compiled dataclass whose
    ``__init__`` is written out (reference/interface.py), whose ``__new__``
    runs that ``__init__``, required arguments and all."""
    if issubclass(cls, msgspec.Struct):
        return None
    try:
        return cls.__new__(cls)
    except TypeError:
        return None


class _Decoder:
    def __init__(self, data: dict, externals: dict[str, object],
                 unpack: dict[str, Callable], modules: tuple[str, ...]):
        self.modules = modules
        try:
            self.table = data["objects"]
            self.root = data["root"]
            packed = data.get("packed") or {}
        except (TypeError, KeyError, AttributeError):
            raise SnapshotError("a keyframe's state has no root or objects") from None
        self.externals = externals
        self.packed: dict[str, tuple[object, list]] = {}
        for name, pdata in packed.items():
            if name not in unpack:
                raise SnapshotError(f"a keyframe packs {name!r}, which this kvtrace cannot read")
            try:
                self.packed[name] = unpack[name](pdata)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise SnapshotError(f"a keyframe's {name} is not readable: {e}") from None
        self.made: list[object] = []

    def value(self, v: Any) -> Any:
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict):
            return v
        try:
            if "r" in v:
                if type(v["r"]) is not int or v["r"] < 0:
                    raise IndexError("a reference that is not an index")
                made = self.made[v["r"]]
                return made if made is not None else self._struct(v["r"])
            if "d" in v:
                items = {self.value(k): self.value(x) for k, x in v["d"]}
                return (Counter(items) if v.get("C") else
                        OrderedDict(items) if v.get("O") else items)
            if "t" in v:
                return tuple(self.value(x) for x in v["t"])
            if "s" in v:
                return {self.value(x) for x in v["s"]}
            if "fs" in v:
                return frozenset(self.value(x) for x in v["fs"])
            if "q" in v:
                return deque((self.value(x) for x in v["q"]), v.get("m"))
            if "x" in v:
                return bytes.fromhex(v["x"])
            if "e" in v:
                return _resolve(v["e"], self.modules)[v["v"]]
            if "c" in v:
                return _resolve(v["c"], self.modules)
            if "ext" in v:
                return self.externals[v["ext"]]
            if "p" in v:
                return self.packed[v["p"]][0]
            if "m" in v:
                name, i = v["m"]
                if type(i) is not int or i < 0:
                    raise IndexError("a member that is not an index")
                return self.packed[name][1][i]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SnapshotError(f"a keyframe's value {str(v)[:60]} is not readable: {e}") from None
        raise SnapshotError(f"a keyframe's value {str(v)[:60]} has no known tag")

    def run(self) -> object:
        self.classes = [_resolve(entry["o"], self.modules) for entry in self.table]
        # Objects first, empty, so that references among them resolve; a
        # msgspec Struct, or an object that cannot be made empty, is made whole
        # when first referred to (it holds no cycle).
        self.made = [_empty(cls) for cls in self.classes]
        whole = [m is None for m in self.made]
        for i, (cls, entry) in enumerate(zip(self.classes, self.table)):
            if whole[i]:
                if self.made[i] is None:
                    self._struct(i)
                continue
            for k, v in entry["f"].items():
                try:
                    object.__setattr__(self.made[i], k, self.value(v))
                except AttributeError:
                    raise SnapshotError(f"a keyframe gives {_name(cls)} a field {k!r} "
                                        "it does not have") from None
        return self.value(self.root)

    def _struct(self, i: int) -> object:
        cls = self.classes[i]
        try:
            self.made[i] = cls(**{k: self.value(v) for k, v in self.table[i]["f"].items()})
        except TypeError as e:
            raise SnapshotError(f"a keyframe's {_name(cls)} is not readable: {e}") from None
        return self.made[i]


def decode(data: dict, externals: dict[str, object] | None = None,
           unpack: dict[str, Callable] | None = None, modules: tuple[str, ...] = OWN) -> object:
    """The graph ``encode`` wrote, with each external name replaced by the
    object given for it; ``unpack[name](data)`` gives (object, members) back
    for each packed object. Any damage is a SnapshotError."""
    try:
        return _Decoder(data, externals or {}, unpack or {}, modules).run()
    except SnapshotError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError,
            MemoryError, RecursionError) as e:
        raise SnapshotError(f"a keyframe's state is damaged: {type(e).__name__}: "
                            f"{str(e)[:80]}") from None


def _ordered(items) -> list:
    """A set's items in an order that does not depend on string hashing (which
    changes from process to process), so the same state gives the same
    keyframe; as they come when they do not compare (objects)."""
    try:
        return sorted(items)
    except TypeError:
        return list(items)
