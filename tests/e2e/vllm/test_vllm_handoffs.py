"""A fleet of prefill and decode engines, each vLLM 0.32's own with
NixlConnector (model-free: the NIXL library is not here,
kvtrace.lab.model_free's TransferWorker completes its transfers), recorded in
one process by kvtrace.lab.release_jobs: three prefill engines running
pd-prefill, one decode engine sent what the first two handed over, another
what the third did. ``kvtrace diff`` pairs every handoff across the five
traces; a planted bad one is named with its two traces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests._require import require

require("vllm", "the vLLM recorder needs vLLM")

from kvtrace import cli  # noqa: E402
from tests.mini_traces import load_records, save_records  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet")
    jobs = [{"name": "prefill-a", "workload": "pd-prefill"},
            {"name": "prefill-b", "workload": "pd-prefill"},
            {"name": "prefill-c", "workload": "pd-prefill"},
            {"name": "decode-x", "handoff_from": ["prefill-a", "prefill-b"]},
            {"name": "decode-y", "handoff_from": "prefill-c"}]
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(out / "vllm"))
    env.pop("KVTRACE_OUT", None)
    (out / "traces").mkdir()
    p = subprocess.run([sys.executable, "-m", "kvtrace.lab.release_jobs", "--no-check",
                        str(out / "jobs.json"), str(out / "traces")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [r["error"] for r in results] == [None] * len(jobs), results
    return out / "traces"


def _diff(capsys, *argv) -> tuple[int, dict]:
    code = cli.run(["diff", "--json", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, orjson.loads(out)


def test_every_handoff_of_the_fleet_pairs_across_its_traces(fleet, capsys):
    code, doc = _diff(capsys, *sorted(fleet.iterdir()))
    assert code == 0, doc["divergences"][:3]
    roles = {Path(t["path"]).name[:-len(".jsonl.gz")]: (t["role"], t["handed_over"], t["pulls"])
             for t in doc["traces"]}
    assert roles == {"prefill-a": ("prefill", 8, 0), "prefill-b": ("prefill", 8, 0),
                     "prefill-c": ("prefill", 8, 0), "decode-x": ("decode", 0, 16),
                     "decode-y": ("decode", 0, 8)}
    assert doc["summary"]["handoffs_compared"] == 24
    assert doc["summary"]["unread"] == {} and doc["summary"]["unknown"] == {}


def test_a_bad_handoff_is_named_with_its_decode_and_prefill_traces(fleet, tmp_path, capsys):
    bad = tmp_path / "fleet"
    bad.mkdir()
    for p in fleet.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    b_ids = {r["req"] for r in load_records(fleet / "prefill-b.jsonl.gz")
             if r.get("kind") == "request_finished"}
    recs = load_records(fleet / "decode-x.jsonl.gz")
    arrival = next(r for r in recs if r.get("kind") == "arrival"
                   and r["kv_transfer_params"]["remote_request_id"] in b_ids)
    arrival["kv_transfer_params"]["remote_block_ids"] = [[13, 14, 15]]
    (bad / "decode-x.jsonl.gz").unlink()
    save_records(recs, bad / "decode-x.jsonl")
    code, doc = _diff(capsys, bad)
    (d,) = doc["divergences"]
    assert code == 1 and d["req"] == arrival["req"] and d["field"] == "remote_block_ids"
    assert (Path(d["decode_trace"]).name, Path(d["prefill_trace"]).name) == (
        "decode-x.jsonl", "prefill-b.jsonl.gz")
