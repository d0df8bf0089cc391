"""What kvtrace's own child processes (the trace writer, the content worker) need."""

from __future__ import annotations

import os
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
