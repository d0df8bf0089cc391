"""The reference scheduler: an independent, readable model of vLLM V1's scheduler
(baseline profile of the semantics doc). It knows nothing about traces.

Read in this order: request.py, block_pool.py, kv_manager.py, scheduler.py, then
the feature modules it builds on (admission.py, output.py, speculative.py,
kv_transfer.py, async_output.py, sessions.py: feature.py), kv_groups.py and state_groups.py for hybrid KV caches, and profiles.py.
"""

from .config import GroupSpec, SchedulerConfig, StateSpec
from .hashing import PromptEmbeds
from .interface import (Connector, ModelOutput, RequestOutput, ScheduledRequest, SchedulerAssertion,
                        SchedulerOutput)
from .request import FINISH_REASONS, PrefillStats, Request, Status
from .scheduler import Scheduler

__all__ = [
    "Connector", "FINISH_REASONS", "GroupSpec", "ModelOutput", "PrefillStats", "PromptEmbeds", "Request",
    "RequestOutput",
    "ScheduledRequest", "Scheduler", "SchedulerAssertion", "SchedulerConfig", "SchedulerOutput",
    "StateSpec", "Status",
]
