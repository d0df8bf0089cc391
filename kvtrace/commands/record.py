"""``kvtrace record``: the embedded engine, an offline vLLM run, or any command."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click

from kvtrace.catalog import (EMBEDDED_FAULT_WORKLOADS, EMBEDDED_FAULTS, EMBEDDED_WORKLOADS,
                             VLLM_FAULT_WORKLOADS, VLLM_FAULTS, pairs)
from kvtrace.writing import blamed_on

from ._common import (EXIT_NOTHING, EXIT_OK, VLLM_HINT, Bounded, FilePath, Size, UsageProblem,
                      echo, importing, require_vllm, say, trace_output)
from .progress import progress

WORKLOADS = tuple(EMBEDDED_WORKLOADS)
FAULTS = tuple(EMBEDDED_FAULTS)
SEEDS = Bounded(0, 2 ** 64 - 1, "a seed is from 0 to 2^64-1")
MAX_REQUESTS = 1_000_000
REQUESTS = Bounded(1, MAX_REQUESTS, f"from 1 to {MAX_REQUESTS:,} requests")
STDOUT_REFUSED = ("'-' (standard output) is not accepted: a trace is written to a file, "
                  "which can be read while it grows")


@click.command(context_settings={"allow_interspersed_args": False})
@click.option("-o", "--out", "out", required=True,
              type=FilePath(no_dash=STDOUT_REFUSED, dir_okay=True),
              help="Trace file to write (.jsonl, .jsonl.gz or .jsonl.zst); with --ring, the "
                   "directory of segments to write.")
@click.option("--workload", default=None,
              help=f"Built-in workload. Embedded engine: {', '.join(WORKLOADS)} (default "
                   f"{WORKLOADS[0]}, or the one that shows --fault). vLLM: prefix, preemption, "
                   "connector, speculative and more (default: prefix, or the fault's). "
                   "docs/reference/catalog.md lists them all.")
@click.option("--fault", default=None,
              help="Put a known scheduler bug back in; each runs, without --workload, the "
                   "workload in parentheses, which shows it. Embedded engine: "
                   f"{pairs(EMBEDDED_FAULTS, EMBEDDED_FAULT_WORKLOADS)}. vLLM (a scheduler "
                   f"subclass): {pairs(VLLM_FAULTS, VLLM_FAULT_WORKLOADS)}.")
@click.option("--seed", type=SEEDS, default=None,
              help="Seed of the embedded engine's workload and sampler: 0 to 2^64-1 (default "
                   "0). The vLLM workloads are fixed: with --engine vllm or a command it is "
                   "refused.")
@click.option("--requests", type=REQUESTS, default=None, metavar="N",
              help="Make the embedded engine's workload of N requests (default: its own, 16 to "
                   "28), to scale a fault up. Refused with --engine vllm or a command.")
@click.option("--engine", type=click.Choice(("embedded", "vllm")), default="embedded",
              show_default=True, help="Engine to record.")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Model directory for --engine vllm (default: a tiny random-weight Llama, "
                   "built locally).")
@click.option("--async-scheduling", "async_scheduling", is_flag=True,
              help="Schedule step N+1 before step N's output is back, as vLLM's AsyncScheduler "
                   "does (the default on GPUs).")
@click.option("--redact", is_flag=True,
              help="Replace token ids with keyed pseudonyms in the written trace.")
@click.option("--keyframe-every", "keyframe_every", type=click.IntRange(min=1), default=None,
              metavar="N", help="Write a keyframe before every N-th step (replay --from-step "
                                "starts there). A vLLM engine: KVTRACE_KEYFRAME_EVERY.")
@click.option("--ring", type=Size(), default=None, metavar="SIZE",
              help="Always-on: -o is a directory of segments, each replayable alone, that never "
                   "holds more than SIZE (2GB); the oldest go first, those around a trigger are "
                   "kept. A vLLM engine: KVTRACE_RING.")
@click.option("--segment", type=Size(), default=None, metavar="SIZE",
              help="With --ring: the size of a segment (default: an eighth of the ring).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def command(out: Path, workload: str | None, fault: str | None, seed: int | None,
            requests: int | None, engine: str, model: Path | None, async_scheduling: bool,
            redact: bool, keyframe_every: int | None, ring: int | None, segment: int | None,
            command: tuple[str, ...]) -> int:
    """Record a trace, from the embedded engine, an offline vLLM run, or any
    command given after -- (for example a vLLM server).

    \b
    kvtrace record -o run.jsonl.gz --workload offload --fault async-load-overshoot
    kvtrace record -o big.jsonl.gz --workload offload --requests 500
    kvtrace record -o run.jsonl.gz --engine vllm --workload preemption
    kvtrace record -o run.jsonl.gz -- python -m vllm.entrypoints.openai.api_server --model DIR
    """
    flight = Flight(keyframe_every, ring, segment)
    # A vLLM engine takes them from its environment: its writer process makes
    # the keyframes and writes the segments.
    with _environ(flight.env() if command or engine == "vllm" else {}):
        return _record(out, workload, fault, seed, requests, engine, model, async_scheduling,
                       redact, flight, command)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``values`` in the environment while the recording runs."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _record(out: Path, workload: str | None, fault: str | None, seed: int | None,
            requests: int | None, engine: str, model: Path | None, async_scheduling: bool,
            redact: bool, flight: "Flight", command: tuple[str, ...]) -> int:
    if flight and redact:   # keyframes hold token ids: redact leaves them out
        raise UsageProblem("--redact with --keyframe-every or --ring: keyframes hold token ids, "
                           "which redact leaves out; redact the traces you keep")
    if flight.ring and out.exists() and not out.is_dir():
        raise UsageProblem(f"{out} is a file: --ring writes a directory of segments (name a new "
                           "directory)")
    if not flight.ring:
        if out.is_dir():
            raise UsageProblem(f"{out} is a directory: a trace is one file (--ring writes a "
                               "directory of segments)")
        trace_output(out)
    target = out.with_name(out.name + ".plain") if redact else out
    if seed is not None and (command or engine == "vllm"):
        raise UsageProblem("--seed applies to the embedded engine only: the vLLM workloads "
                           "are fixed")
    if requests is not None and (command or engine == "vllm"):
        raise UsageProblem("--requests applies to the embedded engine only: the vLLM workloads "
                           "are fixed")
    if command:
        if fault or workload or model or async_scheduling:
            raise UsageProblem("--workload, --fault, --model and --async-scheduling do not apply "
                               "to a command after --")
        with importing("the vLLM recorder", VLLM_HINT):
            from kvtrace.lab.run import record_command
        before = _stat(target)
        code = int(record_command(target, list(command)) or 0)
        after = _stat(target)
        if after is None or after == before:   # no recording vLLM engine wrote it
            if code != 127:   # (not started: record_command said so)
                say(f"no trace written to {out}: the command exited with status {code} and "
                    "started no recording vLLM engine (it runs no vLLM, or its Python has no "
                    "kvtrace)")
            return code or EXIT_NOTHING
    elif engine == "vllm":
        try:
            _record_vllm(target, workload, fault, model, async_scheduling)
        except Exception as e:
            from kvtrace.lab.run import EngineFailed

            if redact and isinstance(e, EngineFailed):   # the trace up to the failure, redacted
                _redact(target, out)
                raise EngineFailed(str(out), e.error) from e
            raise
        code = EXIT_OK
    else:
        _record_embedded(target, workload, fault, seed or 0, requests, model, async_scheduling,
                         flight)
        code = EXIT_OK
    if redact:
        _redact(target, out)
    echo(f"wrote {out}")
    return code


def _stat(path: Path) -> tuple | None:
    """What tells a file written now from the one that was there: None when
    there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _redact(plain: Path, out: Path) -> None:
    from kvtrace.redact import redact_file

    redact_file(plain, out)
    plain.unlink()


class Flight:
    """What --keyframe-every, --ring and --segment ask for."""

    def __init__(self, every: int | None, ring: int | None, segment: int | None):
        if segment is not None and ring is None:
            raise UsageProblem("--segment needs --ring")
        if ring is not None:
            segment = segment or ring // 8
            if ring < 2 * segment:
                raise UsageProblem(f"--ring {ring:,} bytes holds less than two segments of "
                                   f"{segment:,}")
        self.every, self.ring, self.segment = every, ring, segment

    def __bool__(self) -> bool:
        return self.every is not None or self.ring is not None

    def env(self) -> dict[str, str]:
        """The same, as a vLLM engine's recorder reads them from its environment."""
        from kvtrace.record.folder import ENV_RING, ENV_SEGMENT
        from kvtrace.record.sink import ENV_KEYFRAME_EVERY

        env = {}
        if self.every is not None:
            env[ENV_KEYFRAME_EVERY] = str(self.every)
        if self.ring is not None:
            env[ENV_RING], env[ENV_SEGMENT] = str(self.ring), str(self.segment)
        return env

    def args(self) -> list[str]:
        """The same, as the flight recorder's writer process takes them."""
        args = ["--keyframe-every", str(self.every)] if self.every is not None else []
        if self.ring is not None:
            args += ["--ring", str(self.ring), "--segment", str(self.segment)]
        return args

    def writer(self):
        """How the embedded engine's trace is opened: by a writer process that
        keeps every completed step from a kill, the flight recorder's when
        keyframes or a ring are asked for (it makes them, beside the
        engine); in this process when no writer process can be started."""
        from kvtrace.record.step_writer import open_step_writer

        if not self:
            return open_step_writer
        return lambda path, header: open_step_writer(path, header, self.args(),
                                                     self.in_process)

    def in_process(self, path, header):
        """The flight recorder's writers in this process, on ``TraceWriter``s."""
        from kvtrace.flight import flight_writer

        return flight_writer(path, header, self.every, self.ring, self.segment, on_pin=say)


def _record_embedded(out: Path, workload: str | None, fault: str | None, seed: int,
                     requests: int | None, model: Path | None, async_scheduling: bool,
                     flight: Flight | None = None) -> None:
    if model is not None:
        raise UsageProblem("--model needs --engine vllm")
    if fault is not None and fault not in FAULTS:
        raise UsageProblem(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    from kvtrace.engine import FAULT_WORKLOADS, build_workload, record_workload
    from kvtrace.engine.workloads import under_async_scheduling

    workload = workload or (FAULT_WORKLOADS[fault] if fault else WORKLOADS[0])
    if workload not in WORKLOADS:
        raise UsageProblem(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    wl = build_workload(workload, seed, requests)
    if async_scheduling:
        wl = under_async_scheduling(wl)
    with progress(f"recording {out.name}", "steps") as advance, blamed_on(out):
        try:
            # Each completed step goes to a writer process: a kill loses none.
            res = record_workload(out, wl, fault, seed, progress=advance,
                                  open_writer=(flight or Flight(None, None, None)).writer())
        except ValueError as e:   # a combination the engine does not run
            raise UsageProblem(str(e)) from None
    if fault and not res.fault_log:
        say(f"the fault {fault} never fired in workload {workload}: the trace is a clean run "
            f"(it fires in {FAULT_WORKLOADS[fault]})")


def _record_vllm(out: Path, workload: str | None, fault: str | None, model: Path | None,
                 async_scheduling: bool) -> None:
    require_vllm()
    with importing("the vLLM recorder", VLLM_HINT):
        from kvtrace.lab.run import UnknownChoice, record_named
    try:
        record_named(out, workload, fault, None if model is None else str(model), async_scheduling)
    except UnknownChoice as e:
        raise UsageProblem(str(e)) from None
