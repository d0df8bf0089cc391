"""The ``kvtrace`` command: parse arguments, call one function, turn errors into exit codes.

Exit codes: 0 no divergence (or a successful recording), 1 divergences, 2 unusable
input or bad usage, 3 an internal error (KVTRACE_DEBUG=1 prints its traceback).
Engines, recorders and the replayer are imported only by the command that needs
them, so ``kvtrace diff`` never loads torch or vLLM.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from pathlib import Path

import click

EXIT_OK, EXIT_DIVERGENT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3

WORKLOADS = ("shared-prefix", "kv-pressure", "offload", "load-failures")
# The vLLM recorder's workloads, under the embedded engine's names where they match.
_VLLM_ALIASES = {"shared-prefix": "prefix", "kv-pressure": "preemption"}
_VLLM_HINT = "; recording vLLM needs the [vllm] extra: pip install -e '.[vllm]'"
FAULTS = (
    "stale-cached-on-preempt",
    "negative-external-on-invalid-blocks",
    "stale-computed-after-failed-schedule",
    "no-reload-after-preempt",
    "async-load-overshoot",
)


class UsageProblem(Exception):
    """Arguments that make sense to click but not together."""

    exit_code = EXIT_BAD_INPUT


class Unavailable(Exception):
    """A part of kvtrace (or an optional dependency) that this install lacks."""

    exit_code = EXIT_INTERNAL


def _load(module: str, name: str, hint: str = ""):
    """Import ``module.name`` when a command needs it, with a one-line error if it cannot."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        missing = getattr(e, "name", None) or ""
        if missing.split(".")[0] != "vllm":
            hint = ""
        raise Unavailable(f"{module}.{name} is not available ({e}){hint}") from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtrace", prog_name="kvtrace")
def cli() -> None:
    """Record, replay and diff the KV-cache scheduling decisions of vLLM V1."""


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Trace file to write (.jsonl, .jsonl.gz or .jsonl.zst).")
@click.option("--workload", default=None,
              help=f"Built-in workload. Embedded engine: {', '.join(WORKLOADS)} (default "
                   f"{WORKLOADS[0]}). vLLM: prefix, preemption, connector (default prefix).")
@click.option("--fault", type=click.Choice(FAULTS), default=None,
              help="Put a known scheduler bug back into the embedded engine.")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload and sampler seed.")
@click.option("--engine", type=click.Choice(("embedded", "vllm")), default="embedded",
              show_default=True, help="Engine to record.")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Model directory for --engine vllm (default: a tiny random-weight Llama, "
                   "built locally).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record(out: Path, workload: str | None, fault: str | None, seed: int, engine: str,
           model: Path | None, command: tuple[str, ...]) -> int:
    """Record a trace, from the embedded engine, an offline vLLM run, or any
    command given after -- (for example a vLLM server).

    \b
    kvtrace record -o run.jsonl.gz --workload offload --fault async-load-overshoot
    kvtrace record -o run.jsonl.gz --engine vllm --workload preemption
    kvtrace record -o run.jsonl.gz -- python -m vllm.entrypoints.openai.api_server --model DIR
    """
    if command:
        if fault or workload or model:
            raise UsageProblem("--workload, --fault and --model do not apply to a command after --")
        record_command = _load("kvtrace.record.vllm_run", "record_command", _VLLM_HINT)
        return int(record_command(out, list(command)) or 0)
    if engine == "vllm":
        if fault:
            raise UsageProblem("--fault applies to the embedded engine only")
        record_vllm_offline = _load("kvtrace.record.vllm_run", "record_vllm_offline", _VLLM_HINT)
        known = _load("kvtrace.record.vllm_run", "WORKLOADS")
        name = _VLLM_ALIASES.get(workload or "prefix", workload or "prefix")
        if name not in known:
            raise UsageProblem(f"unknown vLLM workload {workload!r}; known: {', '.join(known)}")
        record_vllm_offline(None if model is None else str(model), out, name)
    else:
        if model is not None:
            raise UsageProblem("--model needs --engine vllm")
        workload = workload or WORKLOADS[0]
        if workload not in WORKLOADS:
            raise UsageProblem(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
        record_embedded = _load("kvtrace.engine", "record_embedded")
        record_embedded(out, workload=workload, fault=fault, seed=seed)
    click.echo(f"wrote {out}")
    return EXIT_OK


@cli.command()
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the replayed trace (the reference's decisions) here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--device", type=click.Choice(("auto", "cpu", "cuda")), default="auto",
              show_default=True, help="Where the shadow KV-content check runs.")
def replay(trace: Path, out: Path | None, as_json: bool, device: str) -> int:
    """Replay TRACE through the reference scheduler and report divergences.

    Exit 0 when the trace matches, 1 when it diverges, 2 when it is unusable.
    """
    from kvtrace.report import terminal

    replay_file = _load("kvtrace.replay", "replay_file")

    kwargs: dict = {"out": out}
    if device != "auto":
        if "device" not in inspect.signature(replay_file).parameters:
            raise UsageProblem("--device is not supported by this replayer")
        kwargs["device"] = device
    result = replay_file(trace, **kwargs)
    if as_json:
        sys.stdout.buffer.write(terminal.replay_json(result, str(trace)))
        sys.stdout.flush()
    else:
        terminal.print_replay(result, str(trace))
    return EXIT_DIVERGENT if result.divergences else EXIT_OK


@cli.command()
@click.argument("a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--match", type=click.Choice(("auto", "id", "id-prefix", "arrival")), default="auto",
              show_default=True,
              help="Pair requests by id, by id without vLLM's random suffix, or by order of "
                   "arrival; auto picks from the first arrivals.")
def diff(a: Path, b: Path, as_json: bool, match: str) -> int:
    """Compare trace A with trace B, request by request.

    Requests are aligned by id and by their own scheduling history, so traces
    whose global step numbering differs still line up. Values from A are shown
    as "recorded", values from B as "expected". Exit 0 when they agree, 1 when
    they differ, 2 when a file is unusable.
    """
    from kvtrace.diff import diff_files
    from kvtrace.report import terminal

    result = diff_files(a, b, match=match)
    if as_json:
        sys.stdout.buffer.write(terminal.diff_json(result))
        sys.stdout.flush()
    else:
        terminal.print_diff(result)
    return EXIT_DIVERGENT if result.divergences else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Never shows a traceback unless KVTRACE_DEBUG=1."""
    code = run(argv)
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    debug = os.environ.get("KVTRACE_DEBUG", "") not in ("", "0")
    try:
        rv = cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
        return rv if isinstance(rv, int) else EXIT_OK
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:  # usage errors: click's own message, exit 2
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        _say("interrupted")
        return 130
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK
    except Exception as e:
        if debug:
            traceback.print_exc()
        code = getattr(e, "exit_code", None)
        if isinstance(code, int) and not isinstance(code, bool):
            _say(_one_line(str(e)) or type(e).__name__)
            return code
        hint = "" if debug else " (set KVTRACE_DEBUG=1 for the traceback)"
        _say(f"internal error: {type(e).__name__}: {_one_line(str(e))}{hint}")
        return EXIT_INTERNAL


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


def _say(msg: str) -> None:
    try:
        print(f"kvtrace: {msg}", file=sys.stderr, flush=True)
    except Exception:
        pass


def _quiet_stdout() -> None:
    # The reader of our output went away (e.g. `| head`); keep Python from
    # complaining again while it flushes stdout at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except Exception:
        pass


if __name__ == "__main__":
    main()
