"""Replay of many traces here (``-j``) and on a local Ray cluster (``--ray``),
next to each other.

    python -m bench.fleet [--items 200] [-j 0]

Links ``--items`` names to the traces under traces/, round and round, into a
temporary folder, and replays them with one command each, in a fresh process,
timed from outside (wall clock): ``kvtrace replay --json -j J`` (0: one
process per core) and ``kvtrace replay --json --ray``, which starts a local
Ray cluster with this machine's cores and shuts it down. Each runs on the
first name alone, then on them all. It prints:

* Ray's fixed cost: ``--ray`` on one trace less the replay here of it (the
  cluster's start and stop), beside its limit, 20 s;
* the time per trace of each, from the difference between all and one,
  beside the limit for Ray's: twice the time per trace here;
* whether the two reports of all are byte for byte the same, with the same
  exit code (the limit: they are).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_RUN = "import sys; from kvtrace.cli import main; sys.argv[0] = 'kvtrace'; main()"
FIXED_LIMIT_S = 20.0


def _replay(args: list[str], cwd: Path) -> tuple[float, int, bytes]:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _RUN, "replay", "--json", *args], cwd=cwd,
                       env=env, capture_output=True)
    dt = time.perf_counter() - t
    if p.returncode not in (0, 1):
        raise SystemExit(f"kvtrace replay {' '.join(args[:3])} ... exited {p.returncode}:\n"
                         f"{p.stderr.decode()[-2000:]}")
    return dt, p.returncode, p.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200, help="traces to replay (default: 200)")
    ap.add_argument("-j", type=int, default=0, help="processes here (default 0: one per core)")
    args = ap.parse_args(argv)
    if args.items < 2:
        ap.error("--items: 2 at least")
    stored = sorted((HERE / "traces").rglob("*.jsonl.gz"))
    with tempfile.TemporaryDirectory(prefix="kvtrace-fleet-") as tmp:
        names = []
        for i in range(args.items):
            name = f"{i:05d}-{stored[i % len(stored)].name}"
            (Path(tmp) / name).symlink_to(stored[i % len(stored)])
            names.append(name)
        here1 = _replay(["-j", str(args.j), names[0]], Path(tmp))
        ray1 = _replay([names[0], "--ray"], Path(tmp))
        here = _replay(["-j", str(args.j), *names], Path(tmp))
        ray = _replay([*names, "--ray"], Path(tmp))
    fixed = ray1[0] - here1[0]
    per_here = (here[0] - here1[0]) / (args.items - 1)
    per_ray = (ray[0] - ray1[0]) / (args.items - 1)
    same = ray[1:] == here[1:]
    print(f"{args.items} traces on {os.cpu_count()} cores: here (-j {args.j}) {here[0]:.2f} s, "
          f"--ray {ray[0]:.2f} s")
    rows = [("Ray's start and stop", f"{fixed:.2f} s", f"limit: {FIXED_LIMIT_S:.0f} s"),
            ("a trace here", f"{per_here * 1e3:.1f} ms", ""),
            ("a trace on Ray", f"{per_ray * 1e3:.1f} ms",
             f"limit: {2 * per_here * 1e3:.1f} ms, twice here"),
            ("same --json and exit code", "yes" if same else "NO", "limit: yes")]
    for label, figure, limit in rows:
        print(f"  {label:<27}{figure:>10}   {limit}".rstrip())
    return 0 if same and fixed <= FIXED_LIMIT_S and per_ray <= 2 * per_here else 1


if __name__ == "__main__":
    sys.exit(main())
