"""The writer process outside the engine's process tree, and the lock by which
whoever started the engine waits for the trace to be whole."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from kvtrace.trace.files import split_trace_name
from kvtrace.workers.child import child_env

logger = logging.getLogger("kvtrace.record")


class Detached:
    """A writer process that is not the engine's child. ``start`` runs
    ``argv`` (the writer's ``--detach`` mode), which forks the writer and
    exits, saying the writer's pid: the writer is left to init, outside the
    engine's process tree, where a shutdown that kills the tree does not reach
    it. Not a child, it is waited for on its connection, ``sock``: just
    before it exits, the writer sends its exit status there, as one line.
    Nothing here waits on the engine's thread: the launcher is reaped, and
    the writer's pid read, by the sink's writer thread (``reap``)."""

    def __init__(self, launcher: subprocess.Popen, sock: socket.socket):
        self._launcher = launcher
        self._reaping = threading.Lock()
        self._pid: int | None = None
        self._sock = sock
        self.returncode: int | None = None

    @classmethod
    def start(cls, argv: list[str], theirs: socket.socket, fds: tuple[int, ...],
              sock: socket.socket) -> "Detached":
        launcher = subprocess.Popen(argv, stdin=theirs.fileno(), stdout=subprocess.PIPE,
                                    pass_fds=fds, close_fds=True, env=child_env(),
                                    start_new_session=True)
        return cls(launcher, sock)

    def reap(self) -> None:
        """Read the writer's pid from the launcher, and reap the launcher."""
        launcher = self._launcher
        with self._reaping:
            if launcher.stdout is not None and not launcher.stdout.closed:
                said = launcher.stdout.readline()
                launcher.stdout.close()
                if said.strip().isdigit():
                    self._pid = int(said)
            launcher.wait()

    @property
    def pid(self) -> int | None:
        """The writer's pid (None when it did not start)."""
        if self._pid is None:
            self.reap()
        return self._pid

    def poll(self) -> int | None:
        """The writer's exit status once it has said it (None while it runs or
        when it died without a word)."""
        if self.returncode is None:
            try:
                said = self._sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                return None
            if said.endswith(b"\n"):
                self.returncode = int(said)
        return self.returncode

    def ended(self) -> bool:
        """Whether the writer has ended, with a word or without (killed)."""
        if self.returncode is not None:
            return True
        try:
            said = self._sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return not said or said.endswith(b"\n")

    def kill(self) -> None:
        if self.pid is not None and self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status, once it has finished; None when it ended without
        one (killed). Raises TimeoutExpired after ``timeout`` seconds."""
        said = b""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not said.endswith(b"\n"):
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not select.select([self._sock], [], [], left)[0]:
                raise subprocess.TimeoutExpired("kvtrace writer", timeout)
            try:
                chunk = self._sock.recv(64)
            except OSError:   # reset: it died with lines unread
                return None
            if not chunk:
                return None
            said += chunk
        self.returncode = int(said)
        return self.returncode


def hold_lock(fd: int) -> None:
    """Take an exclusive lock on the trace file open as ``fd``, so that whoever
    started the engine can wait for the file to be whole (``wait_for_writers``).
    The lock belongs to the open file, shared by every descriptor of it, the
    writer process's included. Where locks do not work, nothing."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def wait_for_writers(path: str | os.PathLike, timeout: float = 60.0) -> None:
    """Wait until no writer process still writes the trace ``path``, or the
    traces named after it for further schedulers (``.dp1``, ``.pid123``, ...):
    each holds a lock on its file while it writes. A writer is detached from
    the engine, so it may finish after the engine's processes have exited."""
    p = Path(path)
    stem, ext = split_trace_name(p.name)
    paths = [p, *p.parent.glob(f"{stem}.*{ext}")] if p.parent.is_dir() else [p]
    deadline = time.monotonic() + timeout
    for trace in dict.fromkeys(paths):
        try:
            fd = os.open(trace, os.O_RDONLY)
        except OSError:
            continue
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.error("kvtrace: a writer process still writes %s", trace)
                        break
                    time.sleep(0.05)
                except OSError:   # no locks here
                    break
        finally:
            os.close(fd)
