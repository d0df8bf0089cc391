"""Replay time against trace length: a 4x longer trace of the same workload.

    python -m bench.scaling                  # 12,500 and 50,000 requests
    python -m bench.scaling --full           # 50,000 and 200,000 (346,533 steps)
    python -m bench.scaling --requests N [--rounds R] [--worker] [--dir D]

The embedded engine records its default workload (``shared-prefix``, as
``kvtrace record --requests N`` does) at N and 4N requests. Requests arrive
faster than the engine serves them, so the waiting queue grows all along the
trace: a cost per step that grows with it shows as a ratio above 4x. Each
trace is replayed with the shadow-KV check and without it, in one process
(``--worker``: the check, or the record checks, in a worker process too, for
both traces), each replay a fresh interpreter, ``--rounds`` times in turns,
the fastest kept.

The figure is the CPU time of the replay's processes (main and workers):
this machine is shared, and its wall clock moves with the load of others.
The wall clock is printed beside it. The limit: the long trace's replay with
the check takes at most 4.5x the short one's. The same ratio without the
check, and the steps' ratio, are printed for comparison, and the time per
step in each half of the long trace, which stays flat when nothing grows
with the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LIMIT = 4.5

_RECORD = """
import json, sys, time
from kvtrace.engine import build_workload, record_workload
t = time.perf_counter()
res = record_workload(sys.argv[1], build_workload("shared-prefix", 0, int(sys.argv[2])))
print(json.dumps({"seconds": time.perf_counter() - t, "steps": res.steps}))
"""

# One replay: CPU time of this process and of its ended workers; and this
# process's CPU time since the start at each progress call, the last one and
# the one nearest the trace's middle step.
_REPLAY = """
import json, resource, sys, time
from kvtrace.replay import replay_file
path, kv, worker = sys.argv[1], sys.argv[2] == "kv", int(sys.argv[3])
def cpu():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime
marks = []
t, c, own = time.perf_counter(), cpu(), time.process_time()
r = replay_file(path, device="cpu" if kv else None, worker=worker,
                progress=lambda n: marks.append((n, time.process_time() - own)))
wall, c = time.perf_counter() - t, cpu() - c
assert not r.divergences, r.divergences[0]
mid = min(marks, key=lambda m: abs(m[0] - r.steps // 2), default=None)
print(json.dumps({"wall": wall, "cpu": c, "steps": r.steps, "mid": mid,
                  "last": marks[-1] if marks else None}))
"""


def _python(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE), KVTRACE_QUIET="1")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=HERE, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"bench.scaling: a child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def record(out: Path, requests: int) -> dict:
    r = _python(_RECORD, str(out), str(requests))
    r["bytes"] = out.stat().st_size
    return r


def replay(trace: Path, kv: bool, worker: int) -> dict:
    return _python(_REPLAY, str(trace), "kv" if kv else "no", str(worker))


def run(requests: int = 12_500, rounds: int = 1, worker: bool = False,
        work: Path | None = None) -> dict:
    """Record the workload at ``requests`` and 4x as many, replay both; returns
    the figures (``report`` prints them)."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix="kvtrace-scaling-") as tmp:
            return run(requests, rounds, worker, Path(tmp))
    work.mkdir(parents=True, exist_ok=True)
    sizes = {"short": requests, "long": 4 * requests}
    traces = {k: work / f"shared-prefix-{n}.jsonl.zst" for k, n in sizes.items()}
    made = {k: record(traces[k], sizes[k]) for k in sizes}
    arms = [(kv, w) for kv in (True, False) for w in ((0, 1) if worker else (0,))]
    best: dict[tuple, dict] = {}
    for _ in range(rounds):
        for kv, w in arms:
            for k in sizes:
                r = replay(traces[k], kv, w)
                key = (k, kv, w)
                if key not in best or r["cpu"] < best[key]["cpu"]:
                    best[key] = r
    rows = []
    for kv, w in arms:
        short, long = best[("short", kv, w)], best[("long", kv, w)]
        mid_step, mid_cpu = long["mid"] or (0, 0.0)
        last_step, last_cpu = long["last"] or (0, 0.0)
        rows.append({
            "kv": kv, "worker": w,
            "short": short, "long": long,
            "cpu_ratio": long["cpu"] / short["cpu"], "wall_ratio": long["wall"] / short["wall"],
            # Time per step of the main process in each half of the long trace.
            "first_half_us": mid_cpu / mid_step * 1e6 if mid_step else None,
            "second_half_us": (last_cpu - mid_cpu) / (last_step - mid_step) * 1e6
            if last_step > mid_step else None,
        })
    return {"requests": sizes, "traces": {k: str(v) for k, v in traces.items()},
            "made": made, "rounds": rounds, "rows": rows, "limit": LIMIT}


def report(r: dict) -> str:
    made, n = r["made"], r["requests"]
    steps = made["long"]["steps"] / made["short"]["steps"]
    out = [f"replay time against trace length: shared-prefix workload, {n['short']:,} and "
           f"{n['long']:,} requests ({made['short']['steps']:,} and {made['long']['steps']:,} "
           f"steps, {steps:.2f}x; {made['short']['bytes'] / 1e6:.1f} and "
           f"{made['long']['bytes'] / 1e6:.1f} MB of zstd), fastest of {r['rounds']} round(s)"]
    for row in r["rows"]:
        what = ("with the shadow-KV check" if row["kv"] else "without the check") + \
               (", with a worker" if row["worker"] else ", one process")
        s, lg = row["short"], row["long"]
        halves = ""
        if row["first_half_us"] and row["second_half_us"]:
            halves = (f"; long trace, main process: {row['first_half_us']:.0f} us/step in its "
                      f"first half, {row['second_half_us']:.0f} in its second")
        limit = f"   [limit <= {r['limit']}x: {'met' if row['cpu_ratio'] <= r['limit'] else 'MISSED'}]" \
            if row["kv"] else "   [for comparison]"
        out.append(f"  replay {what}: CPU {s['cpu']:.1f} s -> {lg['cpu']:.1f} s = "
                   f"{row['cpu_ratio']:.2f}x (wall {s['wall']:.1f} s -> {lg['wall']:.1f} s = "
                   f"{row['wall_ratio']:.2f}x){halves}{limit}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scaling",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=None,
                    help="the short trace's requests (default 12,500; the long one has 4x)")
    ap.add_argument("--full", action="store_true", help="50,000 and 200,000 requests")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--worker", action="store_true",
                    help="also replay with a worker process, both traces")
    ap.add_argument("--dir", default=None,
                    help="where to write the traces, and keep them (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = ap.parse_args(argv)
    n = args.requests or (50_000 if args.full else 12_500)
    r = run(n, args.rounds, args.worker, Path(args.dir) if args.dir else None)
    print(json.dumps(r) if args.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
