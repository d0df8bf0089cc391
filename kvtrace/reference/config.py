"""The scheduler settings that change its decisions (semantics doc 7.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .profiles import DEFAULT, Profile


@dataclass(frozen=True, slots=True)
class StateSpec:
    """What a state group (vLLM's ``MambaSpec``: Mamba, Mamba2, gated delta
    net and other linear-attention layers) adds to a KV-cache group
    (state_groups.py, KI:1034-1107): its cache mode ("align": a state kept at
    each block boundary, for prefix caching; "none": one state per request),
    the blocks it keeps per request for speculative decoding, whether it
    writes a prefill checkpoint inside a chunk and at what alignment, and the
    layer kind (groups of one spec are looked up together, KC:708-765)."""

    mode: str = "align"
    speculative_blocks: int = 0
    checkpoint_blocks: int = 0
    checkpoint_alignment: int | None = None
    mamba_type: str | None = None


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group (kv_groups.py): ``sliding_window`` is None for full
    attention. ``admission_blocks`` caps what an admission reserves for one
    request in a sliding-window group, which recycles its blocks (ST:214-228).
    ``state`` makes it a state group (state_groups.py). ``block_size`` is the
    group's own, where it is not the scheduler's (the scheduler's block is a
    multiple of every group's, KC:115-119)."""

    sliding_window: int | None = None
    admission_blocks: int | None = None
    state: StateSpec | None = None
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int                      # including the null block 0
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"                 # "fcfs" or "priority"
    long_prefill_token_threshold: int = 0
    max_num_scheduled_tokens: int | None = None
    watermark_blocks: int = 0
    load_failure_policy: Literal["fail", "recompute"] = "fail"    # what a failed KV load does
    # Admit a waiting request only if its whole sequence fits, not just its first
    # chunk (vLLM's scheduler_reserve_full_isl, on by default).
    reserve_full_isl: bool = True
    # With chunked prefill off, a waiting request whose tokens (after the
    # long-prefill threshold) do not fit the step's budget is not split: it
    # waits, and so does everything behind it (S:1160-1167).
    enable_chunked_prefill: bool = True
    # Raise long_prefill_token_threshold to a fair share of the budget (S:650-655).
    adaptive_long_prefill_threshold: bool = False
    # Requests admitted into RUNNING at once; None means max_num_seqs.
    max_num_active_seqs: int | None = None
    # vLLM's AsyncScheduler: step N+1 is scheduled before step N's output comes
    # back, so a decoding request holds a placeholder for its unsampled token.
    async_scheduling: bool = False
    # With steps in flight and a connector that loads KV (a consumer), a freed
    # request's blocks return to the pool only once the steps that may still
    # write them are processed (S:185-192, S:2759-2801).
    defer_block_free: bool = False
    # The connector hands KV off when a request finishes (a producer): a request
    # preempted with output in flight drops that output (S:197-206, S:839).
    requires_kv_delivery: bool = False
    # Speculative decoding: the most draft tokens a request is scheduled with
    # (under async scheduling, placeholders the model runner fills in).
    num_spec_tokens: int = 0
    # Drafting by a model (EAGLE, EAGLE3, MTP, a draft model): the slots each
    # scheduled request gets past its tokens for the drafter to write (vLLM's
    # num_lookahead_tokens, KM:541-544), and whether a prefix hit gives back
    # its last block, which the drafter needs recomputed (use_eagle_block_drop,
    # ST:819-820).
    num_lookahead_tokens: int = 0
    eagle_block_drop: bool = False
    # Input slots of a step's batch each scheduled request takes for drafting,
    # past its tokens (vLLM's max_num_new_slots_for_drafting: 1 for a draft
    # model, S:613-661).
    num_draft_slots: int = 0
    # Dynamic speculative decoding: the drafts a step asks for, indexed by how
    # many requests it schedules (index 0 unused; vLLM's dynamic_sd_lookup,
    # S:307-314). None: always num_spec_tokens.
    spec_tokens_by_batch_size: tuple[int, ...] | None = None
    # Context slots a step keeps for the token it samples: 0 for a pooling
    # model, which samples none (S:150-159).
    num_sampled_tokens_per_step: int = 1
    # LoRA: the most adapters one step may run (vLLM's max_loras); None when
    # LoRA is off. A waiting request whose adapter would exceed it is skipped
    # (S:941-952).
    max_loras: int | None = None
    # vLLM's prefill_schedule_interval, and the data-parallel size that decides
    # whether the scheduler applies it itself (cadence.py).
    prefill_schedule_interval: int = 1
    # vLLM 0.33's lookahead block hashes (EAGLE with prefix caching and no
    # connector): the tokens after each block its hash covers.
    num_hash_lookahead_tokens: int = 0
    data_parallel_size: int = 1
    # Several KV-cache groups, or one sliding-window or state group
    # (kv_groups.py, state_groups.py); empty: one full-attention group. A
    # group's block size is block_size unless its spec says otherwise.
    kv_groups: tuple[GroupSpec, ...] = ()
    # Sliding-window and state groups make hash-visible the blocks a later hit
    # ending on each multiple of this many tokens and on the prompt's replay
    # boundary needs (0: the boundary only); None: every block.
    prefix_cache_retention: int | None = 0
    # The connector restores a state group's lagging state at the end of its
    # external hit (vLLM's supports_divergent_local_hybrid_hits, NIXL's): a
    # lookup takes full attention's own hit as the local one (S:558-568).
    connector_restores_states: bool = False
    # Which release's rules to follow where releases differ (profiles.py).
    profile: Profile = DEFAULT

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens
