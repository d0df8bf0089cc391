"""Conversions between trace events and reference-scheduler objects.

The embedded engine uses these to write what the reference decided as a trace,
and the replayer uses them to feed a trace's inputs to the reference (and, with
``-o``, to write the replayed trace). Nothing else crosses between kvtrace.trace
and kvtrace.reference.
"""

from __future__ import annotations

from typing import Sequence

from kvtrace.reference import (GroupSpec, ModelOutput, PromptEmbeds, Request, RequestOutput,
                               Scheduler, SchedulerConfig, SchedulerOutput, StateSpec)
from kvtrace.reference.profiles import DEFAULT, PROFILES, Profile, profile_for
from kvtrace.trace import events as ev


def header_profile(header: ev.Header) -> tuple[Profile, str | None]:
    """The profile a trace's header asks for: the embedded engine names the one
    it ran (``features.profile``); a vLLM trace's is its release's
    (``profile_for``, with a line when no profile covers that release). A
    profile this kvtrace does not know is replayed under the default, with a
    line saying so."""
    named = header.features.profile
    if header.engine != "vllm" and named is not None:
        if named in PROFILES:
            return PROFILES[named], None
        return DEFAULT, (f"the trace names profile {named[:80]!r}, which this kvtrace does not "
                         f"know (it knows {', '.join(PROFILES)}); replaying under the "
                         f"{DEFAULT.name} profile")
    return profile_for(header.engine, header.engine_version, header.counters)


def config_from_header(header: ev.Header, profile: Profile | None = None) -> SchedulerConfig:
    """Scheduler settings from the header; some of them ride in ``features``,
    with vLLM 0.32's defaults when a trace does not name them. The connector's
    two async-scheduling rules follow its role (``kv_role``, ``kv_both`` when not
    named, as vLLM's KVTransferConfig), unless the trace records them. The
    rules that differ between releases are ``profile``'s (the header's when
    None)."""
    c, f = header.config, header.features
    if profile is None:
        profile = header_profile(header)[0]
    async_scheduling = bool(f.async_scheduling)
    defer, delivery = connector_rules((f.kv_role or "kv_both") if c.connector else None,
                                      async_scheduling, profile)
    if f.defer_block_free is not None:
        defer = f.defer_block_free
    if f.requires_kv_delivery is not None:
        delivery = f.requires_kv_delivery
    return SchedulerConfig(
        block_size=c.block_size,
        num_blocks=c.num_blocks,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        max_model_len=c.max_model_len,
        enable_prefix_caching=c.enable_prefix_caching,
        policy=c.policy,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        max_num_scheduled_tokens=c.max_num_scheduled_tokens,
        watermark_blocks=c.watermark_blocks,
        load_failure_policy=c.connector.load_failure_policy if c.connector else "fail",
        reserve_full_isl=f.scheduler_reserve_full_isl is not False,
        enable_chunked_prefill=f.enable_chunked_prefill is not False,
        adaptive_long_prefill_threshold=bool(f.long_prefill_token_threshold_adaptive),
        max_num_active_seqs=f.max_num_active_seqs,
        async_scheduling=async_scheduling,
        defer_block_free=defer,
        requires_kv_delivery=delivery,
        num_spec_tokens=f.num_speculative_tokens or 0,
        num_lookahead_tokens=f.num_lookahead_tokens or 0,
        eagle_block_drop=bool(f.use_eagle and f.eagle_block_drop),
        num_draft_slots=(f.num_draft_slots or 0) if profile.drafting_takes_input_slots else 0,
        spec_tokens_by_batch_size=(tuple(f.spec_tokens_by_batch_size)
                                   if f.spec_tokens_by_batch_size is not None
                                   and f.num_speculative_tokens else None),
        num_sampled_tokens_per_step=(0 if f.pooling_runner
                                     and profile.pooling_keeps_no_sample_slot else 1),
        max_loras=f.max_loras if f.lora else None,
        prefill_schedule_interval=f.prefill_schedule_interval or 1,
        num_hash_lookahead_tokens=f.num_hash_lookahead_tokens or 0,
        data_parallel_size=f.data_parallel_size or 1,
        kv_groups=tuple(group_spec(g, c.block_size) for g in f.kv_cache_groups or ()),
        prefix_cache_retention=(None if f.prefix_cache_retention_dense
                                else f.prefix_cache_retention_interval or 0),
        connector_restores_states=bool(c.connector and f.supports_divergent_local_hybrid_hits),
        profile=profile,
    )


def group_spec(g: ev.KVCacheGroup, block_size: int) -> GroupSpec:
    """A header's KV-cache group as the reference's spec: a state group
    (``MambaSpec``) with its cache mode and blocks, and a block size of its
    own where it is not the scheduler's ``block_size``."""
    state = None
    if g.kind == "MambaSpec":
        state = StateSpec(g.mamba_cache_mode or "none", g.num_speculative_blocks or 0,
                          g.num_prefill_checkpoint_blocks or 0, g.prefill_checkpoint_alignment,
                          g.mamba_type)
    return GroupSpec(g.sliding_window, g.admission_blocks, state,
                     None if g.block_size == block_size else g.block_size)


def connector_rules(kv_role: str | None, async_scheduling: bool,
                    profile: Profile = DEFAULT) -> tuple[bool, bool]:
    """(defer_block_free, requires_kv_delivery) as vLLM 0.32 derives them from a
    connector's role (None: no connector): a consumer's frees wait for the steps
    in flight, which only async scheduling has (S:185-192); a producer hands KV
    off (the connector's default requires_kv_delivery). A release whose async
    scheduling has no stale-output rules (the legacy profile) has neither."""
    if not profile.async_scheduling_modelled:
        return False, False
    return (async_scheduling and kv_role in ("kv_consumer", "kv_both"),
            kv_role in ("kv_producer", "kv_both"))


def header_features(cfg: SchedulerConfig) -> dict:
    """The settings config_from_header reads from ``features``."""
    return {
        "scheduler_reserve_full_isl": cfg.reserve_full_isl,
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "long_prefill_token_threshold_adaptive": cfg.adaptive_long_prefill_threshold,
        "max_num_active_seqs": cfg.max_num_active_seqs,
        "async_scheduling": cfg.async_scheduling,
        "defer_block_free": cfg.defer_block_free,
        "requires_kv_delivery": cfg.requires_kv_delivery,
        **({"num_speculative_tokens": cfg.num_spec_tokens, "num_draft_slots": cfg.num_draft_slots,
            "num_lookahead_tokens": cfg.num_lookahead_tokens}
           if cfg.num_spec_tokens else {}),
        **({"dynamic_spec_decode": True,
            "spec_tokens_by_batch_size": list(cfg.spec_tokens_by_batch_size)}
           if cfg.num_spec_tokens and cfg.spec_tokens_by_batch_size is not None else {}),
        **({"use_eagle": True, "eagle_block_drop": True, "num_prefill_lookahead_tokens": 1}
           if cfg.num_spec_tokens and cfg.eagle_block_drop else {}),
        **({"lora": True, "max_loras": cfg.max_loras} if cfg.max_loras else {}),
        **(_group_features(cfg) if cfg.kv_groups else {}),
        **({"supports_divergent_local_hybrid_hits": True} if cfg.connector_restores_states else {}),
    }


def _group_features(cfg: SchedulerConfig) -> dict:
    """The KV-cache groups as vLLM's header names them."""
    groups = []
    for i, g in enumerate(cfg.kv_groups):
        d: dict[str, object] = {"kind": "FullAttentionSpec" if g.sliding_window is None else "SlidingWindowSpec",
             "block_size": g.block_size or cfg.block_size, "layers": [f"layers.{i}"]}
        if g.sliding_window is not None:
            d.update(sliding_window=g.sliding_window, admission_blocks=g.admission_blocks)
        if g.state is not None:
            st = g.state
            d.update(kind="MambaSpec", mamba_type=st.mamba_type, mamba_cache_mode=st.mode,
                     num_speculative_blocks=st.speculative_blocks,
                     num_prefill_checkpoint_blocks=st.checkpoint_blocks,
                     prefill_checkpoint_alignment=st.checkpoint_alignment)
        groups.append(d)
    out: dict = {"num_kv_cache_groups": len(groups),
                 "kv_cache_group_kinds": [d["kind"] for d in groups], "kv_cache_groups": groups}
    if any(g.state is not None for g in cfg.kv_groups):
        out["has_mamba_layers"] = True
    if cfg.prefix_cache_retention is None:
        out["prefix_cache_retention_dense"] = True
    elif cfg.prefix_cache_retention:
        out["prefix_cache_retention_interval"] = cfg.prefix_cache_retention
    return out


def header_config(cfg: SchedulerConfig, connector_name: str | None) -> ev.SchedulerConfig:
    return ev.SchedulerConfig(
        block_size=cfg.block_size,
        num_blocks=cfg.num_blocks,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        policy=cfg.policy,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        max_num_scheduled_tokens=cfg.max_num_scheduled_tokens,
        watermark_blocks=cfg.watermark_blocks,
        connector=(ev.ConnectorConfig(connector_name, cfg.load_failure_policy)
                   if connector_name else None),
    )


def request_from_arrival(a: ev.Arrival, block_size: int, hash_lookahead: int = 0) -> Request:
    return Request(
        hash_lookahead=hash_lookahead,
        request_id=a.req,
        prompt_token_ids=list(a.prompt_token_ids),
        max_tokens=a.max_tokens,
        block_size=block_size,
        arrival_time=a.arrival_time,
        priority=a.priority,
        cache_salt=a.cache_salt,
        eos_token_id=a.eos_token_id,
        stop_token_ids=tuple(a.stop_token_ids),
        ignore_eos=a.ignore_eos,
        skip_reading_prefix_cache=a.skip_reading_prefix_cache,
        resumable=a.resumable,
        grammar="compiling" if a.structured_output else None,
        pooling=a.pooling,
        min_tokens=a.min_tokens,
        repetition=(None if a.repetition_detection is None else
                    (a.repetition_detection["max_pattern_size"],
                     a.repetition_detection["min_pattern_size"],
                     a.repetition_detection["min_count"])),
        prompt_embeds=(None if a.prompt_embeds is None else PromptEmbeds(
            tuple(a.prompt_embeds), _token_runs(a.prompt_is_token_ids or ()))),
        lora=None if a.lora is None else (a.lora["id"], a.lora["name"], a.lora["path"]),
    )


def _token_runs(runs: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """Runs [start, end) of positions as the reference keys them; an Arrival
    holds them as lists (events._runs)."""
    return tuple((run[0], run[1]) for run in runs)


def model_output_from_event(o: ev.Output) -> ModelOutput:
    c = o.connector or ev.ConnectorOutput()
    return ModelOutput(
        sampled_token_ids=o.sampled,
        finished_recving=set(c.finished_recving),
        finished_sending=set(c.finished_sending),
        failed_recving=set(c.failed_recving),
        invalid_block_ids=set(c.invalid_block_ids),
        grammar_rejected=set(o.grammar_rejected or ()),
        pooled=set(o.pooled or ()),
        error_order=(tuple(req for req, why in o.finished.items() if why == "error")
                     if o.finished else ()),
        recving_order=tuple(c.finished_recving) if c.finished_recving else (),
        sending_order=tuple(c.finished_sending) if c.finished_sending else (),
    )


def connector_output_event(m: ModelOutput) -> ev.ConnectorOutput | None:
    c = ev.ConnectorOutput(sorted(m.finished_recving), sorted(m.finished_sending),
                           sorted(m.failed_recving), sorted(m.invalid_block_ids))
    return None if c.is_empty() else c


def request_state(sched: Scheduler, r: Request) -> ev.RequestState:
    return ev.RequestState(
        req=r.request_id,
        status=r.status.name,
        num_computed_tokens=r.num_computed_tokens,
        num_tokens=r.num_tokens,
        num_preemptions=r.num_preemptions,
        block_ids=sched.kv.get_block_ids(r.request_id),
        more_groups=sched.kv.more_ids(r.request_id),
    )


def step_event(seq: int, step: int, out: SchedulerOutput, sched: Scheduler,
               lookups: list[ev.Lookup], loads: list[ev.KVLoad] | None,
               grammar: dict[str, str] | None = None) -> ev.Step:
    """What one schedule() decided, with the state of every request it touched:
    scheduled, preempted or looked up, and the grammars it found compiled."""
    touched: dict[str, None] = dict.fromkeys(out.num_scheduled_tokens)
    touched.update(dict.fromkeys(sorted(out.preempted_req_ids)))
    touched.update(dict.fromkeys(lk.req for lk in lookups))
    states = [request_state(sched, sched.requests[rid]) for rid in touched if rid in sched.requests]
    return ev.Step(
        seq=seq,
        step=step,
        new=[ev.ScheduledNew(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids,
                             s.more_groups) for s in out.new],
        resumed=[ev.ScheduledNew(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens,
                                 s.block_ids, s.more_groups) for s in out.resumed],
        running=[ev.ScheduledRunning(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens,
                                     s.block_ids, s.more_groups) for s in out.running],
        preempted=sorted(out.preempted_req_ids),
        finished=sorted(out.finished_req_ids),
        lookups=lookups,
        loads=loads,
        states=states,
        num_free_blocks=sched.kv.pool.num_free_blocks,
        spec={k: list(v) for k, v in out.spec.items()} or None,
        grammar=grammar or None,
    )


def touched_by_output(sched: Scheduler, out: SchedulerOutput, model: ModelOutput) -> list[Request]:
    """The requests an update_from_output() may change; call before the update,
    since finished requests leave ``sched.requests``."""
    ids = dict.fromkeys(out.num_scheduled_tokens)
    for group in (model.failed_recving, model.finished_recving, model.finished_sending):
        ids.update(dict.fromkeys(sorted(group)))
    return [sched.requests[i] for i in ids if i in sched.requests]


def output_events(seq_fn, step: int, model: ModelOutput, results: list[RequestOutput],
                  sched: Scheduler, touched: list[Request]) -> list:
    """The Output event for one update_from_output(), then one PromptStats per
    request whose first output it carried."""
    out = ev.Output(
        seq=seq_fn(),
        step=step,
        sampled={k: list(v) for k, v in model.sampled_token_ids.items() if v},
        connector=connector_output_event(model),
        finished={r.req_id: r.finish_reason for r in results if r.finish_reason},
        states=[request_state(sched, r) for r in touched],
        grammar_rejected=sorted(model.grammar_rejected) or None,
        pooled=sorted(model.pooled) or None,
    )
    events: list = [out]
    for r in results:
        if r.prefill_stats is None:
            continue
        ps = r.prefill_stats
        events.append(ev.PromptStats(
            seq=seq_fn(), step=step, req=r.req_id,
            prefill_stats=ev.PrefillStats(
                ps.num_prompt_tokens, ps.num_local_cached_tokens, ps.num_external_cached_tokens,
                ps.num_cached_tokens, ps.num_computed_tokens, ps.num_cache_creation_tokens),
            legacy=(ev.LegacyCounters(*r.legacy_counters) if r.legacy_counters else None),
        ))
    return events
