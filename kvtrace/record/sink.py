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
/ ``RawOutput`` (``capture``): copies of the engine's own lists and counters,
taken on its thread with as little Python per request as possible, which
``Resolver`` and ``Records`` (``records``) turn into ``step`` and ``output``
records. The writer process is started outside the engine's process tree
(``detached``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import termios
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import orjson

from kvtrace.record.detached import Detached, hold_lock
from kvtrace.record.records import Records, Resolver
from kvtrace.trace.events import Header, plain_values, to_json
from kvtrace.trace.io import JSON_LINE, TraceWriter, open_trace_file
from kvtrace.workers.child import above_stdio

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
