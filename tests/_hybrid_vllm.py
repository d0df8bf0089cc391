"""vLLM's own Scheduler, model-free, with state (Mamba) KV-cache groups: the
judge of the reference's state groups.

``record(workload, out_path)`` builds the installed vLLM's ``Scheduler`` (its
``AsyncScheduler`` under async scheduling) for a hybrid ``KVCacheConfig`` (state
groups beside full-attention and sliding-window ones, as the workload lists
them), drives it with the workload's arrivals, aborts and prefix-cache resets
as vLLM's engine core does (a batch queue of two under async scheduling), with
``model_free``'s model (tokens and n-gram drafts as functions of the request
and position), and records every call with kvtrace's recorder. Replaying that
trace through the reference must find no divergence.

The recorder side of kvtrace does not write state groups yet; ``states_on``
patches the three places that must (the KV-cache config built from a header,
the vLLM config's cache mode, and the header's groups), and ``state_header``
is what the header must hold.

Run as a script with another release first on ``PYTHONPATH`` (vLLM 0.33's,
``releases.environment``): ``python tests/_hybrid_vllm.py JOBS.json OUT_DIR``
records each job (``{"name": ..., "workload": {...}}``) into
OUT_DIR/NAME.jsonl and prints one JSON line per job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any

from kvtrace.trace import events as ev

# Workload keys: config (SchedulerConfig's fields), groups (KVCacheGroup dicts:
# kind, block_size, sliding_window, mamba_type, mamba_cache_mode,
# num_speculative_blocks, num_prefill_checkpoint_blocks,
# prefill_checkpoint_alignment), retention (0, k or None: dense), async,
# spec (n-gram drafts per step), arrivals ({step, req, prompt, max_tokens,
# priority}), aborts ({step, req}), resets ({step, running}).


def header_of(wl: dict) -> ev.Header:
    """The header a recording of ``wl`` starts from: its config and groups."""
    c = dict(wl["config"])
    c.setdefault("max_num_scheduled_tokens", None)
    if wl.get("connector"):   # kvtrace's scripted connector, keeping the groups (SupportsHMA)
        c["connector"] = ev.ConnectorConfig(_connector_name(wl["connector"]),
                                            wl["connector"].get("policy", "fail"))
    # A sliding window's admission cap, as vLLM derives it (KI:859-885): its
    # window and the tokens of the steps in flight.
    in_flight = c["max_num_batched_tokens"] * (2 if wl.get("async") else 1)
    groups = [ev.KVCacheGroup(**{"layers": [f"model.layers.{i}.mixer"], **g})
              for i, g in enumerate(wl["groups"])]
    for g in groups:
        if g.sliding_window is not None:
            tokens = min(g.sliding_window - 1 + in_flight, c["max_model_len"])
            g.admission_blocks = -(-tokens // g.block_size) + 1
    features: dict[str, Any] = {
        "kv_cache_groups": groups, "num_kv_cache_groups": len(groups),
        "kv_cache_group_kinds": [g.kind for g in groups],
        "has_mamba_layers": any(g.kind == "MambaSpec" for g in groups),
        "hash_block_size": c["block_size"],
        "async_scheduling": bool(wl.get("async")),
    }
    retention = wl.get("retention", 0)
    if retention is None:
        features["prefix_cache_retention_dense"] = True
    elif retention:
        features["prefix_cache_retention_interval"] = retention
    if wl.get("spec") and wl.get("eagle"):   # an EAGLE head: lookahead slots, the block drop
        features.update(num_speculative_tokens=wl["spec"], speculative_method="eagle",
                        num_draft_slots=0, num_lookahead_tokens=wl["spec"], use_eagle=True,
                        eagle_block_drop=True, num_prefill_lookahead_tokens=1)
    elif wl.get("spec"):
        features.update(num_speculative_tokens=wl["spec"], speculative_method="ngram",
                        num_draft_slots=0, num_lookahead_tokens=0)
    if wl.get("connector"):
        features["kv_role"] = "kv_consumer"
        features["supports_divergent_local_hybrid_hits"] = bool(wl["connector"].get("divergent"))
    return ev.Header(engine="vllm", engine_version="", config=ev.SchedulerConfig(**c),
                     features=features)


# --------------------------------------------------------------------------- what the recorder must do


def kv_cache_config(num_blocks: int, block_size: int, features: ev.SchedulerFeatures) -> Any:
    """vLLM's KVCacheConfig for the header's groups, state groups included:
    a MambaSpec of the recorded mode, block size, speculative and checkpoint
    blocks (its shapes only size a page, which no scheduler decision reads;
    padded to the attention page, as vLLM pads it)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec, SlidingWindowSpec)

    def attn(bs: int) -> dict:
        return dict(block_size=bs, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)

    page = FullAttentionSpec(**attn(block_size)).page_size_bytes
    groups = []
    for i, g in enumerate(features.kv_cache_groups):
        if g.kind == "MambaSpec":
            spec = MambaSpec(
                shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                block_size=g.block_size, page_size_padded=page,
                mamba_type=MambaAttentionBackendEnum[(g.mamba_type or "mamba2").upper()],
                mamba_cache_mode=g.mamba_cache_mode,
                num_speculative_blocks=g.num_speculative_blocks or 0,
                num_prefill_checkpoint_blocks=g.num_prefill_checkpoint_blocks or 0,
                prefill_checkpoint_alignment=g.prefill_checkpoint_alignment)
        elif g.sliding_window is not None:
            spec = SlidingWindowSpec(**attn(g.block_size), sliding_window=g.sliding_window)
        else:
            spec = FullAttentionSpec(**attn(g.block_size))
        groups.append(KVCacheGroupSpec(g.layers or [f"model.layers.{i}.mixer"], spec))
    retention = (None if features.prefix_cache_retention_dense
                 else features.prefix_cache_retention_interval or 0)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         hash_block_size=block_size, cache_hit_alignment_tokens=block_size,
                         prefix_cache_retention_interval=retention)


def state_header(sched: Any, header: ev.Header) -> ev.Header:
    """``header`` (the recorder's) with what a state group adds: each
    MambaSpec group's mamba_type, mamba_cache_mode, num_speculative_blocks,
    num_prefill_checkpoint_blocks and prefill_checkpoint_alignment, from the
    scheduler's own KV-cache config; and enable_mamba_shared_prefix_checkpoint."""
    f = header.features
    for g, spec in zip(f.kv_cache_groups or (), (x.kv_cache_spec for x in
                                                  sched.kv_cache_config.kv_cache_groups)):
        if type(spec).__name__ != "MambaSpec":
            continue
        g.mamba_type = spec.mamba_type.name.lower()
        g.mamba_cache_mode = spec.mamba_cache_mode
        g.num_speculative_blocks = int(spec.num_speculative_blocks)
        g.num_prefill_checkpoint_blocks = int(spec.num_prefill_checkpoint_blocks)
        g.prefill_checkpoint_alignment = spec.prefill_checkpoint_alignment
    f.enable_mamba_shared_prefix_checkpoint = bool(
        getattr(sched.vllm_config.cache_config, "enable_mamba_shared_prefix_checkpoint", False))
    if sched.connector is not None:
        f.supports_divergent_local_hybrid_hits = bool(
            getattr(sched.connector, "supports_divergent_local_hybrid_hits", False))
    return header


@contextlib.contextmanager
def states_on():
    """While it lasts, kvtrace's re-run set-up builds state groups: the
    KV-cache config (``kv_cache_config``), the cache mode vLLM's config must
    carry (a Llama stand-in never sets it: S:375-379 reads it), the header's
    groups (``state_header``) and the check of what it can set up."""
    from kvtrace import baseline
    from kvtrace.record.vllm import header as vh
    from kvtrace.rerun import core as rerun
    from kvtrace.rerun import build as rs
    from kvtrace.trace.io import TraceError

    saved = (rs.build_kv_cache_config, rs.build_vllm_config, vh.build_header, rs.check_supported,
             rerun.check_supported)
    build_config, build_header = rs.build_vllm_config, vh.build_header

    def vllm_config(header: ev.Header) -> Any:
        # The replay connector restores states if the recorded one did.
        restores = bool(header.features.supports_divergent_local_hybrid_hits)
        replay_connector = rs._connector_module().ReplayConnector
        replay_connector.supports_divergent_local_hybrid_hits = property(lambda self: restores)
        vc = build_config(header)
        modes = {g.mamba_cache_mode for g in header.features.kv_cache_groups or ()
                 if g.kind == "MambaSpec"}
        if modes:
            (mode,) = modes
            vc.cache_config.mamba_cache_mode = mode
            if mode == "align":
                vc.cache_config.mamba_block_size = header.config.block_size
        return vc

    def recorder_header(sched: Any, meta: dict | None = None) -> ev.Header:
        return state_header(sched, build_header(sched, meta))

    def check(header: ev.Header, path: str = "<trace>") -> None:
        why = baseline.refusal(header.features, header.config.block_size, "model-free states",
                               header.config.enable_prefix_caching)
        if why is not None:
            raise TraceError(path, 1, why)

    rs.build_kv_cache_config = lambda n, bs, f=None: kv_cache_config(n, bs, f)
    rs.build_vllm_config, vh.build_header = vllm_config, recorder_header
    rs.check_supported = rerun.check_supported = check
    try:
        yield
    finally:
        (rs.build_kv_cache_config, rs.build_vllm_config, vh.build_header, rs.check_supported,
         rerun.check_supported) = saved
        replay_connector = rs._connector_module().ReplayConnector
        if "supports_divergent_local_hybrid_hits" in vars(replay_connector):
            del replay_connector.supports_divergent_local_hybrid_hits


def _connector_name(connector: dict) -> str:
    return "DivergentScriptedConnector" if connector.get("divergent") else "ScriptedHMAConnector"


def __getattr__(name: str) -> Any:
    """``DivergentScriptedConnector``: the scripted connector as one that
    restores a state group's lagging state (as NIXL does), built when vLLM's
    connector factory asks for it."""
    if name != "DivergentScriptedConnector":
        raise AttributeError(name)
    from kvtrace.lab.scripted_connector import ScriptedHMAConnector

    cls = type(name, (ScriptedHMAConnector,), {"supports_divergent_local_hybrid_hits": True})
    globals()[name] = cls
    return cls


@contextlib.contextmanager
def scripted(connector: dict | None):
    """While it lasts, the scheduler built from a header with a connector gets
    kvtrace's scripted connector (``connector["rules"]``: its external hits)
    instead of the replay connector, which answers as a recording did."""
    if not connector:
        yield
        return
    from kvtrace.rerun import build as rs

    build = rs.build_vllm_config

    def vllm_config(header: ev.Header) -> Any:
        from vllm.config import KVTransferConfig

        vc = build(header)
        divergent = connector.get("divergent")
        vc.kv_transfer_config = KVTransferConfig(
            kv_connector=_connector_name(connector),
            kv_connector_module_path=(__name__ if divergent
                                      else "kvtrace.lab.scripted_connector"),
            kv_role="kv_consumer", kv_load_failure_policy=connector.get("policy", "fail"),
            kv_connector_extra_config={"rules": connector["rules"]})
        return vc

    rs.build_vllm_config = vllm_config
    try:
        yield
    finally:
        rs.build_vllm_config = build


# --------------------------------------------------------------------------- the run


def record(wl: dict, out_path: str, step_limit: int = 3000) -> dict:
    """Record ``wl`` on the installed vLLM's scheduler, model-free, into
    ``out_path``. Returns {"steps", "preemptions", "error"}."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    from kvtrace.record.vllm import recorder as vr
    from kvtrace.lab.model_free import ModelFreeExecutor
    from kvtrace.rerun.core import _request
    from kvtrace.rerun.build import build_scheduler, resolve_scheduler_cls

    header = header_of(wl)
    with states_on(), scripted(wl.get("connector")):
        cls = resolve_scheduler_cls(None, bool(wl.get("async")))
        sched, _ = build_scheduler(header, out_path, cls, meta={"model_free_states": True})
    rec = sched._kvtrace
    hasher = None
    if header.config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(header.config.block_size, hash_fn)
    model = ModelFreeExecutor.__new__(ModelFreeExecutor)   # its model only, no engine
    model.scheduler, model.connector, model.drafts, model.pending = sched, None, {}, None
    if wl.get("connector"):   # its worker side, as vLLM's model runner calls it
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        model.connector = type(sched.connector)(sched.vllm_config, KVConnectorRole.WORKER,
                                                sched.kv_cache_config)
    model.num_spec_tokens = int(wl.get("spec") or 0)
    model.async_scheduling = bool(wl.get("async"))
    arrivals = sorted(wl.get("arrivals", ()), key=lambda a: a["step"])
    aborts = sorted(wl.get("aborts", ()), key=lambda a: a["step"])
    resets = sorted(wl.get("resets", ()), key=lambda a: a["step"])
    queue: list = []   # (output, model output) in flight, oldest first
    depth = 2 if wl.get("async") else 1
    status, error, step, preemptions = "complete", None, 0, 0
    try:
        while arrivals or aborts or resets or sched.has_requests() or queue:
            if step >= step_limit:
                raise RuntimeError(f"still running after {step_limit} steps")
            while arrivals and arrivals[0]["step"] <= step:
                a = arrivals.pop(0)
                sched.add_request(_request(ev.Arrival(
                    seq=0, req=a["req"], prompt_token_ids=a["prompt"], max_tokens=a["max_tokens"],
                    arrival_time=float(a["step"]), priority=a.get("priority", 0), ignore_eos=True),
                    hasher, header.config.block_size))
            due = [a["req"] for a in aborts if a["step"] <= step]
            aborts = [a for a in aborts if a["step"] > step]
            live = [r for r in due if r in sched.requests]
            if live:
                sched.finish_requests_in_order(live, RequestStatus.FINISHED_ABORTED)
            while resets and resets[0]["step"] <= step:
                try:
                    sched.reset_prefix_cache(reset_running_requests=resets.pop(0)["running"])
                except RuntimeError:
                    pass
            executed = False
            if sched.has_requests():
                so = sched.schedule()
                preemptions += len(so.preempted_req_ids or ())
                executed = so.total_num_scheduled_tokens > 0
                queue.append((so, model._output(so)))
            step += 1
            if queue and (len(queue) >= depth or not (executed or sched.has_requests())):
                so, out = queue.pop(0)
                sched.update_from_output(so, out)
                if model.num_spec_tokens and not model.async_scheduling and \
                        so.total_num_scheduled_tokens:
                    drafts = model.take_draft_token_ids()
                    if drafts is not None:
                        sched.update_draft_token_ids(drafts)
    except Exception as e:   # the scheduler under test failed: the trace ends there
        status, error = "interrupted", f"{type(e).__name__}: {e}"
    finally:
        if rec.failed is not None:
            rec.sink.close("recorder-error", rec.failed)
        else:
            rec.sink.close(status, error)
        vr.untrack(rec)
        rec.active = False
    return {"steps": step, "preemptions": preemptions, "error": error,
            "vllm": str(getattr(vllm, "__version__", ""))}


# --------------------------------------------------------------------------- random workloads


def state_group(block_size: int, kind: str = "gdn", mode: str = "align", spec: int = 0) -> dict:
    """A state group: gated delta net (Qwen3-Next, Qwen3.5: no checkpoint
    block) or Mamba2 (Nemotron-H, Granite 4: a prefill checkpoint block)."""
    g = {"kind": "MambaSpec", "block_size": block_size, "mamba_cache_mode": mode,
         "num_speculative_blocks": spec, "num_prefill_checkpoint_blocks": 0,
         "mamba_type": "gdn_attn" if kind == "gdn" else "mamba2"}
    if kind == "mamba2" and mode == "align":
        g.update(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    return g


LAYOUTS = ("gdn", "mamba2", "mamba2-nockpt", "pure", "three-kinds", "none", "none-pure",
           "none-three-kinds")


def random_workload(seed: int, layout: str | None = None, async_scheduling: bool | None = None,
                    spec: int | None = None) -> dict:
    """A random workload over state groups: ``layout`` (one of LAYOUTS, or
    drawn) is Qwen3-Next's (three GDN groups and full attention), Nemotron-H's
    (Mamba2 groups with checkpoint blocks), Mamba2 without them, a model of
    state layers only, Qwen3.5's three kinds (a sliding window, full
    attention, GDN), or one of those without prefix caching (mode none: a
    state block of max_model_len tokens). Prompts share prefixes in
    families, some identical, some of whole blocks; block counts from
    plenty down to preemption; budgets and thresholds below a block too;
    retention 0, dense or an interval; n-gram drafts; async scheduling;
    prefix-cache resets and aborts."""
    import random

    rng = random.Random(f"hybrid-state:{seed}")
    layout = layout or rng.choice(LAYOUTS)
    bs = rng.choice((16, 16, 32, 64))
    max_len = rng.choice((512, 1024))
    k = rng.choice((0, 0, 0, 2, 3)) if spec is None else spec
    mode = "none" if layout.startswith("none") else "align"
    gdn, m2 = state_group(bs, "gdn", mode, k), state_group(bs, "mamba2", mode, k)
    if mode == "none":   # the state's block spans max_model_len; attention keeps its own
        gdn["block_size"] = m2["block_size"] = max_len
    full = {"kind": "FullAttentionSpec", "block_size": bs}
    window = rng.choice((2, 3, 4)) * bs
    groups = {"gdn": [gdn] * rng.randint(1, 3) + [full],
              "mamba2": [m2] * rng.randint(1, 2) + [full],
              "mamba2-nockpt": [state_group(bs, "mamba2-nockpt", mode, k), full],
              "pure": [m2 if rng.random() < 0.5 else gdn],
              "three-kinds": [{"kind": "SlidingWindowSpec", "block_size": bs,
                               "sliding_window": window}, full, gdn],
              "none": [gdn] * rng.randint(1, 3) + [full],
              "none-pure": [gdn],
              "none-three-kinds": [{"kind": "SlidingWindowSpec", "block_size": bs,
                                    "sliding_window": window}, full, gdn]}[layout]
    if layout == "mamba2" and rng.random() < 0.3:
        groups = [full] + groups[:-1]   # full attention first (Falcon-H1)
    sched_bs = math.lcm(*(g["block_size"] for g in groups))
    budget = rng.choice((bs // 2 + 3, bs, 2 * bs + 5, 4 * bs, 256, 512))
    budget = max(budget, 8)
    # Room for a few whole prompts, or barely one (preemptions).
    num_blocks = rng.choice((12, 20, 40, 80, 200)) * (len(groups) if mode == "align" else 1)
    if mode == "none":
        num_blocks = rng.choice((3, 5, 8, 16)) * len(groups) + 1
    # At least what one request of max_model_len holds, as vLLM's start-up
    # checks (a state: its running state, one for the state before, a
    # checkpoint and the speculative blocks; none mode: one and those).
    one = sum(-(-max_len // g["block_size"]) if g["kind"] == "FullAttentionSpec"
              else -(-(g.get("sliding_window") or 0) // bs) + 2 if g["kind"] != "MambaSpec"
              else (1 if mode == "none" else 3) + k for g in groups)
    num_blocks = max(num_blocks, one + 1)
    families = [[rng.randrange(16, 480) for _ in range(rng.randint(bs, 3 * bs + 20))]
                for _ in range(rng.randint(1, 3))]
    arrivals, step = [], 0
    for i in range(rng.randint(3, 9)):
        head = rng.choice(families)
        pick = rng.random()
        if pick < 0.2:
            prompt = list(head)                                     # identical
        elif pick < 0.35:
            prompt = head[: rng.randint(1, 3) * bs] + [rng.randrange(16, 480) for _ in range(bs)]
        else:
            prompt = head + [rng.randrange(16, 480) for _ in range(rng.randint(0, 2 * bs + 7))]
        prompt = prompt[: max_len - 40] or [17]
        arrivals.append({"step": step, "req": f"r{i}", "prompt": prompt,
                         "max_tokens": rng.randint(1, 40), "priority": rng.randint(0, 2)})
        step += rng.choice((0, 0, 1, 2, 5, 12))
    resets = [{"step": rng.randint(1, step + 30), "running": rng.random() < 0.5}
              for _ in range(rng.choice((0, 0, 1, 2)))]
    aborts = [{"step": a["step"] + rng.randint(0, 8), "req": a["req"]}
              for a in arrivals if rng.random() < 0.1]
    threshold = rng.choice((0, 0, 0, bs // 2 + 1, 2 * bs))
    connector = None
    if mode == "align" and rng.random() < 0.3:
        # An external store holding a family's head, of whole blocks or not,
        # loaded at once or asynchronously.
        connector = {"rules": [{"prefix": f[:bs], "hit": rng.randint(1, len(f)),
                                "async": rng.random() < 0.4, "delay_steps": rng.randint(1, 3)}
                               for f in families if rng.random() < 0.7],
                     "divergent": rng.random() < 0.4}
    return {
        "name": f"{layout}-{seed}",
        "config": {"block_size": sched_bs, "num_blocks": num_blocks,
                   "max_num_batched_tokens": budget, "max_num_seqs": rng.choice((2, 4, 8)),
                   "max_model_len": max_len, "enable_prefix_caching": mode == "align",
                   "long_prefill_token_threshold": threshold,
                   "policy": rng.choice(("fcfs", "fcfs", "priority"))},
        "groups": groups,
        "retention": rng.choice((0, 0, 0, None, 2 * bs, 4 * bs)) if mode == "align" else 0,
        "async": rng.random() < 0.35 if async_scheduling is None else async_scheduling,
        "spec": k,
        # Without prefix caching a drafter's head only adds lookahead slots.
        "eagle": bool(k) and mode == "none" and rng.random() < 0.5,
        "arrivals": arrivals, "resets": resets, "aborts": aborts, "connector": connector,
    }


def main(argv: list[str]) -> int:
    jobs_path, out_dir = argv
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        out = os.path.join(out_dir, f"{job['name']}.jsonl")
        try:
            res = record(job["workload"], out)
        except Exception as e:
            res = {"error": f"refused: {type(e).__name__}: {e}"}
        print(json.dumps({"name": job["name"], "path": out, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
