"""Replay with the record checks in a worker process gives the same result as
replay in one process: the same report on good traces, the same cut on a
truncated one, and the same one-line error, at the same line, on bad input. The
main process never acts on a record the worker has not passed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest

from kvtrace.workers import policy as workers
from kvtrace.replay import replay_file
from kvtrace.workers.record_worker import RecordWorker, RecordWorkerError
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace.events import decode, decode_line, encode

from tests._paths import REPO
from tests.mini_traces import load_records, save_records

TRACES = REPO / "traces"
REAL = sorted(TRACES.glob("*.jsonl.gz")) + sorted(TRACES.glob("faults/*.jsonl.gz")) + sorted(
    TRACES.glob("vllm-bugs/*.jsonl.gz")) + sorted(TRACES.glob("data-path/*.jsonl.gz"))


def result(path, worker: int, device: str | None = None) -> tuple:
    r = replay_file(path, device=device, worker=worker)
    return ([d.to_json() for d in r.divergences], r.steps, r.events, r.truncation, r.stopped,
            r.end, r.slots_checked, r.assumed_loads)


def error(path, worker: int, device: str | None = None) -> str:
    with pytest.raises(TraceError) as e:
        replay_file(path, device=device, worker=worker)
    return str(e.value)


def test_one_decoder_from_bytes_or_objects_and_back():
    """Over every record of the real traces, whose steps and outputs use every
    field (connector output, load plans, free-block counts included): a line
    decoded from its bytes equals the same record decoded from its parsed
    object, and encoding the event and decoding it again gives it back."""
    seen = set()
    for path in REAL:
        for rec in load_records(path)[1:]:
            seen.update((rec["kind"], k) for k in rec)
            ev = decode(rec)
            assert decode_line(orjson.dumps(rec)) == ev, (path.name, rec["seq"])
            assert decode_line(encode(ev)) == ev, (path.name, rec["seq"])
    assert {("step", "loads"), ("step", "lookups"), ("step", "num_free_blocks"), ("output", "connector"),
            ("step", "resumed"), ("step", "preempted"), ("prompt_stats", "prefill_stats")} <= seen


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_vllm_traces_replay_the_same_with_a_worker(path):
    here = result(path, False)
    assert result(path, True) == here
    assert here[1] > 0


def test_a_trace_with_divergences_replays_the_same(faulty):
    here = result(faulty, False)
    assert here[0]   # the fault is found
    assert result(faulty, True) == here


def test_a_trace_cut_off_replays_the_same_up_to_the_cut(faulty, tmp_path):
    recs = load_records(faulty)
    cut = len(recs) * 2 // 3
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs[:cut]) + orjson.dumps(recs[cut])[:40])
    here = result(path, False)
    assert here[3] and "cut off" in here[3] and here[2] == cut - 1
    assert result(path, True) == here


def _step_at(recs, nth=2):
    return [i for i, r in enumerate(recs) if r["kind"] == "step" and r.get("running")][nth]


def _bad_schema(recs):
    recs[len(recs) // 2]["seq"] = "seven"


def _unknown_request(recs):   # only the reader's cross-record checks catch it
    recs[_step_at(recs)]["running"][0]["req"] = "nobody"


def _undecodable(recs):       # would break an unchecked decoder, and the reference after it
    recs[_step_at(recs)]["running"] = [{"req": 5}]


def _block_out_of_range(recs):
    recs[_step_at(recs)]["running"][0]["new_block_ids"] = [10 ** 9]


def _out_of_order(recs):
    recs[_step_at(recs)]["seq"] = 0


def _after_the_end(recs):
    recs.append(dict(recs[-2], seq=recs[-1]["seq"] + 1))


def _output_at(recs, nth=2):
    return [i for i, r in enumerate(recs) if r["kind"] == "output" and r.get("states")][nth]


def _bad_output(recs):        # only an output's own checks catch it
    recs[_output_at(recs)]["states"][0]["num_tokens"] = -1


def _undecodable_output(recs):   # would break an unchecked decoder
    recs[_output_at(recs)]["states"] = [{"req": 5}]


def _kind_not_a_name(recs):
    recs[_output_at(recs)]["kind"] = ["output"]


SPOILERS = pytest.mark.parametrize(
    "spoil", [_bad_schema, _unknown_request, _undecodable, _block_out_of_range, _out_of_order,
              _after_the_end, _bad_output, _undecodable_output, _kind_not_a_name],
    ids=lambda f: f.__name__[1:])


@SPOILERS
def test_bad_input_gets_the_same_error_at_the_same_line(faulty, tmp_path, spoil):
    recs = load_records(faulty)
    spoil(recs)
    path = save_records(recs, tmp_path / "bad.jsonl")
    here = error(path, False)
    assert here.startswith(f"{path}:")
    assert error(path, True) == here


def test_a_line_that_is_not_json_gets_the_same_error(faulty, tmp_path):
    lines = Path(faulty).read_bytes().splitlines(keepends=True)
    lines[len(lines) // 2] = b'{"kind": "step", "seq": \n'
    path = tmp_path / "notjson.jsonl"
    path.write_bytes(b"".join(lines))
    here = error(path, False)
    assert f":{len(lines) // 2 + 1}: not JSON" in here
    assert error(path, True) == here


class Gate:
    """The gate interface, with the worker's verdicts given by the test."""

    def __init__(self, bad_line: int | None = None, path="t"):
        self.through, self.bad_line, self.path, self.asked = 0, bad_line, path, []

    def takes_over(self, line):
        return True

    def wait(self, line):
        self.asked.append(line)
        if self.bad_line is not None and line >= self.bad_line:
            raise TraceError(self.path, self.bad_line, "bad")
        self.through = line + 3   # the worker reports a few lines at a time
        if self.bad_line is not None:
            self.through = min(self.through, self.bad_line - 1)


def test_no_record_is_decoded_before_the_worker_passes_its_line(faulty):
    reader = TraceReader(faulty)
    gate = Gate(bad_line=40)
    got = []
    with pytest.raises(TraceError, match=":40: bad"):
        for e in reader.checked_elsewhere(gate):
            assert reader.last_line <= gate.through
            got.append(e.seq)
    assert gate.asked[-1] == 40 and len(gate.asked) > 5
    assert got == [e.seq for e in TraceReader(faulty)][:38]   # lines 2..39


def test_a_worker_that_dies_is_an_error_not_a_clean_replay(faulty):
    gate = RecordWorker(faulty)
    gate._proc.kill()
    gate._proc.wait()
    with pytest.raises(RecordWorkerError, match="exit code -9"):
        for _ in TraceReader(faulty).checked_elsewhere(gate):
            pass
    gate.close()


def test_a_trace_that_grows_after_the_worker_met_its_end_stops_there(faulty, tmp_path):
    """The worker read the file to its end, and the file grew after (a trace
    still being written): the main process reads no further than the worker did,
    so it replays only records the worker checked, and says where and why it
    stopped."""
    recs = load_records(faulty)
    half = len(recs) // 2
    lines = [orjson.dumps(r) + b"\n" for r in recs]
    alone = TraceReader(save_records(recs[:half], tmp_path / "short.jsonl"))
    want = [e.seq for e in alone]
    live = tmp_path / "live.jsonl"
    live.write_bytes(b"".join(lines[:half]))
    reader = TraceReader(live)
    gate = RecordWorker(reader.path, reader.share())
    assert gate._proc.wait(30) == 0   # it has read the whole file
    with open(live, "ab") as f:
        f.write(b"".join(lines[half:]))
    got = [e.seq for e in reader.checked_elsewhere(gate)]
    gate.close()
    assert got == want and len(got) == half - 1
    assert reader.truncation == f"{alone.truncation}; the file has grown since (is it still being written?)"
    assert f"after line {half}" in alone.truncation


def _started_workers(monkeypatch) -> list:
    """The record workers started from now on, as they start."""
    from kvtrace.workers import record_worker

    started = []
    orig = record_worker.RecordWorker.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(record_worker.RecordWorker, "__init__", init)
    return started


def _still_being_written(monkeypatch, tmp_path, recs: list) -> tuple[Path, int, object]:
    """A trace that holds the first half of ``recs`` and gets the rest once a
    reader of it has met its end, the first time the returned progress callback
    runs: a recording still being written. The main process is then still in
    its first chunk of the file, so a worker is the one that met the end.
    Returns the file, the half, and the callback."""
    from kvtrace.trace import io as trace_io

    half = len(recs) // 2
    lines = [orjson.dumps(r) + b"\n" for r in recs]
    path = tmp_path / "live.jsonl"
    path.write_bytes(b"".join(lines[:half]))
    rest = b"".join(lines[half:])

    shared = []
    orig = trace_io.TraceReader.share

    def share(self):
        fds = orig(self)
        shared.append(fds[1])
        return fds

    monkeypatch.setattr(trace_io.TraceReader, "share", share)
    grown = []

    def grow(_steps):
        if shared and not grown:
            deadline = time.monotonic() + 60
            while len(os.pread(shared[0], 8, 0)) < 8:   # SharedEnd: nobody met the end yet
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with open(path, "ab") as f:
                f.write(rest)
            grown.append(True)
    return path, half, grow


@pytest.mark.parametrize("device", [None, "cpu"])
def test_replay_of_a_trace_still_being_written_stops_at_the_workers_end(faulty, tmp_path,
                                                                        monkeypatch, device):
    """With the record checks' worker, or the content check's: the main process
    replays what the worker read, as one process reading the file then would,
    and says that the file has grown since."""
    from kvtrace.replay import replayer

    recs = load_records(faulty)
    live, half, grow = _still_being_written(monkeypatch, tmp_path, recs)
    monkeypatch.setattr(replayer, "PROGRESS_EVERY", 16)
    res = replay_file(live, device=device, worker=True, progress=grow)
    whole = save_records(recs, tmp_path / "whole.jsonl").stat().st_size
    assert live.stat().st_size == whole   # it grew while it was read
    alone = replay_file(save_records(recs[:half], tmp_path / "h.jsonl"), device=device, worker=False)
    assert f"after line {half}" in alone.truncation
    assert res.truncation == f"{alone.truncation}; the file has grown since (is it still being written?)"
    assert [d.to_json() for d in res.divergences] == [d.to_json() for d in alone.divergences]
    assert res.slots_checked == alone.slots_checked and res.steps == alone.steps


def test_diff_of_a_trace_still_being_written_stops_at_the_workers_end(faulty, tmp_path, monkeypatch):
    from kvtrace.diff import align, diff_files

    live, half, grow = _still_being_written(monkeypatch, tmp_path, load_records(faulty))
    monkeypatch.setattr(align, "PROGRESS_EVERY", 16)
    r = diff_files(live, faulty, worker=True, progress=grow)
    assert live.stat().st_size == save_records(load_records(faulty), tmp_path / "w.jsonl").stat().st_size
    assert r.truncation_a.endswith("the file has grown since (is it still being written?)")
    assert f"after line {half}" in r.truncation_a
    # What the worker read, compared as a cut-off trace: no divergence.
    assert r.identical and r.cut_short


def test_the_command_reports_the_same_with_a_worker(faulty, tmp_path, monkeypatch, capsysbinary):
    from kvtrace.cli import run

    recs = load_records(faulty)
    _unknown_request(recs)
    bad = save_records(recs, tmp_path / "bad.jsonl")
    outputs = []
    for choice in ("0", "1"):
        monkeypatch.setenv(workers.ENV, choice)
        assert run(["replay", "--json", "--no-kv-check", str(faulty)]) == 1
        assert run(["replay", "--no-kv-check", str(bad)]) == 2
        outputs.append(capsysbinary.readouterr())
    assert b"\"kind\": \"invariant\"" in outputs[0].out
    assert b"never arrived" in outputs[0].err and outputs[0].err.count(b"\n") == 1
    assert outputs[1] == outputs[0]


def test_when_a_worker_is_used(tmp_path, monkeypatch):
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"{}\n")
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(workers.MIN_BYTES)
    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)
    assert not workers.wanted(small) and workers.wanted(big)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 1)
    assert not workers.wanted(big)
    monkeypatch.setenv(workers.ENV, "1")
    assert workers.wanted(small)
    monkeypatch.setenv(workers.ENV, "0")
    assert not workers.wanted(big)


def test_the_record_checks_alone_get_a_worker_by_the_text_a_file_holds(tmp_path, monkeypatch):
    """Without the content check, a worker pays from MIN_TEXT_BYTES of trace
    text on: a plain file that large, or a compressed one of a twelfth of it."""
    from kvtrace.trace.files import GZIP_MAGIC, ZSTD_MAGIC

    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)

    def file(name: str, size: int, magic: bytes = b"") -> Path:
        p = tmp_path / name
        with open(p, "wb") as f:
            f.write(magic)
            f.truncate(size)
        return p

    plain = file("plain.jsonl", workers.MIN_BYTES)
    assert workers.wanted(plain) and not workers.wanted(plain, content=False)
    assert workers.wanted(file("text.jsonl", workers.MIN_TEXT_BYTES), content=False)
    compressed = -(-workers.MIN_TEXT_BYTES // workers.COMPRESSION)
    for magic in (GZIP_MAGIC, ZSTD_MAGIC):
        name = f"t{magic.hex()}.jsonl.z"
        assert workers.wanted(file(name, compressed, magic), content=False)
        assert not workers.wanted(file("less" + name, compressed - 4096, magic), content=False)
        assert not workers.wanted(tmp_path / name)   # with the content check: bytes on disk


def test_a_cut_off_last_line_the_worker_saw_is_not_passed(faulty, tmp_path):
    """The worker read the file while its last line was cut off; the main
    process reads it once it is complete. The completed line was never checked,
    so the main process must not replay it: it stops there, with the worker's cut."""
    recs = load_records(faulty)
    whole = b"".join(orjson.dumps(r) + b"\n" for r in recs)
    cut = len(whole) - len(orjson.dumps(recs[-1])) + 20
    live = tmp_path / "live.jsonl"
    live.write_bytes(whole[:cut])
    reader = TraceReader(live)
    gate = RecordWorker(reader.path, reader.share())
    assert gate._proc.wait(30) == 0
    with open(live, "ab") as f:
        f.write(whole[cut:])
    got = sum(1 for _ in reader.checked_elsewhere(gate))
    gate.close()
    assert got == len(recs) - 2   # every record but the header and the cut one
    assert reader.truncation == (f"line {len(recs)} is cut off mid-record; "
                                 "the file has grown since (is it still being written?)")
    assert reader.end is None


def test_a_worker_bug_on_a_record_does_not_pass_it(faulty, monkeypatch):
    """A worker that fails on the last record, other than by finding it bad, has
    not checked it: the replay fails there instead of ending clean."""
    from multiprocessing import Pipe

    from kvtrace.workers import record_worker

    last = len(load_records(faulty))

    class Failing(TraceReader):
        def __iter__(self):
            for e in super().__iter__():
                if self.last_line == last:
                    raise RuntimeError("a bug")
                yield e

    monkeypatch.setattr(record_worker, "TraceReader", Failing)
    theirs, mine = Pipe(duplex=False)
    for msg in record_worker._serve(str(faulty), None, mine):
        mine.send(msg)
    gate = RecordWorker.__new__(RecordWorker)
    gate.path, gate._conn, gate.through, gate._end = str(faulty), theirs, 0, None
    with pytest.raises(RecordWorkerError, match=f"stopped after line {last - 1} .*a bug"):
        for _ in TraceReader(faulty).checked_elsewhere(gate):
            pass


def test_the_error_names_the_file_as_one_process_does(faulty, tmp_path, monkeypatch):
    recs = load_records(faulty)
    _unknown_request(recs)
    save_records(recs, tmp_path / "bad.jsonl")
    monkeypatch.chdir(tmp_path)
    for spelling in ("./bad.jsonl", f"{tmp_path}//bad.jsonl"):
        assert error(spelling, True) == error(spelling, False)


@pytest.mark.parametrize("change", ["replaced", "removed"])
def test_the_worker_reads_the_file_the_main_process_has_open(faulty, tmp_path, change):
    """Once replay has opened a trace, its name may be given to another file or
    removed (log rotation): the worker still checks the file being replayed."""
    recs = load_records(faulty)
    path = save_records(recs, tmp_path / "t.jsonl")
    reader = TraceReader(path)
    if change == "replaced":
        _unknown_request(recs)
        save_records(recs, tmp_path / "other.jsonl").replace(path)
    else:
        path.unlink()
    gate = RecordWorker(reader.path, reader.share())
    got = [e.seq for e in reader.checked_elsewhere(gate)]
    gate.close()
    assert got == [e.seq for e in TraceReader(faulty)]


def test_the_content_worker_reads_the_file_the_main_process_has_open(faulty, tmp_path):
    from kvtrace.replay.replayer import Replayer

    here = replay_file(faulty, device="cpu", worker=False)
    recs = load_records(faulty)
    path = save_records(recs, tmp_path / "t.jsonl")
    reader = TraceReader(path)
    save_records(recs[: len(recs) // 3], tmp_path / "short.jsonl").replace(path)
    rp = Replayer(reader.header, str(path), device="cpu", content_worker=True,
                  shared=reader.share())
    with reader:
        for e in reader:
            rp.feed(e, reader.last_line)
    rp.finish()
    rp.close()
    assert [d.to_json() for d in rp.divergences] == [d.to_json() for d in here.divergences]
    assert rp.content.slots_checked == here.slots_checked > 0


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_refused_trace_leaves_no_open_file(tmp_path, suffix):
    recs = load_records(TRACES / "preemption.jsonl.gz")
    recs[0]["features"]["num_speculative_tokens"] = 1
    path = save_records(recs, tmp_path / f"spec{suffix}")
    bad_header = tmp_path / f"header{suffix}"
    save_records([{"kind": "header"}], bad_header)
    before = _open_fds()
    for worker in (False, True, False):
        assert "speculative decoding" in error(path, worker)
        assert ":1: " in error(bad_header, worker)
    assert _open_fds() == before


def test_a_worker_that_cannot_start_leaves_nothing_open(faulty, tmp_path, monkeypatch):
    """The replayed trace it was writing says that replay stopped."""
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    before = _open_fds()
    for device in (None, "cpu"):
        out = tmp_path / f"out-{device}.jsonl"
        with pytest.raises(OSError):
            replay_file(faulty, out=out, device=device, worker=True)
        end = load_records(out)[-1]
        assert end["kind"] == "end" and end["status"] == "interrupted" and "no-python" in end["error"]
    assert _open_fds() == before


def test_workers_work_when_standard_streams_are_closed(faulty):
    """With descriptor 0 closed, the trace's own descriptor may be 0, which is
    the worker's standard input."""
    import subprocess
    import sys

    script = ("import sys; from kvtrace.replay import replay_file\n"
              "for device in (None, 'cpu'):\n"
              "    for worker in (False, True):\n"
              "        r = replay_file(sys.argv[1], device=device, worker=worker)\n"
              "        print(device, worker, r.steps, len(r.divergences), r.slots_checked, file=sys.stderr)\n")
    run = subprocess.run(["bash", "-c", f'"{sys.executable}" -c "$0" "$1" 0<&-', script, str(faulty)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.split("\n")[:4]
    assert lines[0].split()[2:] == lines[1].split()[2:] and lines[2].split()[2:] == lines[3].split()[2:]
    assert int(lines[0].split()[2]) > 0 and int(lines[2].split()[4]) > 0


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_replayed_trace_is_the_same_with_a_worker(faulty, tmp_path, device):
    outs = []
    for worker in (False, True):
        out = tmp_path / f"out-{worker}.jsonl"
        replay_file(faulty, out=out, device=device, worker=worker)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") > 100


# --------------------------------------------------------------------------- diff


def diffed(a, b, worker: bool) -> tuple:
    from kvtrace.diff import diff_files

    r = diff_files(a, b, worker=worker)
    return ([d.to_json() for d in r.divergences], r.summary(), r.truncation_a, r.truncation_b,
            r.end_a, r.end_b)


def diff_error(a, b, worker: bool) -> str:
    from kvtrace.diff import diff_files

    with pytest.raises(TraceError) as e:
        diff_files(a, b, worker=worker)
    return str(e.value)


def test_diff_with_a_worker_per_input_reports_the_same(faulty, tmp_path):
    """Diff checks each input's records in a worker process of its own on large
    files: the same divergences, cuts and ends as in one process."""
    recs = load_records(faulty)
    i = _step_at(recs, 3)
    recs[i]["running"][0]["num_computed_tokens"] += 1
    changed = save_records(recs, tmp_path / "changed.jsonl")
    here = diffed(changed, faulty, False)
    assert here[0] and here[0][0]["field"] == "num_computed_tokens"
    assert diffed(changed, faulty, True) == here
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs[:i + 5]) + orjson.dumps(recs[i + 5])[:30])
    here = diffed(faulty, cut, False)
    assert here[3] and "cut off" in here[3]
    assert diffed(faulty, cut, True) == here


@SPOILERS
def test_diff_with_a_worker_gets_the_same_error_at_the_same_line(faulty, tmp_path, spoil):
    recs = load_records(faulty)
    spoil(recs)
    bad = save_records(recs, tmp_path / "bad.jsonl")
    for a, b in ((bad, faulty), (faulty, bad)):
        here = diff_error(a, b, False)
        assert here.startswith(f"{bad}:")
        assert diff_error(a, b, True) == here


def test_diff_tells_its_progress_in_steps(faulty, monkeypatch):
    from kvtrace.diff import align, diff_files

    monkeypatch.setattr(align, "PROGRESS_EVERY", 64)
    seen: list[int] = []
    recs = load_records(faulty)
    r = diff_files(faulty, faulty, progress=seen.append)
    steps = sum(1 for rec in recs if rec["kind"] == "step")
    assert r.steps_a == steps
    # Every 64 reads across both traces: each record after the header, and each
    # trace's end of file.
    assert len(seen) == (2 * len(recs)) // 64 >= 4
    assert seen == sorted(seen) and 0 < seen[0] < seen[-1] <= steps


def test_diff_starts_a_worker_per_input_as_replay_would_start_one(faulty, monkeypatch):
    """By default, each input large enough for replay to use a worker gets one;
    KVTRACE_REPLAY_WORKER=0 keeps diff in one process."""
    from kvtrace.diff import diff_files

    started = _started_workers(monkeypatch)
    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)
    small = diff_files(faulty, faulty)
    assert started == []   # a small file: no worker
    monkeypatch.setattr(workers, "MIN_TEXT_BYTES", 1)
    big = diff_files(faulty, faulty)
    assert [w.path for w in started] == [str(faulty), str(faulty)]
    assert [d.to_json() for d in big.divergences] == [d.to_json() for d in small.divergences]
    assert big.summary() == small.summary()
    monkeypatch.setenv(workers.ENV, "0")
    diff_files(faulty, faulty)
    assert len(started) == 2
