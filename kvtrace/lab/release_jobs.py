"""Jobs on an installed vLLM release, run in that release's own process:
record a workload model-free, re-run a trace through the release's own
scheduler, and diff the two (``python -m kvtrace.lab.release_jobs JOBS.json
OUT_DIR``). ``kvtrace.lab.releases`` starts it; tests, benchmarks and
traces/make_traces.py read the JSON lines it prints.

It drives a source (record/vllm), then a checker (diff), so it sits on top,
beside the commands.
"""

from __future__ import annotations

import os
from typing import Any

from kvtrace.lab.model_free import step_limited
from kvtrace.lab.run import record_model_free


def run_one(out_path: str, wl: dict | str, check_vllm: bool = True,
            scheduler_cls: str | None = None) -> dict:
    """Record ``wl`` (a workload, or the name of one of workloads.py's) on the
    installed vLLM, model-free, under a step limit, with vLLM's scheduler or
    ``scheduler_cls`` (a dotted path); then, with ``check_vllm``, replay the
    trace through the same release's scheduler (``--scheduler vllm``) and
    diff the two. Returns what happened, as JSON-able values."""
    import time

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.rerun.build import resolve_scheduler_cls
    from kvtrace.lab.run import EngineFailed
    from kvtrace.lab.workloads import WORKLOADS

    spec = WORKLOADS[wl] if isinstance(wl, str) else wl
    if scheduler_cls is not None:
        base = resolve_scheduler_cls(scheduler_cls)
    else:
        base = AsyncScheduler if spec.get("engine", {}).get("async_scheduling") else Scheduler
    t0 = time.perf_counter()
    result: dict[str, Any] = {"path": out_path, "error": None, "vllm_agrees": None}
    try:
        record_model_free(out_path, wl, scheduler_cls=step_limited(base))
    except EngineFailed as e:
        result["error"] = f"{type(e.error).__name__}: {e.error}"
    except Exception as e:   # the release refused the workload before recording it
        result["error"] = f"refused: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        result["seconds"] = round(time.perf_counter() - t0, 3)
        return result
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if check_vllm and result["error"] is None:
        again = through(out_path, out_path.replace(".jsonl", ".vllm.jsonl"), scheduler_cls)
        result["vllm_agrees"] = bool(again["vllm_agrees"]) and again["error"] is None
        if not result["vllm_agrees"]:
            result["vllm_differs"] = again["error"] or again["vllm_differs"]
    return result


def through(trace: str, out_path: str, scheduler_cls: str | None = None) -> dict:
    """Replay the recorded ``trace``'s inputs through the installed vLLM's
    scheduler, or ``scheduler_cls`` (``--scheduler vllm``), writing its
    decisions to ``out_path``, and diff the two."""
    import time

    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    t0 = time.perf_counter()
    try:
        run = replay_through_vllm(trace, out_path, scheduler_cls)
        diff = diff_files(trace, out_path)
    except Exception as e:
        return {"path": None, "error": f"refused: {type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:300]}", "vllm_agrees": None}
    first = diff.divergences[0].to_json() if diff.divergences else None
    return {"path": out_path, "error": run.stopped, "seconds": round(time.perf_counter() - t0, 3),
            "vllm_agrees": not diff.divergences, "vllm_differs": first,
            "faithful_inputs": run.faithful_inputs}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtrace.lab.release_jobs JOBS.json OUT_DIR``: record each
    job, a JSON object with "name" and either "workload" (a workload dict or
    the name of one of workloads.py's) or "seed" and "kind" (random_workloads),
    into OUT_DIR/NAME.jsonl.gz, optionally under "scheduler_cls" (a dotted
    path); a job with "handoff_from" (an earlier job's name, a prefill side,
    or a list of them) records the decode side of those jobs' traces
    (``workloads.fleet_handoff_workload``,
    "workload" defaulting to "pd-decode"); or, for a job with "through" (a trace), replay
    that trace's inputs through this vLLM's scheduler into the same place.
    Prints one JSON line per job."""
    import json
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    check = "--no-check" not in args
    args = [a for a in args if a != "--no-check"]
    jobs_path, out_dir = args
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        out_path = os.path.join(out_dir, f"{job['name']}.jsonl.gz")
        if "through" in job:
            print(json.dumps({"name": job["name"],
                              **through(job["through"], out_path, job.get("scheduler_cls"))}),
                  flush=True)
            continue
        if "handoff_from" in job:   # the decode side of earlier jobs' prefill sides
            from kvtrace.lab.workloads import fleet_handoff_workload

            sources = job["handoff_from"]
            wl = fleet_handoff_workload(
                [os.path.join(out_dir, f"{name}.jsonl.gz")
                 for name in ([sources] if isinstance(sources, str) else sources)],
                job.get("workload", "pd-decode"))
        elif "workload" in job:
            wl = job["workload"]
        else:
            from kvtrace.lab.random_workloads import workload

            wl = workload(int(job["seed"]), job["kind"])
        res = run_one(out_path, wl, check, job.get("scheduler_cls"))
        print(json.dumps({"name": job["name"], **res}), flush=True)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
