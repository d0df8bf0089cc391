"""A long recording on a bounded disk: the flight recorder's acceptance run.

The embedded engine records a long run (``--steps``, 1M by default) into a
ring (``kvtrace record --ring``: a directory of segments that never holds
more than ``--ring`` bytes). A fault is put in that fires only late in the
run (``--fault-at``, a fraction of the run's steps; ``none`` for a clean
run). Each segment is written by a writer process, as ``kvtrace record``
writes it.

Measured and checked, in the same run:

* the directory's size on disk, at every segment's end (the largest it gets:
  a segment ends, then the oldest are deleted before the next starts) and
  sampled every 20 ms besides, against the cap;
* every segment left, replayed alone (from its keyframe): those wholly
  before the fault's first change are clean;
* the pinned segments alone, copied into a directory of their own and
  replayed as one: the fault's first change (its step and request, from the
  engine's own fault log) is found there;
* the engine's steps per second with the ring, beside the same engine
  writing one whole trace without keyframes (``--baseline``).

    python -m bench.long_recording                      # 1M steps, 64 MB ring
    python -m bench.long_recording --steps 50000 --ring 4MB --segment 512KB
    python -m bench.long_recording --fault-at none      # a clean run

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS_PER_REQUEST = 13   # the offload workload's steps per request, about


def _late(fault_cls, first_step: int):
    """``fault_cls`` (StaleCachedOnPreempt) that changes nothing before
    ``first_step``: the engine runs clean until then."""
    from kvtrace.engine.scheduler import EngineScheduler

    class Late(fault_cls):
        def _record_lookup(self, r, num_local, num_external, load_async):
            if self.fault_log.step < first_step:
                return EngineScheduler._record_lookup(self, r, num_local, num_external,
                                                      load_async)
            return super()._record_lookup(r, num_local, num_external, load_async)

    Late.__name__ = f"stale-cached-on-preempt-from-step-{first_step}"
    return Late


class DiskWatch:
    """The directory's size: at each segment's end (``at_rotation``) and
    sampled by a thread."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.most = 0          # bytes, apparent size
        self.most_blocks = 0   # bytes, blocks allocated
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def measure(self) -> None:
        size = blocks = 0
        for p in list(self.folder.iterdir()):
            try:
                st = p.stat()
            except FileNotFoundError:   # deleted as we looked
                continue
            size += st.st_size
            blocks += st.st_blocks * 512
        self.most = max(self.most, size)
        self.most_blocks = max(self.most_blocks, blocks)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.measure()

    def __enter__(self) -> "DiskWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.measure()


def record(folder: Path, steps: int, ring: int, segment: int, fault_at: float | None,
           seed: int):
    """The run: (RecordResult, pins, DiskWatch, seconds)."""
    from kvtrace.engine import build_workload, record_workload
    from kvtrace.engine.faults import StaleCachedOnPreempt
    from kvtrace.flight import SegmentWriter
    from kvtrace.record.step_writer import open_step_writer

    wl = build_workload("offload", seed, max(1, steps // STEPS_PER_REQUEST))
    cls = None if fault_at is None else _late(StaleCachedOnPreempt, int(steps * fault_at))
    watch = DiskWatch(folder)
    said: list[str] = []

    class Watched(SegmentWriter):
        def _make_room(self):
            watch.measure()   # the finished segments, before the oldest go
            super()._make_room()

    def segments(path, header):
        return Watched(path, header, segment, ring, None, open_file=open_step_writer,
                       on_pin=said.append)

    t0 = time.perf_counter()
    with watch:
        res = record_workload(folder, wl, None, seed, open_writer=segments, scheduler_cls=cls)
    return res, said, watch, time.perf_counter() - t0


def baseline(path: Path, steps: int, seed: int) -> float:
    """Seconds for the same clean workload into one whole trace, no keyframes."""
    from kvtrace.engine import build_workload, record_workload
    from kvtrace.record.step_writer import open_step_writer

    wl = build_workload("offload", seed, max(1, steps // STEPS_PER_REQUEST))
    t0 = time.perf_counter()
    record_workload(path, wl, None, seed, open_writer=open_step_writer)
    return time.perf_counter() - t0


def replay_segment(path: Path):
    from kvtrace.replay import replay_file
    from kvtrace.replay.keyframes import first_keyframe, replay_from

    start = first_keyframe(path)
    if start is None:   # the run's first segment
        return replay_file(path, device=None)
    return replay_from(path, start)


def check(folder: Path, res, said: list[str], fault_at: float | None, scratch: Path) -> list[str]:
    """What failed, as lines; prints what it checked."""
    import orjson

    from kvtrace.flight.replay import replay_folder
    from kvtrace.flight.segments import PINS, segment_files
    from kvtrace.trace import TraceError

    failures = []
    first = res.fault_log[0] if res.fault_log else None
    if fault_at is not None and first is None:
        failures.append("the late fault never fired: raise --steps or lower --fault-at")
    left = segment_files(folder)
    clean = dirty = 0
    for path in left:
        try:
            r = replay_segment(path)
        except TraceError as e:
            failures.append(f"{path.name} cannot be replayed: {e}")
            continue
        if r.stopped_at is not None or r.truncation:
            failures.append(f"{path.name}: replay stopped ({r.stopped_at}, {r.truncation})")
        wholly_before = first is None or r.steps_in_trace <= first.step
        if r.divergences and wholly_before:
            d = r.divergences[0]
            failures.append(f"{path.name}: a divergence before any fault: step {d.step} "
                            f"{d.req} {d.field}")
        clean += not r.divergences
        dirty += bool(r.divergences)
    print(f"segments left:     {len(left)} of {len(left) + res_deleted(folder, left)} "
          f"written; replayed alone: {clean} clean, {dirty} with divergences")
    pins = orjson.loads((folder / PINS).read_bytes()) if (folder / PINS).exists() else {}
    print(f"pinned:            {', '.join(sorted(pins)) or 'none'}")
    for line in said:
        print(f"  said: {line}")
    if first is not None:
        alone = scratch / "pinned"
        alone.mkdir()
        for name in pins:
            if (folder / name).exists():
                shutil.copy2(folder / name, alone / name)
        found = replay_folder(alone).divergences if pins else []
        hit = [d for d in found if d.step == first.step and d.req == first.req]
        print(f"fault's first change: step {first.step}, request {first.req} "
              f"({len(res.fault_log)} changes in all)")
        if hit:
            d = hit[0]
            print(f"caught from the pinned segments alone: step {d.step}, {d.req}, {d.field} "
                  f"({d.rule.split(':')[0]}); {len(found)} divergences there")
        else:
            failures.append(f"the pinned segments alone do not show the fault's first change "
                            f"(step {first.step}, {first.req}): {len(found)} divergences")
    return failures


def res_deleted(folder: Path, left: list[Path]) -> int:
    """Segments written but deleted: the highest number minus those left."""
    from kvtrace.flight.segments import NAME

    if not left:
        return 0
    return int(NAME.match(left[-1].name).group(1)) - len(left)


def main(argv: list[str] | None = None) -> int:
    from kvtrace.commands._common import Size

    p = argparse.ArgumentParser(prog="python -m bench.long_recording",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1_000_000, help="steps to record, about")
    p.add_argument("--ring", default="64MB")
    p.add_argument("--segment", default=None, help="default: an eighth of the ring")
    p.add_argument("--fault-at", default="0.8",
                   help="the fault's first step, as a fraction of --steps; 'none': clean")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--baseline", action="store_true",
                   help="also time the same run into one whole trace, without keyframes")
    p.add_argument("--keep", type=Path, default=None,
                   help="record into this (new) directory, and keep it")
    a = p.parse_args(argv)
    size = Size()
    ring = size.convert(a.ring, None, None)
    segment = size.convert(a.segment, None, None) if a.segment else ring // 8
    fault_at = None if a.fault_at == "none" else float(a.fault_at)

    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-long-"))
    folder = a.keep or scratch / "ring"
    folder.mkdir(parents=True, exist_ok=False)
    try:
        res, said, watch, secs = record(folder, a.steps, ring, segment, fault_at, a.seed)
        print(f"recorded:          {res.steps:,} steps, {res.requests:,} requests in {secs:.0f} s "
              f"({res.steps / secs:,.0f} steps/s), ring {ring:,} B, segment {segment:,} B")
        if a.baseline:
            whole = baseline(scratch / "whole.jsonl.gz", a.steps, a.seed)
            print(f"same run, one whole trace, no keyframes: {whole:.0f} s "
                  f"(the ring costs {secs / whole:.2f}x)")
        print(f"disk, most held:   {watch.most:,} B apparent, {watch.most_blocks:,} B in blocks "
              f"({watch.samples:,} looks); cap {ring:,} B")
        failures = []
        if max(watch.most, watch.most_blocks) > ring:
            failures.append(f"the directory held {max(watch.most, watch.most_blocks):,} B, "
                            f"over its cap of {ring:,}")
        failures += check(folder, res, said, fault_at, scratch)
    finally:
        if a.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    for f in failures:
        print(f"FAILED: {f}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
