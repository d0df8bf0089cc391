"""Reading and writing trace files: JSON Lines, plain, gzip or zstd.

The reader streams: it holds one line at a time. A malformed record raises
``TraceError`` naming the file and line. A last line that was cut off (an engine
killed mid-write, a truncated compressed stream) is not an error: iteration stops
before it and ``TraceReader.truncation`` says where.
"""

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
from typing import IO, Any, Callable, Iterator

import msgspec
import orjson

from .events import LINE_DECODER, End, Event, Header, SchemaError, decode_header, decode_line, encode
from .validate import Validator

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
_CHUNK = 1 << 20
_CUT = object()   # what _decode returns for a line cut off mid-record


class TraceError(Exception):
    """Unusable input. ``str()`` is the one-line message the CLI prints (exit code 2)."""

    exit_code = 2

    def __init__(self, path: str | os.PathLike, line: int | None, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


def _env_bytes(name: str, default: int) -> int:
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


def _open_binary_read(path: Path) -> IO[bytes]:
    return _decompressing(open(path, "rb"))


def _is_zstd(magic: bytes) -> bool:
    """A zstd frame, or a skippable frame (magic 0x184D2A50 to 0x184D2A5F,
    little-endian), which zstd tools put before data and read past."""
    return magic == ZSTD_MAGIC or (len(magic) == 4 and magic[1:] == b"\x2a\x4d\x18"
                                   and 0x50 <= magic[0] <= 0x5F)


def _decompressing(raw: IO[bytes]) -> IO[bytes]:
    """The trace's bytes, through gzip or zstd when the file starts with its magic."""
    magic = raw.read(4)
    if raw.seekable():
        raw.seek(0)
    else:   # a pipe cannot seek back: give the magic back
        raw = io.BufferedReader(_Prefixed(magic, raw), _CHUNK)
    if magic[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if _is_zstd(magic):
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
    would wait for a writer). False when it cannot be looked at: the reader then
    names the problem."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _open_read(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    return fd


def _is_stream_damage(e: Exception) -> bool:
    """A truncated or corrupt compressed stream (as opposed to a bug)."""
    return isinstance(e, (EOFError, OSError, zlib.error)) or type(e).__name__ == "ZstdError"


class TraceReader:
    """Iterate a trace's events after its header.

    >>> r = TraceReader("run.jsonl.gz")
    >>> r.header.config.block_size
    >>> for ev in r: ...
    >>> r.truncation   # None, or "line 812 is cut off" etc.

    ``validate`` (on by default) also checks each record against the header and
    the records before it (validate.py): block ids in the pool, request ids that
    arrived, step order. Turn it off only to read a file for repair.
    """

    def __init__(self, path: str | os.PathLike, validate: bool = True,
                 shared: tuple[int, int] | None = None):
        """``shared``: read the file through these descriptors, from another
        process's reader (its ``share()``), instead of opening ``path``, which
        then only names the file in messages. The reader closes them."""
        self.path = Path(path)
        self.truncation: str | None = None
        self.end: End | None = None
        self.last_line = 0
        self.max_line_bytes = _env_bytes(ENV_MAX_LINE_BYTES, MAX_LINE_BYTES)
        self.max_total_bytes = _env_bytes(ENV_MAX_BYTES, MAX_TOTAL_BYTES)
        self.bytes_read = 0
        self._grown = False   # the file grew past where this reader found its end
        try:
            if shared is None:
                self._file = SharedFile(_open_read(self.path))
            else:
                self._file = SharedFile(shared[0], SharedEnd(shared[1]))
        except OSError as e:
            raise TraceError(self.path, None, f"cannot open: {e.strerror or e}") from None
        self._raw = io.BufferedReader(self._file, _CHUNK)
        try:
            self.header: Header = self._read_header()
        except BaseException:
            self.close()
            raise
        self._validator = Validator(self.header) if validate else None

    @property
    def shareable(self) -> bool:
        """Whether ``share`` can give another reader the same bytes: a regular
        file, not a pipe or anything else that only one reader can read."""
        return self._file.seekable()

    def share(self) -> tuple[int, int]:
        """Descriptors for a reader in another process (``shared``) that is to read
        the very bytes this one reads: the same open file, and the same end
        should something still be appending to it (``SharedEnd``). Only for a
        regular file (``shareable``)."""
        if not self.shareable:
            raise ValueError(f"{self.path} is not a regular file: only one reader can read it")
        if self._file.end is None:
            self._file.end = SharedEnd()
        return self._file.fd, self._file.end.fd

    def _read_header(self) -> Header:
        try:
            fh = _decompressing(self._raw)
        except OSError as e:
            raise TraceError(self.path, None, f"cannot open: {e.strerror or e}") from None
        self._fh = fh
        self._read = getattr(fh, "read1", fh.read)
        first = self._next_raw()
        if first is None:
            if self.truncation:
                raise TraceError(self.path, 1, f"the header record is cut off: {self.truncation}")
            if self.bytes_read == 0 and not isinstance(self._fh, io.BufferedReader):
                raise TraceError(self.path, 1, "the compressed stream holds no data: no header "
                                               "record (cut off before the first record?)")
            raise TraceError(self.path, 1, "empty file: no header record")
        lineno, raw, complete = first
        self.last_line = lineno
        if not complete and (b"\x00" in raw or not _mostly_text(raw)):
            raise TraceError(self.path, lineno, "binary data, not a JSON record")
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            if not complete:
                self.truncation = f"line {lineno} is cut off mid-record"
                raise TraceError(self.path, 1, "the header record is cut off") from None
            if b"\x00" in raw or not _mostly_text(raw):
                raise TraceError(self.path, lineno, "binary data, not a JSON record") from None
            raise TraceError(self.path, lineno, f"not JSON ({_short(e)})") from None
        try:
            return decode_header(obj)
        except SchemaError as e:
            raise TraceError(self.path, lineno, str(e)) from None

    # -- raw lines -------------------------------------------------------------

    def _lines(self) -> Iterator[tuple[int, bytes, bool]]:
        """(line number, bytes, ends with a newline) for every non-blank line.
        Reads in chunks, so a line without an end costs at most the line limit."""
        lineno = 0
        pieces: list[bytes] = []   # the current, unfinished line
        plen = 0
        max_line, max_total = self.max_line_bytes, self.max_total_bytes
        while True:
            try:
                chunk = self._read(_CHUNK)
            except Exception as e:
                if not _is_stream_damage(e):
                    raise
                # Truncated or corrupt compressed stream: whatever came before stands.
                what = "ends early" if isinstance(e, EOFError) else "is damaged"
                self.truncation = f"compressed stream {what} after line {lineno} ({_reason(e)})"
                return
            if not chunk:
                break
            self.bytes_read += len(chunk)
            if self.bytes_read > max_total:
                raise TraceError(self.path, lineno + 1,
                                 f"more than {max_total} bytes of trace data; refusing to read on "
                                 f"(a decompression bomb? set {ENV_MAX_BYTES} to allow more)")
            if not pieces and chunk.isspace():   # a run of blank lines
                lineno += chunk.count(b"\n")
                continue
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                if nl < 0:
                    if start < len(chunk):
                        rest = chunk[start:]
                        pieces.append(rest)
                        plen += len(rest)
                        if plen > max_line:
                            raise TraceError(self.path, lineno + 1, _too_long(max_line))
                    break
                part = chunk[start:nl + 1]
                start = nl + 1
                lineno += 1
                if pieces:
                    if plen + len(part) > max_line:
                        raise TraceError(self.path, lineno, _too_long(max_line))
                    pieces.append(part)
                    raw = b"".join(pieces)
                    pieces, plen = [], 0
                else:
                    if len(part) > max_line:
                        raise TraceError(self.path, lineno, _too_long(max_line))
                    raw = part
                if raw.isspace():
                    continue
                yield lineno, raw, True
        if pieces:
            raw = b"".join(pieces)
            if not raw.isspace():
                yield lineno + 1, raw, False

    def _next_raw(self):
        if not hasattr(self, "_raw_iter"):
            self._raw_iter = self._lines()
        return next(self._raw_iter, None)

    def _decode(self, lineno: int, raw: bytes, complete: bool):
        """The line's event, its own checks passed, or ``_CUT`` for a last line
        cut off mid-record."""
        try:
            return decode_line(raw)
        except SchemaError as e:
            raise TraceError(self.path, lineno, str(e)) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            if not complete:
                self.truncation = f"line {lineno} is cut off mid-record"
                return _CUT
            if b"\x00" in raw or not _mostly_text(raw):
                raise TraceError(self.path, lineno, "binary data, not a JSON record") from None
            try:   # orjson names the place of a syntax error
                orjson.loads(raw)
            except orjson.JSONDecodeError as je:
                raise TraceError(self.path, lineno, f"not JSON ({_short(je)})") from None
            raise TraceError(self.path, lineno, f"not JSON ({_short(e)})") from None

    # -- events ----------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        return self._events(self._validator)

    def validated_elsewhere(self, gate) -> Iterator[Event]:
        """The events of a file that another reader of it checks as well, from
        its first record, through ``shares_checks``. Here every record gets
        every check until the other reader has caught up, at the first record
        whose line ``gate.caught_up`` says it has checked. From there on, the
        checks across records (validate.py) are left to it, and each record
        waits for ``gate`` as in ``checked_elsewhere``; each record still gets
        its own checks as it is decoded. Same events, same cut, same errors as
        iteration, as long as the other reader reads the same bytes (replay's
        content worker)."""
        return self._events(self._validator, gate)

    def shares_checks(self) -> Iterator[Event]:
        """The other reader's side of ``validated_elsewhere``: iteration, every
        check included, so a record's first problem raises the TraceError
        iteration would raise."""
        return self._events(self._validator)

    def _events(self, validator: Validator | None, gate=None) -> Iterator[Event]:
        """Each record decoded with its own checks, then the checks of order and,
        with ``validator``, those across records. With ``gate``, see
        ``validated_elsewhere``."""
        last_seq = -1
        check = validator.check if validator is not None else None
        fast = LINE_DECODER.decode
        if not hasattr(self, "_raw_iter"):
            self._raw_iter = self._lines()
        for lineno, raw, complete in self._raw_iter:
            self.last_line = lineno
            try:
                ev = fast(raw)
            except Exception:   # named, or found cut off, the slow way
                ev = self._decode(lineno, raw, complete)
                if ev is _CUT:
                    break
            if ev.seq <= last_seq:
                raise TraceError(self.path, lineno,
                                 f"sequence number {ev.seq} does not follow {last_seq}")
            last_seq = ev.seq
            if self.end is not None:
                raise TraceError(self.path, lineno, "record after the 'end' record")
            if check is not None:
                if gate is not None and gate.caught_up(lineno):
                    check = None   # the other reader checks from here on
                else:
                    try:
                        check(ev)
                    except SchemaError as e:
                        raise TraceError(self.path, lineno, str(e)) from None
            if check is None and gate is not None and lineno > gate.through:
                gate.wait(lineno)
            if type(ev) is End:
                self.end = ev
            yield ev
        self._end_of_records()
        self._note_no_end()

    def checked_elsewhere(self, gate) -> Iterator[Event]:
        """The events of a file whose records another reader of it checks across
        records: each record is decoded, with its own checks, once ``gate`` says
        that the other reader has passed its line: ``gate.through`` is the last
        line it has checked, and ``gate.wait(line)`` returns when it has checked
        ``line``, or raises its TraceError for that line or one before it. Same
        events, same cut, same errors as iteration, as long as the other reader
        reads the same bytes (replay's record worker, through ``share()``)."""
        for lineno, raw, complete in self._raw_records():
            # Decoded first: its own checks are the other reader's, which has
            # passed every line before this one (a cut last line it never passes).
            ev = self._decode(lineno, raw, complete)
            if ev is _CUT:
                break
            if lineno > gate.through:
                gate.wait(lineno)
            if type(ev) is End:
                self.end = ev
            yield ev
        self._end_of_records()
        self._note_no_end()

    def _note_no_end(self) -> None:
        if self.end is None and self.truncation is None:
            self.truncation = f"no 'end' record after line {self.last_line}: the recording was cut off"
        if self.truncation is not None and self._grown:
            self.truncation += "; the file has grown since (is it still being written?)"

    def records(self) -> Iterator[tuple[int, Event]]:
        """(line number, event) for each record after the header, with its own
        checks (types, ranges, allowed values) and none across records, which
        iteration adds. On its own, for a second reader of a file whose records
        another reader checks across records (the replay's content worker).
        Stops where the file is cut off, and closes it."""
        for lineno, raw, complete in self._raw_records():
            ev = self._decode(lineno, raw, complete)
            if ev is _CUT:
                break
            yield lineno, ev
        self._end_of_records()

    def _raw_records(self) -> Iterator[tuple[int, bytes, bool]]:
        """(line number, bytes, whether the line ended) of each line after the header."""
        while True:
            item = self._next_raw()
            if item is None:
                return
            self.last_line = item[0]
            yield item

    def _end_of_records(self) -> None:
        self._grown = self._file.grown()
        self.close()

    def close(self) -> None:
        # A GzipFile leaves the file under it open: close both.
        for f in (getattr(self, "_fh", None), getattr(self, "_raw", None)):
            if f is not None:
                try:
                    f.close()
                except Exception:
                    pass

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _mostly_text(raw: bytes) -> bool:
    sample = raw[:256]
    return sum(32 <= b < 127 or b in (9, 10, 13) for b in sample) >= 0.9 * len(sample)


def _too_long(limit: int) -> str:
    return (f"record longer than {limit} bytes without a line break "
            f"(set {ENV_MAX_LINE_BYTES} to allow longer records)")


def _short(e: Exception) -> str:
    return str(e).split("\n")[0][:120]


def _reason(e: Exception) -> str:
    return _short(e) or type(e).__name__


# --------------------------------------------------------------------------- writing


def open_trace_file(path: str | os.PathLike) -> int:
    """A descriptor for writing the trace ``path``, created or emptied. Traces
    hold users' prompts: readable by their owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if stat.S_ISREG(os.fstat(fd).st_mode):   # never a device's or a pipe's mode
        os.fchmod(fd, 0o600)   # also when writing over an existing file
    return fd


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
        self._fh.write(encode(header) + b"\n")

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def write(self, event: Event | dict) -> None:
        # An event as the schema encodes it (numpy integers as integers); a dict
        # of a record's fields as it is.
        self._fh.write(encode(event) + b"\n")

    def _write_obj(self, obj: dict) -> None:
        self._fh.write(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))

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
            self.close(status="interrupted", error=f"{type(exc).__name__}: {exc}")
