"""What kvtrace's own child processes (the trace writer, replay's workers) need."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Sequence


def child_env() -> dict[str, str]:
    """The environment for a kvtrace child process (``python -m kvtrace...``), so
    that it imports kvtrace from where this process did. From a source tree, that
    tree goes first on its PYTHONPATH. An installed kvtrace is found in
    site-packages anyway, which then stays behind the user's own PYTHONPATH
    entries."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    if root in _site_dirs():
        return env
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _site_dirs() -> set[Path]:
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def spawn(module: str, *args: str, share: Sequence[int] = ()) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m module *args SHARE FD`` (its main is ``worker_main``),
    where FD is the writing end of a pipe for it to report on, and SHARE its
    copies of this process's descriptors ``share`` (for a worker: the trace and
    the scratch file of their shared end, ``TraceReader.share``), joined by
    commas, or "-". Returns the process and the reading end."""
    theirs, mine = os.pipe()[::-1]
    # The child's descriptors 0-2 are its standard streams: what it is to keep
    # goes above them, whatever numbers it has here (0 to 2 when this process
    # started with them closed).
    fds = [above_stdio(theirs)] + [above_stdio(fd) for fd in share]
    os.close(theirs)
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, *args,
                                 ",".join(map(str, fds[1:])) or "-", str(fds[0])],
                                stdin=subprocess.DEVNULL, pass_fds=fds, env=child_env())
    except BaseException:
        os.close(mine)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return proc, Connection(mine, writable=False)


def above_stdio(fd: int) -> int:
    """A copy of ``fd`` numbered 3 or above, closed on exec unless passed on."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


def stop(proc: subprocess.Popen, conn: Connection) -> None:
    """Stop a process ``spawn`` started, if it still runs, and reap it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()


def worker_main(serve, argv: list[str]) -> int:
    """The main of a process ``spawn`` started: ``serve(*args, share, conn)``, with
    the descriptors it shares (a tuple, or None) and the pipe's writing end,
    then the messages it returns, if the reader still listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the process that started it stops it
    *args, share, fd = argv
    conn = Connection(int(fd), readable=False)
    last = serve(*args, None if share == "-" else tuple(map(int, share.split(","))), conn)
    try:
        for msg in last:
            conn.send(msg)
        conn.close()
    except OSError:   # the reader is gone
        pass
    return 0
