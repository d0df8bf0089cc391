"""A trace as normalized Arrow tables, for pandas, polars and DuckDB.

``build_tables`` takes a trace's records, each with its line, and the
divergences of an analysis (none is run here), and returns one
``pyarrow.Table`` per name in ``TABLES``. Every table keys its rows by
``step`` and ``req`` where they apply, so that the tables join.
docs/guide/export.md lists the columns; ``SCHEMAS`` is their definition.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import orjson
import pyarrow as pa

from ..findings import Divergence
from ..trace import events as ev

_I64, _F64, _STR, _BOOL = pa.int64(), pa.float64(), pa.string(), pa.bool_()
_CAT = pa.dictionary(pa.int32(), pa.string())   # a few distinct values: status, kind ...
_BLOCKS = pa.list_(pa.int32())                  # block ids: at most 2^24 (events.MAX_NUM_BLOCKS)
_GROUPS = pa.list_(_BLOCKS)                     # more KV-cache groups: groups 1, 2, ...
_TOKENS = pa.list_(_I64)


def _schema(*cols: tuple[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, t) for name, t in cols])


_STATE = (("status", _CAT), ("num_tokens", _I64), ("num_preemptions", _I64),
          ("block_ids", _BLOCKS), ("more_groups", _GROUPS))

SCHEMAS: dict[str, pa.Schema] = {
    "steps": _schema(
        ("step", _I64), ("seq", _I64), ("line", _I64),
        ("num_new", _I64), ("num_resumed", _I64), ("num_running", _I64),
        ("num_scheduled_tokens", _I64), ("num_preempted", _I64), ("num_finished", _I64),
        ("num_lookups", _I64), ("num_loads", _I64), ("num_load_tokens", _I64),
        ("num_free_blocks", _I64), ("throttle_prefills", _BOOL),
        ("output_seq", _I64), ("output_line", _I64), ("invalid_block_ids", _BLOCKS)),
    "request_steps": _schema(
        ("step", _I64), ("req", _STR), ("scheduled_as", _CAT),
        ("num_computed_tokens", _I64), ("num_scheduled_tokens", _I64),
        ("scheduled_block_ids", _BLOCKS), ("scheduled_more_groups", _GROUPS),
        ("spec_token_ids", _TOKENS), ("preempted", _BOOL), ("finished", _BOOL),
        ("grammar", _CAT), ("num_computed_tokens_after", _I64), *_STATE),
    "lookups": _schema(
        ("step", _I64), ("req", _STR), ("call", _I64), ("local", _I64), ("ext", _I64),
        ("load_async", _BOOL)),
    "loads": _schema(
        ("step", _I64), ("req", _STR), ("start", _I64), ("end", _I64), ("num_tokens", _I64)),
    "outputs": _schema(
        ("step", _I64), ("req", _STR), ("seq", _I64), ("line", _I64),
        ("sampled_token_ids", _TOKENS), ("finish_reason", _CAT),
        ("num_computed_tokens", _I64), *_STATE,
        ("finished_recving", _BOOL), ("finished_sending", _BOOL), ("failed_recving", _BOOL),
        ("grammar_rejected", _BOOL), ("pooled", _BOOL), ("draft_token_ids", _TOKENS)),
    "prompt_stats": _schema(
        ("step", _I64), ("req", _STR), ("seq", _I64), ("line", _I64),
        *((name, _I64) for name in ev.PrefillStats.__struct_fields__),
        *((f"legacy_{name}", _I64) for name in ev.LegacyCounters.__struct_fields__)),
    "arrivals": _schema(
        ("step", _I64), ("req", _STR), ("seq", _I64), ("line", _I64),
        ("num_prompt_tokens", _I64), ("prompt_token_ids", _TOKENS), ("max_tokens", _I64),
        ("arrival_time", _F64), ("priority", _I64), ("cache_salt", _STR),
        ("eos_token_id", _I64), ("stop_token_ids", _TOKENS), ("min_tokens", _I64),
        ("ignore_eos", _BOOL), ("skip_reading_prefix_cache", _BOOL), ("resumable", _BOOL),
        ("structured_output", _BOOL), ("pooling", _BOOL), ("prompt_embeds", _BOOL),
        ("lora_id", _I64), ("lora_name", _STR), ("repetition_detection", _STR),
        ("kv_transfer_params", _STR)),
    "aborts": _schema(
        ("step", _I64), ("req", _STR), ("seq", _I64), ("line", _I64), ("status", _CAT)),
    "divergences": _schema(
        ("step", _I64), ("req", _STR), ("field", _STR), ("recorded", _STR),
        ("expected", _STR), ("rule", _STR), ("kind", _CAT), ("seq", _I64), ("line", _I64),
        ("why", _STR)),
}
TABLES = tuple(SCHEMAS)
# Every divergence of several traces replayed together: the divergences
# table, with the trace each comes from (its path as given) first.
FLEET_DIVERGENCES = pa.schema([pa.field("trace", _STR), *SCHEMAS["divergences"]])


class _Rows:
    """One table's columns, filled a row at a time; a column a row leaves out is null."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.cols: dict[str, list] = {name: [] for name in schema.names}
        self.n = 0

    def add(self, **values: Any) -> int:
        """Append a row; returns its index (for ``set``)."""
        for name, col in self.cols.items():
            col.append(values.get(name))
        self.n += 1
        return self.n - 1

    def set(self, i: int, **values: Any) -> None:
        for name, v in values.items():
            self.cols[name][i] = v

    def table(self) -> pa.Table:
        return pa.table([pa.array(self.cols[f.name], type=f.type) for f in self.schema],
                        schema=self.schema)


def _state(st: ev.RequestState) -> dict:
    return {"status": st.status, "num_tokens": st.num_tokens,
            "num_preemptions": st.num_preemptions, "block_ids": st.block_ids,
            "more_groups": st.more_groups}


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value, default=str).decode()


def _json_text(value: Any) -> str:
    """A value as JSON text, none included ("null"): json.loads always reads it."""
    return orjson.dumps(value, default=str).decode()


class _Builder:
    def __init__(self):
        self.rows = {name: _Rows(schema) for name, schema in SCHEMAS.items()}
        self.steps_seen = 0                      # step records so far: the next step's index
        self.step_row: dict[int, int] = {}       # step -> its row in ``steps``
        self.output_rows: dict[tuple[int, str], int] = {}   # (step, req) -> row in ``outputs``
        self.output_at: dict[int, tuple[int, int]] = {}     # step -> its output's (seq, line)

    def feed(self, line: int, e: ev.Event) -> None:
        t = type(e)
        if t is ev.Step:
            self.step(line, e)
        elif t is ev.Output:
            self.output(line, e)
        elif t is ev.Drafts:
            self.drafts(e)
        elif t is ev.Arrival:
            self.arrival(line, e)
        elif t is ev.PromptStats:
            self.prompt_stats(line, e)
        elif t is ev.Abort:
            for req in e.reqs:
                self.rows["aborts"].add(step=self.steps_seen, req=req, seq=e.seq, line=line,
                                        status=e.status)

    def step(self, line: int, e: ev.Step) -> None:
        k = e.step
        self.steps_seen = k + 1
        sched = {}
        for kind, items in (("new", e.new), ("resumed", e.resumed)):
            for it in items:
                sched[it.req] = dict(scheduled_as=kind, num_computed_tokens=it.num_computed_tokens,
                                     num_scheduled_tokens=it.num_scheduled_tokens,
                                     scheduled_block_ids=it.block_ids,
                                     scheduled_more_groups=it.more_groups)
        for it in e.running:
            sched[it.req] = dict(scheduled_as="running", num_computed_tokens=it.num_computed_tokens,
                                 num_scheduled_tokens=it.num_scheduled_tokens,
                                 scheduled_block_ids=it.new_block_ids,
                                 scheduled_more_groups=it.more_groups)
        states = {st.req: st for st in e.states}
        preempted, finished = set(e.preempted), set(e.finished)
        spec, grammar = e.spec or {}, e.grammar or {}
        rs = self.rows["request_steps"]
        for req in dict.fromkeys([*sched, *states, *e.preempted, *e.finished, *spec, *grammar]):
            row = sched.get(req, {"num_scheduled_tokens": 0})
            st = states.get(req)
            if st is not None:
                row = {**row, **_state(st), "num_computed_tokens_after": st.num_computed_tokens}
            rs.add(step=k, req=req, **row, spec_token_ids=spec.get(req),
                   preempted=req in preempted, finished=req in finished,
                   grammar=grammar.get(req))
        for i, lk in enumerate(e.lookups):
            self.rows["lookups"].add(step=k, req=lk.req, call=i, local=lk.local, ext=lk.ext,
                                     load_async=lk.load_async)
        for ld in e.loads or ():
            self.rows["loads"].add(step=k, req=ld.req, start=ld.start, end=ld.end,
                                   num_tokens=ld.end - ld.start)
        self.step_row[k] = self.rows["steps"].add(
            step=k, seq=e.seq, line=line, num_new=len(e.new), num_resumed=len(e.resumed),
            num_running=len(e.running),
            num_scheduled_tokens=sum(r["num_scheduled_tokens"] for r in sched.values()),
            num_preempted=len(e.preempted), num_finished=len(e.finished),
            num_lookups=len(e.lookups),
            num_loads=None if e.loads is None else len(e.loads),
            num_load_tokens=None if e.loads is None else sum(ld.end - ld.start for ld in e.loads),
            num_free_blocks=e.num_free_blocks, throttle_prefills=e.throttle_prefills)

    def output(self, line: int, e: ev.Output) -> None:
        k = e.step
        self.output_at[k] = (e.seq, line)
        c = e.connector or ev.ConnectorOutput()
        if k in self.step_row:
            self.rows["steps"].set(self.step_row[k], output_seq=e.seq, output_line=line,
                                   invalid_block_ids=c.invalid_block_ids)
        states = {st.req: st for st in e.states}
        recving, sending, failed = (set(c.finished_recving), set(c.finished_sending),
                                    set(c.failed_recving))
        rejected, pooled = set(e.grammar_rejected or ()), set(e.pooled or ())
        out = self.rows["outputs"]
        for req in dict.fromkeys([*e.sampled, *e.finished, *states, *c.finished_recving,
                                  *c.finished_sending, *c.failed_recving, *rejected, *pooled]):
            st = states.get(req)
            extra = {} if st is None else {**_state(st), "num_computed_tokens": st.num_computed_tokens}
            self.output_rows[(k, req)] = out.add(
                step=k, req=req, seq=e.seq, line=line, sampled_token_ids=e.sampled.get(req),
                finish_reason=e.finished.get(req), **extra,
                finished_recving=req in recving, finished_sending=req in sending,
                failed_recving=req in failed, grammar_rejected=req in rejected,
                pooled=req in pooled)

    def drafts(self, e: ev.Drafts) -> None:
        out = self.rows["outputs"]
        seq, line = self.output_at.get(e.step, (None, None))
        for req, tokens in e.drafts.items():
            i = self.output_rows.get((e.step, req))
            if i is None:
                self.output_rows[(e.step, req)] = out.add(
                    step=e.step, req=req, seq=seq, line=line, draft_token_ids=tokens,
                    finished_recving=False, finished_sending=False, failed_recving=False,
                    grammar_rejected=False, pooled=False)
            else:
                out.set(i, draft_token_ids=tokens)

    def arrival(self, line: int, e: ev.Arrival) -> None:
        lora = e.lora or {}
        self.rows["arrivals"].add(
            step=self.steps_seen, req=e.req, seq=e.seq, line=line,
            num_prompt_tokens=len(e.prompt_token_ids), prompt_token_ids=e.prompt_token_ids,
            max_tokens=e.max_tokens, arrival_time=e.arrival_time, priority=e.priority,
            cache_salt=e.cache_salt, eos_token_id=e.eos_token_id,
            stop_token_ids=e.stop_token_ids, min_tokens=e.min_tokens, ignore_eos=e.ignore_eos,
            skip_reading_prefix_cache=e.skip_reading_prefix_cache, resumable=e.resumable,
            structured_output=e.structured_output, pooling=e.pooling,
            prompt_embeds=e.prompt_embeds is not None, lora_id=lora.get("id"),
            lora_name=lora.get("name"), repetition_detection=_json(e.repetition_detection),
            kv_transfer_params=_json(e.kv_transfer_params))

    def prompt_stats(self, line: int, e: ev.PromptStats) -> None:
        row = {}
        if e.prefill_stats is not None:
            row.update((n, getattr(e.prefill_stats, n)) for n in ev.PrefillStats.__struct_fields__)
        if e.legacy is not None:
            row.update((f"legacy_{n}", getattr(e.legacy, n))
                       for n in ev.LegacyCounters.__struct_fields__)
        self.rows["prompt_stats"].add(step=e.step, req=e.req, seq=e.seq, line=line, **row)

    def divergences(self, divs: Iterable[Divergence]) -> None:
        _add_divergences(self.rows["divergences"], divs)


def _add_divergences(rows: _Rows, divs: Iterable[Divergence], **more: Any) -> None:
    for d in divs:
        rows.add(step=d.step, req=d.req, field=d.field, recorded=_json_text(d.recorded),
                 expected=_json_text(d.expected), rule=d.rule, kind=d.kind, seq=d.seq,
                 line=d.line, why=getattr(d, "why", None), **more)


def fleet_divergences(traces: Iterable[tuple[str, Iterable[Divergence]]]) -> pa.Table:
    """One table of the divergences of several traces: for each (trace, its
    divergences), in the order given, its rows as the ``divergences`` table
    has them, with ``trace`` (the path as given) first."""
    rows = _Rows(FLEET_DIVERGENCES)
    for trace, divs in traces:
        _add_divergences(rows, divs, trace=trace)
    return rows.table()


def build_tables(records: Iterable[tuple[int, ev.Event]],
                 divergences: Iterable[Divergence] | None = None,
                 progress: Callable[[int], None] | None = None) -> dict[str, pa.Table]:
    """The tables of a trace: ``records`` are (line, event) pairs after the
    header, in trace order (``TraceReader.last_line`` gives the line of the
    event just read). ``divergences`` come from ``replay_file`` or
    ``diff_files``; None leaves out the ``divergences`` table. ``progress``,
    if given, is called now and then with the number of steps read."""
    b = _Builder()
    for line, e in records:
        b.feed(line, e)
        if progress is not None and type(e) is ev.Step and not e.step % 256:
            progress(e.step)
    if divergences is not None:
        b.divergences(divergences)
    return {name: rows.table() for name, rows in b.rows.items()
            if name != "divergences" or divergences is not None}
