"""Peak memory of reading one hostile line, beside the bound of
docs/reference/bad-input.md ("Safety of the read path"): a reader holds a
line to what its trace's header allows (kvtrace/trace/limits.py), and takes
at most about 28 times that while it gathers and decodes it.

Each case is the header of the embedded engine's shared-prefix trace and one
record, read by ``kvtrace replay --no-kv-check`` in a fresh process:

* ``arrival``: a 24 KB zstd file whose arrival holds 255 MB of ``1000,``
  (51 million token ids; the header's max_model_len is 512);
* ``groups``: a step whose ``more_groups`` is a list of empty lists as long as
  any record of the header may be (the costliest typed record known: 26 bytes
  of memory per byte of text).

    python -m bench.line_memory
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK = ("import re, sys\nfrom kvtrace import cli\n"
        "rc = cli.run(['replay', '--no-kv-check', sys.argv[1]])\n"
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "sys.exit(rc)\n")


def _peak(path: Path) -> tuple[int, int, str]:
    """(peak resident bytes, exit code, stderr) of a replay of ``path``."""
    p = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True,
                       cwd=ROOT, stdin=subprocess.DEVNULL)
    return int(p.stdout.strip().splitlines()[-1]) * 1024, p.returncode, p.stderr.strip()


def main() -> int:
    import zstandard

    from kvtrace.engine import record_embedded
    from kvtrace.trace.io import TraceReader
    from kvtrace.trace.limits import LineLimits

    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as tmp:
        d = Path(tmp)
        record_embedded(d / "base.jsonl", workload="shared-prefix")
        header = (d / "base.jsonl").read_bytes().split(b"\n", 1)[0] + b"\n"
        with TraceReader(d / "base.jsonl") as r:
            limits = LineLimits(r.header, 256 << 20)
        cases = []

        arrival = d / "arrival.jsonl.zst"
        with zstandard.ZstdCompressor(level=3).stream_writer(arrival.open("wb")) as z:
            z.write(header + b'{"kind":"arrival","seq":0,"req":"r","max_tokens":1,'
                             b'"prompt_token_ids":[')
            block = b"1000," * (1 << 18)
            for _ in range(255_000_000 // len(block)):
                z.write(block)
            z.write(b"1]}\n")
        cases.append(("arrival of 255 MB", arrival, limits.by_kind["arrival"]))

        n = (limits.general - 300) // 3
        groups = d / "groups.jsonl"
        groups.write_bytes(header + (d / "base.jsonl").read_bytes().split(b"\n")[1] + b"\n"
                           + b'{"kind":"step","seq":1,"step":0,"new":[{"req":"chat-0",'
                             b'"num_computed_tokens":0,"num_scheduled_tokens":0,"block_ids":[],'
                             b'"more_groups":[' + b"[]," * n + b"[]]}]}\n")
        cases.append(("step of empty lists", groups, limits.general))

        print(f"header: {limits.why}; lines held to {limits.by_kind['arrival']:,} bytes "
              f"(arrival), {limits.general:,} (any record)")
        for name, path, limit in cases:
            peak, rc, err = _peak(path)
            bound = 28 * limit + (64 << 20)   # the interpreter and kvtrace's imports
            print(f"{name:22} file {path.stat().st_size:>11,} B  exit {rc}  peak "
                  f"{peak / 1e6:7.1f} MB  (limit: 28 x {limit / 1e6:.1f} MB + 64 MB = "
                  f"{bound / 1e6:.0f} MB: {'met' if peak <= bound else 'MISSED'})")
            if err:
                print(f"  {err[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
