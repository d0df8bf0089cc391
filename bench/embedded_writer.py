"""The embedded engine's wall time with the writer ``kvtrace record`` uses
(``kvtrace.record.step_writer``: each completed step handed to a writer
process, so that a kill loses none) beside the in-process ``TraceWriter``
(which held up to 1 MiB in the engine's process, lost to a kill).

The same workload is recorded with each, in turns, in this process, into a
plain, a gzip and a zstd file; each figure is the median of the runs, from
the call to the trace's file being whole (the writer process's start and
its last write included). The limit: the step writer takes at most 1.10
times the in-process writer's time.

    python -m bench.embedded_writer              # offload, 3,000 requests, 5 runs each
    python -m bench.embedded_writer --requests 500 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

LIMIT = 1.10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="offload")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)

    from kvtrace.engine import build_workload, record_workload
    from kvtrace.record.step_writer import StepWriter
    from kvtrace.trace.io import TraceWriter

    wl = build_workload(args.workload, 0, args.requests)
    writers = {"in-process": TraceWriter, "step writer": StepWriter}
    failed = False
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as tmp:
        for ext in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
            times: dict[str, list[float]] = {name: [] for name in writers}
            steps = 0
            for _ in range(args.runs):
                for name, opener in writers.items():
                    out = Path(tmp) / f"t{ext}"
                    t0 = time.perf_counter()
                    steps = record_workload(out, wl, open_writer=opener).steps
                    times[name].append(time.perf_counter() - t0)
            base, step = (statistics.median(times[n]) for n in writers)
            ratio = step / base
            failed |= ratio > LIMIT
            print(f"{ext:10} {steps:,} steps: in-process {base:.2f} s, step writer {step:.2f} s "
                  f"= {ratio:.2f}x (limit: {LIMIT:.2f}x: {'met' if ratio <= LIMIT else 'MISSED'}); "
                  f"runs {', '.join(f'{t:.2f}' for t in times['step writer'])} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
