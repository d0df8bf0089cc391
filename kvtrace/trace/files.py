"""Opening trace files for reading: plain, gzip or zstd (by their magic
bytes), the limits on what a reader takes, and file handles that two readers
(the main process and a worker) share, each with its own position."""

from __future__ import annotations

import errno
import fcntl
import gzip
import io
import os
import stat
import tempfile
import zlib
from pathlib import Path
from typing import IO

import orjson

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A single record larger than this is corrupt; stops a bad file from eating memory.
MAX_LINE_BYTES = 256 << 20
# The most bytes (after decompression) a reader takes from one file. A bound on
# what a decompression bomb can cost in time; memory is bounded by the line limit.
MAX_TOTAL_BYTES = 64 << 30
# Both can be changed through the environment, for unusual traces or for tests.
ENV_MAX_LINE_BYTES = "KVTRACE_MAX_LINE_BYTES"
ENV_MAX_BYTES = "KVTRACE_MAX_BYTES"
READ_CHUNK = 1 << 20
# The name that stands for standard input, as a trace to read.
STDIN = "-"
STDIN_NAME = "standard input"


def is_stdin(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is ``-``, standard input."""
    return path is not None and os.fspath(path) == STDIN


def shown(path: str | os.PathLike) -> str:
    """A trace's name in messages: ``standard input`` for ``-``."""
    return STDIN_NAME if is_stdin(path) else str(path)


def split_trace_name(name: str) -> tuple[str, str]:
    """A trace file's name as (stem, ending): ``run.jsonl.gz`` -> ``("run", ".jsonl.gz")``.
    Further schedulers' traces are named ``stem + tag + ending``."""
    for ext in (".jsonl.gz", ".jsonl.zst", ".jsonl", ".gz", ".zst"):
        if name.endswith(ext):
            return name[: -len(ext)], ext
    return name, ""


class TraceError(Exception):
    """Unusable input. ``str()`` is the one-line message the CLI prints (exit code 2)."""

    exit_code = 2

    def __init__(self, path: str | os.PathLike, line: int | None, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        name = shown(path)
        where = f"{name}:{line}" if line is not None else name
        super().__init__(f"{where}: {problem}")


def foreign_json(path: str | os.PathLike, line: int, raw: bytes,
                 obj: object = None) -> TraceError | None:
    """The error for a first record that is JSON of another kind, or None: a
    Perfetto (Chrome trace-event) file, such as ``kvtrace export`` writes, or
    a JSON document spread over several lines (``json.dump(obj, f,
    indent=2)``). ``raw`` is the first line; ``obj`` what it parsed to, when
    it did."""
    head = raw.lstrip()[:1]
    if (isinstance(obj, dict) and "traceEvents" in obj) or b'"traceEvents"' in raw or (
            head == b"[" and b'"ph"' in raw) or (
            isinstance(obj, list) and obj and isinstance(obj[0], dict) and "ph" in obj[0]):
        return TraceError(path, None, "a Perfetto (Chrome trace-event) file, not a kvtrace trace")
    if obj is None and head in (b"{", b"["):
        try:
            orjson.loads(raw)
        except ValueError as e:
            if str(e).startswith("unexpected end of data"):   # the value goes on past the line
                return TraceError(path, line, "a JSON document spread over several lines; a "
                                              "kvtrace trace has one JSON record per line")
    return None


def env_bytes(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise TraceError(name, None, f"must be a number of bytes, got {v!r}") from None
    if n <= 0:
        raise TraceError(name, None, f"must be positive, got {n}")
    return n


def open_binary_read(path: Path) -> IO[bytes]:
    return decompressing(open(path, "rb"))


def is_zstd(magic: bytes) -> bool:
    """A zstd frame, or a skippable frame (magic 0x184D2A50 to 0x184D2A5F,
    little-endian), which zstd tools put before data and read past."""
    return magic == ZSTD_MAGIC or (len(magic) == 4 and magic[1:] == b"\x2a\x4d\x18"
                                   and 0x50 <= magic[0] <= 0x5F)


def decompressing(raw: IO[bytes]) -> IO[bytes]:
    """The trace's bytes, through gzip or zstd when the file starts with its magic."""
    magic = raw.read(4)
    if raw.seekable():
        raw.seek(0)
    else:   # a pipe cannot seek back: give the magic back
        raw = io.BufferedReader(_Prefixed(magic, raw), READ_CHUNK)
    if magic[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if is_zstd(magic):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    return raw


class SharedFile(io.RawIOBase):
    """A descriptor of a file read at this reader's own offset (``os.pread``), so
    that no other reader of the same open file moves its place. Replay's workers
    read the trace through the descriptor of the main process's reader: the very
    file it reads, even if the name has since been renamed, replaced or removed.
    With ``end``, reads stop where the first of those readers met the file's end
    (``SharedEnd``). A descriptor that cannot be read at an offset (a pipe) is
    read in order."""

    def __init__(self, fd: int, end: "SharedEnd | None" = None):
        self.fd, self.pos, self.end = fd, 0, end
        self._at_offset = stat.S_ISREG(os.fstat(fd).st_mode)
        self.ended_at: int | None = None   # where a read first found nothing more

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._at_offset

    def readinto(self, b) -> int:
        if self.closed:
            raise ValueError("read of a closed file")
        if not self._at_offset:
            n = os.readv(self.fd, [b])
        elif self.end is not None:
            n = self.end.readinto(self.fd, b, self.pos)
        else:
            n = os.preadv(self.fd, [b], self.pos)
        if n == 0 and len(b) and self.ended_at is None:
            self.ended_at = self.pos
        self.pos += n
        return n

    def grown(self) -> bool:
        """Whether the file has grown past where this reader found its end (or
        the end its readers agreed on): a trace still being written."""
        return (self._at_offset and self.ended_at is not None and not self.closed
                and os.fstat(self.fd).st_size > self.ended_at)

    def being_written(self) -> bool:
        """Whether a writer holds the file, as kvtrace's writers hold a trace
        until it is whole (an exclusive ``flock``, writer.open_trace_file)."""
        if not self._at_offset or self.closed:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:   # a file system without locks
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self._at_offset:
            raise io.UnsupportedOperation("seek")
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self.pos + offset
        elif whence == io.SEEK_END:
            size = os.fstat(self.fd).st_size
            if self.end is not None and self.end.at is not None:
                size = min(size, self.end.at)
            pos = size + offset
        else:
            raise ValueError(f"invalid whence ({whence})")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            try:
                os.close(self.fd)
            finally:
                if self.end is not None:
                    self.end.close()
                super().close()


class _Prefixed(io.RawIOBase):
    """``head``, then the rest of ``rest``: a stream whose first bytes were read
    already (from a pipe, which cannot seek back)."""

    def __init__(self, head: bytes, rest: IO[bytes]):
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        # readinto1: what the pipe has now (readinto would wait for len(b) bytes,
        # and a trace read as it is written would move a megabyte at a time)
        return getattr(self._rest, "readinto1", self._rest.readinto)(b)

    def close(self) -> None:
        if not self.closed:
            try:
                self._rest.close()
            finally:
                super().close()


class SharedEnd:
    """Where the readers of one file in several processes (replay's main process
    and its workers) agree that the file ends, while something may still be
    appending to it (a trace still being recorded). Each reads at its own pace,
    so without this they could meet its end at different places. The first
    reader to meet the end fixes it there for all of them, and later reads by any
    of them stop at that offset: they all read the same bytes, so they all find
    the same records and the same cut.

    The offset lives in a small scratch file that the readers share (``fd``,
    made here when not given). Until the end is known, each read and the look
    at the offset happen under a lock on that file (``fcntl.lockf``), so that
    no reader reads past the end in the moment between another meeting it and
    fixing it. After that, reads need no lock."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd, name = tempfile.mkstemp(prefix="kvtrace-end-")
            os.unlink(name)
        self.fd = fd
        self.at: int | None = None   # the end, once known
        self._locking = True

    def readinto(self, fd: int, b, pos: int) -> int:
        """Read ``fd`` at ``pos`` into ``b``, up to the end."""
        if self.at is None:
            self._lock(fcntl.LOCK_EX)
            try:
                known = os.pread(self.fd, 8, 0)
                if len(known) == 8:
                    self.at = int.from_bytes(known, "little")
                else:
                    n = os.preadv(fd, [b], pos)
                    if n == 0 and len(b):   # this reader met the end first
                        os.pwrite(self.fd, pos.to_bytes(8, "little"), 0)
                        self.at = pos
                    return n
            finally:
                self._lock(fcntl.LOCK_UN)
        room = max(0, min(len(b), self.at - pos))
        return os.preadv(fd, [memoryview(b)[:room]], pos) if room else 0

    def _lock(self, op: int) -> None:
        if self._locking:
            try:
                fcntl.lockf(self.fd, op)
            except OSError:
                # A file system without locks: the readers go on without them,
                # and only the moment between meeting the end and fixing it is
                # left open.
                self._locking = False

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def not_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` names something other than a regular file (a pipe, a
    device), which only one reader can read, without opening it (a named pipe
    would wait for a writer). ``-`` is standard input. False when it cannot be
    looked at: the reader then names the problem."""
    try:
        return not stat.S_ISREG((os.fstat(0) if is_stdin(path) else os.stat(path)).st_mode)
    except OSError:
        return False


def open_read(path: Path) -> int:
    """A descriptor to read ``path`` by; for ``-``, one of standard input."""
    if is_stdin(path):
        return os.dup(0)
    fd = os.open(path, os.O_RDONLY)
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    return fd


def is_stream_damage(e: Exception) -> bool:
    """A truncated or corrupt compressed stream (as opposed to a bug)."""
    return isinstance(e, (EOFError, OSError, zlib.error)) or type(e).__name__ == "ZstdError"
