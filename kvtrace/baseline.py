"""The baseline profile (semantics doc, section 0.1): which engines' traces can
be replayed, by the reference and by vLLM's own scheduler alike.

Outside it, the scheduler's arithmetic changes (speculative tokens, EAGLE's
dropped hit block, sliding-window null blocks, Mamba alignment, encoder
budgets, ...). A trace whose header turns on such a feature is refused, with
the feature named, rather than replayed into false divergences. The vLLM
recorder writes every key read here (``build_header``); a key a trace does not
name is taken as off (traces recorded before ``lora`` and
``prefill_schedule_interval`` were written do not name them).
"""

from __future__ import annotations

# Features that are on when they are true or a number above 0.
FLAGS = {
    "num_speculative_tokens": "speculative decoding",
    "num_lookahead_tokens": "lookahead slots",
    "use_eagle": "EAGLE",
    "has_mamba_layers": "Mamba layers",
    "multimodal": "a multimodal model",
    "prefix_replay_tokens": "prefix replay windows",
    "lora": "LoRA (its slot limit, max_loras)",
}
# Sizes that are on when they are not 1.
SIZES = {
    "pipeline_parallel_size": "pipeline parallelism",
    "decode_context_parallel_size": "decode context parallelism",
}
# KV-cache specs that vLLM 0.32 manages with its FullAttentionManager, the one
# the reference models.
FULL_ATTENTION = ("FullAttentionSpec", "MLAAttentionSpec")


def outside(features: dict, block_size: int) -> str | None:
    """The first thing in a header's ``features`` that the baseline does not
    cover, in words, or None."""
    for key, what in FLAGS.items():
        v = features.get(key)
        if v:
            return f"{what} is on ({key}={v!r})"
    for key, what in SIZES.items():
        v = features.get(key)
        if v not in (None, 1):
            return f"{what} is on ({key}={v!r})"
    interval = features.get("prefill_schedule_interval", 1)
    if interval not in (None, 1) and features.get("data_parallel_size", 1) not in (None, 1):
        # Only vLLM's data-parallel engine core defers prefills to every
        # interval-th step (schedule(throttle_prefills=True)); that is not recorded.
        return f"data-parallel prefill throttling is on (prefill_schedule_interval={interval!r})"
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
