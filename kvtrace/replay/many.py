"""Several traces (one per engine rank or replica) replayed in parallel, each
in a process of a pool, in the order given. Unusable input and internal errors
come back as messages, so the other traces' results still count."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

from kvtrace.trace import TraceError

from .replayer import ReplayResult, replay_file


class InternalError(str):
    """The message of an internal error in one trace (not of unusable input)."""


# One replay's answer: (path as given, its result or None, None or why not).
Answer = tuple[str, ReplayResult | None, str | None]


def replay_quietly(args: tuple[str, str | None, str | None]) -> Answer:
    """One trace: (path, result, None), or (path, None, the message why not)."""
    path, device, profile = args
    return quietly(path, lambda: replay_file(path, device=device, profile=profile))


def quietly(path: str, replay: Callable[[], ReplayResult]) -> Answer:
    """``replay()``'s result as an answer: (path, result, None), or (path, None,
    the message of unusable input, or an InternalError's)."""
    try:
        return path, replay(), None
    except TraceError as e:
        return path, None, str(e)
    except Exception as e:
        return path, None, InternalError(f"{path}: internal error: {type(e).__name__}: "
                                         f"{' '.join(str(e).split())}")


def replay_many(paths: list[str], device: str | None, profile: str | None, jobs: int = 0,
                progress: Callable[[int], None] | None = None,
                task: Callable[[tuple[str, str | None, str | None]], Answer] = replay_quietly
                ) -> list[Answer]:
    """Replay ``paths`` on ``jobs`` processes (0: one per core, at most one per
    trace); ``progress`` is told how many are done. ``task`` replays one
    (path, device, profile) (a top-level function: it is pickled by name)."""
    jobs = min(jobs or os.cpu_count() or 1, len(paths))
    work = [(str(p), device, profile) for p in paths]
    results = []
    with contextlib.ExitStack() as stack:
        if jobs == 1:
            done = map(task, work)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=jobs))
            stack.push(lambda *exc: stop_pool(pool) if exc[0] is not None else None)
            done = pool.map(task, work)
        for i, result in enumerate(done):   # in the order given
            results.append(result)
            if progress is not None:
                progress(i + 1)
    return results


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Interrupted (SIGTERM reaches this process alone, not the workers, as
    Ctrl-C does): stop the replays still running rather than wait for them."""
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in multiprocessing.active_children():
        proc.terminate()
