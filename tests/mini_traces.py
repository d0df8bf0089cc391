"""Small hand-made traces for format, diff and CLI tests, and the records of a
trace file as dicts, for tests that edit traces (``load_records``/``save_records``).

``write_mini_trace`` runs a toy schedule (whole-prompt prefill, then one token
per step, blocks handed out in order) and writes it with TraceWriter. The
numbers are self-consistent but do not come from the reference scheduler.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Callable

import orjson

from kvtrace.trace.events import (
    Arrival, Header, Output, PromptStats, PrefillStats, RequestState, ScheduledNew,
    ScheduledRunning, SchedulerConfig, Step,
)
from kvtrace.trace.io import TraceWriter

BLOCK = 4


def mini_header(**meta) -> Header:
    return Header(
        engine="embedded", engine_version="test",
        config=SchedulerConfig(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64,
                               max_num_seqs=8, max_model_len=128),
        meta=meta,
    )


def write_mini_trace(
    path: Path,
    *,
    requests: dict[str, int] | None = None,
    max_tokens: int = 3,
    empty_step_at: int | None = None,
    edit: Callable[[object], None] | None = None,
    close: bool = True,
) -> Path:
    """Write a toy trace. ``requests`` maps request id to prompt length.
    ``empty_step_at`` inserts a step that schedules nothing before that step
    index, shifting the numbering of all later steps. ``edit`` is called on
    every event before it is written (to plant a difference)."""
    requests = requests or {"r0": 6, "r1": 5, "r2": 9}
    w = TraceWriter(path, mini_header())
    emit = (lambda ev: (edit(ev), w.write(ev))) if edit else w.write
    live: dict[str, dict] = {}
    next_block = 1
    for i, (req, n) in enumerate(requests.items()):
        prompt = [(i * 31 + j) % 97 + 1 for j in range(n)]
        emit(Arrival(seq=w.next_seq(), req=req, prompt_token_ids=prompt, max_tokens=max_tokens,
                     arrival_time=float(i)))
        live[req] = {"tokens": n, "computed": 0, "blocks": [], "out": 0, "new": True}
    step = 0
    logical = 0
    while live:
        if empty_step_at is not None and logical == empty_step_at:
            emit(Step(seq=w.next_seq(), step=step,
                      states=[_state(r, s) for r, s in live.items()]))
            emit(Output(seq=w.next_seq(), step=step))
            step += 1
            empty_step_at = None
            continue
        new, running = [], []
        for req, s in live.items():
            n = s["tokens"] - s["computed"]
            need = -(-(s["tokens"]) // BLOCK) - len(s["blocks"])
            # Ids wrap around inside the header's pool (1..63): the reader refuses ids
            # outside it, and the toy schedule never frees a block.
            blocks = [(b - 1) % 63 + 1 for b in range(next_block, next_block + max(need, 0))]
            next_block += len(blocks)
            s["blocks"] += blocks
            if s["new"]:
                new.append(ScheduledNew(req=req, num_computed_tokens=s["computed"],
                                        num_scheduled_tokens=n, block_ids=list(s["blocks"])))
            else:
                running.append(ScheduledRunning(req=req, num_computed_tokens=s["computed"],
                                                num_scheduled_tokens=n, new_block_ids=blocks))
            s["computed"] += n
        states = [_state(r, s) for r, s in live.items()]
        emit(Step(seq=w.next_seq(), step=step, new=new, running=running, states=states))
        sampled, finished = {}, {}
        for req, s in live.items():
            tok = (s["tokens"] * 7 + s["out"]) % 97 + 1
            sampled[req] = [tok]
            s["tokens"] += 1
            s["out"] += 1
            if s["out"] >= max_tokens:
                finished[req] = "length"
        out_states = [_state(r, s, "FINISHED_LENGTH_CAPPED" if r in finished else "RUNNING")
                      for r, s in live.items()]
        emit(Output(seq=w.next_seq(), step=step, sampled=sampled, finished=finished,
                    states=out_states))
        for req, s in live.items():
            if s["new"]:
                p = s["tokens"] - 1
                emit(PromptStats(seq=w.next_seq(), step=step, req=req, prefill_stats=PrefillStats(
                    num_prompt_tokens=p, num_local_cached_tokens=0, num_external_cached_tokens=0,
                    num_cached_tokens=0, num_computed_tokens=p, num_cache_creation_tokens=0)))
                s["new"] = False
        for req in finished:
            del live[req]
        step += 1
        logical += 1
    if close:
        w.close()
    else:
        w.flush()
        w._fh.close()
    return path


def _state(req: str, s: dict, status: str = "RUNNING") -> RequestState:
    return RequestState(req=req, status=status, num_computed_tokens=s["computed"],
                        num_tokens=s["tokens"], num_preemptions=0, block_ids=list(s["blocks"]))


def load_records(path: Path) -> list[dict]:
    """Every record of a trace file (plain or gzip), header first, as dicts,
    each with every field of its kind, a field the file leaves at its default
    included."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        recs = [orjson.loads(line) for line in f if line.strip()]
    return recs[:1] + [_whole(r) for r in recs[1:]]


def _whole(rec: dict) -> dict:
    """A record with every field its kind has (kept as it is when it does not
    decode: a test may have spoilt it)."""
    from kvtrace.trace.events import SchemaError, decode

    try:
        ev = decode(rec)
    except SchemaError:
        return rec
    return _every_field(ev)


def _every_field(obj):
    import msgspec

    if isinstance(obj, msgspec.Struct):
        out = {f: _every_field(getattr(obj, f)) for f in obj.__struct_fields__}
        if getattr(type(obj), "kind", None) is not None:
            out["kind"] = type(obj).kind
        return out
    if isinstance(obj, list):
        return [_every_field(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _every_field(v) for k, v in obj.items()}
    return obj


def save_records(records: list[dict], path: Path) -> Path:
    """Write ``records`` as a plain trace file; returns ``path``."""
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def abort_workload(first: str, second: str):
    """An embedded-engine workload: four requests fill the pool exactly (two
    blocks each); ``first`` and ``second`` are aborted in one call before the
    step in which the other two each need one more block. Those are the first
    two blocks freed, so the order the aborted requests are freed in decides
    them."""
    from kvtrace.engine.workloads import PlannedAbort, PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    config = SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=64, max_num_seqs=8,
                             max_model_len=16, enable_prefix_caching=False, policy="fcfs",
                             long_prefill_token_threshold=0)
    arrivals = tuple(PlannedArrival(0, req, tuple(range(100 + 10 * i, 104 + 10 * i)), 8, 0)
                     for i, req in enumerate((first, second, "c", "d")))
    return Workload("abort-order", config, arrivals, (PlannedAbort(1, first), PlannedAbort(1, second)),
                    None, 32000)


def one_token_full_hit_workload():
    """An embedded-engine workload: a one-token prompt whose whole prompt the
    KV store holds and loads asynchronously, beside an ordinary request. When
    the load completes, the full-hit rule takes its num_computed_tokens back to
    0, which starts another lookup and another load (docs/findings.md)."""
    from kvtrace.engine.kv_store import StoreSettings
    from kvtrace.engine.workloads import PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    config = SchedulerConfig(block_size=2, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=32, enable_prefix_caching=True, policy="fcfs",
                             long_prefill_token_threshold=0)
    arrivals = (PlannedArrival(0, "one", (500,), 4, 0),
                PlannedArrival(0, "other", tuple(range(600, 610)), 6, 0))
    store = StoreSettings(capacity_tokens=64, preload=((500,),), min_hit_tokens=1,
                          async_fraction=1.0, async_delay_steps=1)
    return Workload("one-token-full-hit", config, arrivals, (), store, 32000)


def preemption_loop_workload():
    """An embedded-engine workload (found by a random search) on which vLLM 0.32,
    with ``scheduler_reserve_full_isl`` off, priority scheduling and chunked long
    prefills, admits and preempts three requests again and again, and never
    finishes them (docs/findings.md)."""
    from kvtrace.engine.workloads import PlannedArrival, Workload
    from kvtrace.reference import SchedulerConfig

    config = SchedulerConfig(block_size=2, num_blocks=44, max_num_batched_tokens=178, max_num_seqs=4,
                             max_model_len=83, enable_prefix_caching=False, policy="priority",
                             long_prefill_token_threshold=16, max_num_scheduled_tokens=89,
                             watermark_blocks=1, reserve_full_isl=False)
    shape = [(0, 45, 2, 2), (1, 52, 2, 1), (5, 21, 4, 0), (7, 10, 5, 0), (9, 65, 4, 1),
             (9, 30, 3, 2), (9, 41, 4, 1), (9, 58, 2, 1), (9, 46, 5, 2)]
    arrivals = tuple(PlannedArrival(step, f"q{i}", tuple(range(1000 + 100 * i, 1000 + 100 * i + n)),
                                    max_tokens, priority)
                     for i, (step, n, max_tokens, priority) in enumerate(shape))
    return Workload("preemption-loop", config, arrivals, (), None, 32000, eos_probability=0.05)
