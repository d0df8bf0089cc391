"""The shadow-KV check on state groups (Mamba, gated delta nets): a step must
start from the state after exactly its own prefix of the length it has
computed. Served a state of another prefix or length, or a state block freed
and written by another request since, is a kv-content divergence naming the
write that put it there."""

from __future__ import annotations

import pytest

from kvtrace.engine import record_workload
from kvtrace.engine import kv_store
from kvtrace.engine.content_faults import FAULTS, FAULT_WORKLOADS
from kvtrace.engine.workloads import build_workload
from kvtrace.replay import replay_file
from kvtrace.replay.kv_content.check import ContentCheck
from kvtrace.trace import events as ev

B = 4


def content(divs):
    return [d for d in divs if d.kind == "kv-content"]


def _check(state: dict, **fa) -> ContentCheck:
    """A content check of a state group (group 0) beside full attention (group 1)."""
    cfg = ev.SchedulerConfig(block_size=B, num_blocks=16, max_num_batched_tokens=64,
                             max_num_seqs=4, max_model_len=64)
    groups = [ev.KVCacheGroup(kind="MambaSpec", mamba_type="gdn_attn", **state),
              ev.KVCacheGroup(kind="FullAttentionSpec", block_size=B, **fa)]
    return ContentCheck(cfg, "numpy", groups=groups)


def _align() -> ContentCheck:
    return _check(dict(block_size=B, mamba_cache_mode="align", num_speculative_blocks=0))


def _run(check: ContentCheck, *records) -> list:
    """Feed arrivals, steps and outputs; the divergences of every step."""
    out = []
    for line, r in enumerate(records, 1):
        if type(r) is ev.Arrival:
            check.arrival(r)
        elif type(r) is ev.Output:
            check.output(r)
        else:
            out += [d for _, ds in check.step(r, line) for d in ds]
    return out + [d for _, ds in check.flush() for d in ds]


def _arrive(req: str, prompt: list[int], seq: int = 0) -> ev.Arrival:
    return ev.Arrival(seq=seq, req=req, prompt_token_ids=prompt, max_tokens=8)


def _new(req, c, n, state, fa):
    return ev.ScheduledNew(req, c, n, state, more_groups=[fa])


def _running(req, c, n, state=(), fa=()):
    return ev.ScheduledRunning(req, c, n, list(state), more_groups=[list(fa)])


# --------------------------------------------------------------------------- align mode


def test_a_state_block_freed_and_written_by_another_request_is_named_where_it_is_read():
    """a keeps the state after 8 tokens in block 1; b is given block 1 and
    writes its own state there; a's next chunk starts from block 1."""
    check = _align()
    divs = _run(check,
                _arrive("a", list(range(100, 110))), _arrive("b", list(range(200, 206))),
                ev.Step(seq=1, step=0, new=[_new("a", 0, 8, [0, 1], [2, 3])]),
                ev.Output(seq=2, step=0),
                ev.Step(seq=3, step=1, new=[_new("b", 0, 4, [1], [5])]),
                ev.Output(seq=4, step=1),
                ev.Step(seq=5, step=2, running=[_running("a", 8, 2, [6], [4])]))
    assert [(d.step, d.req) for d in divs] == [(2, "a")]
    assert divs[0].recorded == "state slot 1, block 1: written by b at step 1 (its state after 4 tokens)"
    assert divs[0].expected == "state of a after 8 tokens"
    assert check.states_checked == 1


def test_the_state_a_step_writes_is_read_by_the_next_chunk_and_by_a_hit():
    """The state after each chunk, in the slot of the boundary it ends on, is
    what the next chunk starts from; a request that hits it reads it."""
    check = _align()
    prompt = list(range(100, 110))
    divs = _run(check, _arrive("a", prompt), _arrive("b", prompt[:8] + [7, 7]),
                ev.Step(seq=1, step=0, new=[_new("a", 0, 4, [1], [2])]),
                ev.Output(seq=2, step=0),
                ev.Step(seq=3, step=1, running=[_running("a", 4, 4, [3], [4])]),
                ev.Output(seq=4, step=1),
                ev.Step(seq=5, step=2, new=[_new("b", 8, 2, [0, 3, 5], [2, 4, 6])],
                        running=[_running("a", 8, 2, [7], [8])]))
    assert divs == [] and check.states_checked == 3


def test_a_hit_whose_attention_goes_past_the_state_reads_a_state_never_written():
    """LMCache #4247's shape: full attention hits 8 tokens, the state group
    keeps a state at 4 only; the step starts from slot 1, which holds none."""
    check = _align()
    prompt = list(range(100, 110))
    divs = _run(check, _arrive("a", prompt), _arrive("b", prompt[:8] + [7, 7]),
                ev.Step(seq=1, step=0, new=[_new("a", 0, 4, [1], [2])]),
                ev.Output(seq=2, step=0),
                ev.Step(seq=3, step=1, running=[_running("a", 4, 4, [3], [4])]),
                ev.Output(seq=4, step=1),
                ev.Step(seq=5, step=2, new=[_new("b", 8, 2, [1, 0, 5], [2, 4, 6])]))
    assert [d.recorded for d in content(divs)] == \
        ["state slot 1, block 0 (the null block): never written"]


def test_a_prefill_checkpoint_is_the_state_at_the_chunks_last_boundary():
    """Mamba2's checkpoint block: a chunk of 10 tokens from 0 writes the state
    after 8 into slot 1 (and the state after 10 into slot 2); a sibling hits
    it there."""
    check = _check(dict(block_size=B, mamba_cache_mode="align", num_speculative_blocks=0,
                        num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1))
    prompt = list(range(100, 110))
    divs = _run(check, _arrive("a", prompt), _arrive("b", prompt[:8] + [1, 2, 3]),
                ev.Step(seq=1, step=0, new=[_new("a", 0, 10, [0, 1, 2], [3, 4, 5])]),
                ev.Output(seq=2, step=0, sampled={"a": [9]}),
                ev.Step(seq=3, step=1, new=[_new("b", 8, 3, [0, 1, 6], [3, 4, 7])]))
    assert divs == [] and check.states_checked == 1


def test_a_state_a_connector_loads_is_where_the_step_starts_from():
    check = _align()
    prompt = list(range(100, 112))
    load = dict(new=[_new("a", 8, 2, [0, 1, 2], [3, 4, 5])])
    assert _run(check, _arrive("a", prompt),
                ev.Step(seq=1, step=0, loads=[ev.KVLoad("a", 0, 8)], **load)) == []
    short = _run(_align(), _arrive("a", prompt),
                 ev.Step(seq=1, step=0, loads=[ev.KVLoad("a", 0, 4)], **load))
    assert [d.recorded for d in content(short)][:1] == ["state slot 1, block 1: never written"]


# --------------------------------------------------------------------------- speculative decoding


def _none_spec() -> ContentCheck:
    """A state group without prefix caching: one state block and one for a draft."""
    return _check(dict(block_size=64, mamba_cache_mode="none", num_speculative_blocks=1))


def _decodes(rejected_kept: bool) -> list:
    check = _none_spec()
    c3 = 9 if rejected_kept else 8
    return _run(check, _arrive("a", [10, 11, 12, 13, 14]),
                ev.Step(seq=1, step=0, new=[_new("a", 0, 5, [1, 2], [3, 4])]),
                ev.Output(seq=2, step=0, sampled={"a": [15]}),
                # A draft, accepted: states after 6 (slot 0) and 7 (slot 1).
                ev.Step(seq=3, step=1, running=[_running("a", 5, 2, [], [5])], spec={"a": [16]}),
                ev.Output(seq=4, step=1, sampled={"a": [16, 17]}),
                # It starts from slot 1; a draft, rejected: the state after 8 in slot 0.
                ev.Step(seq=5, step=2, running=[_running("a", 7, 2, [], [])], spec={"a": [99]}),
                ev.Output(seq=6, step=2, sampled={"a": [18]}),
                ev.Step(seq=7, step=3, running=[_running("a", c3, 1, [], [6])])), check


def test_a_decode_starts_from_the_state_after_its_last_accepted_token():
    divs, check = _decodes(rejected_kept=False)
    assert divs == [] and check.states_checked == 3


def test_a_rejected_draft_counted_as_computed_reads_a_state_of_another_length():
    divs, _ = _decodes(rejected_kept=True)
    states = [d for d in content(divs) if d.recorded.startswith("state slot")]
    assert [(d.step, d.recorded, d.expected) for d in states] == [
        (3, "state slot 0, block 1: written by a at step 2 (its state after 8 tokens)",
         "state of a after 9 tokens")]


# --------------------------------------------------------------------------- the embedded engine


@pytest.mark.parametrize("fault,seed,written", [("state-hash-kept-on-reuse", 1, "other"),
                                                ("state-split-off-grid", 0, "shorter")])
def test_state_faults_of_the_embedded_engine_are_named_where_they_are_read(tmp_path, fault, seed,
                                                                           written):
    """Every count agrees with the reference where the fault fires; the
    content check names the read and the write that put the wrong state there."""
    wl = build_workload(FAULT_WORKLOADS[fault], seed)
    res = record_workload(tmp_path / "t.jsonl", wl, seed=seed, scheduler_cls=FAULTS[fault])
    assert res.fault_log, f"the fault {fault} never fired"
    divs = content(replay_file(res.path).divergences)
    states = [d for d in divs if "state slot" in d.recorded]
    assert states, "no state read flagged"
    first = states[0]
    assert first.step >= res.fault_log[0].step
    writer = first.recorded.split("written by ")[1].split(" ")[0]
    wanted = int(first.expected.split("after ")[1].split(" ")[0])
    if written == "other":     # another request's write, in the block a hit adopted
        assert writer != first.req and (first.step, first.req) in {
            (e.step, e.req) for e in res.fault_log}
    else:                      # the state of another length, where a boundary's is wanted
        length = int(first.recorded.split("its state after ")[1].split(" ")[0])
        assert length < wanted and wanted % wl.config.block_size == 0


def test_a_full_async_hit_on_a_state_model_leaves_the_last_token_without_its_state(
        tmp_path, monkeypatch):
    """vLLM computes a whole prompt's last token again after an async load of
    all of it (S:3171-3172): the state group needs the state before that
    token, which a store that loaded the whole prompt does not hold. The
    embedded store answers one token short on a state model, as vLLM's
    Mooncake connector does; made to answer in full, it is flagged."""
    wl = build_workload("hybrid-state-offload", 1)
    clean = record_workload(tmp_path / "clean.jsonl", wl, seed=1)
    assert content(replay_file(clean.path).divergences) == []
    init = kv_store.ExternalKVStore.__init__
    monkeypatch.setattr(kv_store.ExternalKVStore, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "keeps_last_token": False}))
    full = record_workload(tmp_path / "full.jsonl", wl, seed=1)
    divs = content(replay_file(full.path).divergences)
    assert divs and all(d.expected.startswith("state of ") for d in divs)
    assert "(the null block): never written" in divs[0].recorded
