"""Trace events: the only coupling between recording and replay.

Every line of a trace is one JSON object with a ``kind``. The classes below are
msgspec ``Struct``\\ s: one definition is the wire format, the per-record
validation (types, ranges, allowed values, done in C as a line is decoded) and
the in-memory type. ``decode_line`` turns a line of bytes into an event,
``decode`` a parsed JSON object; both raise ``SchemaError`` with a precise
message when the record does not fit. Field names follow vLLM's own names
(``num_computed_tokens``, ``block_ids`` ...) so that a scheduler engineer can
read a trace line by eye. Checks that need more than one record are in
validate.py.

A field left at its default is not written. docs/reference/trace-format.md is the prose
version of this file; keep them together.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta, Struct, field

SCHEMA_VERSION = 1

STATUSES = (
    "WAITING",
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",   # a structured output's grammar still compiling
    "WAITING_FOR_REMOTE_KVS",
    "WAITING_FOR_STREAMING_REQ",   # a streaming-input session between turns
    "RUNNING",
    "PREEMPTED",
    "FINISHED_STOPPED",
    "FINISHED_LENGTH_CAPPED",
    "FINISHED_ABORTED",
    "FINISHED_IGNORED",
    "FINISHED_ERROR",
)
FINISH_REASONS = ("stop", "length", "abort", "error")
FINISHED_STATUSES = tuple(s for s in STATUSES if s.startswith("FINISHED_"))
# The finish reason of each finished status (vLLM's RequestStatus.get_finished_reason).
STATUS_REASONS = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length",
                  "FINISHED_ABORTED": "abort", "FINISHED_IGNORED": "length",
                  "FINISHED_ERROR": "error"}
POLICIES = ("fcfs", "priority")
COUNTER_SHAPES = ("prefill_stats", "legacy")
END_STATUSES = ("complete", "recorder-error", "interrupted", "continued")
PAUSE_STATES = ("UNPAUSED", "PAUSED_NEW", "PAUSED_ALL")
GRAMMAR_OUTCOMES = ("ready", "error")
REPETITION_FIELDS = ("max_pattern_size", "min_pattern_size", "min_count")

# Sanity bounds: a value above these is a corrupt trace, not a big run.
MAX_COUNT = 1 << 40
# The most KV slots (num_blocks * block_size) and the longest max_model_len a
# header may claim: about 2 billion tokens, far beyond any real deployment. Replay
# sizes its shadow KV cache by the header, so an absurd header must not reach it.
MAX_KV_SLOTS = 1 << 31
MAX_NUM_BLOCKS = 1 << 24   # 16.7 million blocks: far above any engine's pool
MAX_MODEL_LEN = 1 << 31
# The deepest a free-form value (kv_transfer_params, the header's meta and
# features) may nest: far beyond what an engine writes, and well within what
# every JSON encoder and decoder kvtrace uses takes.
MAX_DEPTH = 32
TOO_DEEP = f"a value nested more than {MAX_DEPTH} levels deep"


class SchemaError(ValueError):
    """An object that does not fit the trace schema. The message names the problem;
    the reader adds the file and line."""


# --------------------------------------------------------------------------- value types

Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]             # counts, positions, ids
Positive = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Signed = Annotated[int, Meta(ge=-MAX_COUNT, le=MAX_COUNT)]    # counters as an engine held them
Draft = Annotated[int, Meta(ge=-1, le=MAX_COUNT)]            # a draft token; -1 pads
Digest = Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]      # sha256, lowercase hex
BytesDigest = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]   # a KV block's bytes (kv_audit)
# kv_audit entries: [req, block id, block hash, digest], and for a load
# [req, block id, block hash, digest before, digest after, asked, by_connector].
BlockBytes = tuple[str, Count, str, BytesDigest]
LoadedBlock = tuple[str, Count, str, BytesDigest, BytesDigest, bool, bool]
Status = Literal[STATUSES]
FinishedStatus = Literal[FINISHED_STATUSES]
FinishReason = Literal[FINISH_REASONS]


class _Record(Struct, omit_defaults=True, tag_field="kind"):
    """A trace line: its ``kind`` is the tag."""


class _Part(Struct, omit_defaults=True):
    """A part of a record."""


# --------------------------------------------------------------------------- header


class ConnectorConfig(_Part):
    name: str
    load_failure_policy: Literal["fail", "recompute"] = "fail"   # vLLM's default: fail


class SchedulerConfig(Struct):   # every field written: a reader sees the whole config
    block_size: Positive
    num_blocks: Annotated[int, Meta(ge=2, le=MAX_NUM_BLOCKS)]  # including vLLM's null block 0
    max_num_batched_tokens: Positive
    max_num_seqs: Positive
    max_model_len: Annotated[int, Meta(ge=1, le=MAX_MODEL_LEN)]
    enable_prefix_caching: bool = True
    policy: Literal[POLICIES] = "fcfs"
    long_prefill_token_threshold: Count = 0
    max_num_scheduled_tokens: Positive | None = None  # defaults to max_num_batched_tokens
    watermark_blocks: Count = 0
    connector: ConnectorConfig | None = None

    def __post_init__(self) -> None:
        if self.num_blocks * self.block_size > MAX_KV_SLOTS:
            raise ValueError(f"absurd KV cache: num_blocks * block_size = "
                             f"{self.num_blocks * self.block_size} slots (at most 2^31)")

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


class KVCacheGroup(_Part):
    """One KV-cache group: its spec's kind (vLLM's class name: ``FullAttentionSpec``,
    ``SlidingWindowSpec``, ``MambaSpec`` ...), its block size, its window for a
    sliding-window group, the most blocks an admission reserves for one request
    in a group that recycles its blocks (vLLM's ``max_admission_blocks_per_request``),
    and its layers. A state group (``MambaSpec``: Mamba, Mamba2, gated delta net
    and other linear-attention layers) also names its ``mamba_type``, its cache
    mode (``align``: a state kept at block boundaries for prefix caching;
    ``none``: one state per request), and the blocks its spec adds per request
    for speculative decoding and for a prefill checkpoint."""

    kind: str
    block_size: Positive
    sliding_window: Positive | None = None
    admission_blocks: Positive | None = None
    layers: list[str] = []
    # State groups (MambaSpec) only
    mamba_type: str | None = None
    mamba_cache_mode: Literal["align", "none"] | None = None
    num_speculative_blocks: Count | None = None
    num_prefill_checkpoint_blocks: Count | None = None
    prefill_checkpoint_alignment: Positive | None = None


class SchedulerFeatures(_Part, forbid_unknown_fields=False):
    """The header's ``features``: engine features outside the baseline profile
    and the scheduler settings replay reads (docs/reference/trace-format.md). A key a
    trace does not name is None: taken as off, or as vLLM 0.32's default.
    Keys this version does not know are kept in ``extra``, so that a newer
    recorder's traces still read."""

    # Scheduling
    async_scheduling: bool | None = None        # the AsyncScheduler runs
    scheduler_cls: str | None = None            # the class that ran
    scheduler_reserve_full_isl: bool | None = None
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold_adaptive: bool | None = None
    max_num_active_seqs: Positive | None = None
    prefill_schedule_interval: Positive | None = None
    throttle_prefills_recorded: bool | None = None
    watermark: float | None = None
    profile: str | None = None                  # the embedded engine's version profile
    # KV cache
    num_kv_cache_groups: Count | None = None
    kv_cache_group_kinds: list[str] | None = None
    hash_block_size: Positive | None = None
    kv_cache_groups: list[KVCacheGroup] | None = None    # every group, in vLLM's order
    # Which blocks of a sliding-window group are made hash-visible: those of a
    # window ending on every multiple of this many tokens, and on the prompt's
    # replay boundary (absent: 0, vLLM 0.32's default: the boundary only). With
    # prefix_cache_retention_dense, a window ending on every aligned boundary.
    prefix_cache_retention_interval: Count | None = None
    prefix_cache_retention_dense: bool | None = None
    # A state group also keeps the state where two prompts' shared prefix ends
    # (vLLM's enable_mamba_shared_prefix_checkpoint; absent: off).
    enable_mamba_shared_prefix_checkpoint: bool | None = None
    prefix_caching_hash_algo: str | None = None
    prefix_replay_tokens: Count | None = None
    # KV connector
    kv_role: str | None = None
    # The connector restores a state group's lagging state at the end of its
    # external hit, so a lookup takes full attention's own hit as the local
    # one (vLLM's supports_divergent_local_hybrid_hits; absent: no).
    supports_divergent_local_hybrid_hits: bool | None = None
    defer_block_free: bool | None = None
    requires_kv_delivery: bool | None = None
    # Speculative decoding
    num_speculative_tokens: Count | None = None
    num_lookahead_tokens: Count | None = None
    speculative_method: str | None = None
    num_draft_slots: Count | None = None
    dynamic_spec_decode: bool | None = None
    spec_tokens_by_batch_size: list[int] | None = None
    use_eagle: bool | None = None
    eagle_block_drop: bool | None = None
    num_prefill_lookahead_tokens: Count | None = None
    num_hash_lookahead_tokens: Count | None = None
    # Models and inputs
    has_mamba_layers: bool | None = None
    multimodal: bool | None = None
    diffusion: bool | None = None
    lora: bool | None = None
    max_loras: Positive | None = None
    prompt_embeds: bool | None = None
    pooling_runner: bool | None = None
    use_v2_model_runner: bool | None = None
    # Parallelism
    pipeline_parallel_size: Positive | None = None
    # The KV cache's shards: the KV audit's records name their rank.
    tensor_parallel_size: Positive | None = None
    data_parallel_size: Positive | None = None
    decode_context_parallel_size: Positive | None = None
    # Keys this version does not know, as written.
    extra: dict[str, Any] = {}

    def windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's sliding window, or None; empty when the
        header lists no groups (one full-attention group)."""
        return tuple(g.sliding_window for g in self.kv_cache_groups or ())

    def named(self) -> dict[str, Any]:
        """The keys the trace names, with their values (``extra``'s included)."""
        out = {k: v for k, v in msgspec.structs.asdict(self).items()
               if v is not None and k != "extra"}
        if self.kv_cache_groups is not None:
            out["kv_cache_groups"] = msgspec.to_builtins(self.kv_cache_groups)
        out.update(self.extra)
        return out


_FEATURE_KEYS = frozenset(SchedulerFeatures.__struct_fields__) - {"extra"}


def features_from(d: dict) -> SchedulerFeatures:
    """A header's ``features`` object, typed; raises SchemaError naming the key."""
    if type(d) is not dict:
        raise SchemaError(f"field 'features' must be an object, got {_tname(d)}")
    known = {k: v for k, v in d.items() if k in _FEATURE_KEYS}
    extra = {k: v for k, v in d.items() if k not in _FEATURE_KEYS}
    try:
        f = msgspec.convert(known, SchedulerFeatures)
    except msgspec.ValidationError as e:
        raise SchemaError(_say(str(e), "features.")) from None
    f.extra = extra
    return f


class Header(Struct, tag="header", tag_field="kind"):   # every field written
    engine: str
    engine_version: str
    config: SchedulerConfig
    counters: Literal[COUNTER_SHAPES] = "prefill_stats"  # which prompt-stats shape the engine emits
    schema: int = SCHEMA_VERSION
    # Engine features outside the baseline profile and the scheduler settings
    # replay reads; a dict is taken and typed.
    features: SchedulerFeatures = field(default_factory=SchedulerFeatures)
    meta: dict = {}  # free-form: recorder, command, workload, fault
    kind: ClassVar[str] = "header"

    def __post_init__(self) -> None:
        if isinstance(self.features, dict):
            self.features = features_from(self.features)


# --------------------------------------------------------------------------- inputs


class Arrival(_Record, tag="arrival"):
    """``Scheduler.add_request``: everything the scheduler reads from a new request."""

    seq: Count
    req: str
    prompt_token_ids: Annotated[list[Count], Meta(min_length=1)]
    max_tokens: Count
    arrival_time: float = 0.0
    priority: Signed = 0
    cache_salt: str | None = None
    eos_token_id: Count | None = None
    stop_token_ids: list[Count] = []
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_reading_prefix_cache: bool = False
    # One input chunk of a streaming-input session (vLLM's resumable requests).
    resumable: bool = False
    # A structured output: the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    # until the scheduler finds its grammar compiled (``Step.grammar``).
    structured_output: bool = False
    # A pooling request (an embedding, a classification, a reward): it samples
    # no token, and finishes when its pooler output comes (``Output.pooled``).
    pooling: bool = False
    # vLLM's repetition detection (``RepetitionDetectionParams``): the request
    # stops once its output ends in a pattern of ``min_pattern_size`` to
    # ``max_pattern_size`` tokens repeated ``min_count`` times. None when off.
    repetition_detection: dict[str, Count] | None = None
    # A prompt given as embeddings (vLLM's ``enable_prompt_embeds``): the sha256
    # of each block's rows of them, as vLLM hashes them into the block's key
    # (block i: rows i*B to min((i+1)*B, n), with B the size vLLM hashes at,
    # the header's hash_block_size or else block_size, and n the prompt's
    # length). ``prompt_token_ids`` holds the ids vLLM's request hashes: 0 at
    # each position given as embeddings, unless the prompt came with ids of
    # its own. None for a prompt of token ids.
    prompt_embeds: Annotated[list[Digest], Meta(min_length=1)] | None = None
    # A prompt of embeddings and token ids mixed (a chat message with embeddings
    # parts): the positions given as token ids, as runs [start, end) (vLLM's
    # ``prompt_is_token_ids`` mask); the others are given as embeddings. None
    # when every position is (or none is).
    prompt_is_token_ids: Annotated[list[tuple[Count, Count]], Meta(min_length=1)] | None = None
    # The request's LoRA adapter (vLLM's LoRARequest): {"id": int, "name": str,
    # "path": str}. Its name and path key every block; its id counts against the
    # header's features.max_loras. None without one.
    lora: dict | None = None
    # The request's kv_transfer_params as the connector reads them (a
    # disaggregated deployment's handoff: do_remote_prefill, remote_block_ids,
    # remote_request_id, ...). The scheduler passes them to the connector only;
    # ``kvtrace diff`` pairs a decode-side request with the prefill-side request
    # they name. None without them.
    kv_transfer_params: dict | None = None
    kind: ClassVar[str] = "arrival"

    def __post_init__(self) -> None:
        if self.kv_transfer_params is not None:
            shallow(self.kv_transfer_params, "kv_transfer_params")
        if self.repetition_detection is not None:
            self.repetition_detection = _repetition(self.repetition_detection)
        if self.prompt_is_token_ids is not None:
            if self.prompt_embeds is None:
                raise ValueError("field 'prompt_is_token_ids' is set on a prompt without "
                                 "'prompt_embeds'")
            self.prompt_is_token_ids = _runs(self.prompt_is_token_ids, len(self.prompt_token_ids))
        if self.lora is not None:
            self.lora = _lora(self.lora)


def shallow(value: Any, name: str) -> None:
    """Raise ValueError when ``value`` (a free-form object of a record)
    nests more than ``MAX_DEPTH`` levels deep."""
    if type(value) is not dict and type(value) is not list:
        return
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if type(v) is dict else v
        for x in items:
            if type(x) is dict or type(x) is list:
                if depth >= MAX_DEPTH:
                    raise ValueError(f"field '{name}' holds {TOO_DEEP}")
                stack.append((x, depth + 1))


def _repetition(d: dict) -> dict[str, int]:
    missing = [k for k in REPETITION_FIELDS if k not in d]
    if missing:
        raise ValueError(f"missing field 'repetition_detection.{missing[0]}'")
    return {k: d[k] for k in REPETITION_FIELDS}


def _runs(runs: list, n: int) -> list[list[int]]:
    """Runs ``[start, end)`` of positions in ``0..n``, in order, none empty and
    none touching the next, so that one mask has one form."""
    last = -1
    for start, end in runs:
        if not last < start < end <= n:
            raise ValueError(f"field 'prompt_is_token_ids' must hold runs [start, end] of prompt "
                             f"positions, in order, none empty and none touching the next, "
                             f"within the prompt's {n} tokens; found {[start, end]!r:.80}")
        last = end
    return [list(r) for r in runs]


class _Lora(Struct):
    id: Positive
    name: str
    path: Annotated[str, Meta(min_length=1)]   # vLLM's LoRARequest has none without a path


def _lora(d: dict) -> dict:
    try:
        lora = msgspec.convert(d, _Lora)
    except msgspec.ValidationError as e:
        raise ValueError(_say(str(e), "lora.")) from None
    return {"id": lora.id, "name": lora.name, "path": lora.path}


def mask_from_runs(runs: list[list[int]] | None, n: int) -> list[bool]:
    """The per-position mask of ``n`` positions that ``runs`` [start, end) mark
    True (``Arrival.prompt_is_token_ids``); all False for None."""
    mask = [False] * n
    for start, end in runs or ():
        mask[start:end] = [True] * (end - start)
    return mask


class Abort(_Record, tag="abort"):
    """``Scheduler.finish_requests(ids, status)`` from outside the scheduler:
    an abort (``FINISHED_ABORTED``, the default), or another finished status a
    caller gives (``FINISHED_STOPPED``, say)."""

    seq: Count
    reqs: list[str]
    status: FinishedStatus = "FINISHED_ABORTED"
    kind: ClassVar[str] = "abort"

    @property
    def reason(self) -> str:
        """The finish reason the status reads as (``abort`` for an abort)."""
        return STATUS_REASONS[self.status]


class RequestFinished(_Record, tag="request_finished"):
    """A KV connector's answer to ``request_finished(request, block_ids)``, made
    as the scheduler frees a finished request (S:3005-3058): whether it keeps the
    request's blocks until it reports the request in ``finished_sending``
    (``delay_free``: the prefill side of a disaggregated deployment, while the
    decode side reads them), and the transfer parameters it hands back. It
    comes before the record of the call that finished the request."""

    seq: Count
    req: str
    delay_free: bool = False
    kv_transfer_params: dict | None = None
    kind: ClassVar[str] = "request_finished"

    def __post_init__(self) -> None:
        if self.kv_transfer_params is not None:
            shallow(self.kv_transfer_params, "kv_transfer_params")


class ResetPrefixCache(_Record, tag="reset_prefix_cache"):
    """``Scheduler.reset_prefix_cache(reset_running_requests)`` and what it
    returned: with ``reset_running_requests`` every running request is preempted
    first; the cache is emptied only when no block is in use."""

    seq: Count
    reset_running_requests: bool = False
    succeeded: bool = True
    reset_connector: bool = False   # the connector's cache was reset too; its answer is in succeeded
    kind: ClassVar[str] = "reset_prefix_cache"


class PauseState(_Record, tag="pause_state"):
    """``Scheduler.set_pause_state(state)``, as vLLM's ``pause_scheduler`` /
    ``resume_scheduler`` call it: from ``PAUSED_NEW`` on, admissions take only
    waiting requests that hold blocks (a completed async load); from
    ``PAUSED_ALL`` on, ``schedule()`` schedules nothing; ``UNPAUSED`` resumes."""

    seq: Count
    state: Literal[PAUSE_STATES]
    kind: ClassVar[str] = "pause_state"


# --------------------------------------------------------------------------- step


class Lookup(_Part):
    """One ``connector.get_num_new_matched_tokens(request, num_local)`` call:
    the argument passed in and the answer. ``ext`` is None when the connector
    answered "not ready yet"."""

    req: str
    local: Count
    ext: Signed | None   # a broken connector can answer less than 0: recorded as it is
    load_async: bool = False


class KVLoad(_Part):
    """A load the connector planned in this step: token positions [start, end) of ``req``."""

    req: str
    start: Count
    end: Count


def joined_groups(ids: list[int], more: list[list[int]] | None) -> list:
    """A record's block ids as compared across traces: group 0's, or with
    several KV-cache groups whose others hold any, one list per group."""
    return [ids, *more] if more and any(more) else ids


class ScheduledNew(_Part):
    """A request in ``scheduled_new_reqs`` (or a resumed one): its whole block table."""

    req: str
    num_computed_tokens: Count  # pre-step value, as in NewRequestData
    num_scheduled_tokens: Count
    block_ids: list[Count]
    # With several KV-cache groups, block_ids is group 0's table and more_groups
    # holds groups 1, 2, ... in order; absent with one group, and when those
    # are all empty.
    more_groups: list[list[Count]] | None = None


class ScheduledRunning(_Part):
    """A running request in ``scheduled_cached_reqs``: only its newly allocated blocks."""

    req: str
    num_computed_tokens: Count
    num_scheduled_tokens: Count
    new_block_ids: list[Count]
    more_groups: list[list[Count]] | None = None   # groups 1, 2, ...: as ScheduledNew's


class RequestState(_Part):
    """A request as the scheduler holds it at a point in time."""

    req: str
    status: Status
    num_computed_tokens: Count
    num_tokens: Count
    num_preemptions: Count
    block_ids: list[Count]
    more_groups: list[list[Count]] | None = None   # groups 1, 2, ...: as ScheduledNew's


class Step(_Record, tag="step"):
    """One ``Scheduler.schedule()`` call and what it decided."""

    seq: Count
    step: Count
    new: list[ScheduledNew] = []
    resumed: list[ScheduledNew] = []
    running: list[ScheduledRunning] = []
    preempted: list[str] = []
    finished: list[str] = []
    lookups: list[Lookup] = []
    # The connector's load plan for this step; None when the engine cannot show it.
    loads: list[KVLoad] | None = None
    states: list[RequestState] = []
    num_free_blocks: Count | None = None
    # Speculative decoding: the draft tokens scheduled for each request that has
    # any (``scheduled_spec_decode_tokens``; -1 for a padding slot); None when none.
    spec: dict[str, list[Draft]] | None = None
    # Structured outputs: the requests whose grammar this step found compiled
    # ("ready") or failed ("error"), the first time it did; None when none.
    grammar: dict[str, Literal[GRAMMAR_OUTCOMES]] | None = None
    # The engine core asked this step to hold prefills back
    # (``schedule(throttle_prefills=True)``: data-parallel prefill balancing).
    throttle_prefills: bool = False
    kind: ClassVar[str] = "step"

    def scheduled(self) -> dict[str, int]:
        """req -> num_scheduled_tokens for every request scheduled in this step."""
        out = {s.req: s.num_scheduled_tokens for s in self.new}
        out.update((s.req, s.num_scheduled_tokens) for s in self.resumed)
        out.update((s.req, s.num_scheduled_tokens) for s in self.running)
        return out


class StepFailed(_Record, tag="step_failed"):
    """A ``Scheduler.schedule()`` call that raised: step ``step`` never
    returned, so no ``step`` record has it. What the call had asked up to the
    failure, as a ``step`` record holds it (``lookups`` in call order,
    ``loads``, ``grammar``, ``throttle_prefills``): the inputs a replay needs
    to run the same step. ``error``: the exception, ``Type: message`` on one
    line; ``where``: the innermost frame it was raised in, ``path:line in
    function``, the path relative to the folder it was imported from
    (``vllm/v1/core/sched/scheduler.py:1372 in schedule``)."""

    seq: Count
    step: Count
    error: str
    where: str | None = None
    lookups: list[Lookup] = []
    loads: list[KVLoad] | None = None
    grammar: dict[str, Literal[GRAMMAR_OUTCOMES]] | None = None
    throttle_prefills: bool = False
    kind: ClassVar[str] = "step_failed"


# --------------------------------------------------------------------------- output


class ConnectorOutput(_Part):
    """``KVConnectorOutput`` of one model step."""

    finished_recving: list[str] = []
    finished_sending: list[str] = []
    failed_recving: list[str] = []
    invalid_block_ids: list[Count] = []

    def is_empty(self) -> bool:
        return not (self.finished_recving or self.finished_sending or self.failed_recving
                    or self.invalid_block_ids)


class Output(_Record, tag="output"):
    """``Scheduler.update_from_output`` for one step: the model's sampled tokens
    (inputs) and what the scheduler made of them (outputs)."""

    seq: Count
    step: Count
    sampled: dict[str, list[Count]] = {}  # raw, before stop trimming
    connector: ConnectorOutput | None = None
    finished: dict[str, FinishReason] = {}  # req -> finish reason
    states: list[RequestState] = []
    # Structured outputs: the requests whose grammar refused the tokens this
    # output sampled; the scheduler finishes them with an error. None when none.
    grammar_rejected: list[str] | None = None
    # Pooling requests whose pooler output this model step produced: each is done
    # (S:2170-2173). None when none.
    pooled: list[str] | None = None
    # The connector's prefix-cache stats the scheduler made since the output
    # before (``make_stats``, with log stats on); None when it made none.
    connector_cache: CacheStats | None = None
    kind: ClassVar[str] = "output"

    def turn_ends(self) -> dict[str, RequestState]:
        """The requests whose turn, not whose life, this output ends: it reports
        their finish reason, and their state goes on (streaming-input sessions,
        S:2465-2491), each with that state."""
        if not self.finished:   # most outputs: nothing to look at
            return {}
        return {st.req: st for st in self.states
                if st.req in self.finished and not st.status.startswith("FINISHED_")}


class CacheStats(_Part):
    """vLLM's ``PrefixCacheStats`` of the connector, summed over the
    ``make_stats`` calls since the output before: requests admitted with a
    lookup, the tokens queried and hit; the same for requests resumed after a
    preemption (S:1295-1311, make_stats S:2915-2930)."""

    requests: Count = 0
    queries: Count = 0
    hits: Count = 0
    preempted_requests: Count = 0
    preempted_queries: Count = 0
    preempted_hits: Count = 0


class PrefillStats(Struct):
    """vLLM 0.32's ``PrefillStats`` as emitted with a request's first output."""

    num_prompt_tokens: Signed
    num_local_cached_tokens: Signed
    num_external_cached_tokens: Signed
    num_cached_tokens: Signed
    num_computed_tokens: Signed
    num_cache_creation_tokens: Signed


class LegacyCounters(Struct):
    """The per-request counters of older V1 engines, as sent with the first output.
    Values are recorded as the engine held them, negative ones included."""

    num_cached_tokens: Signed
    num_external_computed_tokens: Signed


class PromptStats(_Record, tag="prompt_stats"):
    """The prompt-token accounting a request's first output carried."""

    seq: Count
    step: Count
    req: str
    prefill_stats: PrefillStats | None = None
    legacy: LegacyCounters | None = None
    kind: ClassVar[str] = "prompt_stats"

    def __post_init__(self) -> None:
        if self.prefill_stats is None and self.legacy is None:
            raise ValueError("a prompt_stats record needs 'prefill_stats' or 'legacy'")


class Drafts(_Record, tag="drafts"):
    """``Scheduler.update_draft_token_ids`` under speculative decoding with the
    synchronous scheduler: the draft tokens the model proposed right after the
    output for ``step``, for each request of that batch (an empty list: no draft).
    The scheduler keeps them as the request's next ``spec_token_ids``."""

    seq: Count
    step: Count
    drafts: dict[str, list[Count]] = {}
    kind: ClassVar[str] = "drafts"


class KVAudit(_Record, tag="kv_audit"):
    """The KV cache's real bytes at ``step``, as the process that owns the
    cache saw them: one 64-bit digest per block of all its layers' K and V
    (docs/reference/trace-format.md, "KV audit"), taken after the step's
    forward pass and the connector's loads and saves.

    ``cached``: blocks the step's forward pass filled (hash "" where not known yet);
    ``hits``: blocks a request admitted this step took as a local prefix hit;
    ``saved``: blocks the connector was handed to save; each entry
    ``[req, block, hash, digest]``, ``hash`` the engine's block hash (the first
    16 hex digits). ``loaded``: blocks a connector load wrote or should have
    written, ``[req, block, hash, before, after, asked, by_connector]``: the
    digest before the step and after it, whether the scheduler admitted the
    block as an external hit, and whether the connector loaded it by its own
    account (``view`` "metadata": what the connector's metadata for the step
    says it loads and saves) or by the bytes (``view`` "bytes": the block's
    bytes changed; a black-box connector's saves are not known). ``rank``:
    the tensor-parallel rank whose shard of the KV cache (its heads) the
    digests are of; absent with one rank. ``group``: the KV-cache group
    whose block table the blocks are in (its layers' bytes; the block hashes
    are that group's); absent with one group. ``stopped``: this worker's
    audit stopped here, and why (its later steps are not audited)."""

    seq: Count
    step: Count
    view: Literal["metadata", "bytes"] = "bytes"
    rank: Count | None = None
    group: Count | None = None
    stopped: str | None = None
    loaded: list[LoadedBlock] = []
    saved: list[BlockBytes] = []
    cached: list[BlockBytes] = []
    hits: list[BlockBytes] = []
    kind: ClassVar[str] = "kv_audit"


class Keyframe(_Record, tag="keyframe"):
    """The whole state a replay needs to start at ``step``: the reference
    scheduler's (every request, its counts, tokens and block tables; the queues;
    the block pool's reference counts, free-queue order and hash map) and the
    checks' own (steps in flight, connector answers, preemption counts), as
    the replay of the records before it left them. It comes right before the
    ``step`` record and shares its ``seq``. ``state`` is kvtrace's own
    (docs/reference/trace-format.md, "Keyframes"): written by ``kvtrace`` of
    ``version``, read by a kvtrace of the same keyframe ``format``. A replay
    from the start passes over it."""

    seq: Count
    step: Count
    format: int
    version: str
    state: dict[str, Any]
    # What a reader that starts here needs of the records before it: the
    # requests live, the streaming sessions among them, requests finished
    # lately (records may still name them), the steps recorded whose output
    # has not come, and the last step that had one.
    live: list[str] = []
    sessions: list[str] = []
    finished: list[str] = []
    awaiting: list[Count] = []
    last_output_step: int = -1
    kind: ClassVar[str] = "keyframe"


class End(_Record, tag="end"):
    """The last record of a trace the recorder closed. A trace without it was cut off."""

    seq: Count
    status: Literal[END_STATUSES] = "complete"
    error: str | None = None
    dropped_events: Count = 0
    kind: ClassVar[str] = "end"


Event = (Arrival | Abort | RequestFinished | ResetPrefixCache | PauseState | Step | StepFailed
         | Output | Drafts | PromptStats | KVAudit | Keyframe | End)
EVENT_TYPES: dict[str, type] = {cls.kind: cls for cls in Event.__args__}


# --------------------------------------------------------------------------- decoding

LINE_DECODER = msgspec.json.Decoder(Event)   # a line of bytes -> its event
_HEADER_LINE = msgspec.json.Decoder(dict)
def plain_values(obj: Any) -> Any:
    """A numpy integer or array (a recorder's copy of an engine's) as JSON values."""
    if hasattr(obj, "__index__"):
        return int(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.json.Encoder(enc_hook=plain_values)


def decode_line(raw: bytes) -> Event:
    """One line of a trace (not the header) → its event. Raises SchemaError for a
    record that does not fit, ``msgspec.DecodeError`` for bytes that are not
    JSON (the reader names those)."""
    try:
        return LINE_DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise SchemaError(_say(str(e))) from None


def decode(obj: Any) -> Event:
    """A parsed JSON object → its event class. Raises SchemaError."""
    if type(obj) is not dict:
        raise SchemaError(f"a record must be a JSON object, got {_tname(obj)}")
    if obj.get("kind") == "header":
        raise SchemaError("a second header record")
    try:
        return msgspec.convert(obj, Event)
    except msgspec.ValidationError as e:
        raise SchemaError(_say(str(e))) from None


def decode_header(obj: Any) -> Header:
    """The first record, parsed JSON → the header. Raises SchemaError."""
    if type(obj) is not dict or obj.get("kind") != "header":
        raise SchemaError("missing header: the first record must have kind 'header'")
    schema = obj.get("schema", ...)
    if schema is ...:
        raise SchemaError("missing field 'schema'")
    if type(schema) is not int:
        raise SchemaError(f"field 'schema': expected an integer, got {_tname(schema)} "
                          f"{clip(repr(schema))} (this kvtrace reads schema {SCHEMA_VERSION})")
    if schema != SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {clip(repr(schema))} (this kvtrace reads "
                          f"{SCHEMA_VERSION})")
    try:
        for key, value in obj.items():
            shallow(value, key)
    except ValueError as e:
        raise SchemaError(str(e)) from None
    features = features_from(obj.get("features", {}))
    try:
        h = msgspec.convert({**obj, "features": {}}, Header)
    except msgspec.ValidationError as e:
        raise SchemaError(_say(str(e))) from None
    h.features = features
    return h


def decode_header_line(raw: bytes) -> Header:
    """The first line of a trace → the header. Raises SchemaError, or
    ``msgspec.DecodeError`` for bytes that are not JSON."""
    return decode_header(_HEADER_LINE.decode(raw))


def to_json(obj: Any) -> Any:
    """An event (or any part of one) → plain JSON values, fields left at their
    default left out (a header's fields all kept)."""
    if type(obj) is Header:
        d = msgspec.to_builtins(obj, enc_hook=plain_values)
        d["features"] = obj.features.named()
        return d
    return msgspec.to_builtins(obj, enc_hook=plain_values)


def encode(event: Any) -> bytes:
    """An event (or a dict of a record's fields) → its JSON line, without the
    newline."""
    if type(event) is Header:
        return _ENCODER.encode(to_json(event))
    return _ENCODER.encode(event)


# --------------------------------------------------------------------------- messages

_AT = re.compile(r"^(.*?)(?: - at `\$\.?(.*)`)?$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")
_TYPES = {"int": "an integer", "str": "a string", "bool": "true or false", "float": "a number",
          "array": "a list", "object": "an object", "null": "null"}
_GOT = {**_TYPES, "bool": "a boolean", "array": "a list"}


def _say(msg: str, prefix: str = "") -> str:
    """msgspec's validation message in the words of this format: the field's
    path and the problem."""
    m = _AT.match(msg)
    problem, path = (m.group(1), m.group(2)) if m else (msg, None)
    path = prefix + (path or "") if (path or prefix) else ""
    path = path.rstrip(".")
    missing = _MISSING.match(problem)
    if missing:
        name = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"missing field '{name}'"
    if path == "kind" and problem.startswith("Invalid value"):
        value = problem.split(" ", 2)[2]
        return "a second header record" if value == "'header'" else f"unknown event kind {value}"
    if not path and problem.startswith("Expected `object`, got `"):
        return f"a record must be a JSON object, got {_GOT.get(problem[24:-1], problem[24:-1])}"
    problem = re.sub(r"got `(\w+)`", lambda t: "got " + _GOT.get(t.group(1), t.group(1)), problem)
    problem = re.sub(r"`([\w| ]+)`", lambda t: " or ".join(_TYPES.get(p.strip(), p.strip())
                                                           for p in t.group(1).split("|")), problem)
    problem = problem.replace("Invalid enum value", "not an allowed value:")
    problem = problem.replace("a string matching regex '^[0-9a-f]{64}$'",
                              "a sha256 digest (64 lowercase hex digits)")
    problem = problem[0].lower() + problem[1:] if problem else problem
    return f"field '{path}': {problem}" if path else problem


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: a value
    quoted in a message (a request id may be megabytes long)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def _tname(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)
