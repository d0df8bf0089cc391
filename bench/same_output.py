"""Whether this checkout's ``kvtrace replay --json`` is byte for byte the one of
the code at ``--before``, on every trace under traces/.

    git worktree add /tmp/kvtrace-before <rev>
    python -m bench.same_output --before /tmp/kvtrace-before [-j 2]

Each trace of this checkout is replayed by both codes, each in a fresh
interpreter, from this checkout's folder (the paths in the output are the
same). Prints the traces compared, the identical ones beside the limit (all of
them), and the first lines that differ for each one that is not.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_RUN = "import sys; from kvtrace.cli import main; sys.argv[0] = 'kvtrace'; main()"


def _replay(root: Path, trace: Path) -> tuple[int, bytes]:
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="80")
    p = subprocess.run([sys.executable, "-P", "-c", _RUN, "replay", "--json", str(trace.relative_to(HERE))],
                       cwd=HERE, env=env, capture_output=True)
    return p.returncode, p.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.same_output", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the code before")
    ap.add_argument("-j", type=int, default=2, help="replays at once")
    ap.add_argument("--under", default="traces", help="the folder of traces (default: traces)")
    args = ap.parse_args(argv)
    traces = sorted(p for p in (HERE / args.under).rglob("*.jsonl*") if p.is_file())
    jobs = [(root, t) for t in traces for root in (args.before.resolve(), HERE)]
    with ThreadPoolExecutor(args.j) as pool:
        done = list(pool.map(lambda job: _replay(*job), jobs))
    same, differ, empty = 0, [], 0
    for i, t in enumerate(traces):
        before, after = done[2 * i], done[2 * i + 1]
        empty += not after[1].strip()
        if before == after and after[1].strip():
            same += 1
        else:
            differ.append((t, before, after))
    print(f"traces compared: {len(traces)} ({empty} printed nothing: counted as differing)")
    print(f"--json byte-identical (and the same exit code): {same}   limit: {len(traces)}"
          f"   {'met' if same == len(traces) else 'NOT met'}")
    for t, (ca, a), (cb, b) in differ:
        print(f"\n{t.relative_to(HERE)}: exit {ca} before, {cb} now")
        lines = difflib.unified_diff(a.decode(errors="replace").splitlines(),
                                     b.decode(errors="replace").splitlines(), "before", "now", lineterm="", n=0)
        for line in list(lines)[:12]:
            print("  " + line[:200])
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
