"""A request as the scheduler sees it (semantics doc 1)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from .hashing import PromptEmbeds, extend_block_hashes


class Status(IntEnum):
    WAITING = 1
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 2   # a structured output's grammar compiling
    WAITING_FOR_REMOTE_KVS = 3
    WAITING_FOR_STREAMING_REQ = 4   # a streaming-input session between turns
    RUNNING = 5
    PREEMPTED = 6
    FINISHED_STOPPED = 7
    FINISHED_LENGTH_CAPPED = 8
    FINISHED_ABORTED = 9
    FINISHED_IGNORED = 10
    FINISHED_ERROR = 11

    @property
    def is_finished(self) -> bool:
        return self > Status.PREEMPTED


FINISH_REASONS = {
    Status.FINISHED_STOPPED: "stop",
    Status.FINISHED_LENGTH_CAPPED: "length",
    Status.FINISHED_IGNORED: "length",
    Status.FINISHED_ABORTED: "abort",
    Status.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class PrefillStats:
    """How the first scheduled prefill split into local hits, external hits and
    compute (MS:307-346)."""

    num_prompt_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_cache_creation_tokens: int = 0

    def set(self, prompt: int, local: int, external: int) -> None:
        assert local + external <= prompt
        self.num_prompt_tokens = prompt
        self.num_local_cached_tokens = local
        self.num_external_cached_tokens = external
        self.num_cached_tokens = local + external
        self.num_computed_tokens = prompt - (local + external)

    def finalize(self, cached_tokens: int) -> None:
        self.num_cache_creation_tokens = max(
            0, min(cached_tokens, self.num_prompt_tokens) - self.num_cached_tokens)


@dataclass(slots=True)
class LegacyAdmission:
    """An admission to RUNNING, as the legacy pair it gives: the lookup it came
    from (an index in lookup_history), num_computed_tokens at the admission,
    and that lookup's external hit less what failed loads took off since."""

    lookup: int
    num_cached_tokens: int
    num_external_computed_tokens: int


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_size: int
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_reading_prefix_cache: bool = False
    # A streaming-input session: its input comes in chunks under one id, and a
    # stop ends a turn, not the request (S:2465-2491).
    resumable: bool = False
    # A structured output: None for a request without a grammar, else where the
    # engine's compile of it stands: "compiling", "ready" or "error" (R:116-117).
    # The request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until the
    # scheduler finds it compiled (S:3191-3200).
    grammar: str | None = None
    # A pooling request: it samples nothing, and stops when its pooler output comes.
    pooling: bool = False
    # Repetition detection: (max_pattern_size, min_pattern_size, min_count), or
    # None; it stops nothing before min_tokens output tokens (SU:122-135).
    repetition: tuple[int, int, int] | None = None
    min_tokens: int = 0
    # A prompt of embeddings: what of them is part of each block's hash
    # (semantics doc 4.2); None for a prompt of token ids.
    prompt_embeds: PromptEmbeds | None = None
    # A LoRA adapter: (id, name, path). Its name and path key every block
    # (semantics doc 4.2); its id counts against max_loras.
    lora: tuple[int, str, str] | None = None
    # vLLM 0.33's lookahead block hashes: the tokens after each block its hash
    # covers (hashing.py).
    hash_lookahead: int = 0

    status: Status = Status.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    # len(all_token_ids), kept in step with it: read many times per step.
    num_tokens: int = field(init=False, default=0)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Async scheduling (semantics doc 1.1): tokens scheduled whose sampled token
    # has not come back yet, counted inside num_computed_tokens.
    num_output_placeholders: int = 0
    # Scheduled tokens whose step's output has not been processed yet, and the
    # part of them that a preemption made stale (S:1596-1606).
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    # Several KV-cache groups: where its last lookup's full-attention hit went
    # past the hit every group holds (0: nowhere); sliding-window groups keep the
    # window ending there for later hits (kv_groups.py).
    shared_prefix_boundary: int = 0
    drop_stale_output: bool = False   # the stale output is discarded, not delivered
    last_sched_seq: int = 0           # the last non-empty step that scheduled it (defer_block_free)
    # Set by each schedule() of the request: False when the step samples a token.
    is_prefill_chunk: bool = True
    # Speculative decoding: the drafts proposed for the next step (R:183), set by
    # update_draft_token_ids and used up when the request is scheduled.
    spec_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    prefill_stats: PrefillStats | None = field(default_factory=PrefillStats)
    # Legacy per-request counters of older V1 engines (semantics doc 1.5). Under
    # the legacy profiles they follow those releases: num_cached_tokens set once,
    # at the first admission; the external count at every lookup, less what a
    # failed load takes off. Otherwise the maintainers' rule: both from the
    # first scheduled prefill. Each names the lookup that set it (its index in
    # lookup_history).
    legacy_num_cached_tokens: int = -1
    legacy_num_external_computed_tokens: int = 0
    legacy_cached_from: int | None = None
    legacy_external_from: int | None = None
    # Each admission to RUNNING before the first output, with the pair it gives
    # under the rule "both counters at each admission".
    legacy_admissions: list[LegacyAdmission] = field(default_factory=list)
    # Every (step, local, external, async) split a lookup produced, in order;
    # the replayer checks emitted counters against these.
    lookup_history: list[tuple[int, int, int, bool]] = field(default_factory=list)
    invalid_block_hits: int = 0   # how many times a load failure truncated this request
    # A session's next chunks, given while a turn runs; None is the end of its input.
    streaming_queue: "deque[StreamingUpdate | None] | None" = None

    def __post_init__(self) -> None:
        if self.grammar is not None:
            self.status = Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt,
                            self.prompt_embeds, None if self.lora is None else ("lora", *self.lora[1:]),
                            self.hash_lookahead)

    def rehash(self) -> None:
        """Every block hash again, from the tokens the request has now."""
        self.block_hashes.clear()
        self._extend_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        if (self.num_tokens - self.hash_lookahead) % self.block_size == 0:   # a block's hash is due
            self._extend_hashes()

    def start_next_turn(self, update: "StreamingUpdate", keep: int,
                        truncate_hashes: bool = True) -> None:
        """A session's next chunk (S:1650-1685): its output tokens up to position
        ``keep`` join the prompt, the rest are dropped, and the chunk's tokens
        follow. The chunk brings its own sampling parameters. A legacy engine
        (``truncate_hashes`` False) keeps the hashes of the dropped tokens'
        blocks, and hashes only the blocks past them."""
        n = keep
        kept = self.all_token_ids[len(self.prompt_token_ids):n]
        del self.all_token_ids[n:]
        if truncate_hashes:
            del self.block_hashes[n // self.block_size:]
        self.prompt_token_ids.extend(kept)
        self.all_token_ids.extend(update.prompt_token_ids)
        self.prompt_token_ids.extend(update.prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)
        self._extend_hashes()
        self.arrival_time = update.arrival_time
        self.max_tokens = update.max_tokens
        self.stop_token_ids = update.stop_token_ids
        self.ignore_eos = update.ignore_eos
        self.min_tokens = update.min_tokens
        self.repetition = update.repetition

    def set_legacy_external(self, num_external: int) -> None:
        """The last lookup sets the legacy external count."""
        self.legacy_num_external_computed_tokens = num_external
        self.legacy_external_from = len(self.lookup_history) - 1

    def note_legacy_admission(self) -> None:
        """The request became RUNNING before its first output, from its last lookup."""
        k = len(self.lookup_history) - 1
        if k < 0 or self.prefill_stats is None:
            return
        ext = (self.legacy_num_external_computed_tokens if self.legacy_external_from == k
               else self.lookup_history[k][2])
        self.legacy_admissions.append(LegacyAdmission(k, self.num_computed_tokens, ext))

    def take_off_legacy_external(self, tokens: int) -> None:
        """A failed load takes ``tokens`` off the legacy external count, and off
        the admission whose lookup set it."""
        self.legacy_num_external_computed_tokens -= tokens
        for a in self.legacy_admissions:
            if a.lookup == self.legacy_external_from:
                a.num_external_computed_tokens -= tokens

    def take_prefill_stats(self) -> PrefillStats | None:
        stats, self.prefill_stats = self.prefill_stats, None
        return stats

    def __lt__(self, other: "Request") -> bool:
        """Priority-queue order: priority, then arrival time, then id."""
        return ((self.priority, self.arrival_time, self.request_id)
                < (other.priority, other.arrival_time, other.request_id))

    def __hash__(self) -> int:
        """By identity, as a plain object (sets of requests). Compiled, a class
        that orders its objects hashes them only when it says so."""
        return object.__hash__(self)


@dataclass(frozen=True, slots=True)
class StreamingUpdate:
    """What a session's next chunk changes (vLLM's ``StreamingUpdate``)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int = 0
    repetition: tuple[int, int, int] | None = None

    @classmethod
    def from_request(cls, r: Request) -> "StreamingUpdate | None":
        """A chunk given as a request under the session's id; None for the end of
        the session's input (a request that is not resumable)."""
        if not r.resumable:
            return None
        return cls(tuple(r.prompt_token_ids), r.max_tokens, r.arrival_time,
                   r.stop_token_ids, r.ignore_eos, r.min_tokens, r.repetition)


def check_stop(request: Request, max_model_len: int, min_tokens_first: bool = False) -> bool:
    """After appending one token: has the request finished? (SU:98-140) Under
    min_tokens nothing but the length stops it; a legacy engine
    (``min_tokens_first``) lets nothing stop it under min_tokens."""
    if min_tokens_first and request.num_output_tokens < request.min_tokens:
        return False
    last = request.all_token_ids[-1]
    if request.eos_token_id is not None and not request.ignore_eos and last == request.eos_token_id:
        request.status = Status.FINISHED_STOPPED
        return True
    if last in request.stop_token_ids:
        request.status = Status.FINISHED_STOPPED
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = Status.FINISHED_LENGTH_CAPPED
        return True
    if (request.repetition is not None and request.num_output_tokens >= request.min_tokens
            and _repeats(request.all_token_ids[request.num_prompt_tokens:], *request.repetition)):
        request.status = Status.FINISHED_STOPPED   # vLLM's FINISHED_REPETITION
        return True
    return False


def _repeats(output: list[int], max_size: int, min_size: int, min_count: int) -> bool:
    """Whether the output ends in a pattern of min_size..max_size tokens
    repeated min_count times (vLLM's check_sequence_repetition, SU:28-62)."""
    min_size = max(min_size, 1)
    if max_size <= 0 or min_count < 2 or min_size > max_size:
        return False
    for size in range(min_size, max_size + 1):
        if size * min_count > len(output):
            return False
        tail = output[-size:]
        if all(output[-size * (k + 1):len(output) - size * k] == tail for k in range(1, min_count)):
            return True
    return False
