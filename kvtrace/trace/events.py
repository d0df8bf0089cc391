"""Trace events: the only coupling between recording and replay.

Every line of a trace is one JSON object with a ``kind``. The classes below are
the typed form of those objects; ``decode`` turns a parsed JSON object into one
of them and raises ``SchemaError`` with a precise message when the object does
not fit. Field names follow vLLM's own names (``num_computed_tokens``,
``block_ids`` ...) so that a scheduler engineer can read a trace line by eye.

docs/trace-format.md is the prose version of this file; keep them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import chain, starmap
from operator import itemgetter
from typing import Any

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
_STATUS_SET = frozenset(STATUSES)
FINISH_REASONS = ("stop", "length", "abort", "error")
FINISHED_STATUSES = tuple(s for s in STATUSES if s.startswith("FINISHED_"))
_FINISH_SET = frozenset(FINISH_REASONS)
# The finish reason of each finished status (vLLM's RequestStatus.get_finished_reason).
STATUS_REASONS = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length",
                  "FINISHED_ABORTED": "abort", "FINISHED_IGNORED": "length",
                  "FINISHED_ERROR": "error"}
POLICIES = ("fcfs", "priority")
COUNTER_SHAPES = ("prefill_stats", "legacy")
END_STATUSES = ("complete", "recorder-error", "interrupted")
PAUSE_STATES = ("UNPAUSED", "PAUSED_NEW", "PAUSED_ALL")
GRAMMAR_OUTCOMES = ("ready", "error")

# Sanity bounds: a value above these is a corrupt trace, not a big run.
MAX_COUNT = 1 << 40
# The most KV slots (num_blocks * block_size) and the longest max_model_len a
# header may claim: about 2 billion tokens, far beyond any real deployment. Replay
# sizes its shadow KV cache by the header, so an absurd header must not reach it.
MAX_KV_SLOTS = 1 << 31
MAX_NUM_BLOCKS = 1 << 24   # 16.7 million blocks: far above any engine's pool
MAX_MODEL_LEN = 1 << 31


class SchemaError(ValueError):
    """An object that does not fit the trace schema. The message names the problem;
    the reader adds the file and line."""


# --------------------------------------------------------------------------- checks


def _int(v: Any, name: str, lo: int = 0) -> int:
    if type(v) is not int:
        raise SchemaError(f"field '{name}' must be an integer, got {_tname(v)}")
    if v < lo or v > MAX_COUNT:
        raise SchemaError(f"field '{name}' is out of range: {v} (allowed: {_bound(lo)}..2^40)")
    return v


def _bound(lo: int) -> str:
    return "-2^40" if lo == -MAX_COUNT else str(lo)


def _opt_int(v: Any, name: str, lo: int = 0) -> int | None:
    return None if v is None else _int(v, name, lo)


def _num(v: Any, name: str) -> float:
    if type(v) not in (int, float):
        raise SchemaError(f"field '{name}' must be a number, got {_tname(v)}")
    return float(v)


def _str(v: Any, name: str) -> str:
    if type(v) is not str:
        raise SchemaError(f"field '{name}' must be a string, got {_tname(v)}")
    return v


def _opt_str(v: Any, name: str) -> str | None:
    return None if v is None else _str(v, name)


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise SchemaError(f"field '{name}' must be true or false, got {_tname(v)}")
    return v


_INT_ONLY = {int}


def _ints(v: Any, name: str, lo: int = 0) -> list[int]:
    # The common case checked by C-level calls; the loop below names the problem.
    if type(v) is list and _counts_ok(v, lo):
        return v
    if type(v) is not list:
        raise SchemaError(f"field '{name}' must be a list of integers, got {_tname(v)}")
    for x in v:
        if type(x) is not int:
            raise SchemaError(f"field '{name}' must be a list of integers, found {_tname(x)}")
        if x < lo or x > MAX_COUNT:
            raise SchemaError(f"field '{name}' holds an out-of-range value: {x} "
                              f"(allowed: {_bound(lo)}..2^40)")
    return v


def _token_map(v: Any, name: str, lo: int = 0) -> dict[str, list[int]] | None:
    """None, or an object of request id -> list of token ids of at least ``lo``."""
    if v is None:
        return None
    d = _obj(v, name)
    for k, ids in d.items():
        _ints(ids, f"{name}.{k}", lo)
    return d


def _grammar_map(v: Any) -> dict[str, str] | None:
    """None, or an object of request id -> "ready" | "error"."""
    if v is None:
        return None
    d = _obj(v, "grammar")
    for k, outcome in d.items():
        _choice(outcome, f"grammar.{k}", GRAMMAR_OUTCOMES)
    return d


REPETITION_FIELDS = ("max_pattern_size", "min_pattern_size", "min_count")


def _repetition(v: Any) -> dict[str, int] | None:
    """None, or the three counts of vLLM's RepetitionDetectionParams."""
    if v is None:
        return None
    d = _obj(v, "repetition_detection")
    return {k: _int(_get(d, k), f"repetition_detection.{k}") for k in REPETITION_FIELDS}


_HEX = frozenset("0123456789abcdef")


def _digests(v: Any, name: str) -> list[str] | None:
    """None, or a non-empty list of sha256 digests, each 64 lowercase hex digits."""
    if v is None:
        return None
    if type(v) is not list or not v:
        raise SchemaError(f"field '{name}' must be a non-empty list of sha256 digests")
    for x in v:
        if type(x) is not str or len(x) != 64 or not _HEX.issuperset(x):
            raise SchemaError(f"field '{name}' must hold sha256 digests (64 lowercase hex "
                              f"digits), found {x!r:.80}")
    return v


def _runs(v: Any, name: str, n: int) -> list[list[int]] | None:
    """None, or runs ``[start, end)`` of positions in ``0..n``, in order, none
    empty and none touching the next, so that one mask has one form."""
    if v is None:
        return None
    if type(v) is not list or not v:
        raise SchemaError(f"field '{name}' must be a non-empty list of [start, end] runs")
    last = -1
    for x in v:
        if (type(x) is not list or len(x) != 2 or type(x[0]) is not int or type(x[1]) is not int
                or not last < x[0] < x[1] <= n):
            raise SchemaError(f"field '{name}' must hold runs [start, end] of prompt positions, "
                              f"in order, none empty and none touching the next, within the "
                              f"prompt's {n} tokens; found {x!r:.80}")
        last = x[1]
    return v


def mask_from_runs(runs: list[list[int]] | None, n: int) -> list[bool]:
    """The per-position mask of ``n`` positions that ``runs`` [start, end) mark
    True (``Arrival.prompt_is_token_ids``); all False for None."""
    mask = [False] * n
    for start, end in runs or ():
        mask[start:end] = [True] * (end - start)
    return mask


def _lora(v: Any) -> dict | None:
    """None, or a LoRA adapter: its id (at least 1), name and path."""
    if v is None:
        return None
    d = _obj(v, "lora")
    lora = {"id": _int(_get(d, "id"), "lora.id", 1), "name": _str(_get(d, "name"), "lora.name"),
            "path": _str(_get(d, "path"), "lora.path")}
    if not lora["path"]:   # vLLM's LoRARequest has none without a path
        raise SchemaError("field 'lora.path' is empty")
    return lora


def _opt_strs(v: Any, name: str) -> list[str] | None:
    return None if v is None else _strs(v, name)


def _strs(v: Any, name: str) -> list[str]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise SchemaError(f"field '{name}' must be a list of strings")
    return v


def _choice(v: Any, name: str, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise SchemaError(f"field '{name}' must be one of {', '.join(allowed)}; got {v!r}")
    return v


def _obj(v: Any, name: str) -> dict:
    if type(v) is not dict:
        raise SchemaError(f"field '{name}' must be an object, got {_tname(v)}")
    return v


def _opt_obj(v: Any, name: str) -> dict | None:
    return None if v is None else _obj(v, name)


def _list_of(v: Any, name: str, cls: type) -> list:
    if type(v) is not list:
        raise SchemaError(f"field '{name}' must be a list, got {_tname(v)}")
    if v and hasattr(cls, "from_rows"):
        out = cls.from_rows(v)
        if out is not None:
            return out
    return [cls.from_json(_obj(x, name)) for x in v]


# A whole list of objects of one kind checked at once, by C-level passes over
# its columns (``from_rows``): less time than checking them one by one on the
# lists of requests that make up most of a trace (decoding a trace takes about
# 7% less CPU; docs/performance.md). Anything those passes do not accept goes
# through ``from_json`` item by item, which accepts the same objects and names
# the problem in the others.
_DICT, _STR, _LIST = {dict}, {str}, {list}


def _rows(v: list, keys: itemgetter, width: int) -> list[tuple] | None:
    """Each object's fields, in ``keys``' order, when every item of ``v`` is an
    object with those ``width`` keys and no others; else None."""
    if set(map(type, v)) != _DICT or set(map(len, v)) != {width}:
        return None
    try:
        return list(map(keys, v))
    except KeyError:
        return None


def _counts_ok(xs: tuple | list, lo: int = 0) -> bool:
    """Every item an integer in lo..2^40 (``_int``'s check), by C-level passes."""
    return not xs or (set(map(type, xs)) == _INT_ONLY and min(xs) >= lo and max(xs) <= MAX_COUNT)


def _id_lists_ok(lists: tuple) -> bool:
    """Every item a list of integers in 0..2^40 (``_ints``' check)."""
    return set(map(type, lists)) == _LIST and _counts_ok(list(chain.from_iterable(lists)))


def _reasons_ok(reasons) -> bool:
    """Every item a finish reason (``_choice``'s check)."""
    return set(map(type, reasons)) <= _STR and _FINISH_SET.issuperset(reasons)


def _tname(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _get(d: dict, key: str, default: Any = ...) -> Any:
    if key in d:
        return d[key]
    if default is ...:
        raise SchemaError(f"missing field '{key}'")
    return default


def _to_json(obj: Any) -> Any:
    """Dataclass → plain JSON object, dropping optional fields left at None (and
    flags left false that say to)."""
    if hasattr(obj, "__dataclass_fields__"):
        out = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if (v is None or v is False) and f.metadata.get("omit_none" if v is None else "omit_false"):
                continue
            if "omit_default" in f.metadata and v == f.default:
                continue
            out[f.name] = _to_json(v)
        return out
    if isinstance(obj, list):
        if _SCALARS.issuperset(map(type, obj)):   # token and block ids: no call per item
            return list(obj)
        return [_to_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    return obj


_SCALARS = frozenset((int, float, str, bool, type(None)))


_OMIT = {"omit_none": True}
_OMIT_FALSE = {"omit_false": True}
_OMIT_DEFAULT = {"omit_default": True}   # left out when it holds the field's default

# --------------------------------------------------------------------------- header


@dataclass(slots=True)
class ConnectorConfig:
    name: str
    load_failure_policy: str = "fail"  # "fail" (vLLM's default) or "recompute"

    @classmethod
    def from_json(cls, d: dict) -> "ConnectorConfig":
        return cls(
            name=_str(_get(d, "name"), "connector.name"),
            load_failure_policy=_choice(
                _get(d, "load_failure_policy", "fail"), "connector.load_failure_policy",
                ("fail", "recompute")),
        )


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int  # including vLLM's null block 0
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    max_num_scheduled_tokens: int | None = None  # defaults to max_num_batched_tokens
    watermark_blocks: int = 0
    connector: ConnectorConfig | None = None

    @classmethod
    def from_json(cls, d: dict) -> "SchedulerConfig":
        conn = _get(d, "connector", None)
        cfg = cls(
            block_size=_int(_get(d, "block_size"), "block_size", 1),
            num_blocks=_int(_get(d, "num_blocks"), "num_blocks", 2),
            max_num_batched_tokens=_int(_get(d, "max_num_batched_tokens"), "max_num_batched_tokens", 1),
            max_num_seqs=_int(_get(d, "max_num_seqs"), "max_num_seqs", 1),
            max_model_len=_int(_get(d, "max_model_len"), "max_model_len", 1),
            enable_prefix_caching=_bool(_get(d, "enable_prefix_caching", True), "enable_prefix_caching"),
            policy=_choice(_get(d, "policy", "fcfs"), "policy", POLICIES),
            long_prefill_token_threshold=_int(_get(d, "long_prefill_token_threshold", 0),
                                              "long_prefill_token_threshold"),
            max_num_scheduled_tokens=_opt_int(_get(d, "max_num_scheduled_tokens", None),
                                              "max_num_scheduled_tokens", 1),
            watermark_blocks=_int(_get(d, "watermark_blocks", 0), "watermark_blocks"),
            connector=None if conn is None else ConnectorConfig.from_json(_obj(conn, "connector")),
        )
        if cfg.num_blocks > MAX_NUM_BLOCKS:
            raise SchemaError(f"field 'num_blocks' is absurd: {cfg.num_blocks} (at most 2^24)")
        if cfg.num_blocks * cfg.block_size > MAX_KV_SLOTS:
            raise SchemaError(f"absurd KV cache: num_blocks * block_size = "
                              f"{cfg.num_blocks * cfg.block_size} slots (at most 2^31)")
        if cfg.max_model_len > MAX_MODEL_LEN:
            raise SchemaError(f"field 'max_model_len' is absurd: {cfg.max_model_len} (at most 2^31)")
        return cfg

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


@dataclass(slots=True)
class Header:
    engine: str
    engine_version: str
    config: SchedulerConfig
    counters: str = "prefill_stats"  # which prompt-stats shape the engine emits
    schema: int = SCHEMA_VERSION
    # Engine features outside the baseline profile (async_scheduling, speculative
    # decoding ...). Replay refuses a trace that turns one on.
    features: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # free-form: recorder, command, workload, fault
    kind: str = "header"

    @classmethod
    def from_json(cls, d: dict) -> "Header":
        schema = _get(d, "schema")
        if type(schema) is not int or schema != SCHEMA_VERSION:   # true == 1 in Python
            raise SchemaError(f"unsupported schema version {schema!r} (this kvtrace reads {SCHEMA_VERSION})")
        return cls(
            engine=_str(_get(d, "engine"), "engine"),
            engine_version=_str(_get(d, "engine_version"), "engine_version"),
            config=SchedulerConfig.from_json(_obj(_get(d, "config"), "config")),
            counters=_choice(_get(d, "counters", "prefill_stats"), "counters", COUNTER_SHAPES),
            features=_obj(_get(d, "features", {}), "features"),
            meta=_obj(_get(d, "meta", {}), "meta"),
        )


# --------------------------------------------------------------------------- inputs


@dataclass(slots=True)
class Arrival:
    """``Scheduler.add_request``: everything the scheduler reads from a new request."""

    seq: int
    req: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_reading_prefix_cache: bool = False
    # One input chunk of a streaming-input session (vLLM's resumable requests).
    resumable: bool = field(default=False, metadata=_OMIT_FALSE)
    # A structured output: the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    # until the scheduler finds its grammar compiled (``Step.grammar``).
    structured_output: bool = field(default=False, metadata=_OMIT_FALSE)
    # A pooling request (an embedding, a classification, a reward): it samples
    # no token, and finishes when its pooler output comes (``Output.pooled``).
    pooling: bool = field(default=False, metadata=_OMIT_FALSE)
    # vLLM's repetition detection (``RepetitionDetectionParams``): the request
    # stops once its output ends in a pattern of ``min_pattern_size`` to
    # ``max_pattern_size`` tokens repeated ``min_count`` times. None when off.
    repetition_detection: dict[str, int] | None = field(default=None, metadata=_OMIT)
    # A prompt given as embeddings (vLLM's ``enable_prompt_embeds``): the sha256
    # of each block's rows of them, as vLLM hashes them into the block's key
    # (block i: rows i*B to min((i+1)*B, n), with B the size vLLM hashes at,
    # the header's hash_block_size or else block_size, and n the prompt's
    # length). ``prompt_token_ids`` holds the ids vLLM's request hashes: 0 at
    # each position given as embeddings, unless the prompt came with ids of
    # its own. None for a prompt of token ids.
    prompt_embeds: list[str] | None = field(default=None, metadata=_OMIT)
    # A prompt of embeddings and token ids mixed (a chat message with embeddings
    # parts): the positions given as token ids, as runs [start, end) (vLLM's
    # ``prompt_is_token_ids`` mask); the others are given as embeddings. None
    # when every position is (or none is).
    prompt_is_token_ids: list[list[int]] | None = field(default=None, metadata=_OMIT)
    # The request's LoRA adapter (vLLM's LoRARequest): {"id": int, "name": str,
    # "path": str}. Its name and path key every block; its id counts against the
    # header's features.max_loras. None without one.
    lora: dict | None = field(default=None, metadata=_OMIT)
    # The request's kv_transfer_params as the connector reads them (a
    # disaggregated deployment's handoff: do_remote_prefill, remote_block_ids,
    # remote_request_id, ...). The scheduler passes them to the connector only;
    # ``kvtrace diff`` pairs a decode-side request with the prefill-side request
    # they name. None without them.
    kv_transfer_params: dict | None = field(default=None, metadata=_OMIT)
    kind: str = "arrival"

    @classmethod
    def from_json(cls, d: dict) -> "Arrival":
        prompt = _ints(_get(d, "prompt_token_ids"), "prompt_token_ids")
        if not prompt:
            raise SchemaError("field 'prompt_token_ids' is empty")
        embeds = _digests(_get(d, "prompt_embeds", None), "prompt_embeds")
        mask = _runs(_get(d, "prompt_is_token_ids", None), "prompt_is_token_ids", len(prompt))
        if mask is not None and embeds is None:
            raise SchemaError("field 'prompt_is_token_ids' is set on a prompt without "
                              "'prompt_embeds'")
        return cls(
            seq=_int(_get(d, "seq"), "seq"),
            req=_str(_get(d, "req"), "req"),
            prompt_token_ids=prompt,
            max_tokens=_int(_get(d, "max_tokens"), "max_tokens"),
            arrival_time=_num(_get(d, "arrival_time", 0.0), "arrival_time"),
            priority=_int(_get(d, "priority", 0), "priority", -MAX_COUNT),
            cache_salt=_opt_str(_get(d, "cache_salt", None), "cache_salt"),
            eos_token_id=_opt_int(_get(d, "eos_token_id", None), "eos_token_id"),
            stop_token_ids=_ints(_get(d, "stop_token_ids", []), "stop_token_ids"),
            min_tokens=_int(_get(d, "min_tokens", 0), "min_tokens"),
            ignore_eos=_bool(_get(d, "ignore_eos", False), "ignore_eos"),
            skip_reading_prefix_cache=_bool(_get(d, "skip_reading_prefix_cache", False),
                                            "skip_reading_prefix_cache"),
            resumable=_bool(_get(d, "resumable", False), "resumable"),
            structured_output=_bool(_get(d, "structured_output", False), "structured_output"),
            pooling=_bool(_get(d, "pooling", False), "pooling"),
            repetition_detection=_repetition(_get(d, "repetition_detection", None)),
            prompt_embeds=embeds,
            prompt_is_token_ids=mask,
            lora=_lora(_get(d, "lora", None)),
            kv_transfer_params=_opt_obj(_get(d, "kv_transfer_params", None), "kv_transfer_params"),
        )


@dataclass(slots=True)
class Abort:
    """``Scheduler.finish_requests(ids, status)`` from outside the scheduler:
    an abort (``FINISHED_ABORTED``, the default), or another finished status a
    caller gives (``FINISHED_STOPPED``, say)."""

    seq: int
    reqs: list[str]
    status: str = field(default="FINISHED_ABORTED", metadata=_OMIT_DEFAULT)
    kind: str = "abort"

    @property
    def reason(self) -> str:
        """The finish reason the status reads as (``abort`` for an abort)."""
        return STATUS_REASONS[self.status]

    @classmethod
    def from_json(cls, d: dict) -> "Abort":
        return cls(seq=_int(_get(d, "seq"), "seq"), reqs=_strs(_get(d, "reqs"), "reqs"),
                   status=_choice(_get(d, "status", "FINISHED_ABORTED"), "status",
                                  FINISHED_STATUSES))


@dataclass(slots=True)
class RequestFinished:
    """A KV connector's answer to ``request_finished(request, block_ids)``, made
    as the scheduler frees a finished request (S:3005-3058): whether it keeps the
    request's blocks until it reports the request in ``finished_sending``
    (``delay_free``: the prefill side of a disaggregated deployment, while the
    decode side reads them), and the transfer parameters it hands back. It
    comes before the record of the call that finished the request."""

    seq: int
    req: str
    delay_free: bool = False
    kv_transfer_params: dict | None = field(default=None, metadata=_OMIT)
    kind: str = "request_finished"

    @classmethod
    def from_json(cls, d: dict) -> "RequestFinished":
        params = _get(d, "kv_transfer_params", None)
        return cls(seq=_int(_get(d, "seq"), "seq"), req=_str(_get(d, "req"), "req"),
                   delay_free=_bool(_get(d, "delay_free", False), "delay_free"),
                   kv_transfer_params=_opt_obj(params, "kv_transfer_params"))


@dataclass(slots=True)
class ResetPrefixCache:
    """``Scheduler.reset_prefix_cache(reset_running_requests)`` and what it
    returned: with ``reset_running_requests`` every running request is preempted
    first; the cache is emptied only when no block is in use."""

    seq: int
    reset_running_requests: bool = False
    succeeded: bool = True
    reset_connector: bool = False   # the connector's cache was reset too; its answer is in succeeded
    kind: str = "reset_prefix_cache"

    @classmethod
    def from_json(cls, d: dict) -> "ResetPrefixCache":
        return cls(seq=_int(_get(d, "seq"), "seq"),
                   reset_running_requests=_bool(_get(d, "reset_running_requests", False),
                                                "reset_running_requests"),
                   succeeded=_bool(_get(d, "succeeded", True), "succeeded"),
                   reset_connector=_bool(_get(d, "reset_connector", False), "reset_connector"))


@dataclass(slots=True)
class PauseState:
    """``Scheduler.set_pause_state(state)``, as vLLM's ``pause_scheduler`` /
    ``resume_scheduler`` call it: from ``PAUSED_NEW`` on, admissions take only
    waiting requests that hold blocks (a completed async load); from
    ``PAUSED_ALL`` on, ``schedule()`` schedules nothing; ``UNPAUSED`` resumes."""

    seq: int
    state: str = "UNPAUSED"
    kind: str = "pause_state"

    @classmethod
    def from_json(cls, d: dict) -> "PauseState":
        return cls(seq=_int(_get(d, "seq"), "seq"),
                   state=_choice(_get(d, "state"), "state", PAUSE_STATES))


@dataclass(slots=True)
class Lookup:
    """One ``connector.get_num_new_matched_tokens(request, num_local)`` call:
    the argument passed in and the answer. ``ext`` is None when the connector
    answered "not ready yet"."""

    req: str
    local: int
    ext: int | None
    load_async: bool = False

    @classmethod
    def from_json(cls, d: dict) -> "Lookup":
        return cls(
            req=_str(_get(d, "req"), "lookups.req"),
            local=_int(_get(d, "local"), "lookups.local"),
            ext=_opt_int(_get(d, "ext"), "lookups.ext"),
            load_async=_bool(_get(d, "load_async", False), "lookups.load_async"),
        )


@dataclass(slots=True)
class KVLoad:
    """A load the connector planned in this step: token positions [start, end) of ``req``."""

    req: str
    start: int
    end: int

    @classmethod
    def from_json(cls, d: dict) -> "KVLoad":
        return cls(req=_str(_get(d, "req"), "loads.req"), start=_int(_get(d, "start"), "loads.start"),
                   end=_int(_get(d, "end"), "loads.end"))


# --------------------------------------------------------------------------- step


@dataclass(slots=True)
class ScheduledNew:
    """A request in ``scheduled_new_reqs`` (or a resumed one): its whole block table."""

    req: str
    num_computed_tokens: int  # pre-step value, as in NewRequestData
    num_scheduled_tokens: int
    block_ids: list[int]

    @classmethod
    def from_json(cls, d: dict) -> "ScheduledNew":
        return cls(
            req=_str(_get(d, "req"), "req"),
            num_computed_tokens=_int(_get(d, "num_computed_tokens"), "num_computed_tokens"),
            num_scheduled_tokens=_int(_get(d, "num_scheduled_tokens"), "num_scheduled_tokens"),
            block_ids=_ints(_get(d, "block_ids"), "block_ids"),
        )

    @classmethod
    def from_rows(cls, v: list) -> "list[ScheduledNew] | None":
        return _scheduled(cls, v, _rows(v, _NEW_KEYS, 4))


@dataclass(slots=True)
class ScheduledRunning:
    """A running request in ``scheduled_cached_reqs``: only its newly allocated blocks."""

    req: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: list[int]

    @classmethod
    def from_json(cls, d: dict) -> "ScheduledRunning":
        return cls(
            req=_str(_get(d, "req"), "req"),
            num_computed_tokens=_int(_get(d, "num_computed_tokens"), "num_computed_tokens"),
            num_scheduled_tokens=_int(_get(d, "num_scheduled_tokens"), "num_scheduled_tokens"),
            new_block_ids=_ints(_get(d, "new_block_ids"), "new_block_ids"),
        )

    @classmethod
    def from_rows(cls, v: list) -> "list[ScheduledRunning] | None":
        return _scheduled(cls, v, _rows(v, _RUNNING_KEYS, 4))


_NEW_KEYS = itemgetter("req", "num_computed_tokens", "num_scheduled_tokens", "block_ids")
_RUNNING_KEYS = itemgetter("req", "num_computed_tokens", "num_scheduled_tokens", "new_block_ids")


def _scheduled(cls: type, v: list, rows: list[tuple] | None) -> list | None:
    if rows is None:
        return None
    reqs, computed, scheduled, blocks = zip(*rows)
    if set(map(type, reqs)) == _STR and _counts_ok(computed + scheduled) and _id_lists_ok(blocks):
        return list(starmap(cls, rows))
    return None


@dataclass(slots=True)
class RequestState:
    """A request as the scheduler holds it at a point in time."""

    req: str
    status: str
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int
    block_ids: list[int]

    @classmethod
    def from_json(cls, d: dict) -> "RequestState":
        return cls(
            req=_str(_get(d, "req"), "states.req"),
            status=_choice(_get(d, "status"), "states.status", STATUSES),
            num_computed_tokens=_int(_get(d, "num_computed_tokens"), "states.num_computed_tokens"),
            num_tokens=_int(_get(d, "num_tokens"), "states.num_tokens"),
            num_preemptions=_int(_get(d, "num_preemptions"), "states.num_preemptions"),
            block_ids=_ints(_get(d, "block_ids"), "states.block_ids"),
        )

    @classmethod
    def from_rows(cls, v: list) -> "list[RequestState] | None":
        rows = _rows(v, _STATE_KEYS, 6)
        if rows is None:
            return None
        reqs, statuses, computed, tokens, preemptions, blocks = zip(*rows)
        if (set(map(type, reqs)) == _STR and set(map(type, statuses)) == _STR
                and _STATUS_SET.issuperset(statuses) and _counts_ok(computed + tokens + preemptions)
                and _id_lists_ok(blocks)):
            return list(starmap(cls, rows))
        return None


_STATE_KEYS = itemgetter("req", "status", "num_computed_tokens", "num_tokens", "num_preemptions", "block_ids")


@dataclass(slots=True)
class Step:
    """One ``Scheduler.schedule()`` call and what it decided."""

    seq: int
    step: int
    new: list[ScheduledNew] = field(default_factory=list)
    resumed: list[ScheduledNew] = field(default_factory=list)
    running: list[ScheduledRunning] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    lookups: list[Lookup] = field(default_factory=list)
    # The connector's load plan for this step; None when the engine cannot show it.
    loads: list[KVLoad] | None = field(default=None, metadata=_OMIT)
    states: list[RequestState] = field(default_factory=list)
    num_free_blocks: int | None = field(default=None, metadata=_OMIT)
    # Speculative decoding: the draft tokens scheduled for each request that has
    # any (``scheduled_spec_decode_tokens``; -1 for a padding slot); None when none.
    spec: dict[str, list[int]] | None = field(default=None, metadata=_OMIT)
    # Structured outputs: the requests whose grammar this step found compiled
    # ("ready") or failed ("error"), the first time it did; None when none.
    grammar: dict[str, str] | None = field(default=None, metadata=_OMIT)
    # The engine core asked this step to hold prefills back
    # (``schedule(throttle_prefills=True)``: data-parallel prefill balancing).
    throttle_prefills: bool = field(default=False, metadata=_OMIT_FALSE)
    kind: str = "step"

    @classmethod
    def from_json(cls, d: dict) -> "Step":
        loads = _get(d, "loads", None)
        return cls(
            seq=_int(_get(d, "seq"), "seq"),
            step=_int(_get(d, "step"), "step"),
            new=_list_of(_get(d, "new", []), "new", ScheduledNew),
            resumed=_list_of(_get(d, "resumed", []), "resumed", ScheduledNew),
            running=_list_of(_get(d, "running", []), "running", ScheduledRunning),
            preempted=_strs(_get(d, "preempted", []), "preempted"),
            finished=_strs(_get(d, "finished", []), "finished"),
            lookups=_list_of(_get(d, "lookups", []), "lookups", Lookup),
            loads=None if loads is None else _list_of(loads, "loads", KVLoad),
            states=_list_of(_get(d, "states", []), "states", RequestState),
            num_free_blocks=_opt_int(_get(d, "num_free_blocks", None), "num_free_blocks"),
            spec=_token_map(_get(d, "spec", None), "spec", lo=-1),
            grammar=_grammar_map(_get(d, "grammar", None)),
            throttle_prefills=_bool(_get(d, "throttle_prefills", False), "throttle_prefills"),
        )

    def scheduled(self) -> dict[str, int]:
        """req -> num_scheduled_tokens for every request scheduled in this step."""
        out = {s.req: s.num_scheduled_tokens for s in self.new}
        out.update((s.req, s.num_scheduled_tokens) for s in self.resumed)
        out.update((s.req, s.num_scheduled_tokens) for s in self.running)
        return out


# --------------------------------------------------------------------------- output


@dataclass(slots=True)
class ConnectorOutput:
    """``KVConnectorOutput`` of one model step."""

    finished_recving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> "ConnectorOutput":
        return cls(
            finished_recving=_strs(_get(d, "finished_recving", []), "finished_recving"),
            finished_sending=_strs(_get(d, "finished_sending", []), "finished_sending"),
            failed_recving=_strs(_get(d, "failed_recving", []), "failed_recving"),
            invalid_block_ids=_ints(_get(d, "invalid_block_ids", []), "invalid_block_ids"),
        )

    def is_empty(self) -> bool:
        return not (self.finished_recving or self.finished_sending or self.failed_recving
                    or self.invalid_block_ids)


@dataclass(slots=True)
class Output:
    """``Scheduler.update_from_output`` for one step: the model's sampled tokens
    (inputs) and what the scheduler made of them (outputs)."""

    seq: int
    step: int
    sampled: dict[str, list[int]] = field(default_factory=dict)  # raw, before stop trimming
    connector: ConnectorOutput | None = field(default=None, metadata=_OMIT)
    finished: dict[str, str] = field(default_factory=dict)  # req -> finish reason
    states: list[RequestState] = field(default_factory=list)
    # Structured outputs: the requests whose grammar refused the tokens this
    # output sampled; the scheduler finishes them with an error. None when none.
    grammar_rejected: list[str] | None = field(default=None, metadata=_OMIT)
    # Pooling requests whose pooler output this model step produced: each is done
    # (S:2170-2173). None when none.
    pooled: list[str] | None = field(default=None, metadata=_OMIT)
    kind: str = "output"

    @classmethod
    def from_json(cls, d: dict) -> "Output":
        sampled = _obj(_get(d, "sampled", {}), "sampled")
        if not _id_lists_ok(tuple(sampled.values())):
            for k, v in sampled.items():
                _ints(v, f"sampled.{k}")
        finished = _obj(_get(d, "finished", {}), "finished")
        if not _reasons_ok(finished.values()):
            for k, v in finished.items():
                _choice(v, f"finished.{k}", FINISH_REASONS)
        conn = _get(d, "connector", None)
        return cls(
            seq=_int(_get(d, "seq"), "seq"),
            step=_int(_get(d, "step"), "step"),
            sampled=sampled,
            connector=None if conn is None else ConnectorOutput.from_json(_obj(conn, "connector")),
            finished=finished,
            states=_list_of(_get(d, "states", []), "states", RequestState),
            grammar_rejected=_opt_strs(_get(d, "grammar_rejected", None), "grammar_rejected"),
            pooled=_opt_strs(_get(d, "pooled", None), "pooled"),
        )

    def turn_ends(self) -> dict[str, RequestState]:
        """The requests whose turn, not whose life, this output ends: it reports
        their finish reason, and their state goes on (streaming-input sessions,
        S:2465-2491), each with that state."""
        if not self.finished:   # most outputs: nothing to look at
            return {}
        return {st.req: st for st in self.states
                if st.req in self.finished and not st.status.startswith("FINISHED_")}


@dataclass(slots=True)
class PrefillStats:
    """vLLM 0.32's ``PrefillStats`` as emitted with a request's first output."""

    num_prompt_tokens: int
    num_local_cached_tokens: int
    num_external_cached_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    num_cache_creation_tokens: int

    @classmethod
    def from_json(cls, d: dict) -> "PrefillStats":
        return cls(**{f.name: _int(_get(d, f.name), f"prefill_stats.{f.name}", -MAX_COUNT)
                      for f in fields(cls)})


@dataclass(slots=True)
class LegacyCounters:
    """The per-request counters of older V1 engines, as sent with the first output.
    Values are recorded as the engine held them, negative ones included."""

    num_cached_tokens: int
    num_external_computed_tokens: int

    @classmethod
    def from_json(cls, d: dict) -> "LegacyCounters":
        return cls(
            num_cached_tokens=_int(_get(d, "num_cached_tokens"), "legacy.num_cached_tokens", -MAX_COUNT),
            num_external_computed_tokens=_int(_get(d, "num_external_computed_tokens"),
                                              "legacy.num_external_computed_tokens", -MAX_COUNT),
        )


@dataclass(slots=True)
class PromptStats:
    """The prompt-token accounting a request's first output carried."""

    seq: int
    step: int
    req: str
    prefill_stats: PrefillStats | None = field(default=None, metadata=_OMIT)
    legacy: LegacyCounters | None = field(default=None, metadata=_OMIT)
    kind: str = "prompt_stats"

    @classmethod
    def from_json(cls, d: dict) -> "PromptStats":
        ps, lg = _get(d, "prefill_stats", None), _get(d, "legacy", None)
        if ps is None and lg is None:
            raise SchemaError("a prompt_stats record needs 'prefill_stats' or 'legacy'")
        return cls(
            seq=_int(_get(d, "seq"), "seq"),
            step=_int(_get(d, "step"), "step"),
            req=_str(_get(d, "req"), "req"),
            prefill_stats=None if ps is None else PrefillStats.from_json(_obj(ps, "prefill_stats")),
            legacy=None if lg is None else LegacyCounters.from_json(_obj(lg, "legacy")),
        )


@dataclass(slots=True)
class Drafts:
    """``Scheduler.update_draft_token_ids`` under speculative decoding with the
    synchronous scheduler: the draft tokens the model proposed right after the
    output for ``step``, for each request of that batch (an empty list: no draft).
    The scheduler keeps them as the request's next ``spec_token_ids``."""

    seq: int
    step: int
    drafts: dict[str, list[int]] = field(default_factory=dict)
    kind: str = "drafts"

    @classmethod
    def from_json(cls, d: dict) -> "Drafts":
        return cls(seq=_int(_get(d, "seq"), "seq"),
                   step=_int(_get(d, "step"), "step"),
                   drafts=_token_map(_get(d, "drafts", {}), "drafts"))


@dataclass(slots=True)
class End:
    """The last record of a trace the recorder closed. A trace without it was cut off."""

    seq: int
    status: str = "complete"
    error: str | None = field(default=None, metadata=_OMIT)
    dropped_events: int = 0
    kind: str = "end"

    @classmethod
    def from_json(cls, d: dict) -> "End":
        return cls(
            seq=_int(_get(d, "seq"), "seq"),
            status=_choice(_get(d, "status", "complete"), "status", END_STATUSES),
            error=_opt_str(_get(d, "error", None), "error"),
            dropped_events=_int(_get(d, "dropped_events", 0), "dropped_events"),
        )


Event = (Arrival | Abort | RequestFinished | ResetPrefixCache | PauseState | Step | Output | Drafts
         | PromptStats | End)

EVENT_TYPES: dict[str, type] = {
    "arrival": Arrival,
    "abort": Abort,
    "request_finished": RequestFinished,
    "reset_prefix_cache": ResetPrefixCache,
    "pause_state": PauseState,
    "step": Step,
    "output": Output,
    "drafts": Drafts,
    "prompt_stats": PromptStats,
    "end": End,
}


def decode(obj: Any) -> Event:
    """A parsed JSON object → its event class. Raises SchemaError."""
    if type(obj) is not dict:
        raise SchemaError(f"a record must be a JSON object, got {_tname(obj)}")
    kind = obj.get("kind")
    cls = EVENT_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        if kind == "header":
            raise SchemaError("a second header record")
        raise SchemaError(f"unknown event kind {kind!r}")
    return cls.from_json(obj)


def decode_header(obj: Any) -> Header:
    if type(obj) is not dict or obj.get("kind") != "header":
        raise SchemaError("missing header: the first record must have kind 'header'")
    return Header.from_json(obj)


def to_json(event: Any) -> dict:
    return _to_json(event)
