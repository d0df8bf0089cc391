"""What kvtrace's own child processes (the trace writer, replay's workers) need."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path


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


def spawn(module: str, *args: str, share: int | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m module *args SHARE FD``, where FD is the writing end of a
    pipe for it to report on, and SHARE the descriptor ``share`` of this process
    (a file it is to read too), passed on under the same number, or "-". Returns
    the process and the reading end."""
    theirs, mine = os.pipe()[::-1]
    fds = (theirs,) if share is None else (theirs, share)
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, *args, "-" if share is None else str(share),
                                 str(theirs)], stdin=subprocess.DEVNULL, pass_fds=fds, env=child_env())
    except BaseException:
        os.close(mine)
        raise
    finally:
        os.close(theirs)
    return proc, Connection(mine, writable=False)


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
    """The main of a process ``spawn`` started: ``serve(*argv[:-1], conn)`` on the
    pipe's writing end, then the messages it returns, if the reader still listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the process that started it stops it
    *args, fd = argv
    conn = Connection(int(fd), readable=False)
    last = serve(*args, conn)
    try:
        for msg in last:
            conn.send(msg)
        conn.close()
    except OSError:   # the reader is gone
        pass
    return 0
