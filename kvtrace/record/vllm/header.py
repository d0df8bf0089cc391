"""The trace header for a constructed vLLM scheduler: its config, the features
outside the baseline profile, the counters shape and the class that runs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvtrace.trace.events import ConnectorConfig, Header, SchedulerConfig

if TYPE_CHECKING:
    from vllm.config import CacheConfig, KVTransferConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

MODEL_FREE_ENV = "KVTRACE_MODEL_FREE"


def _runs_async(sched: Scheduler) -> bool:
    """Whether the scheduler is vLLM's AsyncScheduler (or a subclass of it),
    which schedules a step before the output of the one before comes back."""
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except Exception:
        return bool(getattr(sched.vllm_config.scheduler_config, "async_scheduling", False))
    return isinstance(sched, AsyncScheduler)


def _is_diffusion(vc: VllmConfig) -> bool:
    if getattr(vc, "diffusion_config", None) is not None:
        return True
    try:
        return bool(getattr(vc.model_config, "is_diffusion", False))
    except Exception:   # a property that reads the model's config
        return False


def _counters_shape() -> str:
    try:
        from vllm.v1.engine import EngineCoreOutput

        names = set(getattr(EngineCoreOutput, "__struct_fields__", ()))
    except Exception:
        names = set()
    if "prefill_stats" in names:
        return "prefill_stats"
    if "num_cached_tokens" in names:
        return "legacy"
    return "prefill_stats"


def _spec_features(spec: SpeculativeConfig | None) -> dict:
    """What replay must know of a speculative-decoding config: its method, the
    extra input slots each request takes for drafting, and whether the number
    of drafts changes with the batch size (dynamic speculative decoding; the
    scheduler's table of it is recorded by ``build_header``)."""
    if spec is None:
        return {}
    return {"speculative_method": str(getattr(spec, "method", "") or ""),
            "num_draft_slots": int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0),
            "dynamic_spec_decode": bool(getattr(spec, "num_speculative_tokens_per_batch_size",
                                                None))}


def _group_features(groups: list[KVCacheGroupSpec], kcc: KVCacheConfig | None,
                    kvm: KVCacheManager) -> dict:
    """Every KV-cache group's spec, and the sliding-window retention rule,
    unless the cache is one full-attention group (traces of those stay as they were)."""
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if kinds in ([], ["FullAttentionSpec"]):
        return {}
    try:
        managers = list(kvm.coordinator.single_type_managers)
    except AttributeError:
        managers = []
    specs = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        d = {"kind": type(spec).__name__, "block_size": int(spec.block_size)}
        window = getattr(spec, "sliding_window", None)
        if window:
            d["sliding_window"] = int(window)
        cap = getattr(managers[i], "max_admission_blocks_per_request", None) if managers else None
        if cap is not None:
            d["admission_blocks"] = int(cap)
        d["layers"] = [str(name) for name in getattr(g, "layer_names", ())]
        if d["kind"] == "MambaSpec":
            d.update(_state_group(spec))
        specs.append(d)
    out: dict = {"kv_cache_groups": specs}
    interval = getattr(kcc, "prefix_cache_retention_interval", 0)
    if interval is None:
        out["prefix_cache_retention_dense"] = True
    elif interval:
        out["prefix_cache_retention_interval"] = int(interval)
    return out


def _state_group(spec: MambaSpec) -> dict:
    """What a state group's spec (vLLM's ``MambaSpec``) tells its manager:
    the layer kind, the cache mode, and the blocks each request takes for
    speculative decoding and for a prefill checkpoint (KI:1034-1107)."""
    kind = getattr(spec, "mamba_type", None)
    name = getattr(kind, "name", None)   # a MambaAttentionBackendEnum member
    d = {"mamba_type": str(name).lower() if name is not None else str(kind),
         "mamba_cache_mode": str(getattr(spec, "mamba_cache_mode", "none")),
         "num_speculative_blocks": int(getattr(spec, "num_speculative_blocks", 0) or 0),
         "num_prefill_checkpoint_blocks": int(getattr(spec, "num_prefill_checkpoint_blocks", 0)
                                              or 0)}
    alignment = getattr(spec, "prefill_checkpoint_alignment", None)
    if alignment is not None:
        d["prefill_checkpoint_alignment"] = int(alignment)
    return d


def _shared_prefix_checkpoint(cc: CacheConfig) -> dict:
    """vLLM's opt-in state checkpoint at a shared-prefix junction, when on
    (absent from the header: off)."""
    if getattr(cc, "enable_mamba_shared_prefix_checkpoint", False) is True:
        return {"enable_mamba_shared_prefix_checkpoint": True}
    return {}


def _class_name(sched: Scheduler) -> str:
    """The scheduler class that runs: the one its recording class wraps
    (``hooks.make_recording_scheduler``)."""
    cls = getattr(type(sched), "_kvtrace_base", None) or type(sched).__mro__[1]
    return f"{cls.__module__}.{cls.__qualname__}"


def _connector(ktc: KVTransferConfig | None) -> ConnectorConfig | None:
    """The scheduler's connector, and what it does when a load fails."""
    if ktc is None or not getattr(ktc, "kv_connector", None):
        return None
    policy = getattr(ktc, "kv_load_failure_policy", "fail")
    if policy not in ("fail", "recompute"):
        policy = "fail"
    return ConnectorConfig(name=str(ktc.kv_connector), load_failure_policy=policy)


def _scheduler_config(sched: Scheduler) -> SchedulerConfig:
    """The settings every trace's header holds: the KV cache's size and the
    scheduler's limits and policy."""
    vc = sched.vllm_config
    sc = vc.scheduler_config
    cc = vc.cache_config
    kvm = sched.kv_cache_manager
    num_blocks = getattr(getattr(kvm, "block_pool", None), "num_gpu_blocks", None)
    if num_blocks is None:
        num_blocks = cc.num_gpu_blocks
    mnst = getattr(sched, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens
    return SchedulerConfig(
        block_size=int(sched.block_size),
        num_blocks=int(num_blocks),
        max_num_batched_tokens=int(sc.max_num_batched_tokens),
        max_num_seqs=int(sc.max_num_seqs),
        max_model_len=int(getattr(sched, "max_model_len", vc.model_config.max_model_len)),
        enable_prefix_caching=bool(cc.enable_prefix_caching),
        policy=str(getattr(sc, "policy", "fcfs")),
        long_prefill_token_threshold=int(getattr(sc, "long_prefill_token_threshold", 0) or 0),
        max_num_scheduled_tokens=int(mnst),
        watermark_blocks=int(getattr(kvm, "watermark_blocks", 0) or 0),
        connector=_connector(vc.kv_transfer_config),
    )


def _admission_features(sched: Scheduler) -> dict:
    """How the scheduler admits and chunks requests, and the class that runs."""
    sc = sched.vllm_config.scheduler_config
    return {
        # The class that runs decides, not the config: vLLM's CPU platform turns
        # the flag off, and a caller may pass an AsyncScheduler regardless.
        "async_scheduling": _runs_async(sched),
        "enable_chunked_prefill": bool(getattr(sc, "enable_chunked_prefill", True)),
        "max_num_active_seqs": getattr(sc, "max_num_active_seqs", None),
        "long_prefill_token_threshold_adaptive": bool(
            getattr(sc, "long_prefill_token_threshold_adaptive", False)),
        "scheduler_reserve_full_isl": bool(getattr(sc, "scheduler_reserve_full_isl", False)),
        "watermark": float(getattr(sc, "watermark", 0.0) or 0.0),
        "prefill_schedule_interval": int(getattr(sc, "prefill_schedule_interval", 1) or 1),
        # Each step's schedule(throttle_prefills=...) is in the trace (Step.throttle_prefills).
        "throttle_prefills_recorded": True,
        "scheduler_cls": _class_name(sched),
    }


def _speculation_features(sched: Scheduler) -> dict:
    """Speculative decoding: the drafts a step schedules, and how a drafter
    changes the blocks a request hashes and holds."""
    return {
        "num_speculative_tokens": int(getattr(sched, "num_spec_tokens", 0) or 0),
        "num_lookahead_tokens": int(getattr(sched, "num_lookahead_tokens", 0) or 0),
        **_spec_features(sched.vllm_config.speculative_config),
        "prefix_replay_tokens": int(getattr(sched, "prefix_replay_tokens", 0) or 0),
        "use_eagle": bool(getattr(sched, "use_eagle", False)),
        # With EAGLE: whether a prefix hit drops its last block, and how far past
        # a prefill chunk the drafter reads (above 1 for multi-module MTP).
        "eagle_block_drop": bool(getattr(sched, "use_eagle_block_drop",
                                         getattr(sched, "use_eagle", False))),
        "num_prefill_lookahead_tokens": int(getattr(sched, "num_prefill_lookahead", 0) or 0),
        # vLLM 0.33: each block's hash covers this many tokens after it (EAGLE).
        "num_hash_lookahead_tokens": int(getattr(sched, "num_hash_lookahead_tokens", 0) or 0),
        # Dynamic speculative decoding: the drafts a step asks for, by how many
        # requests it schedules (index 0 unused; vLLM's dynamic_sd_lookup).
        "spec_tokens_by_batch_size": (
            [int(k) for k in sched.dynamic_sd_lookup]
            if getattr(sched, "dynamic_sd_lookup", None) is not None else None),
    }


def _cache_features(sched: Scheduler) -> dict:
    """The KV cache: its groups, how blocks are hashed, and state layers."""
    cc = sched.vllm_config.cache_config
    kcc = getattr(sched, "kv_cache_config", None)
    groups = kcc.kv_cache_groups if kcc is not None else []
    return {
        "num_kv_cache_groups": len(groups),
        "kv_cache_group_kinds": [type(g.kv_cache_spec).__name__ for g in groups],
        "hash_block_size": int(getattr(sched, "hash_block_size", sched.block_size)),
        **_group_features(groups, kcc, sched.kv_cache_manager),
        "prefix_caching_hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "")),
        "has_mamba_layers": bool(getattr(sched, "has_mamba_layers", False)),
        **_shared_prefix_checkpoint(cc),
    }


def _engine_features(sched: Scheduler) -> dict:
    """The engine around the scheduler: parallelism, the model runner, the
    model's kind and inputs, LoRA, and the connector's rules."""
    vc = sched.vllm_config
    pc = vc.parallel_config
    ktc = vc.kv_transfer_config
    lora = getattr(vc, "lora_config", None)
    return {
        "pipeline_parallel_size": int(getattr(pc, "pipeline_parallel_size", 1)),
        # Above 1 only: the KV audit's records name each rank's shard.
        **({"tensor_parallel_size": tp} if (tp := int(getattr(pc, "tensor_parallel_size", 1)
                                                         or 1)) > 1 else {}),
        "data_parallel_size": int(getattr(pc, "data_parallel_size", 1)),
        "decode_context_parallel_size": int(getattr(pc, "decode_context_parallel_size", 1)),
        "use_v2_model_runner": bool(getattr(vc, "use_v2_model_runner", False)),
        "multimodal": bool(getattr(vc.model_config, "is_multimodal_model", False)),
        # A diffusion language model (dLLM): vLLM counts its canvas as drafts
        # (num_speculative_tokens), which are not speculative decoding.
        "diffusion": _is_diffusion(vc),
        # A LoRA slot limit (max_loras) and data-parallel prefill throttling
        # change which requests a step admits.
        "lora": lora is not None,
        "max_loras": int(lora.max_loras) if lora is not None else None,
        "prompt_embeds": bool(getattr(vc.model_config, "enable_prompt_embeds", False)),
        # A pooling model keeps no context slot for a sampled token (S:150-159).
        "pooling_runner": getattr(vc.model_config, "runner_type", None) == "pooling",
        "kv_role": getattr(ktc, "kv_role", None) if ktc is not None else None,
        # The connector's rules under async scheduling, as this scheduler holds them.
        "defer_block_free": bool(getattr(sched, "defer_block_free", False)),
        "requires_kv_delivery": bool(getattr(sched, "requires_kv_delivery", False)),
    }


def data_parallel_rank(pc: object) -> int:
    """The engine's data-parallel rank: vLLM's ``data_parallel_index``, which
    it keeps when it turns a dense model's ranks into independent engines of
    rank 0 and size 1 (core.py:1477-1482, ``reconfigure_for_independent_dp_rank``,
    config/parallel.py:1172-1181), else ``data_parallel_rank``."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(pc, name, None)
        if isinstance(value, int):
            return value
    return 0


def data_parallel_meta(pc: object) -> dict:
    """The header's meta keys of a data-parallel rank: its rank, and the
    address every rank of one run shares (the DP group's master,
    ``data_parallel_master_ip``/``_port``, a port vLLM picks free for each
    run it starts with several ranks, config/parallel.py:979-995), which
    tells a rank of this run from one of another run recorded to the same path."""
    meta = {"data_parallel_rank": data_parallel_rank(pc)}
    port = getattr(pc, "data_parallel_master_port", None)
    if port:
        meta["data_parallel_master"] = f"{getattr(pc, 'data_parallel_master_ip', '')}:{port}"
    return meta


def build_header(sched: Scheduler, meta: dict | None = None) -> Header:
    """The trace header for a constructed vLLM scheduler."""
    import vllm

    config = _scheduler_config(sched)
    features = {**_admission_features(sched), **_speculation_features(sched),
                **_cache_features(sched), **_engine_features(sched)}
    m = {"recorder": "kvtrace.record.vllm.recorder", "pid": os.getpid(),
         **data_parallel_meta(sched.vllm_config.parallel_config)}
    if os.environ.get(MODEL_FREE_ENV):   # kvtrace.lab.model_free's engine: no model ran
        m["model_free"] = True
    if meta:
        m.update(meta)
    return Header(engine="vllm", engine_version=str(getattr(vllm, "__version__", "unknown")),
                  config=config, counters=_counters_shape(),
                  features=features, meta=m)
