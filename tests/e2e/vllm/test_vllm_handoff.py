"""The recorder on vLLM 0.32's real scheduler, for the calls that change the
scheduler's state from outside ``schedule``/``update_from_output``: a
connector's ``request_finished`` answer (the prefill side of prefill/decode
disaggregation with NixlConnector), ``schedule(throttle_prefills=True)``,
``finish_requests`` with a status other than aborted, and an
``AsyncScheduler`` run with the config's async flag off. Each is recorded
live (model-free: NixlConnector's worker side cannot run here), replays clean
through the reference and through vLLM's own scheduler, and the copy without
what the recorder wrote for it (what a recorder that left it out wrote)
diverges. test_handoff.py checks the traces under traces/ the same way
without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._require import require

require("vllm", "the vLLM recorder needs vLLM")

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.rerun.core import replay_through_vllm  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from tests.unit.diff.test_handoff import DECODE, FREE_BEFORE_SEND, PREFILL, TRACES, records, write  # noqa: E402

pytestmark = pytest.mark.vllm

ASYNC = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Path:
    """The four recorded live, in one process with no model."""
    out = tmp_path_factory.mktemp("live")
    jobs = [{"name": "prefill", "workload": "pd-prefill"},
            {"name": "decode", "handoff_from": "prefill"},
            {"name": "throttle", "workload": "dp-throttle"},
            {"name": "stopped", "workload": "finish-stopped"}]
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(out / "vllm"))
    env.pop("KVTRACE_OUT", None)
    p = subprocess.run([sys.executable, "-m", "kvtrace.lab.release_jobs", str(out / "jobs.json"),
                        str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, (x for x in p.stdout.splitlines()
                                                      if x.startswith("{")))}
    assert len(results) == len(jobs), p.stdout[-2000:]
    for r in results.values():   # recorded, and vLLM's scheduler decided alike
        assert r["error"] is None and r["vllm_agrees"] is True, r
    return out


def clean(path: Path) -> None:
    assert replay_file(path, device="cpu", worker=0).divergences == []


def test_a_delayed_free_is_recorded_live_and_replay_needs_it(live, tmp_path):
    path = live / "prefill.jsonl.gz"
    clean(path)
    objs = records(path)
    answers = [o for o in objs if o.get("kind") == "request_finished"]
    assert len(answers) == 8 and all(a["delay_free"] for a in answers)
    bare = write([o for o in objs if o.get("kind") != "request_finished"], tmp_path / "b.jsonl")
    d = replay_file(bare, device="cpu", worker=0).divergences[0]
    assert d.field == "state.block_ids" and d.expected == [] and d.req == answers[0]["req"]


def test_the_live_sides_line_up(live):
    clean(live / "decode.jsonl.gz")
    res = diff_files(live / "prefill.jsonl.gz", live / "decode.jsonl.gz")
    assert res.matched_by == "handoff" and res.requests_compared == 8 and res.divergences == []


def test_prefill_throttling_is_recorded_live_and_replay_needs_it(live, tmp_path):
    path = live / "throttle.jsonl.gz"
    clean(path)
    objs = records(path)
    assert sum(1 for o in objs if o.get("throttle_prefills")) >= 10
    for o in objs:
        o.pop("throttle_prefills", None)
    assert replay_file(write(objs, tmp_path / "b.jsonl"), device="cpu", worker=0).divergences


def test_a_stopped_finish_is_recorded_live_and_replay_needs_it(live, tmp_path):
    path = live / "stopped.jsonl.gz"
    clean(path)
    objs = records(path)
    (stop,) = [o for o in objs if o.get("kind") == "abort"]
    assert stop["status"] == "FINISHED_STOPPED" and len(stop["reqs"]) == 3
    bare = write([o for o in objs if o is not stop], tmp_path / "b.jsonl")
    assert replay_file(bare, device="cpu", worker=0).divergences


def test_the_header_names_the_class_that_runs_not_the_config_flag(tmp_path):
    # vLLM's AsyncScheduler driven in async order (each step scheduled before
    # the output of the one before) under a config whose async flag is off, as
    # a caller that passes the class does: the recorder says async.
    objs = records(TRACES / "async-preemption.jsonl.gz")
    objs[0]["features"]["async_scheduling"] = False
    run = replay_through_vllm(write(objs, tmp_path / "in.jsonl"), tmp_path / "out.jsonl", ASYNC)
    assert run.summary()["first_difference"] is None
    out = records_plain(run.out)
    assert out[0]["features"]["async_scheduling"] is True
    assert out[0]["features"]["scheduler_cls"] == ASYNC
    clean(run.out)
    out[0]["features"]["async_scheduling"] = False   # what the config said
    d = replay_file(write(out, tmp_path / "b.jsonl"), device="cpu", worker=0).divergences[0]
    assert d.rule.startswith("I1") and d.step == 1


def records_plain(path: Path) -> list[dict]:
    import orjson

    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines()]


@pytest.mark.parametrize("path", [PREFILL, DECODE, TRACES / "dp-throttle.jsonl.gz",
                                  TRACES / "finish-stopped.jsonl.gz"],
                         ids=lambda p: p.name.split(".")[0])
def test_the_checked_in_traces_are_vllms_own_decisions(path, tmp_path):
    run = replay_through_vllm(path, tmp_path / "v.jsonl")
    assert run.summary()["first_difference"] is None
    assert diff_files(path, run.out).divergences == []


def test_vllms_own_scheduler_keeps_the_blocks_the_fault_frees(tmp_path):
    run = replay_through_vllm(FREE_BEFORE_SEND, tmp_path / "v.jsonl")
    first = run.summary()["first_difference"]
    assert first is not None and first["field"] == "block_ids"
    assert diff_files(FREE_BEFORE_SEND, run.out).divergences
