"""How fast ``kvtrace diff`` reads, beside what reading its inputs costs, all
measured in the same run on the same file, each phase in a fresh process
(bench/phases.py):

* JSON only: decompress and orjson-parse every line, keeping nothing;
* typed decode: decompress and decode every line into its event (msgspec, in C),
  without the checks across records;
* checked parse: the reader's events, every check passed (what diff reads);
* diff of the trace with itself, with worker processes as diff chooses them,
  and all in one process, in MB/s of trace text per input.

Each figure is wall time, and CPU time beside it: on a shared machine the
wall clock moves with others' load, the CPU time much less.

The target: diff at >= 50% of JSON only per input (diffing two inputs takes
no longer than JSON-decoding both). The limit printed beside it: the checked
parse of one input, which diff does for each.

    python -m bench.diff_speed --requests 2000     # the trace of python -m bench --quick
    python -m bench.diff_speed --trace run.jsonl.zst
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(phase: str, **kw) -> dict:
    """One phase in a fresh interpreter (bench/phases.py); it prints one JSON line."""
    out = subprocess.run([sys.executable, "-m", "bench.phases", phase, json.dumps(kw)],
                         cwd=HERE.parent, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description="kvtrace diff's speed beside reading its inputs")
    ap.add_argument("--requests", type=int, default=2000, help="the embedded engine's trace of "
                                                               "this many requests (default 2000)")
    ap.add_argument("--trace", default=None, help="a trace to diff instead")
    args = ap.parse_args()
    if args.trace:
        trace = args.trace
    else:
        trace = str(Path(tempfile.mkdtemp(prefix="kvtrace-diff-bench-")) / f"scale-{args.requests}.jsonl.zst")
        _child("engine", out=trace, requests=args.requests)
    size = _child("size", trace=trace)
    plain = size["plain_bytes"]
    raw = _child("json_only", trace=trace)
    dec = _child("decode_only", trace=trace)
    parses = [_child("parse", trace=trace)]
    dif = _child("diff", trace=trace, worker=None)
    parses.append(_child("parse", trace=trace))
    dif1 = _child("diff", trace=trace, worker=False)
    parses.append(_child("parse", trace=trace))
    parse_s = sorted(p["seconds"] for p in parses)[1]   # the median of three
    parse_cpu = sorted(p["cpu"] for p in parses)[1]
    parse_runs = ", ".join(f"{p['seconds']:.2f}" for p in parses)

    def mbs(seconds: float) -> float:
        return plain / seconds / 1e6

    def of_json(seconds: float) -> str:
        return f"{raw['seconds'] / seconds:.0%} of JSON only"

    rows = [
        ("trace", f"{size['requests']:,} requests, {size['steps']:,} steps, {plain / 1e6:,.1f} MB "
                  f"of trace text", ""),
        ("JSON only (decompress + orjson)", f"{raw['seconds']:.2f} s, {mbs(raw['seconds']):,.1f} MB/s; "
                                            f"CPU {raw['cpu']:.2f} s", ""),
        ("typed decode (msgspec, no checks across records)",
         f"{dec['seconds']:.2f} s, {mbs(dec['seconds']):,.1f} MB/s = {of_json(dec['seconds'])}", ""),
        ("checked parse (what diff reads of each input)",
         f"{parse_s:.2f} s, {mbs(parse_s):,.1f} MB/s = {of_json(parse_s)} (median of "
         f"{len(parses)} runs beside the diffs: {parse_runs} s); CPU {parse_cpu:.2f} s", ""),
    ]
    for title, d in ((f"diff (trace with itself), default: {dif['workers']} worker(s)", dif),
                     ("diff (trace with itself), all in one process", dif1)):
        rows.append((title, f"{d['seconds']:.2f} s, {mbs(d['seconds']):,.1f} MB/s per input = "
                            f"{of_json(d['seconds'])} per input, "
                            f"{2 * parse_s / d['seconds']:.0%} of parsing both inputs; CPU "
                            f"{d['cpu']:.2f} s + {d['worker_cpu']:.2f} s in workers = "
                            f"{raw['cpu'] / (d['cpu'] + d['worker_cpu']):.0%} of JSON only's "
                            f"CPU per input, {2 * parse_cpu / (d['cpu'] + d['worker_cpu']):.0%} "
                            f"of parsing both inputs (what diff adds to them: "
                            f"{d['cpu'] + d['worker_cpu'] - 2 * parse_cpu:.2f} s of CPU); peak "
                            f"{d['peak_rss'] / 2**20:,.0f} MB; limit: the checked parse of both "
                            f"inputs, {2 * parse_s:.2f} s in one process ({of_json(2 * parse_s)} "
                            f"per input), at best {parse_s:.2f} s on two cores "
                            f"({of_json(parse_s)} per input)", ">= 50% of JSON only per input"))
    width = max(len(r[0]) for r in rows)
    print(f"kvtrace diff speed ({trace})")
    for name, figure, limit in rows:
        print(f"  {name:<{width}}  {figure}" + (f"   [target {limit}]" if limit else ""))


if __name__ == "__main__":
    main()
