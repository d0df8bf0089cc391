"""A killed embedded engine keeps every step it completed, as a killed vLLM
engine does (test_hard_exit.py): ``kvtrace record`` of the embedded engine
ended by SIGKILL from outside at a random time, and by ``os._exit`` as a
random step begins (``bench.hard_exit``, which runs 50 of each; here a few
seeds of each). Its writer held 1 MiB in the engine's process, and a kill
lost the 300 to 500 steps it held."""

from __future__ import annotations

import signal

import pytest

from bench.hard_exit import one


@pytest.mark.parametrize("mode, seed", [("embedded-kill", 1), ("embedded-kill", 2),
                                        ("embedded-exit", 3), ("embedded-exit", 4)])
def test_a_killed_embedded_engine_keeps_every_completed_step(tmp_path, mode, seed):
    res = one(mode, seed, tmp_path)
    assert res["unreadable"] is None, res
    assert res["completed"] > 0, f"the engine ended before its first step: {res}"
    assert res["missing"] == [], {**res, "missing": res["missing"][:20]}
    assert res["rc"] == (-signal.SIGKILL if mode == "embedded-kill" else 0), res
    # Cut off after the last completed step, or (the run was done before the kill) whole.
    assert res["cut"] or res["status"] == "complete", res
    assert res["steps"] >= res["completed"] and res["outputs"] >= res["completed"]
