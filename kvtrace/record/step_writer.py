"""The embedded engine's trace writer: every completed step survives a kill.

``StepWriter`` writes what ``TraceWriter`` writes, with ``TraceWriter``'s
calls, but hands it to a writer process at the end of every engine step
(``end_step``), and returns only once the step's records are in a ring in
shared memory (``ring``). The writer process (``python -m
kvtrace.record.writer_process --copy``, detached from the engine's process
tree, as the vLLM recorder's is: ``sink.start_writer``) copies the ring into
the file, compressing it as its name says. So when the engine's process is
killed (SIGKILL, ``os._exit``, a crash in native code), the writer still has
every step the engine completed: it writes them, closes the file, and the
trace reads as cut off after the last of them. Records of a step still
running, held here until the step ends, are lost with it.

With ``flight`` (``kvtrace record --keyframe-every N`` or ``--ring``), the
writer process is the flight recorder's (``python -m
kvtrace.flight.writer_process``, as for a vLLM engine): it reads each record
back, makes the keyframes, checks the invariants, pins on triggers and, with
a ring, writes the directory of segments. The engine's process does no more
for them than for a whole trace.

The engine waits for room when the ring is full: it never drops a record.
A write the writer process cannot make (a full disk) is said in the ring,
and raised here, naming the trace, at the next step's end.

``open_step_writer`` is what ``kvtrace record`` uses: this writer, or, where
no writer process can be started (or ``KVTRACE_WRITER=thread``), a
``TraceWriter`` in this process, which keeps the steps a 1 MiB buffer holds
from a kill.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import orjson

from kvtrace.record.ring import DEFAULT_SIZE
from kvtrace.record.sink import (ENV_RING, ENV_WRITER, KEYFRAMING_WRITER as FLIGHT_WRITER,
                                 WriterProcessError, start_writer)
from kvtrace.trace.events import End, Header, encode
from kvtrace.trace.io import TraceWriter, interrupted_by

logger = logging.getLogger("kvtrace.record")

HAND_ON_BYTES = 1 << 20   # records held here before they go, within a step
WAIT_S = 0.001            # how long the engine sleeps while the ring is full
LOOK_EVERY_S = 0.05       # while it waits: how often it looks whether the writer lives


class StepWriter:
    """``TraceWriter``'s calls, each step's records handed to a writer process
    once the step is complete."""

    def __init__(self, path: str | os.PathLike, header: Header, ring_size: int | None = None,
                 flight: list[str] | None = None):
        """``flight``: the flight writer process's arguments
        (``--keyframe-every N``, ``--ring BYTES --segment BYTES``); with
        ``--ring``, ``path`` is the directory of segments, claimed here."""
        self.path = Path(path)
        self._flight = flight is not None   # the records are read back, the end said as a line
        self._seq = 0
        self._held: list[bytes] = []   # encoded records of the step under way
        self._bytes = 0
        self._closed = False
        size = int(ring_size or os.environ.get(ENV_RING, 0) or DEFAULT_SIZE)
        first = encode(header) + b"\n"
        if flight is None:
            self._ring, self._proc, self._sock = start_writer(self.path, first, size, copy=True)
        else:
            self._ring, self._proc, self._sock = start_writer(
                self.path, first, size, module=FLIGHT_WRITER, args=flight,
                folder="--ring" in flight)
        self.bytes_written = len(first)   # the trace's text so far, before compression
        self._piece = max(1, size // 2)   # the most offered at once: a line may be split

    # -- TraceWriter's calls ----------------------------------------------------------

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def write(self, event) -> None:
        line = encode(event)
        self._held.append(line)
        self._bytes += len(line) + 1
        self.bytes_written += len(line) + 1
        if self._bytes >= HAND_ON_BYTES:
            self._hand_on()

    def end_step(self) -> None:
        """The step is complete: its records are in the ring when this returns."""
        if self._held:
            self._hand_on()
        elif self._ring.error:
            self._raise_error()

    def flush(self) -> None:
        self.end_step()

    def close(self, status: str = "complete", error: str | None = None,
              dropped_events: int = 0) -> None:
        if self._closed:
            return
        self.finish(End(seq=self.next_seq(), status=status, error=error,
                        dropped_events=dropped_events))

    def finish(self, end: End | None) -> None:
        if self._closed:
            return
        if end is not None and self._flight:   # the flight writer writes the end itself
            self._held.append(orjson.dumps(["end", end.status, end.error, end.dropped_events]))
        elif end is not None:
            self.write(end)
        self.finish_records()

    def finish_records(self) -> None:
        """Hand on what is held, tell the writer process this is all, and wait
        for it to close the file."""
        self._closed = True
        try:
            if self._held:
                self._hand_on()
        finally:
            rc = self._hang_up()
        if self._ring_error:
            self._raise_error()
        if rc != 0:
            raise WriterProcessError(f"the trace writer process for {self.path} "
                                     f"{'ended without a word' if rc is None else f'exited with {rc}'}")

    def __enter__(self) -> "StepWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close(status="interrupted", error=interrupted_by(exc))
        except Exception:   # the error on its way out says more
            pass

    # -- the hand-over --------------------------------------------------------------

    def _hand_on(self) -> None:
        data = b"\n".join(self._held) + b"\n"
        self._held, self._bytes = [], 0
        ring = self._ring
        for at in range(0, len(data), self._piece):
            piece = data[at:at + self._piece]
            if not ring.offer(piece):
                self._wait_to_offer(piece)
        if ring.error:
            self._raise_error()

    def _wait_to_offer(self, piece: bytes) -> None:
        """The ring is full: wait until the writer process has made room."""
        looked = time.monotonic()
        while not self._ring.offer(piece):
            if self._ring.error:
                self._raise_error()
            if time.monotonic() - looked >= LOOK_EVERY_S:
                looked = time.monotonic()
                if self._proc.ended():
                    raise WriterProcessError(f"the trace writer process for {self.path} has "
                                             "ended; the trace stops at the last step it took")
            time.sleep(WAIT_S)

    def _raise_error(self) -> None:
        err = self._ring_error or self._ring.error
        raise OSError(err, os.strerror(err), str(self.path))

    def _hang_up(self) -> int | None:
        """End the connection; the writer process writes what is left in the
        ring, closes the file and says its exit status."""
        rc = None
        try:
            self._sock.shutdown(socket.SHUT_WR)
            rc = self._proc.wait(60)
        except subprocess.TimeoutExpired:
            logger.error("kvtrace: the trace writer process for %s is still running", self.path)
        except OSError:
            pass
        finally:
            self._ring_error = self._ring.error
            self._sock.close()
            self._ring.close()
            try:
                self._proc.reap()
            except Exception:
                pass
        return rc

    _ring_error = 0


def open_step_writer(path: str | os.PathLike, header: Header, flight: list[str] | None = None,
                     in_process=TraceWriter):
    """A ``StepWriter`` for ``path`` (``flight``: as ``StepWriter``'s); with
    ``KVTRACE_WRITER=thread``, or when the writer process cannot be started
    (said once), ``in_process(path, header)``: a ``TraceWriter``, or the
    flight recorder's writers in this process."""
    if os.environ.get(ENV_WRITER, "").strip().lower() == "thread":
        return in_process(path, header)
    try:
        return StepWriter(path, header, flight=flight)
    except WriterProcessError as e:
        logger.warning("kvtrace: cannot start the trace writer process (%s); writing %s from "
                       "this process instead: a kill loses the steps its buffer holds", e, path)
        return in_process(path, header)
