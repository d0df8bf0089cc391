"""Replay with the content check and both workers (the content check in one,
the record checks in another, the main process decoding without checks behind
the record checks' gate) gives what replay in one process gives: the same
report, the same cut, the same one-line error at the same line, the same -o
trace."""

from __future__ import annotations

import orjson
import pytest

from kvtrace.workers import policy as workers
from kvtrace.replay.kv_content import worker as content_worker
from kvtrace.replay import replay_file
from kvtrace.workers import record_worker

from tests.mini_traces import load_records, save_records
from tests.unit.workers import test_record_worker as rw
from tests.unit.workers.test_record_worker import (REAL, _after_the_end, _bad_schema,
                                                    _block_out_of_range, _out_of_order,
                                                    _undecodable, _unknown_request)


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """The workers each replay starts."""
    names: list[str] = []
    for module, cls in ((content_worker, "ContentWorker"), (record_worker, "RecordWorker")):
        real = getattr(module, cls)

        class Spy(real):
            def __init__(self, *a, _name=cls, **k):
                names.append(_name)
                super().__init__(*a, **k)

        monkeypatch.setattr(module, cls, Spy)
    return names


def result(path, worker: int) -> tuple:
    return rw.result(path, worker, "cpu")


def error(path, worker: int) -> str:
    return rw.error(path, worker, "cpu")


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_vllm_traces_replay_the_same_with_both_workers(path, started):
    here = result(path, 0)
    assert started == []
    assert result(path, 2) == here
    assert sorted(started) == ["ContentWorker", "RecordWorker"]
    assert here[1] > 0 and here[6] > 0


def test_kv_divergences_are_the_same_with_both_workers(faulty, started):
    here = result(faulty, 0)
    assert any(d["kind"] == "kv-content" for d in here[0])
    assert result(faulty, 2) == here
    assert sorted(started) == ["ContentWorker", "RecordWorker"]


def test_a_trace_cut_off_replays_the_same_up_to_the_cut(faulty, tmp_path):
    recs = load_records(faulty)
    cut = len(recs) * 2 // 3
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs[:cut]) + orjson.dumps(recs[cut])[:40])
    here = result(path, 0)
    assert here[3] and "cut off" in here[3]
    assert result(path, 2) == here


@pytest.mark.parametrize("spoil", [_bad_schema, _unknown_request, _undecodable, _block_out_of_range,
                                   _out_of_order, _after_the_end], ids=lambda f: f.__name__[1:])
def test_bad_input_gets_the_same_error_at_the_same_line(faulty, tmp_path, spoil, started):
    recs = load_records(faulty)
    spoil(recs)
    path = save_records(recs, tmp_path / "bad.jsonl")
    here = error(path, 0)
    assert here.startswith(f"{path}:")
    assert error(path, 2) == here
    assert sorted(started) == ["ContentWorker", "RecordWorker"]


def test_the_replayed_trace_is_the_same_with_both_workers(faulty, tmp_path):
    outs = []
    for worker in (0, 2):
        out = tmp_path / f"out-{worker}.jsonl"
        replay_file(faulty, out=out, device="cpu", worker=worker)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") > 100


def test_how_many_workers(tmp_path, monkeypatch):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_bytes(b"x")
    with open(big, "wb") as f:
        f.truncate(workers.MIN_BYTES)
    monkeypatch.delenv(workers.ENV, raising=False)
    for cores, n in ((1, 0), (2, 1), (3, 2), (16, 2)):
        monkeypatch.setattr(workers.os, "cpu_count", lambda c=cores: c)
        assert workers.wanted(big) == n, cores
        assert workers.wanted(small) == 0
    for choice in ("0", "1", "2"):
        monkeypatch.setenv(workers.ENV, choice)
        assert workers.wanted(small) == workers.wanted(big) == int(choice)
