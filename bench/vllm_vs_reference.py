"""The reference scheduler and vLLM's own scheduler, side by side on the same traces.

    python -m bench.vllm_vs_reference [--repeat 5] [--seed 0]
                                      [--embedded kv-pressure,offload,load-failures]
                                      [--traces 'traces/*.jsonl.gz'] [--json FILE]

For every real trace in traces/ and for embedded-engine traces recorded in this run
(``kvtrace.engine.record_embedded(..., counters="prefill_stats")``, so that both
sides emit the same prompt accounting), in the same process:

* reference: ``kvtrace.replay.replay_file(path, device=None)``: the reference
  scheduler with every check, no shadow-KV content check;
* vLLM: ``kvtrace.rerun.core.replay_through_vllm(path, out)``: the
  installed vLLM's ``Scheduler`` fed the recorded inputs, its decisions written by
  the kvtrace recorder to ``out``.

Agreement, per trace: divergences of the reference on the recording, of ``kvtrace
diff RECORDING VLLM_OUT``, and of the reference on the trace vLLM's scheduler
wrote. The embedded engine numbers blocks with its own allocator and hashes
prefixes its own way; zero diff divergences there means vLLM's scheduler made the
same decisions, block ids included.

Speed: steps/s, best of --repeat runs, four figures per trace:

* ref:    the whole ``replay_file(path, device=None)`` call (read, schedule, check);
* ref+w:  the same, also writing the replayed trace (``out=``, what ``-o`` does);
* vLLM:   the feed loop of ``replay_through_vllm`` (read, schedule, update, recorder
          capture; the recorder's writer thread runs beside it);
* vLLM+w: the whole ``replay_through_vllm`` call less its set-up (building the
          config and the scheduler, reported apart), the trace written and closed.

The ratio is vLLM+w over ref+w: both read the same file, decode the same events and
write a trace. Small traces are dominated by per-call costs (opening and closing
the gzip writer, starting the writer thread), so the "all" row, over every step of
every trace, is the figure to quote.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check_reference_signature() -> None:
    from kvtrace.replay import replay_file

    params = inspect.signature(replay_file).parameters
    if "device" not in params or "out" not in params:
        raise SystemExit(f"kvtrace.replay.replay_file{inspect.signature(replay_file)}: "
                         "expected (path, out=None, device=...)")


def _time_reference(path: str, out: str | None, repeat: int) -> tuple[float, object]:
    from kvtrace.replay import replay_file

    best, res = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = replay_file(path, out, device=None)
        best = min(best, time.perf_counter() - t0)
    return best, res


def _time_vllm(path: str, out: str, repeat: int) -> tuple[float, float, float, object]:
    """Best wall time less set-up, best feed-loop time, set-up of the best run, result."""
    from kvtrace.rerun.core import replay_through_vllm

    best, loop, setup, res = float("inf"), float("inf"), 0.0, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = replay_through_vllm(path, out)
        wall = time.perf_counter() - t0
        loop = min(loop, res.seconds)
        if wall - res.setup_seconds < best:
            best, setup = wall - res.setup_seconds, res.setup_seconds
    return best, loop, setup, res


def run(traces: list[tuple[str, str]], repeat: int, scratch: Path) -> list[dict]:
    from kvtrace.diff import diff_files
    from kvtrace.replay import replay_file

    rows = []
    for name, path in traces:
        stem = Path(path).name.split('.')[0]
        out = str(scratch / f"{stem}.vllm.jsonl.gz")
        ref_s, ref = _time_reference(path, None, repeat)
        refw_s, _ = _time_reference(path, str(scratch / f"{stem}.ref.jsonl.gz"), repeat)
        v_s, loop_s, setup, vres = _time_vllm(path, out, repeat)
        d = diff_files(path, out)
        ref_on_vllm = replay_file(out, device=None)
        rows.append({
            "trace": name, "steps": ref.steps, "vllm_steps": vres.steps,
            "ref_s": ref_s, "ref_write_s": refw_s, "vllm_s": v_s, "vllm_loop_s": loop_s,
            "vllm_setup_s": setup,
            "ref_steps_per_s": ref.steps / ref_s, "ref_write_steps_per_s": ref.steps / refw_s,
            "vllm_loop_steps_per_s": vres.steps / loop_s, "vllm_steps_per_s": vres.steps / v_s,
            "ratio_vllm_over_ref": (vres.steps / v_s) / (ref.steps / refw_s),
            "ref_divergences": len(ref.divergences),
            "diff_divergences": len(d.divergences),
            "ref_on_vllm_divergences": len(ref_on_vllm.divergences),
            "vllm_stopped": vres.stopped,
            "vllm_input_notes": vres.summary()["input_notes"],
            "first_diff": [x.to_json() for x in d.divergences[:3]],
            "first_ref": [x.to_json() for x in ref.divergences[:3]],
        })
    return rows


def measure(repeat: int, seed: int, embedded: list[str], traces_glob: str) -> list[dict]:
    """The rows of every trace matching ``traces_glob`` and of the embedded
    workloads recorded now; ImportError without vLLM."""
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="kvtrace-vllm-cache-"))
    import vllm  # noqa: F401

    _check_reference_signature()
    import torch

    torch.set_num_threads(1)
    from kvtrace.engine import record_embedded

    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-vllm-"))
    traces = [(Path(p).name, p) for p in sorted(glob.glob(traces_glob))]
    for wl in embedded:
        p = scratch / f"embedded-{wl}-{seed}.jsonl.gz"
        record_embedded(p, workload=wl, seed=seed, counters="prefill_stats")
        traces.append((f"embedded {wl} seed={seed}", str(p)))
    return run(traces, repeat, scratch) if traces else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_vs_reference",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the embedded-engine traces")
    ap.add_argument("--embedded", default="kv-pressure,offload,load-failures",
                    help="embedded-engine workloads to record and replay ('' for none)")
    ap.add_argument("--traces", default=str(ROOT / "traces" / "*.jsonl.gz"),
                    help="glob of recorded traces (default: the real traces in traces/)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)

    try:
        rows = measure(args.repeat, args.seed, [w for w in args.embedded.split(",") if w],
                       args.traces)
    except ImportError:
        print("vLLM is not installed (pip install -e .[vllm]); nothing to compare", file=sys.stderr)
        return 2
    if not rows:
        print("no traces", file=sys.stderr)
        return 2

    import vllm as _v
    print(f"vLLM {_v.__version__}; best of {args.repeat}; reference without the content check; "
          f"torch threads 1")
    hdr = (f"{'trace':30} {'steps':>5} {'ref':>7} {'ref+w':>7} {'vLLM':>7} {'vLLM+w':>7} "
           f"{'ratio':>6} {'setup':>6}  divergences: ref | diff | ref-on-vLLM")
    print(hdr)
    print("-" * len(hdr))
    agree = True
    for r in rows:
        print(f"{r['trace']:30} {r['steps']:>5} {r['ref_steps_per_s']:>7.0f} "
              f"{r['ref_write_steps_per_s']:>7.0f} {r['vllm_loop_steps_per_s']:>7.0f} "
              f"{r['vllm_steps_per_s']:>7.0f} {r['ratio_vllm_over_ref']:>6.2f} "
              f"{r['vllm_setup_s']:>6.2f}  {r['ref_divergences']:>4} | {r['diff_divergences']:>4} | "
              f"{r['ref_on_vllm_divergences']:>4}")
        if r["diff_divergences"] or r["ref_on_vllm_divergences"] or r["vllm_stopped"]:
            agree = False
        for d in r["first_diff"]:
            print(f"    diff: {json.dumps(d)}")
        for d in r["first_ref"]:
            print(f"    reference on the recording: {json.dumps(d)}")
        if r["vllm_stopped"]:
            print(f"    vLLM replay stopped: {r['vllm_stopped']}")
        for n in r["vllm_input_notes"]:
            print(f"    input: {n}")
    steps = sum(r["steps"] for r in rows)
    t = {k: sum(r[k] for r in rows) for k in ("ref_s", "ref_write_s", "vllm_loop_s", "vllm_s")}
    print("-" * len(hdr))
    print(f"{'all':30} {steps:>5} {steps / t['ref_s']:>7.0f} {steps / t['ref_write_s']:>7.0f} "
          f"{steps / t['vllm_loop_s']:>7.0f} {steps / t['vllm_s']:>7.0f} "
          f"{t['ref_write_s'] / t['vllm_s']:>6.2f}")
    print("steps/s. ref: replay_file(path, device=None); ref+w: the same writing its trace (-o); "
          "vLLM: the feed loop (recorder capture on, writer thread running); vLLM+w: the whole "
          "call less set-up, trace closed; ratio: vLLM+w over ref+w; setup: seconds to build "
          "the config and the scheduler.")
    print("vLLM's scheduler and the reference agree on every trace" if agree else
          "vLLM's scheduler and the reference DISAGREE on at least one trace (see above)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
