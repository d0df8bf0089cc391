"""kvtrace show: the run summary and one request's history, rendered with rich."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from kvtrace.report.at_step import UnknownRequest
from kvtrace.report.show import show, sparkline
from kvtrace.report.figures import Series
from kvtrace.report.summary import summarize
from kvtrace.trace.events import (
    Arrival, Header, Output, RequestState, ScheduledNew, ScheduledRunning, SchedulerConfig, Step,
)
from kvtrace.trace.io import TraceError, TraceWriter

from tests._paths import REPO
from tests.mini_traces import write_mini_trace

TRACES = REPO / "traces"


def _console() -> Console:
    return Console(record=True, width=200, color_system=None)


def test_summary_of_a_connector_trace():
    c = _console()
    s = show(TRACES / "connector.jsonl.gz", console=c)
    out = c.export_text()
    assert "82 steps · 7 requests" in out
    assert "finished: 7 length" in out
    assert "preemptions        1" in out
    # 64 of 649 prompt tokens hit the local cache, 403 came from the connector.
    assert "prefix hit rate    9.9% (64 of 649 prompt tokens" in out
    assert "external hit rate  62.1% (403 prompt tokens" in out
    assert "48 lookups (1 not ready, 43 async), 8 loads" in out
    assert "1 failed, 1 invalid block\n" in out or "1 failed, 1 invalid block " in out
    assert "peak 19/19 blocks" in out
    assert s.steps == 82 and s.requests == 7 and not s.timelines


def test_summary_of_a_preemption_trace():
    c = _console()
    show(TRACES / "preemption.jsonl.gz", console=c)
    out = c.export_text()
    assert "preemptions        5 (requests preempted: 4)" in out
    assert "external hit rate  0.0%" in out
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")   # KV usage sparkline


def test_request_history_with_preemption():
    c = _console()
    show(TRACES / "preemption.jsonl.gz", request="3", console=c)
    out = c.export_text()
    assert "request 3-827a4ea2" in out
    assert "prompt 68 tokens, max_tokens 64" in out
    lines = out.splitlines()

    def row(step: str, event: str) -> str:
        hits = [ln for ln in lines if ln[2:].split()[:2] == [step, event]]
        assert hits, f"no row {step} {event} in\n{out}"
        return hits[0]

    adm = row("0", "admitted")
    assert "32→68" in adm and "36" in adm and "new blocks 4 9 10" in adm and "local 32, external 0" in adm
    assert "60 decode steps" in row("1–60", "decode")
    assert "preempted with 128 tokens computed" in row("61", "preempted")
    res = row("64", "resumed")
    assert "64→129" in res and "65" in res and "prefill" in res
    assert "finished: length" in row("66", "finished")
    assert "; 1 preemption;" in out
    assert "num_local_cached_tokens 32" in out and "num_cache_creation_tokens 32" in out


def test_request_history_of_an_async_load():
    c = _console()
    show(TRACES / "connector.jsonl.gz", request="2-a1675dff", console=c, collapse_decode=False)
    out = c.export_text()
    for text in ("async-wait", "WAITING_FOR_REMOTE_KVS", "load tokens [0, 75)",
                 "asynchronous load finished", "load tokens [96, 97)", "resumed", "preempted"):
        assert text in out, text
    assert "decode steps" not in out          # nothing collapsed
    assert sum(ln[2:].split()[1:2] == ["scheduled"] for ln in out.splitlines()) >= 30


def test_unknown_and_ambiguous_requests(tmp_path):
    with pytest.raises(UnknownRequest, match="no request 'nope'"):
        show(TRACES / "connector.jsonl.gz", request="nope", console=_console())
    t = write_mini_trace(tmp_path / "t.jsonl", requests={"r1": 4, "r10": 4, "x": 4})
    with pytest.raises(UnknownRequest, match="2 requests start with 'r': r1, r10"):
        show(t, request="r", console=_console())
    c = _console()
    show(t, request="r1", console=c)           # an exact id wins over a longer one
    assert "request r1\n" in c.export_text()


def test_unusable_trace_raises_trace_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(TraceError):
        show(bad, console=_console())


def test_truncated_trace_says_so(tmp_path):
    t = write_mini_trace(tmp_path / "t.jsonl", close=False)
    c = _console()
    show(t, console=c)
    assert "truncated: no 'end' record" in c.export_text()


def test_series_downsampling_keeps_extremes_and_bounds_memory():
    s = Series(100)
    for x in range(100_000):
        s.add(x, 7 if x == 54_321 else x % 5)
    pts = s.points()
    assert len(pts) <= 101
    assert max(y for _, y in pts) == 7 and (54_321, 7) in pts
    assert min(y for _, y in pts) == 0
    assert pts[-1] == (99_999, 99_999 % 5)
    assert [x for x, _ in pts] == sorted(x for x, _ in pts)
    assert len(sparkline(s, 7, width=40)) == 40


def test_summary_memory_follows_live_requests(tmp_path):
    t = write_mini_trace(tmp_path / "long.jsonl", requests={f"r{i}": 5 for i in range(300)},
                         max_tokens=2)
    s = summarize(t, max_timelines=3, keep={"r150"})
    assert s.requests == 300
    assert sorted(s.timelines) == ["r0", "r1", "r150", "r2"]
    assert s.timelines_left_out == 296
    assert len(s.sched_tokens.points()) <= 2001
    long = _one_long_request(tmp_path / "longer.jsonl.gz", decode_steps=5000)
    s = summarize(long, max_timelines=1)
    assert s.steps == 5001
    tl = s.timelines["a"]
    assert len(tl.computed.points()) <= 601 and tl.history is None
    assert tl.computed.max == 5004
    assert len(s.sched_tokens.points()) <= 2001 and len(s.kv_used.points()) <= 2001
    assert s.peak_kv_used == 1251           # ceil(5004 / 4)


def _one_long_request(path: Path, decode_steps: int) -> Path:
    """One request: a 4-token prompt, then ``decode_steps`` decode steps, block size 4."""
    n = decode_steps + 5
    cfg = SchedulerConfig(block_size=4, num_blocks=n // 4 + 8, max_num_batched_tokens=64,
                          max_num_seqs=4, max_model_len=n + 8)
    with TraceWriter(path, Header(engine="embedded", engine_version="test", config=cfg)) as w:
        w.write(Arrival(seq=w.next_seq(), req="a", prompt_token_ids=[1, 2, 3, 4],
                        max_tokens=decode_steps + 1))
        blocks, c, tokens = [], 0, 4
        for k in range(decode_steps + 1):
            sched = 4 if k == 0 else 1
            need = -(-(c + sched) // 4) - len(blocks)
            new = list(range(len(blocks) + 1, len(blocks) + 1 + need))
            blocks += new
            item = (ScheduledNew(req="a", num_computed_tokens=0, num_scheduled_tokens=4,
                                 block_ids=list(blocks)) if k == 0 else
                    ScheduledRunning(req="a", num_computed_tokens=c, num_scheduled_tokens=1,
                                     new_block_ids=new))
            c += sched
            st = RequestState(req="a", status="RUNNING", num_computed_tokens=c, num_tokens=tokens,
                              num_preemptions=0, block_ids=list(blocks))
            w.write(Step(seq=w.next_seq(), step=k, new=[item] if k == 0 else [],
                         running=[] if k == 0 else [item], states=[st],
                         num_free_blocks=cfg.num_blocks - 1 - len(blocks)))
            tokens += 1
            done = k == decode_steps
            w.write(Output(seq=w.next_seq(), step=k, sampled={"a": [5]},
                           finished={"a": "length"} if done else {}))
    return path


# --------------------------------------------------------------------------- one step
# Checked against the step records as orjson reads them, rebuilt here
# independently of kvtrace/report/at_step.py.

import gzip   # noqa: E402
import re   # noqa: E402

import orjson   # noqa: E402

from kvtrace import cli   # noqa: E402
from kvtrace.engine import FAULT_WORKLOADS, record_embedded   # noqa: E402
from kvtrace.replay import replay_file   # noqa: E402
from kvtrace.report.at_step import StepNotFound, read_step   # noqa: E402


def _lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    data = gzip.decompress(data) if path.suffix == ".gz" else data
    return [orjson.loads(x) for x in data.splitlines() if x.strip()]


def _step_record(path: Path, n: int) -> dict:
    return next(r for r in _lines(path) if r["kind"] == "step" and r["step"] == n)


def _tables_at(path: Path, n: int) -> dict[str, list[list[int]]]:
    """Each request's block table per group at step ``n``: whole tables of
    admissions, new blocks of running requests, emptied by a preemption or a finish."""
    tables: dict[str, list[list[int]]] = {}
    for r in _lines(path):
        if r["kind"] == "abort":
            for q in r["reqs"]:
                tables.pop(q, None)
        elif r["kind"] == "output":
            for q in r.get("finished", {}):
                tables.pop(q, None)
        elif r["kind"] == "step":
            for q in r.get("preempted", []) + r.get("finished", []):
                tables.pop(q, None)
            for e in r.get("new", []) + r.get("resumed", []):
                tables[e["req"]] = [list(e["block_ids"])] + [list(g) for g in e.get("more_groups") or []]
            for e in r.get("running", []):
                new = [e["new_block_ids"]] + (e.get("more_groups") or [])
                t = tables.setdefault(e["req"], [])
                t += [[] for _ in range(len(new) - len(t))]
                for g, ids in enumerate(new):
                    t[g] += ids
            if r["step"] == n:
                return tables
    raise AssertionError(f"no step {n}")


def _batch_of(rec: dict) -> list[tuple]:
    out = [(e["req"], how, e["num_computed_tokens"], e["num_scheduled_tokens"], e["block_ids"])
           for how in ("new", "resumed") for e in rec.get(how, [])]
    return out + [(e["req"], "running", e["num_computed_tokens"], e["num_scheduled_tokens"],
                   e["new_block_ids"]) for e in rec.get("running", [])]


def _busy_divergent_step(path: Path, divs) -> int:
    """A step whose record admits and runs requests, with a KV-content
    divergence among its divergences and a request of its batch without one."""
    at = {d.step for d in divs if d.kind == "kv-content"}
    for r in _lines(path):
        if r["kind"] != "step" or r["step"] not in at or not r.get("running"):
            continue
        batch = {b[0] for b in _batch_of(r)}
        if (r.get("new") or r.get("resumed")) and batch - {d.req for d in divs if d.step == r["step"]}:
            return r["step"]
    raise AssertionError("the fault trace has no such step")


@pytest.fixture(scope="module")
def faulty_step(faulty):
    divs = replay_file(faulty, device="cpu").divergences
    return faulty, _busy_divergent_step(faulty, divs), divs


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _row(out: str, req: str) -> str:
    """The batch row of ``req``: the first line that names it after "batch"."""
    section = out.split("\nbatch\n", 1)[1].split("\nqueues", 1)[0]
    hits = [ln for ln in section.splitlines() if re.search(rf"(^|\s){re.escape(req)}\s", ln)]
    assert hits, f"no batch row for {req} in\n{section}"
    return hits[0]


def test_step_batch_blocks_and_free_blocks_are_the_records(faulty_step):
    trace, n, _ = faulty_step
    rec = _step_record(trace, n)
    view = read_step(trace, n)
    assert [(b.req, b.how, b.computed, b.scheduled, b.blocks[0]) for b in view.batch] == _batch_of(rec)
    tables = _tables_at(trace, n)
    assert {r: t for r, t in view.tables.items() if any(t)} == {r: t for r, t in tables.items() if any(t)}
    assert view.groups == 1 and view.record.num_free_blocks == rec["num_free_blocks"]


def test_step_queues_hold_the_live_requests_outside_the_batch(faulty_step):
    trace, n, _ = faulty_step
    arrived, ended, preempted_at, scheduled_at = [], set(), {}, {}
    for r in _lines(trace):
        if r["kind"] == "arrival":
            arrived.append(r["req"])
        elif r["kind"] == "abort":
            ended.update(r["reqs"])
        elif r["kind"] == "output":
            ended.update(r.get("finished", {}))
        elif r["kind"] == "step":
            ended.update(r.get("finished", []))
            for q in r.get("preempted", []):
                preempted_at[q] = r["step"]
            for b in _batch_of(r):
                scheduled_at[b[0]] = r["step"]
            if r["step"] == n:
                break
    batch = {b[0] for b in _batch_of(_step_record(trace, n))}
    view = read_step(trace, n)
    assert {p.req for p in view.queued} == set(arrived) - ended - batch
    preempted = {q for q, k in preempted_at.items() if k >= scheduled_at.get(q, -1)} - ended - batch
    assert {p.req for p in view.queued if p.queue == "preempted"} == preempted


def test_show_step_marks_and_lists_the_divergences_of_the_step(faulty_step, capsys):
    trace, n, divs = faulty_step
    rec = _step_record(trace, n)
    code, out, err = _cli(capsys, "show", str(trace), "--step", str(n))
    assert code == 0, err
    cfg = _lines(trace)[0]["config"]
    assert f"free blocks  {rec['num_free_blocks']} of {cfg['num_blocks'] - 1} usable" in out
    here = [d for d in divs if d.step == n]
    divergent = {d.req for d in here}
    for req, how, *_ in _batch_of(rec):
        row = _row(out, req)
        assert how in row
        assert row.startswith("!") == (req in divergent), row
    listed = out.split(f"divergences at step {n} ({len(here)})", 1)[1]
    flat = " ".join(listed.split())
    assert len(re.findall(r"^! ", listed, flags=re.M)) == len(here)
    for d in here:
        assert f"{d.req} {d.field}" in flat
        if isinstance(d.recorded, str):   # whole: a clobbering write named
            assert " ".join(d.recorded.split()) in flat
    assert any("written by" in str(d.recorded) for d in here if d.kind == "kv-content")


def test_show_step_request_narrows_to_one_request(faulty_step, capsys):
    trace, n, divs = faulty_step
    mine = next(d.req for d in divs if d.step == n and d.kind == "kv-content")
    others = {b[0] for b in _batch_of(_step_record(trace, n))} - {mine}
    code, out, err = _cli(capsys, "show", str(trace), "--step", str(n), "--request", mine)
    assert code == 0, err
    assert f"request {mine}" in out and _row(out, mine).startswith("!")
    for other in others:
        assert not re.search(rf"(^|[\s,]){re.escape(other)}([\s,]|$)", out), other
    listed = out.split(f"divergences at step {n}", 1)[1]
    assert len(re.findall(r"^! ", listed, flags=re.M)) == sum(
        1 for d in divs if d.step == n and d.req in (mine, None))


def test_show_step_past_the_end_is_one_line_exit_2(faulty, capsys):
    last = max(r["step"] for r in _lines(faulty) if r["kind"] == "step")
    code, out, err = _cli(capsys, "show", str(faulty), "--step", str(last + 1))
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"kvtrace: {faulty}: no step {last + 1}: the last step is {last}"]


def test_show_step_reads_no_further_than_the_step(faulty, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(faulty.read_bytes() + b"not json\n")
    assert read_step(broken, 3).step == 3          # the bad line is never read
    with pytest.raises(TraceError, match="not JSON"):
        read_step(broken, 10 ** 6)
    with pytest.raises(StepNotFound):
        read_step(faulty, 10 ** 6)


@pytest.mark.parametrize("columns", [80, 200])
def test_show_step_fits_the_width(faulty_step, capsys, monkeypatch, columns):
    trace, n, _ = faulty_step
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = _cli(capsys, "show", str(trace), "--step", str(n))
    assert code == 0, err
    widths = [len(ln.rstrip()) for ln in out.splitlines()]
    assert max(widths) <= columns
    if columns > 80:
        assert max(widths) > 80                      # the width is used


def test_show_step_with_kv_cache_groups(tmp_path, capsys):
    trace = record_embedded(tmp_path / "hybrid.jsonl", workload=FAULT_WORKLOADS["window-freed-early"],
                            fault="window-freed-early").path
    n = next(r["step"] for r in _lines(trace) if r["kind"] == "step"
             and any(e.get("more_groups") for e in r.get("running", [])))
    view = read_step(trace, n)
    assert view.groups == 2
    tables = _tables_at(trace, n)
    assert {r: t for r, t in view.tables.items() if any(t)} == {r: t for r, t in tables.items() if any(t)}
    code, out, err = _cli(capsys, "show", str(trace), "--step", str(n), "--no-kv-check")
    assert code == 0, err
    assert "group 0: sliding window" in out and "g1: " in out
    # The window's freed blocks: the step's recorded state shows them as 0.
    assert "state: 0 0" in out


# --------------------------------------------------------------------------- what replay reasons about
# The expected values come from the trace's records (read with orjson) and
# from `kvtrace replay --json`, never from show's own output.

from kvtrace.report.show import show_step   # noqa: E402


def _tried_lookups(path: Path) -> list[tuple[int, dict, str | None]]:
    """Each (step, lookup, status after the step) of a request the step looked
    up but did not schedule: the last lookup of it in the step's record."""
    out = []
    for r in _lines(path):
        if r["kind"] != "step":
            continue
        scheduled = {b[0] for b in _batch_of(r)}
        states = {st["req"]: st["status"] for st in r.get("states", [])}
        last = {lk["req"]: lk for lk in r.get("lookups", [])}
        out += [(r["step"], lk, states.get(q)) for q, lk in last.items() if q not in scheduled]
    return out


@pytest.mark.parametrize("name", ["connector.jsonl.gz", "data-path/example-connector.jsonl.gz"])
def test_show_step_lists_a_failed_admission_with_its_lookup(name):
    trace = TRACES / name
    tried = _tried_lookups(trace)
    assert tried
    kinds = set()
    for step, lk, status in tried:
        c = _console()
        show_step(read_step(trace, step), [], console=c)
        out = c.export_text()
        queues = out.split("\nqueues after the step\n", 1)[1].split("\nplaced by the step's", 1)[0]
        lines = queues.splitlines()
        at = [i for i, ln in enumerate(lines) if re.search(rf"(^|\s){re.escape(lk['req'])}\s", ln)]
        assert at, f"step {step}: {lk['req']} is in no queue\n{queues}"
        said = lines[at[0] + 1]
        assert f"local hit {lk['local']} token" in said, (step, said)
        if lk["ext"] is None:
            assert "connector not ready" in said, (step, said)
            kinds.add("not ready")
        else:
            assert f"external hit {lk['ext']}" in said, (step, said)
            assert ("asynchronous" in said) == bool(lk.get("load_async")), (step, said)
        if status == "WAITING_FOR_REMOTE_KVS":
            assert "waits for the load" in said, (step, said)
            kinds.add("parked")
        else:
            what = "resumption" if status == "PREEMPTED" else "admission"
            assert f"{what} failed at this step" in said, (step, said)
            kinds.add(what)
    # Each trace shows the kinds it is known for (traces/README.md).
    assert kinds >= ({"not ready", "parked", "admission"} if name == "connector.jsonl.gz"
                     else {"resumption"})


def _replay_json(capsys, trace: Path) -> list[dict]:
    capsys.readouterr()
    code = cli.run(["replay", "--json", str(trace)])
    assert code in (0, 1)
    return orjson.loads(capsys.readouterr().out)["divergences"]


_ROW = re.compile(r"^([ !]) +(\d+)(?:–(\d+))? +(\S+)")


def _history_rows(out: str) -> list[tuple[bool, set[int], str, list[str]]]:
    """show --request's rows: (marked, the steps it covers, event, the
    divergence lines under it, flattened)."""
    body = out.split("  step  event", 1)[1].split("\nfinish: ", 1)[0].splitlines()[1:]
    rows: list = []
    for ln in body:
        m = _ROW.match(ln)
        if m and ln[1] == " ":
            a, b = int(m.group(2)), int(m.group(3) or m.group(2))
            rows.append((m.group(1) == "!", set(range(a, b + 1)), m.group(4), []))
        elif ln.lstrip().startswith("! "):
            rows[-1][3].append(ln.strip())
        elif rows and rows[-1][3]:   # a divergence line wrapped
            rows[-1][3][-1] += " " + ln.strip()
    return rows


@pytest.mark.parametrize("name,req", [
    ("faults/async-load-overshoot.jsonl.gz", "0-a3c17fc3"),
    ("faults/stale-computed-on-preempt.jsonl.gz", "6-9a2d06f4"),
    ("faults/grammar-not-awaited.jsonl.gz", "4-b779c767"),
    ("vllm-bugs/async-session-lost.jsonl.gz", "9-session"),
])
def test_show_request_marks_the_divergences_replay_finds(capsys, monkeypatch, name, req):
    trace = TRACES / name
    mine = [d for d in _replay_json(capsys, trace) if d["req"] == req]
    assert mine
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = _cli(capsys, "show", str(trace), "--request", req)
    assert code == 0, err
    rows = _history_rows(out)
    steps = {d["step"] for d in mine}
    assert set().union(*(r[1] for r in rows if r[0])) == steps
    for d in mine:
        under = [x for marked, covered, _, lines in rows if marked and d["step"] in covered
                 for x in lines]
        assert any(re.match(rf"! (and .*)?{re.escape(d['field'])}[:, ]", x) or
                   re.search(rf"[ ,]{re.escape(d['field'])}(,|$)", x) for x in under), (d, under)
    first = mine[0]   # replay lists the likely cause first: compact, on its row
    if isinstance(first["recorded"], int) and isinstance(first["expected"], int):
        row = next(r for r in rows if r[0] and first["step"] in r[1])
        assert any(x.startswith(f"! {first['field']}: recorded {first['recorded']}, expected "
                                f"{first['expected']}") for x in row[3]), row
    n = len(steps)
    assert f"divergences: {len(mine)} at {n} step{'s' if n != 1 else ''}, marked !" in out


def test_show_request_without_divergences_says_it_was_replayed(capsys, monkeypatch):
    trace = TRACES / "faults/stale-computed-on-preempt.jsonl.gz"
    diverging = {d["req"] for d in _replay_json(capsys, trace)}
    calm = next(r["req"] for r in _lines(trace) if r["kind"] == "arrival" and r["req"] not in diverging)
    code, out, err = _cli(capsys, "show", str(trace), "--request", calm)
    assert code == 0, err
    assert "divergences: none (replayed)" in out
    assert not any(r[0] or r[3] for r in _history_rows(out))


def test_show_request_from_a_pipe_says_it_is_not_replayed(faulty):
    import os
    import subprocess
    import sys
    req = next(r["req"] for r in _lines(faulty) if r["kind"] == "arrival")
    code = "import sys\nfrom kvtrace.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code, "show", "-", "--request", req],
                       input=faulty.read_bytes(), capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert b"divergences: not replayed: the trace came through a pipe" in p.stdout


def _events_of(path: Path, req: str) -> int:
    """The events show lists for ``req`` with no decode run folded, counted
    from the records: its arrival, each step that schedules it, each parked
    async lookup, load, finished load, preemption, and its finish."""
    n = 1
    for r in _lines(path):
        if r["kind"] == "step":
            n += sum(b[0] == req for b in _batch_of(r)) + r.get("preempted", []).count(req)
            n += sum(ld["req"] == req for ld in r.get("loads") or [])
            parked = {st["req"] for st in r.get("states", []) if st["status"] == "WAITING_FOR_REMOTE_KVS"}
            n += sum(lk["req"] == req and lk.get("load_async") and req in parked for lk in r.get("lookups", []))
        elif r["kind"] == "output":
            n += (r.get("connector") or {}).get("finished_recving", []).count(req)
            n += req in r.get("finished", {})
    return n


def test_show_request_spends_a_line_on_an_event_at_80_columns():
    trace, req = TRACES / "connector.jsonl.gz", "2-a1675dff"
    events = _events_of(trace, req)
    assert events > 40
    c = Console(record=True, width=80, color_system=None)
    show(trace, request=req, console=c, collapse_decode=False)
    out = c.export_text()
    table = out.split("  step  event", 1)[1].split("\nfinish: ", 1)[0].splitlines()[1:]
    assert events <= len(table) <= events + events // 4, "\n".join(table)
    assert max(len(ln.rstrip()) for ln in out.splitlines()) <= 80
    assert "WAITING_FOR_REMOTE_KVS" in out and "asynchronously" in out and "…" not in out


@pytest.mark.parametrize("columns", [80, None])   # None: a pipe, 100 columns
@pytest.mark.parametrize("name,req", [
    ("connector.jsonl.gz", "2-a1675dff"),
    ("faults/stale-computed-on-preempt.jsonl.gz", "6-9a2d06f4"),
    ("faults/window-freed-early.jsonl.gz", "1-"),
    ("faults/grammar-not-awaited.jsonl.gz", "4-b779c767"),
    ("long-id", "chatcmpl-"),
])
def test_show_request_fits_the_width_and_cuts_no_word(capsys, monkeypatch, tmp_path, columns, name, req):
    if name == "long-id":   # an OpenAI-compatible server's id, 60 characters
        long_id = "chatcmpl-" + "0123456789abcdef" * 3 + "-000"
        trace = write_mini_trace(tmp_path / "t.jsonl", requests={long_id: 9, "r1": 5}, max_tokens=8)
    else:
        trace = TRACES / name
    fields = {d["field"] for d in _replay_json(capsys, trace) if (d["req"] or "").startswith(req)}
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = _cli(capsys, "show", str(trace), "--request", req)
    assert code == 0, err
    assert max(len(ln.rstrip()) for ln in out.splitlines()) <= (columns or 100)
    assert "…" not in out
    for status in re.findall(r"\b[A-Z]+(?:_[A-Z]+)+\b", out):   # status names whole
        assert status in ("WAITING_FOR_REMOTE_KVS", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"), status
    for f in fields:                                               # field names whole
        assert re.search(rf"(^|[\s,]){re.escape(f)}[:,\s]", out, flags=re.M), f


def test_show_request_says_a_lookup_admitted_nothing(faulty):
    recs = _lines(faulty)
    tried: dict[str, dict[int, bool]] = {}   # request -> step of a lookup -> admitted in it
    for r in recs:
        if r["kind"] == "step":
            admitted = {e["req"] for e in r.get("new", []) + r.get("resumed", [])}
            for lk in r.get("lookups", []):
                tried.setdefault(lk["req"], {})[r["step"]] = lk["req"] in admitted
    req = next(q for q, at in tried.items() if not all(at.values()) and any(at.values()))
    c = _console()
    show(faulty, request=req, console=c)
    rows = [ln[2:].split(None, 2) for ln in c.export_text().splitlines()]
    lookups = {int(r[0]): r[2] for r in rows if len(r) == 3 and r[1] == "lookup" and r[0].isdigit()}
    assert lookups
    for step, text in lookups.items():
        assert ("not admitted" in text) == (not tried[req][step]), (step, text)


def test_show_step_shows_a_step_whose_schedule_raised(capsys):
    """It said 'no step 30: the last step is 29' for the step that stopped the
    engine, which the trace records as a step_failed record."""
    path = TRACES / "vllm-bugs" / "spec-padding-cut.jsonl.gz"
    from tests.mini_traces import load_records

    failed = next(r for r in load_records(path) if r["kind"] == "step_failed")
    code, out, _ = _cli(capsys, "show", str(path), "--step", str(failed["step"]), "--no-kv-check")
    flat = " ".join(out.split())
    assert code == 0
    assert f"step {failed['step']} (line " in flat
    assert f"schedule() raised {failed['error']} at {failed['where']}" in flat
    assert "the engine stopped in this step" in flat
