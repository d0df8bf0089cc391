"""The reference scheduler against rules of the semantics doc, with expectations
worked out by hand from the doc (section numbers cited), not copied from a run."""

from __future__ import annotations

from kvtrace.reference import ModelOutput, Request, Scheduler, SchedulerConfig, Status
from kvtrace.reference.block_pool import BlockPool

B = 4


def cfg(**kw) -> SchedulerConfig:
    base = dict(block_size=B, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8,
                max_model_len=128)
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid: str, tokens: list[int], max_tokens: int = 8, **kw) -> Request:
    return Request(rid, tokens, max_tokens=max_tokens, block_size=B, **kw)


def decode_tokens(s: Scheduler, out) -> ModelOutput:
    """One sampled token for every request whose prefill is complete."""
    return ModelOutput({rid: [7] for rid in out.num_scheduled_tokens
                        if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens})


class FixedConnector:
    """Answers every lookup with a fixed external hit."""

    def __init__(self, ext: int, load_async: bool):
        self.ext, self.load_async, self.calls = ext, load_async, []

    def get_num_new_matched_tokens(self, r, n):
        self.calls.append((r.request_id, n))
        ext = self.ext.get(r.request_id, 0) if isinstance(self.ext, dict) else self.ext
        return ext, self.load_async

    def update_state_after_alloc(self, r, block_ids, e):
        pass

    def request_finished(self, r, block_ids):
        return False


# --------------------------------------------------------------------------- block pool (4.5)


def test_pool_hands_out_ids_from_one_in_order_and_never_the_null_block():
    pool = BlockPool(6, enable_caching=True)
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0


def test_unhashed_blocks_freed_in_reverse_go_to_the_head_tail_block_first():
    pool = BlockPool(8, enable_caching=True)
    table = pool.get_new_blocks(3)                      # ids 1, 2, 3
    pool.free_blocks(reversed(table))                    # frees 3, 2, 1
    # LIFO: the last block of the table is reused first.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 2, 1]


def test_hashed_blocks_go_to_the_tail_and_a_hit_takes_one_from_the_middle():
    pool = BlockPool(6, enable_caching=True)
    table = pool.get_new_blocks(2)                       # 1, 2; free queue now 3, 4, 5
    pool.cache_full_blocks([b"h1", b"h2"], table, 0, 2, B)
    pool.free_blocks(reversed(table))                    # appended: 2 then 1
    assert pool.free_queue.ids() == [3, 4, 5, 2, 1]
    hit = pool.get_cached_block(b"h1")
    pool.touch([hit])
    assert pool.free_queue.ids() == [3, 4, 5, 2]
    # Popping a hashed block evicts its hash.
    got = pool.get_new_blocks(4)
    assert got[-1].block_id == 2 and pool.get_cached_block(b"h2") is None


# --------------------------------------------------------------------------- lookups (4.6)


def test_local_hit_leaves_one_token_so_an_aligned_cached_prompt_recomputes_its_last_block():
    s = Scheduler(cfg())
    prompt = list(range(8))                              # exactly 2 blocks
    s.add_request(req("a", prompt))
    s.update_from_output(s.schedule(), ModelOutput({"a": [99]}))
    s.add_request(req("b", prompt))
    out = s.schedule()
    b = next(x for x in out.new if x.req_id == "b")
    # hit capped at num_tokens - 1 = 7 -> one whole block (4 tokens), block-granular
    assert b.num_computed_tokens == 4 and b.num_scheduled_tokens == 4
    a_table = s.kv.get_block_ids("a")
    assert b.block_ids[0] == a_table[0] and b.block_ids[1] != a_table[1]


def test_blocks_are_hash_visible_from_the_step_that_allocates_them():
    s = Scheduler(cfg())
    s.add_request(req("a", list(range(12))))
    s.add_request(req("b", list(range(12))))
    out = s.schedule()
    a, b = out.new
    # b hits a's first two blocks in the same waiting pass (4.3), before a's forward pass.
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]


# --------------------------------------------------------------------------- budgets (2.1, 2.2)


def test_chunked_prefill_under_token_budget_and_threshold_only_with_company():
    s = Scheduler(cfg(max_num_batched_tokens=10, long_prefill_token_threshold=3))
    s.add_request(req("solo", list(range(20))))
    out = s.schedule()
    # alone: the threshold is off (S:643), the budget caps the chunk
    assert out.num_scheduled_tokens == {"solo": 10}
    s.update_from_output(out, ModelOutput())
    s.add_request(req("other", list(range(100, 120))))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"solo": 3, "other": 3}


def test_max_num_seqs_stops_admission():
    s = Scheduler(cfg(max_num_seqs=2))
    for i in range(3):
        s.add_request(req(f"r{i}", [i] * 5))
    assert set(s.schedule().num_scheduled_tokens) == {"r0", "r1"}


def test_fcfs_preempts_the_last_running_request_and_skips_the_waiting_pass():
    s = Scheduler(cfg(num_blocks=5, max_num_batched_tokens=64))   # 4 usable blocks
    s.add_request(req("a", list(range(8)), max_tokens=20))          # 2 blocks
    s.add_request(req("b", list(range(100, 108)), max_tokens=20))   # 2 blocks
    out = s.schedule()
    s.update_from_output(out, decode_tokens(s, out))   # a, b now hold 9 tokens each
    s.add_request(req("c", [5, 5]))
    out = s.schedule()
    # a needs a 3rd block; none free -> b (last) is preempted; a gets b's freed block.
    assert out.preempted_req_ids == {"b"} and set(out.num_scheduled_tokens) == {"a"}
    assert s.requests["b"].status == Status.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    assert s.requests["c"].status == Status.WAITING   # no admission in a step that preempted


def test_priority_preempts_the_lowest_priority_request():
    s = Scheduler(cfg(num_blocks=5, policy="priority"))
    s.add_request(req("low", list(range(8)), max_tokens=20, priority=5, arrival_time=0))
    s.add_request(req("high", list(range(100, 108)), max_tokens=20, priority=0, arrival_time=1))
    out = s.schedule()
    s.update_from_output(out, decode_tokens(s, out))
    out = s.schedule()
    assert out.preempted_req_ids == {"low"}


# --------------------------------------------------------------------------- external loads (1.3, 3)


def test_async_full_hit_completes_with_the_last_token_left_to_compute():
    conn = FixedConnector(ext=8, load_async=True)
    s = Scheduler(cfg(), conn)
    s.add_request(req("a", list(range(8))))
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and s.requests["a"].status == Status.WAITING_FOR_REMOTE_KVS
    assert s.requests["a"].num_computed_tokens == 8
    s.update_from_output(out, ModelOutput(finished_recving={"a"}))
    out = s.schedule()
    (a,) = out.new
    assert a.num_computed_tokens == 7 and a.num_scheduled_tokens == 1   # S:3171-3172
    assert conn.calls == [("a", 0)]                                     # no second lookup
    stats = s.update_from_output(out, ModelOutput({"a": [1]}))[0].prefill_stats
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens,
            stats.num_computed_tokens) == (0, 8, 0)


def test_prefill_stats_keep_the_first_admission_after_a_preemption():
    conn = FixedConnector(ext=0, load_async=False)
    s = Scheduler(cfg(num_blocks=5, max_num_batched_tokens=5), conn)   # 4 usable blocks
    s.add_request(req("a", list(range(8)), max_tokens=3))   # at most 11 tokens: 3 blocks
    out = s.schedule()                                   # a: 5 of 8, 2 blocks
    s.update_from_output(out, decode_tokens(s, out))
    s.add_request(req("b", list(range(100, 108)), max_tokens=20))
    out = s.schedule()                                   # a: 3 (done), b: 2 of 8, 1 block
    assert out.num_scheduled_tokens == {"a": 3, "b": 2}
    s.update_from_output(out, decode_tokens(s, out))
    out = s.schedule()                                   # a takes the last block; b needs one more
    assert out.preempted_req_ids == {"b"}                # b preempted mid-prefill, before any output
    conn.ext = {"b": 4}                                  # the external store grew meanwhile
    for _ in range(20):
        if "b" in {x.req_id for x in out.resumed}:
            break
        s.update_from_output(out, decode_tokens(s, out))
        out = s.schedule()
    assert next(x for x in out.resumed if x.req_id == "b").num_computed_tokens == 4
    for _ in range(20):
        res = {r.req_id: r for r in s.update_from_output(out, decode_tokens(s, out))}
        if "b" in res:
            break
        out = s.schedule()
    stats = res["b"].prefill_stats
    # S:1074: only lookups before the first preemption set the stats
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (0, 0)
    assert res["b"].legacy_counters == (0, 0)


def test_invalid_block_truncates_to_the_block_and_a_shared_block_reverts_the_other():
    conn = FixedConnector(ext=6, load_async=False)
    s = Scheduler(cfg(load_failure_policy="recompute"), conn)
    s.add_request(req("a", list(range(12))))
    out = s.schedule()
    (a,) = out.new
    assert a.num_computed_tokens == 6 and a.num_scheduled_tokens == 6
    bad = a.block_ids[1]                                 # holds positions 4..7
    res = s.update_from_output(out, ModelOutput({"a": [1]}, invalid_block_ids={bad}))
    assert res == []                                     # the step's output is skipped
    assert s.requests["a"].num_computed_tokens == 4      # idx 1 * block size
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8}


def test_a_shared_block_an_async_load_claimed_is_claimed_again_by_a_running_request():
    """S:3274: the async loads and the running requests are two passes, each
    with its own set of claimed blocks. A shared block that failed is claimed
    by the first async load holding it, and claimed again by the first running
    request holding it, which is cut back to that block too."""

    class Conn(FixedConnector):
        def get_num_new_matched_tokens(self, r, n):
            return {"l": (4, True), "r": (4, False)}.get(r.request_id, (0, False))

    s = Scheduler(cfg(load_failure_policy="recompute"), Conn(0, False))
    s.add_request(req("p", list(range(8)) + [100, 101, 102, 103], max_tokens=1))
    s.update_from_output(s.schedule(), ModelOutput({"p": [99]}))   # p finishes; its blocks stay cached
    assert "p" not in s.requests
    s.add_request(req("l", list(range(8)) + list(range(200, 208))))
    s.add_request(req("r", list(range(8)) + list(range(300, 308))))
    out = s.schedule()
    l_, r_ = s.requests["l"], s.requests["r"]
    assert l_.status == Status.WAITING_FOR_REMOTE_KVS and l_.num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"r": 4} and r_.num_computed_tokens == 16
    shared = s.kv.get_block_ids("l")[1]                   # p's second block, hit by both
    assert s.kv.get_block_ids("r")[1] == shared
    s.update_from_output(out, ModelOutput({"r": [1]}, invalid_block_ids={shared}))
    assert l_.num_computed_tokens == 4                    # idx 1 * block size (async pass)
    assert r_.num_computed_tokens == 4                    # claimed again (sync pass), not 12


def test_fail_policy_finishes_the_request_with_an_error():
    conn = FixedConnector(ext=4, load_async=True)
    s = Scheduler(cfg(), conn)
    s.add_request(req("a", list(range(10))))
    out = s.schedule()
    res = s.update_from_output(out, ModelOutput(failed_recving={"a"}, finished_recving={"a"}))
    assert [(r.req_id, r.finish_reason) for r in res] == [("a", "error")]
    assert "a" not in s.requests and s.kv.pool.num_free_blocks == 15


def test_abort_while_loading_keeps_blocks_until_the_load_finishes():
    conn = FixedConnector(ext=4, load_async=True)
    s = Scheduler(cfg(), conn)
    s.add_request(req("a", list(range(10))))
    out = s.schedule()
    held = len(s.kv.get_block_ids("a"))
    s.finish_requests(["a"], Status.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == 15 - held
    s.update_from_output(out, ModelOutput(finished_recving={"a"}))
    assert s.kv.pool.num_free_blocks == 15 and "a" not in s.requests


def test_stop_token_and_length_cap():
    s = Scheduler(cfg())
    s.add_request(req("a", [1, 2, 3], max_tokens=5, eos_token_id=9))
    s.add_request(req("b", [4, 5, 6], max_tokens=2))
    out = s.schedule()
    res = {r.req_id: r for r in s.update_from_output(out, ModelOutput({"a": [9], "b": [1]}))}
    assert res["a"].finish_reason == "stop" and res["b"].finish_reason is None
    out = s.schedule()
    res = {r.req_id: r for r in s.update_from_output(out, ModelOutput({"b": [1]}))}
    assert res["b"].finish_reason == "length"
    assert out.finished_req_ids == {"a"}


def test_admission_needs_room_for_the_whole_sequence_by_default():
    # 4 usable blocks; a's first chunk takes 1. b's first chunk (4 tokens) needs 1
    # block, but its whole 16-token prompt needs 4: only 3 are free (KM:522-539).
    for reserve, admitted in ((True, False), (False, True)):
        s = Scheduler(cfg(num_blocks=5, max_num_batched_tokens=12, long_prefill_token_threshold=4,
                          reserve_full_isl=reserve))
        s.add_request(req("a", list(range(8)), max_tokens=2))
        s.add_request(req("b", list(range(100, 116)), max_tokens=2))
        out = s.schedule()
        assert ("b" in out.num_scheduled_tokens) is admitted, reserve
        assert out.num_scheduled_tokens["a"] == 4


def test_max_num_active_seqs_caps_admission_below_max_num_seqs():
    s = Scheduler(cfg(max_num_seqs=8, max_num_active_seqs=1))
    s.add_request(req("a", [1, 2, 3]))
    s.add_request(req("b", [4, 5, 6]))
    assert set(s.schedule().num_scheduled_tokens) == {"a"}



def test_chunked_prefill_off_a_prompt_that_does_not_fit_waits_whole_and_blocks_the_queue():
    """S:1160-1167, budget 16: "a" (10 tokens) is admitted; "b" (10) does not fit
    in the 6 left, so it is not split, and "c" (2) behind it waits too. With
    chunked prefill on, "b" gets a 6-token chunk and "c" nothing (the budget
    is spent)."""
    def first_step(chunked: bool) -> dict:
        s = Scheduler(cfg(max_num_batched_tokens=16, enable_chunked_prefill=chunked))
        for base, rid, n in ((10, "a", 10), (30, "b", 10), (50, "c", 2)):
            s.add_request(req(rid, list(range(base, base + n))))   # no shared prefix
        return dict(s.schedule().num_scheduled_tokens)

    assert first_step(chunked=False) == {"a": 10}
    assert first_step(chunked=True) == {"a": 10, "b": 6}


def test_chunked_prefill_off_still_splits_at_the_long_prefill_threshold():
    """The threshold caps a prefill before the check (S:1155-1156): with a
    threshold of 8 and a budget of 16, two 10-token prompts each get 8, and the
    next step finishes both (2 each), chunked prefill off or not."""
    s = Scheduler(cfg(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                      enable_chunked_prefill=False))
    s.add_request(req("a", list(range(10, 20))))
    s.add_request(req("b", list(range(30, 40))))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"a": 8, "b": 8}
    s.update_from_output(out, ModelOutput({}))
    assert dict(s.schedule().num_scheduled_tokens) == {"a": 2, "b": 2}


# --------------------------------------------------------------------------- async scheduling (AS)


def test_async_decode_holds_a_placeholder_and_skips_the_step_past_max_tokens():
    """AsyncScheduler (AS:25-78, S:664-678), worked by hand for a 6-token prompt,
    max_tokens 3, with the engine's order: step N+1 is scheduled before step N's
    output comes back, at most two steps in flight."""
    s = Scheduler(cfg(async_scheduling=True))
    r = req("a", [1, 2, 3, 4, 5, 6], max_tokens=3)
    s.add_request(r)
    out0 = s.schedule()                       # the prefill samples the 1st token
    assert out0.num_scheduled_tokens == {"a": 6}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (6, 1)
    out1 = s.schedule()                       # T = 6 + 1 placeholder - c 6 = 1
    assert out1.num_scheduled_tokens == {"a": 1}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (7, 2)
    s.update_from_output(out0, ModelOutput({"a": [11]}))
    assert (r.num_tokens, r.num_output_placeholders) == (7, 1)
    # the output caches blocks up to c - placeholders = 6: one full block of 4
    assert s.kv.num_cached_block["a"] == 1
    out2 = s.schedule()                       # 7 + 2 - 1 = 8 < 6 + 3: one more step
    assert out2.num_scheduled_tokens == {"a": 1}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (8, 2)
    s.update_from_output(out1, ModelOutput({"a": [12]}))
    assert (r.num_tokens, r.num_output_placeholders) == (8, 1)
    assert s.kv.num_cached_block["a"] == 1    # 8 - 1 = 7 tokens: still one full block
    out3 = s.schedule()                       # 8 + 2 - 1 = 9 >= 9: the last token is in flight
    assert out3.num_scheduled_tokens == {}
    res = s.update_from_output(out2, ModelOutput({"a": [13]}))
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in res] == [("a", [13], "length")]
    assert "a" not in s.requests


def test_async_preemption_makes_output_in_flight_stale():
    """A request preempted while its step is in flight (S:1596-1607): its
    placeholders go to 0 and its in-flight tokens become stale; the stale output's
    token is still appended but changes no counter, and until it is back the
    request is not admitted again (S:934, S:2080-2087)."""
    s = Scheduler(cfg(async_scheduling=True))
    r = req("a", [1, 2, 3, 4, 5, 6])
    s.add_request(r)
    out0 = s.schedule()
    s.running.remove(r)                       # as the running pass does before preempting
    s._preempt_request(r)
    assert (r.num_computed_tokens, r.num_output_placeholders) == (0, 0)
    assert (r.num_in_flight_tokens, r.num_stale_output_tokens) == (6, 6)
    assert s.schedule().num_scheduled_tokens == {}   # skipped: stale output still to come
    s.update_from_output(out0, ModelOutput({"a": [11]}))
    assert (r.num_tokens, r.num_output_placeholders, r.num_stale_output_tokens) == (7, 0, 0)
    assert r.status == Status.PREEMPTED and s.kv.num_cached_block.get("a", 0) == 0
    # Resumed with a fresh lookup: the first block, cached when it was allocated
    # (4.3) and freed to the tail, is a local hit of 4; the other 3 tokens, the
    # stale token among them, are computed again.
    out = s.schedule()
    assert [(x.req_id, x.num_computed_tokens) for x in out.resumed] == [("a", 4)]
    assert out.num_scheduled_tokens == {"a": 3}


def test_synchronous_scheduler_holds_no_placeholder():
    s = Scheduler(cfg())
    r = req("a", [1, 2, 3, 4, 5, 6], max_tokens=3)
    s.add_request(r)
    s.schedule()
    assert (r.num_computed_tokens, r.num_output_placeholders) == (6, 0)
    assert s.schedule().num_scheduled_tokens == {}   # nothing to compute until the token is back


def test_deferred_free_waits_for_the_steps_in_flight():
    """defer_block_free (async scheduling with a consumer connector, S:185-192,
    S:2759-2801): an aborted request's blocks go back to the pool only once the
    last non-empty step that scheduled it has been processed. Worked by hand: a
    6-token prompt holds 2 blocks of 4 after its first decode step is scheduled."""
    s = Scheduler(cfg(async_scheduling=True, defer_block_free=True))
    r = req("a", [1, 2, 3, 4, 5, 6], max_tokens=8)
    s.add_request(r)
    out0 = s.schedule()                          # fence 1
    out1 = s.schedule()                          # fence 2: position 6, a second block
    free = s.kv.pool.num_free_blocks
    assert free == 16 - 1 - 2 and r.last_sched_seq == 2
    s.finish_requests(["a"], Status.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == free      # step 2 may still write them
    s.update_from_output(out0, ModelOutput({"a": [11]}))
    assert s.kv.pool.num_free_blocks == free      # processed 1 < fence 2
    s.update_from_output(out1, ModelOutput({"a": [12]}))
    assert s.kv.pool.num_free_blocks == 16 - 1   # processed 2: back in the pool


def test_without_deferral_the_blocks_come_back_at_once():
    s = Scheduler(cfg(async_scheduling=True))
    s.add_request(req("a", [1, 2, 3, 4, 5, 6], max_tokens=8))
    s.schedule()
    s.schedule()
    s.finish_requests(["a"], Status.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == 16 - 1


# --------------------------------------------------------------------------- pause states


def test_paused_for_new_requests_the_running_go_on_and_only_a_finished_load_is_admitted():
    """S:914-917: under PAUSED_NEW the waiting pass takes only the queue of
    requests that hold blocks (a completed async load); S:615-617: under
    PAUSED_ALL the token budget is 0, so nothing at all is scheduled."""
    class OneAsyncLoad(FixedConnector):
        def get_num_new_matched_tokens(self, r, n):
            self.calls.append((r.request_id, n))
            return (8, True) if r.request_id == "loaded" else (0, False)

    conn = OneAsyncLoad(ext=0, load_async=False)
    s = Scheduler(cfg(), conn)
    s.add_request(req("run", list(range(5)), max_tokens=20))
    s.add_request(req("loaded", list(range(100, 108))))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"run"}
    assert s.requests["loaded"].status == Status.WAITING_FOR_REMOTE_KVS
    s.update_from_output(out, ModelOutput({"run": [1]}, finished_recving={"loaded"}))

    s.set_pause_state("PAUSED_NEW")
    s.add_request(req("new", list(range(200, 204))))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"run": 1, "loaded": 1}   # the loaded one: its last token
    assert s.requests["new"].status == Status.WAITING and conn.calls == [("run", 0), ("loaded", 0)]
    s.update_from_output(out, ModelOutput({"run": [2], "loaded": [3]}))

    s.set_pause_state("PAUSED_ALL")
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and not out.preempted_req_ids
    assert [r.request_id for r in s.running] == ["run", "loaded"]

    s.set_pause_state("UNPAUSED")
    out = s.schedule()
    assert out.num_scheduled_tokens == {"run": 1, "loaded": 1, "new": 4}


def test_a_request_preempted_while_paused_for_new_requests_waits_for_the_resume():
    """A preempted request goes back to the waiting queue (it holds no blocks),
    which PAUSED_NEW does not admit from (S:914-917), even with room for it."""
    s = Scheduler(cfg(num_blocks=5))                               # 4 usable blocks
    s.add_request(req("a", list(range(8)), max_tokens=2))           # 2 blocks
    s.add_request(req("b", list(range(100, 108)), max_tokens=20))   # 2 blocks
    out = s.schedule()
    s.update_from_output(out, decode_tokens(s, out))    # 9 tokens each: a needs a 3rd block
    s.set_pause_state("PAUSED_NEW")
    out = s.schedule()
    assert out.preempted_req_ids == {"b"} and set(out.num_scheduled_tokens) == {"a"}
    s.update_from_output(out, decode_tokens(s, out))    # a's 2nd token: max_tokens, finished
    assert "a" not in s.requests and not s.running
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and s.requests["b"].status == Status.PREEMPTED
    s.set_pause_state("UNPAUSED")
    out = s.schedule()
    assert [r.req_id for r in out.resumed] == ["b"]
