"""Replay speed of a single-group trace against the code before KV-cache groups,
and of a hybrid trace beside it.

    git worktree add /tmp/kvtrace-before 4a3563f     # the code before groups
    python -m bench.groups --before /tmp/kvtrace-before [--requests 3000] [--rounds 5]

One trace of the bench's serving workload (one full-attention group) is
replayed, in one process, by this checkout and by the one at ``--before``, in
rounds that alternate which goes first, each replay in a fresh interpreter; with and without the
shadow-KV check. The same workload with Gemma 3's KV cache (a sliding-window
group of 64 tokens and a full-attention group) is replayed by this checkout for
comparison. Prints each median with the ratio to the code before: the limit
is 1.00x (no slower), read against the spread of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

_REPLAY = """
import json, sys, time
from kvtrace.replay import replay_file
t = time.perf_counter()
r = replay_file(sys.argv[1], device="cpu" if sys.argv[2] == "kv" else None, worker=False)
assert not r.divergences, r.divergences[0]
print(json.dumps({"seconds": time.perf_counter() - t, "steps": r.steps}))
"""


def _make(out: str, requests: int, hybrid: bool) -> None:
    code = f"""
import dataclasses
from bench.phases import scale_workload
from kvtrace.engine import record_workload
from kvtrace.engine.workloads import sliding_group
from kvtrace.reference import GroupSpec
wl = scale_workload({requests})
if {hybrid}:
    c = wl.config
    groups = (sliding_group(64, c.block_size, c.max_num_batched_tokens, c.max_model_len), GroupSpec())
    wl = dataclasses.replace(wl, config=dataclasses.replace(c, kv_groups=groups, num_blocks=2 * c.num_blocks))
record_workload({out!r}, wl, counters="prefill_stats")
"""
    subprocess.run([sys.executable, "-c", code], cwd=HERE, check=True)


def _replay(root: Path, trace: str, kv: bool) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _REPLAY, trace, "kv" if kv else "no"], cwd=root,
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"replay in {root} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a checkout of kvtrace before KV-cache groups")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    before = Path(a.before).resolve()
    with tempfile.TemporaryDirectory() as d:
        single, hybrid = f"{d}/single.jsonl.zst", f"{d}/hybrid.jsonl.zst"
        _make(single, a.requests, False)
        _make(hybrid, a.requests, True)
        print(f"{'replay (one process)':<40} {'now':>9} {'before':>9} {'now/before':>11}  "
              "limit")
        for kv in (False, True):
            now, then = [], []
            for i in range(a.rounds):   # each checkout first in every other round
                if i % 2:
                    now.append(_replay(HERE, single, kv))
                    then.append(_replay(before, single, kv))
                else:
                    then.append(_replay(before, single, kv))
                    now.append(_replay(HERE, single, kv))
            ratios = sorted(n / t for n, t in zip(now, then))
            what = "single group, " + ("shadow-KV check" if kv else "no content check")
            print(f"{what:<40} {statistics.median(now):8.2f}s {statistics.median(then):8.2f}s "
                  f"{statistics.median(ratios):10.3f}x  <= 1.00x (rounds {ratios[0]:.3f}-"
                  f"{ratios[-1]:.3f})")
            g = statistics.median(_replay(HERE, hybrid, kv) for _ in range(a.rounds))
            what = "Gemma 3's groups, " + ("shadow-KV check" if kv else "no content check")
            print(f"{what:<40} {g:8.2f}s {'':>9} {g / statistics.median(now):10.3f}x  "
                  "(of the single group now)")


if __name__ == "__main__":
    main()
