"""The kvtrace command: exit codes, output, and one-line errors."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from kvtrace import cli
from kvtrace.findings import Divergence
from kvtrace.trace.events import Step

from tests._paths import REPO
from tests.mini_traces import mini_header, write_mini_trace

TRACES = REPO / "traces"


def run(capsys, *argv):
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _edit_nct(req="r2", step=2):
    def edit(ev):
        if isinstance(ev, Step) and ev.step == step:
            for s in ev.running:
                if s.req == req:
                    s.num_computed_tokens += 1
    return edit


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


# --------------------------------------------------------------------------- diff


def test_diff_identical_exits_0(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl.gz")
    code, out, err = run(capsys, "diff", str(a), str(a))
    assert code == 0, err
    assert "3 requests compared, 0 diverge" in out
    assert err == ""


def test_diff_divergent_exits_1_and_names_request(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_edit_nct())
    code, out, err = run(capsys, "diff", str(b), str(a))
    assert code == 1
    assert "r2" in out and "num_computed_tokens" in out and "3rd schedule of r2" in out
    assert "3 requests compared, 1 diverges" in out
    # Step 2 is line 12 of the mini trace (header, 3 arrivals, then step 0 ...).
    assert ("first divergence at step 2, line 12 of A, request r2, field num_computed_tokens"
            in " ".join(out.split()))   # wrapped at the console's width


def test_diff_json(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl")
    b = write_mini_trace(tmp_path / "b.jsonl", edit=_edit_nct())
    code, out, _ = run(capsys, "diff", "--json", str(b), str(a))
    assert code == 1
    doc = orjson.loads(out)
    assert doc["summary"]["divergent_requests"] == 1
    [d] = doc["divergences"]
    assert (d["step"], d["req"], d["field"], d["recorded"], d["expected"], d["kind"]) == (
        2, "r2", "num_computed_tokens", 11, 10, "diff")


def test_diff_reports_truncation(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl")
    lines = a.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:-4]) + lines[-4][:7])
    code, out, _ = run(capsys, "diff", str(cut), str(cut))
    assert code == 0
    assert f"read up to line {len(lines) - 4}" in out


# --------------------------------------------------------------------------- errors


def _one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtrace: ")
    for n in needles:
        assert n in lines[0]


def test_missing_file_exits_2(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl")
    code, out, err = run(capsys, "diff", str(a), str(tmp_path / "nope.jsonl"))
    assert code == 2
    _one_line_error(err, "nope.jsonl", "cannot open")


def test_malformed_line_exits_2_naming_line(tmp_path, capsys):
    a = write_mini_trace(tmp_path / "a.jsonl")
    lines = a.read_bytes().splitlines(keepends=True)
    lines[3] = b"{nope\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines))
    code, _, err = run(capsys, "diff", str(bad), str(a))
    assert code == 2
    _one_line_error(err, f"{bad}:4:", "not JSON")


def test_garbage_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(os.urandom(4096))
    code, _, err = run(capsys, "diff", str(bad), str(bad))
    assert code == 2
    _one_line_error(err)


@pytest.mark.parametrize("argv,needle", [
    (["diff"], "Missing argument 'A'"),
    (["diff", "only-one"], "Missing argument 'B'"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["replay", "x.jsonl", "--device", "tpu"], "'tpu' is not one of"),
    (["record"], "Missing option '-o'"),
    (["diff", "--bogus", "a", "b"], "No such option '--bogus'"),
    (["replay", "-j", "-1", "a", "b"], "-1 is not in the range x>=0"),
])
def test_usage_errors_exit_2_with_one_line(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    _one_line_error(err, needle)


def test_a_directory_for_a_trace_is_one_line(capsys, tmp_path):
    for argv in (["diff", str(tmp_path), str(tmp_path)], ["show", str(tmp_path)]):
        code, _, err = run(capsys, *argv)
        assert code == 2
        _one_line_error(err, str(tmp_path), "is a directory")
    # replay reads a flight recorder's segment directory; this one holds none
    code, _, err = run(capsys, "replay", str(tmp_path))
    assert code == 2
    _one_line_error(err, str(tmp_path), "holds no segment")


def test_an_output_that_cannot_be_written_is_one_line(capsys, tmp_path):
    trace = str(TRACES / "preemption.jsonl.gz")
    missing = tmp_path / "no" / "such" / "dir" / "out.jsonl"
    for argv in (["replay", "--no-kv-check", trace, "-o", str(missing)],
                 ["export", "--no-divergences", trace, "-o", str(missing)],
                 ["report", trace, "-o", str(missing)]):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        _one_line_error(err, str(missing), "No such file or directory")


def test_an_output_never_overwrites_the_trace_being_read(capsys, tmp_path):
    """Not by its name, not through a link, not for any command that writes."""
    import shutil

    trace = tmp_path / "t.jsonl.gz"
    shutil.copy(TRACES / "preemption.jsonl.gz", trace)
    link = tmp_path / "link.jsonl.gz"
    link.symlink_to(trace)
    before = trace.read_bytes()
    for argv in (["replay", "--no-kv-check", str(trace), "-o", str(trace)],
                 ["replay", "--no-kv-check", str(trace), "-o", str(link)],
                 ["export", "--no-divergences", str(trace), "-o", str(link)],
                 ["report", str(trace), "-o", str(trace)],
                 ["redact", str(trace), str(link)]):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        _one_line_error(err, "this is the file being read")
        assert trace.read_bytes() == before, argv


def test_markup_and_control_characters_in_a_trace_are_shown_as_text(capsys, tmp_path):
    """A request id is data: rich markup in it is not parsed (a closing tag
    used to crash the table), and control characters do not reach the terminal."""
    from tests.mini_traces import load_records, save_records

    recs = load_records(TRACES / "faults" / "async-load-overshoot.jsonl.gz")
    req = next(r["req"] for r in recs if r["kind"] == "arrival")
    odd = "[/x]\x1b]0;t" + req

    def rename(x):
        if isinstance(x, dict):
            return {(odd if k == req else k): rename(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rename(v) for v in x]
        return odd if x == req else x

    path = save_records([rename(r) for r in recs], tmp_path / "odd.jsonl")
    code, out, err = run(capsys, "replay", "--no-kv-check", str(path))
    assert code == 1, err
    assert "[/x]" in out and "\x1b" not in out and "\\x1b]0;t" in out


@pytest.mark.parametrize("argv,needle", [
    (["record", "-o", "x.jsonl", "--workload", "nope"], "unknown workload"),
    (["record", "-o", "x.jsonl", "--model", "."], "--model needs --engine vllm"),
    (["record", "-o", "x.jsonl", "--fault", "no-such-fault"], "unknown fault 'no-such-fault'"),
    (["record", "-o", "x.jsonl", "--engine", "vllm", "--fault", "no-reload-after-preempt"],
     "vLLM fault"),
    (["replay", "a.jsonl", "b.jsonl", "-o", "c.jsonl"], "-o needs a single trace"),
    (["record", "-o", "x.jsonl", "--fault", "async-load-overshoot", "--", "true"], "do not apply"),
])
def test_record_argument_problems_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    _one_line_error(err, needle)


def test_help_and_version_exit_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "record" in out and "replay" in out and "diff" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and "kvtrace" in out


def test_internal_error_exits_3_with_hint(tmp_path, capsys, monkeypatch):
    import kvtrace.diff

    def boom(a, b, **kw):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(kvtrace.diff, "diff_files", boom)
    monkeypatch.delenv("KVTRACE_DEBUG", raising=False)
    code, _, err = run(capsys, "diff", "a", "b")
    assert code == 3
    _one_line_error(err, "internal error", "RuntimeError: something broke", "KVTRACE_DEBUG=1")


def test_debug_shows_traceback(tmp_path, capsys, monkeypatch):
    import kvtrace.diff

    def boom(a, b, **kw):
        raise RuntimeError("broke")

    monkeypatch.setattr(kvtrace.diff, "diff_files", boom)
    monkeypatch.setenv("KVTRACE_DEBUG", "1")
    code, _, err = run(capsys, "diff", "a", "b")
    assert code == 3
    assert "Traceback" in err and "kvtrace: internal error: RuntimeError: broke" in err


def test_exception_with_exit_code_is_honoured(capsys, monkeypatch):
    import kvtrace.diff

    class Refused(Exception):
        exit_code = 4

    def refuse(a, b, **kw):
        raise Refused("trace uses async scheduling, which replay does not model")

    monkeypatch.setattr(kvtrace.diff, "diff_files", refuse)
    code, _, err = run(capsys, "diff", "a", "b")
    assert code == 4
    _one_line_error(err, "async scheduling")


def test_real_process_no_traceback(tmp_path):
    """Through the interpreter, as a user runs it: no stdin, one line on stderr."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"kind": "header", "schema": 7}\n')
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "diff", str(bad), str(bad)],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert p.returncode == 2
    _one_line_error(p.stderr, "unsupported schema version 7")


# --------------------------------------------------------------------------- replay / record plumbing


def _fake_replay_result(divs):
    from kvtrace.results import ReplayResult

    return ReplayResult(path="fake", header=mini_header(), divergences=divs, steps=3,
                        steps_in_trace=3, truncation="line 9 is cut off mid-record")


@pytest.mark.skipif(not _has("kvtrace.replay", "replay_file"), reason="kvtrace.replay not built yet")
def test_replay_plumbing(tmp_path, capsys, monkeypatch):
    import kvtrace.replay

    calls = []

    def fake(path, out=None, **kw):
        calls.append((str(path), out, kw))
        div = Divergence(step=4, req="r1", field="num_computed_tokens", recorded=32, expected=20,
                         rule="S:1337 async-load admission sets c = L + E")
        return _fake_replay_result([div] if "bad" in str(path) else [])

    monkeypatch.setattr(kvtrace.replay, "replay_file", fake)
    code, out, _ = run(capsys, "replay", "good.jsonl")
    assert code == 0 and "no divergence" in out
    assert "replayed up to line 8: line 9 is cut off mid-record" in out
    code, out, _ = run(capsys, "replay", "bad.jsonl", "-o", str(tmp_path / "o.jsonl"))
    assert code == 1 and "r1" in out and "S:1337" in out
    assert calls[-1][1] == tmp_path / "o.jsonl"
    code, out, _ = run(capsys, "replay", "--json", "bad.jsonl")
    doc = orjson.loads(out)
    assert code == 1 and doc["divergences"][0]["req"] == "r1"
    assert doc["truncation"] == "line 9 is cut off mid-record"


@pytest.mark.skipif(not _has("kvtrace.engine", "record_embedded"), reason="kvtrace.engine not built yet")
def test_record_embedded_plumbing(tmp_path, capsys, monkeypatch):
    import kvtrace.engine

    calls = []
    from types import SimpleNamespace

    from kvtrace.record.step_writer import open_step_writer

    def fake(out, wl, fault, seed, progress, open_writer):
        assert callable(progress)
        assert open_writer is open_step_writer   # every completed step survives a kill
        calls.append((out, {"workload": wl.name, "fault": fault, "seed": seed,
                            "async_scheduling": wl.config.async_scheduling}))
        return SimpleNamespace(fault_log=["fired"])

    monkeypatch.setattr(kvtrace.engine, "record_workload", fake)
    out_path = tmp_path / "t.jsonl.gz"
    code, out, _ = run(capsys, "record", "-o", str(out_path), "--workload", "offload",
                       "--fault", "async-load-overshoot", "--seed", "7")
    assert code == 0 and f"wrote {out_path}" in out
    assert calls == [(out_path, {"workload": "offload", "fault": "async-load-overshoot", "seed": 7,
                                 "async_scheduling": False})]
    code, _, _ = run(capsys, "record", "-o", str(out_path), "--workload", "kv-pressure",
                     "--async-scheduling")
    assert code == 0 and calls[-1][1]["async_scheduling"] is True
    code, _, _ = run(capsys, "record", "-o", str(out_path), "--workload", "kv-pressure")
    assert code == 0 and calls[-1][1]["seed"] == 0   # the default seed


def test_record_refuses_a_seed_where_the_workload_is_fixed(tmp_path, capsys):
    """The vLLM workloads and a recorded command take no seed: --seed is refused
    there, before anything runs, rather than silently ignored."""
    out_path = tmp_path / "t.jsonl"
    for extra in (["--engine", "vllm"], ["--", "true"]):
        code, out, err = run(capsys, "record", "-o", str(out_path), "--seed", "3", *extra)
        assert code == 2 and out == ""
        assert err.strip() == ("kvtrace: --seed applies to the embedded engine only: "
                               "the vLLM workloads are fixed")
        assert not out_path.exists()


def test_record_async_scheduling_on_the_embedded_engine(tmp_path, capsys):
    from kvtrace.replay import replay_file
    from kvtrace.trace.io import TraceReader

    out_path = tmp_path / "a.jsonl"
    code, _, _ = run(capsys, "record", "-o", str(out_path), "--workload", "kv-pressure",
                     "--async-scheduling")
    assert code == 0
    with TraceReader(out_path) as r:
        assert r.header.features.async_scheduling is True
        order = [(e.kind, e.step) for e in r if e.kind in ("step", "output")]
    # the output of step N comes after the schedule of step N+1
    assert order[:4] == [("step", 0), ("step", 1), ("output", 0), ("step", 2)]
    assert replay_file(out_path, device="cpu").divergences == []
    # with the external store (a connector) too
    code, _, _ = run(capsys, "record", "-o", str(tmp_path / "b.jsonl"), "--workload", "offload",
                     "--async-scheduling")
    assert code == 0
    with TraceReader(tmp_path / "b.jsonl") as r:
        f = r.header.features
        assert (f.async_scheduling, f.defer_block_free, f.requires_kv_delivery) == \
            (True, True, True)
    assert replay_file(tmp_path / "b.jsonl", device="cpu").divergences == []
    # not with a command
    code, _, err = run(capsys, "record", "-o", str(tmp_path / "c.jsonl"), "--async-scheduling",
                       "--", "true")
    assert code == 2 and "--async-scheduling" in err


@pytest.mark.skipif(not _has("kvtrace.lab.run", "record_command"),
                    reason="kvtrace.lab.run not built yet")
def test_record_command_plumbing(tmp_path, capsys, monkeypatch):
    import kvtrace.lab.run as vr

    calls = []

    def fake(out, argv):
        calls.append((out, argv))
        return 5

    monkeypatch.setattr(vr, "record_command", fake)
    out_path = tmp_path / "t.jsonl"
    code, _, _ = run(capsys, "record", "-o", str(out_path), "--", "python", "-m", "x", "--port", "1")
    assert code == 5
    assert calls == [(out_path, ["python", "-m", "x", "--port", "1"])]


@pytest.mark.skipif(not _has("kvtrace.lab.run", "record_vllm_offline"),
                    reason="kvtrace.lab.run not built yet")
def test_record_vllm_plumbing(tmp_path, capsys, monkeypatch):
    import kvtrace.lab.run as vr

    calls = []
    monkeypatch.setattr(vr, "record_vllm_offline", lambda m, o, w: calls.append((m, o, w)))
    out_path = tmp_path / "t.jsonl"
    code, _, err = run(capsys, "record", "-o", str(out_path), "--engine", "vllm",
                       "--workload", "kv-pressure", "--model", str(tmp_path))
    assert code == 0, err
    assert calls == [(str(tmp_path), out_path, "preemption")]


def test_repeated_divergences_fold_into_one_line_per_field():
    from kvtrace.findings import Divergence, by_request

    divs = [Divergence(s, "r", "kv-content", "x", "y", "rule", seq=s) for s in (5, 6, 6, 7, 9)]
    divs.insert(2, Divergence(6, "q", "kv-content", "x", "y", "rule", seq=6))
    findings = by_request(divs)
    assert [(s.req, s.cause.step, s.count) for s in findings] == [("r", 5, 5), ("q", 6, 1)]
    (fold,) = findings[0].folds   # r's four later ones: one line, steps 6 to 9
    assert (fold.count, fold.first_step, fold.last_step) == (4, 6, 9)


@pytest.mark.parametrize("what", ["finished_recving", "finished_sending"])
def test_a_finished_transfer_for_a_running_request_is_the_engines_assertion(capsys, tmp_path, what):
    """vLLM asserts that a finished transfer names a request that waits for it or
    has finished (S:3230, S:2747): replay reports the assertion (exit 1), it
    does not crash (exit 3)."""
    from tests.mini_traces import load_records, save_records

    recs = load_records(TRACES / "connector.jsonl.gz")
    out = next(r for r in recs if r["kind"] == "output" and r.get("connector")
               and any(st["status"] == "RUNNING" for st in r["states"]))
    running = next(st["req"] for st in out["states"] if st["status"] == "RUNNING")
    out["connector"][what] = sorted({*out["connector"][what], running})
    path = save_records(recs, tmp_path / "t.jsonl")
    code, stdout, err = run(capsys, "replay", "--no-kv-check", "--json", str(path))
    assert code == 1, err
    doc = orjson.loads(stdout)
    first = doc["divergences"][0]
    assert (first["field"], first["req"], first["step"]) == ("assertion", running, out["step"])
    assert first["rule"].startswith("S:3230" if what == "finished_recving" else "S:2747")


def test_control_characters_in_an_error_message_are_escaped(capsys, tmp_path):
    from tests.mini_traces import load_records, save_records

    recs = load_records(TRACES / "preemption.jsonl.gz")
    out = next(i for i, r in enumerate(recs) if r["kind"] == "output")
    recs[out]["kind"] = "x\x1b]0;t\x07"
    path = save_records(recs, tmp_path / "ctl.jsonl")
    code, _, err = run(capsys, "replay", "--no-kv-check", str(path))
    assert code == 2
    _one_line_error(err, "\\x1b]0;t\\x07")
    assert "\x1b" not in err and "\x07" not in err


def test_a_bad_trace_among_several_is_bad_input_whatever_its_message_says(capsys, tmp_path):
    """The exit code of several traces comes from what went wrong, not from the
    words of a message, which may quote the trace."""
    from tests.mini_traces import load_records, save_records

    recs = load_records(TRACES / "preemption.jsonl.gz")
    recs[3]["kind"] = "internal error: oops"
    bad = save_records(recs, tmp_path / "bad.jsonl")
    code, _, err = run(capsys, "replay", "--no-kv-check", "-j", "1", str(TRACES / "preemption.jsonl.gz"), str(bad))
    assert code == 2
    _one_line_error(err, f"{bad}:4:")


def _pipe(path: Path, first: int = 0) -> str:
    """A pipe that carries ``path``'s bytes, named as a shell's ``<(...)`` names
    it; with ``first``, its first ``first`` bytes come a moment before the rest."""
    import threading
    import time

    r, w = os.pipe()
    data = path.read_bytes()

    def feed():
        with os.fdopen(w, "wb", buffering=0) as f:
            try:
                if first:
                    f.write(data[:first])
                    time.sleep(0.2)
                f.write(data[first:])
            except BrokenPipeError:
                pass
    threading.Thread(target=feed, daemon=True).start()
    return f"/dev/fd/{r}"


@pytest.mark.parametrize("first", [0, 1, 2])
def test_a_trace_read_from_a_pipe_replays_as_from_its_file(capsys, monkeypatch, first):
    """Also when the pipe's first read gives less than the compression's magic."""
    trace = TRACES / "preemption.jsonl.gz"
    monkeypatch.setenv("KVTRACE_REPLAY_WORKER", "1")   # a pipe has one reader: no worker
    want = run(capsys, "replay", "--json", "--no-kv-check", str(trace))
    fd = _pipe(trace, first)
    got = run(capsys, "replay", "--json", "--no-kv-check", fd)
    os.close(int(fd.rsplit("/", 1)[1]))
    assert got[0] == want[0] == 0
    assert orjson.loads(got[1])["steps"] == orjson.loads(want[1])["steps"] > 0


@pytest.mark.parametrize("argv", [["report", "-o", "{out}", "{fifo}"],
                                  ["report", "-o", "{out}", "--against", "{fifo}", "{trace}"],
                                  ["export", "-o", "{out}", "{fifo}"]])
def test_commands_that_read_a_trace_twice_refuse_a_pipe(capsys, tmp_path, argv):
    """A pipe's data goes to one read only; a named pipe would make the second
    read wait for ever. Refused at once, on one line."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    names = {"out": str(tmp_path / "out"), "fifo": str(fifo), "trace": str(TRACES / "preemption.jsonl.gz")}
    code, _, err = run(capsys, *[a.format(**names) for a in argv])
    assert code == 2
    _one_line_error(err, str(fifo), "not a regular file", "save it to a file first")
    assert not (tmp_path / "out").exists()


def test_diff_of_a_named_pipe_without_a_writer_is_refused_at_once(capsys, tmp_path):
    """Choosing the match mode reads the start of each input first: a named pipe
    is refused before it is opened, which would wait for a writer."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "diff", str(TRACES / "preemption.jsonl.gz"), str(fifo))
    assert code == 2
    _one_line_error(err, str(fifo), "give --match")


def test_diff_of_a_pipe_needs_a_match_mode(capsys):
    trace = TRACES / "preemption.jsonl.gz"
    fd = _pipe(trace)
    code, _, err = run(capsys, "diff", fd, str(trace))
    os.close(int(fd.rsplit("/", 1)[1]))
    assert code == 2
    _one_line_error(err, fd, "give --match")
    fd = _pipe(trace)
    code, out, _ = run(capsys, "diff", "--match", "id", fd, str(trace))
    os.close(int(fd.rsplit("/", 1)[1]))
    assert code == 0 and "0 diverge" in out


def test_replay_says_the_same_whatever_the_hash_seed(tmp_path):
    """The reference goes through a connector output's finished transfers in
    sorted order, not in the order of a set, which differs from process to
    process: connector.jsonl.gz without its output for step 9 makes a finished
    load arrive for requests that no longer wait for one, and replay named the
    first of them in set order (seeds 0 and 1 named different requests)."""
    import gzip

    lines = gzip.decompress((TRACES / "connector.jsonl.gz").read_bytes()).splitlines(keepends=True)
    dropped = [i for i, line in enumerate(lines)
               if orjson.loads(line).get("kind") == "output" and orjson.loads(line)["step"] == 9]
    assert len(dropped) == 1
    mutant = tmp_path / "m.jsonl"
    mutant.write_bytes(b"".join(line for i, line in enumerate(lines) if i != dropped[0]))
    outs = []
    for seed in ("0", "1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, KVTRACE_REPLAY_WORKER="0")
        p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", "--no-kv-check",
                            str(mutant)], capture_output=True, env=env)
        assert p.returncode == 1, p.stderr
        outs.append(p.stdout)
    assert "S:3230" in outs[0].decode()
    assert outs[1] == outs[0] and outs[2] == outs[0]


# --------------------------------------------------------------------------- progress


def _with_terminal_stderr(argv: list[str], **env_extra) -> tuple[int, bytes, bytes]:
    """Run ``kvtrace ARGV`` with standard error on a terminal (a pty) and
    standard output on a pipe, as ``kvtrace replay --json t > report.json``
    typed at a terminal runs: (exit code, stdout, what the terminal got)."""
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVTRACE_QUIET")}
    env.update(TERM="xterm", COLUMNS="120", **env_extra)
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", *argv], stdout=subprocess.PIPE,
                         stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:   # the terminal's other end closed (EIO)
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = p.stdout.read()
    return p.wait(60), out, seen


def test_progress_goes_to_the_terminal_and_never_into_the_output(tmp_path):
    """A person at a terminal sees what a long command is doing, on standard
    error; what it writes to standard output (a pipe here) is the report
    alone, byte for byte what it writes without a terminal."""
    trace = TRACES / "preemption.jsonl.gz"
    code, out, seen = _with_terminal_stderr(["replay", "--json", "--no-kv-check", str(trace)])
    assert code == 0
    assert b"replaying preemption.jsonl.gz" in seen and b"%" in seen   # of the file read
    plain = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "--json", "--no-kv-check",
                            str(trace)], capture_output=True, env=dict(os.environ, CI="true"))
    assert out == plain.stdout and out.startswith(b"{")
    assert orjson.loads(out)["divergences"] == []
    code, out, seen = _with_terminal_stderr(["record", "-o", str(tmp_path / "t.jsonl"),
                                             "--workload", "kv-pressure"])
    assert code == 0 and b"recording t.jsonl" in seen and b"recording" not in out


def test_no_progress_in_ci_or_when_asked_for_quiet():
    trace = TRACES / "preemption.jsonl.gz"
    for extra in ({"CI": "true"}, {"KVTRACE_QUIET": "1"}):
        code, out, seen = _with_terminal_stderr(["replay", "--no-kv-check", str(trace)], **extra)
        assert code == 0 and b"no divergence" in out and seen == b"", (extra, seen)


def test_a_trace_with_no_step_is_not_a_pass(tmp_path, capsys):
    """A recorder that captured nothing leaves a header and an end: replay says
    there was nothing to check and exits 4, in JSON too (its content as for any
    trace), so that a CI gate on replay's status does not pass it."""
    from kvtrace.trace.io import TraceReader, TraceWriter

    header = TraceReader(TRACES / "preemption.jsonl.gz").header
    empty = tmp_path / "empty.jsonl"
    TraceWriter(empty, header).close()
    code, out, _ = run(capsys, "replay", "--no-kv-check", str(empty))
    assert code == 4 and "nothing to check: the trace holds no step" in out
    assert "no divergence" not in out
    code, out, _ = run(capsys, "replay", "--no-kv-check", "--json", str(empty))
    assert code == 4 and orjson.loads(out)["steps"] == 0


@pytest.mark.parametrize("argv, code", [(["true"], 4), (["false"], 1)])
def test_record_of_a_command_that_writes_no_trace_says_so(tmp_path, capsys, argv, code):
    out = tmp_path / "t.jsonl"
    got, stdout, err = run(capsys, "record", "-o", str(out), "--", *argv)
    assert got == code and "wrote" not in stdout and not out.exists()
    assert err.strip() == (f"kvtrace: no trace written to {out}: the command exited with status "
                           f"{code if code != 4 else 0} and started no recording vLLM engine (it "
                           "runs no vLLM, or its Python has no kvtrace)")


def test_record_of_a_command_says_what_it_wrote_when_it_wrote_it(tmp_path, capsys, monkeypatch):
    import kvtrace.lab.run as vr

    def fake(out, argv):
        out.write_text("a trace\n")
        return 0

    monkeypatch.setattr(vr, "record_command", fake)
    out = tmp_path / "t.jsonl"
    code, stdout, err = run(capsys, "record", "-o", str(out), "--", "serve")
    assert code == 0 and stdout.strip() == f"wrote {out}" and err == ""


def test_bare_kvtrace_prints_the_help_as_h_does(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    code_h, out_h, _ = run(capsys, "-h")
    assert out == out_h and out.startswith("Usage: kvtrace") and "\n  replay " in out


@pytest.mark.parametrize("argv", [
    ["record", "-o", "{d}/t.jsonl.bz2"],
    ["replay", "--no-kv-check", str(TRACES / "preemption.jsonl.gz"), "-o", "{d}/t.jsonl.xz"],
    ["redact", str(TRACES / "preemption.jsonl.gz"), "{d}/t.lz4"],
], ids=["record", "replay", "redact"])
def test_a_trace_named_for_a_compression_kvtrace_does_not_write_is_refused(tmp_path, capsys, argv):
    """Written plain under a name that says .bz2, a trace would be unreadable
    to the tools the name promises: refused in one line, nothing written."""
    argv = [a.format(d=tmp_path) for a in argv]
    code, out, err = run(capsys, *argv)
    ending = argv[-1].rsplit(".", 1)[1]
    assert code == 2 and err.strip().startswith("kvtrace: ") and err.count("\n") == 1
    assert f"kvtrace writes traces plain, .gz or .zst, not .{ending}" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fault", sorted(__import__("kvtrace.engine", fromlist=["FAULTS"]).FAULTS))
def test_record_of_a_fault_alone_runs_the_workload_that_shows_it(tmp_path, capsys, fault):
    """Without --workload, --fault runs the workload it fires in (the catalog's
    pairs), and replay flags it; with a workload where it never fires, record
    says so."""
    out = tmp_path / "f.jsonl"
    code, _, err = run(capsys, "record", "-o", str(out), "--fault", fault)
    assert code == 0 and "never fired" not in err, err
    code, _, _ = run(capsys, "replay", str(out))
    assert code == 1


def test_record_says_when_a_fault_never_fired(tmp_path, capsys):
    code, _, err = run(capsys, "record", "-o", str(tmp_path / "f.jsonl"), "--fault",
                       "async-load-overshoot", "--workload", "shared-prefix")
    assert code == 0
    assert err.strip() == ("kvtrace: the fault async-load-overshoot never fired in workload "
                           "shared-prefix: the trace is a clean run (it fires in offload)")
