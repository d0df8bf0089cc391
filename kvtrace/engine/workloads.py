"""Built-in workloads: an engine configuration and a timed list of arrivals.

Every workload is a function of the seed and of its number of requests
(``requests``; each workload has its own default, and any number from 1 up
makes a workload of the same kind, for scaling a fault up). Prompts are random
token ids built from shared pieces (system prompts, documents), so that
requests hit each other's blocks in the prefix cache and in the external store.

* ``shared-prefix``: chat with a few shared system prompts; prefix-cache hits,
  one request aborted while waiting and one while running.
* ``kv-pressure``: a small KV cache, long prompts and outputs; preemptions.
* ``offload``: an external store, preloaded with documents whose lengths end
  mid-block; sync and async external hits; the store saves on finish and on
  preemption, so a resumed request finds more of itself than before.
* ``load-failures``: the store with the "recompute" load-failure policy; some
  async loads fail whole (failed_recving), some sync loads lose a block
  (invalid_block_ids), some of those reported a step late.
* ``hybrid``, ``sliding-window``: sliding-window KV-cache groups.
* ``hybrid-state``, ``hybrid-state-checkpoint``, ``hybrid-state-uncached``,
  ``hybrid-state-offload``, ``hybrid-three-kinds``: state (Mamba, gated delta
  net) KV-cache groups beside full attention (and a sliding window; an
  external store).
* ``hybrid-state-pressure``: Qwen3-Next's cache in a small pool: the states
  kept are evicted and their blocks handed out again.
* ``hybrid-state-async-reset``: Qwen3-Next's cache under async scheduling
  with a store that loads KV (a freed request's blocks wait for the step in
  flight), the prefix cache reset under running requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable

from kvtrace.reference import GroupSpec, SchedulerConfig, StateSpec

from .kv_store import StoreSettings
from .sampler import FIRST_ORDINARY_TOKEN

VOCAB_SIZE = 32000


@dataclass(frozen=True, slots=True)
class PlannedArrival:
    step: int
    req: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0


@dataclass(frozen=True, slots=True)
class PlannedAbort:
    step: int
    req: str


@dataclass(frozen=True, slots=True)
class PlannedReset:
    """``reset_prefix_cache`` before the step's schedule(); with
    ``reset_running_requests`` every running request is preempted for it."""

    step: int
    reset_running_requests: bool = False


@dataclass(frozen=True, slots=True)
class PlannedPause:
    """``set_pause_state(state)`` before the step's schedule(): "PAUSED_NEW",
    "PAUSED_ALL" or "UNPAUSED" (trace format 3.2b)."""

    step: int
    state: str


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    config: SchedulerConfig
    arrivals: tuple[PlannedArrival, ...]
    aborts: tuple[PlannedAbort, ...] = ()
    store: StoreSettings | None = None
    vocab_size: int = VOCAB_SIZE
    eos_probability: float = 0.0
    resets: tuple[PlannedReset, ...] = ()
    pauses: tuple[PlannedPause, ...] = ()


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(n))


def _arrival_steps(rng: random.Random, n: int, gaps: tuple[int, ...]) -> list[int]:
    steps, t = [], 0
    for _ in range(n):
        steps.append(t)
        t += rng.choice(gaps)
    return steps


def _rng(name: str, seed: int) -> random.Random:
    return random.Random(f"{name}:{seed}")


# --------------------------------------------------------------------------- workloads


def shared_prefix(seed: int, requests: int | None = None) -> Workload:
    rng = _rng("shared-prefix", seed)
    config = SchedulerConfig(block_size=8, num_blocks=96, max_num_batched_tokens=96,
                             max_num_seqs=6, max_model_len=512)
    systems = [_tokens(rng, rng.randint(20, 60)) for _ in range(3)]
    arrivals = []
    for i, step in enumerate(_arrival_steps(rng, requests or 28, (0, 1, 1, 2, 3))):
        prompt = rng.choice(systems) + _tokens(rng, rng.randint(6, 40))
        arrivals.append(PlannedArrival(step, f"chat-{i}", prompt, rng.randint(4, 24)))
    # One abort while still waiting, one while running by then: the 10th and
    # 18th requests, and so on in every 28 of a longer workload.
    aborts = tuple(PlannedAbort(arrivals[i].step + late, arrivals[i].req)
                   for base in range(0, len(arrivals), 28)
                   for i, late in ((base + 9, 0), (base + 17, 4)) if i < len(arrivals))
    return Workload("shared-prefix", config, tuple(arrivals), aborts, eos_probability=0.03)


def sliding_group(window: int, block_size: int, max_num_batched_tokens: int,
                  max_model_len: int) -> GroupSpec:
    """A sliding-window group, with vLLM's admission cap for it: the window's
    blocks and a step's tokens, one block more for a window that starts
    mid-block (kv_cache_interface.py, SlidingWindowSpec)."""
    tokens = min(window - 1 + max_num_batched_tokens, max_model_len)
    return GroupSpec(window, -(-tokens // block_size) + 1)


def _windowed(name: str, seed: int, groups: tuple[str, ...], requests: int | None) -> Workload:
    """Shared prefixes longer than the window and decodes past it, under a
    cache that preempts: ``groups`` names each KV-cache group's kind."""
    rng = _rng(name, seed)
    bs, batch, max_len = 8, 64, 512
    window = sliding_group(32, bs, batch, max_len)
    config = SchedulerConfig(block_size=bs, num_blocks=80, max_num_batched_tokens=batch,
                             max_num_seqs=6, max_model_len=max_len,
                             kv_groups=tuple(window if g == "sliding" else GroupSpec()
                                             for g in groups))
    systems = [_tokens(rng, rng.randint(40, 70)) for _ in range(3)]
    arrivals = []
    for i, step in enumerate(_arrival_steps(rng, requests or 20, (0, 1, 1, 2, 3))):
        prompt = rng.choice(systems) + _tokens(rng, rng.randint(4, 30))
        arrivals.append(PlannedArrival(step, f"turn-{i}", prompt, rng.randint(16, 48)))
    return Workload(name, config, tuple(arrivals), eos_probability=0.02)


def hybrid(seed: int, requests: int | None = None) -> Workload:
    """Gemma 3's KV cache: a sliding-window group, then a full-attention one."""
    return _windowed("hybrid", seed, ("sliding", "full"), requests)


def sliding_window(seed: int, requests: int | None = None) -> Workload:
    """Every layer windowed: one sliding-window group."""
    return _windowed("sliding-window", seed, ("sliding",), requests)


GDN = StateSpec("align", mamba_type="gdn_attn")                   # gated delta net: no checkpoint
MAMBA2 = StateSpec("align", checkpoint_blocks=1, checkpoint_alignment=1, mamba_type="mamba2")


def _stateful(name: str, seed: int, groups: tuple[GroupSpec, ...], requests: int | None,
              block_size: int = 16, caching: bool = True, num_blocks: int | None = None
              ) -> Workload:
    """Families of prompts that share prefixes of several blocks, some sent
    again whole, outputs that cross block boundaries, under a cache that
    preempts: the states a state group keeps, hits on them, and the chunks
    the scheduler splits at block boundaries."""
    rng = _rng(name, seed)
    batch, max_len = 96, 512
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks or 30 * len(groups),
                             max_num_batched_tokens=batch, max_num_seqs=6, max_model_len=max_len,
                             enable_prefix_caching=caching, kv_groups=groups)
    systems = [_tokens(rng, rng.randint(40, 90)) for _ in range(3)]
    arrivals: list[PlannedArrival] = []
    for i, step in enumerate(_arrival_steps(rng, requests or 20, (0, 1, 1, 2, 3))):
        if i >= 4 and rng.random() < 0.2:
            prompt = rng.choice(arrivals).prompt                          # the same prompt again
        else:
            prompt = rng.choice(systems) + _tokens(rng, rng.randint(1, 40))
        arrivals.append(PlannedArrival(step, f"turn-{i}", prompt, rng.randint(8, 40)))
    return Workload(name, config, tuple(arrivals), eos_probability=0.02)


def hybrid_state(seed: int, requests: int | None = None) -> Workload:
    """Qwen3-Next's KV cache: three gated-delta-net state groups, then full attention."""
    return _stateful("hybrid-state", seed, (GroupSpec(state=GDN),) * 3 + (GroupSpec(),), requests)


def hybrid_state_checkpoint(seed: int, requests: int | None = None) -> Workload:
    """Nemotron-H's: two Mamba2 state groups, which write a prefill checkpoint
    inside a chunk, then full attention."""
    return _stateful("hybrid-state-checkpoint", seed, (GroupSpec(state=MAMBA2),) * 2 + (GroupSpec(),),
                     requests)


def hybrid_state_uncached(seed: int, requests: int | None = None) -> Workload:
    """Qwen3-Next's without prefix caching: one state per request, in a block
    of max_model_len tokens, beside full attention's blocks of 16."""
    state = GroupSpec(state=StateSpec("none", mamba_type="gdn_attn"), block_size=512)
    return _stateful("hybrid-state-uncached", seed, (state,) * 3 + (GroupSpec(block_size=16),),
                     requests, block_size=512, caching=False)


def hybrid_state_offload(seed: int, requests: int | None = None) -> Workload:
    """Qwen3-Next's KV cache with an external store that holds documents and
    saves what requests computed: external hits after a local hit, where full
    attention often hits further than the state groups keep a state."""
    wl = _stateful("hybrid-state-offload", seed, (GroupSpec(state=GDN),) * 3 + (GroupSpec(),),
                   requests)
    rng = _rng("hybrid-state-offload-store", seed)
    documents = tuple(a.prompt[: rng.randint(20, len(a.prompt))] for a in wl.arrivals[:3])
    store = StoreSettings(capacity_tokens=4000, preload=documents, async_fraction=0.3,
                          async_delay_steps=2)
    return replace(wl, store=store)


def hybrid_state_pressure(seed: int, requests: int | None = None) -> Workload:
    """Qwen3-Next's KV cache in a pool of 40 blocks: preemptions, and the
    states kept evicted, their blocks handed out again."""
    return _stateful("hybrid-state-pressure", seed, (GroupSpec(state=GDN),) * 3 + (GroupSpec(),),
                     requests, num_blocks=40)


def hybrid_state_async_reset(seed: int, requests: int | None = None) -> Workload:
    """Qwen3-Next's KV cache under async scheduling, with a store that loads
    KV (a freed request's blocks go back to the pool once the step in flight
    that writes them is processed, S:2759-2801), and the prefix cache reset
    under the running requests two steps after every seventh arrival."""
    wl = _stateful("hybrid-state-async-reset", seed, (GroupSpec(state=GDN),) * 3 + (GroupSpec(),),
                   requests)
    resets = tuple(PlannedReset(a.step + 2, reset_running_requests=True)
                   for a in wl.arrivals[6::7])
    return replace(wl, config=replace(wl.config, async_scheduling=True), resets=resets,
                   store=StoreSettings(capacity_tokens=4000, kv_role="kv_consumer"))


def hybrid_three_kinds(seed: int, requests: int | None = None) -> Workload:
    """Three kinds of group at once: a sliding window, full attention and a
    gated-delta-net state group (Qwen3.5's shape)."""
    window = sliding_group(32, 16, 96, 512)
    return _stateful("hybrid-three-kinds", seed, (window, GroupSpec(), GroupSpec(state=GDN)),
                     requests)


def kv_pressure(seed: int, requests: int | None = None) -> Workload:
    rng = _rng("kv-pressure", seed)
    config = SchedulerConfig(block_size=8, num_blocks=33, max_num_batched_tokens=64,
                             max_num_seqs=6, max_model_len=512, long_prefill_token_threshold=32)
    prefixes = [_tokens(rng, 24), _tokens(rng, 40)]
    arrivals = []
    for i, step in enumerate(_arrival_steps(rng, requests or 16, (0, 1, 2))):
        prompt = rng.choice(prefixes) + _tokens(rng, rng.randint(16, 70))
        arrivals.append(PlannedArrival(step, f"long-{i}", prompt, rng.randint(20, 60)))
    return Workload("kv-pressure", config, tuple(arrivals))


def _document_workload(name: str, seed: int, store: Callable[[tuple], StoreSettings],
                       load_failure_policy: str, num_requests: int) -> Workload:
    rng = _rng(name, seed)
    config = SchedulerConfig(block_size=8, num_blocks=41, max_num_batched_tokens=48,
                             max_num_seqs=5, max_model_len=512, long_prefill_token_threshold=16,
                             load_failure_policy=load_failure_policy)
    # Document lengths end mid-block, so loads of them do too.
    documents = [_tokens(rng, 8 * rng.randint(3, 8) + rng.randint(1, 7)) for _ in range(4)]
    preload = tuple(documents[:3])          # the fourth is only ever saved by requests
    arrivals = []
    for i, step in enumerate(_arrival_steps(rng, num_requests, (0, 1, 2, 3))):
        if i % 4 == 3 and i >= 7:
            # A regenerated answer: the prompt of an earlier request, which the
            # store may hold whole (a full external hit).
            prompt = arrivals[i - 6].prompt
        else:
            prompt = rng.choice(documents) + _tokens(rng, rng.randint(20, 80))
        arrivals.append(PlannedArrival(step, f"doc-{i}", prompt, rng.randint(16, 48)))
    return Workload(name, config, tuple(arrivals), store=store(preload))


def offload(seed: int, requests: int | None = None) -> Workload:
    return _document_workload(
        "offload", seed, lambda preload: StoreSettings(
            capacity_tokens=3000, preload=preload, async_fraction=0.4, async_delay_steps=2),
        "fail", num_requests=requests or 22)


def load_failures(seed: int, requests: int | None = None) -> Workload:
    return _document_workload(
        "load-failures", seed, lambda preload: StoreSettings(
            capacity_tokens=3000, preload=preload, async_fraction=0.5, async_delay_steps=1,
            failed_recving_fraction=0.5, invalid_blocks_fraction=0.8, late_failure_fraction=0.7),
        "recompute", num_requests=requests or 20)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "kv-pressure": kv_pressure,
    "offload": offload,
    "load-failures": load_failures,
    "hybrid": hybrid,
    "sliding-window": sliding_window,
    "hybrid-state": hybrid_state,
    "hybrid-state-checkpoint": hybrid_state_checkpoint,
    "hybrid-state-uncached": hybrid_state_uncached,
    "hybrid-state-offload": hybrid_state_offload,
    "hybrid-three-kinds": hybrid_three_kinds,
    "hybrid-state-pressure": hybrid_state_pressure,
    "hybrid-state-async-reset": hybrid_state_async_reset,
}


def under_async_scheduling(wl: Workload) -> Workload:
    """``wl`` run as vLLM's AsyncScheduler runs it: two steps in flight,
    which a sliding window's admission cap covers too (KI:859-885)."""
    c = wl.config
    groups = tuple(g if g.sliding_window is None else sliding_group(
        g.sliding_window, g.block_size or c.block_size, 2 * c.max_num_batched_tokens,
        c.max_model_len) for g in c.kv_groups)
    return replace(wl, config=replace(c, async_scheduling=True, kv_groups=groups))


def build_workload(name: str, seed: int = 0, requests: int | None = None) -> Workload:
    """Workload ``name`` for ``seed``, of ``requests`` requests (None: its own number)."""
    try:
        make = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    if requests is not None and requests < 1:
        raise ValueError(f"a workload needs at least one request, not {requests}")
    return make(seed, requests)
