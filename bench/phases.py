"""The phases of ``python -m bench``, each run in its own process:
``python -m bench.phases PHASE '{json args}'`` prints one JSON line."""

from __future__ import annotations

import gzip
import io
import json
import random
import resource
import sys
import time


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _children() -> list[int]:
    """This process's child processes (Linux: each thread's ``children`` list)."""
    import os

    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += map(int, f.read().split())
        except OSError:
            pass
    return pids


class _ChildPeaks:
    """The peak resident size of each worker process this process starts, as the
    worker's own high-water mark (``VmHWM``), read every 0.2 s while it runs.
    ``RUSAGE_CHILDREN`` would count the main process's resident size at the
    moment it started the worker, and only the largest worker."""

    def __init__(self):
        import threading

        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for pid in _children():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        hwm = [line for line in f if line.startswith("VmHWM:")]
                except OSError:
                    continue
                if hwm:
                    peak = int(hwm[0].split()[1]) * 1024
                    self.peaks[pid] = max(self.peaks.get(pid, 0), peak)

    def stop(self) -> list[int]:
        """The workers' peaks, largest first."""
        self._stop.set()
        self._thread.join()
        return sorted(self.peaks.values(), reverse=True)


def scale_workload(requests: int, seed: int = 0):
    """A long serving run: shared system prompts, a steady arrival rate that keeps
    about eight requests running, and a KV cache small enough to preempt now and then."""
    from kvtrace.engine.workloads import PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    rng = random.Random(f"scale:{seed}")
    config = SchedulerConfig(block_size=16, num_blocks=128, max_num_batched_tokens=256,
                             max_num_seqs=8, max_model_len=1024, long_prefill_token_threshold=64)
    systems = [tuple(rng.randrange(4, 32000) for _ in range(rng.randint(32, 96))) for _ in range(6)]
    arrivals, step = [], 0
    for i in range(requests):
        prompt = rng.choice(systems) + tuple(rng.randrange(4, 32000) for _ in range(rng.randint(16, 64)))
        arrivals.append(PlannedArrival(step, f"r{i}", prompt, rng.randint(40, 100)))
        step += rng.randint(8, 13)
    return Workload("scale", config, tuple(arrivals))


def engine(out: str, requests: int) -> dict:
    from kvtrace.engine import record_workload

    t = time.perf_counter()
    res = record_workload(out, scale_workload(requests), counters="prefill_stats")
    return {"seconds": time.perf_counter() - t, "steps": res.steps, "peak_rss": _peak_rss()}


def reference_alone(requests: int, repeat: int = 3) -> dict:
    """The reference scheduler alone on the engine's workload: the embedded
    engine with no trace written and no record built (its writer keeps
    nothing; the events that bridge.py makes are not made). Replay runs the
    same scheduler on every step, so this is its floor beside the parse.
    Best of ``repeat``."""
    from kvtrace import bridge
    from kvtrace.engine import engine, record_workload

    class _Nothing:   # a trace writer that keeps nothing
        def __init__(self, *args, **kwargs):
            self.seq = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

        def next_seq(self) -> int:
            self.seq += 1
            return self.seq

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    class _NoRecords:   # bridge.py, less the records it builds
        def __getattr__(self, name):
            return getattr(bridge, name)

        step_event = staticmethod(lambda *args, **kwargs: None)
        output_events = staticmethod(lambda *args, **kwargs: ())

    engine.bridge = _NoRecords()   # this phase's own process
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        record_workload("unwritten.jsonl", scale_workload(requests), counters="prefill_stats",
                        open_writer=_Nothing)
        best = min(best, time.perf_counter() - t)
    return {"seconds": best}


def size(trace: str) -> dict:
    """Bytes of trace text, its compressed sizes, and what the trace holds."""
    import os
    from pathlib import Path

    import orjson

    from kvtrace.trace.io import open_binary_read

    steps = request_steps = tokens = requests = plain = 0
    counter = _Counter()
    gzw = gzip.GzipFile(fileobj=counter, mode="wb", compresslevel=6)
    with open_binary_read(Path(trace)) as f:
        for line in _lines(f):
            plain += len(line)
            gzw.write(line)
            o = orjson.loads(line)
            kind = o.get("kind")
            if kind == "step":
                steps += 1
                for group in ("new", "resumed", "running"):
                    request_steps += len(o.get(group, ()))
                    tokens += sum(s["num_scheduled_tokens"] for s in o.get(group, ()))
            elif kind == "arrival":
                requests += 1
    gzw.close()
    return {"steps": steps, "request_steps": request_steps, "scheduled_tokens": tokens,
            "requests": requests, "plain_bytes": plain, "zst_bytes": os.path.getsize(trace),
            "gz_bytes": counter.n}


def _lines(f):
    rest = b""
    while chunk := f.read(1 << 20):
        *whole, rest = (rest + chunk).split(b"\n")
        for line in whole:
            yield line + b"\n"
    if rest:
        yield rest


class _Counter(io.RawIOBase):
    """A sink that only counts bytes."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        return len(b)


def json_only(trace: str) -> dict:
    """Decompress and orjson-parse every line, keeping nothing: what any reader of
    JSON Lines pays before it looks at a record."""
    from pathlib import Path

    import orjson

    from kvtrace.trace.io import open_binary_read

    t, cpu = time.perf_counter(), time.process_time()
    n = 0
    with open_binary_read(Path(trace)) as f:
        for line in _lines(f):
            orjson.loads(line)
            n += 1
    return {"seconds": time.perf_counter() - t, "lines": n, "peak_rss": _peak_rss(),
            "cpu": time.process_time() - cpu}


def decode_only(trace: str) -> dict:
    """Decompress and decode every line into its typed event with its own
    checks (msgspec, in C), without the checks across records: the part of the
    checked parse that no Python runs."""
    from pathlib import Path

    from kvtrace.trace.events import LINE_DECODER, decode_header_line
    from kvtrace.trace.io import open_binary_read

    decode = LINE_DECODER.decode
    t = time.perf_counter()
    n = 0
    with open_binary_read(Path(trace)) as f:
        lines = _lines(f)
        decode_header_line(next(lines))
        for line in lines:
            decode(line)
            n += 1
    return {"seconds": time.perf_counter() - t, "lines": n, "peak_rss": _peak_rss()}


def kv_bound(device: str = "cpu") -> dict:
    """The shadow-KV check's gather-and-compare alone (every block of a cache
    read every step, bench.shadow_kv's full-cache check) on the backend replay
    runs it on there (``--device cpu`` is NumPy; CUDA is torch), the device's
    memory bandwidth, and the floor of the check's design: the array ops it
    cannot do without, on a step's slots with every index built beforehand
    (the state's rows and the expected rows gathered, compared, the verdict
    brought to the host), and a bare indexed gather and compare of as many
    slots one by one."""
    import numpy as np
    import torch

    from bench.shadow_kv import BYTES_PER_SLOT, _sync, bandwidth, run_full_check
    from kvtrace.replay.kv_content.device import open_shadow

    torch.set_num_threads(1)   # as replay's worker runs the check
    dev = torch.device(device)
    B, blocks, per_step = 16, 4096, 4032   # run_full_check's cache, and its rows a step

    def best_of(fn, reps: int = 7) -> float:
        fn()
        best = float("inf")
        for _ in range(reps):
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            best = min(best, time.perf_counter() - t)
        return best

    with torch.inference_mode():
        backend = "numpy" if device == "cpu" else device
        # Best of three, as the bandwidth and the floor below are best-of too.
        t_full, full_slots, _ = min(run_full_check(blocks, B, backend, 200) for _ in range(3))
        # The same again with the backend's array work timed: the rest of
        # the check's time is its Python, queueing each step's reads.
        spent, depth = [0.0], [0]
        cls = type(open_shadow(blocks, B, backend))
        names = ("_compare", "_first_bad", "_fingerprint", "_write_log", "_apply", "_ints",
                 "_columns")
        originals = {n: getattr(cls, n) for n in names}

        def timed(fn):
            def run(*args, **kw):   # the outermost call alone: they call each other
                depth[0] += 1
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    depth[0] -= 1
                    if not depth[0]:
                        spent[0] += time.perf_counter() - t
            return run

        for n, fn in originals.items():
            setattr(cls, n, timed(fn))
        try:
            t_again, _, _ = run_full_check(blocks, B, backend, 200)
        finally:
            for n, fn in originals.items():
                setattr(cls, n, fn)
        state = torch.randint(1, 1 << 62, (blocks * B,), dtype=torch.int64, device=dev)
        arena = torch.randint(1, 1 << 62, (per_step * B,), dtype=torch.int64, device=dev)
        rows = torch.randint(0, blocks, (per_step,), dtype=torch.int64, device=dev)
        starts = torch.arange(per_step, dtype=torch.int64, device=dev) * B
        if backend == "numpy":
            st, ar, ro, sa = state.numpy(), arena.numpy(), rows.numpy(), starts.numpy()
            ar_rows = np.lib.stride_tricks.sliding_window_view(ar, B)
            t_rows = best_of(lambda: bool((st.reshape(-1, B).take(ro, axis=0)
                                           != ar_rows[sa]).any()))
        else:
            t_rows = best_of(lambda: bool(torch.ne(state.unfold(0, B, B).index_select(0, rows),
                                                   arena.unfold(0, B, 1).index_select(0, starts)).any()))
        idx = torch.randint(0, blocks * B, (1 << 22,), dtype=torch.int64, device=dev)
        want = state.index_select(0, idx)
        t_gather = best_of(lambda: bool(torch.ne(state.index_select(0, idx), want).any()))
    bw, _ = bandwidth(dev)
    return {"backend": "NumPy" if backend == "numpy" else f"torch on {device}",
            "check_slots_per_s": full_slots / t_full, "gather_slots_per_s": len(idx) / t_gather,
            "rows_slots_per_s": per_step * B / t_rows, "array_share": spent[0] / t_again,
            "bound_slots_per_s": bw / BYTES_PER_SLOT, "bandwidth": bw}


def parse(trace: str) -> dict:
    from kvtrace.trace import TraceReader

    t, cpu = time.perf_counter(), time.process_time()
    n = sum(1 for _ in TraceReader(trace))
    return {"seconds": time.perf_counter() - t, "events": n, "peak_rss": _peak_rss(),
            "cpu": time.process_time() - cpu}


def replay(trace: str, kv: bool, worker: bool | None = None, device: str = "cpu") -> dict:
    """Replay, with the content check on ``device`` if ``kv``; with ``worker``,
    part of the work runs in a worker process (the content check, or else the
    record checks); None: as replay decides."""
    from kvtrace.workers import policy as workers
    from kvtrace.replay import replay_file

    used = workers.wanted(trace, content=kv) if worker is None else int(worker)
    children = _ChildPeaks()
    t, cpu, worker_cpu = time.perf_counter(), time.process_time(), _children_cpu()
    r = replay_file(trace, device=device if kv else None, worker=worker)
    seconds = time.perf_counter() - t
    cpu, worker_cpu = time.process_time() - cpu, _children_cpu() - worker_cpu
    if r.divergences:
        raise SystemExit(f"{len(r.divergences)} divergences on a clean trace: {r.divergences[0]}")
    return {"seconds": seconds, "steps": r.steps, "peak_rss": _peak_rss(),
            "worker_peak_rss": children.stop(), "slots": getattr(r, "slots_checked", 0),
            "workers": used if kv or used < 2 else 1, "cpu": cpu, "worker_cpu": worker_cpu}


def _children_cpu() -> float:
    """CPU seconds of this process's ended worker processes."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def diff(trace: str, worker: bool | None = None) -> dict:
    """Diff of the trace with itself; with ``worker``, each input's records are
    checked in a worker process of its own; None: as diff decides."""
    from kvtrace.diff import diff_files
    from kvtrace.workers import policy as workers

    used = workers.wanted(trace, content=False) >= 1 if worker is None else worker
    children = _ChildPeaks()
    t, cpu, worker_cpu = time.perf_counter(), time.process_time(), _children_cpu()
    r = diff_files(trace, trace, worker=worker)
    seconds = time.perf_counter() - t
    cpu, worker_cpu = time.process_time() - cpu, _children_cpu() - worker_cpu
    if r.divergences:
        raise SystemExit(f"a trace differs from itself: {r.divergences[0]}")
    return {"seconds": seconds, "peak_rss": _peak_rss(), "worker_peak_rss": children.stop(),
            "workers": 2 if used else 0, "cpu": cpu, "worker_cpu": worker_cpu}


def cuda() -> dict:
    """The CUDA device torch sees, if any."""
    import torch

    return {"name": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def recorder(model: str = "tiny", rounds: int = 101) -> dict:
    from bench.recorder_overhead import run

    return run(rounds=rounds, model=model)


def kv_audit_engine(rounds: int = 21, tp: int = 1) -> dict:
    from bench.kv_audit import engine_overhead

    return engine_overhead(rounds, tp=tp)


def small_replay(runs: int = 10) -> dict:
    from bench.small_replay import run

    return run(runs)


def scaling(requests: int = 12_500) -> dict:
    from bench.scaling import run

    return run(requests)


def vllm_vs_reference(repeat: int = 3) -> dict:
    """bench/vllm_vs_reference.py's "all" row: the stored traces and three
    embedded workloads through the reference and through vLLM's own
    Scheduler, one core; {"vllm": None} without vLLM."""
    from bench import vllm_vs_reference as vs

    try:
        rows = vs.measure(repeat, 0, ["kv-pressure", "offload", "load-failures"],
                          str(vs.ROOT / "traces" / "*.jsonl.gz"))
    except ImportError:
        return {"vllm": None}
    import vllm

    total = {k: sum(r[k] for r in rows) for k in ("steps", "ref_s", "ref_write_s", "vllm_s")}
    agree = not any(r["diff_divergences"] or r["ref_on_vllm_divergences"] or r["vllm_stopped"]
                    for r in rows)
    return {"vllm": vllm.__version__, "traces": len(rows), "agree": agree, "repeat": repeat,
            **total}


def kv_digests(device: str = "cpu", batch: int = 64) -> dict:
    from bench.kv_audit import digest_throughput

    return digest_throughput(device, batch=batch)


if __name__ == "__main__":
    phase, kwargs = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print(json.dumps(globals()[phase](**kwargs)))
