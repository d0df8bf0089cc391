"""``TraceWriter``: a trace file written whole, plain, gzip or zstd by its name,
created with mode 0600 (it holds prompts as token ids)."""

from __future__ import annotations

import errno
import fcntl
import gzip
import io
import os
import stat
import time
from pathlib import Path
from typing import IO

import orjson

from .events import End, Event, Header, encode

# How long a new writer of a trace waits for another process's lock on it to
# go: a reader looks at the lock for a moment (files.being_written); a writer
# holds it until the trace is whole.
CLAIM_WAIT_S = 0.5


def interrupted_by(exc: BaseException) -> str:
    """The end record's error for a recording that ``exc`` interrupted: its
    type and message, or, without a message (Ctrl-C), what happened."""
    said = str(exc).strip()
    return f"{type(exc).__name__}: {said}" if said else f"interrupted ({type(exc).__name__})"


class TraceBusy(OSError):
    """Another writer holds the trace: a second recording into one file."""


def open_trace_file(path: str | os.PathLike) -> int:
    """A descriptor for writing the trace ``path``, created or emptied. Traces
    hold users' prompts: readable by their owner only.

    A regular file is claimed first, with an exclusive lock (``flock``) that
    its open file holds until the writer closes it, and emptied only then: a
    second writer of the same path (two ``kvtrace record -o t.jsonl`` at
    once, or a writer process still finishing a trace) raises ``TraceBusy``
    and leaves the file as it is. Readers take the lock as the sign that a
    recorder is still writing the trace."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):   # never a device's or a pipe's
            _claim(fd, path)
            os.ftruncate(fd, 0)
            os.fchmod(fd, 0o600)   # also when writing over an existing file
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim(fd: int, path: str | os.PathLike) -> None:
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TraceBusy(errno.EBUSY, "another process is writing this trace now (a "
                                "second recording into one file?); wait for it to end, or name "
                                "another file", os.fspath(path)) from None
            time.sleep(0.01)
        except OSError:   # a file system without locks
            return


def open_trace_stream(path: str | os.PathLike, fd: int | None = None
                      ) -> tuple[IO[bytes], IO[bytes]]:
    """(stream to write, the file under it) for the trace ``path``, or the open
    descriptor ``fd`` of it: the compression follows the name."""
    return _open_binary_write(Path(path), fd)


def _open_binary_write(path: Path, fd: int | None = None) -> tuple[IO[bytes], IO[bytes]]:
    """(stream to write, the file under it): the compression follows the name."""
    raw = os.fdopen(open_trace_file(path) if fd is None else fd, "wb")
    name = path.name
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6), raw
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=True), raw
    return raw, raw


# One record per line: numpy integers written as integers.
JSON_LINE = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY


class TraceWriter:
    """Write a header, then events. The compression follows the file name
    (``.gz``, ``.zst`` or plain). ``fd``: an open descriptor for ``path`` to
    write to (see ``open_trace_file``), which the writer then owns."""

    def __init__(self, path: str | os.PathLike, header: Header, fd: int | None = None):
        self.path = Path(path)
        # file, or gzip/zstd stream over it
        self._inner, self._raw = _open_binary_write(self.path, fd)
        self._fh = io.BufferedWriter(self._inner, buffer_size=1 << 20)
        self._seq = 0
        self._closed = False
        line = encode(header) + b"\n"
        self._fh.write(line)
        self.bytes_written = len(line)   # the trace's text so far, before compression

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def write(self, event: Event | dict) -> None:
        # An event as the schema encodes it (numpy integers as integers); a dict
        # of a record's fields as it is.
        line = encode(event) + b"\n"
        self._fh.write(line)
        self.bytes_written += len(line)

    def _write_obj(self, obj: dict) -> None:
        self._fh.write(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))

    def end_step(self) -> None:
        """An engine step is complete. A writer that hands each one on out of
        the engine's process (``kvtrace.record.step_writer``) does so here;
        this one writes through its buffer when it fills."""

    def flush(self) -> None:
        """Everything written so far reaches the file, compressed stream included,
        so that a process killed afterwards leaves a trace readable up to here."""
        self._fh.flush()
        self._inner.flush()     # gzip: a sync flush; zstd: the end of a block; plain: the OS

    def close(self, status: str = "complete", error: str | None = None, dropped_events: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.write(End(seq=self.next_seq(), status=status, error=error, dropped_events=dropped_events))
        finally:
            self._close_files()

    def finish(self, end: End | None) -> None:
        """Close the file ending with ``end`` as given (its own seq and status), or
        with no end record at all when ``end`` is None: a copy of a trace that was
        cut off stays cut off."""
        if self._closed:
            return
        self._closed = True
        try:
            if end is not None:
                self.write(end)
        finally:
            self._close_files()

    def _close_files(self) -> None:
        try:
            self._fh.close()
        finally:
            self._raw.close()   # gzip leaves the file under it open

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.close(status="interrupted", error=interrupted_by(exc))
