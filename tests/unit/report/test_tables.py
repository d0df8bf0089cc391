"""``kvtrace export --format parquet|arrow``: the tables hold what the trace holds,
read back with pyarrow and checked against the trace read here line by line."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from kvtrace import cli
from kvtrace.report.tables import SCHEMAS, TABLES

from tests._paths import REPO

ROOT = REPO
TRACES = ROOT / "traces"
DOC = ROOT / "docs" / "guide" / "export.md"
FAULT = TRACES / "faults" / "async-load-overshoot.jsonl.gz"


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def raw_records(path: Path) -> list[tuple[int, dict]]:
    """(line, record) after the header, read with gzip and orjson alone; stops
    at a last line cut mid-record."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    out = []
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            rec = orjson.loads(raw)
        except orjson.JSONDecodeError:
            break
        if rec.get("kind") != "header":
            out.append((lineno, rec))
    return out


def read_dir(out: Path, fmt: str = "parquet") -> dict[str, pa.Table]:
    tables = {}
    for f in sorted(out.iterdir()):
        if fmt == "parquet":
            tables[f.stem] = pq.read_table(f)
        else:
            with pa.OSFile(str(f)) as src:
                tables[f.stem] = pyarrow.ipc.open_file(src).read_all()
    return tables


def rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def by_step_req(table: pa.Table) -> dict[tuple[int, str], dict]:
    out = {}
    for r in rows(table):
        key = (r["step"], r["req"])
        assert key not in out, f"two rows for {key}"
        out[key] = r
    return out


def export(capsys, trace: Path, out: Path, *more: str) -> dict[str, pa.Table]:
    code, stdout, err = run(capsys, "export", trace, "--format", "parquet", "-o", out, *more)
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}:")
    return read_dir(out)


def check_against_trace(tables: dict[str, pa.Table], trace: Path) -> None:
    recs = raw_records(trace)
    steps = [(line, r) for line, r in recs if r["kind"] == "step"]
    outputs = {r["step"]: (line, r) for line, r in recs if r["kind"] == "output"}

    for name, table in tables.items():
        assert table.schema.remove_metadata() == SCHEMAS[name], name

    st = rows(tables["steps"])
    assert [r["step"] for r in st] == [r["step"] for _, r in steps]
    assert [r["line"] for r in st] == [line for line, _ in steps]
    assert [r["seq"] for r in st] == [r["seq"] for _, r in steps]
    assert [r["num_free_blocks"] for r in st] == [r.get("num_free_blocks") for _, r in steps]
    sched = lambda r: r.get("new", []) + r.get("resumed", []) + r.get("running", [])
    assert [r["num_scheduled_tokens"] for r in st] == [
        sum(s["num_scheduled_tokens"] for s in sched(r)) for _, r in steps]
    assert [r["output_line"] for r in st] == [
        outputs[r["step"]][0] if r["step"] in outputs else None for _, r in steps]

    # request_steps: a row per request a step names; scheduled items and states as recorded
    rs = by_step_req(tables["request_steps"])
    named = 0
    for _, r in steps:
        k = r["step"]
        reqs = {s["req"] for s in sched(r)} | {s["req"] for s in r.get("states", [])}
        reqs |= set(r.get("preempted", [])) | set(r.get("finished", []))
        reqs |= set(r.get("spec") or {}) | set(r.get("grammar") or {})
        named += len(reqs)
        for how in ("new", "resumed", "running"):
            for s in r.get(how, []):
                row = rs[(k, s["req"])]
                assert row["scheduled_as"] == how
                assert row["num_computed_tokens"] == s["num_computed_tokens"]
                assert row["num_scheduled_tokens"] == s["num_scheduled_tokens"]
                blocks = s["block_ids"] if how != "running" else s["new_block_ids"]
                assert row["scheduled_block_ids"] == blocks
        for s in r.get("states", []):
            row = rs[(k, s["req"])]
            assert (row["status"], row["num_computed_tokens_after"], row["block_ids"],
                    row["more_groups"]) == (s["status"], s["num_computed_tokens"],
                                            s["block_ids"], s.get("more_groups"))
        for req, drafts in (r.get("spec") or {}).items():
            assert rs[(k, req)]["spec_token_ids"] == drafts
    assert len(rs) == named

    lk = rows(tables["lookups"])
    raw_lk = [(r["step"], x["req"], x["local"], x["ext"]) for _, r in steps
              for x in r.get("lookups", [])]
    assert [(x["step"], x["req"], x["local"], x["ext"]) for x in lk] == raw_lk
    ld = rows(tables["loads"])
    assert [(x["step"], x["req"], x["start"], x["end"]) for x in ld] == [
        (r["step"], x["req"], x["start"], x["end"]) for _, r in steps for x in r.get("loads") or []]

    out = by_step_req(tables["outputs"])
    for k, (line, r) in outputs.items():
        for req, tokens in r.get("sampled", {}).items():
            assert out[(k, req)]["sampled_token_ids"] == tokens
            assert out[(k, req)]["line"] == line
        for req, reason in r.get("finished", {}).items():
            assert out[(k, req)]["finish_reason"] == reason
        for req in (r.get("connector") or {}).get("failed_recving", []):
            assert out[(k, req)]["failed_recving"] is True
    for _, r in recs:
        if r["kind"] == "drafts":
            for req, drafts in r.get("drafts", {}).items():
                assert out[(r["step"], req)]["draft_token_ids"] == drafts

    kinds = Counter(r["kind"] for _, r in recs)
    assert tables["prompt_stats"].num_rows == kinds["prompt_stats"]
    arrivals = [r for _, r in recs if r["kind"] == "arrival"]
    assert [(a["req"], a["num_prompt_tokens"]) for a in rows(tables["arrivals"])] == [
        (a["req"], len(a["prompt_token_ids"])) for a in arrivals]
    assert tables["aborts"].num_rows == sum(len(r["reqs"]) for _, r in recs if r["kind"] == "abort")


@pytest.mark.parametrize("name", ["connector", "speculative", "structured-output", "pooling",
                                  "hybrid/hybrid-connector", "vllm-0.18/preemption"])
def test_each_table_holds_what_the_trace_holds(capsys, tmp_path, name):
    trace = TRACES / f"{name}.jsonl.gz"
    assert trace.exists(), trace
    tables = export(capsys, trace, tmp_path / "t", "--no-divergences")
    assert set(tables) == set(TABLES) - {"divergences"}   # no replay, no divergences table
    check_against_trace(tables, trace)
    meta = tables["steps"].schema.metadata
    assert meta[b"kvtrace.table"] == b"steps"
    assert b"kvtrace.truncation" not in meta
    assert json.loads(meta[b"kvtrace.header"])["engine"] == meta[b"kvtrace.engine"].decode()


def _replay_json(capsys, trace: Path) -> list[dict]:
    code, out, err = run(capsys, "replay", "--json", trace)
    assert code == 1, err
    return json.loads(out)["divergences"]


def _canonical(divs: list[dict]) -> list[str]:
    return sorted(json.dumps(d, sort_keys=True) for d in divs)


def _same_divergences(table: pa.Table, want: list[dict]) -> None:
    """The table's rows, ``recorded`` and ``expected`` decoded, hold every field
    of replay's JSON, with the same values."""
    got = [{**r, "recorded": json.loads(r["recorded"]), "expected": json.loads(r["expected"])}
           for r in rows(table)]
    assert want
    fields = set(want[0])
    assert _canonical([{k: r[k] for k in fields} for r in got]) == _canonical(want)


def test_a_fault_trace_exports_replays_divergences(capsys, tmp_path):
    tables = export(capsys, FAULT, tmp_path / "t")
    check_against_trace(tables, FAULT)
    _same_divergences(tables["divergences"], _replay_json(capsys, FAULT))


def test_an_embedded_engine_fault_recording_exports(capsys, tmp_path):
    trace = tmp_path / "emb.jsonl.gz"
    code, _, err = run(capsys, "record", "-o", trace, "--workload", "offload",
                       "--fault", "async-load-overshoot")
    assert code == 0, err
    tables = export(capsys, trace, tmp_path / "t")
    check_against_trace(tables, trace)
    assert json.loads(tables["steps"].schema.metadata[b"kvtrace.header"])["engine"] == \
        "kvtrace-embedded"
    _same_divergences(tables["divergences"], _replay_json(capsys, trace))


def _code_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_guide_queries_run(capsys, tmp_path, monkeypatch):
    blocks = _code_blocks()
    assert len(blocks) == 4
    export(capsys, FAULT, tmp_path / "run-tables")
    monkeypatch.chdir(tmp_path)
    spaces = []
    for code in blocks:
        ns: dict = {}
        exec(compile(code, str(DOC), "exec"), ns)
        assert capsys.readouterr().out.strip()
        spaces.append(ns)
    meta, lowest, pa_join, duck_join = spaces
    recs = raw_records(FAULT)
    steps = [r for _, r in recs if r["kind"] == "step"]

    assert meta["meta"].get(b"kvtrace.truncation") is None

    low = min(r["num_free_blocks"] for r in steps)
    assert lowest["low"] == low
    assert lowest["tightest"]["step"].to_pylist() == [
        r["step"] for r in steps if r["num_free_blocks"] == low]

    how = {(r["step"], s["req"]): kind for r in steps for kind in ("new", "resumed", "running")
           for s in r.get(kind, [])}
    divs = _replay_json(capsys, FAULT)
    joined = pa_join["joined"].to_pylist()
    assert len(joined) == len(divs)
    assert sorted(r["line"] for r in joined) == sorted(d["line"] for d in divs)
    for r in joined:
        assert r["scheduled_as"] == how.get((r["step"], r["req"]))
    duck = duck_join["joined"]
    assert len(duck) == len(divs)
    assert Counter((s, q, f) for s, q, f, *_ in duck) == Counter(
        (d["step"], d["req"], d["field"]) for d in divs)
    for step, req, _f, _r, _e, scheduled_as, _blocks in duck:
        assert scheduled_as == how.get((step, req))


def _cut(tmp_path: Path, src: Path, line: int) -> Path:
    """``src`` uncompressed, cut in the middle of ``line``."""
    lines = gzip.decompress(src.read_bytes()).split(b"\n")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"\n".join(lines[:line - 1]) + b"\n" + lines[line - 1][:len(lines[line - 1]) // 2])
    return cut


@pytest.mark.parametrize("fmt,more", [("parquet", ()), ("arrow", ("--no-divergences",))])
def test_a_cut_trace_exports_its_complete_part_and_says_so(capsys, tmp_path, fmt, more):
    cut = _cut(tmp_path, TRACES / "preemption.jsonl.gz", 120)
    out = tmp_path / "t"
    code, stdout, err = run(capsys, "export", cut, "--format", fmt, "-o", out, *more)
    assert code == 0, err
    assert err == f"kvtrace: {cut}: exported up to line 119: line 120 is cut off mid-record\n"
    assert sorted(p.suffix for p in out.iterdir()) == [f".{fmt}"] * len(list(out.iterdir()))
    tables = read_dir(out, fmt)
    assert ("divergences" in tables) == (fmt == "parquet")
    check_against_trace(tables, cut)
    assert max(r["line"] for r in rows(tables["steps"])) < 120
    for name, table in tables.items():
        meta = table.schema.metadata
        assert meta[b"kvtrace.truncation"] == b"line 120 is cut off mid-record", name
        assert meta[b"kvtrace.last_line"] == b"119"
        assert b"kvtrace.end" not in meta


def test_an_output_that_exists_is_refused(capsys, tmp_path):
    trace = TRACES / "preemption.jsonl.gz"
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    afile = tmp_path / "afile"
    afile.write_text("mine too")
    for out, needle in ((full, "the directory exists and is not empty"),
                        (afile, "exists and is not an empty directory")):
        code, stdout, err = run(capsys, "export", trace, "--format", "parquet", "-o", out)
        assert code == 2 and not stdout
        assert err.count("\n") == 1 and err.startswith(f"kvtrace: {out}: {needle}"), err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert afile.read_text() == "mine too"
    code, _, err = run(capsys, "export", trace, "--format", "parquet", "-o", trace)
    assert code == 2 and "this is the file being read" in err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "export", trace, "--format", "parquet", "--no-divergences",
                       "-o", empty)
    assert code == 0, err
    assert {p.stem for p in empty.iterdir()} == set(TABLES) - {"divergences"}


_NO_PYARROW = ("import sys; sys.modules['pyarrow'] = None; from kvtrace.cli import main; "
               "main(sys.argv[1:])")


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_without_pyarrow_the_table_formats_say_how_to_install_it(tmp_path, fmt):
    out = tmp_path / "t"
    p = subprocess.run([sys.executable, "-c", _NO_PYARROW, "export", str(FAULT),
                        "--format", fmt, "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1
    assert f"--format {fmt} needs pyarrow" in p.stderr
    assert "pip install 'kvtrace[export]'" in p.stderr
    assert not out.exists() and not p.stdout


def test_other_commands_never_import_pyarrow(tmp_path):
    code = ("import sys; from kvtrace.cli import run; "
            "c = run(sys.argv[1:]); print(c, 'pyarrow' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, "export", "--no-divergences",
                        str(FAULT), "-o", str(tmp_path / "e.json")],
                       capture_output=True, text=True)
    assert p.stdout.split()[-2:] == ["0", "False"], p.stderr

