"""The embedded engine, default of ``kvtrace record``: the reference scheduler
driven by a workload generator, a deterministic token sampler and a simulated
external KV store, with ``--fault`` putting known scheduler bugs back in.
"""

from .engine import EngineStalled, RecordResult, record_embedded, record_workload
from .fault_log import FaultEvent
from .faults import FAULT_WORKLOADS, FAULTS
from .workloads import WORKLOADS, build_workload

__all__ = ["EngineStalled", "FAULTS", "FAULT_WORKLOADS", "FaultEvent", "RecordResult", "WORKLOADS",
           "build_workload", "record_embedded", "record_workload"]
