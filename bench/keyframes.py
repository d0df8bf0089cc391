"""Keyframe equivalence: a replay from each keyframe of a trace reports exactly
what a replay of the whole trace reports from that step on.

For each trace: ``kvtrace keyframes`` puts a keyframe before every N-th step
(N chosen so that a trace gets about ``--per-trace`` of them), then the copy
is replayed whole and from each keyframe, both without the shadow-KV check
(a replay from a keyframe does not check KV contents). The two must give the
same divergences from the keyframe on (every field, in order), the same
steps, the same stop and the same truncation.

    python -m bench.keyframes                 # traces/ and 100 random runs
    python -m bench.keyframes --random 20 --per-trace 8
    python -m bench.keyframes --overhead      # what keyframes cost a recording
    python -m bench.keyframes --overhead --ring 64MB   # what a ring costs one

``--overhead`` times the recorder with keyframes against the recorder
without them. On both engines the flight recorder's writer process makes
the keyframes, beside the engine. The embedded engine (``kvtrace record
--keyframe-every``, ``--requests``): its own time, the time until the trace
is whole, and the limit, the writer process's work alone. A real vLLM engine
(the tiny model): three arms, each a fresh process recording the engine from
its start, so that every trace is one whole run (an engine whose recorder is
detached between rounds, as bench/recorder_overhead.py's, writes a trace that
does not replay, and the writer's replay would stop at once): a whole trace,
the same with KVTRACE_KEYFRAME_EVERY (or a ring), and a whole trace again, the
noise floor. The arms take turns; every flight recording must replay clean.
The target is a ratio of at most 1.03. With ``--ring SIZE`` both are timed with a ring of SIZE
(segments of an eighth of it: the writer process replays every record for
the segments' keyframes, checks the invariants and rotates) against the same
recorder writing a whole trace.

The random runs are embedded-engine recordings, a random seed each: half of
them a random fault on the workload that shows it, half a random workload
run clean; a quarter under async scheduling.
It prints, per source, the traces, keyframes and mismatches, the keyframes'
size beside the trace's, and the time to make them beside a replay's.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from kvtrace.record.folder import parse_size

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Checked:
    keyframes: int = 0
    mismatches: list[str] = field(default_factory=list)
    keyframe_bytes: int = 0
    trace_bytes: int = 0
    add_s: float = 0.0      # making the keyframes (a replay without the content check)
    replay_s: float = 0.0   # a whole replay of the copy, without the content check


def _steps(path: Path) -> int:
    from kvtrace.trace import TraceReader
    from kvtrace.trace import events as ev

    n = 0
    with TraceReader(path) as r:
        for e in r:
            if type(e) is ev.Step:
                n = e.step + 1
    return n


def _said(result) -> dict:
    return {"steps": result.steps, "steps_in_trace": result.steps_in_trace,
            "stopped": result.stopped,
            "stopped_at": None if result.stopped_at is None else result.stopped_at.to_json(),
            "truncation": result.truncation}


def _whole(path: Path):
    """The whole replay of ``path`` (no content check), as ``replay_file``
    runs it, and, for each keyframe's step, the divergences it had found
    when it reached that keyframe (their ids)."""
    from kvtrace import bridge
    from kvtrace.replay.replayer import Replayer
    from kvtrace.results import ReplayResult
    from kvtrace.trace import TraceReader
    from kvtrace.trace import events as ev

    before: dict[int, set[int]] = {}
    with TraceReader(path) as reader:
        header = reader.header
        profile = bridge.header_profile(header)[0]
        rp = Replayer(header, str(path), None, None, profile=profile)
        result = ReplayResult(path=str(path), header=header, profile=profile.name)
        for e in reader:
            if type(e) is ev.Keyframe:
                before[e.step] = {id(d) for d in rp.divergences}
            result.events += 1
            rp.feed(e, reader.last_line)
            if type(e) is ev.End:
                result.end = e
        rp.finish()
    rp.put_into(result, reader.truncation)
    return result, before


def check(src: Path, per_trace: int, tmp: Path) -> Checked:
    """Keyframes into a copy of ``src``, then each replay from one against the
    whole replay."""
    from kvtrace.replay import replay_file
    from kvtrace.replay.keyframes import add_keyframes, replay_from
    from kvtrace.trace import TraceReader
    from kvtrace.trace import events as ev

    out = Checked(trace_bytes=src.stat().st_size)
    every = max(1, _steps(src) // (per_trace + 1))
    copy = tmp / f"kf-{src.name}"
    t = time.perf_counter()
    add_keyframes(src, copy, every)
    out.add_s = time.perf_counter() - t
    t = time.perf_counter()
    whole, before = _whole(copy)
    out.replay_s = time.perf_counter() - t
    with TraceReader(copy) as r:
        for e in r:
            if type(e) is ev.Keyframe:
                out.keyframe_bytes += len(orjson.dumps(e.state))
    for k, earlier in before.items():
        part = replay_from(copy, k)
        # What the whole replay reports from the keyframe on: every divergence
        # it had not found when it reached the keyframe, in its order.
        want = [d.to_json() for d in whole.divergences if id(d) not in earlier]
        got = [d.to_json() for d in part.divergences]
        out.keyframes += 1
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                         min(len(got), len(want)))
            out.mismatches.append(f"{src}: from the keyframe at step {k}: {len(got)} "
                                  f"divergences, the whole replay {len(want)} from there; the "
                                  f"first that differs is #{first}")
        elif _said(part) != _said(whole):
            out.mismatches.append(f"{src}: from the keyframe at step {k}: {_said(part)} "
                                  f"!= {_said(whole)}")
    return out


def random_runs(n: int, seed: int, tmp: Path) -> list[Path]:
    """``n`` embedded-engine recordings of random workloads, faults and seeds."""
    from kvtrace.catalog import EMBEDDED_FAULT_WORKLOADS, EMBEDDED_FAULTS
    from kvtrace.engine import EngineStalled, record_embedded
    from kvtrace.engine.workloads import WORKLOADS

    rng = random.Random(seed)
    out = []
    for i in range(n):
        fault = rng.choice(sorted(EMBEDDED_FAULTS)) if rng.random() < 0.5 else None
        # a fault runs on the workload that shows it (a fault of one KV-cache
        # group's scheduler is not written for several)
        workload = EMBEDDED_FAULT_WORKLOADS[fault] if fault else rng.choice(sorted(WORKLOADS))
        path = tmp / f"random-{i}-{workload}-{fault or 'clean'}.jsonl.gz"
        try:
            record_embedded(path, workload, fault, seed=rng.randrange(2**32),
                            async_scheduling=rng.random() < 0.25)
        except EngineStalled:
            pass   # the trace up to the stall is written: replayed as it is
        except ValueError:
            continue   # a combination the engine refuses (a profile without async, say)
        out.append(path)
    return out


TARGET = 1.03


def embedded_overhead(every: int, ring: str | None, requests: int, runs: int = 3) -> None:
    """``kvtrace record``'s embedded engine, with keyframes (or a ring) and
    without: the engine's own time (to its last step handed on) and the
    time until the trace is whole, best of ``runs``. The limit: the flight
    writer process's work alone, in this process, over the same records."""
    from kvtrace.commands.record import Flight
    from kvtrace.engine import build_workload, record_workload
    from kvtrace.record.ring import DEFAULT_SIZE

    size = parse_size(ring) if ring else None
    cases = {"plain": Flight(None, None, None),
             "flight": Flight(None if size else every, size, size // 8 if size else None)}
    engine = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    whole = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as d:
        for i in range(runs):
            for name in ("plain", "flight") if i % 2 else ("flight", "plain"):
                marks: list[tuple[float, float]] = []
                opener = _marking(cases[name].writer(), marks)
                out = Path(d) / (f"{name}{i}" if name == "flight" and size else
                                 f"{name}{i}.jsonl.gz")
                t, c = time.perf_counter(), time.process_time()
                record_workload(out, build_workload("offload", i, requests), seed=i,
                                open_writer=opener)
                whole[name].append(time.perf_counter() - t)
                engine[name].append(marks[0][0] - t)
                cpu[name].append(marks[0][1] - c)
        alone = min(_writer_alone(Path(d) / "plain0.jsonl.gz", cases["flight"], Path(d) / f"a{k}")
                    for k in range(runs))
    (e0, e1), (c0, c1), (w0, w1) = ((min(x["plain"]), min(x["flight"]))
                                    for x in (engine, cpu, whole))
    what = f"a ring of {ring}" if size else f"a keyframe every {every} steps"
    print(f"embedded engine (kvtrace record), offload of {requests} requests, best of {runs}, "
          f"{what}:")
    print(f"  the engine's own time: {e0:.2f} s plain, {e1:.2f} s: {e1 / e0:.3f}x "
          f"(target <= {TARGET:.2f}); its process's CPU time {c0:.2f} s and {c1:.2f} s: "
          f"{c1 / c0:.3f}x (the wall clock also counts the writer's turns on a shared core)")
    print(f"  until the trace is whole: {w0:.2f} s plain, {w1:.2f} s: {w1 / w0:.2f}x")
    print(f"  limit: the writer process replays every record to make them, {alone:.2f} s of "
          f"work alone against the engine's {e0:.2f} s ({alone / e0:.2f}x); the engine waits "
          f"for it only when the {DEFAULT_SIZE >> 20} MiB ring between them is full")


def _marking(opener, marks: list[float]):
    """``opener``, its writers noting the time (wall, this process's CPU) the
    engine hands on its end."""
    def open_(path, header):
        w = opener(path, header)
        finish = w.finish

        def finished(end):
            marks.append((time.perf_counter(), time.process_time()))
            return finish(end)

        w.finish = finished   # close() calls it too
        return w
    return open_


def _writer_alone(plain: Path, flight, out: Path) -> float:
    """The flight writer process's work over the records of ``plain``, timed
    in this process: what ``kvtrace.flight.writer_process`` does with them."""
    import gzip

    from kvtrace.flight import KeyframingWriter, SegmentWriter
    from kvtrace.record import writer_process
    from kvtrace.trace import TraceWriter
    from kvtrace.trace.events import decode_header

    lines = [line for line in gzip.decompress(plain.read_bytes()).split(b"\n") if line]
    header = decode_header(orjson.loads(lines[0]))
    end = orjson.loads(lines[-1])
    body = lines[1:-1] + [orjson.dumps(["end", end.get("status", "complete"), end.get("error"), 0])]
    t = time.perf_counter()
    if flight.ring is not None:
        w = SegmentWriter(out, header, flight.segment, flight.ring, flight.every,
                          open_file=TraceWriter, on_pin=lambda m: None)
    else:
        w = KeyframingWriter(TraceWriter(out.with_suffix(".jsonl.gz"), header), header,
                             flight.every)
    rc = writer_process.write_lines(w, iter(body))[0]
    assert rc == 0, rc
    return time.perf_counter() - t


def overhead(rounds: int, every: int, ring: str | None = None, requests: int = 1000) -> None:
    """Print what keyframes every ``every`` steps (or a ring of ``ring``
    bytes) cost a recording: the embedded engine's, then a vLLM engine's."""
    embedded_overhead(every, ring, requests)
    if rounds == 0:
        return
    try:
        import vllm  # noqa: F401
    except ImportError as e:   # no vLLM here
        print(f"vLLM: not measured ({e})")
        return
    vllm_overhead(rounds, every, ring)


# -- a vLLM engine -------------------------------------------------------------------------

ARMS = ("plain", "flight", "plain2")   # plain2: the noise floor, plain against plain


def vllm_overhead(rounds: int, every: int, ring: str | None, processes: int = 3,
                  requests: int = 16) -> None:
    """A vLLM engine recorded from its start in every arm, each arm a fresh
    process (so that every trace is one whole run that replays): a whole
    trace, the same with keyframes (or a ring), and a whole trace again.
    The arms take turns, ``processes`` times each, ``rounds`` timed rounds
    a process; the figure is the median over rounds of the flight arm's
    time against the plain arm's for the same round, beside the same for
    plain2 (the noise floor). Each flight recording must replay clean:
    otherwise its writer stopped replaying, and the figure would leave its
    work out."""
    import statistics
    import subprocess

    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    lag: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as d:
        for p in range(processes):
            for arm in ARMS[p % 3:] + ARMS[:p % 3]:
                out = Path(d) / f"{arm}{p}"
                cmd = [sys.executable, "-m", "bench.keyframes", "--vllm-arm", arm,
                       "--rounds", str(rounds), "--every", str(every), str(out)]
                if ring:
                    cmd[-1:-1] = ["--ring", ring]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:])
                    raise SystemExit(f"the {arm} arm failed (exit {proc.returncode})")
                got = orjson.loads(proc.stdout.strip().splitlines()[-1])
                if arm == "flight":
                    _replays_clean(Path(got["trace"]), proc.stderr)
                times[arm].append(got["rounds_s"])
                lag[arm].append(got["lag_s"])
    ratio = [f / p for fs, ps in zip(times["flight"], times["plain"]) for f, p in zip(fs, ps)]
    floor = [q / p for qs, ps in zip(times["plain2"], times["plain"]) for q, p in zip(qs, ps)]
    what = f"a ring of {ring}" if ring else f"a keyframe every {every} steps"
    print(f"vLLM, tiny model, recorded from its start ({processes} processes an arm, "
          f"{rounds} rounds each): {what} against a whole trace, median "
          f"{statistics.median(ratio):.3f}x (target <= {TARGET:.2f}); noise floor, a whole "
          f"trace against another, {statistics.median(floor):.3f}x")
    print(f"  the writer's lag at shutdown: {statistics.median(lag['plain']):.2f} s for a "
          f"whole trace, {statistics.median(lag['flight']):.2f} s with {what}; every flight "
          "recording replayed clean")


def _replays_clean(trace: Path, stderr: str) -> None:
    """The flight arm's recording replays clean, and its writer never stopped
    replaying it (a recording whose keyframes stopped costs less)."""
    import subprocess

    if "keyframes stopped" in stderr or "invariant checks stopped" in stderr:
        raise SystemExit(f"the recorder's replay stopped in {trace}: {stderr[-2000:]}")
    proc = subprocess.run([sys.executable, "-c", "import sys; from kvtrace.cli import main; "
                           "sys.argv[0] = 'kvtrace'; main()", "replay", str(trace)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the flight recording {trace} does not replay clean "
                         f"(exit {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def vllm_arm(arm: str, rounds: int, every: int, ring: str | None, out: Path,
             requests: int = 16, max_tokens: int = 48) -> dict:
    """One arm's process: a vLLM engine recorded from its start into ``out``
    (with keyframes or a ring in the flight arm), a warm-up round, then
    ``rounds`` timed rounds of ``requests`` prompts, the prefix cache emptied
    before each (the prompts are the same in every arm). Returns the rounds'
    times and how long the trace took to be whole after shutdown."""
    import os
    import random

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    for k in ("KVTRACE_KEYFRAME_EVERY", "KVTRACE_RING", "KVTRACE_SEGMENT"):
        os.environ.pop(k, None)
    if arm == "flight" and ring:
        os.environ["KVTRACE_RING"] = ring
        os.environ["KVTRACE_SEGMENT"] = str(parse_size(ring) // 8)
    elif arm == "flight":
        os.environ["KVTRACE_KEYFRAME_EVERY"] = str(every)
    trace = out if arm == "flight" and ring else out.with_name(out.name + ".jsonl.zst")
    os.environ["KVTRACE_OUT"] = str(trace)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.recorder_overhead import _prompts
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.lab.tiny_model import ensure_tiny_model
    from kvtrace.lab.workloads import BASE_ENGINE
    from kvtrace.record.detached import wait_for_writers
    from kvtrace.record.vllm import plugin as vllm_plugin

    vllm_plugin.install()
    llm = LLM(model=str(ensure_tiny_model()),
              **dict(BASE_ENGINE, num_gpu_blocks_override=48, max_num_seqs=16))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rnd = random.Random(0)
    got = []
    for i in range(rounds + 1):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(rnd, requests)]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if i:   # the first is the warm-up
            got.append(time.perf_counter() - t)
    t = time.perf_counter()
    shutdown_llm(llm)
    wait_for_writers(trace, timeout=600)
    return {"trace": str(trace), "rounds_s": got, "lag_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--overhead", action="store_true",
                   help="time recordings with keyframes against recordings without")
    p.add_argument("--rounds", type=int, default=21, help="--overhead: vLLM rounds")
    p.add_argument("--every", type=int, default=100, help="--overhead: keyframe interval")
    p.add_argument("--ring", default=None, metavar="SIZE",
                   help="--overhead: time a ring of SIZE (64MB) instead")
    p.add_argument("--requests", type=int, default=1000,
                   help="--overhead: the embedded engine's requests")
    p.add_argument("--random", type=int, default=100, help="random embedded runs (default 100)")
    p.add_argument("--per-trace", type=int, default=6, help="keyframes per trace (about)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("traces", nargs="*", type=Path, help="traces (default: all under traces/)")
    p.add_argument("--vllm-arm", choices=ARMS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.vllm_arm:   # one arm of --overhead's vLLM figure, in its own process
        got = vllm_arm(a.vllm_arm, a.rounds, a.every, a.ring, a.traces[0])
        print(orjson.dumps(got).decode(), flush=True)
        return 0
    if a.overhead:
        if a.ring is not None and parse_size(a.ring) is None:
            p.error(f"--ring {a.ring!r} is not a size")
        overhead(a.rounds, a.every, a.ring, a.requests)
        return 0
    stored = a.traces or sorted(q for q in (ROOT / "traces").rglob("*.jsonl*"))
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for label, paths in (("stored traces", stored),
                             ("random runs", random_runs(a.random, a.seed, tmp))):
            total = Checked()
            for path in paths:
                c = check(path, a.per_trace, tmp)
                total.keyframes += c.keyframes
                total.mismatches += c.mismatches
                total.keyframe_bytes += c.keyframe_bytes
                total.trace_bytes += c.trace_bytes
                total.add_s += c.add_s
                total.replay_s += c.replay_s
            for m in total.mismatches:
                print(m)
            bad += len(total.mismatches)
            print(f"{label}: {len(paths)} traces, {total.keyframes} keyframes, "
                  f"{len(total.mismatches)} mismatches")
            print(f"  keyframes' state: {total.keyframe_bytes / 2**20:.1f} MiB of JSON "
                  f"(the traces: {total.trace_bytes / 2**20:.1f} MiB compressed)")
            print(f"  making them: {total.add_s:.1f} s; a whole replay without the "
                  f"content check: {total.replay_s:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
