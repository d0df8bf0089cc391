"""The items of a replay of many as Ray tasks (``kvtrace replay --ray``).

One task per item, on the cluster at an address, or on a local one started in
this process for the command and shut down after it. One trace with
keyframes is split at them instead, a task a piece (``replay_split_on_ray``). Ray retries a task whose
worker dies (killed, out of memory, its node lost) up to ``RETRIES`` times; a
task that fails past them, or raises, is answered with an InternalError that
names its item. The answers come back in the order given, as the pool's do
(kvtrace/replay/many.py), so the report is the same.

Ray is imported only here, and only when called: kvtrace runs without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
from typing import Callable

from kvtrace._text import count
from kvtrace.replay.many import Answer, InternalError
from kvtrace.replay.split import (SplitError, Unsplittable, check_content, merge, plan_split,
                                  replay_piece, verdict)

from .items import Item, replay_item

RETRIES = 3                      # Ray's retries of a task whose worker died
LOCAL = "local"                  # ray.init's address for a new cluster on this machine
LOCAL_OBJECT_STORE = 200 << 20   # bytes: answers are small, and a small machine starts it
WAIT_S = 1.0                     # progress is told at least this often
REACH_S = 10.0                   # how long a cluster's address may take to answer
RAY_INSTALL = "pip install 'kvtrace[ray]'"
_ADDRESS = re.compile(r"(?:auto|local|ray://\S+|[^\s/]+:\d+)\Z")
_HOST_PORT = re.compile(r"(?:ray://)?\[?([^\s/\]]+)\]?:(\d+)/?\Z")


class RayUnavailable(Exception):
    """Ray is not installed, or does not import: the user's environment, exit 2."""

    exit_code = 2


class ClusterUnavailable(Exception):
    """No Ray cluster at the address given, or a local one that did not start: exit 2."""

    exit_code = 2


def is_address(text: str) -> bool:
    """Whether ``text`` reads as a Ray address: ``auto``, ``local``,
    ``HOST:PORT`` or ``ray://HOST:PORT`` (a file name does not)."""
    return bool(_ADDRESS.match(text))


def require_ray():
    """Import Ray, or say in one line why it cannot and how to fix it."""
    try:
        import ray
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise RayUnavailable(f"Ray does not import: {e}") from None
        raise RayUnavailable(f"--ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    except Exception as e:
        raise RayUnavailable(f"Ray does not import: {type(e).__name__}: {_line(e)}") from None
    return ray


@contextlib.contextmanager
def connected(address: str = LOCAL):
    """Ray, connected for the block: to the cluster at ``address``, or to a
    local one started here (``local``) with this machine's cores, a small
    object store and no dashboard, shut down after the block. A program that
    connected already keeps its own connection, as it is."""
    ray = require_ray()
    _reachable(address)
    if ray.is_initialized():
        yield ray
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # no prompt, nothing sent
    options = {"log_to_driver": False, "logging_level": logging.ERROR}
    if address == LOCAL:
        options.update(num_cpus=os.cpu_count() or 1, include_dashboard=False,
                       object_store_memory=LOCAL_OBJECT_STORE)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, **options)
    except Exception as e:
        with contextlib.suppress(Exception):
            ray.shutdown()
        where = "start a local Ray cluster" if address == LOCAL else f"reach a Ray cluster at {address}"
        raise ClusterUnavailable(f"--ray: cannot {where}: {type(e).__name__}: {_line(e)}") from None
    except BaseException as e:   # interrupted as Ray started: nothing of it left running
        with contextlib.suppress(Exception):
            ray.shutdown()
        _restore(handler)
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)   # ray.init's handler exits; the command's unwinds
        raise
    finally:
        _restore(handler)
    try:
        yield ray
    finally:
        ray.shutdown()


def _restore(handler) -> None:
    """SIGTERM's handler back as it was: ray.init sets its own, which exits at
    once, where the command's unwinds (its tasks stopped, the cluster shut down)."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _reachable(address: str) -> None:
    """A HOST:PORT that nothing answers at is said at once (Ray would try for
    minutes, its own lines on stderr)."""
    m = _HOST_PORT.match(address)
    if m is None:   # auto, local: Ray finds the cluster, or says there is none
        return
    try:
        with socket.create_connection((m[1], int(m[2])), timeout=REACH_S):
            pass
    except OSError as e:
        raise ClusterUnavailable(f"--ray: no Ray cluster answers at {address}: "
                                 f"{e.strerror or e or type(e).__name__}") from None


def replay_on_ray(items: list[Item], address: str = LOCAL,
                  progress: Callable[[int], None] | None = None,
                  task: Callable[[Item], Answer] = replay_item,
                  retries: int = RETRIES) -> list[Answer]:
    """Replay ``items``, one Ray task each, on the cluster at ``address``;
    ``progress`` is told how many are done. ``task`` replays one item (a
    top-level function: Ray's workers import it by name, so kvtrace must be
    installed on the cluster); ``retries``: Ray's, of a task whose worker died."""
    with connected(address) as ray:
        remote = ray.remote(run_task).options(num_cpus=1, max_retries=retries,
                                              retry_exceptions=False)
        here = os.getcwd()
        pending = [remote.remote(task, item, here) for item in items]
        where = {ref: i for i, ref in enumerate(pending)}
        answers: list = [None] * len(items)
        done = 0
        try:
            while pending:
                ready, pending = _unwrapped(ray.wait, pending, num_returns=len(pending),
                                            timeout=WAIT_S)
                for ref in ready:
                    i = where.pop(ref)   # the answer is fetched: Ray may free it
                    answers[i] = _answer(ray, ref, items[i], retries)
                done += len(ready)
                if ready and progress is not None:
                    progress(done)
        except BaseException:   # interrupted: stop the tasks still running
            for ref in pending:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise
    return answers


def replay_split_on_ray(item: Item, address: str = LOCAL,
                        progress: Callable[[int], None] | None = None,
                        retries: int = RETRIES, pieces: int | None = None) -> Answer:
    """Replay one trace split at its keyframes into ``pieces`` (default: the
    cluster's CPUs), a Ray task a piece and one for the content check, the
    report merged as ``kvtrace replay -j`` merges it (the same report as a
    serial replay). Where it cannot be split, or a piece finds what only a
    serial replay can say, the trace is one task, as in a replay of many.
    ``progress`` is told how many pieces are done."""
    path, device, profile = item
    with connected(address) as ray:
        n = pieces or int(ray.cluster_resources().get("CPU", 1))
        split = plan_split(path, n, device, profile)
        if split is not None:
            try:
                return path, _split_on(ray, split, progress, retries), None
            except SplitError as e:
                return path, None, InternalError(str(e))
            except Unsplittable:
                pass   # the serial replay says what the pieces could not
        return replay_on_ray([item], address, None, retries=retries)[0]


def _split_on(ray, split, progress, retries: int):
    """``split``'s pieces and content check as Ray tasks, merged in trace order."""
    remote = ray.remote(run_job).options(num_cpus=1, max_retries=retries,
                                         retry_exceptions=False)
    here = os.getcwd()
    check = remote.remote(check_content, split.content, here) if split.content else None
    refs = [remote.remote(replay_piece, p, here) for p in split.pieces]
    where = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending, done = list(refs), 0
    try:
        while pending:
            ready, pending = _unwrapped(ray.wait, pending, num_returns=len(pending),
                                        timeout=WAIT_S)
            for ref in ready:
                i = where.pop(ref)
                results[i] = _job(ray, ref, f"piece {i + 1} of {len(refs)}", split.path, retries)
                if results[i].error is not None:   # no need to wait for the others
                    verdict(split, i, results[i])
            done += len(ready)
            if ready and progress is not None:
                progress(done)
        checked = (_job(ray, check, "the content check", split.path, retries)
                   if check is not None else None)
    except BaseException:   # interrupted, or a piece ends the split: stop the rest
        for ref in [*pending, *([check] if check is not None else [])]:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise
    return merge(split, results, checked)


def _job(ray, ref, what: str, path: str, retries: int):
    """A split's task's result; SplitError when it failed past Ray's retries."""
    try:
        return _unwrapped(ray.get, ref)
    except ray.exceptions.RayError as e:
        raise SplitError(f"{path}: {what}: {_failure(ray, e, retries)}") from None


def run_job(job: Callable, arg, folder: str):
    """On a Ray worker: ``job(arg)`` in ``folder``, the command's (a piece's
    relative path is read from there)."""
    if os.getcwd() != folder:
        os.chdir(folder)
    return job(arg)


def run_task(task: Callable[[Item], Answer], item: Item, folder: str) -> Answer:
    """On a Ray worker: ``task(item)``, a relative path read from ``folder``,
    the one the command runs in (a cluster's node must see it at the same place)."""
    path = item[0]
    if not os.path.isabs(path) and os.getcwd() != folder:
        try:
            os.chdir(folder)
        except OSError as e:
            return path, None, (f"{path}: a relative path, and Ray's worker on "
                                f"{socket.gethostname()} cannot enter {folder}, where the "
                                f"command runs ({e.strerror}); give paths that every node sees")
    return task(item)


def _answer(ray, ref, item: Item, retries: int) -> Answer:
    """A task's answer, or an InternalError that names its item."""
    path = item[0]
    try:
        return _unwrapped(ray.get, ref)
    except ray.exceptions.RayError as e:
        return path, None, InternalError(f"{path}: {_failure(ray, e, retries)}")


def _failure(ray, e: BaseException, retries: int) -> str:
    """A Ray task's failure in one line: the error the task raised (Ray
    does not retry those), or Ray's own once its retries are spent (the
    task's worker or node lost, each time)."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None) or e
        return f"internal error in its Ray task: {type(cause).__name__}: {_line(cause)}"
    return (f"internal error: its Ray task failed after {count(retries, 'retry', 'retries')}: "
            f"{type(e).__name__}: {_line(e)}")


def _unwrapped(call, *args, **kw):
    """``call(*args, **kw)``, a call into Ray's compiled code; Ctrl-C or SIGTERM
    (its handler raises) during it comes out as itself, not as the SystemError
    that Ray's code turns it into."""
    try:
        return call(*args, **kw)
    except SystemError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            raise cause from None
        raise


def _line(e: BaseException) -> str:
    """The first line of an error's message (Ray's go on for pages)."""
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else ""
