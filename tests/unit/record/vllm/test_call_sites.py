"""The recorder sees the connector's answers at the scheduler's own call sites
(``kvtrace.record.vllm.call_sites``), on a stand-in scheduler: a read of the
held object anywhere else gets the object itself, and a call site returns and
raises what the object does. The same on vLLM's own Scheduler:
tests/e2e/vllm/test_recorder_observed.py."""

from __future__ import annotations

import pytest

from kvtrace.record.vllm import call_sites


class Store:
    def answer(self, x):
        return ("store", x)


class View:
    def __init__(self, value, rec):
        self.value, self.rec = value, rec

    def answer(self, x):
        self.rec.calls.append(x)
        return self.value.answer(x)


class Rec:
    active = True

    def __init__(self):
        self.calls = []
        self.views = {}
        self.watched = {"store"}


class Sched:
    def __init__(self, store):
        self.store = store

    def call(self, x):
        return self.store.answer(x)

    def calls_in_a_comprehension(self, xs):
        return [self.store.answer(x) for x in xs]

    def copies_then_calls(self, x):
        s = self.store
        return s.answer(x)

    def reads(self):
        return self.store, getattr(self, "store"), self.store is not None


def _recording(base=Sched, attr="store"):
    cls = type("Recording", (base,), {})
    setattr(cls, attr, call_sites.held(attr, base, {"answer"}, View))
    return cls


def test_a_call_site_is_recorded_and_every_other_read_gets_the_object_itself():
    store, rec = Store(), Rec()
    s = _recording()(store)
    s._kvtrace = rec
    for i in range(50):   # before and after the interpreter specializes the reads
        assert s.call(i) == ("store", i)
        assert s.reads() == (store, store, True) and s.reads()[0] is store
        assert s.copies_then_calls(-1) == ("store", -1)
    assert s.calls_in_a_comprehension([7, 8]) == [("store", 7), ("store", 8)]
    assert rec.calls == list(range(50)) + [7, 8]   # the copy's calls are not call sites
    assert vars(s) == {"store": store, "_kvtrace": rec}
    rec.active = False
    s.call(99)
    assert rec.calls[-1] == 8   # a recorder that stopped records nothing


def test_a_call_site_returns_and_raises_what_the_object_does():
    class Odd:
        out = object()
        error = LookupError("no such block")

        def answer(self, x):
            if x < 0:
                raise self.error
            return self.out

    store, rec = Odd(), Rec()
    s = _recording()(store)
    s._kvtrace = rec
    assert s.call(1) is Odd.out
    with pytest.raises(LookupError) as raised:
        s.call(-1)
    assert raised.value is Odd.error and rec.calls == [1, -1]


def test_a_call_site_past_many_names_is_found():
    """A method with hundreds of names: its loads carry EXTENDED_ARG prefixes."""
    names = [f"a{i}" for i in range(300)]
    src = "def call(self, x):\n" + "".join(f"    self.{n} = {i}\n" for i, n in enumerate(names))
    src += "    return self.store.answer(x)\n"
    space: dict = {}
    exec(compile(src, "<many>", "exec"), space)
    base = type("Big", (Sched,), {"call": space["call"]})
    store, rec = Store(), Rec()
    s = _recording(base)(store)
    s._kvtrace = rec
    for i in range(40):
        s.call(i)
    assert rec.calls == list(range(40))


def test_a_base_class_property_or_default_is_kept():
    class WithProperty(Sched):
        @property
        def store(self):
            return self._held

        @store.setter
        def store(self, v):
            self._held = v

    class WithDefault(Sched):
        store = None

        def __init__(self):
            pass

    store, rec = Store(), Rec()
    s = _recording(WithProperty)(store)
    s._kvtrace = rec
    assert s._held is store and s.store is store and "store" not in vars(s)
    assert s.call(1) == ("store", 1) and rec.calls == [1]
    d = _recording(WithDefault)()
    d._kvtrace = rec
    assert d.store is None
    d.store = store
    assert d.store is store and d.call(2) == ("store", 2) and rec.calls == [1, 2]
    del d.store
    assert d.store is None


def test_this_python_passes_the_check():
    call_sites.check()
