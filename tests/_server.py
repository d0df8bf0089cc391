"""A vLLM OpenAI server started by a test: a free port, a request, its
health, and its stop (Ctrl-C, as in the terminal that runs it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> dict:
    """A completion request's answer."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """Until the server answers /health; fails with its log's end if it exits."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group; SIGKILL (and a failure) when it
    has not exited after 120 s."""
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        raise
