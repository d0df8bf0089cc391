"""A ``schedule()`` that raises is a finding: the recorder writes what the
failing step had asked the connector (a ``step_failed`` record), replay runs
that very step with those answers, reaches the same failure, and names the
request, the counts and the rule, with exit code 1. A failure the reference
does not reach is a finding too (rule ``crash``). The same on real engines:
tests/e2e/vllm/test_failed_step.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from kvtrace.replay import replay_file
from kvtrace.trace import TraceError
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader, TraceWriter

from tests._paths import REPO

BLOCK = 4


def _header(connector: bool = True) -> ev.Header:
    return ev.Header(engine="vllm", engine_version="0.32.0", config=ev.SchedulerConfig(
        block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
        max_model_len=128, connector=ev.ConnectorConfig("ScriptedConnector") if connector else None))


def _write(path, events, header=None, error="the engine stopped on AssertionError"):
    w = TraceWriter(path, header or _header())
    for e in events:
        w.write(msgspec.structs.replace(e, seq=w.next_seq()))
    w.close(status="interrupted", error=error)
    return path


def _replay_cli(path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", "--no-kv-check",
                        str(path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVTRACE_QUIET": "1"})
    return p.returncode, json.loads(p.stdout)


PROMPT = list(range(1, 9))   # two blocks


def test_a_failed_step_is_run_with_its_recorded_answers_and_named(tmp_path):
    """The engine's connector answered a sync external hit over the whole
    prompt, and vLLM failed its assertion inside schedule() (S:1170). The
    reference is given that answer and fails there too."""
    path = _write(tmp_path / "t.jsonl", [
        ev.Arrival(seq=0, req="r0", prompt_token_ids=PROMPT, max_tokens=4),
        ev.StepFailed(seq=0, step=0, error="AssertionError",
                      where="vllm/v1/core/sched/scheduler.py:1170 in schedule",
                      lookups=[ev.Lookup(req="r0", local=0, ext=8)], loads=[]),
    ])
    code, doc = _replay_cli(path)
    assert code == 1
    [d] = doc["divergences"]
    assert (d["step"], d["req"], d["field"]) == (0, "r0", "assertion")
    assert d["rule"].startswith("S:1170")
    assert d["recorded"] == ("schedule() raised AssertionError at "
                             "vllm/v1/core/sched/scheduler.py:1170 in schedule")
    res = replay_file(path, device=None)
    assert res.divergences[0].why == (
        "num_computed_tokens = local hit 0 + external hit 8 (sync, the connector's answer at "
        "this step) = 8 of num_tokens 8: 0 tokens left to compute")
    assert res.stopped.startswith("the engine failed in schedule() at step 0")
    assert res.steps == 1


def test_a_failed_step_the_reference_schedules_is_a_crash_finding(tmp_path):
    """Nothing the reference knows fails at this step (a plain admission): the
    engine's failure is still reported, and replay exits 1."""
    path = _write(tmp_path / "t.jsonl", [
        ev.Arrival(seq=0, req="r0", prompt_token_ids=PROMPT, max_tokens=4),
        ev.StepFailed(seq=0, step=0, error="KeyError: 'r0'", where="my/scheduler.py:12 in schedule",
                      lookups=[ev.Lookup(req="r0", local=0, ext=0)], loads=[]),
    ], error="the engine stopped on KeyError: 'r0'")
    code, doc = _replay_cli(path)
    assert code == 1
    [d] = doc["divergences"]
    assert (d["step"], d["req"], d["field"]) == (0, None, "schedule")
    assert d["rule"].startswith("crash:")
    assert d["recorded"] == "schedule() raised KeyError: 'r0' at my/scheduler.py:12 in schedule"


def test_a_failed_step_whose_lookups_the_reference_does_not_make_says_so(tmp_path):
    """The engine asked the connector for a request the reference does not
    look up at that step (it already runs): the lookup is flagged with the
    failure."""
    path = _write(tmp_path / "t.jsonl", [
        ev.Arrival(seq=0, req="r0", prompt_token_ids=PROMPT, max_tokens=4),
        ev.Arrival(seq=0, req="zz", prompt_token_ids=PROMPT, max_tokens=4),
        ev.StepFailed(seq=0, step=0, error="AssertionError",
                      lookups=[ev.Lookup(req="r0", local=0, ext=8), ev.Lookup(req="zz", local=0, ext=1)],
                      loads=[]),
    ])
    divs = replay_file(path, device=None).divergences
    assert [(d.req, d.field) for d in divs] == [("r0", "assertion"), ("zz", "lookup")]
    assert all(d.step == 0 and d.line == 4 for d in divs)


def test_an_older_interrupted_trace_still_replays_the_next_step(tmp_path):
    """A trace without a step_failed record (recorded before it existed, or an
    engine that failed elsewhere) is replayed as before: the reference
    schedules one step more, and names the assertion it fails there."""
    from tests.mini_traces import load_records, save_records

    cut = REPO / "traces/vllm-bugs/spec-padding-cut.jsonl.gz"
    records = load_records(cut)
    failed = [r for r in records if r.get("kind") == "step_failed"]
    assert len(failed) == 1
    older = save_records([r for r in records if r not in failed], tmp_path / "older.jsonl")
    got = replay_file(cut, device=None).divergences
    old = replay_file(older, device=None).divergences
    assert [(d.step, d.req, d.field, d.rule) for d in old] == [
        (failed[0]["step"], got[0].req, "assertion", got[0].rule)]
    assert got[0].rule.startswith("S:1372") and old[0].recorded == "the engine stopped on AssertionError"


def test_a_step_failed_record_round_trips_and_the_reader_takes_it_before_end(tmp_path):
    path = _write(tmp_path / "t.jsonl.gz", [
        ev.Arrival(seq=0, req="r0", prompt_token_ids=PROMPT, max_tokens=4),
        ev.StepFailed(seq=0, step=0, error="AssertionError", where="a.py:1 in f",
                      lookups=[ev.Lookup(req="r0", local=0, ext=8, load_async=True)],
                      loads=[ev.KVLoad(req="r0", start=0, end=8)], grammar={"r0": "ready"},
                      throttle_prefills=True),
    ])
    r = TraceReader(path)
    got = list(r)
    assert isinstance(got[1], ev.StepFailed) and got[1].lookups[0].load_async
    assert got[1].grammar == {"r0": "ready"} and got[1].throttle_prefills
    assert r.end.status == "interrupted"


@pytest.mark.parametrize("events,why", [
    ([ev.Arrival(seq=0, req="r0", prompt_token_ids=PROMPT, max_tokens=4),
      ev.StepFailed(seq=0, step=0, error="AssertionError"),
      ev.Abort(seq=0, reqs=["r0"])],
     "a record of kind 'abort' after step 0, whose schedule() raised: only the 'end' record may follow"),
    ([ev.StepFailed(seq=0, step=0, error="AssertionError",
                    lookups=[ev.Lookup(req="ghost", local=0, ext=8)])],
     "field 'lookups.req' names request 'ghost', which never arrived"),
], ids=["record-after-it", "unknown-request"])
def test_a_step_failed_record_is_held_to_what_follows_and_what_it_names(tmp_path, events, why):
    """These were read as if nothing were wrong: a record after the step that
    stopped the engine, a lookup of a request that never arrived."""
    path = _write(tmp_path / "t.jsonl", events)
    with pytest.raises(TraceError) as e:
        list(TraceReader(path))
    assert why in str(e.value) and f"{path}:" in str(e.value)
