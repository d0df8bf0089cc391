"""The vLLM workload is one typed struct (kvtrace/lab/workload_spec.py): every
stored and random workload is one, and a key no driver reads, or a value of
the wrong type, is refused with its name, where a dict once ignored it."""

from __future__ import annotations

import pytest

from kvtrace.lab.random_workloads import ALL_KINDS, workload
from kvtrace.lab.workload_spec import BadWorkload, Workload, as_workload
from kvtrace.lab.workloads import WORKLOADS


def test_every_stored_and_random_workload_is_a_workload():
    stored = [w for w in WORKLOADS.values() if isinstance(w, dict)]
    assert len(stored) > 20
    for wl in stored + [workload(seed, kind) for kind in ALL_KINDS for seed in (1, 2)]:
        got = as_workload(wl)
        assert [list(p) for p in wl["prompts"]] == got.prompts
        assert got.engine == wl.get("engine", {})
        assert got.driven_step_by_step == ("arrive_at" in wl or "aborts" in wl)


@pytest.mark.parametrize("wl,said", [
    ({"prompts": [[1, 2]], "max_token": 8}, "unknown field `max_token`"),
    ({"prompts": [[1, 2]], "max_tokens": "8x"}, "at `$.max_tokens`"),
    ({"prompts": [[1, 2]], "priority": [0, "high"]}, "at `$.priority[1]`"),
    ({"max_tokens": 8}, "missing required field `prompts`"),
])
def test_a_workload_with_an_unknown_key_or_a_wrong_value_is_refused_by_name(wl, said):
    with pytest.raises(BadWorkload, match=None) as e:
        as_workload(wl)
    assert said in str(e.value), str(e.value)


def test_the_defaults_are_the_drivers():
    wl = as_workload({"prompts": [[5]]})
    assert (wl.max_tokens, wl.model, wl.engine, wl.pooling) == (32, "tiny", {}, False)
    assert as_workload(wl) is wl and isinstance(wl, Workload)
