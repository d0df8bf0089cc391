"""The writer process's start: its parent says the writer's pid to an
engine that may be gone."""

from __future__ import annotations

import os

import pytest

from kvtrace.record import writer_process


class _Exited(Exception):
    pass


def test_the_parent_says_nothing_to_a_killed_engine_and_exits(monkeypatch):
    r, w = os.pipe()
    os.close(r)   # the engine that would read the pid was killed

    class Out:
        def fileno(self):
            return w

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(os, "fork", lambda: 4242)   # this is the parent
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(writer_process.sys, "stdout", Out())
    try:
        with pytest.raises(_Exited) as exited:   # not BrokenPipeError: no traceback
            writer_process._detach()
    finally:
        os.close(w)
    assert exited.value.args == (0,)
