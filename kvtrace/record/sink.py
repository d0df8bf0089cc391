"""Where the recorder's events go: from the engine's thread to the trace file.

Data flow, one way::

    engine's thread                                         trace writer
    ---------------                                         ------------
    capture -> put() -> Resolver: block ids, statuses ----> Records -> TraceWriter

``put`` never blocks and never raises. Two sinks split the work differently:

* ``ProcessSink`` (the default): ``put`` reads, on the engine's thread, the block
  ids that only the engine's process can read, encodes the event as one JSON
  line and copies it into a ring in shared memory (``ring``), which ``python -m
  kvtrace.record.writer_process`` drains. That process builds the schema's
  records, serializes, compresses and writes the file, outside the engine's
  GIL. An event is safe once ``put`` returns: when the engine dies without
  shutting down (SIGKILL, ``os._exit``, a crash in native code), the writer
  process sees the connection close, reads what is left in the ring and ends
  the file after the last event.
* ``TraceSink``: ``put`` appends to a deque, and a writer thread in the engine's
  process does all the rest (``KVTRACE_WRITER=thread``, or when the writer
  process cannot be started).

Encoding on the engine's thread costs it about what handing events to a thread
did, and saves the GIL hand-offs of a thread that wakes to take them: on a
small CPU engine those cost more than the work itself (docs/performance.md).

When ``maxsize`` events are waiting, ``put`` drops the event and counts it; the
trace then ends with ``status "recorder-error"`` and ``dropped_events > 0``.

Events are the schema's (``Arrival``, ``Abort``, ``PromptStats``), or ``RawStep``
/ ``RawOutput`` (``capture``): copies of the engine's own lists and counters,
taken on its thread with as little Python per request as possible, which
``Resolver`` and ``Records`` (``records``) turn into ``step`` and ``output``
records. The writer process is started outside the engine's process tree
(``detached``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import orjson

from kvtrace.record.detached import Detached, hold_lock
from kvtrace.record.folder import ENV_RING as ENV_FLIGHT_RING
from kvtrace.record.folder import open_folder, ring_settings
from kvtrace.record.records import Records, Resolver
from kvtrace.record.ring import DEFAULT_SIZE, Ring, memory_file
from kvtrace.trace.events import Header, plain_values, to_json
from kvtrace.trace.io import JSON_LINE, TraceWriter, open_trace_file
from kvtrace.workers.child import above_stdio

logger = logging.getLogger("kvtrace.record")
# One line of the hand-over: an event, or a raw step or output (tuples of the
# engine's values, numpy integers among them).
_encode = msgspec.json.Encoder(enc_hook=plain_values).encode

ENV_QUEUE = "KVTRACE_QUEUE_SIZE"
ENV_WRITER = "KVTRACE_WRITER"       # "process" (default) or "thread"
ENV_RING = "KVTRACE_RING_BYTES"     # the shared-memory ring's size (ProcessSink)
# A keyframe before every N-th step, or a ring (KVTRACE_RING, KVTRACE_SEGMENT:
# record.folder): the writer process that makes them is the flight
# recorder's (kvtrace.flight.writer_process), started by its name.
ENV_KEYFRAME_EVERY = "KVTRACE_KEYFRAME_EVERY"
KEYFRAMING_WRITER = "kvtrace.flight.writer_process"
DEFAULT_QUEUE_SIZE = 1 << 16
FLUSH_IDLE_S = 0.25  # flush after this long without events

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

    ``put`` reads the block ids that only the engine's process can read,
    encodes the event as one JSON line (together about as much work as handing
    it to a thread, without the GIL hand-offs a thread costs the engine), and
    copies the line into a ring in shared memory (``kvtrace.record.ring``).
    Nothing is sent, and nothing waits in the engine's memory: once ``put``
    returns, the event survives the engine's process, whether it then exits,
    is SIGKILLed, calls ``os._exit`` or crashes in native code. Only when the
    ring is full (the writer process is far behind) do lines wait here, at most
    ``maxsize`` events; more are dropped and counted. The writer thread moves
    waiting lines into the ring as it empties.

    ``python -m kvtrace.record.writer_process`` maps the ring, reads it every
    ``writer_process.RING_POLL_S``, builds the schema's records, serializes,
    compresses and writes the file, outside the engine's GIL. The first line in
    the ring is the header, the last ``["end", status, error, dropped]``. A
    socket pair joins the two processes only so that the writer process knows
    when the engine's process is gone: then it reads what is left in the ring
    and, without an end line, ends the file after the last event, where it
    reads as cut off. The trace file is opened here, so that a path that cannot
    be written fails at once, in the engine's process; the writer process
    inherits the open file and the ring's memory file.

    The writer process runs in its own session, so that a Ctrl-C or a signal to
    the engine's process group does not cut the trace short; it ends when the
    connection closes. It is detached from the engine's process tree
    (``Detached``): vLLM's shutdown SIGKILLs every descendant of an engine core
    that has not exited at once, and a writer killed there would lose its last
    events and the end record. A process forked from the engine (without exec)
    closes its copy of the connection, so that it cannot keep the writer
    waiting, and records nothing.

    ``settled`` (the engine holds no request) puts ``["settled", dropped]`` in
    the ring after every event. When the engine's process is killed with that
    line last, it had recorded everything it did and held no request, and the
    writer process ends the trace ``complete``: vLLM's API server, stopped with
    Ctrl-C, SIGKILLs its engine core at once (its shutdown timeout is 0), and an
    idle engine core killed so has left nothing out of its trace. An event put
    later follows the line and so undoes it; should an event have to wait
    outside the ring after it, or the recorder fail, ``["unsettled"]`` follows
    (the ring keeps room for it), and a kill then leaves a trace that reads as
    cut off."""

    POLL_S = 0.01   # the writer thread: how often it moves waiting lines into the ring
    KEEP = 64       # bytes an event leaves free in the ring, for the control lines
    FLUSH_WAIT_S = 5.0   # flush: how long it waits for room in the ring
    ALIVE_S = 0.5   # the writer thread: how often it looks whether the writer process lives

    def __init__(self, path: str | os.PathLike, header: Header, maxsize: int | None = None,
                 ring_size: int | None = None):
        super().__init__(path, maxsize)
        self._out: deque[bytes] = deque()  # encoded events waiting for room in the ring
        self._settling = False   # settled() was called while lines waited
        self._settled = False    # the ring's last line says the engine settled
        size = int(ring_size or os.environ.get(ENV_RING, 0) or DEFAULT_SIZE)
        self._largest = size - self.KEEP   # an event longer than this never fits: dropped
        first = orjson.dumps(to_json(header), option=orjson.OPT_APPEND_NEWLINE)
        every = keyframe_every()
        flight = ring_settings()   # may raise: the caller says why
        args = ["--keyframe-every", str(every)] if every else []
        if flight is not None:
            args += ["--ring", str(flight[0]), "--segment", str(flight[1])]
        self._ring, self._proc, self._sock = start_writer(
            self.path, first, size, folder=flight is not None,
            **({"module": KEYFRAMING_WRITER, "args": args} if args else {}))
        _OPEN.add(self)
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
                chunk = (_encode(lines[0]) + b"\n" if len(lines) == 1
                         else b"".join([_encode(x) + b"\n" for x in lines]))
                self._settling = False   # an event came: the engine is not settled
                if len(chunk) > self._largest:
                    self.dropped += 1    # it would never fit, and hold up every event after it
                    self._unsettle()
                elif self._out or not self._ring.offer(chunk, self.KEEP):
                    self._out.append(chunk)
                    self._unsettle()   # this event is not in the ring yet
                self._settled = False  # (when it is, it follows the settled line)
            except Exception as e:  # an event that cannot be encoded ...
                self._failed(e)

    def _move_waiting(self, keep: int) -> None:
        """(The lock held.) Move waiting lines into the ring while they fit."""
        out, ring = self._out, self._ring
        while out and ring.offer(out[0], keep):
            out.popleft()

    def flush(self) -> None:
        """The engine is failing: move every waiting line into the ring now,
        waiting for room a few seconds at most. vLLM's front end kills an
        engine core that does not exit at once after a failure."""
        deadline = time.monotonic() + self.FLUSH_WAIT_S
        while True:
            with self._lock:
                if self.closed or self.write_error is not None:
                    return
                self._move_waiting(0)
                if not self._out or self._proc.ended():
                    return
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def settled(self) -> None:
        """The engine holds no request: say so after every event so far (at
        once, unless lines wait for room; then the writer thread does)."""
        with self._lock:
            if self.closed or self.write_error is not None or self._settled:
                return
            self._settling = True
            self._tell_settled()

    def _tell_settled(self) -> None:
        """(The lock held.) Put the settled line in the ring, once nothing waits."""
        self._move_waiting(self.KEEP)
        if self._out:
            return
        if self._ring.offer(orjson.dumps(["settled", self.dropped], option=JSON_LINE), 32):
            self._settling = False
            self._settled = True

    def _failed(self, e: Exception) -> None:
        super()._failed(e)
        if not self.closed:
            self._unsettle()

    def unsettle(self) -> None:
        with self._lock:
            if not self.closed:   # once closed, the writer thread alone puts in the ring
                self._unsettle()

    def _unsettle(self) -> None:
        """(The lock held, or the sink closed.) Events are lost, or wait outside
        the ring, from here: if the ring's last line says the engine settled,
        undo it (the ring keeps room for this line)."""
        self._settling = False
        if self._settled:
            self._settled = False
            self._ring.offer(orjson.dumps(["unsettled"], option=JSON_LINE))

    def _run(self) -> None:
        try:
            self._proc.reap()   # off the engine's thread
        except Exception as e:
            logger.error("kvtrace: starting the trace writer process for %s: %s", self.path, e)
        looked = time.monotonic()
        while True:
            self._wake.wait(self.POLL_S)
            self._wake.clear()   # what woke it is read under the lock below
            with self._lock:
                stop = self._stop
                if (stop is None and self.write_error is None
                        and time.monotonic() - looked >= self.ALIVE_S):
                    looked = time.monotonic()
                    self._writer_gone()
                if stop is None and self.write_error is None:
                    if self._settling:
                        self._tell_settled()
                    elif self._out:
                        self._move_waiting(self.KEEP)
            if stop is not None:
                self._finish(*stop)
                return

    def _writer_gone(self) -> bool:
        """Whether the writer process has ended; when it is first seen so, the
        recording stops with recorder-error (events from here are lost)."""
        if not self._proc.ended():
            return False
        if self.write_error is None:
            self._failed(WriterProcessError("the trace writer process has ended"))
        return True

    def _finish(self, status: str, error: str | None) -> None:
        # Closed: nothing is put any more, so the lines left need no lock. They go
        # even after an error in put, then the end line, as long as the writer
        # process lives to make room for them.
        status, error = self._end_status(status, error)
        end = orjson.dumps(["end", status, error, self.dropped], option=JSON_LINE)
        deadline = time.monotonic() + 60
        try:
            while not self._writer_gone():   # it may have died since the thread last looked
                self._move_waiting(0)
                if not self._out and self._ring.offer(end):
                    break
                if time.monotonic() > deadline:
                    logger.error("kvtrace: the trace writer process for %s reads nothing; "
                                 "the trace ends without its last events", self.path)
                    break
                time.sleep(0.002)
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
            self._ring.close()
        if rc != 0:
            logger.error("kvtrace: the trace writer process for %s %s", self.path,
                         "ended without a word" if rc is None else f"exited with {rc}")


class WriterProcessError(RuntimeError):
    """The writer process could not be started (or, for a ``StepWriter``,
    ended before the trace was whole)."""


def keyframe_every() -> int | None:
    """``KVTRACE_KEYFRAME_EVERY``: a keyframe before every N-th step (None:
    unset, or not a positive number, which is said once)."""
    text = os.environ.get(ENV_KEYFRAME_EVERY, "").strip()
    if not text:
        return None
    if text.isascii() and text.isdigit() and int(text) > 0:
        return int(text)
    logger.warning("kvtrace: %s=%r is not a positive number of steps; no keyframes",
                   ENV_KEYFRAME_EVERY, text)
    return None


def start_writer(path: Path, first: bytes, size: int, copy: bool = False,
                 module: str = "kvtrace.record.writer_process", args: list[str] = (),
                 folder: bool = False) -> tuple[Ring, Detached, socket.socket]:
    """Open the trace ``path`` (which may raise: the caller says why), make a
    ring of ``size`` bytes holding ``first``, and start the writer process
    (``python -m kvtrace.record.writer_process``, detached) that writes the
    trace from the ring; with ``copy``, the ring's bytes as they are
    (``serve_copy``); with ``folder``, ``path`` is a directory of segments,
    claimed here (``folder.open_folder``). Returns the ring, the process and
    this side of the connection whose end tells the writer that this process
    is gone. Raises WriterProcessError when the ring or the process cannot be
    made."""
    raw = open_folder(path) if folder else open_trace_file(path)
    if raw < 3:  # never where the writer process's stdin/stdout/stderr go
        raw, low = above_stdio(raw), raw
        os.close(low)
    # Locked before the writer exists: the lock goes with the open file,
    # which the writer inherits, so the file is never unlocked before the
    # writer has finished it, however early wait_for_writers looks.
    hold_lock(raw)
    try:
        low = memory_file(size)
        try:   # the copy above standard I/O only: each writer started would leak one
            memfd = above_stdio(low)
        finally:
            os.close(low)
        ring = Ring(memfd, size, populate=True)
    except BaseException as e:
        os.close(raw)
        raise WriterProcessError(f"the ring in shared memory: {type(e).__name__}: {e}") from e
    ring.offer(first)
    mine, theirs = socket.socketpair()
    try:
        if not sys.executable:
            raise WriterProcessError("this Python does not know its own executable")
        proc = Detached.start(
            [sys.executable, "-m", module, "--detach", *args,
             *(["--copy"] if copy else []), str(path), str(raw), str(memfd)],
            theirs, (raw, memfd), mine)
    except BaseException as e:
        mine.close()
        ring.close()
        if isinstance(e, (OSError, ValueError)):
            raise WriterProcessError(f"{type(e).__name__}: {e}") from e
        raise
    finally:
        os.close(raw)
        os.close(memfd)
        theirs.close()
    return ring, proc, mine


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
    (and says so): a trace written more slowly beats no trace. A ring
    (``KVTRACE_RING``: ``path`` is a directory of segments) is written by the
    writer process alone: without one this raises, and the engine runs
    unrecorded (the caller says why)."""
    kind = os.environ.get(ENV_WRITER, "process").strip().lower() or "process"
    ring = bool(os.environ.get(ENV_FLIGHT_RING, "").strip())
    if kind == "thread" and ring:
        raise ValueError(f"{ENV_FLIGHT_RING} needs the writer process ({ENV_WRITER}=thread "
                         "writes whole traces only)")
    if kind == "thread":
        if keyframe_every():
            logger.warning("kvtrace: %s=thread writes no keyframes (the writer process makes "
                           "them)", ENV_WRITER)
        return TraceSink(path, header, maxsize)
    if kind != "process":
        raise ValueError(f"{ENV_WRITER}={kind!r}: expected 'process' or 'thread'")
    try:
        return ProcessSink(path, header, maxsize)
    except WriterProcessError as e:
        if ring:   # a ring is written outside the engine's process, or not at all
            raise
        logger.warning("kvtrace: cannot start the trace writer process (%s); writing %s from "
                       "a thread of this process instead", e, path)
        return TraceSink(path, header, maxsize)
