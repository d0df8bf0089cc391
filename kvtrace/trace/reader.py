"""``TraceReader``: a trace's header, then its events, one line at a time.

The reader streams: it holds one line at a time. A malformed record raises
``TraceError`` naming the file and line. A last line that was cut off (an engine
killed mid-write, a truncated compressed stream) is not an error: iteration stops
before it and ``TraceReader.truncation`` says where.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterator

import msgspec
import orjson

from .events import (LINE_DECODER, TOO_DEEP, End, Event, Header, Keyframe, SchemaError,
                     decode_header, decode_line)
from .files import (ENV_MAX_BYTES, ENV_MAX_LINE_BYTES, MAX_LINE_BYTES, MAX_TOTAL_BYTES, READ_CHUNK,
                    SharedEnd, SharedFile, TraceError, decompressing, env_bytes, foreign_json,
                    is_stream_damage, open_read)
from .limits import HEADER_BYTES, SMALL, LineLimits
from .validate import Validator

_CUT = object()   # what _decode returns for a line cut off mid-record
# Called as ``watch(reader)`` after each chunk any reader reads, and at the end
# of its file: ``reader.position`` of ``reader.size`` bytes (progress bars).
read_watchers: list = []


class TraceReader:
    """Iterate a trace's events after its header.

    >>> r = TraceReader("run.jsonl.gz")
    >>> r.header.config.block_size
    >>> for ev in r: ...
    >>> r.truncation   # None, or "line 812 is cut off" etc.

    ``checked_elsewhere(gate)`` gives the same events with the checks across
    records left to a reader in another process.

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
        cap = env_bytes(ENV_MAX_LINE_BYTES, MAX_LINE_BYTES)
        explicit = bool(os.environ.get(ENV_MAX_LINE_BYTES, "").strip())
        # The header's line, then any record's, as its header allows (limits.py).
        self.max_line_bytes = cap if explicit else min(cap, HEADER_BYTES)
        self._limits: LineLimits | None = None
        self.max_total_bytes = env_bytes(ENV_MAX_BYTES, MAX_TOTAL_BYTES)
        self.bytes_read = 0
        self._grown = False   # the file grew past where this reader found its end
        self._written = False   # a writer held the file when this reader found its end
        self._skip_to: int | None = None   # the line iteration starts at (skip_to)
        try:
            if shared is None:
                self._file = SharedFile(open_read(self.path))
            else:
                self._file = SharedFile(shared[0], SharedEnd(shared[1]))
        except OSError as e:
            raise TraceError(self.path, None, f"cannot open: {e.strerror or e}") from None
        self._raw = io.BufferedReader(self._file, READ_CHUNK)
        # The file's size in bytes as stored (compressed), None for a pipe.
        self.size: int | None = os.fstat(self._file.fd).st_size if self._file.seekable() else None
        try:
            self.header: Header = self._read_header()
        except BaseException:
            self.close()
            raise
        self._limits = LineLimits(self.header, cap, explicit)
        self.max_line_bytes = self._limits.general
        self._validator = Validator(self.header) if validate else None

    @property
    def position(self) -> int:
        """Bytes of the file as stored (compressed) read so far, read-ahead included."""
        return self._file.pos

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

    def skip_to(self, line: int) -> None:
        """Start iteration at ``line``: the lines between the header and it are
        passed over unread, neither decoded nor checked (another reader of the
        same file checks them: a replay split at keyframes). Line numbers, the
        byte limit and a cut are counted as in a reading of every line. Call it
        before iterating."""
        self._skip_to = line

    def _read_header(self) -> Header:
        try:
            fh = decompressing(self._raw)
        except OSError as e:
            raise TraceError(self.path, None, f"cannot open: {e.strerror or e}") from None
        self._fh = fh
        self._read = getattr(fh, "read1", fh.read)
        self._raw_iter = self._lines()
        first = next(self._raw_iter, None)
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
            if str(e).startswith("depth limit exceeded"):
                raise TraceError(self.path, lineno, TOO_DEEP) from None
            if not complete:
                self.truncation = f"line {lineno} is cut off mid-record"
                raise TraceError(self.path, 1, "the header record is cut off") from None
            if b"\x00" in raw or not _mostly_text(raw):
                raise TraceError(self.path, lineno, "binary data, not a JSON record") from None
            raise (foreign_json(self.path, lineno, raw)
                   or TraceError(self.path, lineno, f"not JSON ({_short(e)})")) from None
        try:
            return decode_header(obj)
        except SchemaError as e:
            raise (foreign_json(self.path, lineno, raw, obj)
                   or TraceError(self.path, lineno, str(e))) from None
        except RecursionError:
            raise TraceError(self.path, lineno, TOO_DEEP) from None

    # -- raw lines -------------------------------------------------------------

    def _lines(self) -> Iterator[tuple[int, bytes, bool]]:
        """(line number, bytes, ends with a newline) for every non-blank line.
        Reads in chunks, so a line without an end costs at most the line limit."""
        lineno = 0
        pieces: list[bytes] = []   # the current, unfinished line
        plen = 0
        kind = None   # the unfinished line's kind, once it is long and says it first
        max_total = self.max_total_bytes
        while True:
            max_line = self.max_line_bytes   # the header's limit, then the records'
            try:
                chunk = self._read(READ_CHUNK)
            except Exception as e:
                if not is_stream_damage(e):
                    raise
                # Truncated or corrupt compressed stream: whatever came before stands.
                what = "ends early" if isinstance(e, EOFError) else "is damaged"
                self.truncation = f"compressed stream {what} after line {lineno} ({_reason(e)})"
                return
            for watch in read_watchers:
                watch(self)
            if not chunk:
                break
            self.bytes_read += len(chunk)
            if self.bytes_read > max_total:
                raise TraceError(self.path, lineno + 1,
                                 f"more than {max_total} bytes of trace data; refusing to read on "
                                 f"(a decompression bomb? set {ENV_MAX_BYTES} to allow more)")
            start = 0
            if self._skip_to is not None:   # lines passed over (skip_to)
                start, lineno = self._pass_over(chunk, start, lineno)
                if start < 0:
                    continue
            if not start and not pieces and chunk.isspace():   # a run of blank lines
                lineno += chunk.count(b"\n")
                continue
            while True:
                nl = chunk.find(b"\n", start)
                if nl < 0:
                    if start < len(chunk):
                        rest = chunk[start:]
                        pieces.append(rest)
                        plen += len(rest)
                        if plen > SMALL and self._limits is not None:
                            if kind is None:
                                kind = self._limits.leading_kind(pieces[0])
                            problem = self._limits.too_long(kind, plen)
                            if problem is not None:
                                raise TraceError(self.path, lineno + 1, problem)
                        if plen > self._longest(kind, max_line):
                            raise TraceError(self.path, lineno + 1, self._too_long(max_line))
                    break
                part = chunk[start:nl + 1]
                start = nl + 1
                lineno += 1
                if pieces:
                    if plen + len(part) > self._longest(kind, max_line):
                        raise TraceError(self.path, lineno, self._too_long(max_line))
                    pieces.append(part)
                    raw = b"".join(pieces)
                    pieces, plen, kind = [], 0, None
                else:
                    # (No record may pass max_line but a keyframe that says it is one.)
                    if len(part) > max_line and len(part) > self._longest(
                            self._limits and self._limits.leading_kind(part), max_line):
                        raise TraceError(self.path, lineno, self._too_long(max_line))
                    raw = part
                if raw.isspace():
                    continue
                yield lineno, raw, True
                if self._skip_to is not None:
                    start, lineno = self._pass_over(chunk, start, lineno)
                    if start < 0:
                        break
        if pieces:
            raw = b"".join(pieces)
            if not raw.isspace():
                yield lineno + 1, raw, False

    def _longest(self, kind: str | None, max_line: int) -> int:
        """How long a line being read may grow: ``max_line``, the limit of any
        record, but for a keyframe that says its kind first (every live
        request's tokens, which no header bounds): its own limit."""
        if kind == "keyframe" and self._limits is not None:
            return max(max_line, self._limits.by_kind["keyframe"])
        return max_line

    def _pass_over(self, chunk: bytes, start: int, lineno: int) -> tuple[int, int]:
        """``skip_to`` in ``chunk`` from ``start``, after line ``lineno``: (where
        the line asked for starts in it, or -1 when that lies past it; the
        last line passed)."""
        need = self._skip_to - 1 - lineno   # line breaks to pass
        if need > 0:
            n = chunk.count(b"\n", start)
            if n < need:
                return -1, lineno + n
            for _ in range(need):
                start = chunk.find(b"\n", start) + 1
            lineno += need
        self._skip_to = None
        return start, lineno

    def _too_long(self, limit: int) -> str:
        held = self._limits
        why = (f", more than any record of this trace's header can hold ({held.why})"
               if held is not None and limit < held.cap else "")
        return (f"record longer than {limit} bytes without a line break{why} "
                f"(set {ENV_MAX_LINE_BYTES} to allow longer records)")

    def _sized(self, lineno: int, raw: bytes) -> None:
        """Refuse a line longer than its kind may be, before decoding it."""
        problem = self._limits.check(raw) if self._limits is not None else None
        if problem is not None:
            raise TraceError(self.path, lineno, problem)

    def _decode(self, lineno: int, raw: bytes, complete: bool):
        """The line's event, its own checks passed, or ``_CUT`` for a last line
        cut off mid-record."""
        if len(raw) > SMALL:
            self._sized(lineno, raw)
        try:
            return decode_line(raw)
        except SchemaError as e:
            raise TraceError(self.path, lineno, str(e)) from None
        except RecursionError:   # msgspec's own limit, past MAX_DEPTH
            raise TraceError(self.path, lineno, TOO_DEEP) from None
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
    # Two ways to read the events: iteration, every check here, and
    # ``checked_elsewhere``, the checks across records left to another reader.
    # Both run one loop: it stops at the file's end or a cut last line, and
    # then says why in ``truncation`` the same way.

    def __iter__(self) -> Iterator[Event]:
        """Each event after the header: each record decoded with its own checks,
        then the checks of order and (with ``validate``) those across records.
        Stops before a last line cut off mid-record; then ``truncation`` says
        why the events stopped, if they stopped before an 'end' record."""
        return self._events(None)

    def checked_elsewhere(self, gate) -> Iterator[Event]:
        """The events of iteration, with the checks across records (validate.py)
        left to another reader of the same bytes (``share()``) from the first
        record at whose line ``gate.takes_over(line)`` says so; before that,
        every record gets every check here. From there on, each record is
        decoded with its own checks and the checks of order, and then waits
        until ``gate`` has passed its line: ``gate.through`` is the last line it
        has checked, and ``gate.wait(line)`` returns once it has checked
        ``line``, or raises its TraceError for that line or one before it. Same
        events, same cut, same errors as iteration, as long as the other reader
        reads the same bytes (replay's record worker and content worker)."""
        return self._events(gate)

    def _events(self, gate) -> Iterator[Event]:
        last_seq = -1
        check = self._validator.check if self._validator is not None else None
        fast = LINE_DECODER.decode
        for lineno, raw, complete in self._raw_iter:
            self.last_line = lineno
            if len(raw) > SMALL:
                self._sized(lineno, raw)
            try:
                ev = fast(raw)
            except Exception:   # named, or found cut off, the slow way
                ev = self._decode(lineno, raw, complete)
                if ev is _CUT:   # a cut last line: the other reader never passes it
                    break
            if ev.seq <= last_seq:
                raise TraceError(self.path, lineno,
                                 f"sequence number {ev.seq} does not follow {last_seq}")
            # A keyframe shares the sequence number of the step record after it.
            last_seq = ev.seq - 1 if type(ev) is Keyframe else ev.seq
            if self.end is not None:
                raise TraceError(self.path, lineno, "record after the 'end' record")
            if check is not None:
                if gate is not None and gate.takes_over(lineno):
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

    def _end_of_records(self) -> None:
        """Close the file, and say in ``truncation`` why the events stopped
        where they stopped before an 'end' record."""
        self._grown = self._file.grown()
        self._written = self._file.being_written()
        self.close()
        if self.end is None and self.truncation is None:
            self.truncation = f"no 'end' record after line {self.last_line}: the recording was cut off"
        if self.truncation is not None and self._written:
            self.truncation += "; a recorder is still writing the file"
        elif self.truncation is not None and self._grown:
            self.truncation += "; the file has grown since (is it still being written?)"

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




def _short(e: Exception) -> str:
    return str(e).split("\n")[0][:120]


def _reason(e: Exception) -> str:
    return _short(e) or type(e).__name__
