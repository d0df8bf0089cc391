"""A data-parallel run's ranks found from rank 0's trace: the files beside it
named as its ranks (``.dp<k>.pid<pid>``), each taken by its own header.

The ranks here are made from traces/dp-throttle.jsonl.gz (vLLM 0.32, its
engine core asking for prefills to be held back on two steps of every three,
as a data-parallel engine core in lockstep does), each rank's copy with its
header saying its rank and the run, and its request ids its own
(``as_rank``)."""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace.trace.ranks import find_run, rank_files

from tests._paths import REPO
from tests.mini_traces import load_records, save_records

THROTTLE = REPO / "traces" / "dp-throttle.jsonl.gz"
MASTER = "127.0.0.1:4242"


def renamed(value, ids: dict[str, str]):
    """``value`` (a record, or a part of one) with every request id in ``ids``
    (as a string or a key) replaced by its new name."""
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, list):
        return [renamed(v, ids) for v in value]
    if isinstance(value, dict):
        return {ids.get(k, k): renamed(v, ids) for k, v in value.items()}
    return value


def as_rank(dst: Path, rank: int, size: int = 2, *, interval: int = 3, master: str = MASTER,
            own_ids: bool = True, src: Path = THROTTLE, change=None) -> Path:
    """``src``'s records as rank ``rank`` of a run of ``size`` ranks whose
    prefill_schedule_interval is ``interval``; its request ids suffixed with
    its rank (``own_ids``); ``change(records)`` edits them last."""
    recs = load_records(src)
    head = recs[0]
    head["features"].update(data_parallel_size=size, prefill_schedule_interval=interval)
    head["meta"] = {**head["meta"], "data_parallel_rank": rank, "data_parallel_master": master}
    if own_ids:
        ids = {r["req"]: f"{r['req']}.r{rank}" for r in recs if r.get("kind") == "arrival"}
        recs = recs[:1] + [renamed(r, ids) for r in recs[1:]]
    if change is not None:
        change(recs)
    return save_records(recs, dst)


def rank_name(run: Path, rank: int, pid: int = 77) -> Path:
    """Where the vLLM recorder writes rank ``rank`` of the run recorded to ``run``."""
    stem = run.name[: -len(".jsonl")]
    return run if rank == 0 else run.with_name(f"{stem}.dp{rank}.pid{pid}.jsonl")


def make_run(folder: Path, size: int = 2, **kw) -> Path:
    """Rank 0's trace of a run of ``size`` ranks, every rank's file written."""
    run = folder / "run.jsonl"
    for k in range(size):
        as_rank(rank_name(run, k), k, size, **kw)
    return run


def test_a_run_is_its_rank_files(tmp_path):
    run = make_run(tmp_path, 3)
    found = find_run(run)
    assert found.size == 3 and found.lockstep
    assert found.ranks == {k: str(rank_name(run, k)) for k in range(3)}
    assert found.missing == [] and found.others == []


def test_a_rank_that_left_no_trace_is_missing_rank_0_included(tmp_path):
    run = make_run(tmp_path, 4)
    rank_name(run, 2).unlink()
    assert find_run(run).missing == [2]
    # A rank's own file is no run: only rank 0's trace names it.
    assert find_run(rank_name(run, 1)) is None


def test_an_older_file_of_a_rank_or_one_of_another_run_is_not_taken(tmp_path):
    run = make_run(tmp_path, 3)
    old = as_rank(rank_name(run, 1, pid=5), 1, 3)
    os.utime(old, (1, 1))                          # an earlier run's, recorded to the same path
    stranger = as_rank(rank_name(run, 2, pid=6), 2, 3, master="10.0.0.9:777")
    rank_name(run, 2).unlink()
    found = find_run(run)
    assert found.ranks[1] == str(rank_name(run, 1)) and found.missing == [2]
    why = dict(found.others)
    assert why[str(old)].startswith("an older trace of rank 1")
    assert "of another run" in why[str(stranger)] and "10.0.0.9:777" in why[str(stranger)]


def test_a_file_whose_header_names_another_rank_is_not_taken(tmp_path):
    run = make_run(tmp_path, 2)
    liar = as_rank(rank_name(run, 1, pid=9), 0, 2)
    found = find_run(run)
    assert found.ranks[1] == str(rank_name(run, 1))
    assert dict(found.others)[str(liar)] == "its header names rank 0, not 1"


def test_independent_ranks_are_found_by_their_files_alone(tmp_path):
    """A dense model's ranks name size 1: the run is what lies beside rank 0,
    and a rank is missing only where a higher one is there."""
    run = tmp_path / "run.jsonl"
    for k in (0, 2):
        as_rank(rank_name(run, k), k, size=1)
    found = find_run(run)
    assert found.size is None and not found.lockstep and found.missing == [1]
    assert sorted(found.ranks) == [0, 2]


def test_a_single_engine_is_no_run(tmp_path):
    assert find_run(THROTTLE) is None
    lone = as_rank(tmp_path / "run.jsonl", 0, size=1)
    assert find_run(lone) is None and rank_files(lone) == {}
