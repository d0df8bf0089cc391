"""When the record checks' worker pays: replay without the content check, in
one process and with one worker, on traces of growing size.

    python -m bench.record_worker [--requests 250,500,1000,2000] [--repeat 3]

Each trace is the embedded engine's scale workload (bench/phases.py) of that
many requests, written plain, gzip and zstd. Each is replayed ``--repeat``
times each way, in turns, with ``--no-kv-check``; the best of each is printed
beside its text size and the number of workers replay picks by itself
(``kvtrace.workers.policy.wanted``). A worker pays where its column is the
smaller. The limit is the other column of the same row: the same replay in
the other way.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import tempfile
import time
from pathlib import Path


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(requests: list[int], repeat: int = 3) -> list[dict]:
    import zstandard

    from bench.phases import engine
    from kvtrace.replay import replay_file
    from kvtrace.workers import wanted

    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    rows = []
    try:
        for n in requests:
            plain = scratch / f"t{n}.jsonl"
            engine(str(plain), n)
            text = plain.read_bytes()
            gz = scratch / f"t{n}.jsonl.gz"
            gz.write_bytes(gzip.compress(text, 6))
            zst = scratch / f"t{n}.jsonl.zst"
            zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(text))
            for path in (plain, gz, zst):
                times = {w: float("inf") for w in (0, 1)}
                for _ in range(repeat):   # in turns: the machine's drift touches both
                    for w in (0, 1):
                        times[w] = min(times[w], _seconds(
                            lambda: replay_file(path, device=None, worker=w)))
                rows.append({"requests": n, "file": path.name, "bytes": path.stat().st_size,
                             "text_bytes": len(text), "one_process_s": times[0],
                             "worker_s": times[1], "picked": wanted(path, content=False)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default="250,500,1000,2000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = run([int(x) for x in args.requests.split(",")], args.repeat)
    print("replay --no-kv-check: one process against one record worker (best of "
          f"{args.repeat})")
    print(f"{'file':<16}{'on disk':>9}{'text':>9}{'1 process':>11}{'worker':>9}"
          f"{'gain':>7}  picked")
    for r in rows:
        gain = 1 - r["worker_s"] / r["one_process_s"]
        print(f"{r['file']:<16}{r['bytes'] / 2**20:>7.1f}MB{r['text_bytes'] / 2**20:>7.1f}MB"
              f"{r['one_process_s']:>10.3f}s{r['worker_s']:>8.3f}s{gain:>7.0%}  "
              f"{'worker' if r['picked'] else 'one process'}")


if __name__ == "__main__":
    main()
