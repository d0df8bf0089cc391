"""vLLM general plugin: record scheduler decisions when ``KVTRACE_OUT`` is set.

Declared in pyproject.toml as::

    [project.entry-points."vllm.general_plugins"]
    kvtrace = "kvtrace.record.vllm.plugin:register"

vLLM loads general plugins in every process (front end, engine core, workers),
and the engine core loads them before it resolves its scheduler class with
``vllm_config.scheduler_config.get_scheduler_cls()`` (vllm/v1/engine/core.py).
``register()`` wraps that method so that whatever class it resolves (vLLM's
``Scheduler``, ``AsyncScheduler`` or a user's ``scheduler_cls``) is returned as a
recording subclass built by ``make_recording_scheduler``.

* Without ``KVTRACE_OUT`` in the environment ``register()`` does nothing.
* It is idempotent, and harmless in processes that never build a scheduler.
* ``KVTRACE_OUT`` is read when a scheduler is constructed, so one process may
  record several engines by changing it in between. A second scheduler in the
  same process with the same path, or a data-parallel rank other than 0, writes
  to the path with ``.dp<rank>``/``.pid<pid>`` inserted before the extension.
* The trace is closed (End record) by ``Scheduler.shutdown`` and, failing that,
  at process exit.
* Every worker-side connector vLLM's factory makes is watched for the KV
  audit's plans (``kv_shard.install_factory_hook``): a worker in a process of
  its own (tensor parallelism) digests its shard there.
* With ``KVTRACE_RING`` (a directory of segments, ``kvtrace.flight``), an
  exception out of vLLM's stat loggers in the front end (Prometheus'
  ``Counters can only be incremented by non-negative amounts``) asks the
  engine's writer process to pin its segments (``record.folder.ask_pin``);
  the exception goes on as it came.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.engine.core import EngineCore

logger = logging.getLogger("kvtrace.record")

_PATCHED_ATTR = "_kvtrace_wrapped"


def register() -> None:
    if not os.environ.get("KVTRACE_OUT"):
        return
    try:
        install()
    except Exception:
        logger.exception("kvtrace: could not install the recording hook; vLLM runs unrecorded")


def install() -> bool:
    """Patch ``SchedulerConfig.get_scheduler_cls``. Returns False if already done."""
    from vllm.config.scheduler import SchedulerConfig

    orig = SchedulerConfig.get_scheduler_cls
    if getattr(orig, _PATCHED_ATTR, False):
        return False

    def get_scheduler_cls(self: SchedulerConfig, *args: object,
                          **kwargs: object) -> type[SchedulerInterface]:
        base = orig(self, *args, **kwargs)
        if not os.environ.get("KVTRACE_OUT"):
            return base
        try:
            from kvtrace.record.vllm.hooks import make_recording_scheduler

            _hook_engine_shutdown()
            return make_recording_scheduler(base)
        except Exception:
            logger.exception("kvtrace: could not wrap %r; vLLM runs unrecorded", base)
            return base

    setattr(get_scheduler_cls, _PATCHED_ATTR, True)
    get_scheduler_cls.__wrapped__ = orig  # type: ignore[attr-defined]
    get_scheduler_cls.__doc__ = orig.__doc__
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    try:
        _hook_metrics()
    except Exception:
        logger.exception("kvtrace: could not watch vLLM's metrics; a metrics error pins nothing")
    try:
        from kvtrace.record.vllm.kv_shard import install_factory_hook

        install_factory_hook()
    except Exception:
        logger.exception("kvtrace: could not watch the connectors' worker sides; no KV audit "
                         "in processes of their own")
    return True


def _hook_metrics() -> None:
    """Watch ``StatLoggerManager.record``, where vLLM's front end hands each
    step's stats to its stat loggers (vllm/v1/engine/llm_engine.py,
    async_llm.py's output handler). When it raises, a ring's writer process
    is asked to pin its segments, and the exception is raised again, the
    same object: the caller sees what it saw before (its traceback holds
    one frame more, this wrapper's)."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    orig = StatLoggerManager.record
    if getattr(orig, _PATCHED_ATTR, False):
        return

    def record(self: object, *args: object, **kwargs: object) -> object:
        try:
            return orig(self, *args, **kwargs)
        except Exception as exc:
            rank = kwargs.get("engine_idx", args[3] if len(args) > 3 else None)
            metrics_failed(exc, rank)
            raise

    setattr(record, _PATCHED_ATTR, True)
    record.__wrapped__ = orig  # type: ignore[attr-defined]
    record.__doc__ = orig.__doc__
    StatLoggerManager.record = record


def metrics_failed(exc: BaseException, rank: object = None) -> None:
    """vLLM's metrics raised ``exc`` for the engine of data-parallel rank
    ``rank``: ask the writer process of each ring it records to pin its
    segments. Never raises."""
    try:
        from kvtrace.record.folder import ENV_RING, NoRecorder, ask_pin

        out = os.environ.get("KVTRACE_OUT")
        if not out or not os.environ.get(ENV_RING, "").strip():
            return
        why = " ".join(f"vLLM's metrics failed: {type(exc).__name__}: {exc}".split())
        for folder in recorded_folders(out, int(rank or 0)):
            try:
                pid = ask_pin(folder, why)
            except (NoRecorder, OSError):
                continue
            logger.warning("kvtrace: %s; asked the recorder (pid %d) to pin its segments in %s",
                           why, pid, folder)
    except Exception:
        logger.exception("kvtrace: asking the recorder to pin its segments failed")


def recorded_folders(out: str, rank: int) -> list[str]:
    """The segment directories that engines of data-parallel rank ``rank``
    record for ``KVTRACE_OUT=out``: ``out`` itself (rank 0), and those named
    with ``.dp<rank>``/``.pid<pid>`` (``recorder._destination``)."""
    import glob

    if rank:
        return sorted(glob.glob(glob.escape(out) + f".dp{rank}.pid*"))
    return [out, *sorted(glob.glob(glob.escape(out) + ".pid*"))]


def _hook_engine_shutdown() -> None:
    """Close traces at the start of ``EngineCore.shutdown``.

    The scheduler's own ``shutdown`` runs last, after the executor has waited for
    its workers; a front end that force-kills the engine core process (the API
    server does, right after SIGTERM) kills it before that point. Closing first
    writes the End record when there is still time; when there is not, an
    engine core killed while it held no request has its trace ended
    ``complete`` by the writer process (``ProcessSink.settled``). A shutdown while an
    exception leaves the engine (its busy loop raised, or the offline run did)
    ends the traces ``interrupted``, with that exception."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:
        return
    orig = EngineCore.shutdown
    if getattr(orig, _PATCHED_ATTR, False):
        return

    def shutdown(self: EngineCore, *args: object, **kwargs: object) -> None:
        try:
            from kvtrace.record.vllm.recorder import close_all, propagating_failure

            close_all(interrupted=propagating_failure())   # "interrupted" when the engine failed
        except Exception:
            logger.exception("kvtrace: closing traces at engine shutdown failed")
        return orig(self, *args, **kwargs)

    setattr(shutdown, _PATCHED_ATTR, True)
    shutdown.__wrapped__ = orig  # type: ignore[attr-defined]
    EngineCore.shutdown = shutdown
