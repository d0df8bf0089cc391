"""Properties checked on random inputs (hypothesis):

* random workloads and engine configurations, run through the embedded engine,
  replay with zero divergences;
* an injected fault is flagged whenever it fired (a non-empty fault log means at
  least one divergence);
* diff is symmetric: diff(A, B) and diff(B, A) name the same requests and
  fields, with recorded and expected swapped;
* reading a written trace gives back the same events (plain, gzip, zstd);
* redaction keeps replay exact and leaves no original token sequence.

Example counts are small so that the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.engine import FAULT_WORKLOADS, FAULTS, EngineStalled, build_workload
from kvtrace.engine import record_workload as engine_record
from kvtrace.engine.engine import RecordResult
from kvtrace.engine.faults import STORE_FAULTS
from kvtrace.engine.kv_store import StoreSettings
from kvtrace.engine.sampler import FIRST_ORDINARY_TOKEN
from kvtrace.engine.workloads import (PlannedAbort, PlannedArrival, PlannedPause, PlannedReset,
                                      Workload)
from kvtrace.reference import SchedulerConfig
from kvtrace.trace import TraceReader, TraceWriter
from kvtrace.trace import events as ev

from tests._paths import REPO

TRACES = REPO / "traces"
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                  HealthCheck.data_too_large])


# --------------------------------------------------------------------------- random workloads


@st.composite
def workloads(draw, store: bool | None = None, large: bool = False,
              async_scheduling: bool | None = False) -> Workload:
    """A random engine configuration and a timed list of arrivals and aborts.
    Sizes keep every request satisfiable, so the engine always finishes.
    ``large``: more requests (up to 60), longer prompts and outputs.
    ``async_scheduling``: on, off, or (None) drawn."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = random.Random(seed)
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n_req = draw(st.integers(10, 60) if large else st.integers(1, 10))
    max_prompt = draw(st.integers(4, 200 if large else 96))
    max_out = draw(st.integers(1, 64 if large else 24))
    max_model_len = max_prompt + max_out + draw(st.integers(0, 32))
    need = -(-max_model_len // block_size)           # blocks of the longest request
    num_blocks = 1 + need + draw(st.integers(0, 3 * need))
    with_store = draw(st.booleans()) if store is None else store
    if async_scheduling is None:
        async_scheduling = draw(st.booleans())
    policy_fail = draw(st.sampled_from(["fail", "recompute"]))
    max_num_batched_tokens = draw(st.integers(8, 256))
    max_num_seqs = draw(st.integers(1, 8))
    # Chunked prefill off now and then; vLLM then wants a budget that holds a
    # whole request (its config check), so that every prompt can be admitted.
    chunked = draw(st.sampled_from([True, True, True, False]))
    if not chunked:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    config = SchedulerConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 8, 16, 48])),
        load_failure_policy=policy_fail,
        # Less common settings, each off most of the time.
        max_num_scheduled_tokens=draw(st.sampled_from([None, None, None, max_num_batched_tokens // 2]))
        if chunked else None,
        watermark_blocks=draw(st.sampled_from([0, 0, 0, 1, 3])),
        reserve_full_isl=draw(st.sampled_from([True, True, False])),
        enable_chunked_prefill=chunked,
        adaptive_long_prefill_threshold=draw(st.sampled_from([False, False, False, True])),
        max_num_active_seqs=draw(st.sampled_from([None, None, None, max(1, max_num_seqs // 2)])),
        async_scheduling=async_scheduling,
    )
    vocab = draw(st.sampled_from([FIRST_ORDINARY_TOKEN + 16, 1000, 32000]))

    def toks(n):
        return tuple(rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n))

    prefixes = [toks(rng.randint(1, max_prompt)) for _ in range(rng.randint(1, 3))]
    arrivals, t = [], 0
    for i in range(n_req):
        p = rng.choice(prefixes) if rng.random() < 0.7 else ()
        p = (p + toks(rng.randint(1, max_prompt)))[:max_prompt]
        arrivals.append(PlannedArrival(t, f"q{i}", p, rng.randint(1, max_out), rng.randint(0, 2)))
        t += rng.choice((0, 0, 1, 2, 4))
    aborts = tuple(PlannedAbort(a.step + rng.randint(0, 6), a.req)
                   for a in arrivals if rng.random() < draw(st.sampled_from([0.0, 0.2])))
    settings_ = None
    if with_store:
        fails = policy_fail == "recompute" and draw(st.booleans())
        settings_ = StoreSettings(
            capacity_tokens=rng.randint(50, 3000),
            preload=tuple(prefixes[: rng.randint(0, len(prefixes))]),
            min_hit_tokens=rng.choice((1, block_size)),
            async_fraction=rng.choice((0.0, 0.3, 0.7)),
            async_delay_steps=rng.randint(1, 3),
            failed_recving_fraction=0.4 if fails else 0.0,
            invalid_blocks_fraction=0.5 if fails else 0.0,
            late_failure_fraction=0.5 if fails else 0.0,
            kv_role=rng.choice(("kv_both", "kv_producer", "kv_consumer")),
        )
    # reset_prefix_cache now and then, preempting the running requests for it half
    # the time (with a store it can fail even so: a load in flight keeps its blocks).
    resets = tuple(PlannedReset(rng.randint(0, max(t, 1) + 8), rng.random() < 0.5)
                   for _ in range(draw(st.sampled_from([0, 0, 1, 3]))))
    # Now and then a pause (trace format 3.2b): for new requests or for all,
    # resumed a few steps later.
    pauses = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        at = rng.randint(0, max(t, 1) + 8)
        pauses += [PlannedPause(at, rng.choice(("PAUSED_NEW", "PAUSED_ALL"))),
                   PlannedPause(at + rng.randint(1, 6), "UNPAUSED")]
    return Workload(f"random-{seed}", config, tuple(arrivals), aborts, settings_, vocab,
                    eos_probability=draw(st.sampled_from([0.0, 0.05])), resets=resets,
                    pauses=tuple(pauses))


def record_workload(wl: Workload, path: Path, fault: str | None = None, seed: int = 0) -> RecordResult:
    """Record a workload built here. A run that stalls (vLLM 0.32's scheduler can,
    see docs/findings.md) comes back with ``stalled`` set and its trace written."""
    try:
        result = engine_record(path, wl, fault, seed)
        result.stalled = False
    except EngineStalled as stall:
        result = stall.result
        result.stalled = True
    return result


def _only_the_stall(result, divs) -> bool:
    """A stalled run's trace replays with the stall flagged and nothing else."""
    return result.stalled and divs and all(d.field == "progress" for d in divs)


def _replay(path):
    from kvtrace.replay import replay_file

    return replay_file(path, device="cpu")


def _show(divs) -> str:
    return "\n".join(f"step {d.step} {d.req} {d.field}: {d.recorded!r} != {d.expected!r} ({d.rule})"
                     for d in divs[:5])


@settings(max_examples=25, **SLOW)
@given(wl=workloads(async_scheduling=None))
def test_random_workloads_replay_clean(tmp_path_factory, wl):
    path = tmp_path_factory.mktemp("wl") / "t.jsonl"
    rec = record_workload(wl, path)
    result = _replay(path)
    assert result.stopped is None
    # The stall may come with the failed-load bug's own face, at an earlier step.
    if _only_the_stall(rec, [d for d in result.divergences if not _failed_load_face(wl, path, d)]):
        return
    assert not rec.stalled, f"the engine stalled, and replay did not flag it\n{wl}"
    assert result.truncation is None
    divs = [d for d in result.divergences if not _failed_load_face(wl, path, d)]
    assert divs == [], f"{wl}\n{_show(divs)}"


STALE = "I8: a token sampled from KV a failed load left unloaded is discarded"


def _failed_load_face(wl, path, d) -> bool:
    """vLLM 0.32's failed-load bug under async scheduling, which the embedded
    engine reproduces as the reference does (docs/findings.md): after a failed
    load, a step in flight samples from the unloaded KV and its token is kept,
    and the request's count runs past its last token (I1); a later step then
    reads the kept token's position, which the recomputation did not write
    (kv-content). Only for a request whose table held a block an output
    reports failed, or whose load failed."""
    if not (wl.config.async_scheduling and wl.store is not None
            and (wl.store.failed_recving_fraction or wl.store.invalid_blocks_fraction)):
        return False
    if not (d.rule == STALE or (d.rule.startswith("I1") and d.field == "state.num_computed_tokens")
            or d.kind == "kv-content"):
        return False
    hit = set()
    with TraceReader(path) as r:
        for e in r:
            if e.kind == "output" and e.connector is not None:
                bad = set(e.connector.invalid_block_ids)
                hit.update(e.connector.failed_recving)
                hit.update(st.req for st in e.states if bad.intersection(st.block_ids))
    return d.req in hit


def _failing_store_workload(name: str, arrivals: list, capacity: int, preload: tuple = (),
                            delay: int = 1, kv_role: str = "kv_both", **config) -> Workload:
    """Async scheduling, one token per block, max_num_seqs 1, and a store whose
    loads fail now and then (block-level and whole), as the random workloads
    below draw them: the two examples they found."""
    cfg = SchedulerConfig(block_size=1, max_num_seqs=1, enable_prefix_caching=False,
                          load_failure_policy="recompute", async_scheduling=True, **config)
    return Workload(name, cfg, tuple(PlannedArrival(*a) for a in arrivals), (),
                    StoreSettings(capacity_tokens=capacity, preload=preload, min_hit_tokens=1,
                                  async_fraction=0.0, async_delay_steps=delay,
                                  failed_recving_fraction=0.4, invalid_blocks_fraction=0.5,
                                  late_failure_fraction=0.5, kv_role=kv_role),
                    19, eos_probability=0.0)


def test_a_request_stranded_running_after_a_failed_block_is_named(tmp_path):
    """Under async scheduling a block of q5's sync load fails while its only
    step is in flight: the step's output is dropped, but its output placeholder
    stays (as in vLLM, upstream issue 45138), so the recomputed prefill samples
    nothing and q5 waits, running, for a token no step will bring. The engine
    stalls; replay names q5 by the liveness check, and nothing else."""
    wl = _failing_store_workload("stranded", [
        (0, "q0", (18, 14, 9, 6, 11), 1, 1), (0, "q1", (13, 18, 6, 14, 16, 13), 1, 2),
        (2, "q2", (18, 14, 9, 3), 1, 2), (4, "q3", (3, 18, 13, 10, 13, 5), 1, 2),
        (4, "q4", (4, 11, 18, 15, 17, 5), 1, 1), (8, "q5", (4, 11, 18, 15, 13, 9), 1, 1)],
        capacity=332, num_blocks=8, max_num_batched_tokens=8, max_model_len=7)
    rec = record_workload(wl, tmp_path / "t.jsonl")
    assert rec.stalled
    divs = _replay(tmp_path / "t.jsonl").divergences
    assert [(d.req, d.field) for d in divs] == [("q5", "progress")]
    assert "q5 is running, yet nothing is scheduled" in divs[0].rule
    assert "1 output placeholders" in divs[0].rule


def test_the_failed_load_bug_the_embedded_engine_shares_with_vllm_is_named(tmp_path):
    """A block of q5's sync load fails while its next step is in flight: that
    step samples from the unloaded KV and its token is kept, and q5's count runs
    past its last token, as in vLLM 0.32 (docs/findings.md). Replay names both,
    and the random test accepts just these for a request hit by a failed load."""
    wl = _failing_store_workload("stale", [
        (0, "q0", (5, 11, 6, 18, 17, 6), 1, 1), (2, "q1", (5, 11, 6, 18, 17, 17), 1, 0),
        (6, "q2", (5, 11, 6, 18, 17, 9), 3, 0), (7, "q3", (5, 11, 6, 18, 17, 12), 1, 2),
        (8, "q4", (5, 11, 6, 18, 17, 16), 3, 0), (10, "q5", (5, 11, 6, 18, 17, 8), 2, 2)],
        capacity=1313, preload=((5, 11, 6, 18, 17),), delay=3,
        num_blocks=10, max_num_batched_tokens=8, max_model_len=9)
    path = tmp_path / "t.jsonl"
    assert not record_workload(wl, path).stalled
    divs = _replay(path).divergences
    assert sorted((d.req, d.rule[:3]) for d in divs) == [("q5", "I1:"), ("q5", STALE[:3])]
    assert all(_failed_load_face(wl, path, d) for d in divs)


def test_the_failed_load_bug_s_kept_token_is_read_later(tmp_path):
    """The same bug, found by the random test later: a block of q5's sync load
    fails (step 31's output) while step 32 is in flight; step 32's token is
    kept (I1, and the stale token), the prefill is recomputed from 0, and
    step 34 reads the kept token's position, which no step of q5 wrote: the
    shadow-KV check names the read. All of it is the bug's face."""
    wl = _failing_store_workload("kept-token-read", [
        (0, "q0", (18, 6, 9, 11), 7, 1), (0, "q1", (4, 3, 7, 17), 5, 0),
        (0, "q2", (18, 18, 9, 3), 6, 0), (4, "q3", (4, 3, 7, 5), 4, 0),
        (8, "q4", (4, 3, 7, 15), 4, 0), (12, "q5", (14, 13, 3, 11), 3, 0)],
        capacity=2830, preload=((18,), (4, 3, 7), (14, 13, 3, 11)), delay=2, kv_role="kv_consumer",
        num_blocks=13, max_num_batched_tokens=8, max_model_len=12)
    path = tmp_path / "t.jsonl"
    assert not record_workload(wl, path).stalled
    divs = _replay(path).divergences
    assert sorted({(d.req, d.kind) for d in divs}) == [("q5", "invariant"), ("q5", "kv-content")]
    assert any(d.rule == STALE for d in divs) and any(d.kind == "kv-content" for d in divs)
    assert all(_failed_load_face(wl, path, d) for d in divs)


# --------------------------------------------------------------------------- faults


@settings(max_examples=10, **SLOW)
@given(wl=workloads(store=True), fault=st.sampled_from(FAULTS))
def test_fault_is_flagged_whenever_it_fires_random(tmp_path_factory, wl, fault):
    path = tmp_path_factory.mktemp("f") / "t.jsonl"
    rec = record_workload(wl, path, fault)
    if rec.fault_log:
        found = [d for d in _replay(path).divergences if d.field != "progress"]
        assert found, f"{fault} fired {rec.fault_log[:3]} but replay found nothing\n{wl}"


@pytest.mark.parametrize("fault", FAULTS)
@settings(max_examples=2, **SLOW)
@given(seed=st.integers(0, 10 ** 6))
def test_fault_is_flagged_whenever_it_fires_builtin(tmp_path_factory, fault, seed):
    path = tmp_path_factory.mktemp("fb") / "t.jsonl"
    rec = record_workload(build_workload(FAULT_WORKLOADS[fault], seed), path, fault, seed)
    if rec.fault_log:
        found = [d for d in _replay(path).divergences if d.field != "progress"]
        assert found, f"{fault} seed {seed}: fired {rec.fault_log[:3]}, not flagged"


# --------------------------------------------------------------------------- diff


def _diff_key(divs, swap: bool) -> list:
    out = []
    for d in divs:
        rec, exp = (d.expected, d.recorded) if swap else (d.recorded, d.expected)
        out.append((d.req, d.field, repr(rec), repr(exp)))
    return sorted(out)


@settings(max_examples=6, **SLOW)
@given(workload=st.sampled_from(["kv-pressure", "offload", "shared-prefix"]),
       fault=st.sampled_from([None, *FAULTS]), seed=st.integers(0, 1000),
       other_seed=st.integers(0, 1))
def test_diff_is_symmetric(tmp_path_factory, workload, fault, seed, other_seed):
    from kvtrace.diff import diff_files

    if fault in STORE_FAULTS and workload != "offload":
        fault = None
    d = tmp_path_factory.mktemp("d")
    a, b = d / "a.jsonl", d / "b.jsonl.gz"
    record_workload(build_workload(workload, seed), a, seed=seed)
    record_workload(build_workload(workload, seed + other_seed), b, fault, seed + other_seed)
    ab, ba = diff_files(a, b), diff_files(b, a)
    assert _diff_key(ab.divergences, False) == _diff_key(ba.divergences, True)


# --------------------------------------------------------------------------- round trip

_ints = st.integers(0, ev.MAX_COUNT)
_small = st.integers(0, 1 << 20)
_ids = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_tok_lists = st.lists(_ints, max_size=8)
_states = st.builds(ev.RequestState, req=_ids, status=st.sampled_from(ev.STATUSES), num_computed_tokens=_ints,
                    num_tokens=_ints, num_preemptions=_ints, block_ids=_tok_lists)
_new = st.builds(ev.ScheduledNew, req=_ids, num_computed_tokens=_ints, num_scheduled_tokens=_ints,
                 block_ids=_tok_lists)
_running = st.builds(ev.ScheduledRunning, req=_ids, num_computed_tokens=_ints, num_scheduled_tokens=_ints,
                     new_block_ids=_tok_lists)
_signed = st.integers(-ev.MAX_COUNT, ev.MAX_COUNT)


def _event_strategies():
    seq = st.just(0)
    return st.one_of(
        st.builds(ev.Arrival, seq=seq, req=_ids, prompt_token_ids=st.lists(_ints, min_size=1, max_size=8),
                  max_tokens=_ints, arrival_time=st.floats(allow_nan=False, allow_infinity=False),
                  priority=_signed, cache_salt=st.none() | _ids, eos_token_id=st.none() | _ints,
                  stop_token_ids=_tok_lists, min_tokens=_ints, ignore_eos=st.booleans(),
                  skip_reading_prefix_cache=st.booleans()),
        st.builds(ev.Abort, seq=seq, reqs=st.lists(_ids, max_size=4)),
        st.builds(ev.Step, seq=seq, step=_ints, new=st.lists(_new, max_size=3),
                  resumed=st.lists(_new, max_size=2), running=st.lists(_running, max_size=3),
                  preempted=st.lists(_ids, max_size=3), finished=st.lists(_ids, max_size=3),
                  lookups=st.lists(st.builds(ev.Lookup, req=_ids, local=_ints, ext=st.none() | _ints,
                                             load_async=st.booleans()), max_size=3),
                  loads=st.none() | st.lists(st.builds(ev.KVLoad, req=_ids, start=_ints, end=_ints),
                                             max_size=3),
                  states=st.lists(_states, max_size=3), num_free_blocks=st.none() | _ints),
        st.builds(ev.Output, seq=seq, step=_ints, sampled=st.dictionaries(_ids, _tok_lists, max_size=3),
                  connector=st.none() | st.builds(
                      ev.ConnectorOutput, finished_recving=st.lists(_ids, max_size=2),
                      finished_sending=st.lists(_ids, max_size=2), failed_recving=st.lists(_ids, max_size=2),
                      invalid_block_ids=_tok_lists),
                  finished=st.dictionaries(_ids, st.sampled_from(ev.FINISH_REASONS), max_size=3),
                  states=st.lists(_states, max_size=3)),
        st.builds(ev.PromptStats, seq=seq, step=_ints, req=_ids,
                  prefill_stats=st.builds(ev.PrefillStats, *[_signed] * 6),
                  legacy=st.none() | st.builds(ev.LegacyCounters, _signed, _signed)),
    )


_headers = st.builds(
    ev.Header, engine=_ids, engine_version=_ids,
    config=st.builds(ev.SchedulerConfig, block_size=st.integers(1, 256), num_blocks=st.integers(2, 1 << 20),
                     max_num_batched_tokens=st.integers(1, 1 << 20), max_num_seqs=st.integers(1, 1024),
                     max_model_len=st.integers(1, 1 << 24), enable_prefix_caching=st.booleans(),
                     policy=st.sampled_from(ev.POLICIES), long_prefill_token_threshold=_small,
                     max_num_scheduled_tokens=st.none() | st.integers(1, 1 << 20), watermark_blocks=_small,
                     connector=st.none() | st.builds(ev.ConnectorConfig, name=_ids,
                                                     load_failure_policy=st.sampled_from(["fail", "recompute"]))),
    counters=st.sampled_from(ev.COUNTER_SHAPES),
    features=st.dictionaries(_ids, st.integers(0, 4) | st.booleans(), max_size=3),
    meta=st.dictionaries(_ids, _ids | st.integers(0, 100), max_size=3),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_headers, events=st.lists(_event_strategies(), max_size=8),
       gaps=st.lists(st.integers(1, 5), min_size=9, max_size=9),
       end=st.none() | st.builds(ev.End, seq=st.just(0), status=st.sampled_from(ev.END_STATUSES),
                                 error=st.none() | _ids, dropped_events=_small),
       suffix=st.sampled_from(["jsonl", "jsonl.gz", "jsonl.zst"]))
def test_round_trip(tmp_path_factory, header, events, gaps, end, suffix):
    seq = 0
    for e, g in zip([*events, end], gaps):
        if e is not None:
            seq += g
            e.seq = seq
    path = tmp_path_factory.mktemp("rt") / f"t.{suffix}"
    w = TraceWriter(path, header)
    for e in events:
        w.write(e)
    w.finish(end)
    r = TraceReader(path, validate=False)   # random events name requests that never arrived
    assert r.header == header
    got = list(r)
    assert got == events + ([end] if end else [])
    assert r.end == end
    assert (r.truncation is None) == (end is not None)


# --------------------------------------------------------------------------- redaction


def _ngrams(seqs, n=4) -> set:
    return {tuple(s[i:i + n]) for s in seqs for i in range(len(s) - n + 1)}


def _prompts(path) -> tuple[list[list[int]], dict]:
    prompts, sampled = [], {}
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival):
            prompts.append(e.prompt_token_ids)
        elif isinstance(e, ev.Output):
            for req, ts in e.sampled.items():
                sampled.setdefault(req, []).extend(ts)
    return prompts, sampled


def _check_redacted(src, dst, summary):
    p0, s0 = _prompts(src)
    p1, s1 = _prompts(dst)
    assert len(p0) == len(p1) == summary.arrivals
    # Same id -> same pseudonym, different ids -> different pseudonyms.
    mapping: dict[int, int] = {}
    for a, b in zip([*p0, *s0.values()], [*p1, *s1.values()]):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert mapping.setdefault(x, y) == y
    assert len(set(mapping.values())) == len(mapping)
    # No original token sequence of length >= 4 is left anywhere in the file.
    assert not _ngrams(p0) & _ngrams([*p1, *s1.values()])
    raw = dst.read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    for seq in list(_ngrams(p0))[:200]:
        assert ",".join(map(str, seq)).encode() not in text


@pytest.mark.parametrize("workload", ["shared-prefix", "kv-pressure", "offload", "load-failures"])
def test_redacted_embedded_traces_replay_clean(tmp_path, workload):
    from kvtrace.redact import redact_file

    src, dst = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    record_workload(build_workload(workload, 3), src, seed=3)
    summary = redact_file(src, dst)
    _check_redacted(src, dst, summary)
    assert _replay(dst).divergences == []


@pytest.mark.parametrize("name", ["prefix-sharing", "preemption", "connector", "priority"])
def test_redacted_real_traces_replay_clean(tmp_path, name):
    from kvtrace.redact import redact_file

    src, dst = TRACES / f"{name}.jsonl.gz", tmp_path / "r.jsonl.gz"
    summary = redact_file(src, dst)
    _check_redacted(src, dst, summary)
    result = _replay(dst)
    assert result.divergences == [] and result.truncation is None


def test_redacted_fault_trace_keeps_its_divergences(tmp_path):
    from kvtrace.redact import redact_file

    src = TRACES / "faults" / "async-load-overshoot.jsonl.gz"
    redact_file(src, tmp_path / "r.jsonl")
    a, b = _replay(src), _replay(tmp_path / "r.jsonl")
    assert [(d.step, d.req, d.field) for d in a.divergences] == [(d.step, d.req, d.field) for d in b.divergences]
    assert b.divergences


def test_redacted_cut_trace_stays_cut(tmp_path):
    from kvtrace.redact import redact_file

    raw = gzip.decompress((TRACES / "preemption.jsonl.gz").read_bytes())
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(raw[: len(raw) // 2])
    summary = redact_file(cut, tmp_path / "r.jsonl")
    assert summary.truncation and "cut off" in summary.truncation
    r = TraceReader(tmp_path / "r.jsonl")
    list(r)
    assert r.end is None and r.truncation


def test_key_is_not_stored_and_keys_differ(tmp_path):
    from kvtrace.redact import redact_file

    src = TRACES / "prefix-sharing.jsonl.gz"
    key = bytes(range(32))
    redact_file(src, tmp_path / "a.jsonl", key)
    redact_file(src, tmp_path / "b.jsonl", key)
    redact_file(src, tmp_path / "c.jsonl")
    a, b, c = (_prompts(tmp_path / f"{x}.jsonl")[0] for x in "abc")
    assert a == b and a != c                       # a given key is reproducible; the default is random
    text = (tmp_path / "a.jsonl").read_bytes()
    assert key.hex().encode() not in text and b"redacted" in text


@settings(max_examples=50, deadline=None)
@given(key=st.binary(min_size=16, max_size=64), tokens=st.lists(st.integers(0, ev.MAX_COUNT), max_size=50))
def test_pseudonyms_are_a_permutation(key, tokens):
    from kvtrace.redact import Redactor

    r1, r2 = Redactor(key), Redactor(key)
    p1 = r1.tokens(tokens)
    assert p1 == r2.tokens(list(reversed(tokens)))[::-1]           # deterministic per key
    assert all(0 <= p <= ev.MAX_COUNT for p in p1)                 # stays a valid token id
    assert len(set(p1)) == len(set(tokens))                         # injective
    assert r1.token(ev.MAX_COUNT) <= ev.MAX_COUNT
