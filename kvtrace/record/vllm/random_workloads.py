"""Random vLLM workloads by kind: ``workload(seed, kind)``.

A kind names a base workload of ``kvtrace.record.vllm.run`` and the
modifiers put on it, as prefixes:

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

from kvtrace.record.vllm.run import (connector_workload, knobs_workload, mixed_workload,
                                     rlhf_workload, served, sessions_workload, stream_workload,
                                     with_draft_model, with_drafts, with_dynamic_drafts,
                                     with_eagle, with_embeds, with_grammars, with_loras)

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
ALL_KINDS = (KINDS + SPEC_KINDS + EA_KINDS + DM_KINDS + SO_KINDS + PE_KINDS + LO_KINDS + DY_KINDS
             + PI_KINDS)


def workload(seed: int, kind: str) -> dict:
    """The random workload of ``kind`` drawn from ``seed``."""
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
