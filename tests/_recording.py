"""Record a ``kvtrace.lab.run`` workload on a real vLLM engine in a
process of its own: after an engine with n-gram drafts (llvmlite) no other
engine of the same process starts, and a workload's grammar faults patch vLLM
for the life of its engine only."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

_RECORD = """
import sys
from kvtrace.lab.fault_schedulers import FAULTS
from kvtrace.lab.run import EngineFailed, record_vllm_offline
kw = {"scheduler_cls": FAULTS[sys.argv[3]]} if len(sys.argv) > 3 else {}
try:
    record_vllm_offline(None, sys.argv[2], sys.argv[1], **kw)
except EngineFailed as e:
    print("engine failed:", type(e.error).__name__)
"""


def record_apart(tmp_path: Path, workload: str, *fault: str) -> tuple[Path, str]:
    """The trace of ``workload`` (with the bug ``fault`` of FAULTS put back, if
    given), and what the recording process printed: ``engine failed: NAME``
    when the engine raised."""
    out = tmp_path / f"{workload}.jsonl.gz"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("KVTRACE_OUT", None)
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    p = subprocess.run([sys.executable, "-c", _RECORD, workload, str(out), *fault],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p.stdout


def replays_clean_through_both(out: Path, tmp_path: Path) -> None:
    """``out`` replays with no divergence through the reference, and vLLM's own
    scheduler, fed the same inputs, decides as the recorded engine did."""
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm
    from kvtrace.replay import replay_file

    assert replay_file(out, device="cpu", worker=0).divergences == []
    theirs = replay_through_vllm(out, tmp_path / "vllm.jsonl").out
    assert diff_files(out, theirs).divergences == []


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of trace ``src`` (gzip) at ``dst`` (plain), its records, as
    dicts, changed in place by ``change``."""
    import orjson

    objs = [orjson.loads(x) for x in gzip.decompress(src.read_bytes()).splitlines()]
    change(objs)
    dst.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    return dst
