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
MTP is not: its chunks keep clear of the drafter's reads. Outside it, the
scheduler's arithmetic changes (sliding-window null blocks, Mamba alignment,
encoder budgets, ...). A trace whose header turns on such a feature is
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

# Features that are on when they are true or a number above 0.
FLAGS = {
    "diffusion": "a diffusion language model (dLLM)",
    "has_mamba_layers": "Mamba layers",
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


# The features read here and by the replays (kvtrace.bridge), and what each
# must be: a flag, or an integer of at least 0 or 1; absent or null means "not
# named". A string "true" is not a flag.
TYPES = {
    "async_scheduling": "flag", "scheduler_reserve_full_isl": "flag",
    "enable_chunked_prefill": "flag", "long_prefill_token_threshold_adaptive": "flag",
    "defer_block_free": "flag", "requires_kv_delivery": "flag", "use_eagle": "flag",
    "eagle_block_drop": "flag", "num_prefill_lookahead_tokens": "count0",
    "num_hash_lookahead_tokens": "count0",
    "has_mamba_layers": "flag", "multimodal": "flag", "diffusion": "flag", "lora": "flag", "prompt_embeds": "flag",
    "max_loras": "count",
    "pooling_runner": "flag",
    "num_speculative_tokens": "count0", "num_lookahead_tokens": "count0",
    "prefix_replay_tokens": "count0", "max_num_active_seqs": "count",
    "num_draft_slots": "count0", "dynamic_spec_decode": "flag",
    "pipeline_parallel_size": "count", "decode_context_parallel_size": "count",
    "data_parallel_size": "count", "prefill_schedule_interval": "count",
    "num_kv_cache_groups": "count", "hash_block_size": "count",
    "throttle_prefills_recorded": "flag",
}


def type_error(features: dict) -> str | None:
    """The first feature in ``TYPES`` whose value has the wrong type, in words,
    or None."""
    for key, kind in TYPES.items():
        v = features.get(key)
        if v is None:
            continue
        if kind == "flag" and type(v) is not bool:
            return f"field 'features.{key}' must be true or false, got {v!r}"
        low = 0 if kind == "count0" else 1
        if kind != "flag" and (type(v) is not int or v < low):
            return f"field 'features.{key}' must be an integer of at least {low}, got {v!r}"
    return None


def refusal(features: dict, block_size: int, scope: str) -> str | None:
    """Why a replay refuses a header's ``features``, or None: a feature of the
    wrong type, or the first thing outside the baseline, followed by
    ``scope``, what that replay covers."""
    wrong = type_error(features)
    if wrong is not None:
        return wrong
    why = outside(features, block_size)
    return None if why is None else f"{why}; {scope}"


def outside(features: dict, block_size: int) -> str | None:
    """The first thing in a header's ``features`` (of the right types) that the
    baseline does not cover, in words, or None."""
    for key, what in FLAGS.items():
        v = features.get(key)
        if v:
            return f"{what} is on ({key}={v!r})"
    spec = speculative(features)
    if spec is not None:
        return spec
    if features.get("lora") and features.get("max_loras") is None:
        return "LoRA is on (lora=True), and the trace does not say how many adapters a step may run (max_loras)"
    for key, what in SIZES.items():
        v = features.get(key)
        if v not in (None, 1):
            return f"{what} is on ({key}={v!r})"
    interval = features.get("prefill_schedule_interval", 1)
    if (interval not in (None, 1) and features.get("data_parallel_size", 1) not in (None, 1)
            and not features.get("throttle_prefills_recorded")):
        # vLLM's data-parallel engine core defers prefills to every interval-th
        # step (schedule(throttle_prefills=True)); a trace that does not record
        # that flag cannot be followed.
        return (f"data-parallel prefill throttling is on (prefill_schedule_interval={interval!r}) "
                "and the trace does not record which steps throttled prefills")
    groups = features.get("num_kv_cache_groups", 1)
    if groups != 1:
        return f"{groups} KV-cache groups"
    kinds = features.get("kv_cache_group_kinds")
    if kinds is not None:
        if not isinstance(kinds, list):
            return f"field 'features.kv_cache_group_kinds' must be a list of names, got {kinds!r}"
        other = [k for k in kinds if k not in FULL_ATTENTION]
        if other:
            return f"a KV-cache group of kind {other[0]!r}, not full attention"
    hash_block_size = features.get("hash_block_size", block_size)
    if hash_block_size != block_size:
        return f"hash_block_size {hash_block_size!r} differs from block_size {block_size}"
    return None



def speculative(features: dict) -> str | None:
    """Why a header's speculative decoding is outside the baseline, or None
    (none, or drafts under either scheduler, a fixed number or, with dynamic
    speculative decoding, a number by batch size from the header's table: by
    n-gram and suffix decoding, or by a drafter with its lookahead slots, its
    input slots per request and, for EAGLE, EAGLE3 and one-module MTP, the
    dropped hit block)."""
    k = features.get("num_speculative_tokens")
    eagle = features.get("use_eagle")
    lookahead = features.get("num_lookahead_tokens")
    if not k:
        if eagle or lookahead:
            return (f"EAGLE or lookahead slots without speculative decoding (use_eagle={eagle!r}, "
                    f"num_lookahead_tokens={lookahead!r})")
        return None
    on = f"speculative decoding (num_speculative_tokens={k!r})"
    table = features.get("spec_tokens_by_batch_size")
    if features.get("dynamic_spec_decode") and table is None:
        return (f"dynamic {on} is on, and the trace does not say how many drafts each batch "
                "size takes (spec_tokens_by_batch_size)")
    if table is not None:
        if (not isinstance(table, list) or len(table) < 2
                or any(type(v) is not int or not 0 <= v <= k for v in table)):
            return ("field 'features.spec_tokens_by_batch_size' must be a list of at least two "
                    f"integers from 0 to num_speculative_tokens ({k}), got {table!r}")
    if features.get("num_draft_slots") is None:
        return f"{on} is on, and the trace does not say how many input slots drafting takes"
    if eagle:
        if features.get("eagle_block_drop") is None:
            return (f"{on} by EAGLE is on, and the trace does not say whether a prefix hit drops "
                    "its last block (eagle_block_drop)")
        ahead = features.get("num_prefill_lookahead_tokens")
        if ahead is None:
            return (f"{on} by EAGLE is on, and the trace does not say how far past a prefill "
                    "chunk the drafter reads (num_prefill_lookahead_tokens)")
        if ahead > 1:
            # Multi-module MTP: chunks end clear of the drafter's reads (S:575-589),
            # and the last ahead - 1 computed tokens are never cached (KC:346-352).
            return f"{on} by multi-module MTP is on (num_prefill_lookahead_tokens={ahead!r})"
    return None
