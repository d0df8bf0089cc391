"""The trace format on disk: round trips, compression, permissions, damaged files."""

from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import orjson
import pytest

from kvtrace.trace import TraceError, TraceReader, TraceWriter
from kvtrace.trace.events import (
    Abort, Arrival, ConnectorOutput, End, KVLoad, LegacyCounters, Lookup, Output, PrefillStats,
    PromptStats, RequestState, ScheduledNew, ScheduledRunning, Step, to_json,
)

from tests._paths import REPO
from tests.mini_traces import load_records, mini_header, write_mini_trace


def _events(w: TraceWriter) -> list:
    """One event of every kind, with every optional part filled in."""
    s = w.next_seq
    return [
        Arrival(seq=s(), req="a", prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=4, arrival_time=0.5,
                priority=-1, cache_salt="salt", eos_token_id=2, stop_token_ids=[7], min_tokens=1,
                ignore_eos=True, skip_reading_prefix_cache=True),
        # The reader checks that every request a record names has arrived.
        *[Arrival(seq=s(), req=r, prompt_token_ids=[1], max_tokens=1) for r in "bcdefg"],
        Step(seq=s(), step=0,
             new=[ScheduledNew(req="a", num_computed_tokens=4, num_scheduled_tokens=1, block_ids=[1, 2])],
             resumed=[ScheduledNew(req="b", num_computed_tokens=0, num_scheduled_tokens=3, block_ids=[3])],
             running=[ScheduledRunning(req="c", num_computed_tokens=8, num_scheduled_tokens=1,
                                       new_block_ids=[4])],
             preempted=["d"], finished=["e"],
             lookups=[Lookup(req="a", local=0, ext=4, load_async=False),
                      Lookup(req="f", local=4, ext=None)],
             loads=[KVLoad(req="a", start=0, end=4)],
             states=[RequestState(req="a", status="RUNNING", num_computed_tokens=5, num_tokens=5,
                                  num_preemptions=0, block_ids=[1, 2])],
             num_free_blocks=9),
        Output(seq=s(), step=0, sampled={"a": [9], "c": []},
               connector=ConnectorOutput(finished_recving=["f"], finished_sending=["e"],
                                         failed_recving=["g"], invalid_block_ids=[5]),
               finished={"a": "length"},
               states=[RequestState(req="a", status="FINISHED_LENGTH_CAPPED", num_computed_tokens=5,
                                    num_tokens=6, num_preemptions=0, block_ids=[1, 2])]),
        PromptStats(seq=s(), step=0, req="a",
                    prefill_stats=PrefillStats(num_prompt_tokens=5, num_local_cached_tokens=0,
                                               num_external_cached_tokens=4, num_cached_tokens=4,
                                               num_computed_tokens=1, num_cache_creation_tokens=0),
                    legacy=LegacyCounters(num_cached_tokens=-1, num_external_computed_tokens=-3)),
        Abort(seq=s(), reqs=["b", "c"]),
    ]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"])
def test_round_trip(tmp_path, name):
    path = tmp_path / name
    with TraceWriter(path, mini_header(workload="x")) as w:
        written = _events(w)
        for ev in written:
            w.write(ev)
    r = TraceReader(path)
    assert r.header == mini_header(workload="x")
    got = list(r)
    assert got[:-1] == written
    assert isinstance(got[-1], End) and got[-1].status == "complete"
    assert r.end == got[-1]
    assert r.truncation is None
    raw = path.read_bytes()
    if name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b"
    elif name.endswith(".zst"):
        assert raw[:4] == b"\x28\xb5\x2f\xfd"
    else:
        assert raw.startswith(b"{")


def test_compression_detected_by_content_not_name(tmp_path):
    gz = write_mini_trace(tmp_path / "t.jsonl.gz")
    renamed = tmp_path / "renamed.jsonl"
    os.rename(gz, renamed)
    assert len(list(TraceReader(renamed))) > 5


def test_files_are_private(tmp_path):
    for name in ("p.jsonl", "p.jsonl.gz", "p.jsonl.zst"):
        path = write_mini_trace(tmp_path / name)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_fields_at_their_defaults_are_left_out_and_may_be_written(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, mini_header()) as w:
        w.write(Step(seq=w.next_seq(), step=0))
    lines = path.read_bytes().splitlines()
    step = orjson.loads(lines[1])
    assert step == {"kind": "step", "seq": 0, "step": 0}   # fields at their defaults are left out
    end = orjson.loads(lines[2])
    assert end == {"kind": "end", "seq": 1}
    # The same records with every field written read back the same.
    step.update(new=[], resumed=[], running=[], preempted=[], finished=[], lookups=[], loads=None,
                states=[], num_free_blocks=None, spec=None, grammar=None, throttle_prefills=False)
    end.update(status="complete", error=None, dropped_events=0)
    path.write_bytes(b"\n".join([lines[0], orjson.dumps(step), orjson.dumps(end)]) + b"\n")
    events = list(TraceReader(path))
    assert events[0].loads is None and events[0].num_free_blocks is None
    assert events[1].error is None


def test_interrupted_writer_says_so(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, mini_header()) as w:
            w.write(Step(seq=w.next_seq(), step=0))
            raise RuntimeError("engine died")
    r = TraceReader(path)
    list(r)
    assert r.end.status == "interrupted" and "engine died" in r.end.error


# --------------------------------------------------------------------------- truncation


def _lines(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_plain_last_line_cut_off(tmp_path):
    path = write_mini_trace(tmp_path / "t.jsonl")
    lines = _lines(path)
    cut = b"".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2]
    path.write_bytes(cut)
    r = TraceReader(path)
    events = list(r)
    assert len(events) == len(lines) - 4  # header, and the cut line, are not events
    assert r.truncation == f"line {len(lines) - 2} is cut off mid-record"
    assert r.end is None


def test_no_end_record_is_reported(tmp_path):
    path = write_mini_trace(tmp_path / "t.jsonl")
    lines = _lines(path)
    path.write_bytes(b"".join(lines[:-1]))
    r = TraceReader(path)
    assert len(list(r)) == len(lines) - 2
    assert "no 'end' record" in r.truncation and "cut off" in r.truncation


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_gzip_cut_mid_stream(tmp_path, fraction):
    full = write_mini_trace(tmp_path / "full.jsonl.gz", requests={f"r{i}": 5 + i for i in range(40)},
                            max_tokens=20)
    total = len(list(TraceReader(full)))
    raw = full.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(raw[: int(len(raw) * fraction)])
    r = TraceReader(cut)
    events = list(r)
    assert 0 < len(events) < total
    assert r.truncation is not None
    # Everything before the cut is intact and in order.
    assert [e.seq for e in events] == list(range(len(events)))


def test_zstd_cut_mid_stream(tmp_path):
    full = write_mini_trace(tmp_path / "full.jsonl.zst", requests={f"r{i}": 5 + i for i in range(40)},
                            max_tokens=20)
    total = len(list(TraceReader(full)))
    raw = full.read_bytes()
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(raw[: len(raw) // 2])
    r = TraceReader(cut)
    events = list(r)
    assert 0 < len(events) < total
    assert r.truncation is not None
    assert [e.seq for e in events] == list(range(len(events)))


@pytest.mark.parametrize("pipe", [False, True], ids=["file", "pipe"])
def test_zstd_after_a_skippable_frame_is_read(tmp_path, pipe):
    """zstd tools put skippable frames (metadata) before the data and read past
    them; so does the reader, from a file or a pipe."""
    import struct
    import subprocess

    import zstandard

    plain = write_mini_trace(tmp_path / "t.jsonl", requests={"r0": 5, "r1": 9}, max_tokens=4)
    want = [e.seq for e in TraceReader(plain)]
    skippable = struct.pack("<II", 0x184D2A5F, 6) + b"kvmeta"
    z = tmp_path / "s.jsonl.zst"
    z.write_bytes(skippable + zstandard.ZstdCompressor().compress(plain.read_bytes()))
    if not pipe:
        assert [e.seq for e in TraceReader(z)] == want
        return
    cat = subprocess.Popen(["cat", str(z)], stdout=subprocess.PIPE)
    try:
        assert [e.seq for e in TraceReader(f"/dev/fd/{cat.stdout.fileno()}")] == want
    finally:
        cat.stdout.close()
        cat.wait()


# --------------------------------------------------------------------------- unusable input


def _write_lines(path, objs) -> None:
    path.write_bytes(b"".join(o if isinstance(o, bytes) else orjson.dumps(o) + b"\n" for o in objs))


def _header_obj() -> dict:
    return to_json(mini_header())


def _read_all(path):
    return list(TraceReader(path))


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = write_mini_trace(tmp_path / "t.jsonl")
    lines = _lines(path)
    lines[4] = b'{"seq": 4, "kind": "step", oops}\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(TraceError) as e:
        _read_all(path)
    assert str(e.value).startswith(f"{path}:5: not JSON")
    assert e.value.exit_code == 2 and e.value.line == 5


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(TraceError, match="empty file"):
        TraceReader(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        TraceReader(tmp_path / "nope.jsonl")


def test_missing_header(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [{"seq": 0, "kind": "abort", "reqs": []}])
    with pytest.raises(TraceError, match=r":1: missing header"):
        TraceReader(path)


def test_wrong_schema_version(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj() | {"schema": 99}])
    with pytest.raises(TraceError, match="unsupported schema version 99"):
        TraceReader(path)


def test_unknown_kind(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), {"seq": 0, "kind": "teleport"}])
    with pytest.raises(TraceError, match=r"t.jsonl:2: unknown event kind 'teleport'"):
        _read_all(path)


def test_second_header(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), _header_obj()])
    with pytest.raises(TraceError, match=r":2: a second header"):
        _read_all(path)


@pytest.mark.parametrize("bad,message", [
    ({"seq": 0, "kind": "step", "step": "3"}, "field 'step': expected an integer, got a string"),
    ({"seq": 0, "kind": "step", "step": 1, "new": [{"req": "a", "num_computed_tokens": -1,
                                                      "num_scheduled_tokens": 1, "block_ids": []}]},
     "field 'new[0].num_computed_tokens': expected an integer >= 0"),
    ({"seq": 0, "kind": "arrival", "req": "a", "prompt_token_ids": [1, "x"], "max_tokens": 1},
     "field 'prompt_token_ids[1]': expected an integer, got a string"),
    ({"seq": 0, "kind": "arrival", "req": "a", "prompt_token_ids": [], "max_tokens": 1},
     "field 'prompt_token_ids': expected a list of length >= 1"),
    ({"seq": 0, "kind": "output", "step": 0, "finished": {"a": "tired"}}, "field 'finished[...]': not an allowed value: 'tired'"),
    ({"seq": 0, "kind": "abort"}, "missing field 'reqs'"),
    ({"seq": True, "kind": "abort", "reqs": []}, "field 'seq': expected an integer, got a boolean"),
    ([1, 2], "a record must be a JSON object"),
])
def test_wrong_types(tmp_path, bad, message):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), bad])
    with pytest.raises(TraceError, match=r"t.jsonl:2: ") as e:
        _read_all(path)
    assert message in str(e.value)


def test_bad_header_types(tmp_path):
    path = tmp_path / "t.jsonl"
    h = _header_obj()
    h["config"]["block_size"] = 0
    _write_lines(path, [h])
    with pytest.raises(TraceError, match=r":1: field 'config.block_size': expected an integer >= 1"):
        TraceReader(path)


def test_binary_garbage(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(bytes(range(256)) * 4 + b"\n")
    with pytest.raises(TraceError, match=r":1: binary data"):
        TraceReader(path)


def test_binary_garbage_after_header(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), b"\x00\x01\x02\xff\xfe garbage\n"])
    with pytest.raises(TraceError, match=r":2: binary data"):
        _read_all(path)


def test_gzip_with_garbage_inside(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(orjson.dumps(_header_obj()) + b"\n" + b"\xff" * 200 + b"\n"))
    with pytest.raises(TraceError, match=r":2: "):
        _read_all(path)


@pytest.mark.parametrize("seqs", [[0, 0], [3, 2]])
def test_non_increasing_seq(tmp_path, seqs):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj()] + [{"seq": s, "kind": "abort", "reqs": []} for s in seqs])
    with pytest.raises(TraceError, match=rf":3: sequence number {seqs[1]} does not follow {seqs[0]}"):
        _read_all(path)


def test_record_after_end(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), {"seq": 0, "kind": "end"}, {"seq": 1, "kind": "abort", "reqs": []}])
    with pytest.raises(TraceError, match=r":3: record after the 'end' record"):
        _read_all(path)


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), b"\n", {"seq": 0, "kind": "abort", "reqs": ["x"]}, b"  \n",
                        {"seq": 1, "kind": "end"}])
    r = TraceReader(path)
    assert [e.kind for e in r] == ["abort", "end"]
    assert r.truncation is None


def test_docs_worked_example_reads(tmp_path):
    """The example in docs/trace-format.md is a valid, complete trace."""
    from pathlib import Path

    doc = (REPO / "docs" / "reference" / "trace-format.md").read_text()
    block = doc.split("```jsonl\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "example.jsonl"
    path.write_text(block)
    r = TraceReader(path)
    kinds = [e.kind for e in r]
    assert kinds == ["arrival", "step", "output", "step", "output", "prompt_stats", "step",
                     "output", "end"]
    assert r.truncation is None and r.end.status == "complete"
    # ... and, as the document says, it replays through the reference with no divergence.
    from kvtrace.replay import replay_file

    assert replay_file(path, device="cpu").divergences == []


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"])
def test_flushed_events_survive_a_writer_that_never_closes(tmp_path, name):
    # A recording engine killed after a flush leaves a file readable up to the flush.
    import shutil

    path = tmp_path / name
    w = TraceWriter(path, mini_header())
    w.write(Step(seq=w.next_seq(), step=0))
    w.flush()
    killed = tmp_path / ("killed-" + name)
    shutil.copy(path, killed)          # the bytes on disk at that moment
    r = TraceReader(killed)
    assert [e.kind for e in r] == ["step"]
    assert r.truncation is not None and r.end is None
    w.close()


def test_finished_requests_never_forget_and_rarely_confuse():
    """The validator's memory of finished requests is fixed in size: it must still
    know every finished id, and take few never-seen ids for finished ones."""
    from kvtrace.trace.validate import FinishedRequests

    finished = FinishedRequests()
    ids = [f"req-{i}" for i in range(100_000)]
    for req in ids:
        finished.add(req)
    assert all(req in finished for req in ids)
    confused = sum(f"other-{i}" in finished for i in range(100_000))
    assert confused <= 10      # expected about 0.5 at this load (see the class docstring)


def test_the_reader_closes_its_file_also_under_gzip_and_on_a_bad_header(tmp_path):
    """Closing a reader closes the file itself, not only the decompressor over it
    (gzip leaves the file open), and a reader that refuses its header closes its
    file even while the error, which holds the reader, is still alive."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gz = write_mini_trace(tmp_path / "t.jsonl.gz")
    before = fds()
    reader = TraceReader(gz)
    assert fds() == before + 1
    reader.close()
    assert fds() == before
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"not json\n")
    with pytest.raises(TraceError, match=":1: not JSON") as e:
        TraceReader(bad)
    assert fds() == before, e.value


def test_a_shared_file_reads_at_its_own_offset(tmp_path):
    import io

    from kvtrace.trace.io import SharedFile

    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    with open(path, "rb") as mine:
        assert mine.read(3) == b"012"
        shared = SharedFile(os.dup(mine.fileno()))
        assert shared.read(4) == b"0123" and mine.read(2) == b"34"
        assert shared.seek(-2, io.SEEK_END) == 8 and shared.read(5) == b"89" and shared.read(5) == b""
        assert shared.seek(1) == 1 and shared.seek(2, io.SEEK_CUR) == 3 and shared.read(1) == b"3"
        with pytest.raises(ValueError):
            shared.seek(-1)
        shared.close()
        with pytest.raises(ValueError):
            shared.read(1)
        assert mine.read() == b"56789"   # its own descriptor is still open


GROWN = "; the file has grown since (is it still being written?)"


def _sharing(reader: TraceReader) -> TraceReader:
    """A second reader of ``reader``'s file that shares it, as a worker would."""
    fd, end = reader.share()
    return TraceReader(reader.path, shared=(os.dup(fd), os.dup(end)))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_reader_stops_where_the_reader_sharing_its_file_met_its_end(tmp_path, suffix):
    """A trace still being written: the worker's reader meets its end first and
    fixes it there; the main process's reader, reading on after the file grew,
    stops there too. Both read the same records and report the same cut; the
    one that finished after the file grew says so."""
    whole_path = write_mini_trace(tmp_path / f"whole{suffix}", requests={"a": 20, "b": 9})
    data = whole_path.read_bytes()
    live = tmp_path / f"live{suffix}"
    live.write_bytes(data[: len(data) * 2 // 3])
    alone = TraceReader(live)
    want = [e.seq for e in alone]
    assert alone.truncation and 0 < len(want) < len(list(TraceReader(whole_path)))
    main = TraceReader(live)
    worker = _sharing(main)
    assert [e.seq for e in worker] == want
    live.write_bytes(data)   # the recording goes on
    assert [e.seq for e in main] == want
    assert worker.truncation == alone.truncation
    assert main.truncation == alone.truncation + GROWN


def test_the_first_reader_to_meet_the_end_fixes_it_for_all(tmp_path):
    """Either side may meet the end first; every read after that, by any of
    them, stops there."""
    from kvtrace.trace.io import SharedEnd, SharedFile

    path = tmp_path / "f"
    path.write_bytes(b"0123")
    fd = os.open(path, os.O_RDONLY)
    end = SharedEnd()
    a, b, c = (SharedFile(os.dup(fd), SharedEnd(os.dup(end.fd))) for _ in range(3))
    assert b.read(2) == b"01" and a.read(10) == b"0123"
    assert a.read(10) == b""   # a met the end, at 4
    assert not a.grown()
    with open(path, "ab") as f:
        f.write(b"4567")
    assert b.read(10) == b"23" and b.read(10) == b"" and c.read(10) == b"0123" and c.read(1) == b""
    assert a.grown() and b.grown() and c.grown()   # each found the end at 4, and the file goes on
    fresh = SharedFile(os.dup(fd))   # a reader that shares no end reads on
    assert fresh.read(10) == b"01234567" and not fresh.grown()
    for f in (a, b, c, fresh):
        f.close()
    end.close()
    os.close(fd)


def test_a_shared_file_that_did_not_grow_reads_as_alone(tmp_path):
    path = write_mini_trace(tmp_path / "t.jsonl", requests={"a": 20})
    one = TraceReader(path)
    two = _sharing(one)
    assert [e.seq for e in one] == [e.seq for e in two] == [e.seq for e in TraceReader(path)]
    assert one.truncation is None and two.truncation is None and one.end == two.end


def test_a_pipe_is_read_by_one_reader(tmp_path):
    path = write_mini_trace(tmp_path / "t.jsonl", requests={"a": 20})
    r, w = os.pipe()
    os.write(w, path.read_bytes())
    os.close(w)
    reader = TraceReader(f"/dev/fd/{r}")
    assert not reader.shareable
    with pytest.raises(ValueError, match="not a regular file"):
        reader.share()
    assert [e.seq for e in reader] == [e.seq for e in TraceReader(path)]
    os.close(r)


# Values that break one field of a record in every way the checks tell apart.
_BAD_VALUES = [None, -1, 1 << 41, "x", "RUNNING", "stop", 1.5, True, [], [1, "x"], [-1], [1 << 41],
               {}, {"a": [1]}, {"a": "stop"}, {"a": "nope"}]


def _corrupt(rec: dict, rng) -> None:
    """Change, add or remove one field of one object of ``rec``, at any depth."""
    def objects(v):
        if isinstance(v, dict):
            yield v
            for x in v.values():
                yield from objects(x)
        elif isinstance(v, list):
            for x in v:
                yield from objects(x)
    obj = rng.choice([o for o in objects(rec) if o is not rec] or [rec])
    what = rng.random()
    if what < 0.15 and obj:
        del obj[rng.choice(sorted(obj))]
    elif what < 0.25:
        obj["extra"] = 1
    elif obj:
        key = rng.choice(sorted(obj))
        if isinstance(obj[key], list) and obj[key] and rng.random() < 0.5:
            obj[key][rng.randrange(len(obj[key]))] = rng.choice(_BAD_VALUES)
        else:
            obj[key] = rng.choice(_BAD_VALUES)


def _decoded(rec: dict):
    from kvtrace.trace.events import SchemaError, decode

    try:
        return decode(rec)
    except SchemaError as e:
        return f"SchemaError: {e}"


def test_a_record_decodes_alike_from_its_bytes_and_from_its_object():
    """One decoder: a line decoded from its bytes (as the reader does) and the
    same record decoded from its parsed object give the same event, or the
    same error in the same words, over every step and output of the real
    traces, each also with one field broken at random, many times over; and
    most broken records are refused, not all (an extra field is allowed)."""
    import copy
    import random

    from kvtrace.trace.events import SchemaError, decode_line

    traces = REPO / "traces"
    recs = [r for p in sorted(traces.glob("*.jsonl.gz")) for r in load_records(p)[1:]
            if r["kind"] in ("step", "output")]
    rng = random.Random(7)
    cases = recs + []
    for _ in range(4000):
        rec = copy.deepcopy(rng.choice(recs))
        _corrupt(rec, rng)
        cases.append(rec)

    def from_bytes(rec):
        try:
            return decode_line(orjson.dumps(rec))
        except SchemaError as e:
            return f"SchemaError: {e}"

    from_objects = [_decoded(copy.deepcopy(r)) for r in cases]
    assert from_objects == [from_bytes(r) for r in cases]
    errors = sum(isinstance(x, str) for x in from_objects)
    assert 1000 < errors < len(cases) - len(recs)   # most broken records are refused, not all


def test_a_shared_end_without_locks_still_bounds_the_reads(tmp_path, monkeypatch):
    """On a file system whose files cannot be locked, the readers still agree on
    the end; only the moment between meeting it and fixing it is unguarded."""
    from kvtrace.trace import files as trace_files
    from kvtrace.trace.io import SharedEnd, SharedFile

    tried = []

    def no_locks(fd, op):
        tried.append(op)
        raise OSError(37, "No locks available")

    monkeypatch.setattr(trace_files.fcntl, "lockf", no_locks)
    path = tmp_path / "f"
    path.write_bytes(b"0123")
    fd = os.open(path, os.O_RDONLY)
    end = SharedEnd()
    a, b = (SharedFile(os.dup(fd), SharedEnd(os.dup(end.fd))) for _ in range(2))
    assert a.read(10) == b"0123" and a.read(10) == b""
    with open(path, "ab") as f:
        f.write(b"4567")
    assert b.read(10) == b"0123" and b.read(10) == b"" and b.seek(0, 2) == 4
    for f in (a, b):
        f.close()
    end.close()
    os.close(fd)
    assert len(tried) == 2   # each reader tried once, then went on without


# --------------------------------------------------------------------------- checks left to another reader


class _Gate:
    """The other reader of ``checked_elsewhere``: it takes the checks across
    records over from line ``at`` and has already passed every line."""

    through = 1 << 30

    def __init__(self, at: int = 2):
        self.at = at

    def takes_over(self, line):
        return line >= self.at

    def wait(self, line):
        raise AssertionError("a gate past every line is never waited for")


@pytest.mark.parametrize("seqs", [[0, 0], [3, 2]])
def test_records_out_of_order_are_refused_also_when_checked_elsewhere(tmp_path, seqs):
    """The checks of order stay with the reader that gives the events."""
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj()] + [{"seq": s, "kind": "abort", "reqs": []} for s in seqs])
    with pytest.raises(TraceError, match=rf":3: sequence number {seqs[1]} does not follow {seqs[0]}"):
        list(TraceReader(path).checked_elsewhere(_Gate()))


def test_a_record_after_the_end_is_refused_also_when_checked_elsewhere(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), {"seq": 0, "kind": "end"}, {"seq": 1, "kind": "abort", "reqs": []}])
    with pytest.raises(TraceError, match=r":3: record after the 'end' record"):
        list(TraceReader(path).checked_elsewhere(_Gate()))


def test_checks_across_records_stay_here_until_the_gate_takes_them_over(tmp_path):
    """A step that does not follow the one before (line 3) is refused here when
    the gate takes over after it, and left to the gate when it takes over
    before it."""
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_header_obj(), {"seq": 0, "kind": "step", "step": 0},
                        {"seq": 1, "kind": "step", "step": 0}, {"seq": 2, "kind": "end"}])
    with pytest.raises(TraceError, match=r":3: step 0 does not follow step 0") as here:
        _read_all(path)
    with pytest.raises(TraceError) as kept:
        list(TraceReader(path).checked_elsewhere(_Gate(at=4)))
    assert str(kept.value) == str(here.value)
    r = TraceReader(path)
    assert [e.seq for e in r.checked_elsewhere(_Gate(at=3))] == [0, 1, 2]
    assert r.truncation is None and r.end is not None


@pytest.mark.parametrize("cut", ["mid-record", "no end"])
def test_a_cut_trace_ends_alike_when_checked_elsewhere(tmp_path, cut):
    """Same events, same cut, same words for it, either way."""
    path = write_mini_trace(tmp_path / "t.jsonl")
    lines = _lines(path)
    path.write_bytes(b"".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2] if cut == "mid-record"
                     else b"".join(lines[:-1]))
    alone = TraceReader(path)
    want = [e.seq for e in alone]
    other = TraceReader(path)
    assert [e.seq for e in other.checked_elsewhere(_Gate())] == want
    assert other.truncation == alone.truncation and alone.truncation is not None
    assert other.last_line == alone.last_line and other.end is alone.end is None


def _keyframed_text(tmp_path: Path) -> bytes:
    """A stored trace with keyframes (long lines) and blank lines, as text."""
    from kvtrace.replay.keyframes import add_keyframes

    kf = tmp_path / "kf.jsonl"
    add_keyframes(REPO / "traces" / "preemption.jsonl.gz", kf, 20)
    lines = kf.read_bytes().splitlines(keepends=True)
    for i, blank in ((40, b"\n" * 250), (7, b"  \n\n"), (3, b"\n")):   # blank lines count
        lines.insert(i, blank)
    return b"".join(lines)


def _written(path: Path, text: bytes) -> Path:
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text))
    elif path.name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(text))
    else:
        path.write_bytes(text)
    return path


def _read(path: Path, start: int | None = None, validate: bool = False):
    """(line, event) of each record of ``path`` from line ``start``, and the cut."""
    with TraceReader(path, validate=validate) as r:
        if start is not None:
            r.skip_to(start)
        got = [(r.last_line, e) for e in r]
    return got, r.truncation


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"])
@pytest.mark.parametrize("chunk", [97, 1 << 20])
def test_skip_to_a_line_reads_on_as_a_reading_of_every_line_does(tmp_path, monkeypatch, name,
                                                                 chunk):
    """From every fifth line and the last ones (in chunks of 97 bytes, lines
    run across chunks and several fit in one): the same records, with the
    same lines, as a reading of every line gives from that line on; a line
    past the end gives none."""
    monkeypatch.setattr("kvtrace.trace.reader.READ_CHUNK", chunk)
    text = _keyframed_text(tmp_path)
    path = _written(tmp_path / name, text)
    whole, _ = _read(path)
    assert len(whole) > 250
    lines = text.count(b"\n")
    for start in [*range(2, lines, 5), *range(lines - 3, lines + 3)]:
        assert _read(path, start)[0] == [(n, e) for n, e in whole if n >= start], start


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_skip_to_a_keyframe_reads_the_rest_checked_and_the_same_cut(tmp_path, monkeypatch, name):
    """Started at a keyframe, the records after it pass every check; a cut
    (a line cut off, a compressed stream that ends early) is said in the same
    words as by a reading of every line."""
    monkeypatch.setattr("kvtrace.trace.reader.READ_CHUNK", 97)
    text = _keyframed_text(tmp_path)
    cut = text[: int(len(text) * 0.8)] if name.endswith(".jsonl") else text
    path = _written(tmp_path / name, cut)
    if name.endswith(".gz"):
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * 0.8)])
    whole, truncation = _read(path, validate=True)
    keyframes = [n for n, e in whole if e.kind == "keyframe"]
    assert len(keyframes) >= 3 and truncation is not None
    for start in keyframes:
        assert _read(path, start, validate=True) == ([(n, e) for n, e in whole if n >= start],
                                                     truncation)
