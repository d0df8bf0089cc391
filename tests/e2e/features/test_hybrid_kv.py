"""Several KV-cache groups and sliding-window attention: the reference's
grouped KV manager against rules worked out by hand from vLLM 0.32's hybrid
coordinator (semantics doc 4.9), the shadow-KV check's window, the embedded
engine's hybrid faults, and the format's groups."""

from __future__ import annotations

import gzip

import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.reference import GroupSpec, ModelOutput, Request, Scheduler, SchedulerConfig
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

from tests._paths import REPO

B = 4
WINDOW = 8          # two blocks of 4: a hit needs cdiv(8 - 1, 4) = 2 cached blocks in a row
ROOT = REPO


def cfg(groups=(GroupSpec(WINDOW, 19), GroupSpec()), **kw) -> SchedulerConfig:
    base = dict(block_size=B, num_blocks=40, max_num_batched_tokens=64, max_num_seqs=8,
                max_model_len=128, kv_groups=groups)
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, max_tokens=max_tokens, block_size=B)


def step(s: Scheduler):
    """One schedule() and its output: a token for every request past its prefill."""
    out = s.schedule()
    s.update_from_output(out, ModelOutput(
        {rid: [7] for rid in out.num_scheduled_tokens
         if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}))
    return out


def tables(s: Scheduler, rid: str) -> list[list[int]]:
    return [s.kv.get_block_ids(rid), *(s.kv.more_ids(rid) or [[]])]


# --------------------------------------------------------------------------- the reference


def test_a_sliding_window_gives_back_blocks_before_the_window_as_the_null_block():
    s = Scheduler(cfg())
    s.add_request(req("a", list(range(100, 112))))
    out = step(s)
    # 12 tokens: 3 blocks a group; group 0 (the window) takes its blocks first.
    assert (out.new[0].block_ids, out.new[0].more_groups) == ([1, 2, 3], [[4, 5, 6]])
    free = s.kv.pool.num_free_blocks
    out = step(s)
    # Token 12's window reads 5..12: block 0 (tokens 0..3) is given back; both
    # groups take a block for token 12.
    assert tables(s, "a") == [[0, 2, 3, 7], [4, 5, 6, 8]]
    assert (out.running[0].block_ids, out.running[0].more_groups) == ([7], [[8]])
    assert s.kv.pool.num_free_blocks == free + 1 - 2


def test_a_hit_holds_only_where_every_group_can_serve_it():
    """Only the blocks of the window ending at the prompt's last token but one
    become hash-visible in the window's group (retention 0, vLLM 0.32's
    default). A prompt that shares 16 tokens then hits 16 under full attention
    and nothing in the window's group: it gets no hit, but the point where the
    full-attention hit ended becomes its shared-prefix boundary, and the window
    ending there is cached for the next prompt, which hits it."""
    shared = list(range(100, 116))
    s = Scheduler(cfg())
    s.add_request(req("a", shared + list(range(200, 208)), max_tokens=1))
    while s.requests:
        step(s)
    b = req("b", shared + list(range(300, 308)), max_tokens=1)
    s.add_request(b)
    out = step(s)
    assert out.new[0].num_computed_tokens == 0
    assert b.shared_prefix_boundary == 16
    while s.requests:
        step(s)
    s.add_request(req("c", shared + list(range(400, 408)), max_tokens=1))
    out = step(s)
    assert out.new[0].num_computed_tokens == 16
    # Token 16's window reads 9..16: the hit's blocks 0 and 1 are not kept.
    assert out.new[0].block_ids[:2] == [0, 0] and 0 not in out.new[0].block_ids[2:]
    assert 0 not in out.new[0].more_groups[0]


def test_a_full_attention_group_alone_serves_the_whole_prefix():
    """One full-attention group listed as a group is the single-group reference."""
    one = Scheduler(cfg(groups=()))
    grouped = Scheduler(cfg(groups=(GroupSpec(),)))
    for s in (one, grouped):
        s.add_request(req("a", list(range(100, 124)), max_tokens=2))
        s.add_request(req("b", list(range(100, 120)) + [9, 9, 9, 9], max_tokens=2))
    for _ in range(4):
        a, b = step(one), step(grouped)
        assert [(x.req_id, x.num_computed_tokens, x.block_ids) for x in a.new + a.running] == \
               [(x.req_id, x.num_computed_tokens, x.block_ids) for x in b.new + b.running]


# --------------------------------------------------------------------------- the content check


def test_the_content_check_reads_a_window_only():
    torch = pytest.importorskip("torch")
    del torch
    from kvtrace.replay.kv_content.torch_backend import ShadowKV

    s = ShadowKV(16, B, "cpu")
    s.add_request("a", list(range(100, 113)), window=WINDOW)
    assert s.step(0, [], [("a", 0, 12, [1, 2, 3])]) == []
    # Block 0 given back (the null block 0 in its place): token 12 reads 5..12.
    assert s.step(1, [], [("a", 12, 1, [0, 2, 3, 4])]) == []
    s.add_request("b", list(range(100, 113)), window=WINDOW)
    # A table whose block 1 (tokens 4..7, read from 5 on) is given back too.
    divs = s.step(2, [], [("b", 12, 1, [0, 0, 3, 5])])
    assert len(divs) == 1 and divs[0].req == "b"
    assert "position 5" in divs[0].recorded and "never written" in divs[0].recorded
    assert "3 of 7 positions read are wrong" in divs[0].recorded


def test_the_content_check_tells_groups_apart():
    """A slot one group wrote, read through another group's table, is wrong KV."""
    pytest.importorskip("torch")
    from kvtrace.replay.kv_content.check import ContentCheck

    c = ev.SchedulerConfig(block_size=B, num_blocks=16, max_num_batched_tokens=64,
                           max_num_seqs=4, max_model_len=64)
    check = ContentCheck(c, "cpu", windows=(None, None))
    check.arrival(ev.Arrival(seq=0, req="a", prompt_token_ids=list(range(100, 108)), max_tokens=4))
    first = ev.Step(seq=1, step=0, new=[ev.ScheduledNew("a", 0, 8, [1, 2], more_groups=[[3, 4]])])
    assert [d for _, ds in check.step(first, 2) + check.flush() for d in ds] == []
    check.output(ev.Output(seq=2, step=0, sampled={"a": [5]}))
    # Group 1 reads group 0's blocks: every slot holds group 0's KV.
    wrong = ev.Step(seq=3, step=1, running=[ev.ScheduledRunning("a", 8, 1, [], more_groups=[[]])],
                    states=[ev.RequestState("a", "RUNNING", 9, 9, 0, [1, 2, 5],
                                            more_groups=[[1, 2, 6]])])
    divs = [d for _, ds in check.step(wrong, 4) + check.flush() for d in ds]
    assert [(d.req, d.field) for d in divs] == [("a", "kv-content")]
    assert divs[0].recorded.startswith("group 1: block 1 slot 0 (position 0): written by a ")


# --------------------------------------------------------------------------- faults, embedded


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    from kvtrace.replay import replay_file

    d = tmp_path_factory.mktemp("hybrid-faults")
    out = {}
    for fault in ("hybrid-hit-not-served", "window-freed-early"):
        res = record_embedded(d / f"{fault}.jsonl", workload=FAULT_WORKLOADS[fault], fault=fault)
        out[fault] = (res, replay_file(res.path).divergences)
    return out


@pytest.mark.parametrize("fault, field", [("hybrid-hit-not-served", "num_computed_tokens"),
                                          ("window-freed-early", "block_ids")])
def test_a_hybrid_fault_is_named_where_it_first_bites(faulted, fault, field):
    """The first divergence is at the step and request of the fault log's
    first note, on the field the fault changes; and the content check sees the
    request read the window's empty slots."""
    res, divs = faulted[fault]
    first = res.fault_log[0]
    counted = [d for d in divs if d.kind != "kv-content"]
    assert (counted[0].step, counted[0].req) == (first.step, first.req)
    assert counted[0].field.endswith(field)
    assert any(d.kind == "kv-content" and d.req == first.req and "never written" in d.recorded
               for d in divs)


def test_clean_hybrid_workloads_use_both_groups_and_give_blocks_back(tmp_path):
    """The embedded hybrid workload is one a fault can show on: its tables hold
    the null block in the window's group, both groups' tables are in the trace,
    and prefix hits and preemptions happen."""
    res = record_embedded(tmp_path / "h.jsonl", workload="hybrid")
    with TraceReader(res.path) as r:
        header, steps = r.header, [e for e in r if isinstance(e, ev.Step)]
    assert [g.kind for g in header.features.kv_cache_groups] == ["SlidingWindowSpec",
                                                                  "FullAttentionSpec"]
    states = [st for e in steps for st in e.states]
    assert any(0 in st.block_ids for st in states)
    assert all(st.more_groups is None or 0 not in st.more_groups[0] for st in states)
    assert any(st.more_groups for st in states)
    assert any(s.num_computed_tokens > 0 for e in steps for s in e.new)
    assert any(e.preempted for e in steps)


def test_a_legacy_profile_refuses_sliding_windows_in_one_line():
    import subprocess
    import sys

    trace = ROOT / "traces" / "hybrid" / "hybrid-prefix.jsonl.gz"
    out = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--profile", "legacy",
                          str(trace)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "sliding-window KV-cache groups under the legacy profile" in out.stderr


# --------------------------------------------------------------------------- the format


def test_single_group_traces_carry_no_group_fields():
    """A trace of one full-attention group is written as before: no group specs
    in its header, no other groups' tables in its records."""
    for path in ROOT.glob("traces/*.jsonl.gz"):
        text = gzip.decompress(path.read_bytes())
        assert b'"more_groups"' not in text and b'"kv_cache_groups"' not in text, path.name


def test_hybrid_traces_carry_every_group():
    traces = sorted(ROOT.glob("traces/hybrid/*.jsonl.gz"))
    assert {p.name.split("-")[0] for p in traces} >= {"hybrid", "sliding", "gpt"}
    for path in traces:
        with TraceReader(path) as r:
            groups = r.header.features.kv_cache_groups
            more = any(s.more_groups for e in r if isinstance(e, ev.Step) for s in e.states)
        assert groups and groups[0].sliding_window == 64
        assert more == (len(groups) > 1), path.name
