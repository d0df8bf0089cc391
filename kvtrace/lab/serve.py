"""A workload served step by step, as a server drives the engine: arrivals
before the steps given, aborts, streaming-input sessions' further chunks,
prefix-cache resets and scheduler pauses (its ``control`` actions), a data-parallel
engine core's prefill throttling, and steps on while the connector still
sends. ``run`` calls ``serve`` when a workload has arrivals or aborts."""

from __future__ import annotations

import copy
import logging
from typing import Any

from kvtrace.lab.workload_spec import Workload

logger = logging.getLogger("kvtrace.record")


def serve(eng: Any, prompts: list, params: Any, wl: Workload, loras: list | None = None) -> dict:
    """Drive ``eng`` (a ``LLMEngine``) step by step, as a server does: request i
    (id ``str(i)``) arrives before engine step ``arrive_at[i]``; ``aborts``, a list
    of ``[step, [i, ...]]``, aborts those requests in one call before that step.
    Steps where nothing is left to run are skipped to the next arrival. After
    them, before each step, the ``control`` actions due by then (``apply_control``).
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
    arrive = list(wl.arrive_at or [0] * n)
    priority = list(wl.priority or [0] * n)
    aborts = {int(step): [str(i) for i in ids] for step, ids in wl.aborts or ()}
    order = sorted(range(n), key=lambda i: (arrive[i], i))
    control = [list(c) for c in wl.control or ()]
    sessions = {int(i): chunks for i, chunks in wl.sessions or ()}
    chunks = sorted((int(at), i, k, tokens) for i, given in sessions.items()
                    for k, (at, tokens) in enumerate(given))
    aborted: set[str] = set()
    outs: dict[int, Any] = {}
    step = 0
    core = getattr(eng.engine_core, "engine_core", None)   # the engine core, when in process
    if wl.throttle_every:
        _throttle_like_data_parallel(core, int(wl.throttle_every))
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
            apply_control(eng, *control.pop(0)[1:])
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


def apply_control(eng: Any, action: str, *args: Any) -> None:
    """One action of an RLHF loop on ``eng``'s in-process engine core:
    ``reset`` (``reset_prefix_cache(reset_running_requests, reset_connector)``),
    ``pause-new`` (the scheduler paused for new requests, as
    ``pause_scheduler(mode="wait")`` does; the in-process core refuses that
    mode), ``pause-all`` (``pause_scheduler(mode="keep", clear_cache)``),
    ``resume``, ``finish`` (``finish_requests([i, ...], status)``, a caller
    that ends requests with a status of its own, ``FINISHED_STOPPED`` say), or
    ``corrupt-store`` (one byte of a prompt's KV in an ExampleConnector's
    store changed: ``fault_connectors.corrupt_stored_prompt``). vLLM raises from a reset it cannot make (blocks still in use
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
        elif action == "corrupt-store":
            from kvtrace.lab.fault_connectors import corrupt_stored_prompt

            logger.info("corrupted %s", corrupt_stored_prompt(core.scheduler.connector, list(args[0]),
                                                                  *args[1:]))
        else:
            raise ValueError(f"unknown control action {action!r}")
    except RuntimeError as e:
        logger.info("%s: %s (the engine goes on)", action, e)
