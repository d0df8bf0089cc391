"""diff_files: alignment by request and by each request's own history."""

from __future__ import annotations

import copy

import pytest

from kvtrace.diff import diff_files
from kvtrace.trace import TraceError
from kvtrace.trace.events import Abort, Output, PromptStats, Step

from tests._paths import REPO
from tests.mini_traces import load_records, save_records, write_mini_trace


def _bump_running_nct(req: str, step: int, by: int = 1):
    def edit(ev):
        if isinstance(ev, Step) and ev.step == step:
            for s in ev.running:
                if s.req == req:
                    s.num_computed_tokens += by
    return edit


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst"])
def test_self_diff_is_empty(tmp_path, name):
    a = write_mini_trace(tmp_path / name)
    r = diff_files(a, a)
    assert r.divergences == []
    assert r.identical
    assert r.only_a == [] and r.only_b == []
    assert r.requests_compared == 3 and r.divergent_requests == 0
    assert r.steps_a == r.steps_b == 3


def test_modified_copy_names_request_and_step(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_bump_running_nct("r2", step=2, by=3))
    r = diff_files(b, a)
    assert len(r.divergences) == 1
    d = r.divergences[0]
    assert (d.step, d.req, d.field) == (2, "r2", "num_computed_tokens")
    assert (d.recorded, d.expected) == (13, 10)
    assert d.kind == "diff" and d.rule == "diff: 3rd schedule of r2 differs"
    assert d.line is not None and d.seq is not None
    assert r.divergent_requests == 1 and r.requests_compared == 3


def test_direction_a_is_recorded_b_is_expected(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_bump_running_nct("r1", step=1))
    d = diff_files(a, b).divergences[0]
    assert (d.req, d.step, d.recorded, d.expected) == ("r1", 1, 5, 6)


def test_shifted_step_numbering_still_aligns(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl.gz", empty_step_at=1)
    r = diff_files(a, b)
    assert r.divergences == []
    assert (r.steps_a, r.steps_b) == (3, 4)


def test_shifted_numbering_reports_step_of_trace_a(tmp_path):
    # B has an extra empty step (its steps are numbered one higher after it)
    # and a planted difference at its step 3, which is step 2 in A.
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", empty_step_at=1, edit=_bump_running_nct("r0", step=3))
    r = diff_files(a, b)
    assert [(d.step, d.req, d.field) for d in r.divergences] == [(2, "r0", "num_computed_tokens")]


def test_first_divergence_per_request_only(tmp_path):
    def edit(ev):
        _bump_running_nct("r2", step=1)(ev)
        _bump_running_nct("r2", step=2)(ev)
        if isinstance(ev, Output) and ev.step == 2 and "r0" in ev.sampled:
            ev.sampled["r0"] = [ev.sampled["r0"][0] + 1]
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=edit)
    r = diff_files(b, a)
    got = {(d.req, d.step, d.field) for d in r.divergences}
    assert got == {("r2", 1, "num_computed_tokens"), ("r0", 2, "sampled")}
    assert r.divergent_requests == 2


def test_earliest_channel_wins(tmp_path):
    # The prompt stats (written after step 0's output) differ, and so does a
    # later schedule: the earlier one in trace A is reported.
    def edit(ev):
        _bump_running_nct("r1", step=2)(ev)
        if isinstance(ev, PromptStats) and ev.req == "r1":
            ev.prefill_stats.num_local_cached_tokens = 4
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=edit)
    [d] = diff_files(b, a).divergences
    assert (d.req, d.step, d.field) == ("r1", 0, "prefill_stats.num_local_cached_tokens")


def test_requests_only_in_one_trace(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl", requests={"r0": 6, "r1": 5, "r2": 9})
    b = write_mini_trace(tmp_path / "b.jsonl", requests={"r0": 6, "r1": 5, "r3": 4})
    r = diff_files(a, b)
    assert r.only_a == ["r2"] and r.only_b == ["r3"]
    # A request only in B has no place in A: the row names its arrival in B.
    r3_line = next(n for n, text in enumerate(b.read_text().splitlines(), 1)
                   if '"arrival"' in text and '"r3"' in text)
    assert {(d.req, d.rule) for d in r.divergences} == {
        ("r2", "diff: request only in A"), ("r3", f"diff: request only in B (B's line {r3_line})")}
    assert r.requests_compared == 2 and r.divergent_requests == 0


def test_more_schedules_in_one_trace(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl", max_tokens=3)
    b = write_mini_trace(tmp_path / "b.jsonl", max_tokens=4)
    r = diff_files(a, b)
    by_req = {d.req: d for d in r.divergences}
    assert set(by_req) == {"r0", "r1", "r2"}
    assert by_req["r0"].field == "max_tokens"  # the arrival differs first


def test_finish_reason_differs(tmp_path):
    def edit(ev):
        if isinstance(ev, Output) and "r1" in ev.finished:
            ev.finished["r1"] = "stop"
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=edit)
    [d] = diff_files(a, b).divergences
    assert (d.req, d.field, d.recorded, d.expected) == ("r1", "finish_reason", "length", "stop")


def _one_request_trace(path, finish_with_abort: bool):
    from kvtrace.trace import TraceWriter
    from kvtrace.trace.events import Arrival, ScheduledNew

    from tests.mini_traces import mini_header

    with TraceWriter(path, mini_header()) as w:
        w.write(Arrival(seq=w.next_seq(), req="x", prompt_token_ids=[1, 2, 3], max_tokens=2))
        w.write(Step(seq=w.next_seq(), step=0, new=[ScheduledNew(
            req="x", num_computed_tokens=0, num_scheduled_tokens=3, block_ids=[1])]))
        if finish_with_abort:
            w.write(Output(seq=w.next_seq(), step=0, sampled={"x": [5]}))
            w.write(Abort(seq=w.next_seq(), reqs=["x"]))
        else:
            w.write(Output(seq=w.next_seq(), step=0, sampled={"x": [5]}, finished={"x": "length"}))
    return path


def test_abort_counts_as_finish(tmp_path):
    aborted = _one_request_trace(tmp_path / "a.jsonl", finish_with_abort=True)
    capped = _one_request_trace(tmp_path / "b.jsonl", finish_with_abort=False)
    assert diff_files(aborted, aborted).divergences == []
    [d] = diff_files(aborted, capped).divergences
    assert (d.req, d.field, d.recorded, d.expected) == ("x", "finish_reason", "abort", "length")


def test_config_difference_is_reported(tmp_path):
    from kvtrace.trace.events import Header, SchedulerConfig
    from tests import mini_traces

    a = write_mini_trace(tmp_path / "a.jsonl")
    orig = mini_traces.mini_header
    try:
        mini_traces.mini_header = lambda **m: Header(
            engine="vllm", engine_version="0.32.0",
            config=SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64,
                                   max_num_seqs=8, max_model_len=128))
        b = write_mini_trace(tmp_path / "b.jsonl")
    finally:
        mini_traces.mini_header = orig
    [d] = diff_files(a, b).divergences
    assert (d.req, d.field, d.recorded, d.expected) == (None, "config.num_blocks", 64, 32)


def test_truncated_trace_is_diffed_up_to_the_cut(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    lines = a.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:-6]) + lines[-6][:10])
    r = diff_files(cut, cut)
    assert r.divergences == []
    assert "cut off" in r.truncation_a
    r = diff_files(cut, a)
    assert r.truncation_a and r.truncation_b is None
    # What only the whole trace holds after the cut is not a divergence.
    assert r.divergences == [] and r.identical
    assert sorted(r.cut_short) == ["r0", "r1", "r2"] and r.requests_compared == 3
    # Both ways round.
    r = diff_files(a, cut)
    assert r.divergences == [] and sorted(r.cut_short) == ["r0", "r1", "r2"]


def test_a_divergence_before_the_cut_is_still_found(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_bump_running_nct("r1", 1))
    lines = b.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:-3]) + lines[-3][:10])   # in step 2, after step 1's output
    r = diff_files(cut, a)
    assert r.truncation_a
    assert [(d.req, d.step, d.field) for d in r.divergences] == [("r1", 1, "num_computed_tokens")]
    assert "r1" not in r.cut_short and r.cut_short


# --------------------------------------------------------------------------- embedded recordings


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """Embedded recordings: with preemptions, and with a connector (aborts,
    async loads), as records."""
    from kvtrace.engine import record_embedded

    d = tmp_path_factory.mktemp("recorded")
    return {name: load_records(record_embedded(d / f"{name}.jsonl", workload=name).path)
            for name in ("kv-pressure", "offload")}


def _line_of(records: list[dict], rec: dict) -> int:
    return next(n for n, r in enumerate(records, 1) if r is rec)


def test_a_preempted_requests_state_is_compared(recorded, tmp_path):
    """A preemption that leaves a stale counter is named at the preemption, not
    when the request comes back."""
    recs = recorded["kv-pressure"]
    b = save_records(recs, tmp_path / "b.jsonl")
    spoilt = copy.deepcopy(recs)
    step = next(r for r in spoilt if r["kind"] == "step" and r.get("preempted"))
    victim = step["preempted"][0]
    state = next(st for st in step["states"] if st["req"] == victim)
    assert state["status"] == "PREEMPTED" and state["num_computed_tokens"] == 0
    state["num_computed_tokens"] = 37
    a = save_records(spoilt, tmp_path / "a.jsonl")
    r = diff_files(a, b)
    assert [(d.req, d.step, d.line, d.field, d.recorded, d.expected) for d in r.divergences] == [
        (victim, step["step"], _line_of(spoilt, step), "state.num_computed_tokens", 37, 0)]
    assert r.divergences[0].rule == f"diff: 1st preemption of {victim} differs"


def test_what_a_trace_says_of_a_request_after_it_finished_is_not_compared(recorded, tmp_path):
    """A request aborted while its async load is in flight, whose load then
    completes: both traces say so, B some steps later and with another request
    finishing early. Only that other request diverges, whichever trace is A
    (and so however far one trace is read ahead of the other)."""
    recs = copy.deepcopy(recorded["offload"])
    asks = next(i for i, r in enumerate(recs) if r["kind"] == "step"
                and any(lk.get("load_async") for lk in r.get("lookups") or ()))
    victim = next(lk["req"] for lk in recs[asks]["lookups"] if lk["load_async"])
    done = next(i for i, r in enumerate(recs) if i > asks and r["kind"] == "output"
                and victim in ((r.get("connector") or {}).get("finished_recving") or ()))
    # Abort it just before the step whose output completes its load: nothing
    # more of it after that but the completion.
    assert recs[done - 1]["kind"] == "step"
    a_recs = (recs[:done - 1] + [{"kind": "abort", "seq": 0, "reqs": [victim]}]
              + _without(recs[done - 1:done], victim) + [recs[done]] + _without(recs[done + 1:], victim))
    _renumber(a_recs)
    # B: another request finishes at step 20 instead of after the victim's load
    # completes, and five idle steps come after step 0: B is read behind A then.
    b_recs = copy.deepcopy(a_recs)
    at = next(i for i, r in enumerate(b_recs) if r["kind"] == "output" and r["step"] == 20)
    finish = {req: r["step"] for r in a_recs if r["kind"] == "output" for req in r["finished"]}
    other = max((req for req in b_recs[at]["sampled"] if req != victim), key=finish.get)
    assert finish[other] > recs[done]["step"]
    b_recs[at]["finished"][other] = "length"
    b_recs = b_recs[:at + 1] + _without(b_recs[at + 1:], other)
    for _ in range(5):
        _idle_step_before(b_recs, 1)
    a = save_records(a_recs, tmp_path / "a.jsonl")
    b = save_records(b_recs, tmp_path / "b.jsonl")
    for x, y in ((a, b), (b, a)):
        r = diff_files(x, y)
        assert {d.req for d in r.divergences} == {other}, [d.to_json() for d in r.divergences]


def _without(records: list[dict], req: str) -> list[dict]:
    """``records`` with every mention of ``req`` removed."""
    out = []
    for r in copy.deepcopy(records):
        kind = r["kind"]
        if kind in ("arrival", "prompt_stats") and r["req"] == req:
            continue
        if kind == "step":
            for name in ("new", "resumed", "running", "lookups", "states"):
                r[name] = [x for x in r.get(name) or [] if x["req"] != req]
            if r.get("loads"):
                r["loads"] = [x for x in r["loads"] if x["req"] != req]
            for name in ("preempted", "finished"):
                r[name] = [x for x in r.get(name) or [] if x != req]
        if kind == "output":
            for name in ("sampled", "finished"):
                r[name] = {k: v for k, v in (r.get(name) or {}).items() if k != req}
            r["states"] = [x for x in r.get("states") or [] if x["req"] != req]
            if r.get("connector"):
                for name in ("finished_recving", "finished_sending", "failed_recving"):
                    r["connector"][name] = [x for x in r["connector"].get(name) or [] if x != req]
        out.append(r)
    return out


def _renumber(records: list[dict]) -> None:
    for n, r in enumerate(records[1:]):
        r["seq"] = n


def _idle_step_before(records: list[dict], n: int) -> None:
    """A step that schedules nothing before step ``n``; later steps renumbered."""
    at = next(i for i, r in enumerate(records) if r["kind"] == "step" and r["step"] == n)
    for r in records:
        if r["kind"] in ("step", "output", "prompt_stats") and r["step"] >= n:
            r["step"] += 1
    records[at:at] = [{"kind": "step", "seq": 0, "step": n}, {"kind": "output", "seq": 0, "step": n}]
    _renumber(records)


def test_the_end_records_are_reported(recorded, tmp_path, capsys):
    from kvtrace.cli import run

    recs = copy.deepcopy(recorded["offload"])
    b = save_records(recs, tmp_path / "b.jsonl")
    assert recs[-1]["kind"] == "end"
    recs[-1].update(status="recorder-error", error="boom", dropped_events=3)
    a = save_records(recs, tmp_path / "a.jsonl")
    r = diff_files(a, b)
    assert r.divergences == []
    assert (r.end_a.status, r.end_a.error, r.end_a.dropped_events) == ("recorder-error", "boom", 3)
    assert r.to_json()["a"]["end"] == {"status": "recorder-error", "error": "boom", "dropped_events": 3}
    assert r.to_json()["b"]["end"]["status"] == "complete"
    assert run(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "the recorder closed this trace as 'recorder-error', 3 events dropped: boom" in out


def test_auto_pairs_by_id_when_one_trace_lacks_the_first_request(recorded, tmp_path):
    recs = recorded["offload"]
    first = next(r["req"] for r in recs if r["kind"] == "arrival")
    a = save_records(_without(recs, first), tmp_path / "a.jsonl")
    b = save_records(recs, tmp_path / "b.jsonl")
    r = diff_files(a, b)
    assert r.matched_by == "id"
    assert r.only_b == [first] and r.only_a == []
    assert [d.req for d in r.divergences] == [first]


@pytest.mark.parametrize("shape", ["prefill_stats", "legacy"])
def test_prompt_stats_are_compared_in_the_shapes_both_traces_carry(tmp_path, shape):
    """An engine that emits one shape of prompt stats, against a trace that
    carries both (kvtrace's own traces do): the shape they share is compared,
    the other is not a divergence."""
    from kvtrace.engine import record_embedded

    one = load_records(record_embedded(tmp_path / "one.jsonl", workload="offload", counters=shape).path)
    both = record_embedded(tmp_path / "both.jsonl", workload="offload").path
    other = "legacy" if shape == "prefill_stats" else "prefill_stats"
    stats = [r for r in one if r["kind"] == "prompt_stats"]
    assert stats and all(r.get(shape) and not r.get(other) for r in stats)
    assert all(r.get("legacy") and r.get("prefill_stats")
               for r in load_records(both) if r["kind"] == "prompt_stats")
    assert diff_files(save_records(one, tmp_path / "a.jsonl"), both).divergences == []
    # A change in the shape they share is found.
    name, value = next(iter(stats[0][shape].items()))
    stats[0][shape][name] = value + 5
    r = diff_files(save_records(one, tmp_path / "a.jsonl"), both)
    assert [(d.req, d.field, d.recorded, d.expected) for d in r.divergences] == [
        (stats[0]["req"], f"{shape}.{name}", value + 5, value)]


def test_unusable_input_raises_trace_error(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"not json\n")
    with pytest.raises(TraceError):
        diff_files(a, bad)


def test_memory_follows_live_requests(tmp_path):
    """Requests that come and go one after another: the differ drops each one
    once both sides have finished it, so it never holds more than a few."""
    import kvtrace.diff.align as align
    from kvtrace.trace import TraceWriter
    from kvtrace.trace.events import Arrival, ScheduledNew

    from tests.mini_traces import mini_header

    def write(path, shift):
        with TraceWriter(path, mini_header()) as w:
            step = 0
            for i in range(300):
                req = f"r{i}"
                w.write(Arrival(seq=w.next_seq(), req=req, prompt_token_ids=[i + 1, 2], max_tokens=1))
                if shift and i % 7 == 0:
                    w.write(Step(seq=w.next_seq(), step=step))
                    step += 1
                w.write(Step(seq=w.next_seq(), step=step, new=[ScheduledNew(
                    req=req, num_computed_tokens=0, num_scheduled_tokens=2, block_ids=[1])]))
                w.write(Output(seq=w.next_seq(), step=step, sampled={req: [3]}, finished={req: "length"}))
                step += 1
        return path

    a = write(tmp_path / "a.jsonl", shift=False)
    b = write(tmp_path / "b.jsonl", shift=True)
    peak = 0
    orig = align._Differ._advance

    def spy(self, side):
        nonlocal peak
        orig(self, side)
        peak = max(peak, len(self.pairs))

    align._Differ._advance = spy
    try:
        r = diff_files(a, b)
    finally:
        align._Differ._advance = orig
    assert r.divergences == [] and r.requests_compared == 300
    assert r.steps_b > r.steps_a
    assert peak <= 4


def _renamed(ids: dict[str, str]):
    """An edit that renames requests everywhere they appear."""
    from kvtrace.trace.events import Arrival

    def edit(ev):
        if isinstance(ev, (Arrival, PromptStats)):
            ev.req = ids.get(ev.req, ev.req)
        elif isinstance(ev, Step):
            for part in (ev.new, ev.resumed, ev.running, ev.states):
                for s in part:
                    s.req = ids.get(s.req, s.req)
        elif isinstance(ev, Output):
            for name in ("sampled", "finished"):
                d = getattr(ev, name)
                setattr(ev, name, {ids.get(k, k): v for k, v in d.items()})
            for s in ev.states:
                s.req = ids.get(s.req, s.req)
    return edit


def test_vllm_random_suffixes_are_matched(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl", edit=_renamed(
        {"r0": "0-a34120fd", "r1": "1-82ed55e5", "r2": "2-99241a46"}))
    b = write_mini_trace(tmp_path / "b.jsonl", edit=lambda ev: (
        _renamed({"r0": "0-989c6896", "r1": "1-bb6a7300", "r2": "2-96b2092e"})(ev),
        _bump_running_nct("2-96b2092e", step=2)(ev)))
    r = diff_files(a, b)
    assert r.matched_by == "id-prefix"
    [d] = r.divergences
    assert (d.req, d.step, d.field) == ("2-99241a46", 2, "num_computed_tokens")
    assert r.requests_compared == 3


def test_unrelated_ids_are_matched_by_arrival(tmp_path):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_renamed({"r0": "x", "r1": "y", "r2": "z"}))
    r = diff_files(a, b)
    assert r.matched_by == "arrival" and r.divergences == []
    r = diff_files(a, b, match="id")
    assert sorted(r.only_a) == ["r0", "r1", "r2"] and sorted(r.only_b) == ["x", "y", "z"]


def test_diff_names_a_skipped_load_at_the_admission_that_skipped_it(tmp_path):
    from kvtrace.engine import record_embedded

    clean = record_embedded(tmp_path / "clean.jsonl", workload="offload", seed=0)
    bad = record_embedded(tmp_path / "bad.jsonl", workload="offload", seed=0,
                          fault="no-reload-after-preempt")
    first = bad.fault_log[0]
    result = diff_files(bad.path, clean.path)
    mine = [d for d in result.divergences if d.req == first.req]
    assert mine and mine[0].step == first.step and mine[0].field == "kv_load"
    assert mine[0].recorded is None and mine[0].expected


TRACES = REPO / "traces"
# vLLM's bugs that only the shadow-KV check sees: every count agrees.
KV_ONLY = {"priority-preempt-uncomputed-hit.jsonl.gz", "spec-session-overshoot.jsonl.gz"}


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.jsonl.gz")) + sorted(TRACES.glob("faults/*.jsonl.gz"))
                         + sorted(TRACES.glob("vllm-bugs/*.jsonl.gz")), ids=lambda p: p.name)
def test_a_vllm_recording_and_its_replay(path, tmp_path):
    """``kvtrace replay -o`` writes what the reference scheduler decided; diffed
    with the recording, it agrees where replay found no decision to differ, and
    where replay found one, diff's first divergence is on the same line of the
    recording (under async scheduling an output record follows the next step's,
    so the first by line is not the first by step number). An invariant broken
    by a decision the reference shares (vLLM's own bug in traces/vllm-bugs/) is
    not a difference between the two; nor is KV content, which this replay
    does not check (the bugs of KV_ONLY show only there), nor the connector's
    cache stats, vLLM's accounting of its lookups. One of
    vLLM's bugs is a decision the reference makes otherwise: embeds-mixed-mask,
    a prefix hit on blocks of other inputs."""
    from kvtrace.replay import replay_file

    out = tmp_path / "replayed.jsonl"
    rep = replay_file(path, out=out, device=None, worker=0)
    r = diff_files(path, out)
    assert r.requests_compared > 0 and not r.only_a and not r.only_b
    # The connector's cache stats (rule 5.4) are vLLM's accounting, not a decision.
    decisions = [d for d in rep.divergences
                 if d.kind != "invariant" and not d.field.startswith("connector_cache.")]
    if path.parent.name == "vllm-bugs" and path.name != "embeds-mixed-mask.jsonl.gz":
        assert not decisions
        assert bool(rep.divergences) == (path.name not in KV_ONLY)
    if not decisions:
        assert r.divergences == [], [d.to_json() for d in r.divergences]
    else:
        assert r.divergences
        first = min(d.line for d in decisions if d.line is not None)
        assert min(d.line for d in r.divergences if d.line is not None) == first


def test_every_lookup_is_compared_where_it_happened(recorded, tmp_path):
    """While an async load is in flight the scheduler asks the connector every
    step; a different answer to the first of those questions is named at its
    own step, not lost among the later ones or moved to the admission."""
    recs = copy.deepcopy(recorded["offload"])
    b = save_records(recs, tmp_path / "b.jsonl")
    asked = [r for r in recs if r["kind"] == "step" and any(lk.get("load_async") for lk in r.get("lookups") or ())]
    first = asked[0]
    lk = next(x for x in first["lookups"] if x["load_async"])
    assert sum(x["req"] == lk["req"] for r in asked for x in r["lookups"]) > 1   # asked again later
    lk["ext"] += 1
    r = diff_files(save_records(recs, tmp_path / "a.jsonl"), b)
    n = 1 + sum(x["req"] == lk["req"] for rec in recs[:recs.index(first)] if rec["kind"] == "step"
                for x in rec.get("lookups") or ())
    nth = {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
    assert [(d.req, d.step, d.line, d.field, d.recorded, d.expected, d.rule) for d in r.divergences] == [
        (lk["req"], first["step"], _line_of(recs, first), "lookup.ext", lk["ext"], lk["ext"] - 1,
         f"diff: {nth} lookup of {lk['req']} differs")]


def test_what_the_other_trace_holds_before_the_cut_is_still_compared(tmp_path):
    """B runs r0-r2 in steps 0-2, then r9 in steps 3-5; A is the same except that
    it never schedules r2, and its recording has no end record. B's schedules of
    r2 come before A's cut (step 5): they are divergences, not past the cut."""
    one = load_records(write_mini_trace(tmp_path / "one.jsonl"))
    two = load_records(write_mini_trace(tmp_path / "two.jsonl", requests={"r9": 6}))
    nseq = max(r["seq"] for r in one[1:-1]) + 1
    for r in two[1:-1]:
        r["seq"] += nseq
        if "step" in r:
            r["step"] += 3
    b_recs = one[:-1] + two[1:-1] + [dict(one[-1], seq=10 ** 6)]
    a_recs = [r for r in _without(b_recs, "r2")]
    a_arrival = next(r for r in b_recs if r["kind"] == "arrival" and r["req"] == "r2")
    a_recs.insert(b_recs.index(a_arrival), copy.deepcopy(a_arrival))   # r2 arrives, never runs
    b = save_records(b_recs, tmp_path / "b.jsonl")
    for name, recs in (("whole", a_recs), ("cut", a_recs[:-1])):
        r = diff_files(save_records(recs, tmp_path / f"a-{name}.jsonl"), b)
        assert (r.truncation_a is not None) == (name == "cut")
        assert [(d.req, d.rule) for d in r.divergences] == [("r2", "diff: 1st schedule of r2 only in B (B's step 0, line 5)")], name


def test_a_cut_between_an_output_and_its_prompt_stats_is_no_divergence(tmp_path):
    """The output of step 0 finishes every request; A is cut inside the prompt
    stats that follow it. They may lie past the cut: not a divergence."""
    whole = write_mini_trace(tmp_path / "whole.jsonl", max_tokens=1)
    lines = whole.read_bytes().splitlines(keepends=True)
    assert b'"prompt_stats"' in lines[6] or b'prefill_stats' in lines[6]
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:6]) + lines[6][:20])
    for x, y in ((cut, whole), (whole, cut)):
        r = diff_files(x, y)
        assert r.divergences == [] and r.cut_short, [d.to_json() for d in r.divergences]


def test_an_id_used_again_after_its_request_finished_is_still_compared(tmp_path):
    """r0 comes back once its first request has finished (vLLM allows it); the
    two traces differ only in the second r0's block table."""
    one = load_records(write_mini_trace(tmp_path / "one.jsonl", requests={"r0": 6, "r1": 5, "r2": 9}))
    two = load_records(write_mini_trace(tmp_path / "two.jsonl", requests={"r0": 6}))
    head, body, end = one[0], one[1:-1], one[-1]
    nseq = max(r["seq"] for r in body) + 1
    nstep = max(r["step"] for r in body if r["kind"] == "step") + 1

    def again(blocks):
        out = []
        for r in copy.deepcopy(two[1:-1]):
            r["seq"] += nseq
            if "step" in r:
                r["step"] += nstep
            for x in r.get("new", []) if blocks else ():
                x["block_ids"] = blocks
            out.append(r)
        return out

    a = save_records([head] + body + again(None) + [dict(end, seq=10 ** 6)], tmp_path / "a.jsonl")
    b = save_records([head] + body + again([40, 41]) + [dict(end, seq=10 ** 6)], tmp_path / "b.jsonl")
    for x, y in ((a, b), (b, a)):
        r = diff_files(x, y)
        assert [(d.req, d.step, d.field) for d in r.divergences] == [("r0", nstep, "block_ids")]


def test_a_request_admitted_a_step_later_still_lines_up(recorded, tmp_path):
    """B has one more step before a request's admission, in which the engine
    looked it up (the same answer) and could not admit it yet."""
    recs = recorded["offload"]
    i = next(i for i, r in enumerate(recs) if r["kind"] == "step" and r["step"] > 5 and r.get("new")
             and any(lk["req"] == r["new"][0]["req"] and not lk.get("load_async") for lk in r.get("lookups") or ()))
    s = recs[i]
    req = s["new"][0]["req"]
    lk = next(x for x in s["lookups"] if x["req"] == req)
    st = next(x for x in s["states"] if x["req"] == req)
    extra = {"kind": "step", "seq": 0, "step": s["step"], "new": [], "resumed": [], "running": [],
             "preempted": [], "finished": [], "lookups": [lk], "loads": [],
             "states": [dict(st, status="WAITING", num_computed_tokens=0, block_ids=[])],
             "num_free_blocks": s.get("num_free_blocks")}
    extra_out = {"kind": "output", "seq": 0, "step": s["step"], "sampled": {}, "finished": {}, "states": []}
    b = copy.deepcopy(recs)
    for r in b[i:]:
        if "step" in r:
            r["step"] += 1
    b[i:i] = [extra, extra_out]
    _renumber(b)
    a = save_records(recs, tmp_path / "a.jsonl")
    r = diff_files(a, save_records(b, tmp_path / "b.jsonl"))
    assert r.divergences == [], [d.to_json() for d in r.divergences]


def _abort_pair(tmp_path):
    """An embedded-engine trace with one abort of two requests, and its records."""
    from kvtrace.engine import record_workload

    from tests.mini_traces import abort_workload

    a = tmp_path / "a.jsonl"
    record_workload(a, abort_workload("x", "y"))
    return a, load_records(a)


def test_an_abort_split_into_one_call_per_request_in_the_same_order_is_no_divergence(tmp_path):
    """vLLM replay finishes an abort's ids one call per id: the same order
    before the same step is the same abort."""
    a, records = _abort_pair(tmp_path)
    at = next(i for i, r in enumerate(records) if r.get("kind") == "abort")
    one = records[at]
    split = [dict(one, reqs=[req]) for req in one["reqs"]]
    records[at:at + 1] = split
    for seq, r in enumerate(records[1:]):
        r["seq"] = seq
    b = save_records(records, tmp_path / "b.jsonl")
    assert diff_files(a, b).divergences == []
    assert diff_files(b, a).divergences == []


def _with_pauses(records: list[dict], pauses: dict[int, str]) -> list[dict]:
    """``records`` with a pause_state record before each index of ``pauses``,
    sequence numbers renumbered."""
    out = [records[0]]
    for i, r in enumerate(records[1:], 1):
        if i in pauses:
            out.append({"kind": "pause_state", "seq": 0, "state": pauses[i]})
        out.append(dict(r))
    for n, r in enumerate(out[1:]):
        r["seq"] = n
    return out


def test_diff_compares_the_pause_states_of_two_traces(tmp_path):
    """The k-th pause state of A against the k-th of B (trace format 3.2b), and
    one only a trace has; only the first that differs is reported."""
    records = load_records(TRACES / "preemption.jsonl.gz")
    steps = [i for i, r in enumerate(records) if r["kind"] == "step"]
    at1, at2 = steps[3], steps[9]
    a = save_records(_with_pauses(records, {at1: "PAUSED_NEW", at2: "UNPAUSED"}), tmp_path / "a.jsonl")
    assert diff_files(a, a).divergences == []
    b = save_records(_with_pauses(records, {at1: "PAUSED_ALL", at2: "UNPAUSED"}), tmp_path / "b.jsonl")
    [d] = diff_files(a, b).divergences
    assert (d.field, d.rule, d.recorded, d.expected) == (
        "pause_state", "diff: 1st pause state differs", {"state": "PAUSED_NEW"}, {"state": "PAUSED_ALL"})
    assert d.line == at1 + 1 and d.step == records[steps[2]]["step"]
    c = save_records(_with_pauses(records, {at1: "PAUSED_NEW"}), tmp_path / "c.jsonl")
    [d] = diff_files(a, c).divergences
    assert (d.rule, d.recorded, d.expected) == ("diff: 2nd pause state differs", {"state": "UNPAUSED"}, None)
    # both pause states differ: only the first is reported
    e = save_records(_with_pauses(records, {at1: "PAUSED_ALL", at2: "PAUSED_NEW"}), tmp_path / "e.jsonl")
    assert [d.rule for d in diff_files(a, e).divergences] == ["diff: 1st pause state differs"]
    # a reset that differs too is reported on its own
    f_records = _with_pauses(records, {at1: "PAUSED_ALL", at2: "UNPAUSED"})
    f_records.insert(at2 + 3, {"kind": "reset_prefix_cache", "seq": 0, "reset_running_requests": False,
                               "succeeded": True})
    for n, r in enumerate(f_records[1:]):
        r["seq"] = n
    f = save_records(f_records, tmp_path / "f.jsonl")
    assert sorted(d.rule for d in diff_files(a, f).divergences) == [
        "diff: 1st pause state differs", "diff: 1st prefix-cache reset differs"]


# --------------------------------------------------------------------------- what the command shows


@pytest.fixture(scope="module")
def overshoot_pair(tmp_path_factory):
    """The offload workload with and without a fault: 3 of 22 requests diverge
    (doc-4 first, then doc-16 and doc-17)."""
    from kvtrace.engine import record_embedded

    d = tmp_path_factory.mktemp("pair")
    record_embedded(d / "bad.jsonl.gz", workload="offload", fault="async-load-overshoot")
    record_embedded(d / "good.jsonl.gz", workload="offload")
    return d / "bad.jsonl.gz", d / "good.jsonl.gz"


def _diff_cli(capsys, *argv) -> tuple[int, str, str]:
    from kvtrace import cli

    code = cli.run(["diff", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err


def test_diff_selects_what_it_shows_as_replay_does(overshoot_pair, capsys, monkeypatch):
    """--request, --field, --first and --max, as replay has them; the counts
    and the exit code stay the whole diff's."""
    import orjson

    monkeypatch.setenv("COLUMNS", "80")
    bad, good = overshoot_pair
    code, out, err = _diff_cli(capsys, bad, good)
    assert code == 1 and err == "" and all(f"{r} · step" in out for r in ("doc-4", "doc-16", "doc-17"))

    code, out, _ = _diff_cli(capsys, bad, good, "--request", "doc-16")
    assert code == 1 and "doc-16 · step" in out and "doc-4 · step" not in out, out
    assert "3 of 22 requests diverge" in out
    assert ("shown: 1 of 3 divergences (--request doc-16); the diff's first: step 44, doc-4, "
            "field num_computed_tokens") in out, out

    code, out, _ = _diff_cli(capsys, bad, good, "--request", "doc-4", "--request", "doc-17")
    assert code == 1 and "doc-16 · step" not in out and "doc-17 · step" in out, out
    assert "shown: 2 of 3 divergences (--request doc-17 --request doc-4)" in out, out

    code, out, _ = _diff_cli(capsys, bad, good, "--field", "state.")
    assert code == 1 and "shown: 0 of 3 divergences (--field state.)" in out, out
    code, out, _ = _diff_cli(capsys, bad, good, "--field", "num_computed_tokens")
    assert "shown: 3 of 3 divergences" in out, out

    code, out, _ = _diff_cli(capsys, bad, good, "--first")
    assert code == 1 and "doc-4 · step" in out and "doc-16 · step" not in out, out
    assert "… and 2 more" in out, out
    code, out, _ = _diff_cli(capsys, bad, good, "--max", "2")
    assert "doc-16 · step" in out and "doc-17 · step" not in out and "… and 1 more" in out, out

    code, out, _ = _diff_cli(capsys, bad, good, "--json", "--request", "doc-16")
    doc = orjson.loads(out)
    assert code == 1 and [d["req"] for d in doc["divergences"]] == ["doc-16"]
    assert doc["summary"]["divergent_requests"] == 3 and doc["selection"] == "--request doc-16"


def test_a_diff_that_compared_no_request_is_not_a_pass(tmp_path, capsys):
    """Two traces with no arrival: nothing compared, exit 4 (it exited 0)."""
    from kvtrace import cli
    from kvtrace.trace import TraceWriter

    from tests.mini_traces import mini_header

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (a, b):
        with TraceWriter(path, mini_header()):
            pass
    code = cli.run(["diff", str(a), str(b)])
    out, err = capsys.readouterr()
    assert code == 4 and "0 requests compared" in out, out
    assert err == f"kvtrace: nothing compared: no requests of {a} and {b} pair up\n", err


def test_a_schedule_that_raised_in_one_trace_only_is_a_divergence(tmp_path, capsys):
    """A trace whose engine failed inside schedule() (a step_failed record)
    against one where that step ran: diff ignored the failed step and named
    only what followed from the missing step, if anything."""
    import gzip

    import orjson

    from kvtrace import cli

    crashed = REPO / "traces/vllm-bugs/spec-padding-cut.jsonl.gz"
    records = [orjson.loads(x) for x in gzip.open(crashed)]
    failed = next(r for r in records if r["kind"] == "step_failed")
    ran = [r for r in records if r["kind"] != "step_failed"]
    ran[-1] = {k: v for k, v in ran[-1].items() if k != "error"} | {"status": "complete"}
    other = tmp_path / "ran.jsonl"
    other.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ran))
    code = cli.run(["diff", "--json", str(crashed), str(other)])
    doc = orjson.loads(capsys.readouterr().out)
    assert code == 1
    d = next(d for d in doc["divergences"] if d["field"] == "step_failed")
    assert d["step"] == failed["step"] and d["req"] is None
    assert d["recorded"] == {"step": failed["step"], "error": failed["error"], "where": failed["where"]}
    assert d["expected"] is None


@pytest.mark.parametrize("change,differs", [
    ({"error": "AssertionError: another message", "where": "elsewhere.py:1 in f"}, False),
    ({"error": "ValueError: Cannot get 1 free blocks from the pool"}, True),
    ({"step": None}, True),   # a step later: set below
])
def test_two_schedules_that_raised_agree_on_their_step_and_exception_class(tmp_path, capsys, change, differs):
    """Two traces that failed in schedule() at the same step with the same
    exception class agree: the message and the line are each engine's own
    words (the reference's replay -o writes its rule there). Another class,
    or another step, is a divergence."""
    import gzip

    import orjson

    from kvtrace import cli

    crashed = REPO / "traces/vllm-bugs/spec-padding-cut.jsonl.gz"
    records = [orjson.loads(x) for x in gzip.open(crashed)]
    failed = next(r for r in records if r["kind"] == "step_failed")
    if change.get("step", 0) is None:
        change = {"step": failed["step"] + 1}
    records = [r | change if r["kind"] == "step_failed" else r for r in records]
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    code = cli.run(["diff", "--json", str(crashed), str(other)])
    doc = orjson.loads(capsys.readouterr().out)
    found = [d for d in doc["divergences"] if d["field"] == "step_failed"]
    assert bool(found) == differs, doc["divergences"]
    assert code == (1 if differs else 0)
    if differs:
        assert found[0]["recorded"]["error"] == failed["error"]
