"""Split replay's speed: one long trace with keyframes, replayed serially and
split at its keyframes on -j 2 and on -j (every core) processes, with the
shadow-KV check and without it.

    python -m bench.split                        # 20,000 requests, a keyframe every 1,000 steps
    python -m bench.split --requests 5000 --every 500 --rounds 1
    python -m bench.split --trace T --jobs 2 4     # a trace with keyframes, made before

The trace is the embedded engine's steady serving run (bench/phases.py's
``scale_workload``: about eight requests running, preemptions now and then),
with a keyframe every ``--every`` steps (``kvtrace keyframes``). Each replay
is a fresh ``kvtrace replay --json`` process, timed by the wall clock, the
fastest of ``--rounds`` taken in turns; each split's JSON must be the serial
replay's, byte for byte (printed). Each speedup is printed beside its target
(at least 1.7x on 2 processes, 8x on 16) and the bounds measured in the same
run: the serial time over the processes, and what a split cannot share out:
the pass that finds the keyframes, the time the last piece spends skipping to
its keyframe, and, with the check, the content check of the whole trace,
which runs as one job. The machine's load average is printed beside each
timing: on a shared machine the wall clock moves with others' work.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {2: 1.7, 16: 8.0}   # processes -> the speedup to reach


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _cpu() -> float:
    """CPU seconds of this process's ended children and theirs (the pools')."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _replay(trace: Path, kv: bool, jobs: int | None) -> tuple[float, float, bytes, str]:
    """(wall seconds, CPU seconds of all its processes, the --json output,
    stderr) of one ``kvtrace replay``."""
    cmd = [sys.executable, "-m", "kvtrace.cli", "replay", str(trace), "--json",
           *([] if kv else ["--no-kv-check"]), *([] if jobs is None else ["-j", str(jobs)])]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t, c = time.perf_counter(), _cpu()
    out = subprocess.run(cmd, capture_output=True, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - t, _cpu() - c
    if out.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.decode()[-2000:]}")
    return wall, cpu, out.stdout, out.stderr.decode()


def _make(work: Path, requests: int, every: int) -> tuple[Path, dict]:
    from bench.phases import scale_workload
    from kvtrace.engine import record_workload
    from kvtrace.replay.keyframes import add_keyframes

    src, kf = work / f"scale-{requests}.jsonl.zst", work / f"scale-{requests}-kf.jsonl.zst"
    t = time.perf_counter()
    steps = record_workload(src, scale_workload(requests), counters="prefill_stats").steps
    made = time.perf_counter() - t
    t = time.perf_counter()
    keyframes, _ = add_keyframes(src, kf, every)
    return kf, {"steps": steps, "engine_s": made, "keyframes": keyframes,
                "keyframes_s": time.perf_counter() - t, "bytes": kf.stat().st_size}


_PIECES: dict[tuple, list[float]] = {}   # the pieces' lines -> each piece's CPU seconds


def _bounds(trace: Path, jobs: int, kv: bool) -> dict:
    """What a split on ``jobs`` processes cannot share out, and the CPU time
    of each of its jobs, timed here one at a time (process time, so that
    others' load does not count)."""
    from kvtrace.replay.split import check_content, plan_split, replay_piece
    from kvtrace.trace import TraceReader
    from kvtrace.trace.scan import keyframe_lines

    t = time.process_time()
    keyframe_lines(trace)
    scan = time.process_time() - t
    split = plan_split(str(trace), jobs, "cpu" if kv else None)
    t = time.process_time()
    with TraceReader(trace) as reader:
        reader.skip_to(split.pieces[-1].start)
        next(iter(reader))
    skip = time.process_time() - t
    key = tuple((p.start, p.end) for p in split.pieces)
    if key not in _PIECES:   # the same pieces with the check and without it
        _PIECES[key] = []
        for piece in split.pieces:
            t = time.process_time()
            replay_piece(piece)
            _PIECES[key].append(time.process_time() - t)
    content = None
    if kv:
        t = time.process_time()
        check_content(split.content)
        content = time.process_time() - t
    tasks = ([content] if kv else []) + _PIECES[key]
    ends = [0.0] * jobs   # the pool's order: each job to the first process free
    for task in tasks:
        ends[ends.index(min(ends))] += task
    return {"pieces": _PIECES[key], "scan": scan, "skip": skip, "content": content,
            "idle": scan + max(ends)}


def _main_cpu(trace: Path, kv: bool) -> float:
    """CPU seconds of a serial replay's own process (its workers, as it
    chooses them, not counted), in this process."""
    from kvtrace.replay import replay_file

    t = time.process_time()
    replay_file(trace, device="cpu" if kv else None)
    return time.process_time() - t


def _row(name: str, figure: str, limit: str = "") -> tuple[str, str, str]:
    return name, figure, limit


def measure(trace: Path, kv: bool, jobs_list: list[int], rounds: int) -> list[tuple]:
    """Rows: the serial replay, then each split, with their bounds."""
    best: dict[int | None, tuple[float, float]] = {}   # (wall, CPU) of the fastest
    loads: dict[int | None, list[str]] = {}
    outputs: dict[int | None, bytes] = {}
    notes: dict[int | None, str] = {}
    for _ in range(rounds):
        for jobs in (None, *jobs_list):
            before = _load()
            wall, cpu, out, err = _replay(trace, kv, jobs)
            best[jobs] = min(best.get(jobs, (wall, cpu)), (wall, cpu))
            loads.setdefault(jobs, []).append(f"{before} -> {_load()}")
            outputs[jobs], notes[jobs] = out, err.strip()
    what = "with the KV check" if kv else "without the KV check"
    serial, serial_cpu = best[None]
    main = _main_cpu(trace, kv)
    rows = [_row(f"serial replay, {what}",
                 f"{serial:.2f} s, CPU {serial_cpu:.2f} s (loads {'; '.join(loads[None])}); its "
                 f"main process alone, timed here: {main:.2f} s of CPU (its workers, if any, run "
                 "beside it: on idle cores, about its wall time)")]
    for jobs in jobs_list:
        b = _bounds(trace, jobs, kv)
        same = "the same JSON" if outputs[jobs] == outputs[None] else "A DIFFERENT JSON"
        floor = [f"serial / {jobs} = {serial / jobs:.2f} s",
                 f"finding the keyframes {b['scan']:.2f} s",
                 f"the last piece's skip to its keyframe {b['skip']:.2f} s"]
        if b["content"] is not None:
            floor.append(f"the content check of the whole trace, one job, {b['content']:.2f} s")
        floor.append(f"the pieces {min(b['pieces']):.2f}-{max(b['pieces']):.2f} s each (sum "
                     f"{sum(b['pieces']):.2f} s); all of these CPU times, one at a time; on "
                     f"{jobs} idle cores in the pool's order: {b['idle']:.2f} s = "
                     f"{main / b['idle']:.2f}x the serial main process's CPU time")
        target = TARGETS.get(jobs)
        wall, cpu = best[jobs]
        rows.append(_row(
            f"split, -j {jobs} ({len(b['pieces'])} pieces), {what}",
            f"{wall:.2f} s = {serial / wall:.2f}x the serial replay, {same}"
            f"{'; said: ' + notes[jobs] if notes[jobs] else ''}; CPU {cpu:.2f} s = "
            f"{cpu / serial_cpu:.2f}x the serial's (loads {'; '.join(loads[jobs])}); bounds: "
            f"{', '.join(floor)}", f">= {target}x" if target else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--every", type=int, default=1000, help="steps between keyframes")
    p.add_argument("--jobs", type=int, nargs="*", default=None,
                   help="processes to split on (default: 2 and every core)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-kv", action="store_true", help="only without the content check")
    p.add_argument("--dir", default=None, help="where to write the traces (default: a temp dir)")
    p.add_argument("--trace", type=Path, default=None,
                   help="replay this trace with keyframes instead of making one")
    a = p.parse_args(argv)
    jobs_list = a.jobs or sorted({2, os.cpu_count() or 1})
    t0 = time.perf_counter()
    if a.trace is None:
        work = Path(a.dir or tempfile.mkdtemp(prefix="kvtrace-split-"))
        work.mkdir(parents=True, exist_ok=True)
        trace, made = _make(work, a.requests, a.every)
        said = (f"{a.requests:,} requests, {made['steps']:,} steps, {made['keyframes']} "
                f"keyframes (every {a.every} steps), {made['bytes'] / 1e6:.1f} MB; the engine "
                f"{made['engine_s']:.1f} s, adding keyframes {made['keyframes_s']:.1f} s")
    else:
        trace, said = a.trace, f"{a.trace.stat().st_size / 1e6:.1f} MB"
    rows = [_row("trace", f"{trace}: {said}")]
    for kv in (False,) if a.no_kv else (False, True):
        rows += measure(trace, kv, jobs_list, a.rounds)
    width = max(len(r[0]) for r in rows)
    print(f"kvtrace split replay ({time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPU cores)")
    for name, figure, limit in rows:
        print(f"  {name:<{width}}  {figure}" + (f"   [target {limit}]" if limit else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
