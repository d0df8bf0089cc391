"""Where the recorder's events go: from the engine's thread to the trace file.

Data flow, one way::

    engine's thread                                         trace writer
    ---------------                                         ------------
    capture -> put() -> Resolver: block ids, statuses ----> Records -> TraceWriter

``put`` never blocks and never raises. Two sinks split the work differently:

* ``ProcessSink`` (the default): ``put`` reads, on the engine's thread, the block
  ids that only the engine's process can read, and encodes the event as one JSON
  line. At most every ``ProcessSink.SEND_S`` the lines that have piled up go,
  without blocking, through a socket pair to ``python -m
  kvtrace.record.writer_process``. That process builds the schema's records,
  serializes, compresses and writes the file, outside the engine's GIL. A trace
  is finished properly even when the engine dies without shutting down: the
  writer process sees the connection close and ends the file where the events
  end. A writer thread sends lines left waiting when the engine goes quiet.
* ``TraceSink``: ``put`` appends to a deque, and a writer thread in the engine's
  process does all the rest (``KVTRACE_WRITER=thread``, or when the writer
  process cannot be started).

Encoding on the engine's thread costs it about what handing events to a thread
did, and saves the GIL hand-offs of a thread that wakes to take them: on a
small CPU engine those cost more than the work itself (docs/performance.md).

When ``maxsize`` events are waiting, ``put`` drops the event and counts it; the
trace then ends with ``status "recorder-error"`` and ``dropped_events > 0``.

Events are the schema's (``Arrival``, ``Abort``, ``PromptStats``), or ``RawStep``
/ ``RawOutput``: copies of the engine's own lists and counters, taken on its
thread with as little Python per request as possible, which ``Resolver`` and
``Records`` turn into ``step`` and ``output`` records.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import orjson

from kvtrace.workers.child import above_stdio, child_env
from kvtrace.trace.events import (
    STATUSES,
    Header,
    Output,
    RequestState,
    ScheduledNew,
    ScheduledRunning,
    Step,
    plain_values,
    to_json,
)
from kvtrace.trace.io import JSON_LINE, TraceWriter, open_trace_file

logger = logging.getLogger("kvtrace.record")
# One line of the hand-over: an event, or a raw step or output (tuples of the
# engine's values, numpy integers among them).
_encode = msgspec.json.Encoder(enc_hook=plain_values).encode
# Bytes a socket holds that its reader has not read (Linux: SIOCOUTQ). None
# where termios lacks it: the recorder then never says the engine settled.
_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)

ENV_QUEUE = "KVTRACE_QUEUE_SIZE"
ENV_WRITER = "KVTRACE_WRITER"       # "process" (default) or "thread"
DEFAULT_QUEUE_SIZE = 1 << 16
FLUSH_IDLE_S = 0.25  # flush after this long without events

# vLLM status names that the trace schema folds into one of its own.
STATUS_FOLD = {
    "FINISHED_REPETITION": "FINISHED_STOPPED",
}

_NEW_FIELDS = ScheduledNew.__struct_fields__
_RUNNING_FIELDS = ScheduledRunning.__struct_fields__
_STATE_FIELDS = RequestState.__struct_fields__


# --------------------------------------------------------------------------- queue items


# The recorder copies what the engine holds into these named tuples (cheap to
# build on the engine's thread, encoded as JSON arrays on the way to the writer
# process); ``Records`` turns them into the schema's records. Their field names
# are the schema's, so a field added to the schema is added here by name.


class Scheduled(NamedTuple):
    """A request in ``Step.new`` or ``Step.resumed`` (the fields of ``ScheduledNew``)."""

    req: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list


class RunningColumns(NamedTuple):
    """Copies of the scheduler output's ``scheduled_cached_reqs`` columns."""

    req_ids: list
    num_computed_tokens: list
    new_block_ids: list            # as vLLM holds them: per-group lists, or None
    num_scheduled_tokens: dict     # req id -> tokens, for every scheduled request


class StateCounters(NamedTuple):
    """A request's counters in a snapshot (``RequestState`` without its blocks)."""

    req: str
    status: Any                    # the engine's status enum (its value travels)
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int


class Snapshot(NamedTuple):
    """The states of some requests. With a block table to read incrementally,
    ``blocks`` holds each request's list of block objects *as the KV manager
    holds it* and ``lengths`` its length at the snapshot: the list only grows
    while the request holds it, so its first ``length`` blocks are the request's
    table at that moment, whenever they are read. Otherwise ``blocks`` holds
    lists of ids, read at the snapshot, and ``lengths`` is None."""

    req_ids: list
    counters: list                 # StateCounters (or tuples of its fields)
    blocks: list
    lengths: list | None


class Sampled(NamedTuple):
    """Copies of the model output's sampled tokens and its index."""

    req_ids: list
    sampled_token_ids: list
    req_id_to_index: dict


class RawStep(NamedTuple):
    """One ``schedule()`` as captured; ``rare`` holds the step's rare fields
    that hold something (``spec``, ``grammar``, ``throttle_prefills``), or None."""

    step: int
    new: list                      # Scheduled
    resumed: list                  # Scheduled
    running: RunningColumns
    preempted: list
    finished: list
    lookups: list
    loads: list | None
    states: Snapshot
    num_free_blocks: int | None
    rare: dict | None


class RawOutput(NamedTuple):
    """One ``update_from_output()`` as captured; ``rare`` as a step's
    (``grammar_rejected``, ``pooled``), or None."""

    step: int
    sampled: Sampled
    connector: Any                 # ConnectorOutput or None
    finished: dict
    states: Snapshot
    rare: dict | None


def first_group(block_ids: Any) -> list[int]:
    """vLLM passes block ids as a tuple of per-group lists (or a list of such)."""
    if block_ids is None:
        return []
    if len(block_ids) and not isinstance(block_ids[0], int):
        return list(block_ids[0])
    return list(block_ids)


def status_name(name: str) -> str:
    """The schema's status for a vLLM ``RequestStatus`` name."""
    if name in STATUSES:
        return name
    return STATUS_FOLD.get(name, "WAITING")


# --------------------------------------------------------------------------- resolving (engine's process)


class BlockTables:
    """Block ids from the block lists that snapshots hold.

    With one full-attention group, the KV manager's list of a request's blocks only
    grows (``append``/``extend``), or is dropped when the request frees its blocks.
    So the ids are kept per request with the list they were read from: the same
    list at a known length gives ids already read, and a longer one adds only the
    blocks appended since (after checking that its first and last known blocks
    are unchanged). Anything else is read again in full. The id lists handed out
    are never mutated afterwards, since records hold them."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[list, list[int]]] = {}
        self.reads = 0  # lists read from their first block

    def ids(self, rid: str, blocks: Any, n: int) -> list[int]:
        known = self.known.get(rid)
        if known is not None and known[0] is blocks:
            ids = known[1]
            m = len(ids)
            if m == n:
                return ids
            if m > n:
                return ids[:n]
            if m and ids[0] == blocks[0].block_id and ids[-1] == blocks[m - 1].block_id:
                ids = ids + [b.block_id for b in blocks[m:n]]
                self.known[rid] = (blocks, ids)
                return ids
        self.reads += 1
        if not n:
            self.known.pop(rid, None)
            return []
        ids = [b.block_id for b in blocks[:n]]
        self.known[rid] = (blocks, ids)
        return ids

    def forget(self, rids: Any) -> None:
        for rid in rids:
            self.known.pop(rid, None)


class Resolver:
    """In the engine's process: what only it can read. ``RawStep`` and
    ``RawOutput`` become plain tuples tagged ``"step"`` / ``"output"`` with
    block ids in place of block lists. A status class not seen before is
    announced first, as ``("statuses", [[value, schema name], ...])``: statuses
    travel as their enum values. Other events pass unchanged."""

    def __init__(self) -> None:
        self.blocks = BlockTables()
        self._status_classes: set[type] = set()

    def __call__(self, item: Any, out: list) -> None:
        t = type(item)
        if t is RawStep:
            states = self._states(item.states, out)
            if item.finished:  # gone from the engine: forget them (after this step's states)
                self.blocks.forget(item.finished)
            out.append(("step", item._replace(states=states)))
        elif t is RawOutput:
            out.append(("output", item._replace(states=self._states(item.states, out))))
        else:
            out.append(item)

    def _states(self, raw: Snapshot, out: list) -> tuple:
        """(counters, block ids): the snapshot with its blocks read."""
        rids, counters, blocks, lengths = raw
        if counters:
            cls = type(counters[0][1])
            if cls not in self._status_classes:
                self._status_classes.add(cls)
                out.append(("statuses", _status_table(cls)))
        if lengths is None:
            return counters, blocks
        return counters, list(map(self.blocks.ids, rids, blocks, lengths))


def _status_table(cls: type) -> list:
    try:
        table = [[m.value, status_name(m.name)] for m in cls]  # vLLM's RequestStatus (an IntEnum)
        orjson.dumps(table)
        return table
    except Exception:
        return []


# --------------------------------------------------------------------------- records (writer)


class Records:
    """What ``TraceWriter.write`` serializes for each resolved item: a
    ``("step", RawStep)`` or ``("output", RawOutput)`` pair (or the lists JSON
    made of it, read back into the named tuple) becomes a dict with the
    schema's field names and order; events, or the dicts JSON made of them, get
    their sequence number from ``next_seq``. Returns None for the
    ``"statuses"`` announcement, which takes no sequence number."""

    def __init__(self) -> None:
        self.statuses: dict[Any, str] = {}

    def __call__(self, item: Any, next_seq) -> Any:
        if type(item) is dict:
            item["seq"] = next_seq()
            return item
        if type(item) not in (tuple, list):
            item.seq = next_seq()
            return item
        tag = item[0]
        if tag == "step":
            return self.step(RawStep(*item[1]), next_seq())
        if tag == "output":
            return self.output(RawOutput(*item[1]), next_seq())
        if tag == "statuses":
            self.statuses.update({value: name for value, name in item[1]})
            return None
        raise ValueError(f"unknown item {tag!r}")

    def states(self, raw: Any) -> list[dict]:
        counters, ids = raw
        names = self.statuses
        return [dict(zip(_STATE_FIELDS, (rid, names.get(st) or _unknown_status(st), c, t, p, b)))
                for (rid, st, c, t, p), b in zip(counters, ids)]

    def step(self, s: RawStep, seq: int) -> dict:
        rids, ncts, nbis, nst = s.running
        d = {"seq": seq, "step": s.step,
             "new": [dict(zip(_NEW_FIELDS, t)) for t in s.new],
             "resumed": [dict(zip(_NEW_FIELDS, t)) for t in s.resumed],
             "running": [dict(zip(_RUNNING_FIELDS, (rid, c, nst.get(rid, 0), first_group(nb))))
                         for rid, c, nb in zip(rids, ncts, nbis)],
             "preempted": s.preempted, "finished": s.finished, "lookups": s.lookups,
             "loads": s.loads, "states": self.states(s.states),
             "num_free_blocks": s.num_free_blocks, "kind": "step"}
        if s.rare:   # the rare fields go last, and only when they hold something
            d.update(s.rare)
        return d

    def output(self, o: RawOutput, seq: int) -> dict:
        rids, toks, index = o.sampled
        sampled = {}
        if toks:
            n = len(toks)
            for rid in rids:
                i = index.get(rid)
                if i is not None and i < n and len(toks[i]):
                    sampled[rid] = toks[i]
        d = {"seq": seq, "step": o.step, "sampled": sampled, "connector": o.connector,
             "finished": o.finished, "states": self.states(o.states), "kind": "output"}
        if o.rare:
            d.update(o.rare)
        return d


def _unknown_status(st: Any) -> str:
    return status_name(getattr(st, "name", str(st)))


# --------------------------------------------------------------------------- sinks


def dropped_end(dropped: int) -> tuple[str, str | None]:
    """The end status and error of a run that was otherwise complete."""
    if dropped:
        return "recorder-error", f"{dropped} events dropped: the trace writer could not keep up"
    return "complete", None


class _Sink:
    """What both sinks share: the writer thread, the drop count, how a write
    failure stops recording, and how the trace ends. ``put`` never blocks and
    never raises; ``close`` ends the trace."""

    POLL_S = 0.01  # how often the writer thread looks for work

    def __init__(self, path: str | os.PathLike, maxsize: int | None):
        if maxsize is None:
            maxsize = int(os.environ.get(ENV_QUEUE, DEFAULT_QUEUE_SIZE))
        self.path = Path(path)
        self.maxsize = max(1, maxsize)
        self.dropped = 0
        self.write_error: str | None = None
        self.closed = False
        self._stop: tuple[str, str | None] | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvtrace-writer", daemon=True)
        self._resolve = Resolver()

    def _failed(self, e: Exception) -> None:
        self.write_error = f"writing the trace failed: {type(e).__name__}: {e}"
        logger.error("kvtrace: %s; recording stopped, the engine is unaffected", self.write_error)

    def _end_status(self, status: str, error: str | None) -> tuple[str, str | None]:
        if self.write_error is not None:
            return "recorder-error", self.write_error
        if self.dropped and status == "complete":
            return dropped_end(self.dropped)
        return status, error

    def close(self, status: str = "complete", error: str | None = None,
              timeout: float = 60.0, wait: bool = True) -> None:
        """End the trace with ``status``: the writer thread writes what is waiting,
        then the end record. With ``wait``, until it has (at most ``timeout``
        seconds). Events put after this are not recorded."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._stop = (status, error)
                self._wake.set()
        if wait:
            self.join(timeout)

    def flush(self) -> None:
        """The engine is failing: pass on what waits now (its process may be
        killed before it shuts down). Here, wake the writer thread."""
        self._wake.set()

    def settled(self) -> None:
        """The engine holds no request now. The writer process is told so (see
        ``ProcessSink``); a writer thread dies with the engine's process, and
        has nothing to do here."""

    def unsettle(self) -> None:
        """The recorder failed: what ``settled`` said no longer holds."""

    def join(self, timeout: float = 60.0) -> None:
        """Wait for the writer to finish after ``close``."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("kvtrace: trace writer is stuck; %s may lack its end record", self.path)

    def _run(self) -> None:
        raise NotImplementedError


class TraceSink(_Sink):
    """The whole pipeline on the writer thread, in this process.

    ``put`` appends to a bounded deque (atomic, no lock, no wake-up) or drops and
    counts; the thread wakes every ``POLL_S`` and writes whatever has piled up,
    so the engine's thread pays for neither a lock nor a thread switch per event.
    After ``FLUSH_IDLE_S`` without events it pushes what it has to disk."""

    def __init__(self, path: str | os.PathLike, header: Header, maxsize: int | None = None):
        super().__init__(path, maxsize)
        self._q: deque = deque()
        self._writer = TraceWriter(self.path, header)  # may raise: caller handles it
        self._records = Records()
        self._thread.start()

    def put(self, ev: Any) -> None:
        if self.closed:
            return
        if len(self._q) >= self.maxsize:
            self.dropped += 1
        else:
            self._q.append(ev)

    def _run(self) -> None:
        q = self._q
        dirty = True  # the header
        idle_since = time.monotonic()
        while True:
            if q:
                batch = []
                while q:
                    batch.append(q.popleft())
                if self.write_error is None:
                    try:
                        self._write(batch)
                        dirty = True
                    except Exception as e:  # disk full ...
                        self._failed(e)
                idle_since = time.monotonic()
                continue
            if self._stop is not None:
                self._finish(*self._stop)
                return
            if dirty and time.monotonic() - idle_since >= FLUSH_IDLE_S:
                # Idle: push what we have to disk, so that an engine killed without
                # a shutdown (SIGKILL) leaves a readable, merely cut-off trace.
                if self.write_error is None:
                    try:
                        self._writer.flush()
                    except Exception as e:
                        self._failed(e)
                dirty = False
            self._wake.wait(self.POLL_S)
            self._wake.clear()

    def _write(self, batch: list) -> None:
        w = self._writer
        resolved: list = []
        for item in batch:
            self._resolve(item, resolved)
        for item in resolved:
            rec = self._records(item, w.next_seq)
            if rec is not None:
                w.write(rec)

    def _finish(self, status: str, error: str | None) -> None:
        status, error = self._end_status(status, error)
        try:   # the writer closes its files even when the end record fails
            self._writer.close(status=status, error=error, dropped_events=self.dropped)
        except Exception as e:
            logger.error("kvtrace: closing the trace %s failed: %s", self.path, e)


class ProcessSink(_Sink):
    """Resolve and encode on the engine's thread, write in a writer process.

    ``put`` reads the block ids that only the engine's process can read and
    encodes the event as one JSON line (together about as much work as handing
    it to a thread, without the GIL hand-offs a thread costs the engine). At
    most every ``SEND_S`` it hands the lines that have piled up to a socket pair,
    without blocking: what the socket does not take waits for the next send. At
    most ``maxsize`` events wait; more are dropped and counted. The writer
    thread only sends lines left waiting when the engine goes quiet, and the end.

    ``python -m kvtrace.record.writer_process`` reads the lines, builds the
    schema's records, serializes, compresses and writes the file, outside the
    engine's GIL. The trace file is opened here, so that a path that cannot be
    written fails at once, in the engine's process; the writer process inherits
    the open file. The first line it reads is the header, the last ``["end",
    status, error, dropped]``. Should the connection close without that line
    (the engine died), it ends the file after the last event it received, with
    no end record.

    The socket pair is written with MSG_NOSIGNAL: a writer process that died
    makes a send fail, never raises SIGPIPE in the engine. The writer process
    runs in its own session, so that a Ctrl-C or a signal to the engine's
    process group does not cut the trace short; it ends when the connection
    closes. It is detached from the engine's process tree (``Detached``):
    vLLM's shutdown SIGKILLs every descendant of an engine core that has not
    exited at once, and a writer killed there would lose its last events and
    the end record. A process forked from the engine (without exec) closes its
    copy of the connection, so that it cannot keep the writer waiting.

    ``settled`` (the engine holds no request) hands every waiting line on and,
    once the writer process has read them all, sends ``["settled", dropped]``.
    The socket then holds that line only, so the first event put after it
    goes into the socket, at least its first bytes, before ``put`` returns,
    without blocking. So when the connection closes right after that line,
    the engine's process was killed with every event it recorded handed on
    and no request in it, and the writer process ends the trace ``complete``:
    vLLM's API server, stopped with Ctrl-C, SIGKILLs its engine core at once
    (its shutdown timeout is 0), and an idle engine core killed so has left
    nothing out of its trace. Should the recorder fail after it said so
    (``unsettle``, or an error here), ``["unsettled"]`` follows, and a kill
    then leaves a trace that reads as cut off."""

    SEND_S = 0.05   # each send wakes the writer process: a few per second is enough
    SEND_MAX = 1 << 20   # bytes offered to the socket at once
    POLL_S = 0.05
    SETTLE_POLL_S = 0.002   # while the writer process reads the last lines before "settled"

    def __init__(self, path: str | os.PathLike, header: Header, maxsize: int | None = None):
        super().__init__(path, maxsize)
        self._out: deque[bytes] = deque()  # encoded events the socket has not taken yet
        self._sent_at = time.monotonic()
        self._settling = False   # settled() was called, and nothing put since
        self._settled = False    # the writer process was told: a put must reach it at once
        raw = open_trace_file(self.path)  # may raise: caller handles it
        if raw < 3:  # never where the writer process's stdin/stdout/stderr go
            raw, low = above_stdio(raw), raw
            os.close(low)
        # Locked before the writer exists: the lock goes with the open file,
        # which the writer inherits, so the file is never unlocked before the
        # writer has finished it, however early wait_for_writers looks.
        hold_lock(raw)
        mine, theirs = socket.socketpair()
        try:
            if not sys.executable:
                raise WriterProcessError("this Python does not know its own executable")
            self._proc = Detached.start(
                [sys.executable, "-m", "kvtrace.record.writer_process", "--detach",
                 str(self.path), str(raw)], theirs, raw, mine)
        except BaseException as e:
            mine.close()
            if isinstance(e, (OSError, ValueError)):
                raise WriterProcessError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            os.close(raw)
            theirs.close()
        self._sock = mine
        _OPEN.add(self)
        try:
            self._sock.sendall(orjson.dumps(to_json(header), option=orjson.OPT_APPEND_NEWLINE),
                               socket.MSG_NOSIGNAL)
        except BaseException:
            self._hang_up()
            raise
        self._thread.start()

    def put(self, ev: Any) -> None:
        with self._lock:
            if self.closed or self.write_error is not None:
                return
            if len(self._out) >= self.maxsize:
                self.dropped += 1
                return
            try:
                lines: list = []
                self._resolve(ev, lines)
                self._out.append(b"".join([_encode(x) + b"\n" for x in lines]))
                self._settling = False
                if self._settled or time.monotonic() - self._sent_at >= self.SEND_S:
                    # Settled: the socket was empty but for that line, and takes at
                    # least the start of this one, which the writer process sees.
                    self._settled = False
                    self._send_waiting()
            except Exception as e:  # a dead writer process ...
                self._failed(e)

    def flush(self) -> None:
        """The engine is failing: hand every waiting line to the writer process
        now, blocking until the socket takes them. vLLM's front end kills an
        engine core that does not exit at once after a failure, and lines left
        here, up to ``SEND_S`` of the last events, would be lost with it."""
        with self._lock:
            if self.closed or self.write_error is not None or not self._out:
                return
            try:
                self._sock.sendall(b"".join(self._out), socket.MSG_NOSIGNAL)
                self._out.clear()
                self._sent_at = time.monotonic()
            except Exception as e:   # a dead writer process
                self._failed(e)

    def settled(self) -> None:
        """The engine holds no request: the writer thread hands on what waits,
        then says so to the writer process, unless an event comes first."""
        with self._lock:
            if not self.closed and self.write_error is None and not self._settled:
                self._settling = True
                self._wake.set()

    def _failed(self, e: Exception) -> None:
        super()._failed(e)
        self._unsettle()

    def unsettle(self) -> None:
        with self._lock:
            self._unsettle()

    def _unsettle(self) -> None:
        """(The lock held, or the sink closed.) Events are lost from here: if the
        writer process was told the engine settled, tell it that no longer
        holds, without blocking (the socket held only that line)."""
        self._settling = False
        if self._settled:
            self._settled = False
            self._out.append(orjson.dumps(["unsettled"], option=JSON_LINE))
            try:
                self._send_waiting()
            except OSError:
                pass   # a dead writer process: it ends the trace cut off anyway

    def _tell_settled(self) -> None:
        """On the writer thread, the lock held: once the writer process has read
        every line (the socket is empty), send ``["settled", dropped]``.
        Never blocks: until then the lines wait for the socket, and the line
        waits for the writer process to catch up, a poll later."""
        if self._out:
            self._send_waiting()
            return
        try:
            unread = int.from_bytes(fcntl.ioctl(self._sock.fileno(), _TIOCOUTQ, b"\0" * 4),
                                    sys.byteorder)
        except (OSError, TypeError):   # a system that cannot say: never settled
            self._settling = False
            return
        if unread:
            return
        self._settling = False
        self._out.append(orjson.dumps(["settled", self.dropped], option=JSON_LINE))
        self._send_waiting()   # a few bytes into an empty socket: all taken
        self._settled = True   # (any part left waits in _out, and goes before the next event)

    def _send_waiting(self) -> None:
        """Hand the waiting lines to the socket, as many as it takes without
        blocking (the lock is held)."""
        self._sent_at = time.monotonic()
        out = self._out
        take, size = [], 0
        for lines in out:   # no more than the socket can take: lines may pile up
            take.append(lines)
            size += len(lines)
            if size >= self.SEND_MAX:
                break
        try:
            n = self._sock.send(b"".join(take), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return            # the writer process is behind: the lines wait
        while out and n >= len(out[0]):
            n -= len(out.popleft())
        if n:
            out[0] = out[0][n:]

    def _run(self) -> None:
        try:
            self._proc.reap()   # off the engine's thread
        except Exception as e:
            logger.error("kvtrace: starting the trace writer process for %s: %s", self.path, e)
        while True:
            # Waiting for the writer process to read the last lines: look again soon.
            self._wake.wait(self.SETTLE_POLL_S if self._settling and not self._out else self.POLL_S)
            self._wake.clear()   # what woke it is read under the lock below
            with self._lock:
                stop = self._stop
                try:
                    if stop is None and self._settling and self.write_error is None:
                        self._tell_settled()
                    elif (stop is None and self._out and self.write_error is None
                            and time.monotonic() - self._sent_at >= self.SEND_S):
                        self._send_waiting()
                except Exception as e:
                    self._failed(e)
            if stop is not None:
                self._finish(*stop)
                return

    def _finish(self, status: str, error: str | None) -> None:
        # Closed: nothing is put any more, so the lines left need no lock. They are
        # sent even after an error in put: the first may be partly sent already,
        # and the end line must not be glued to half a line.
        status, error = self._end_status(status, error)
        rest = b"".join(self._out)
        self._out.clear()
        try:
            if self.write_error is None or self._proc.poll() is None:
                end = orjson.dumps(["end", status, error, self.dropped], option=JSON_LINE)
                self._sock.sendall(rest + end, socket.MSG_NOSIGNAL)
        except Exception as e:   # a dead writer process: reported once
            if self.write_error is None:
                self._failed(e)
        finally:
            self._hang_up()

    def _hang_up(self) -> None:
        """End the connection and wait for the writer process to finish the file."""
        _OPEN.discard(self)
        try:
            rc = self._proc.returncode
            if rc is None:
                self._sock.shutdown(socket.SHUT_WR)   # the writer reads to the end, then answers
                rc = self._proc.wait(60)
        except subprocess.TimeoutExpired:
            logger.error("kvtrace: the trace writer process for %s is still running", self.path)
            return
        except OSError:
            rc = None
        finally:
            self._sock.close()
        if rc != 0:
            logger.error("kvtrace: the trace writer process for %s %s", self.path,
                         "ended without a word" if rc is None else f"exited with {rc}")


class Detached:
    """A writer process that is not the engine's child. ``start`` runs
    ``argv`` (the writer's ``--detach`` mode), which forks the writer and
    exits, saying the writer's pid: the writer is left to init, outside the
    engine's process tree, where a shutdown that kills the tree does not reach
    it. Not a child, it is waited for on its connection, ``sock``: just
    before it exits, the writer sends its exit status there, as one line.
    Nothing here waits on the engine's thread: the launcher is reaped, and
    the writer's pid read, by the sink's writer thread (``reap``)."""

    def __init__(self, launcher: subprocess.Popen, sock: socket.socket):
        self._launcher = launcher
        self._reaping = threading.Lock()
        self._pid: int | None = None
        self._sock = sock
        self.returncode: int | None = None

    @classmethod
    def start(cls, argv: list[str], theirs: socket.socket, raw: int,
              sock: socket.socket) -> "Detached":
        launcher = subprocess.Popen(argv, stdin=theirs.fileno(), stdout=subprocess.PIPE,
                                    pass_fds=(raw,), close_fds=True, env=child_env(),
                                    start_new_session=True)
        return cls(launcher, sock)

    def reap(self) -> None:
        """Read the writer's pid from the launcher, and reap the launcher."""
        launcher = self._launcher
        with self._reaping:
            if launcher.stdout is not None and not launcher.stdout.closed:
                said = launcher.stdout.readline()
                launcher.stdout.close()
                if said.strip().isdigit():
                    self._pid = int(said)
            launcher.wait()

    @property
    def pid(self) -> int | None:
        """The writer's pid (None when it did not start)."""
        if self._pid is None:
            self.reap()
        return self._pid

    def poll(self) -> int | None:
        """The writer's exit status once it has said it (None while it runs or
        when it died without a word)."""
        if self.returncode is None:
            try:
                said = self._sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                return None
            if said.endswith(b"\n"):
                self.returncode = int(said)
        return self.returncode

    def kill(self) -> None:
        if self.pid is not None and self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status, once it has finished; None when it ended without
        one (killed). Raises TimeoutExpired after ``timeout`` seconds."""
        said = b""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not said.endswith(b"\n"):
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not select.select([self._sock], [], [], left)[0]:
                raise subprocess.TimeoutExpired("kvtrace writer", timeout)
            try:
                chunk = self._sock.recv(64)
            except OSError:   # reset: it died with lines unread
                return None
            if not chunk:
                return None
            said += chunk
        self.returncode = int(said)
        return self.returncode


def split_trace_name(name: str) -> tuple[str, str]:
    """A trace file's name as (stem, ending): ``run.jsonl.gz`` -> ``("run", ".jsonl.gz")``.
    Further schedulers' traces are named ``stem + tag + ending``."""
    for ext in (".jsonl.gz", ".jsonl.zst", ".jsonl", ".gz", ".zst"):
        if name.endswith(ext):
            return name[: -len(ext)], ext
    return name, ""


def hold_lock(fd: int) -> None:
    """Take an exclusive lock on the trace file open as ``fd``, so that whoever
    started the engine can wait for the file to be whole (``wait_for_writers``).
    The lock belongs to the open file, shared by every descriptor of it, the
    writer process's included. Where locks do not work, nothing."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def wait_for_writers(path: str | os.PathLike, timeout: float = 60.0) -> None:
    """Wait until no writer process still writes the trace ``path``, or the
    traces named after it for further schedulers (``.dp1``, ``.pid123``, ...):
    each holds a lock on its file while it writes. A writer is detached from
    the engine, so it may finish after the engine's processes have exited."""
    p = Path(path)
    stem, ext = split_trace_name(p.name)
    paths = [p, *p.parent.glob(f"{stem}.*{ext}")] if p.parent.is_dir() else [p]
    deadline = time.monotonic() + timeout
    for trace in dict.fromkeys(paths):
        try:
            fd = os.open(trace, os.O_RDONLY)
        except OSError:
            continue
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.error("kvtrace: a writer process still writes %s", trace)
                        break
                    time.sleep(0.05)
                except OSError:   # no locks here
                    break
        finally:
            os.close(fd)


class WriterProcessError(RuntimeError):
    """The writer process could not be started."""


_OPEN: "weakref.WeakSet[ProcessSink]" = weakref.WeakSet()


def _close_in_forked_child() -> None:
    # A forked child has no writer thread, and the lock may have been held by a
    # thread that does not exist there: the child's copy of the sink records nothing.
    for sink in list(_OPEN):
        sink.closed = True
        sink._lock = threading.Lock()
        try:
            sink._sock.close()
        except Exception:
            pass
    _OPEN.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


def open_sink(path: str | os.PathLike, header: Header, maxsize: int | None = None) -> _Sink:
    """The sink ``KVTRACE_WRITER`` asks for: ``process`` (default) or ``thread``.
    When the writer process cannot be started, the writer runs in this process
    (and says so): a trace written more slowly beats no trace."""
    kind = os.environ.get(ENV_WRITER, "process").strip().lower() or "process"
    if kind == "thread":
        return TraceSink(path, header, maxsize)
    if kind != "process":
        raise ValueError(f"{ENV_WRITER}={kind!r}: expected 'process' or 'thread'")
    try:
        return ProcessSink(path, header, maxsize)
    except WriterProcessError as e:
        logger.warning("kvtrace: cannot start the trace writer process (%s); writing %s from "
                       "a thread of this process instead", e, path)
        return TraceSink(path, header, maxsize)
