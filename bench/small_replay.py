"""A small trace's replay with the shadow-KV check, next to its limits.

    python -m bench.small_replay [--runs 10] [--trace PATH]

The common case is a small trace: there the check's own work takes
milliseconds, and what costs is starting up. Each run is a fresh ``kvtrace
replay`` process, timed from outside (wall clock). Measured in the same run,
in turns, ``--runs`` times each:

* ``kvtrace replay TRACE`` (the check as ``--device auto`` places it);
* ``kvtrace replay --no-kv-check TRACE``: the limit, replay without the check;
* ``python -c "import kvtrace.cli"``: the floor, the interpreter and the CLI;
* ``python -c "import torch"`` once per run too, for what the check would
  add if it imported torch.

It prints the median of each, and the check's cost: the median replay with
the check less the median replay without it. The trace is the embedded
engine's ``shared-prefix`` workload (65 steps), recorded first, unless
``--trace`` names one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _time(cmd: list[str]) -> float:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if p.returncode not in (0, 1):   # 1: the trace diverges, still a whole replay
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return dt


def run(runs: int = 10, trace: str | None = None) -> dict:
    py = sys.executable
    if trace is None:
        trace = str(Path(tempfile.mkdtemp(prefix="kvtrace-small-")) / "s.jsonl.gz")
        from kvtrace.engine import record_embedded

        record_embedded(trace, workload="shared-prefix", seed=0)
    cli = [py, "-c", "from kvtrace.cli import main; raise SystemExit(main())"]
    arms = {
        "check": cli + ["replay", trace],
        "no_check": cli + ["replay", "--no-kv-check", trace],
        "import_cli": [py, "-c", "import kvtrace.cli"],
        "import_torch": [py, "-c", "import torch"],
    }
    _time(arms["check"])   # warm the page cache
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(runs):
        for name, cmd in arms.items():
            times[name].append(_time(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    probe = subprocess.run(cli[:2] + [
        "import sys; from kvtrace.replay import replay_file; "
        f"r = replay_file({trace!r}); print(r.steps, r.slots_checked, r.device, "
        "'torch' in sys.modules)"], capture_output=True, text=True, cwd=HERE.parent)
    steps, slots, device, torch_seen = probe.stdout.split()
    return {"trace": trace, "runs": runs, "steps": int(steps), "slots": int(slots),
            "device": device, "torch_imported": torch_seen == "True",
            "median": med, "spread": {k: (min(v), max(v)) for k, v in times.items()}}


def report(r: dict) -> str:
    m, s = r["median"], r["spread"]
    check_cost = m["check"] - m["no_check"]
    rows = [
        ("replay with the check", m["check"], s["check"], "well under 1 s"),
        ("replay --no-kv-check", m["no_check"], s["no_check"], "the limit"),
        ("python -c 'import kvtrace.cli'", m["import_cli"], s["import_cli"], "the floor"),
        ("python -c 'import torch'", m["import_torch"], s["import_torch"], "not paid"),
    ]
    out = [f"small replay: {r['steps']} steps, {r['slots']:,} slots checked on "
           f"{r['device']}, torch imported: {'yes' if r['torch_imported'] else 'no'}",
           f"median of {r['runs']} fresh processes each, in turns (min-max):"]
    for name, t, (lo, hi), limit in rows:
        out.append(f"  {name:<32} {t:6.3f} s  ({lo:.3f}-{hi:.3f})   [{limit}]")
    out.append(f"  the check's cost: {check_cost * 1e3:+.0f} ms = {m['check'] / m['no_check']:.2f}x "
               f"replay without it")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.small_replay",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = ap.parse_args(argv)
    r = run(args.runs, args.trace)
    print(json.dumps(r) if args.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
