"""An LMCache server of a run's own, for the workloads that run vLLM with
LMCache's multi-process connector (``kvtrace.lab.lmcache_connectors``).

LMCache keeps its store in a server process (``lmcache server``): the store
outlives vLLM's prefix-cache reset, and the engine's worker copies KV bytes
to and from it (engine-driven transfers, the mode LMCache runs on a CPU).

``started_server(extra)`` starts one on free local ports, waits until it
answers its health check, and yields the connector's extra config with
``lmcache.mp.host`` and ``lmcache.mp.port`` filled in; on the way out (an
engine failure included) the server is stopped and reaped; it also stops
when the process that started it dies. Its output goes
to a log file, removed after a clean run and kept, and named, after a failure.
``extra["kvtrace.server"]`` holds the server's settings: ``chunk_size``
(tokens, a multiple of vLLM's block size), ``l1_size_gb``, ``shm`` (True:
transfers through a shared-memory segment; False: pickled over the request
channel).

LMCache is not imported here: the server runs in a process of its own, from
the Python running kvtrace, with the directory LMCache is installed in on its
path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("kvtrace.record")

SERVER_KEY = "kvtrace.server"
DEFAULTS = {"chunk_size": 32, "l1_size_gb": 0.25, "shm": True}


class LMCacheUnavailable(RuntimeError):
    """LMCache is not installed, or its server did not start."""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _lmcache_dir() -> str:
    """The directory LMCache is installed in (for the server's path)."""
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        raise LMCacheUnavailable("LMCache is not installed (pip install lmcache)")
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def server_command(port: int, http_port: int, chunk_size: int, l1_size_gb: float,
                   shm_name: str) -> list[str]:
    """``lmcache server`` on local ports with engine-driven transfers.
    Metrics are off: their exporter is an optional dependency."""
    return [sys.executable, "-m", "lmcache.cli.main", "server",
            "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
            "--shm-name", shm_name, "--disable-metrics"]


def _healthy(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _dies_with_parent():
    """What the server's process runs before it starts (Linux): a SIGTERM when
    the thread that started it ends, its process killed included, so that no
    server outlives its run. libc is loaded here, before the fork."""
    import ctypes
    import signal

    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server (its process group: it starts helper processes, multiprocessing's
    resource tracker among them) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def started_server(extra: dict, timeout: float = 120.0) -> Iterator[dict]:
    """Run an LMCache server while the block runs; yield ``extra`` with its
    address filled in (``lmcache.mp.host``, ``lmcache.mp.port``)."""
    settings = dict(DEFAULTS, **(extra.get(SERVER_KEY) or {}))
    port, http_port = _free_ports(2)
    # POSIX shared-memory names are short on some systems: the server
    # prefixes its own 16 characters.
    shm_name = f"kvt{port}" if settings["shm"] else ""
    fd, log = tempfile.mkstemp(prefix="kvtrace-lmcache-", suffix=".log")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_lmcache_dir(), env.get("PYTHONPATH")) if p)
    cmd = server_command(port, http_port, int(settings["chunk_size"]),
                         float(settings["l1_size_gb"]), shm_name)
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_dies_with_parent())
    ok = False
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(http_port):
            if proc.poll() is not None:
                raise LMCacheUnavailable(f"the LMCache server exited ({proc.returncode}) before "
                                         f"it was healthy; its log, {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise LMCacheUnavailable(f"the LMCache server was not healthy after {timeout:.0f} "
                                         f"s; its log, {log}:\n{_tail(log)}")
            time.sleep(0.25)
        logger.info("LMCache server on port %d (pid %d, log %s)", port, proc.pid, log)
        yield dict(extra, **{"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port})
        ok = True
    finally:
        _stop(proc)
        if ok:
            with contextlib.suppress(OSError):
                os.unlink(log)
        else:
            logger.warning("the LMCache server's log is in %s", log)
