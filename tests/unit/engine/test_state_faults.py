"""The embedded engine's state-group faults (kvtrace/engine/faults.py: full
attention's hit kept past a state hit, a preempted request's state blocks
freed while a step in flight writes them, prefill chunks off the block grid,
a state's key kept after its block is handed out again) are flagged where
the recording itself first breaks the rule each one breaks
(tests/_state_faults.py works that place out from the trace's records, not
from a replay): replay's first divergence, in trace order, and the one
its report names first (under async scheduling an output of step N comes
after step N + 1 and shows the tables step N + 1 left) are at that step and
request, on that field, and the fault's own log changed the engine at that
step. The same workload without the fault breaks no rule and replays
clean, so the rule and the place are the fault's.
"""

from __future__ import annotations

import pytest

from kvtrace.engine import FAULT_WORKLOADS, record_embedded
from kvtrace.findings import gather
from kvtrace.replay import replay_file

from tests._state_faults import FAULTS, first_violation


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """Each fault's workload, with the fault and without: (record result,
    replay's divergences)."""
    d = tmp_path_factory.mktemp("state-faults")
    out = {}
    for fault in FAULTS:
        for name, with_fault in ((fault, fault), (f"{fault}-clean", None)):
            res = record_embedded(d / f"{name}.jsonl", FAULT_WORKLOADS[fault], fault=with_fault)
            out[name] = (res, replay_file(res.path, device=None).divergences)
    return out


def test_each_state_fault_runs_a_state_workload():
    assert set(FAULTS) <= set(FAULT_WORKLOADS)
    assert all(FAULT_WORKLOADS[f].startswith("hybrid-state") for f in FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_state_fault_is_flagged_where_the_recording_breaks_its_rule(fault, recorded):
    res, divs = recorded[fault]
    where = first_violation(res.path, fault)
    assert where is not None, f"the trace of {fault} breaks no rule"
    assert divs, f"replay flags nothing in the trace of {fault}"
    assert (divs[0].step, divs[0].req, divs[0].field) == where
    head = gather(divs).headline   # what every view of the replay names first
    assert (head.step, head.req, head.field) == where
    first = res.fault_log[0]
    assert first.step == where[0]
    if fault != "state-freed-in-flight":   # there the log names the preempted request
        assert first.req == where[1]


@pytest.mark.parametrize("fault", FAULTS)
def test_the_fault_workload_without_the_fault_keeps_the_rule(fault, recorded):
    res, divs = recorded[f"{fault}-clean"]
    assert not res.fault_log
    assert first_violation(res.path, fault) is None
    assert divs == [], [d.to_json() for d in divs[:3]]


def test_a_preempted_requests_state_blocks_go_to_another_while_its_step_is_in_flight(recorded):
    """state-freed-in-flight: a block the fault freed early is the one
    handed out where replay first flags it."""
    res, divs = recorded["state-freed-in-flight"]
    freed = {int(b) for e in res.fault_log if e.step == divs[0].step
             for b in e.change.split("[", 1)[1].split("]", 1)[0].split(",")}
    tables = divs[0].recorded if isinstance(divs[0].recorded[0], list) else [divs[0].recorded]
    assert freed & {b for t in tables for b in t}
