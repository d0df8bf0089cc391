"""kvtrace's benchmark: ``python -m bench`` prints one table of figures, each next
to the limit it is measured against, all measured in the same run.

* recorder overhead on a real vLLM engine (recorded / unrecorded wall time),
  on the tiny model and on the small one (bench/recorder_overhead.py);
* the KV audit: its overhead on a real vLLM engine with ExampleConnector,
  and its digests' throughput beside the memory bandwidth, on the CPU and on
  CUDA when the shadow-KV check runs there (bench/kv_audit.py);
* replay against vLLM's own Scheduler fed the same inputs, on the stored
  traces and three embedded workloads (bench/vllm_vs_reference.py);
* a small trace's replay with the shadow-KV check, next to replay without it
  and the interpreter's start with the CLI imported (bench/small_replay.py);
* replay time against trace length: a workload whose waiting queue grows
  all along, at an eighth of the scale and four times that, with the
  shadow-KV check and without (bench/scaling.py);
* the embedded engine producing a large trace (its own wall time);
* decompressing and JSON-parsing that trace, and parsing it into checked
  records (the floor for anything that reads it), measured again after every
  timed phase below: each phase is compared with the mean of the parses just
  before and just after it, since this kind of machine's speed drifts over
  minutes by more than the figures differ;
* replay through the reference, with and without the shadow-KV check, each
  with worker processes as replay chooses them for a large trace on this
  machine (workers.py), and all in one process;
* diff of the trace with itself, in MB/s of trace text per input, with a
  worker process per input as diff chooses them for a large trace, and all in
  one process;
* trace size per scheduled request-step, plain and compressed;
* peak memory of each phase, and replay's peak memory on a 100x shorter
  trace of the same workload (memory must stay flat as traces grow);
* then the flight recorder's: a long trace split at its keyframes against
  its serial replay (bench/split.py), and keyframes' cost to a recording
  (bench/keyframes.py --overhead).

Each phase runs in a fresh process, so its peak memory is its own.

    python -m bench                 # full scale: 100k requests, >= 1M steps
    python -m bench --quick         # 2k requests, about 20k steps
    python -m bench --no-vllm       # skip the recorder-overhead phase
    python -m bench --kv-device cuda   # the shadow-KV check on CUDA too

With ``--kv-device auto`` (the default) replay with the shadow-KV check is
measured on the CPU, and on CUDA as well when torch sees a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(phase: str, **kw) -> dict:
    """Run one phase in a fresh interpreter; it prints one JSON line."""
    cmd = [sys.executable, "-m", "bench.phases", phase, json.dumps(kw)]
    out = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench phase {phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wants_cuda(choice: str) -> bool:
    if choice == "cpu":
        return False
    # Asked in a child: torch in this process would count in every phase's
    # peak memory (Linux keeps a process's peak across exec).
    seen = _child("cuda")["name"]
    if choice == "cuda" and not seen:
        raise SystemExit("--kv-device cuda: torch sees no CUDA device")
    return bool(seen)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _workers_mb(peaks: list[int]) -> str:
    """Each worker's own peak (its high-water mark, bench/phases.py)."""
    if not peaks:
        return "no worker"
    return ("worker " if len(peaks) == 1 else "workers ") + ", ".join(_mb(p) for p in peaks)


def main() -> None:
    ap = argparse.ArgumentParser(description="kvtrace benchmark")
    ap.add_argument("--quick", action="store_true", help="2k requests instead of 100k")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true", help="skip the recorder-overhead phase")
    ap.add_argument("--no-kv", action="store_true", help="skip replay with the shadow-KV check")
    ap.add_argument("--dir", default=None, help="where to write the traces (default: a temp dir)")
    ap.add_argument("--kv-device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="the shadow-KV check's devices: cpu; cuda too (auto: when torch sees one)")
    args = ap.parse_args()
    kv_devices = [] if args.no_kv else ["cpu"] + (["cuda"] if _wants_cuda(args.kv_device) else [])
    n = args.requests or (2000 if args.quick else 100_000)
    work = Path(args.dir or tempfile.mkdtemp(prefix="kvtrace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    big, small = work / f"scale-{n}.jsonl.zst", work / f"scale-{max(n // 100, 100)}.jsonl.zst"
    rows: list[tuple[str, str, str]] = []
    t_start = time.perf_counter()

    if not args.no_vllm:
        # The tiny model's step is mostly vLLM's own Python: the recorder's
        # largest share of a step. The small model's is mostly the model's, as
        # a real model's step on a GPU is; fewer rounds, each ten times longer.
        for model, rounds in (("tiny", 101), ("small", 41)):
            r = _child("recorder", model=model, rounds=rounds)
            rows.append((f"recorder overhead (vLLM, {model} model)",
                         f"{r['ratio_median']:.3f}x engine time (quartiles {r['ratio_q1']:.3f}-"
                         f"{r['ratio_q3']:.3f}, {r['rounds']} interleaved rounds; unrecorded/unrecorded "
                         f"{r['control_median']:.3f}); {r['recorder_us_per_step']:.0f} us per step on an"
                         f" engine step of {r['engine_ms_per_step']:.2f} ms; measured directly: on the "
                         f"engine's thread {r['capture_us_per_step']:.0f} us + writer thread "
                         f"{r['writer_us_per_step']:.0f} us = {r['own_ratio']:.3f}x; floor: the "
                         f"least capture in Python of the same facts, an arm of each round: "
                         f"{r['floor_ratio_median']:.3f}x (directly {r['floor_us_per_step']:.0f} us "
                         f"= {r['floor_own_ratio']:.3f}x)",
                         f"<= {r['target']:.2f}x"))
        a = _child("kv_audit_engine", rounds=21)
        rows.append(("KV audit (vLLM + ExampleConnector, tiny model)",
                     f"recorded with the audit {a['audit_ratio']:.3f}x engine time, without it "
                     f"{a['plain_ratio']:.3f}x ({a['rounds']} interleaved rounds; unrecorded/"
                     f"unrecorded {a['control_ratio']:.3f}); digests {a['digest_share']:.1%} of the "
                     f"audited run, {a['blocks_per_round']:.0f} blocks of {a['block_kib']:.0f} KiB a "
                     f"round", ""))
        a = _child("kv_audit_engine", rounds=7, tp=2)
        rows.append(("KV audit (vLLM + ExampleConnector, tiny model, 2 tensor-parallel workers)",
                     f"recorded with the audit {a['audit_ratio']:.3f}x engine time, without it "
                     f"{a['plain_ratio']:.3f}x ({a['rounds']} interleaved rounds; unrecorded/"
                     f"unrecorded {a['control_ratio']:.3f}); {a['audit_records']} kv_audit records "
                     f"from the workers' processes", ""))

    vs = _child("vllm_vs_reference", repeat=3)
    if vs["vllm"]:
        rows.append((f"replay against vLLM {vs['vllm']}'s own Scheduler ({vs['traces']} traces, "
                     f"{vs['steps']:,} steps, one core, each writing its trace)",
                     f"the reference {vs['steps'] / vs['ref_write_s']:,.0f} steps/s, vLLM's "
                     f"Scheduler fed the same inputs {vs['steps'] / vs['vllm_s']:,.0f} steps/s = "
                     f"{vs['vllm_s'] / vs['ref_write_s']:.2f}x faster (best of {vs['repeat']}; "
                     f"{'the same decisions on every trace' if vs['agree'] else 'DECISIONS DIFFER'});"
                     f" without writing its trace, the reference "
                     f"{vs['steps'] / vs['ref_s']:,.0f} steps/s", ">= 3x"))
    else:
        rows.append(("replay against vLLM's own Scheduler", "vLLM is not installed", ">= 3x"))

    sr = _child("small_replay", runs=10)
    m = sr["median"]
    rows.append((f"small replay with the KV check ({sr['steps']} steps, on {sr['device']})",
                 f"{m['check']:.3f} s, median of {sr['runs']} processes; without the check "
                 f"{m['no_check']:.3f} s ({m['check'] / m['no_check']:.2f}x); python + import "
                 f"kvtrace.cli {m['import_cli']:.3f} s; torch imported: "
                 f"{'yes' if sr['torch_imported'] else 'no'} (import torch alone "
                 f"{m['import_torch']:.3f} s)", "well under 1 s"))

    sc = _child("scaling", requests=max(n // 8, 2500))
    with_kv, without = (next(row for row in sc["rows"] if row["kv"] is kv) for kv in (True, False))
    made = sc["made"]
    rows.append((f"replay time, a 4x longer trace ({sc['requests']['short']:,} and "
                 f"{sc['requests']['long']:,} requests, a growing waiting queue)",
                 f"with the KV check {with_kv['short']['cpu']:.1f} s -> {with_kv['long']['cpu']:.1f} s "
                 f"of CPU = {with_kv['cpu_ratio']:.2f}x (wall {with_kv['wall_ratio']:.2f}x), for "
                 f"{made['long']['steps'] / made['short']['steps']:.2f}x the steps; without it "
                 f"{without['cpu_ratio']:.2f}x; one process",
                 f"<= {sc['limit']}x"))

    eng = _child("engine", out=str(big), requests=n)
    alone = _child("reference_alone", requests=n)
    _child("engine", out=str(small), requests=max(n // 100, 100))
    size = _child("size", trace=str(big))
    raw = _child("json_only", trace=str(big))
    dec = _child("decode_only", trace=str(big))
    # This machine's speed drifts by more than the figures differ, over minutes.
    # So parse-only runs before and after every timed phase, and each phase is
    # compared with the mean of the two parses beside it.
    parses = [_child("parse", trace=str(big))]

    def beside_parses(phase: str, **kw) -> dict:
        r = _child(phase, **kw)
        parses.append(_child("parse", trace=str(big)))
        r["floor"] = (parses[-2]["seconds"] + parses[-1]["seconds"]) / 2
        return r

    rep = beside_parses("replay", trace=str(big), kv=False, worker=None)
    rep1 = beside_parses("replay", trace=str(big), kv=False, worker=False)
    rep_small = _child("replay", trace=str(small), kv=False, worker=False)
    rep_kvs = [(dev, beside_parses("replay", trace=str(big), kv=True, worker=None, device=dev),
                beside_parses("replay", trace=str(big), kv=True, worker=False, device=dev))
               for dev in kv_devices]
    dif = beside_parses("diff", trace=str(big), worker=None)
    dif1 = beside_parses("diff", trace=str(big), worker=False)
    parse = parses[0]
    spread = sorted(p["seconds"] for p in parses)
    bounds = [(dev, _child("kv_bound", device=dev)) for dev in kv_devices]
    # The aligner's own time: diff in one process less the parse of both inputs.
    align_s = max(dif1["seconds"] - 2 * dif1["floor"], 1e-9)

    steps, reqsteps, tokens = size["steps"], size["request_steps"], size["scheduled_tokens"]
    rows += [
        ("trace", f"{size['requests']:,} requests, {steps:,} steps, {reqsteps:,} scheduled "
                  f"request-steps, {tokens:,} scheduled tokens", ">= 100k requests, >= 1M steps"),
        ("engine producing it (embedded)", f"{eng['seconds']:.1f} s, {steps / eng['seconds']:,.0f} steps/s,"
                                           f" peak {_mb(eng['peak_rss'])}", "the engine's own time"),
        ("trace size, plain", f"{size['plain_bytes'] / reqsteps:,.0f} B per scheduled request-step "
                              f"({_mb(size['plain_bytes'])})", ""),
        ("trace size, zstd", f"{size['zst_bytes'] / reqsteps:,.1f} B per scheduled request-step "
                             f"({_mb(size['zst_bytes'])})", ""),
        ("trace size, gzip", f"{size['gz_bytes'] / reqsteps:,.1f} B per scheduled request-step "
                             f"({_mb(size['gz_bytes'])})", ""),
        ("JSON only (decompress + orjson)", f"{raw['seconds']:.1f} s, "
                                            f"{size['plain_bytes'] / raw['seconds'] / 1e6:,.1f} MB/s", ""),
        ("parse only (floor)", f"{parse['seconds']:.1f} s, {steps / parse['seconds']:,.0f} steps/s, "
                               f"{size['plain_bytes'] / parse['seconds'] / 1e6:,.1f} MB/s (typed records,"
                               f" checked) = {raw['seconds'] / parse['seconds']:.0%} of JSON only; peak "
                               f"{_mb(parse['peak_rss'])}; {len(parses)} runs beside the "
                               f"phases below: {spread[0]:.1f}-{spread[-1]:.1f} s; limit: the typed "
                               f"decode alone (msgspec, each record's own checks, in C) runs at "
                               f"{raw['seconds'] / dec['seconds']:.0%} of JSON only, and the checks "
                               f"across records (Python) take {1 - dec['seconds'] / parse['seconds']:.0%}"
                               f" of the parse",
         ">= 150 MB/s and >= 60% of JSON only"),
        (f"replay (counters, blocks, invariants), default: {rep['workers']} worker(s)",
         f"{rep['seconds']:.1f} s, {steps / rep['seconds']:,.0f} steps/s, "
         f"{tokens / rep['seconds']:,.0f} tokens/s = {rep['floor'] / rep['seconds']:.1%} of parse "
         f"({rep['floor']:.1f} s beside it), {eng['seconds'] / rep['seconds']:.2f}x engine speed; "
         f"peak {_mb(rep['peak_rss'])}; {_workers_mb(rep['worker_peak_rss'])}; limit: the "
         f"reference scheduler alone (the embedded engine, no record built or written) takes "
         f"{alone['seconds']:.2f} s = {rep['floor'] / alone['seconds']:.0%} of parse; "
         + (f"with a worker, as here, this process decodes (the worker checks across records) "
            f"and then schedules: decode + the reference alone = "
            f"{rep['floor'] / (dec['seconds'] + alone['seconds']):.0%} of parse"
            if rep["workers"] else
            f"in one process, as here, replay parses and then schedules: parse + the reference "
            f"alone = {rep['floor'] / (rep['floor'] + alone['seconds']):.0%} of parse"),
         ">= 50% of parse"),
        ("replay (counters, blocks, invariants), all in one process",
         f"{rep1['seconds']:.1f} s, {steps / rep1['seconds']:,.0f} steps/s, "
         f"{tokens / rep1['seconds']:,.0f} tokens/s = {rep1['floor'] / rep1['seconds']:.1%} of parse "
         f"({rep1['floor']:.1f} s beside it); peak {_mb(rep1['peak_rss'])}", ""),
    ]
    for dev, rep_kv, rep_kv1 in rep_kvs:
        rows.append((f"replay + KV check ({dev}), default: {rep_kv['workers']} worker(s)",
                     f"{rep_kv['seconds']:.1f} s, {steps / rep_kv['seconds']:,.0f} steps/s, "
                     f"{rep_kv['slots'] / rep_kv['seconds'] / 1e6:,.1f} M slots/s verified = "
                     f"{rep_kv['floor'] / rep_kv['seconds']:.1%} of parse ({rep_kv['floor']:.1f} s beside it); "
                     f"peak {_mb(rep_kv['peak_rss'])}; {_workers_mb(rep_kv['worker_peak_rss'])}; "
                     f"CPU {rep_kv['cpu']:.1f} s main, {rep_kv['worker_cpu']:.1f} s worker(s)",
                     ">= 50% of parse"))
        rows.append((f"replay + KV check ({dev}), all in one process",
                     f"{rep_kv1['seconds']:.1f} s, {steps / rep_kv1['seconds']:,.0f} steps/s, "
                     f"{rep_kv1['slots'] / rep_kv1['seconds'] / 1e6:,.1f} M slots/s verified = "
                     f"{rep_kv1['floor'] / rep_kv1['seconds']:.1%} of parse ({rep_kv1['floor']:.1f} s beside it);"
                     f" peak {_mb(rep_kv1['peak_rss'])}", ""))
    rows += [
        ("replay memory (one process), flat?", f"{_mb(rep_small['peak_rss'])} at {rep_small['steps']:,} steps"
                                               f" vs {_mb(rep1['peak_rss'])} at {steps:,} steps "
                                               f"({rep1['peak_rss'] / rep_small['peak_rss']:.2f}x)", "flat"),
        (f"diff (trace with itself), default: {dif['workers']} worker(s)",
         _diff_figure(size, dif, raw) + f"; peak {_mb(dif['peak_rss'])}; "
         f"{_workers_mb(dif['worker_peak_rss'])}; limit: diff parses both inputs checked, as "
         f"replay does: the two parses beside it take {2 * dif['floor']:.1f} s = "
         f"{2 * dif['floor'] / raw['seconds'] / 2:.1f}x the budget (JSON-decoding both inputs, "
         f"{2 * raw['seconds']:.1f} s); the aligner alone (diff in one process less parsing "
         f"both inputs) takes {align_s:.1f} s",
         ">= 50% of JSON only per input"),
        ("diff (trace with itself), all in one process", _diff_figure(size, dif1, raw)
         + f"; peak {_mb(dif1['peak_rss'])}", ""),
    ]
    for dev in ["cpu"] + (["cuda"] if "cuda" in kv_devices else []):
        for batch in (64, 512):
            d = _child("kv_digests", device=dev, batch=batch)
            rows.append((f"KV audit digests ({dev}, {batch} blocks of 2 MiB a call)",
                         f"{d['digest_gbs']:.2f} GB/s = {d['digest_gbs'] / d['copy_gbs']:.0%} of the "
                         f"memory bandwidth ({d['copy_gbs']:.1f} GB/s, a copy of as many bytes), "
                         + (("one kernel in C (the compiled path)" if dev == "cpu" else
                             "one Triton kernel") if d["kernel"] else
                            f"no kernel ({d['kernel_off']})")
                         + (f"; the kernel alone (by CUDA's clock, launches back to back) "
                            f"{d['kernel_gbs']:.1f} GB/s = {d['kernel_gbs'] / d['copy_gbs']:.0%} "
                            f"(it reads each byte once, where the copy reads and writes each)"
                            if d.get("kernel_gbs") else "")
                         + f"; the gather alone {d['gather_gbs']:.1f} GB/s"
                         + f"; {d['array_name']}, which it falls back on, {d['array_gbs']:.2f} "
                           f"GB/s = {d['array_gbs'] / d['copy_gbs']:.0%}"
                         + (f" (their limit: ten array passes over each chunk in the core's "
                            f"cache, one pass alone {d['pass_gbs']:.1f} GB/s: at most "
                            f"{d['pass_gbs'] / 10:.1f} GB/s)" if dev == "cpu" else ""),
                         ">= 25% of the memory bandwidth"))
    for dev, b in bounds:
        ceiling = b["bound_slots_per_s"]
        rows.append((f"shadow-KV gather-and-compare ({dev}: {b['backend']}, 1 thread)",
                     f"{b['check_slots_per_s'] / 1e6:,.0f} M slots/s compared = "
                     f"{b['check_slots_per_s'] / ceiling:.1%} of the bandwidth bound "
                     f"({b['bandwidth'] / 1e9:.1f} GB/s / 16 B = {ceiling / 1e6:,.0f} M slots/s); "
                     f"limit: the check's own array ops alone (two row gathers, a compare, "
                     f"indices built beforehand) on a step's slots run at "
                     f"{b['rows_slots_per_s'] / 1e6:,.0f} M slots/s = "
                     f"{b['rows_slots_per_s'] / ceiling:.1%} of the bound; the check's array "
                     f"work (those ops, the index arithmetic that finds each row's block and "
                     f"expected row, the expected fingerprints) takes {b['array_share']:.0%} of "
                     f"its time, its Python the rest; slot by slot, a bare indexed gather and "
                     f"compare runs at {b['gather_slots_per_s'] / ceiling:.1%}",
                     ">= 25% of the bandwidth bound"))
    width = max(len(r[0]) for r in rows)
    machine = f"{os.cpu_count()} CPU cores"
    if "cuda" in kv_devices:
        machine += f", {_child('cuda')['name']}"
    print(f"kvtrace benchmark ({time.perf_counter() - t_start:.0f} s on {machine}, traces in {work})")
    for name, figure, limit in rows:
        print(f"  {name:<{width}}  {figure}" + (f"   [target {limit}]" if limit else ""))
    _flight(args, n)


def _flight(args, n: int) -> None:
    """The flight recorder's figures, each printed by its own bench beside its
    targets: one long trace split at its keyframes against its serial replay
    (bench/split.py), and what keyframes cost a recording (bench/keyframes.py
    --overhead: the embedded engine, and a vLLM engine unless --no-vllm)."""
    rounds = "0" if args.no_vllm else "5" if args.quick else "15"
    runs = [("split replay of one long trace", ["bench.split", "--requests", str(max(n // 5, 2000)),
                                                "--rounds", "1" if args.quick else "3"]),
            ("keyframes' cost to the recorder",
             ["bench.keyframes", "--overhead", "--rounds", rounds])]
    for title, cmd in runs:
        print(f"\n{title} (python -m {' '.join(cmd)}):", flush=True)
        subprocess.run([sys.executable, "-m", *cmd], cwd=HERE.parent, check=False)


def _diff_figure(size: dict, dif: dict, raw: dict) -> str:
    per_input = size["plain_bytes"] / dif["seconds"] / 1e6
    return (f"{dif['seconds']:.1f} s, {per_input:,.1f} MB/s of trace text per input = "
            f"{raw['seconds'] / dif['seconds']:.0%} of JSON only, "
            f"{2 * dif['floor'] / dif['seconds']:.0%} of parsing both inputs "
            f"({size['plain_bytes'] / dif['floor'] / 2e6:,.1f} MB/s per input, beside it)")


if __name__ == "__main__":
    main()
