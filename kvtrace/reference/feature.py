"""The base of the Scheduler's parts written in modules of their own:
sessions.py, async_output.py, kv_transfer.py, speculative.py, output.py and
admission.py, each a class built on the one before it, in that order, and the
Scheduler on the last. It declares what the parts use of the whole: the
scheduler's state, set in ``Scheduler.__init__``, and the calls each part
makes into another, so that each part reads, type-checks and compiles alone.
One line of classes, not mixins: compiled (kvtrace/compile.py), a class has
one base, and a rule the embedded engine's faults override must be overridden
wherever it is called from."""

from __future__ import annotations

from abc import abstractmethod
from collections import deque

from mypy_extensions import mypyc_attr

from .block_pool import Block
from .config import SchedulerConfig
from .interface import Connector
from .kv_groups import GroupedKVCacheManager
from .kv_manager import Blocks, KVCacheManager
from .queues import FCFSQueue, PriorityQueue
from .request import Request, Status
from .state_groups import StateSplit
from .step import StepPlan


@mypyc_attr(allow_interpreted_subclasses=True)
class SchedulerFeature:
    config: SchedulerConfig
    block_size: int
    max_model_len: int
    kv_groups: bool
    kv: KVCacheManager | GroupedKVCacheManager
    state_split: StateSplit | None
    connector: Connector | None
    requests: dict[str, Request]
    waiting: FCFSQueue | PriorityQueue
    kv_holding_waiting: FCFSQueue | PriorityQueue
    running: list[Request]
    finished_recving_ids: set[str]
    failed_recving_ids: set[str]
    inflight_prefills: set[Request]
    pause_state: str
    num_waiting_for_streaming_input: int
    grammar_compile_error_ids: set[str]
    deferred_waiting: set[Request]
    sched_step_seq: int
    processed_step_seq: int
    deferred_frees: deque[tuple[int, list[Block]]]

    # scheduler.py
    @abstractmethod
    def finish_requests(self, req_ids: list[str] | set[str], status: Status) -> list[Request]: ...

    @abstractmethod
    def _local_prefix_hit(self, r: Request) -> tuple[Blocks, int]: ...

    @abstractmethod
    def _record_lookup(self, r: Request, num_local: int, num_external: int,
                       load_async: bool) -> None: ...

    @abstractmethod
    def _count_connector_query(self, r: Request, num_local: int, num_external: int) -> None: ...

    @abstractmethod
    def _on_admitted(self, r: Request) -> None: ...

    @abstractmethod
    def _enqueue_waiting(self, r: Request) -> None: ...

    @abstractmethod
    def _free_request(self, r: Request, delay_free: bool = False) -> None: ...

    @abstractmethod
    def _free_blocks(self, r: Request, rule: str) -> None: ...

    # speculative.py
    @abstractmethod
    def spec_decode_step_blocks(self) -> int: ...

    @abstractmethod
    def _admission_lookahead(self, r: Request, load_async: bool) -> int: ...

    @abstractmethod
    def _pads_with_drafts(self, step: StepPlan, num_computed: int) -> bool: ...

    @abstractmethod
    def _reject_drafts(self, r: Request, num_drafts: int, num_sampled: int) -> None: ...

    # kv_transfer.py
    @abstractmethod
    def _external_hit(self, r: Request, num_local: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def _blocks_reserved_for_loads(self) -> int: ...

    @abstractmethod
    def _finish_remote_kv_load(self, r: Request) -> None: ...

    # async_output.py
    @abstractmethod
    def _take_placeholders(self, r: Request, num_given: int, num_kept: int, stale: bool) -> None: ...

    @abstractmethod
    def _cache_output_blocks(self, r: Request, stale: bool, status_before: Status,
                             had_placeholders: bool) -> None: ...

    # sessions.py
    @abstractmethod
    def _handle_stopped_request(self, r: Request) -> bool: ...
