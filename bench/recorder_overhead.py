"""Recorder overhead on a real vLLM engine.

One engine is built with the kvtrace recorder wrapped around its scheduler
(exactly what the vLLM plugin does when KVTRACE_OUT is set, writer process
included). Each round gives fresh prompts to that engine four times, in a
rotating order: once recording, twice with the recorder detached from the
scheduler (the recording scheduler's hooks then do nothing), and once with the
floor below in the recorder's place. The prefix cache is emptied before each
run, so that all four do the same work. The figure is the
median over rounds of recorded / unrecorded wall time of ``LLM.generate``; the
median of unrecorded / unrecorded is printed next to it, as the noise floor of
the same run. The limit is the engine's own time: the target is a ratio of at
most 1.03.

A few more recorded rounds then time the recorder's own work in the engine's
process: on the engine's thread, timed around its hooks (capture, block ids,
JSON lines, copying them into the ring), and the writer thread's CPU
time (lines that waited for room in the ring). Their sum per step,
against the engine's step, is the same figure measured directly; it does not
move with the machine's noise, but it leaves out what the recorder costs the
engine indirectly (caches, allocation).

The floor, each round's fourth arm, is the least capture in Python of the
same facts through the same hooks (``_Floor``), timed by the wall clock as
the others and directly around its hooks. It is below any recorder that keeps
the trace whole: its median ratio is where the wall-clock figure of a
recorder in Python on the engine's thread starts on this engine.

Using one engine for both sides matters on a small machine: two engines in one
process differ by a few percent from each other, recorder or not. After warm-up
the heap is frozen (vLLM's own ``freeze_gc_heap``, which its engine calls after
start-up), so that a full garbage collection of the model's objects does not
land in a random round. Torch gets one core fewer than the machine has, unless
OMP_NUM_THREADS says otherwise: vLLM's CPU backend itself reserves a core for
its scheduler process; in this in-process engine, torch's threads would
otherwise spin on every core, and any other thread would stall them.

    python -m bench.recorder_overhead [--rounds 101] [--requests 16] [--model tiny|small]

``--model small`` runs the same rounds on a larger random model
(``kvtrace.lab.tiny_model.SIZES``), whose step, 10-20 ms on a CPU core, is
mostly the model's, as a real model's step on a GPU is. The recorder's work per
step is the same on both (it grows with the requests in a step, not with the
model), so the tiny model shows its largest share of a step, and the small one
a share closer to a real engine's.

Needs the [vllm] extra.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

TARGET = 1.03
# A pause after each run, outside the timing: the writer process (which reads
# the ring every 20 ms) would otherwise write the last lines in whichever run
# comes next. In a serving engine it overlaps the engine's own work like the
# rest of the writer's.
SETTLE_S = 0.1


def _prompts(rnd: random.Random, n: int) -> list[list[int]]:
    families = [[rnd.randrange(1, 500) for _ in range(40)] for _ in range(4)]
    return [families[i % 4] + [rnd.randrange(1, 500) for _ in range(rnd.randrange(8, 40))]
            for i in range(n)]


def _scheduler(llm):
    """The engine core's scheduler, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run(rounds: int = 101, requests: int = 16, max_tokens: int = 48, suffix: str = ".jsonl.zst",
        model: str = "tiny") -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ.setdefault(var, str(scratch / var.lower()))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.utils.gc_utils import freeze_gc_heap

    from kvtrace.record.vllm import plugin as vllm_plugin
    from kvtrace.lab.tiny_model import ensure_tiny_model
    from kvtrace.lab.run import shutdown_llm
    from kvtrace.lab.workloads import BASE_ENGINE

    vllm_plugin.install()
    model_dir = str(ensure_tiny_model(size=model))
    engine = dict(BASE_ENGINE, num_gpu_blocks_override=48, max_num_seqs=16)
    # KVTRACE_RING set (bench/keyframes.py --overhead --ring): a directory of segments.
    trace = scratch / ("ring" if os.environ.get("KVTRACE_RING") else f"overhead{suffix}")
    os.environ["KVTRACE_OUT"] = str(trace)
    try:
        llm = LLM(model=model_dir, **engine)
    finally:
        os.environ.pop("KVTRACE_OUT", None)
    sched = _scheduler(llm)
    rec = sched._kvtrace
    if rec is None:
        raise SystemExit("the recorder did not attach to the engine's scheduler")

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rnd = random.Random(0)

    cpu: dict[str, float] = {}

    floor = _Floor(rec)

    def timed(prompts, recording: bool, name: str = "") -> float:
        sched._kvtrace = rec if recording else None
        if name == "f":
            floor.install()
        llm.reset_prefix_cache()
        c = time.thread_time()
        t = time.perf_counter()
        try:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                         use_tqdm=False)
        finally:
            if name == "f":
                floor.remove()
        elapsed = time.perf_counter() - t
        cpu[name] = time.thread_time() - c
        time.sleep(SETTLE_S)
        return elapsed

    for recording in (False, True):
        timed(_prompts(rnd, requests), recording)
    freeze_gc_heap()
    ratios, controls, plain_s, rec_s, floor_ratios = [], [], [], [], []
    floor_wall = 0.0
    cpu_ratios, cpu_controls = [], []
    steps_before = rec.step_index
    for i in range(rounds):
        prompts = _prompts(rnd, requests)
        order = [("u", False), ("r", True), ("u2", False), ("f", True)]
        order = order[i % 4:] + order[:i % 4]     # rotate who goes first
        t = {name: timed(prompts, recording, name) for name, recording in order}
        floor_ratios.append(t["f"] / t["u"])
        floor_wall += t["f"]
        cpu_ratios.append(cpu["r"] / cpu["u"])
        cpu_controls.append(cpu["u2"] / cpu["u"])
        plain_s.append(t["u"])
        rec_s.append(t["r"])
        ratios.append(t["r"] / t["u"])
        controls.append(t["u2"] / t["u"])
    steps_per_round = (rec.step_index - steps_before) / rounds
    capture_us, writer_us, wall_us = _own_cost(rec, lambda: timed(_prompts(rnd, requests), True))
    if not rec.active or rec.failed:   # its figures would be an idle recorder's
        raise SystemExit(f"the recorder stopped during the rounds: {rec.failed}")
    floor_us = 1e6 * floor.spent / max(floor.steps, 1)
    floor_wall_us = 1e6 * floor_wall / max(floor.steps, 1)
    sched._kvtrace = rec
    shutdown_llm(llm)
    q = statistics.quantiles(ratios, n=4)
    cq = statistics.quantiles(cpu_ratios, n=4)
    return {
        "model": model,
        "steps_per_round": steps_per_round,
        "engine_ms_per_step": 1e3 * statistics.median(plain_s) / steps_per_round,
        "recorder_us_per_step": 1e6 * (statistics.median(rec_s) - statistics.median(plain_s)) / steps_per_round,
        "rounds": rounds,
        "requests_per_round": requests,
        "unrecorded_s_median": statistics.median(plain_s),
        "recorded_s_median": statistics.median(rec_s),
        "ratio_median": statistics.median(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "control_median": statistics.median(controls),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_q1": cq[0],
        "cpu_ratio_q3": cq[2],
        "cpu_control_median": statistics.median(cpu_controls),
        "capture_us_per_step": capture_us,
        "writer_us_per_step": writer_us,
        "own_wall_us_per_step": wall_us,
        # The same rounds' wall time against it less the recorder's own work.
        "own_ratio": wall_us / (wall_us - capture_us - writer_us) if wall_us else 0.0,
        # The least capture in Python (``_Floor``), an arm of each round.
        "floor_us_per_step": floor_us,
        "floor_own_ratio": floor_wall_us / (floor_wall_us - floor_us) if floor_wall_us else 0.0,
        "floor_ratio_median": statistics.median(floor_ratios),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "trace_bytes": trace.stat().st_size if trace.exists() else 0,
        "target": TARGET,
    }


def _own_cost(rec, one_round, rounds: int = 20) -> tuple[float, float, float]:
    """Microseconds per step of the recorder's work in the engine's process, over
    extra recorded rounds (the timed rounds above run unwrapped): capture on the
    engine's thread, timed around its hooks, and the writer thread's CPU time;
    and the wall time per step of those same rounds. The writer process's work
    is in neither: it runs outside the engine's process and its GIL. Measuring
    the engine in the same rounds keeps the ratio clear of this kind of
    machine's drift, which moves the engine and the hooks alike."""
    names = ("begin_step", "on_schedule", "pre_update", "post_update", "on_add_request")
    spent = [0.0]
    writer = [0.0]
    originals = {name: getattr(rec, name) for name in names}

    def timed_hook(fn):
        def hook(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[0] += time.perf_counter() - t
        return hook

    sink = rec.sink
    # The writer thread's share: moving lines that waited for room into the
    # ring (ProcessSink), or all of the writing (TraceSink, KVTRACE_WRITER=thread).
    wrapped = [name for name in ("_move_waiting", "_write") if hasattr(sink, name)]

    def thread_timed(fn):
        def work(*args):
            if threading.current_thread() is not sink._thread:
                return fn(*args)     # on the engine's thread: inside a timed hook
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                writer[0] += time.thread_time() - t
        return work

    for name, fn in originals.items():
        setattr(rec, name, timed_hook(fn))
    for name in wrapped:
        setattr(sink, name, thread_timed(getattr(sink, name)))
    before = rec.step_index
    wall = 0.0
    try:
        for _ in range(rounds):
            wall += one_round()
        time.sleep(3 * sink.POLL_S)   # the writer's last batch
    finally:
        for name in names:
            delattr(rec, name)
        for name in wrapped:
            delattr(sink, name)
    steps = rec.step_index - before
    if not steps:
        return 0.0, 0.0, 0.0
    return 1e6 * spent[0] / steps, 1e6 * writer[0] / steps, 1e6 * wall / steps


class _Floor:
    """The least a recorder in Python does on the engine's thread: through the
    same hooks, it reads the facts a trace's records hold, with as few
    operations as Python allows, and encodes them as one JSON line each into
    memory. An arrival: its id, prompt and sampling parameters. After
    ``schedule``: the output's own columns (ids, computed and scheduled tokens,
    new block ids, preempted and finished ids) and each scheduled request's
    state (status, computed tokens, tokens, preemptions, its table's length). After
    ``update_from_output``: the sampled tokens, each output's id and finish
    reason, and the same states. It reads no full block table, checks
    nothing, keeps no state between steps and writes nothing to the ring, so
    it is below any recorder that keeps the trace whole. ``install`` puts it
    in place of the recorder's hooks until ``remove``; ``spent`` and
    ``steps`` sum its time and steps."""

    def __init__(self, rec) -> None:
        import msgspec

        self.rec = rec
        self.spent = 0.0
        self.steps = 0
        self.lines = bytearray()
        encode = msgspec.json.Encoder(enc_hook=str).encode
        table = rec.table if rec.table is not None else {}
        lines = self.lines

        def states(sched, rids):
            read = rec.read_state   # the recorder's own reader, should it change
            reqs = list(map(sched.requests.get, rids))
            return [read(r) + (len(table.get(rid, ())),)
                    for rid, r in zip(rids, reqs) if r is not None]

        def on_add_request(request, chunk=False):
            t = time.perf_counter()
            sp = request.sampling_params
            lines.extend(encode((request.request_id, request.prompt_token_ids,
                                 sp.max_tokens if sp is not None else None)))
            self.spent += time.perf_counter() - t

        def on_schedule(sched, out):
            t = time.perf_counter()
            self.steps += 1
            cd = out.scheduled_cached_reqs
            nst = out.num_scheduled_tokens
            lines.extend(encode((
                [(r.req_id, r.num_computed_tokens, r.block_ids) for r in out.scheduled_new_reqs],
                cd.req_ids, cd.num_computed_tokens, cd.new_block_ids, nst,
                sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids),
                states(sched, list(nst)))))
            self.spent += time.perf_counter() - t

        def pre_update(sched, so, mro):
            t = time.perf_counter()
            ctx = (list(so.num_scheduled_tokens), mro.sampled_token_ids, mro.req_id_to_index)
            self.spent += time.perf_counter() - t
            return ctx

        def post_update(sched, ctx, result):
            t = time.perf_counter()
            rids, toks, index = ctx
            done = [(o.request_id, o.finish_reason) for eco in (result or {}).values()
                    for o in eco.outputs if o.finish_reason is not None]
            lines.extend(encode((rids, toks, index, done, states(sched, rids))))
            self.spent += time.perf_counter() - t

        # Every hook that records on a step's path; the rare ones (resets,
        # aborts, pauses, drafts, the connector's answers) stay the recorder's.
        self.hooks = {"begin_step": lambda *args: None, "on_schedule": on_schedule,
                      "pre_update": pre_update, "post_update": post_update,
                      "on_add_request": on_add_request, "settle": lambda sched: None,
                      "on_preempt": lambda request: None, "on_stats": lambda stats: None}

    def install(self) -> None:
        for name, fn in self.hooks.items():
            setattr(self.rec, name, fn)

    def remove(self) -> None:
        for name in self.hooks:
            delattr(self.rec, name)
        del self.lines[:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=101)
    ap.add_argument("--requests", type=int, default=16)
    from kvtrace.lab.tiny_model import SIZES

    ap.add_argument("--model", default="tiny", choices=tuple(SIZES),
                    help="the random model's size (kvtrace.lab.tiny_model.SIZES)")
    ap.add_argument("--suffix", default=".jsonl.zst", help="trace file ending: .jsonl, .jsonl.gz, .jsonl.zst")
    args = ap.parse_args()
    r = run(args.rounds, args.requests, suffix=args.suffix, model=args.model)
    print(f"recorder overhead on vLLM, {r['model']} model ({r['rounds']} interleaved rounds of "
          f"{r['requests_per_round']} requests)")
    print(f"  unrecorded generate, median  {r['unrecorded_s_median']:.3f} s")
    print(f"  recorded generate, median    {r['recorded_s_median']:.3f} s")
    print(f"  ratio recorded/unrecorded    median {r['ratio_median']:.3f}  "
          f"(quartiles {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})  target <= {TARGET:.2f}")
    print(f"  noise floor: unrecorded/unrecorded median {r['control_median']:.3f}")
    print(f"  engine thread CPU time, recorded/unrecorded  median {r['cpu_ratio_median']:.3f}  "
          f"(quartiles {r['cpu_ratio_q1']:.3f}-{r['cpu_ratio_q3']:.3f}); noise floor "
          f"{r['cpu_control_median']:.3f}")
    print(f"  per step: engine {r['engine_ms_per_step']:.2f} ms, recorder {r['recorder_us_per_step']:.0f} us "
          f"({r['steps_per_round']:.0f} steps per round)")
    print(f"  measured directly: on the engine's thread {r['capture_us_per_step']:.0f} us + "
          f"writer thread {r['writer_us_per_step']:.0f} us per step of "
          f"{r['own_wall_us_per_step'] / 1e3:.2f} ms = {r['own_ratio']:.3f}x the engine's own time")
    print(f"  floor: the least capture in Python on the engine's thread (the same facts, "
          f"as few operations, no ring), an arm of each round: median "
          f"{r['floor_ratio_median']:.3f}x; directly {r['floor_us_per_step']:.0f} us per step "
          f"= {r['floor_own_ratio']:.3f}x the engine's own time")
    print(f"  torch threads (OMP_NUM_THREADS): {r['omp_threads']}")


if __name__ == "__main__":
    main()
