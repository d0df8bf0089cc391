"""Streaming-input sessions (vLLM's resumable requests). In the trace format,
each input chunk is an arrival under the session's id, marked ``resumable``,
and the end of its input an arrival under that id without the mark. In the
reference, a stop ends a turn, not the request (S:2465-2491, S:1650-1691,
S:2616-2628): the expectations below are worked out by hand from those lines,
not copied from a run. The real engine's sessions, replayed with no
divergence, are in tests/e2e/vllm/test_vllm_recorder.py."""

from __future__ import annotations

import pytest

from kvtrace import cli
from kvtrace.reference import ModelOutput, Request, Scheduler, SchedulerConfig, Status
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace.events import Arrival, to_json

from tests.mini_traces import load_records, save_records, write_mini_trace


def _arrival(req: str, prompt: list[int], seq: int, **kw) -> dict:
    return to_json(Arrival(seq=seq, req=req, prompt_token_ids=prompt, max_tokens=3, **kw))


def _with_second_arrival(tmp_path, first_resumable: bool, resumable: bool):
    """A mini trace whose first request (marked ``first_resumable``) gets a
    second arrival (marked ``resumable``) right after its first one (line 3),
    the later records renumbered."""
    records = load_records(write_mini_trace(tmp_path / "base.jsonl"))
    first = records[1]
    assert first["kind"] == "arrival"
    if first_resumable:
        first["resumable"] = True
    extra = _arrival(first["req"], [7, 8, 9], 0, resumable=resumable)
    records.insert(2, extra)
    for seq, r in enumerate(records[1:]):
        r["seq"] = seq
    return save_records(records, tmp_path / "edited.jsonl"), first["req"]


def test_an_ordinary_arrival_is_written_as_before():
    """The flag is written only when it is set: traces without sessions keep
    their bytes."""
    assert "resumable" not in _arrival("r", [1, 2], 0)
    assert _arrival("r", [1, 2], 0, resumable=True)["resumable"] is True


def test_a_session_s_further_chunks_and_the_end_of_its_input_are_read(tmp_path):
    for resumable in (True, False):   # a further chunk, or the end of the input
        path, req = _with_second_arrival(tmp_path, first_resumable=True, resumable=resumable)
        with TraceReader(path) as reader:
            arrivals = [e for e in reader if e.kind == "arrival" and e.req == req]
        assert [a.resumable for a in arrivals] == [True, resumable]
        assert arrivals[1].prompt_token_ids == [7, 8, 9]


def test_a_second_arrival_of_an_ordinary_request_is_still_refused(tmp_path):
    path, req = _with_second_arrival(tmp_path, first_resumable=False, resumable=True)
    with pytest.raises(TraceError) as e, TraceReader(path) as reader:
        list(reader)
    assert (e.value.line, e.value.problem) == (3, f"request '{req}' arrives twice")


def test_the_flag_must_be_a_boolean(tmp_path, capsys):
    records = load_records(write_mini_trace(tmp_path / "base.jsonl"))
    records[1]["resumable"] = "yes"
    path = save_records(records, tmp_path / "bad.jsonl")
    assert cli.run(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"kvtrace: {path}:2: field 'resumable': expected true or false, got a string"


# --------------------------------------------------------------------------- the reference

B = 4


def _scheduler(max_num_seqs: int = 2, cls: type[Scheduler] = Scheduler) -> Scheduler:
    return cls(SchedulerConfig(block_size=B, num_blocks=16, max_num_batched_tokens=64,
                               max_num_seqs=max_num_seqs, max_model_len=128))


def _chunk(rid: str, tokens: list[int], resumable: bool = True, max_tokens: int = 3) -> Request:
    return Request(rid, list(tokens), max_tokens=max_tokens, block_size=B, resumable=resumable,
                   ignore_eos=True)


def _step(s: Scheduler, sampled: dict[str, list[int]]):
    out = s.schedule()
    return out, s.update_from_output(out, ModelOutput(sampled))


def _first_turn(s: Scheduler, prompt: list[int]) -> Request:
    """A session's first turn: its prompt in one step, then tokens 50, 51, 52;
    max_tokens=3 stops it at the third (Status FINISHED_LENGTH_CAPPED's reason)."""
    s.add_request(_chunk("s", prompt))
    results = []
    for token in (50, 51, 52):
        results += _step(s, {"s": [token]})[1]
    assert results[-1].finish_reason == "length"
    return s.requests["s"]


def test_a_turn_end_without_a_next_chunk_waits_holding_its_blocks_and_a_slot():
    s = _scheduler(max_num_seqs=1)
    r = _first_turn(s, list(range(10, 18)))            # 8 tokens: 2 full blocks
    # Rewound to the tokens whose KV is written: the prompt and the first two
    # outputs (the third was sampled, never computed), and still 3 blocks held.
    assert r.status == Status.WAITING_FOR_STREAMING_REQ
    assert (r.num_computed_tokens, r.num_tokens) == (10, 11)
    assert len(s.kv.get_block_ids("s")) == 3 and s.requests["s"] is r
    assert s.num_waiting_for_streaming_input == 1
    # Its slot of max_num_seqs=1 keeps a new request out, and it is not scheduled.
    s.add_request(_chunk("other", [1, 2, 3], resumable=False))
    out, _ = _step(s, {})
    assert out.num_scheduled_tokens == {}


def test_a_chunk_given_while_the_session_waits_is_taken_at_once():
    s = _scheduler()
    r = _first_turn(s, list(range(10, 18)))
    s.add_request(_chunk("s", [7, 8, 9], max_tokens=2))
    # The outputs computed join the prompt; the one never computed (52) is gone.
    assert r.status == Status.WAITING and s.num_waiting_for_streaming_input == 0
    assert r.all_token_ids == list(range(10, 18)) + [50, 51] + [7, 8, 9]
    assert r.prompt_token_ids == r.all_token_ids and r.max_tokens == 2
    out, _ = _step(s, {"s": [60]})
    # Scheduled as a new request on its kept blocks: 10 tokens computed, 3 to go.
    assert [(x.req_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.new] == [("s", 10, 3)]
    assert r.num_output_tokens == 1 and r.status == Status.RUNNING


def test_a_chunk_given_during_a_turn_is_taken_when_the_turn_ends():
    s = _scheduler()
    s.add_request(_chunk("s", list(range(10, 18))))
    s.add_request(_chunk("s", [7, 8, 9]))               # queued: the turn is running
    r = s.requests["s"]
    assert list(r.all_token_ids) == list(range(10, 18))
    for token in (50, 51, 52):
        _step(s, {"s": [token]})
    assert r.status == Status.WAITING and s.num_waiting_for_streaming_input == 0
    assert r.all_token_ids == list(range(10, 18)) + [50, 51, 7, 8, 9]


def test_the_end_of_the_input_ends_the_session():
    # While it waits: the session is aborted and its blocks go back.
    s = _scheduler()
    _first_turn(s, list(range(10, 18)))
    free = s.kv.pool.num_free_blocks
    s.add_request(_chunk("s", [0], resumable=False))
    assert "s" not in s.requests and s.num_waiting_for_streaming_input == 0
    assert s.kv.pool.num_free_blocks == free + 3
    # During a turn: the turn's stop ends it, with the stop's reason.
    s = _scheduler()
    s.add_request(_chunk("s", list(range(10, 18))))
    s.add_request(_chunk("s", [0], resumable=False))
    results = []
    for token in (50, 51, 52):
        results += _step(s, {"s": [token]})[1]
    assert results[-1].finish_reason == "length" and "s" not in s.requests


def test_requests_held_back_by_waiting_sessions_are_not_a_stall():
    """Sessions waiting for input hold every slot: the engine schedules nothing,
    step after step, by design, and liveness does not call it stuck. The same
    wait with a slot free is (the control)."""
    from kvtrace.replay.liveness import ProgressWatch

    class Stuck(Scheduler):
        admits = True

        def _schedule_waiting(self, step) -> None:
            if self.admits:
                super()._schedule_waiting(step)

    for max_num_seqs, stalls in ((1, 0), (2, 1)):
        s = _scheduler(max_num_seqs, Stuck)
        _first_turn(s, list(range(10, 18)))
        s.add_request(_chunk("other", [1, 2, 3], resumable=False))
        if max_num_seqs == 2:   # the control: "other" is ready, yet never admitted
            s.admits = False
        watch, found = ProgressWatch(limit=8), []
        for step in range(20):
            out = s.schedule()
            assert out.num_scheduled_tokens == {}
            found += watch.after_schedule(step, out, s, None, None)
        assert len(found) == stalls
        assert all(d.req == "other" for d in found)
