"""vLLM releases installed beside the one this environment imports, to drive
their schedulers model-free (``kvtrace.lab.model_free``).

A release lives in a folder of its own: its wheel installed with ``pip
install --no-deps --target DIR``, with the few packages it needs in other
versions than this environment's, and put first on ``PYTHONPATH`` in a
process of its own. ``.ci/release-env VERSION DIR`` builds one.
``KVTRACE_VLLM_RELEASES`` names them: ``0.33.0=/path/a,0.18.1=/path/b``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ENV = "KVTRACE_VLLM_RELEASES"


def configured() -> dict[str, str]:
    """{version: folder} of the releases ``KVTRACE_VLLM_RELEASES`` names."""
    out = {}
    for part in filter(None, (os.environ.get(ENV) or "").split(",")):
        version, sep, folder = part.partition("=")
        if not sep or not version.strip() or not folder.strip():
            raise ValueError(f"{ENV}: {part!r} is not VERSION=FOLDER")
        out[version.strip()] = folder.strip()
    return out


def environment(folder: str) -> dict[str, str]:
    """The environment of a process that imports the release in ``folder``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    env["VLLM_TARGET_DEVICE"] = "cpu"   # no kernel runs: the platform only builds configs
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("KVTRACE_OUT", None)
    return env


def record(folder: str, jobs: list[dict], out_dir: str, check_vllm: bool = True,
           timeout: float | None = None) -> list[dict]:
    """Record ``jobs`` (see ``kvtrace.lab.release_jobs.main``) on the release in ``folder``,
    in one process; each job's result, in order. A job the process never
    reported (it died) comes back with its error."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    try:
        argv = [sys.executable, "-m", "kvtrace.lab.release_jobs", f.name, out_dir]
        if not check_vllm:
            argv.append("--no-check")
        p = subprocess.run(argv, env=environment(folder), capture_output=True, text=True,
                           timeout=timeout)
    finally:
        os.unlink(f.name)
    done = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            done[res["name"]] = res
    tail = " ".join(p.stderr.strip().splitlines()[-3:])[-500:]
    return [done.get(job["name"], {"name": job["name"], "path": None, "vllm_agrees": None,
                                   "error": f"the recording process ended ({p.returncode}): {tail}"})
            for job in jobs]
