"""What a new user of the command line meets first: the seed's range in
words, ``-`` for standard input, JSON that is not a trace named for what it
is, an honest Perfetto time axis that agrees with ``kvtrace show``,
``record --requests N``, and a missing vLLM as exit 2 with the install line."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import zstandard

from kvtrace import cli
from kvtrace.commands._common import VLLM_INSTALL, VllmUnavailable, importing
from kvtrace.engine import FAULT_WORKLOADS, WORKLOADS, build_workload, record_workload
from kvtrace.engine.engine import EngineStalled
from kvtrace.report.perfetto import load_events
from kvtrace.report.summary import summarize
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceReader

ENV = {**os.environ, "KVTRACE_QUIET": "1", "COLUMNS": "80"}


def run(capsys, *argv):
    code = cli.run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def kvtrace(*argv, stdin=None, data: bytes | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    """The command in a fresh process: ``data`` piped to its standard input,
    or ``stdin`` (an open file) as it; ``prelude`` runs before the CLI."""
    code = f"import sys\n{prelude}\nfrom kvtrace.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], input=data,
                          stdin=stdin if data is None else None, capture_output=True, env=ENV,
                          timeout=600)


def one_line(err: str | bytes, *needles: str) -> str:
    text = err.decode() if isinstance(err, bytes) else err
    assert "Traceback" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith("kvtrace: ")
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def offload(tmp_path_factory) -> Path:
    """A clean trace of the offload workload (async loads), plain."""
    path = tmp_path_factory.mktemp("offload") / "offload.jsonl"
    record_workload(path, build_workload("offload", 0))
    return path


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faulty") / "faulty.jsonl"
    record_workload(path, build_workload("offload", 0), "async-load-overshoot")
    return path


# --------------------------------------------------------------------------- 1. --seed


def test_the_seed_help_gives_its_range_in_words(capsys):
    code, out, _ = run(capsys, "record", "-h")
    assert code == 0
    text = " ".join(out.split())
    assert "0 to 2^64-1" in text
    assert "<=x<=" not in text and "9223372036854775808" not in text


@pytest.mark.parametrize("seed", [-1, 2 ** 64, "x"])
def test_a_seed_outside_the_range_is_one_line(capsys, tmp_path, seed):
    code, _, err = run(capsys, "record", "-o", tmp_path / "t.jsonl", "--seed", seed)
    assert code == 2
    one_line(err, "'--seed'")
    if seed != "x":
        one_line(err, "0 to 2^64-1")
    assert not (tmp_path / "t.jsonl").exists()


def test_the_highest_seed_records_and_replays(capsys, tmp_path):
    out = tmp_path / "t.jsonl"
    code, _, err = run(capsys, "record", "-o", out, "--seed", 2 ** 64 - 1)
    assert code == 0, err
    with TraceReader(out) as r:
        assert r.header.meta["seed"] == 2 ** 64 - 1
    code, _, err = run(capsys, "replay", "--no-kv-check", out)
    assert code == 0, err


# --------------------------------------------------------------------------- 2. "-"


@pytest.mark.parametrize("packing", ["plain", "gzip", "zstd"])
def test_replay_reads_a_trace_on_standard_input(faulty, packing):
    data = faulty.read_bytes()
    data = {"plain": data, "gzip": gzip.compress(data),
            "zstd": zstandard.ZstdCompressor().compress(data)}[packing]
    p = kvtrace("replay", "--no-kv-check", "--json", "-", data=data)
    assert p.returncode == 1, p.stderr   # the fault's divergences: the trace was read
    by_file = kvtrace("replay", "--no-kv-check", "--json", faulty)
    assert by_file.returncode == 1
    assert (orjson.loads(p.stdout)["divergences"]
            == orjson.loads(by_file.stdout)["divergences"])


def test_show_and_diff_read_standard_input(offload, faulty):
    p = kvtrace("show", "-", data=offload.read_bytes())
    assert p.returncode == 0, p.stderr
    assert b"22 requests" in p.stdout
    p = kvtrace("diff", "--match", "id", "-", offload, data=faulty.read_bytes())
    assert p.returncode == 1, p.stderr
    p = kvtrace("diff", "--match", "id", offload, "-", data=offload.read_bytes())
    assert p.returncode == 0, p.stderr


def test_diff_choosing_its_match_needs_a_file_or_match_for_a_pipe(offload):
    p = kvtrace("diff", "-", offload, data=offload.read_bytes())
    assert p.returncode == 2
    one_line(p.stderr, "standard input", "--match")
    with open(offload, "rb") as f:   # standard input a file (< trace): read as often as needed
        p = kvtrace("diff", "-", offload, stdin=f)
    assert p.returncode == 0, p.stderr


def test_errors_on_standard_input_name_it_with_the_line(offload):
    lines = offload.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"seq"', b'"sq"')
    p = kvtrace("replay", "--no-kv-check", "-", data=b"".join(lines))
    assert p.returncode == 2
    assert one_line(p.stderr) == "kvtrace: standard input:5: missing field 'seq'"
    p = kvtrace("show", "-", data=b"")
    assert p.returncode == 2
    one_line(p.stderr, "standard input:1: empty file")


@pytest.mark.parametrize("argv", [
    ["report", "-o", "{tmp}/r.html", "-"],
    ["report", "-o", "{tmp}/r.html", "{trace}", "--against", "-"],
    ["export", "-o", "{tmp}/e.json", "-"],
    ["export", "--no-divergences", "-o", "{tmp}/e.json", "-"],
    ["replay", "--scheduler", "vllm", "-"],
    ["show", "--step", "3", "-"],
], ids=["report", "report-against", "export", "export-no-divergences", "replay-vllm", "show-step"])
def test_commands_that_read_twice_refuse_standard_input(offload, tmp_path, argv):
    argv = [a.format(tmp=tmp_path, trace=offload) for a in argv]
    p = kvtrace(*argv, data=offload.read_bytes())
    assert p.returncode == 2
    one_line(p.stderr, "standard input", "more than once")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,needle", [
    (["diff", "-", "-"], "given twice"),
    (["replay", "-", "{trace}"], "the one trace"),
    (["record", "-o", "-"], "standard output"),
    (["replay", "{trace}", "-o", "-"], "name a file"),
])
def test_dash_where_it_cannot_work_is_one_line(offload, argv, needle):
    p = kvtrace(*[a.format(trace=offload) for a in argv], data=offload.read_bytes())
    assert p.returncode == 2
    one_line(p.stderr, needle)


def test_a_file_called_dash_is_still_read_as_dot_slash_dash(offload, tmp_path, capsys):
    (tmp_path / "-").write_bytes(offload.read_bytes())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, out, err = run(capsys, "replay", "--no-kv-check", "./-")
    finally:
        os.chdir(cwd)
    assert code == 0, err


# --------------------------------------------------------------------------- 3. other JSON


def test_a_pretty_printed_json_file_is_named_so(capsys, tmp_path):
    doc = tmp_path / "pretty.json"
    with open(doc, "w") as f:
        json.dump({"kind": "header", "schema": 1, "config": {}}, f, indent=2)
    listed = tmp_path / "list.json"
    with open(listed, "w") as f:
        json.dump([{"kind": "header"}, {"kind": "step"}], f, indent=2)
    for path in (doc, listed):
        code, _, err = run(capsys, "replay", path)
        assert code == 2
        assert one_line(err) == (f"kvtrace: {path}:1: a JSON document spread over several lines; "
                                 "a kvtrace trace has one JSON record per line")


def test_a_json_record_that_is_not_JSON_is_still_not_JSON(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 4, oops}\n')
    code, _, err = run(capsys, "replay", bad)
    assert code == 2
    one_line(err, f"{bad}:1: not JSON (")


def test_kvtraces_own_perfetto_export_is_named_so(capsys, tmp_path, offload):
    exported = tmp_path / "x.json"
    code, _, err = run(capsys, "export", "--no-divergences", "-o", exported, offload)
    assert code == 0, err
    doc = orjson.loads(exported.read_bytes())
    one = tmp_path / "one-line.json"        # the same document on one line
    one.write_bytes(orjson.dumps(doc))
    events = tmp_path / "array.json"         # the array form of the trace-event format
    events.write_bytes(orjson.dumps(doc["traceEvents"]))
    gz = tmp_path / "x.json.gz"
    gz.write_bytes(gzip.compress(exported.read_bytes()))
    for path in (exported, one, events, gz):
        for argv in (["replay", path], ["show", path], ["diff", "--match", "id", path, offload]):
            code, _, err = run(capsys, *argv)
            assert code == 2, argv
            assert one_line(err) == (f"kvtrace: {path}: a Perfetto (Chrome trace-event) file, "
                                     "not a kvtrace trace"), argv


# --------------------------------------------------------------------------- 4. Perfetto


def test_the_perfetto_time_axis_says_it_counts_steps(capsys, tmp_path, offload, monkeypatch):
    import kvtrace.commands._common as common

    out = tmp_path / "x.json"
    code, stdout, err = run(capsys, "export", "--no-divergences", "-o", out, offload)
    assert (code, stdout, err) == (0, f"wrote {out}\n", "")   # a script: nothing on stderr
    monkeypatch.setattr(common, "show_progress", lambda: True)   # a person at a terminal
    code, stdout, err = run(capsys, "export", "--no-divergences", "-o", out, offload)
    assert code == 0
    assert stdout == f"wrote {out}\n"
    one_line(err, "1 ms = 1 step")
    doc = orjson.loads(out.read_bytes())
    assert "1 ms = 1 step" in doc["metadata"]["time_axis"]
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert len(names) == 2 and all("1 ms = 1 step" in n for n in names)
    with TraceReader(offload) as r:
        last = max(e.step for e in r if isinstance(e, ev.Step))
    assert doc["metadata"]["steps"] == last + 1
    assert max(e["ts"] + e.get("dur", 0) for e in doc["traceEvents"] if "ts" in e) \
        <= (last + 1) * 1000


def _parked_from_the_trace(path: Path) -> dict[str, list[tuple[int, int]]]:
    """Each request's asynchronous loads, from the records alone (trace
    format 3.3 and 3.4): from the step whose state first says
    WAITING_FOR_REMOTE_KVS to the next step recorded after the output that
    reports the load finished."""
    spans: dict[str, list[tuple[int, int]]] = {}
    since: dict[str, int] = {}
    done: set[str] = set()
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.Step):
                for req in done:
                    if req in since:
                        spans.setdefault(req, []).append((since.pop(req), e.step))
                done.clear()
                for st in e.states:
                    if st.status == "WAITING_FOR_REMOTE_KVS" and st.req not in since:
                        since[st.req] = e.step
            elif isinstance(e, ev.Output) and e.connector is not None:
                done.update(req for req in e.connector.finished_recving
                            if req not in e.connector.failed_recving)
    return spans


def _loading_slices(exported: Path) -> dict[str, list[tuple[int, int]]]:
    events = load_events(exported)
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    out: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if e["ph"] == "X" and e["name"] == "loading KV":
            out.setdefault(names[e["tid"]], []).append((e["ts"] // 1000,
                                                        (e["ts"] + e["dur"]) // 1000))
    return out


def _failed_async_attempts(path: Path) -> int:
    """Lookups with an asynchronous hit after which the request is still
    WAITING: the admission failed, and nothing loads yet."""
    n = 0
    with TraceReader(path) as r:
        for e in r:
            if isinstance(e, ev.Step):
                states = {st.req: st.status for st in e.states}
                n += sum(lk.load_async and states.get(lk.req) == "WAITING" for lk in e.lookups)
    return n


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_loading_kv_agrees_with_the_trace_and_with_show(capsys, tmp_path, async_scheduling):
    trace = tmp_path / "t.jsonl"
    argv = ["record", "-o", trace, "--workload", "offload"]
    code, _, err = run(capsys, *argv, *(["--async-scheduling"] if async_scheduling else []))
    assert code == 0, err
    assert _failed_async_attempts(trace) > 0   # the case where they used to disagree
    expected = _parked_from_the_trace(trace)
    assert len(expected) >= 3
    exported = tmp_path / "x.json"
    code, _, err = run(capsys, "export", "--no-divergences", "-o", exported, trace)
    assert code == 0, err
    assert _loading_slices(exported) == expected
    # kvtrace show: the request parks at the slice's start, and its load is
    # reported done in the output of the step before the slice's end (or, with
    # async scheduling, of an earlier one).
    s = summarize(trace, keep=set(expected), max_timelines=0, history=lambda r: r in expected)
    for req, spans in expected.items():
        marks = s.timelines[req].marks
        assert [m.step for m in marks if m.kind == "async-wait"] == [a for a, _ in spans], req
        done = [m.step for m in marks if m.kind == "load-done"]
        assert len(done) == len(spans), req
        for d, (_, end) in zip(done, spans):
            assert d == end - 1 if not async_scheduling else d < end, req


def test_show_prints_the_wait_for_a_load_where_it_starts(offload):
    expected = _parked_from_the_trace(offload)
    req, spans = next(iter(expected.items()))
    p = kvtrace("show", offload, "--request", req)
    assert p.returncode == 0, p.stderr
    rows = re.findall(r"^[ !] +(\d+)  async-wait ", p.stdout.decode(), flags=re.M)
    assert [int(k) for k in rows] == [a for a, _ in spans]


# --------------------------------------------------------------------------- 5. --requests


def _arrivals(path: Path) -> list[str]:
    with TraceReader(path) as r:
        return [e.req for e in r if isinstance(e, ev.Arrival)]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_requests_makes_a_workload_of_that_many(capsys, tmp_path, workload):
    out = tmp_path / "t.jsonl"
    code, _, err = run(capsys, "record", "-o", out, "--workload", workload, "--requests", 7)
    assert code == 0, err
    assert len(set(_arrivals(out))) == 7
    big = tmp_path / "big.jsonl"
    try:
        record_workload(big, build_workload(workload, 0, 200))
    except EngineStalled:   # load-failures may meet vLLM's stall (docs/findings.md)
        assert workload == "load-failures"
    assert len(set(_arrivals(big))) == 200


def test_the_default_number_of_requests_is_the_workloads_own(capsys, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(capsys, "record", "-o", a, "--workload", "offload")[0] == 0
    n = len(_arrivals(a))
    assert run(capsys, "record", "-o", b, "--workload", "offload", "--requests", n)[0] == 0
    assert a.read_bytes() == b.read_bytes()


def test_a_fault_still_fires_at_200_requests(capsys, tmp_path):
    out = tmp_path / "t.jsonl.gz"
    code, _, err = run(capsys, "record", "-o", out, "--fault", "async-load-overshoot",
                       "--requests", 200)
    assert code == 0, err
    assert len(set(_arrivals(out))) == 200
    code, stdout, err = run(capsys, "replay", "--no-kv-check", "--json", out)
    assert code == 1, err
    assert len(orjson.loads(stdout)["divergences"]) > 0


@pytest.mark.parametrize("fault", list(FAULT_WORKLOADS))
def test_every_fault_fires_at_200_requests(tmp_path, fault):
    try:
        log = record_workload(tmp_path / "t.jsonl", build_workload(FAULT_WORKLOADS[fault], 0, 200),
                              fault).fault_log
    except EngineStalled as e:
        log = e.result.fault_log
    assert log


@pytest.mark.parametrize("argv,needle", [
    (["--engine", "vllm", "--requests", "5"], "embedded engine only"),
    (["--requests", "5", "--", "true"], "embedded engine only"),
    (["--requests", "0"], "from 1 to"),
    (["--requests", "many"], "not an integer"),
])
def test_requests_where_it_does_not_apply_is_one_line(capsys, tmp_path, argv, needle):
    code, _, err = run(capsys, "record", "-o", tmp_path / "t.jsonl", *argv)
    assert code == 2
    one_line(err, needle)


def test_record_help_tells_of_requests(capsys):
    code, out, _ = run(capsys, "record", "-h")
    assert code == 0
    assert "--requests N" in out


# --------------------------------------------------------------------------- 6. no vLLM


NO_VLLM = "sys.modules['vllm'] = None"


@pytest.mark.parametrize("argv", [
    ["record", "-o", "{tmp}/v.jsonl", "--engine", "vllm"],
    ["record", "-o", "{tmp}/v.jsonl", "--engine", "vllm", "--workload", "connector",
     "--fault", "async-load-overshoot"],
    ["record", "-o", "{tmp}/v.jsonl", "--engine", "vllm", "--redact"],
    ["replay", "--scheduler", "vllm", "{trace}"],
    ["replay", "--scheduler", "vllm", "{trace}", "-o", "{tmp}/v.jsonl"],
    ["replay", "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler", "{trace}"],
    ["replay", "--scheduler-cls", "my.patched.Scheduler", "{trace}"],
], ids=["record", "record-fault", "record-redact", "replay-vllm", "replay-vllm-out",
        "scheduler-cls", "scheduler-cls-other"])
def test_without_vllm_every_vllm_path_is_exit_2_with_the_install_line(tmp_path, offload, argv):
    p = kvtrace(*[a.format(tmp=tmp_path, trace=offload) for a in argv], prelude=NO_VLLM)
    assert p.returncode == 2, p.stderr
    one_line(p.stderr, VLLM_INSTALL)
    assert not list(tmp_path.iterdir())


def test_without_vllm_record_of_a_command_needs_none_here(tmp_path):
    """The command runs its own Python: kvtrace's side imports no vLLM."""
    p = kvtrace("record", "-o", tmp_path / "v.jsonl", "--", sys.executable, "-c", "pass",
                prelude=NO_VLLM)
    assert p.returncode == 4   # ran, recorded nothing
    one_line(p.stderr, "no trace written")


def test_a_vllm_module_missing_at_import_is_exit_2_with_the_install_line():
    with pytest.raises(VllmUnavailable) as got:
        with importing("the vLLM recorder"):
            raise ModuleNotFoundError("No module named 'vllm.v1.x'", name="vllm.v1.x")
    assert got.value.exit_code == 2
    assert VLLM_INSTALL in str(got.value)
    with pytest.raises(Exception) as other:   # another missing module is kvtrace's own problem
        with importing("the vLLM recorder"):
            raise ModuleNotFoundError("No module named 'msgspec'", name="msgspec")
    assert other.value.exit_code == 3 and VLLM_INSTALL not in str(other.value)
