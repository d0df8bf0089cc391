"""What the reference models, from a header's features: the baseline profile,
which engines' traces can be replayed, by the reference and by vLLM's own
scheduler alike.

Speculative decoding is inside it, under either scheduler: n-gram and
suffix decoding, and drafters that run a model (EAGLE, EAGLE3, one-module
MTP, a draft model), whose lookahead slots, input slots per request and, for
EAGLE, dropped hit block the reference models; with a fixed number of drafts
or one that follows the batch size (dynamic speculative decoding, whose table
the header holds). vLLM 0.32's scheduler reads nothing else of a drafter, so parallel
drafting (P-EAGLE, PARD, DFlash, DSpark), which only takes more of those
slots, is inside it too, though no trace of it was recorded here. So are
KV-cache groups of full attention, sliding windows and states (Mamba, gated
delta nets: ``MambaSpec``; Gemma 3, gpt-oss, Qwen3-Next, Nemotron-H), of one
block size under prefix caching, prompt embeddings (``prompt_embeds``: each such arrival carries the
digests vLLM keys its blocks with) and LoRA, where the header says how many
adapters a step may run (``max_loras``) and each arrival names its adapter.

``REFUSED`` is the one list of what the reference does not model: each entry
names it as the docs do (README.md, docs/guide/replay.md,
docs/reference/bad-input.md and docs/reference/checks.md list the same names;
tests/house/test_docs.py holds them to it) and says in one line where a header
turns it on. Replay refuses such a trace with that line rather than replay it
into false divergences. When the reference learns to model one, its entry
goes (and a KV-cache group kind it names joins ``MODELLED_KINDS``).

Apart from the list, a trace is refused where it does not say what replay
needs (``incomplete``): the number of input slots drafting takes, LoRA's
``max_loras``, the specs of its KV-cache groups, ... The vLLM recorder writes
every key read here (``build_header``); a key a trace does not name is taken
as off (traces recorded before ``lora`` and ``prefill_schedule_interval``
were written do not name them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvtrace.trace.events import SchedulerFeatures, features_from

# KV-cache specs that vLLM 0.32 manages with its FullAttentionManager, the one
# the reference models.
FULL_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")
# Its SlidingWindowManager, modelled too (kvtrace/reference/kv_groups.py).
SLIDING_WINDOW = ("SlidingWindowSpec",)
# Its MambaManager (kvtrace/reference/state_groups.py).
STATE = ("MambaSpec",)
MODELLED_KINDS = FULL_ATTENTION + SLIDING_WINDOW + STATE


@dataclass(frozen=True)
class Setting:
    """What of a header's config an entry may read beside its features."""

    block_size: int
    prefix_caching: bool = True


@dataclass(frozen=True)
class Refused:
    """One thing the reference does not model, which replay refuses in one line.

    ``name``: what it is, as the docs list it. ``on(features, setting,
    profile)``: where a header turns it on, in one line, or None. ``profile``
    is the version profile the reference follows, or None for what every
    replay refuses (the reference and ``--scheduler vllm`` alike); an entry
    that only some profiles refuse (``by_profile``) answers only with one."""

    name: str
    on: Callable[[SchedulerFeatures, Setting, Any], str | None]
    by_profile: bool = False


def _flag(key: str, what: str) -> Callable:
    """On when the feature ``key`` is true or a number above 0."""
    def on(f, at, profile):
        v = getattr(f, key)
        return f"{what} is on ({key}={v!r})" if v else None
    return on


def _size(key: str, what: str) -> Callable:
    """On when the size ``key`` is given and is not 1."""
    def on(f, at, profile):
        v = getattr(f, key)
        return f"{what} is on ({key}={v!r})" if v not in (None, 1) else None
    return on


def _group_kinds(f: SchedulerFeatures) -> list[str]:
    return list(f.kv_cache_group_kinds or [g.kind for g in f.kv_cache_groups or ()])


def _kinds(*kinds: str) -> Callable:
    """On for a KV-cache group of one of ``kinds``; with none, of any kind
    the reference does not model."""
    def on(f, at, profile):
        for k in _group_kinds(f):
            if (k in kinds) if kinds else k not in MODELLED_KINDS:
                return (f"a KV-cache group of kind {k!r}, not full attention, a sliding window "
                        "or a state (MambaSpec)")
        return None
    return on


def _either(*checks: Callable) -> Callable:
    def on(f, at, profile):
        return next((why for c in checks if (why := c(f, at, profile))), None)
    return on


def _multi_module_mtp(f, at, profile):
    ahead = f.num_prefill_lookahead_tokens
    if f.num_speculative_tokens and f.use_eagle and ahead is not None and ahead > 1:
        # Chunks end clear of the drafter's reads (S:575-589), and the last
        # ahead - 1 computed tokens are never cached (KC:346-352).
        return (f"speculative decoding (num_speculative_tokens={f.num_speculative_tokens!r}) "
                f"by multi-module MTP is on (num_prefill_lookahead_tokens={ahead!r})")
    return None


def _group_block_sizes(f, at, profile):
    """Groups of another block size share prefix-cache hits at a finer hash
    unit; without prefix caching the scheduler's block is a multiple of each
    group's (a state group of max_model_len beside attention)."""
    for i, g in enumerate(f.kv_cache_groups or ()):
        if g.block_size != at.block_size and (at.prefix_caching or at.block_size % g.block_size):
            return (f"KV-cache group {i} has block_size {g.block_size}, not the trace's "
                    f"{at.block_size}" + (" (groups of different block sizes share prefix-cache "
                                          "hits at a finer hash unit, which is not modelled)"
                                          if at.prefix_caching else ""))
    return None


def _eagle_with_groups(f, at, profile):
    # EAGLE changes which blocks a hit and the cache keep (KC:128-177,
    # KC:65-86, ST:1110-1122); without prefix caching it only adds lookahead
    # slots, which are modelled.
    groups = f.kv_cache_groups or ()
    if f.use_eagle and at.prefix_caching:
        if any(g.sliding_window for g in groups):
            return "EAGLE with a sliding-window KV-cache group and prefix caching"
        if any(g.kind in STATE for g in groups):
            return "EAGLE with a state (Mamba) KV-cache group and prefix caching"
    return None


def _hash_block_size(f, at, profile):
    if f.hash_block_size not in (None, at.block_size):
        return f"hash_block_size {f.hash_block_size!r} differs from block_size {at.block_size}"
    return None


def _state_modes(f, at, profile):
    states = [(i, g) for i, g in enumerate(f.kv_cache_groups or ()) if g.kind in STATE]
    if len({g.mamba_cache_mode for _, g in states}) > 1:
        return "state groups of different cache modes (mamba_cache_mode)"
    for i, g in states:
        if g.mamba_cache_mode == "none" and at.prefix_caching:
            # vLLM 0.33 asserts against it (ST:1442-1444); no engine builds it.
            return (f"KV-cache group {i} (MambaSpec) keeps one state per request "
                    "(mamba_cache_mode 'none') with prefix caching on")
    return None


def _states_with_lookahead(f, at, profile):
    if f.num_hash_lookahead_tokens and any(g.kind in STATE for g in f.kv_cache_groups or ()):
        return (f"lookahead block hashes (num_hash_lookahead_tokens={f.num_hash_lookahead_tokens}) "
                "with a state (Mamba) KV-cache group")
    return None


def _async_under(f, at, profile):
    if f.async_scheduling and not profile.async_scheduling_modelled:
        return (f"async scheduling under the {profile.name} profile ({profile.releases}): "
                "its AsyncScheduler keeps a preempted request's output placeholders, which "
                "the reference does not model; replay it with --scheduler vllm")
    return None


def _groups_under(f, at, profile):
    if f.kv_cache_groups and not profile.hybrid_kv_modelled:
        kind = "state" if any(g.kind in STATE for g in f.kv_cache_groups) else "sliding-window"
        return (f"{kind} KV-cache groups under the {profile.name} profile "
                f"({profile.releases}): the reference models vLLM 0.32's and 0.33's hybrid "
                "KV-cache manager only")
    return None


def _embeds_with_lookahead(f, at, profile):
    # A prompt of embeddings keys a block by its rows, and the trace's digests
    # do not cover the rows after a block.
    if f.num_hash_lookahead_tokens and f.prompt_embeds:
        return ("prompt embeddings with lookahead block hashes (num_hash_lookahead_tokens="
                f"{f.num_hash_lookahead_tokens}): the trace's digests do not cover the rows "
                "after each block")
    return None


# What the reference does not model, in the order replay looks for it: a
# header with several of them is refused with the first one's line.
REFUSED: tuple[Refused, ...] = (
    Refused("diffusion language models", _flag("diffusion", "a diffusion language model (dLLM)")),
    Refused("multimodal models", _flag("multimodal", "a multimodal model")),
    Refused("prefix replay windows", _flag("prefix_replay_tokens", "prefix replay windows")),
    Refused("multi-module MTP", _multi_module_mtp),
    Refused("pipeline parallelism", _size("pipeline_parallel_size", "pipeline parallelism")),
    Refused("decode context parallelism",
            _size("decode_context_parallel_size", "decode context parallelism")),
    # A KV-cache group of a kind that is none of full attention, sliding
    # window or state: chunked local attention, cross-attention, encoder-only, ...
    Refused("other kinds of KV-cache group (chunked local or cross-attention)", _kinds()),
    Refused("KV-cache groups of another block size under prefix caching", _group_block_sizes),
    Refused("EAGLE with a sliding-window or state group under prefix caching", _eagle_with_groups),
    Refused("a hash block size other than the block size (partial prefix hits)",
            _hash_block_size),
    Refused("state groups of mixed cache modes or one state per request under prefix caching",
            _state_modes),
    Refused("lookahead block hashes with a state group", _states_with_lookahead),
    Refused("sliding-window or state groups or async scheduling under the legacy and 0.19 "
            "profiles", _either(_groups_under, _async_under), by_profile=True),
    Refused("prompt embeddings with lookahead block hashes", _embeds_with_lookahead,
            by_profile=True),
)


def refusal(features: SchedulerFeatures, block_size: int, scope: str,
            enable_prefix_caching: bool = True) -> str | None:
    """Why a replay refuses a header's ``features``, or None: the first thing
    outside the baseline, followed by ``scope``, what that replay covers. (A
    feature of the wrong type never gets here: the reader refuses the header.)"""
    why = outside(features, block_size, enable_prefix_caching)
    return None if why is None else f"{why}; {scope}"


def outside(features: SchedulerFeatures | dict, block_size: int,
            enable_prefix_caching: bool = True) -> str | None:
    """The first thing in a header's ``features`` that the baseline does not
    cover, in words, or None: an entry of ``REFUSED`` that every replay
    refuses, or what the trace does not say (``incomplete``). A dict is typed
    first (``features_from``). ``enable_prefix_caching``: the header's config's."""
    f = features if isinstance(features, SchedulerFeatures) else features_from(features)
    at = Setting(block_size, enable_prefix_caching)
    for r in REFUSED:
        if not r.by_profile:
            why = r.on(f, at, None)
            if why is not None:
                return why
    return incomplete(f, block_size)


def profile_refusal(features: SchedulerFeatures, block_size: int, profile: Any) -> str | None:
    """The first entry of ``REFUSED`` that the reference refuses under
    ``profile`` (a ``kvtrace.reference.profiles.Profile``) only, in words, or None."""
    for r in REFUSED:
        if r.by_profile:
            why = r.on(features, Setting(block_size), profile)
            if why is not None:
                return why
    return None


def incomplete(f: SchedulerFeatures, block_size: int) -> str | None:
    """What a header does not say, or says inconsistently, that replay needs
    to follow a feature the reference models, in words, or None."""
    spec = speculative(f)
    if spec is not None:
        return spec
    if f.lora and f.max_loras is None:
        return "LoRA is on (lora=True), and the trace does not say how many adapters a step may run (max_loras)"
    interval = f.prefill_schedule_interval
    if (interval not in (None, 1) and f.data_parallel_size not in (None, 1)
            and not f.throttle_prefills_recorded):
        # vLLM's data-parallel engine core defers prefills to every interval-th
        # step (schedule(throttle_prefills=True)); a trace that does not record
        # that flag cannot be followed.
        return (f"data-parallel prefill throttling is on (prefill_schedule_interval={interval!r}) "
                "and the trace does not record which steps throttled prefills")
    return kv_cache_groups(f)


def kv_cache_groups(f: SchedulerFeatures) -> str | None:
    """What a header does not say, or says inconsistently, about its KV-cache
    groups, or None: one full-attention group needs nothing more; several, a
    sliding-window one or Mamba layers need their specs (``kv_cache_groups``),
    and a state group its cache mode and blocks."""
    n = f.num_kv_cache_groups
    if f.kv_cache_groups is None:
        if f.has_mamba_layers:
            return ("Mamba layers are on (has_mamba_layers=True), and the trace does not list "
                    "their KV-cache groups (kv_cache_groups)")
        if n not in (None, 1):
            return f"{n} KV-cache groups, and the trace does not list their specs (kv_cache_groups)"
        for k in _group_kinds(f):
            if k in SLIDING_WINDOW or k in STATE:
                what = "sliding-window" if k in SLIDING_WINDOW else "state (MambaSpec)"
                return f"a {what} KV-cache group, and the trace does not list its spec (kv_cache_groups)"
        return None
    if n is not None and n != len(f.kv_cache_groups):
        return (f"num_kv_cache_groups is {n} but kv_cache_groups lists "
                f"{len(f.kv_cache_groups)}")
    for i, g in enumerate(f.kv_cache_groups):
        if (g.kind in SLIDING_WINDOW) != (g.sliding_window is not None):
            return f"KV-cache group {i} ({g.kind}) gives sliding_window={g.sliding_window!r}"
        if g.kind in STATE:
            for key in ("mamba_cache_mode", "num_speculative_blocks",
                        "num_prefill_checkpoint_blocks"):
                if getattr(g, key) is None:
                    return f"KV-cache group {i} (MambaSpec) does not say its {key}"
    return None


def speculative(f: SchedulerFeatures) -> str | None:
    """What a header with speculative decoding does not say, or says
    inconsistently, or None (none, or drafts under either scheduler, a fixed
    number or, with dynamic speculative decoding, a number by batch size from
    the header's table: by n-gram and suffix decoding, or by a drafter with
    its lookahead slots, its input slots per request and, for EAGLE, EAGLE3
    and one-module MTP, the dropped hit block). Multi-module MTP is in
    ``REFUSED``."""
    k, eagle, lookahead = f.num_speculative_tokens, f.use_eagle, f.num_lookahead_tokens
    if not k:
        if eagle or lookahead:
            return (f"EAGLE or lookahead slots without speculative decoding (use_eagle={eagle!r}, "
                    f"num_lookahead_tokens={lookahead!r})")
        return None
    on = f"speculative decoding (num_speculative_tokens={k!r})"
    table = f.spec_tokens_by_batch_size
    if f.dynamic_spec_decode and table is None:
        return (f"dynamic {on} is on, and the trace does not say how many drafts each batch "
                "size takes (spec_tokens_by_batch_size)")
    if table is not None and (len(table) < 2 or any(not 0 <= v <= k for v in table)):
        return ("field 'features.spec_tokens_by_batch_size' must be a list of at least two "
                f"integers from 0 to num_speculative_tokens ({k}), got {table!r}")
    if f.num_draft_slots is None:
        return f"{on} is on, and the trace does not say how many input slots drafting takes"
    if eagle:
        if f.eagle_block_drop is None:
            return (f"{on} by EAGLE is on, and the trace does not say whether a prefix hit drops "
                    "its last block (eagle_block_drop)")
        if f.num_prefill_lookahead_tokens is None:
            return (f"{on} by EAGLE is on, and the trace does not say how far past a prefill "
                    "chunk the drafter reads (num_prefill_lookahead_tokens)")
    return None
