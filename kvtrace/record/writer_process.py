"""The trace writer process: JSON lines in, a trace file out.

Started by ``kvtrace.record.sink.ProcessSink`` as
``python -m kvtrace.record.writer_process PATH FD RING``, with the trace file
already open as descriptor FD and the ring's memory file as descriptor RING
(``kvtrace.record.ring``). It reads the ring every ``RING_POLL_S``, where the
engine's process puts, one JSON line each:

* first, the header;
* resolved items: events, ``["step", ...]``, ``["output", ...]`` and
  ``["statuses", ...]`` (see ``Resolver``), which ``Records`` turns into records;
* last, ``["end", status, error, dropped_events]``: the end record, then exit;
* whenever the engine holds no request, ``["settled", dropped_events]`` after
  everything it recorded, and ``["unsettled"]`` if the recorder then fails
  (see ``ProcessSink``).

With ``--copy`` (``kvtrace.record.step_writer``, the embedded engine's
writer), the ring holds the trace's own lines, header first and end record
last, and they are written as they are (``serve_copy``).

Its standard input is a socket that the engine's process holds open: it
closes when that process ends, however it ends, and then the writer reads
what is left in the ring. When nothing has come for ``FLUSH_IDLE_S``,
everything so far goes to the file, so that an engine killed without a
shutdown leaves a readable trace.

It ignores SIGINT and SIGTERM: a Ctrl-C or a ``kill`` of the process group must
not cut the trace short while the engine shuts down and sends its end. With
``--detach`` (how the engine starts it) it first forks and leaves its parent
to exit, saying the writer's pid: the writer is then no descendant of the
engine, which vLLM's shutdown may kill with all its descendants; and it says
its exit status on the connection just before it exits. When the
connection closes without an end line in the ring (the engine died), the file
ends after the last event the engine put there, without an end record, and reads as cut off; unless the
last thing received was a ``settled`` line: then it ends the file as the end
line would have, ``complete``.

A failure to write (a full disk) is reported once on standard error; later
events are dropped and the end record, if it can still be written, says
``recorder-error``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Iterator

import orjson

from kvtrace.record.detached import hold_lock
from kvtrace.record.records import Records
from kvtrace.record.ring import Ring
from kvtrace.record.sink import FLUSH_IDLE_S, dropped_end
from kvtrace.trace.events import decode_header
from kvtrace.trace.io import TraceWriter, open_trace_stream


IDLE = None  # what ``_lines`` yields after FLUSH_IDLE_S without input
CUT = object()   # what ``_lines`` yields last when the input ends inside a line
RING_POLL_S = 0.02   # how often the ring is read: the engine sends no wake-ups


def _lines(fd: int, ring: Ring, wake_fd: int | None = None):
    """Complete lines read from ``ring`` until the connection ``fd`` closes
    (then what is left); ``IDLE`` once whenever nothing has come for
    ``FLUSH_IDLE_S``, and whenever ``wake_fd`` (a signal's wake-up) can be
    read; ``CUT`` at the end when a line was left unfinished."""
    rest = b""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if wake_fd is not None:
        poll.register(wake_fd, select.POLLIN)
    quiet_since: float | None = time.monotonic()
    while True:
        closed = woken = False
        for ready, _ in poll.poll(RING_POLL_S * 1000):
            if ready == fd:
                closed = not os.read(fd, 1 << 16)   # nothing comes here but the end
            else:
                os.read(wake_fd, 512)
                woken = True
        # Taken after the close is seen: then it holds all the engine's process put.
        chunk = ring.take()
        if chunk:
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from lines
            quiet_since = time.monotonic()
        elif quiet_since is not None and time.monotonic() - quiet_since >= FLUSH_IDLE_S:
            quiet_since = None
            yield IDLE
            woken = False
        if woken:   # a signal came, and may ask something of the writer
            yield IDLE
        if closed:
            if rest:
                yield CUT
            return


def say(msg: str) -> None:
    print(f"kvtrace: {msg}", file=sys.stderr, flush=True)


def serve(fd_in: int, path: str, fd_out: int, fd_ring: int, open_writer=None,
          wake_fd: int | None = None) -> int:
    """Write the trace ``path`` (open as ``fd_out``) from the lines in the ring
    ``fd_ring``, until the connection ``fd_in`` closes. Returns the exit
    status: 0 when the file holds everything it was sent. ``open_writer(path,
    header, fd_out)``, if given, makes the writer the records go through (the
    flight recorder's, which adds keyframes, or writes a directory of
    segments); its ``flush`` is called whenever ``wake_fd`` can be read."""
    hold_lock(fd_out)   # held already, unless the file came from elsewhere
    ring = Ring.of_file(fd_ring)
    os.close(fd_ring)   # the mapping stays
    lines = _lines(fd_in, ring, wake_fd)
    writer = _start(path, fd_out, lines, open_writer)
    if writer is None:
        return 1
    rc, error, settled = write_lines(writer, lines)
    if rc is not None:
        return rc
    return _end_cut_off(writer, path, error, settled)


def _start(path: str, fd_out: int, lines: Iterator[bytes | None | object],
           open_writer=None) -> TraceWriter | None:
    """The trace's writer, its header (the first line) written; None, said,
    when no header came or the file cannot be written."""
    first = next((line for line in lines if line is not IDLE), None)
    if first is None:
        os.close(fd_out)
        return None
    try:
        header = decode_header(orjson.loads(first))
        writer = (open_writer or trace_writer)(path, header, fd_out)
        writer.flush()   # an engine killed before the first idle moment leaves a readable trace
    except Exception as e:
        say(f"cannot write the trace {path}: {type(e).__name__}: {e}")
        return None
    return writer


def trace_writer(path: str, header, fd: int) -> TraceWriter:
    """The trace file's writer, on its open descriptor ``fd``."""
    return TraceWriter(path, header, fd=fd)


def write_lines(writer: TraceWriter, lines: Iterator[bytes | None | object]
                 ) -> tuple[int | None, str | None, int | None]:
    """The records of ``lines`` into ``writer``, up to the end line. Returns
    the exit status when the end line came (None when the input ended
    without it), the first write error, and the events dropped when the last
    line said the engine settled (None when it did not)."""
    records = Records()
    error: str | None = None
    settled: int | None = None
    for line in lines:
        try:
            if line is IDLE:
                if error is None:
                    writer.flush()
                continue
            if line is CUT:
                settled = None
                continue
            item = orjson.loads(line)
            tag = item[0] if type(item) is list else None
            if tag == "settled":
                settled = int(item[1])
                continue
            if tag == "unsettled":   # the recorder failed after it said so
                settled = None
                continue
            settled = None
            if tag == "end":
                _, status, message, dropped = item
                if error is not None:
                    status, message = "recorder-error", error
                writer.close(status=status, error=message, dropped_events=dropped)
                return (0 if error is None else 1), error, settled
            if error is not None:
                continue
            rec = records(item, writer.next_seq)
            if rec is not None:
                writer.write(rec)
        except Exception as e:
            if error is None:
                error = f"writing the trace failed: {type(e).__name__}: {e}"
                say(f"{error}; recording stopped, the engine is unaffected")
    return None, error, settled


def _end_cut_off(writer: TraceWriter, path: str, error: str | None, settled: int | None) -> int:
    """The engine is gone without an end line. Killed while it held no
    request, with every event handed on (vLLM's API server SIGKILLs its
    engine core at Ctrl-C): the trace is whole. Otherwise it stops where its
    events stop. Returns the exit status."""
    try:
        if settled is not None and error is None:
            status, message = dropped_end(settled)
            writer.close(status=status, error=message, dropped_events=settled)
            return 0
        writer.finish(None)
    except Exception as e:
        say(f"closing the trace {path} failed: {type(e).__name__}: {e}")
        return 1
    return 0 if error is None else 1


def serve_copy(fd_in: int, path: str, fd_out: int, fd_ring: int) -> int:
    """Write the trace ``path`` (open as ``fd_out``) from the bytes in the ring
    ``fd_ring``, as they are (compressed as the name says), until the
    connection ``fd_in`` closes; then what is left, and close the file. The
    engine's process puts whole records there, its header first and its end
    record last (``kvtrace.record.step_writer``). A write that fails is said
    in the ring (``Ring.set_error``), for the engine's process to report; what
    comes after it is read and dropped. Returns 0 when the file holds
    everything it was sent."""
    hold_lock(fd_out)
    ring = Ring.of_file(fd_ring)
    os.close(fd_ring)
    error = False
    try:
        stream, raw = open_trace_stream(path, fd_out)
    except OSError as e:
        ring.set_error(e.errno)
        os.close(fd_out)
        stream = raw = None
        error = True
    poll = select.poll()
    poll.register(fd_in, select.POLLIN)
    quiet_since, dirty = time.monotonic(), False
    while True:
        closed = False
        if poll.poll(RING_POLL_S * 1000):
            closed = not os.read(fd_in, 1 << 16)   # nothing comes here but the end
        chunk = ring.take()   # taken after the close is seen: all the engine put
        try:
            if chunk:
                quiet_since = time.monotonic()
                if not error:
                    stream.write(chunk)
                    dirty = True
            elif dirty and not error and time.monotonic() - quiet_since >= FLUSH_IDLE_S:
                stream.flush()   # a reader of the growing trace sees it
                dirty = False
        except OSError as e:
            ring.set_error(e.errno)
            error = True
        if closed:
            break
    if stream is not None:
        try:
            stream.close()
        except OSError as e:
            ring.set_error(e.errno)
            error = True
        finally:
            if raw is not stream:
                try:
                    raw.close()
                except OSError:
                    pass
    return 1 if error else 0


def main(argv: list[str] | None = None, open_writer=None, wake_fd: int | None = None) -> int:
    """``[--detach] [--copy] PATH FD RING``; ``open_writer``, ``wake_fd``: as
    ``serve``'s."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    detach = argv[:1] == ["--detach"]
    if detach:
        argv = argv[1:]
        _detach()
    copy = argv[:1] == ["--copy"]
    if copy:
        argv = argv[1:]
    path, fd, fd_ring = argv[0], int(argv[1]), int(argv[2])
    rc = (serve_copy(sys.stdin.fileno(), path, fd, fd_ring) if copy
          else serve(sys.stdin.fileno(), path, fd, fd_ring, open_writer, wake_fd))
    if detach:   # the engine waits for this line (kvtrace.record.detached.Detached)
        try:
            os.write(sys.stdin.fileno(), b"%d\n" % rc)
        except OSError:
            pass     # the engine is gone
    return rc


def _detach() -> None:
    """Fork; the parent says the child's pid on standard output and exits, and
    the child, the writer, is left to init, outside the engine's process tree."""
    pid = os.fork()
    if pid:
        try:
            os.write(sys.stdout.fileno(), b"%d\n" % pid)
        except OSError:
            pass   # the engine is gone (killed): nobody reads it, and the writer goes on
        os._exit(0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())   # the engine has read what it wanted there
    os.close(null)


if __name__ == "__main__":
    sys.exit(main())
