"""Record the calls a scheduler makes on an object it holds, at its call sites,
without touching the object.

The recorder needs the connector's answers (``get_num_new_matched_tokens``,
``update_state_after_alloc``) and the grammar's (``accept_tokens``), which
only the call returns. Replacing those methods on the connector would change
what the engine and its callers see: the connector would hold plain functions
where its class has methods, and a ``unittest.mock`` connector would lose its
``call_count``. So the connector is never touched. The recording scheduler
holds it as vLLM does, and reads it through ``held``, a property of the
recording class:

* anywhere but at a recorded call site, ``scheduler.connector`` is the very
  object stored (identity, attributes, ``isinstance``, mocks and all);
* at a call site, the expression ``self.connector.get_num_new_matched_tokens``
  of the scheduler's own code, it is a view (``make_view(obj, recorder)``,
  kept while the object and the recorder stay the same) whose method of that
  name calls the object's own method, records its answer and returns it.
  Nothing else ever sees the view: the method is looked up on it and called
  at once.

A call site is found in the bytecode: the load of the attribute followed by
the load of a recorded method (``sites``). The property tells one from any
other read of the attribute by the frame that reads it and the instruction
it is at (``f_lasti``). Each code object is scanned once, the first time it
reads the attribute. A connector assigned after the scheduler was built, or
replaced between steps, is recorded from then on, as the scheduler reads it.
A call through a name the connector was copied to (``c = self.connector``,
then ``c.get_num_new_matched_tokens(...)``) is not seen; vLLM makes none.

``check()`` proves the mechanism on the running Python before a recording
class is built; if it fails there, the scheduler is not recorded (and says
so) rather than recorded without its connector's answers.
"""

from __future__ import annotations

import dis
import inspect
import sys
from types import CodeType
from typing import Any, Callable

_MISSING = object()
_ATTR_OPS = ("LOAD_ATTR", "LOAD_METHOD")


def sites(code: CodeType, attr: str, methods: set[str] | frozenset[str]) -> frozenset[int]:
    """The call sites of ``code`` (not of the code nested in it): each bytecode
    offset at which the load of ``attr`` may run when the next instruction
    loads one of ``methods``. The offsets cover the load's inline caches and
    any ``EXTENDED_ARG`` before it: a specialized load reports a frame's
    ``f_lasti`` inside its caches."""
    found: set[int] = set()
    starts = []   # each real instruction with the offset its EXTENDED_ARGs start at
    start = None
    for i in dis.get_instructions(code):
        if i.opname == "EXTENDED_ARG":
            start = i.offset if start is None else start
            continue
        starts.append((i, i.offset if start is None else start))
        start = None
    for (i, at), (j, end) in zip(starts, starts[1:]):
        if (i.opname in _ATTR_OPS and i.argval == attr and j.opname in _ATTR_OPS
                and j.argval in methods):
            found.update(range(at, end, 2))
    return frozenset(found)


def _stored(attr: str, base_cls: type) -> tuple[Any, bool, Callable[[Any], Any]]:
    """Where ``base_cls`` keeps ``attr``: what its class holds under that
    name (``_MISSING`` for nothing), whether that is a data descriptor (which
    then stores the value), and how an instance that has stored no value
    reads it."""
    static = inspect.getattr_static(base_cls, attr, _MISSING)
    data_descr = static is not _MISSING and hasattr(type(static), "__set__")

    def default(self: Any) -> Any:
        """``attr`` of an instance that has stored none."""
        if static is _MISSING:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")
        getter = getattr(type(static), "__get__", None)
        return static if getter is None else getter(static, self, type(self))

    return static, data_descr, default


def _store_and_delete(attr: str, static: Any, data_descr: bool
                      ) -> tuple[Callable[[Any, Any], None], Callable[[Any], None]]:
    """The setter and the deleter of ``attr``: through ``static`` when it is
    a data descriptor, else in the instance's ``__dict__``."""

    def put(self: Any, value: Any) -> None:
        if data_descr:
            static.__set__(self, value)
        else:
            self.__dict__[attr] = value

    def drop(self: Any) -> None:
        if data_descr:
            static.__delete__(self)
            return
        try:
            del self.__dict__[attr]
        except KeyError:
            raise AttributeError(attr) from None

    return put, drop


def held(attr: str, base_cls: type, methods: set[str] | frozenset[str],
         make_view: Callable[[Any, Any], Any]) -> property:
    """The property through which a recording subclass of ``base_cls`` holds
    ``attr``: the value stored, as ``base_cls`` would give it, except at a call
    site of one of ``methods`` while the scheduler's recorder (``_kvtrace``)
    records and watches ``attr`` (``attr in recorder.watched``), where it is
    ``make_view(value, recorder)``, kept in the recorder's ``views``
    (attribute -> (value, view)) while the value stays. Stored values go where
    ``base_cls`` would put them: in the instance's ``__dict__``, or through
    ``base_cls``'s own descriptor when it has a data descriptor of that name."""
    known: dict[CodeType, frozenset[int]] = {}   # code object -> its call sites
    static, data_descr, default = _stored(attr, base_cls)

    def get(self: Any, _getframe: Callable = sys._getframe) -> Any:
        d = self.__dict__
        if data_descr:
            value = static.__get__(self, type(self))
        else:
            value = d.get(attr, _MISSING)
            if value is _MISSING:
                value = default(self)
        rec = d.get("_kvtrace")
        if rec is None or value is None or attr not in rec.watched:
            return value
        frame = _getframe(1)
        at = known.get(frame.f_code)
        if at is None:
            at = known[frame.f_code] = sites(frame.f_code, attr, methods)
        if frame.f_lasti in at and rec.active:
            kept = rec.views.get(attr)
            if kept is not None and kept[0] is value:
                return kept[1]
            view = make_view(value, rec)
            rec.views[attr] = (value, view)
            return view
        return value

    put, drop = _store_and_delete(attr, static, data_descr)
    return property(get, put, drop, doc=getattr(static, "__doc__", None) if data_descr else None)


class _Probe:
    """``check``'s scheduler: it calls the object it holds as vLLM calls its
    connector, and also reads it without calling it."""

    def __init__(self, held_obj: Any) -> None:
        self.held = held_obj

    def call(self) -> Any:
        return self.held.answer()

    def read(self) -> Any:
        return self.held


class _Held:
    def answer(self) -> str:
        return "held"


class _View:
    def __init__(self, value: Any) -> None:
        self.value = value

    def answer(self) -> tuple:
        return ("view", self.value.answer())


class _ProbeRecorder:
    active = True

    def __init__(self) -> None:
        self.views: dict = {}
        self.watched = {"held"}


def check() -> None:
    """Raise RuntimeError unless ``held`` tells call sites from other reads on
    this Python, before and after the interpreter specializes the reads (a
    few dozen runs)."""
    cls = type("Probe", (_Probe,), {"held": held("held", _Probe, {"answer"},
                                                 lambda value, rec: _View(value))})
    obj = _Held()
    p = cls(obj)
    p._kvtrace = _ProbeRecorder()
    version = sys.version.split()[0]
    for _ in range(64):
        if p.call() != ("view", "held"):
            raise RuntimeError(f"Python {version}: a call site of the connector is not told "
                               "from other reads")
        if p.read() is not obj or p.held is not obj:
            raise RuntimeError(f"Python {version}: a read of the connector that calls "
                               "nothing does not get the connector itself")
