"""The recorder's sinks without an engine: the writer process writes what the
in-process writer writes, ends a trace whose engine died where its events end,
and survives a failing disk; block tables read incrementally stay exact."""

from __future__ import annotations

import enum
import errno
import os
import socket
import time

import orjson
import pytest

from kvtrace.workers import child as child_mod
from kvtrace.record import sink as sink_mod
from kvtrace.record import writer_process
from kvtrace.record import detached
from kvtrace.record.capture import RawOutput, RawStep, RunningColumns, Sampled, Scheduled, Snapshot
from kvtrace.record.records import BlockTables
from kvtrace.record.ring import Ring, memory_file
from kvtrace.record.sink import ProcessSink, TraceSink
from kvtrace.trace.events import (
    Abort,
    Arrival,
    ConnectorOutput,
    Header,
    KVLoad,
    Lookup,
    PrefillStats,
    PromptStats,
    SchedulerConfig,
    encode,
    to_json,
)
from kvtrace.trace.io import TraceError, TraceReader, TraceWriter, open_trace_file


class Status(enum.IntEnum):  # vLLM's RequestStatus numbering, in part
    WAITING = 1
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 2   # folded into WAITING
    RUNNING = 5
    PREEMPTED = 6
    FINISHED_REPETITION = 12


class Block:
    def __init__(self, i: int):
        self.block_id = i


def header() -> Header:
    return Header(engine="vllm", engine_version="test",
                  config=SchedulerConfig(block_size=16, num_blocks=64, max_num_batched_tokens=64,
                                         max_num_seqs=4, max_model_len=256))


def feed(sink) -> None:
    """Events as the recorder queues them: a request's block list grows between
    snapshots, another's is replaced (preempted and resumed)."""
    a_blocks = [Block(3), Block(7)]
    b_blocks = [Block(1)]
    sink.put(Arrival(seq=0, req="a", prompt_token_ids=[1, 2, 3], max_tokens=4, arrival_time=1.5))
    sink.put(Arrival(seq=0, req="b", prompt_token_ids=[4, 5], max_tokens=2, arrival_time=2.0))
    states = Snapshot(["a", "b"], [("a", Status.RUNNING, 0, 3, 0),
                                   ("b", Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, 0, 2, 0)],
                      [a_blocks, b_blocks], [2, 1])
    sink.put(RawStep(step=0, new=[Scheduled("a", 0, 3, [3, 7])], resumed=[],
                     running=RunningColumns([], [], [], {}), preempted=[], finished=[],
                     lookups=[Lookup(req="a", local=0, ext=2, load_async=False)],
                     loads=[KVLoad(req="a", start=0, end=2)], states=states, num_free_blocks=60,
                     rare=None))
    a_blocks.append(Block(9))
    sink.put(RawOutput(step=0, sampled=Sampled(["a"], [[42]], {"a": 0}),
                       connector=ConnectorOutput(finished_recving=["a"], finished_sending=[],
                                                 failed_recving=[], invalid_block_ids=[]),
                       finished={}, states=Snapshot(["a"], [("a", Status.RUNNING, 3, 4, 0)],
                                                    [a_blocks], [3]), rare=None))
    b_new = [Block(11), Block(12)]
    sink.put(RawStep(step=1, new=[], resumed=[],
                     running=RunningColumns(["a"], [3], [([9],)], {"a": 1}), preempted=["b"],
                     finished=[], lookups=[], loads=None,
                     states=Snapshot(["a", "b"], [("a", Status.RUNNING, 3, 4, 0),
                                                  ("b", Status.PREEMPTED, 0, 2, 1)],
                                     [a_blocks, b_new], [3, 2]),
                     num_free_blocks=59, rare={"spec": {"a": [5, -1]}, "grammar": {"b": "ready"}}))
    sink.put(RawOutput(step=1, sampled=Sampled(["a"], [[7, 8]], {"a": 0}), connector=None,
                       finished={"a": "stop"},
                       states=Snapshot(["a"], [("a", Status.FINISHED_REPETITION, 4, 6, 0)],
                                       [a_blocks], [3]),
                       rare={"grammar_rejected": ["a"]}))
    sink.put(PromptStats(seq=0, step=1, req="a", prefill_stats=PrefillStats(
        num_prompt_tokens=3, num_local_cached_tokens=0, num_external_cached_tokens=2,
        num_cached_tokens=2, num_computed_tokens=3, num_cache_creation_tokens=1)))
    sink.put(Abort(seq=0, reqs=["b"]))


def test_writer_process_writes_what_the_thread_writes(tmp_path):
    paths = {}
    for name, cls, suffix in (("thread", TraceSink, ".jsonl"), ("process", ProcessSink, ".jsonl.zst")):
        paths[name] = tmp_path / f"{name}{suffix}"
        s = cls(paths[name], header())
        feed(s)
        s.close()
    read = {name: list(TraceReader(p)) for name, p in paths.items()}
    assert read["thread"] == read["process"]
    evs = read["process"]
    assert [e.kind for e in evs] == ["arrival", "arrival", "step", "output", "step", "output",
                                     "prompt_stats", "abort", "end"]
    assert [e.seq for e in evs] == list(range(9))
    step0, out0, step1, out1 = evs[2:6]
    assert [(s.req, s.status, s.block_ids) for s in step0.states] == \
        [("a", "RUNNING", [3, 7]), ("b", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", [1])]
    assert out0.sampled == {"a": [42]} and out0.connector.finished_recving == ["a"]
    assert out0.states[0].block_ids == [3, 7, 9]
    assert [(r.req, r.num_computed_tokens, r.num_scheduled_tokens, r.new_block_ids)
            for r in step1.running] == [("a", 3, 1, [9])]
    assert step1.states[1].block_ids == [11, 12] and step1.states[1].num_preemptions == 1
    assert step0.spec is None and step1.spec == {"a": [5, -1]}
    assert step0.grammar is None and step1.grammar == {"b": "ready"}
    assert out0.grammar_rejected is None and out1.grammar_rejected == ["a"]
    assert out1.states[0].status == "FINISHED_STOPPED" and out1.finished == {"a": "stop"}
    assert evs[-1].status == "complete"


def test_engine_death_leaves_a_trace_cut_after_its_last_event(tmp_path):
    """The pipe closes without an end line, as when the engine is killed: the
    writer process still writes every event it received, then stops."""
    path = tmp_path / "cut.jsonl.gz"
    s = ProcessSink(path, header())
    feed(s)
    deadline = time.monotonic() + 10
    while s._out and time.monotonic() < deadline:  # the writer thread sends what waits
        time.sleep(0.01)
    assert not s._out
    s.write_error = "the engine is gone"  # nothing more is sent
    s._sock.shutdown(socket.SHUT_WR)      # the connection ends, as the engine's death ends it
    assert s._proc.wait(10) == 0
    s.close()
    r = TraceReader(path)
    evs = list(r)
    assert [e.kind for e in evs][-1] == "abort" and len(evs) == 8
    assert r.end is None and "cut off" in r.truncation


def test_a_quiet_engine_leaves_its_events_on_disk(tmp_path):
    """Events put just before the engine goes quiet reach the file while the
    engine still runs: the writer thread sends what waits, and the writer process
    flushes when nothing has come for a while."""
    path = tmp_path / "quiet.jsonl.zst"
    s = ProcessSink(path, header())
    feed(s)
    deadline = time.monotonic() + 10
    evs: list = []
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            evs = list(TraceReader(path))
        except TraceError:   # nothing on disk yet
            continue
        if len(evs) == 8:
            break
    assert s._proc.poll() is None       # still running: nothing was closed
    assert len(evs) == 8 and evs[-1].kind == "abort"
    s.close()
    assert list(TraceReader(path))[-1].status == "complete"


def test_a_stalled_writer_process_never_blocks_the_engine(tmp_path):
    """With the writer process stopped, ``put`` still returns at once: once the
    ring is full, lines wait in the engine's process, at most ``maxsize`` events,
    and the rest are counted as dropped. Once the writer runs again, the trace holds every event kept and
    says how many were dropped."""
    import signal
    import threading

    path = tmp_path / "stalled.jsonl"
    s = ProcessSink(path, header(), maxsize=50, ring_size=256 << 10)
    os.kill(s._proc.pid, signal.SIGSTOP)
    try:
        big = [f"request-{i:06d}" for i in range(2000)]   # about 34 kB per event
        def engine():
            for _ in range(200):
                s.put(Abort(seq=0, reqs=big))
                time.sleep(0.001)
        t = threading.Thread(target=engine)
        t.start()
        t.join(30)
        assert not t.is_alive(), "put blocked on a stalled writer process"
        assert s.dropped > 0 and s.dropped < 200
    finally:
        os.kill(s._proc.pid, signal.SIGCONT)
    s.close()
    r = TraceReader(path)
    evs = list(r)
    assert len(evs) - 1 + s.dropped == 200
    assert evs[-1].status == "recorder-error" and evs[-1].dropped_events == s.dropped


def test_an_event_that_cannot_be_encoded_ends_the_trace_whole(tmp_path):
    """An error in put while lines wait for room in the ring: they still go
    before the end line, so the trace ends with its end record (recorder-error,
    naming the problem), and keeps every event put before the error."""
    import signal

    path = tmp_path / "enc.jsonl"
    s = ProcessSink(path, header(), ring_size=256 << 10)
    os.kill(s._proc.pid, signal.SIGSTOP)
    try:
        big = [f"request-{i:06d}" for i in range(2000)]
        for _ in range(30):                   # more than the ring holds: lines wait
            s.put(Abort(seq=0, reqs=big))
            time.sleep(0.01)
        s.put(object())                       # not a trace event: cannot be encoded
        assert s.write_error and "TypeError" in s.write_error and s._out
    finally:
        os.kill(s._proc.pid, signal.SIGCONT)
    s.close()
    r = TraceReader(path)
    evs = list(r)
    assert r.end is not None and evs[-1].status == "recorder-error" and "TypeError" in evs[-1].error
    assert len(evs) == 31 and all(e.kind == "abort" for e in evs[:-1])


def test_a_failing_disk_ends_the_trace_with_recorder_error(tmp_path, monkeypatch):
    """The writer process's side: after a write fails, later events are dropped
    and the end record says why."""
    real = TraceWriter.write
    calls = {"n": 0}

    def failing(self, rec):
        calls["n"] += 1
        kind = rec["kind"] if isinstance(rec, dict) else rec.kind
        if calls["n"] == 3 and kind != "end":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, rec)

    monkeypatch.setattr(TraceWriter, "write", failing)
    path = tmp_path / "full.jsonl"
    r_fd, w_fd = os.pipe()
    lines = [orjson.dumps(to_json(header()))]
    lines += [encode(Abort(seq=0, reqs=[f"r{i}"])) for i in range(5)]
    lines.append(orjson.dumps(["end", "complete", None, 0]))
    ring_fd = memory_file(1 << 16)
    assert Ring(ring_fd, 1 << 16).offer(b"\n".join(lines) + b"\n")
    os.close(w_fd)   # the engine's process is gone: the writer reads the ring to its end
    assert writer_process.serve(r_fd, str(path), open_trace_file(path), ring_fd) == 1
    evs = list(TraceReader(path))
    assert [e.kind for e in evs] == ["abort", "abort", "end"]
    assert evs[-1].status == "recorder-error" and "No space left" in evs[-1].error


def test_a_path_that_cannot_be_written_fails_in_the_engines_process(tmp_path):
    with pytest.raises(OSError):
        ProcessSink(tmp_path / "no" / "such" / "dir" / "t.jsonl", header())


def test_unknown_writer_kind_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(sink_mod.ENV_WRITER, "carrier-pigeon")
    with pytest.raises(ValueError, match="KVTRACE_WRITER"):
        sink_mod.open_sink(tmp_path / "t.jsonl", header())


def test_block_tables_follow_growth_replacement_and_rewrites():
    t = BlockTables()
    blocks = [Block(5), Block(6)]
    assert t.ids("a", blocks, 2) == [5, 6] and t.reads == 1
    first = t.ids("a", blocks, 2)
    assert first == [5, 6] and t.reads == 1            # same list, same length: kept
    blocks.append(Block(8))
    assert t.ids("a", blocks, 3) == [5, 6, 8] and t.reads == 1   # grown: only the new block read
    assert first == [5, 6]                              # handed-out lists never change
    assert t.ids("a", blocks, 2) == [5, 6]              # an older snapshot of the same list
    blocks[0] = Block(40)                               # rewritten in place: noticed, read again
    blocks.append(Block(9))
    assert t.ids("a", blocks, 4) == [40, 6, 8, 9] and t.reads == 2
    assert t.ids("a", [Block(1)], 1) == [1] and t.reads == 3     # a new list (after preemption)
    assert t.ids("a", (), 0) == [] and "a" not in t.known
    t.ids("b", [Block(2)], 1)
    t.forget(["b"])
    assert t.known == {}


def test_state_snapshots_skip_requests_gone_and_read_old_request_shapes():
    """Recorder.states: a request the engine no longer holds is skipped; an engine
    whose requests have no num_preemptions records 0; block lists are kept by
    reference with their length at the snapshot."""
    from kvtrace.record.vllm.recorder import Recorder

    class FullAttentionManager:
        def __init__(self):
            self.req_to_blocks = {}

    class KVM:
        def __init__(self):
            self.coordinator = type("C", (), {})()
            self.coordinator.single_type_managers = [FullAttentionManager()]

    class Sched:
        connector = None

        def __init__(self):
            self.kv_cache_manager = KVM()

    class Req:
        def __init__(self, rid, preemptions=None):
            self.request_id, self.status, self.num_computed_tokens, self.num_tokens = rid, Status.RUNNING, 3, 5
            if preemptions is not None:
                self.num_preemptions = preemptions

    sched = Sched()
    table = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    table["a"] = [Block(4), Block(6)]
    rec = Recorder(sched, sink=None)
    rids, counters, blocks, lengths = rec.states(["a", "gone", "b"], [Req("a", 2), None, Req("b", 1)])
    assert rids == ["a", "b"] and counters == [("a", Status.RUNNING, 3, 5, 2), ("b", Status.RUNNING, 3, 5, 1)]
    assert blocks[0] is table["a"] and lengths == [2, 0]
    rids, counters, _, _ = rec.states(["c"], [Req("c")])
    assert counters == [("c", Status.RUNNING, 3, 5, 0)]


def test_a_dead_writer_never_raises_sigpipe_in_the_engine(tmp_path):
    """Some hosts restore SIGPIPE's default action (which kills the process). A
    writer process that died must still only make the recorder log and stop."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import signal, time
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        from tests.unit.record.test_sink import feed, header
        from kvtrace.record.sink import ProcessSink
        s = ProcessSink({str(tmp_path / "t.jsonl")!r}, header())
        s._proc.kill(); s._proc.wait()
        feed(s)
        time.sleep(1.0)   # the writer thread looks every ALIVE_S
        s.close()
        print("engine alive;", s.write_error)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "engine alive; writing the trace failed: WriterProcessError: the trace writer " \
        "process has ended" in p.stdout


def test_without_a_writer_process_the_trace_is_written_from_a_thread(tmp_path, monkeypatch, caplog):
    def no_processes(*a, **k):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(sink_mod.subprocess, "Popen", no_processes)
    with caplog.at_level("WARNING", logger="kvtrace.record"):
        s = sink_mod.open_sink(tmp_path / "t.jsonl", header())
    assert type(s) is TraceSink
    assert any("cannot start the trace writer process" in r.getMessage() for r in caplog.records)
    feed(s)
    s.close()
    evs = list(TraceReader(tmp_path / "t.jsonl"))
    assert len(evs) == 9 and evs[-1].status == "complete"


def test_the_writer_process_imports_kvtrace_from_where_the_engine_did(monkeypatch):
    """A source tree goes first on the writer process's PYTHONPATH; an installed
    kvtrace (in site-packages) leaves the user's PYTHONPATH as it is."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(child_mod.__file__)))
    monkeypatch.setenv("PYTHONPATH", "/the/users/own")
    monkeypatch.setattr(child_mod, "_site_dirs", lambda: set())
    assert child_mod.child_env()["PYTHONPATH"] == os.pathsep.join([root, "/the/users/own"])
    monkeypatch.setattr(child_mod, "_site_dirs", lambda: {child_mod.Path(root).resolve()})
    assert child_mod.child_env()["PYTHONPATH"] == "/the/users/own"


def _killed_after(path, body: str):
    """Run ``body`` (a script that records into the trace at ``PATH``) in a
    process of its own, SIGKILL that process, wait until the writer process has
    ended the file, and read it: (reader, events)."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = f"PATH = {str(path)!r}\n" + textwrap.dedent(body) + \
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    for _ in range(100):   # the writer process ends the file once the connection closes
        if path.exists() and path.stat().st_size and not _writer_running(path):
            break
        time.sleep(0.1)
    with TraceReader(path) as r:
        evs = list(r)
    return r, evs


@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "not-flushed"])
def test_every_event_put_survives_a_kill_of_the_engine_s_process(tmp_path, flush):
    """The engine's process is SIGKILLed right after its last ``put``, with or
    without the flush the recorder does when the scheduler raises: the events
    are in the ring in shared memory, so the trace keeps every one of them and
    reads as cut off after the last."""
    r, evs = _killed_after(tmp_path / "t.jsonl", f"""
        from tests.unit.record.test_sink import feed, header
        from kvtrace.record.sink import ProcessSink
        s = ProcessSink(PATH, header())
        feed(s)
        if {flush!r}:
            s.flush()
    """)
    assert r.end is None and "no 'end' record" in r.truncation
    assert len(evs) == 8, [e.kind for e in evs]


def test_events_waiting_outside_a_full_ring_are_lost_to_a_kill_unless_flushed(tmp_path):
    """The control: with the writer process stopped and the ring full, lines
    wait in the engine's process; a kill loses them, and the trace still reads
    as cut off after the last event that reached the ring."""
    r, evs = _killed_after(tmp_path / "t.jsonl", """
        import os, signal, time
        from tests.unit.record.test_sink import header
        from kvtrace.record.sink import ProcessSink
        from kvtrace.trace.events import Abort
        s = ProcessSink(PATH, header(), ring_size=256 << 10)
        os.kill(s._proc.pid, signal.SIGSTOP)
        big = [f"request-{i:06d}" for i in range(2000)]   # about 34 kB per event
        for i in range(10):
            s.put(Abort(seq=0, reqs=big + [str(i)]))
        assert len(s._out) == 3, len(s._out)
        os.system(f"kill -CONT {s._proc.pid}")
    """)
    assert r.end is None and "no 'end' record" in r.truncation
    assert [e.reqs[-1] for e in evs] == [str(i) for i in range(7)]


@pytest.mark.parametrize("after", ["nothing", "an-arrival", "not-settled", "a-failure"])
def test_an_engine_killed_while_it_holds_no_request_leaves_a_whole_trace(tmp_path, after):
    """vLLM's API server stopped with Ctrl-C SIGKILLs its engine core at once
    (shutdown timeout 0), often before the engine core's shutdown closes the
    trace. Killed after the recorder said that the engine held no request,
    and with nothing recorded since, the engine left nothing out: the writer
    process ends the trace ``complete``. An event recorded after that follows
    in the ring, and the trace reads as cut off after it; so does a trace
    whose engine never settled, and one whose recorder failed after it
    settled, losing what came next (the controls)."""
    r, evs = _killed_after(tmp_path / "t.jsonl", f"""
        import time
        from tests.unit.record.test_sink import feed, header
        from kvtrace.record.sink import ProcessSink
        from kvtrace.trace.events import Arrival
        s = ProcessSink(PATH, header())
        feed(s)
        if {after!r} != "not-settled":
            s.settled()
            assert s._settled
        if {after!r} == "an-arrival":
            s.put(Arrival(seq=0, req="c", prompt_token_ids=[6], max_tokens=1, arrival_time=3.0))
        if {after!r} == "a-failure":
            s.put(object())   # not a trace event: the recorder fails, events are lost from here
            assert s.write_error and not s._settled
            s.put(Arrival(seq=0, req="c", prompt_token_ids=[6], max_tokens=1, arrival_time=3.0))
    """)
    if after == "nothing":
        assert r.truncation is None and r.end is not None
        assert (r.end.status, r.end.dropped_events) == ("complete", 0)
        assert [e.kind for e in evs][-2:] == ["abort", "end"] and len(evs) == 9
    else:
        assert r.end is None and "no 'end' record" in r.truncation
        assert [e.kind for e in evs][-1] == ("arrival" if after == "an-arrival" else "abort")   # a-failure: lost
        assert len(evs) == (9 if after == "an-arrival" else 8)


def test_the_engine_is_said_settled_only_after_the_lines_waiting_outside_the_ring(tmp_path):
    """With the writer process stopped and the ring full, ``settled`` puts
    nothing in the ring while lines wait outside it, and ``put`` still returns
    at once; once the writer process runs again, the lines go, then the
    settled line."""
    import signal

    path = tmp_path / "stalled.jsonl"
    s = ProcessSink(path, header(), ring_size=256 << 10)
    os.kill(s._proc.pid, signal.SIGSTOP)
    try:
        big = [f"request-{i:06d}" for i in range(2000)]   # about 34 kB per event
        for _ in range(10):
            s.put(Abort(seq=0, reqs=big))
        assert s._out
        s.settled()
        time.sleep(0.2)   # twenty polls of the writer thread
        assert s._settling and not s._settled
        t0 = time.monotonic()
        s.put(Arrival(seq=0, req="c", prompt_token_ids=[6], max_tokens=1, arrival_time=3.0))
        assert time.monotonic() - t0 < 1.0
        assert not s._settling   # an event came: the engine is not settled
        s.settled()
    finally:
        os.kill(s._proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while not s._settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s._settled and not s._out
    s.close()
    evs = list(TraceReader(path))
    assert [e.kind for e in evs][-2:] == ["arrival", "end"] and len(evs) == 12


def test_a_line_cut_after_the_engine_settled_leaves_the_trace_cut(tmp_path):
    """The engine settled, then died with half a line in the ring: the trace is
    not whole, and reads as cut off after its last whole event."""
    path = tmp_path / "t.jsonl"
    s = ProcessSink(path, header())
    feed(s)
    s.settled()
    assert s._settled
    s.write_error = "the engine is gone"   # nothing more is put by the sink itself
    assert s._ring.offer(b'{"kind":"arrival","req":"c"')   # half a line, then the connection ends
    s._sock.shutdown(socket.SHUT_WR)
    assert s._proc.wait(10) == 0
    s.close()
    r = TraceReader(path)
    evs = list(r)
    assert r.end is None and "cut off" in r.truncation and len(evs) == 8


def _writer_running(path) -> bool:
    """Whether a writer process for ``path`` is still running (Linux: /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"kvtrace.record.writer_process" in argv and str(path).encode() in argv:
            return True
    return False


@pytest.mark.vllm
def test_a_shutdown_that_kills_the_engines_process_tree_leaves_the_trace_whole(tmp_path):
    """vLLM's shutdown SIGKILLs every descendant of an engine core that has not
    exited at once (``kill_process_tree``), as a server's Ctrl-C does. The
    writer process is no descendant of the engine, so it finishes the trace:
    here it is held stopped while the engine sends its events and its end, then
    the engine's tree is killed, and the writer, let go, writes them all."""
    import signal
    import subprocess
    import sys
    import textwrap

    from tests._require import require

    require("vllm", "vLLM is not installed: this test uses its own kill_process_tree")
    from vllm.utils.system_utils import kill_process_tree

    path = tmp_path / "killed.jsonl.gz"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from tests.unit.record.test_sink import feed, header
        from kvtrace.record.sink import ProcessSink
        s = ProcessSink({str(path)!r}, header())
        os.kill(s._proc.pid, signal.SIGSTOP)
        feed(s)
        s.close(wait=False)        # the engine's shutdown: the rest and the end are sent
        time.sleep(0.5)
        print(s._proc.pid, flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=env)
    writer = int(engine.stdout.readline())
    kill_process_tree(engine.pid)
    engine.wait(10)
    t0 = time.monotonic()
    detached.wait_for_writers(path, timeout=0.5)   # it still holds the file
    assert time.monotonic() - t0 >= 0.5
    os.kill(writer, signal.SIGCONT)
    detached.wait_for_writers(path, timeout=20)    # what `kvtrace record -- CMD` does
    r = TraceReader(path)
    evs = list(r)
    assert [e.kind for e in evs][-2:] == ["abort", "end"] and len(evs) == 9
    assert evs[-1].status == "complete"


def test_a_termination_during_the_closing_of_the_trace_waits_for_the_end(tmp_path):
    """vLLM resets the engine core's signal handlers before its shutdown, and
    its process manager sends SIGTERM as soon as its own shutdown starts: the
    engine core died while it wrote the end record. The close now holds a
    SIGTERM until it is done, and the process then dies of it as it would
    have."""
    import subprocess
    import sys

    marker = tmp_path / "closed"
    code = f"""
import os, signal, time
from kvtrace.record.vllm.recorder import termination_deferred
with termination_deferred():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    open({str(marker)!r}, "w").write("end")
print("not reached")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert marker.read_text() == "end"
    assert p.returncode == -15 and "not reached" not in p.stdout


@pytest.mark.parametrize("seed", range(6))
def test_the_ring_passes_every_byte_in_order_across_wraps(seed):
    """Random chunk sizes (up to the whole ring), offered and taken in a random
    interleaving: the bytes taken are the bytes offered, in order, and an
    offer is refused exactly when the chunk and the room kept do not fit."""
    import random

    rnd = random.Random(seed)
    size = rnd.choice([97, 256, 4096])
    ring = Ring(memory_file(size), size, populate=True)
    sent, got = bytearray(), bytearray()
    for _ in range(3000):
        if rnd.random() < 0.6:
            n, keep = rnd.randrange(0, size + 2), rnd.choice([0, 0, 8, 64])
            chunk = bytes(rnd.randrange(256) for _ in range(n))
            fits = n + keep <= size - (len(sent) - len(got))
            assert ring.offer(chunk, keep) is fits
            if fits:
                sent += chunk
        else:
            got += ring.take()
            assert got == sent[:len(got)]
    got += ring.take()
    assert got == sent and len(sent) > 4 * size
    ring.close()


def test_the_writer_process_s_side_of_the_ring_never_writes_its_data():
    """Only the side that creates the ring takes its pages (with zeros, where
    the kernel cannot populate them): the writer process maps it with the
    header already in it."""
    fd = memory_file(4096)
    engine = Ring(fd, 4096, populate=True)
    assert engine.offer(b"header\n")
    writer = Ring.of_file(fd)
    assert writer.take() == b"header\n"


def test_an_event_larger_than_the_ring_is_dropped_and_counted_and_the_rest_go(tmp_path):
    path = tmp_path / "t.jsonl"
    s = ProcessSink(path, header(), ring_size=64 << 10)
    s.put(Abort(seq=0, reqs=[f"request-{i:06d}" for i in range(10000)]))   # about 170 kB
    feed(s)
    assert s.dropped == 1 and not s._out
    s.close()
    evs = list(TraceReader(path))
    assert len(evs) == 9 and evs[-1].status == "recorder-error" and evs[-1].dropped_events == 1


def test_an_event_put_while_the_settled_line_waits_for_room_undoes_it(tmp_path):
    """settled() finds no room and leaves the line to the writer thread; an
    event then put straight into the ring must cancel it, or the line would
    follow the event and a kill would read as a whole trace."""
    import signal

    s = ProcessSink(tmp_path / "t.jsonl", header(), ring_size=256 << 10)
    os.kill(s._proc.pid, signal.SIGSTOP)
    try:
        big = [f"request-{i:06d}" for i in range(2000)]
        for n in (30000, 1000, 100, 10, 0):   # the ring full to the last byte
            while s._ring.offer(b"x" * n + b"\n"):
                pass
        s.settled()
        assert s._settling and not s._settled
        s._ring.take()   # the writer process has read it all
        s.put(Abort(seq=0, reqs=big))
        assert not s._settling and not s._settled
    finally:
        os.kill(s._proc.pid, signal.SIGCONT)
        s.write_error = "the test is done"
        s.close()


def test_a_failure_after_the_trace_is_closed_raises_nothing(tmp_path):
    s = ProcessSink(tmp_path / "t.jsonl", header())
    feed(s)
    s.settled()
    s.close()
    s.unsettle()
    s._failed(RuntimeError("late"))
