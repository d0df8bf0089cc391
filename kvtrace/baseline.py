"""The baseline profile (semantics doc, section 0.1): which engines' traces can
be replayed, by the reference and by vLLM's own scheduler alike.

Speculative decoding is inside it, under either scheduler: n-gram and
suffix decoding, and drafters that run a model (EAGLE, EAGLE3, one-module
MTP, a draft model), whose lookahead slots, input slots per request and, for
EAGLE, dropped hit block the reference models; with a fixed number of drafts
or one that follows the batch size (dynamic speculative decoding, whose table
the header holds). vLLM 0.32's scheduler reads nothing else of a drafter, so parallel
drafting (P-EAGLE, PARD, DFlash, DSpark), which only takes more of those
slots, is inside it too, though no trace of it was recorded here. Multi-module
MTP is not: its chunks keep clear of the drafter's reads. KV-cache groups
of full attention, sliding windows and states (Mamba, gated delta nets:
``MambaSpec``) are inside it, as ``kv_cache_groups`` lists them. Outside it,
the scheduler's arithmetic changes (partial hash hits, encoder budgets, ...). A trace whose header turns on such a feature is
refused, with the feature named, rather than replayed into false divergences. The vLLM
recorder writes every key read here (``build_header``); a key a trace does not
name is taken as off (traces recorded before ``lora`` and
``prefill_schedule_interval`` were written do not name them). Prompt
embeddings (``prompt_embeds``) are inside it: each such arrival carries the
digests vLLM keys its blocks with; so is LoRA, where the header says how
many adapters a step may run (``max_loras``) and each arrival names its
adapter.
"""

from __future__ import annotations

from kvtrace.trace.events import SchedulerFeatures, features_from

# Features that are on when they are true or a number above 0.
FLAGS = {
    "diffusion": "a diffusion language model (dLLM)",
    "multimodal": "a multimodal model",
    "prefix_replay_tokens": "prefix replay windows",
}
# Sizes that are on when they are not 1.
SIZES = {
    "pipeline_parallel_size": "pipeline parallelism",
    "decode_context_parallel_size": "decode context parallelism",
}
# KV-cache specs that vLLM 0.32 manages with its FullAttentionManager, the one
# the reference models.
FULL_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")
# Its SlidingWindowManager, modelled too (kvtrace/reference/kv_groups.py).
SLIDING_WINDOW = ("SlidingWindowSpec",)
# Its MambaManager (kvtrace/reference/state_groups.py).
STATE = ("MambaSpec",)


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
    cover, in words, or None. A dict is typed first (``features_from``).
    ``enable_prefix_caching``: the header's; without it, KV-cache groups may
    have block sizes of their own."""
    f = features if isinstance(features, SchedulerFeatures) else features_from(features)
    for key, what in FLAGS.items():
        v = getattr(f, key)
        if v:
            return f"{what} is on ({key}={v!r})"
    spec = speculative(f)
    if spec is not None:
        return spec
    if f.lora and f.max_loras is None:
        return "LoRA is on (lora=True), and the trace does not say how many adapters a step may run (max_loras)"
    for key, what in SIZES.items():
        v = getattr(f, key)
        if v not in (None, 1):
            return f"{what} is on ({key}={v!r})"
    interval = f.prefill_schedule_interval
    if (interval not in (None, 1) and f.data_parallel_size not in (None, 1)
            and not f.throttle_prefills_recorded):
        # vLLM's data-parallel engine core defers prefills to every interval-th
        # step (schedule(throttle_prefills=True)); a trace that does not record
        # that flag cannot be followed.
        return (f"data-parallel prefill throttling is on (prefill_schedule_interval={interval!r}) "
                "and the trace does not record which steps throttled prefills")
    if f.hash_block_size not in (None, block_size):
        return f"hash_block_size {f.hash_block_size!r} differs from block_size {block_size}"
    return kv_cache_groups(f, block_size, enable_prefix_caching)


MODELLED = FULL_ATTENTION + SLIDING_WINDOW + STATE


def kv_cache_groups(f: SchedulerFeatures, block_size: int,
                    enable_prefix_caching: bool = True) -> str | None:
    """Why a header's KV-cache groups are outside the baseline, or None: one
    full-attention group, or full-attention, sliding-window and state groups
    whose specs the header lists (``kv_cache_groups``), of ``block_size``
    unless prefix caching is off (then the scheduler's block is a multiple of
    each group's)."""
    kinds = f.kv_cache_group_kinds or [g.kind for g in f.kv_cache_groups or ()]
    other = [k for k in kinds if k not in MODELLED]
    if other:
        return (f"a KV-cache group of kind {other[0]!r}, not full attention, a sliding window "
                "or a state (MambaSpec)")
    n = f.num_kv_cache_groups
    if f.kv_cache_groups is None:
        if f.has_mamba_layers:
            return ("Mamba layers are on (has_mamba_layers=True), and the trace does not list "
                    "their KV-cache groups (kv_cache_groups)")
        if n not in (None, 1):
            return f"{n} KV-cache groups, and the trace does not list their specs (kv_cache_groups)"
        if any(k in SLIDING_WINDOW for k in kinds):
            return ("a sliding-window KV-cache group, and the trace does not list its spec "
                    "(kv_cache_groups)")
        if any(k in STATE for k in kinds):
            return ("a state (MambaSpec) KV-cache group, and the trace does not list its spec "
                    "(kv_cache_groups)")
        return None
    if n is not None and n != len(f.kv_cache_groups):
        return (f"num_kv_cache_groups is {n} but kv_cache_groups lists "
                f"{len(f.kv_cache_groups)}")
    for i, g in enumerate(f.kv_cache_groups):
        if g.kind not in MODELLED:
            return (f"a KV-cache group of kind {g.kind!r}, not full attention, a sliding window "
                    "or a state (MambaSpec)")
        if g.block_size != block_size and (enable_prefix_caching or block_size % g.block_size):
            return (f"KV-cache group {i} has block_size {g.block_size}, not the trace's "
                    f"{block_size}" + (" (groups of different block sizes share prefix-cache "
                                       "hits at a finer hash unit, which is not modelled)"
                                       if enable_prefix_caching else ""))
        if (g.kind in SLIDING_WINDOW) != (g.sliding_window is not None):
            return f"KV-cache group {i} ({g.kind}) gives sliding_window={g.sliding_window!r}"
        if g.kind in STATE:
            why = _state_group(i, g, enable_prefix_caching)
            if why is not None:
                return why
    states = [g for g in f.kv_cache_groups if g.kind in STATE]
    if len({g.mamba_cache_mode for g in states}) > 1:
        return "state groups of different cache modes (mamba_cache_mode)"
    # EAGLE changes which blocks a hit and the cache keep (KC:128-177,
    # KC:65-86, ST:1110-1122): not modelled with these groups; without
    # prefix caching it only adds lookahead slots, which are.
    if f.use_eagle and enable_prefix_caching and any(g.sliding_window for g in f.kv_cache_groups):
        return "EAGLE with a sliding-window KV-cache group and prefix caching"
    if f.use_eagle and enable_prefix_caching and states:
        return "EAGLE with a state (Mamba) KV-cache group and prefix caching"
    if states and f.num_hash_lookahead_tokens:
        return (f"lookahead block hashes (num_hash_lookahead_tokens={f.num_hash_lookahead_tokens}) "
                "with a state (Mamba) KV-cache group")
    return None


def _state_group(i: int, g, enable_prefix_caching: bool) -> str | None:
    """Why a state group (MambaSpec) is outside the baseline, or None."""
    for key in ("mamba_cache_mode", "num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if getattr(g, key) is None:
            return f"KV-cache group {i} (MambaSpec) does not say its {key}"
    if g.mamba_cache_mode == "none" and enable_prefix_caching:
        # vLLM 0.33 asserts against it (ST:1442-1444); no engine builds it.
        return (f"KV-cache group {i} (MambaSpec) keeps one state per request "
                "(mamba_cache_mode 'none') with prefix caching on")
    return None


def speculative(f: SchedulerFeatures) -> str | None:
    """Why a header's speculative decoding is outside the baseline, or None
    (none, or drafts under either scheduler, a fixed number or, with dynamic
    speculative decoding, a number by batch size from the header's table: by
    n-gram and suffix decoding, or by a drafter with its lookahead slots, its
    input slots per request and, for EAGLE, EAGLE3 and one-module MTP, the
    dropped hit block)."""
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
        ahead = f.num_prefill_lookahead_tokens
        if ahead is None:
            return (f"{on} by EAGLE is on, and the trace does not say how far past a prefill "
                    "chunk the drafter reads (num_prefill_lookahead_tokens)")
        if ahead > 1:
            # Multi-module MTP: chunks end clear of the drafter's reads (S:575-589),
            # and the last ahead - 1 computed tokens are never cached (KC:346-352).
            return f"{on} by multi-module MTP is on (num_prefill_lookahead_tokens={ahead!r})"
    return None
