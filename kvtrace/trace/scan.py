"""Where a trace's keyframes are, found without decoding a record: one pass
over the decompressed text that counts line breaks and finds the lines that
start as kvtrace's writer starts a keyframe record. A replay split at
keyframes cuts the trace at some of them (replay/split.py); the reader that
starts there decodes the line and says whether it is one.

A keyframe written otherwise (its ``kind`` not first) is not found: the
trace is then cut at fewer places, never at a wrong one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .files import (ENV_MAX_BYTES, GZIP_MAGIC, MAX_TOTAL_BYTES, READ_CHUNK, decompressing,
                    env_bytes, is_stream_damage, is_zstd)

# A keyframe's line as the writer starts it, with the line break before it.
KEYFRAME_START = b'\n{"kind":"keyframe",'


@dataclass
class KeyframeLines:
    lines: list[int] = field(default_factory=list)     # each keyframe's line, in order
    offsets: list[int] = field(default_factory=list)   # where each starts in the text
    size: int = 0         # bytes of text read (decompressed)
    whole: bool = True    # read to the end (False: a damaged stream, or the byte limit)
    compression: str = "plain"   # "gzip", "zstd" or "plain"


def keyframe_lines(path: str | os.PathLike) -> KeyframeLines:
    """The lines of the keyframes of the trace file ``path`` (a regular file:
    plain, gzip or zstd), each ended by a line break. Reads up to a damaged
    stream or the byte limit (``KVTRACE_MAX_BYTES``), whichever comes first."""
    found = KeyframeLines()
    limit = env_bytes(ENV_MAX_BYTES, MAX_TOTAL_BYTES)
    mark, keep = KEYFRAME_START, len(KEYFRAME_START) - 1
    newlines, tail = 0, b""   # line breaks before the chunk; the last bytes before it
    with open(path, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        found.compression = ("gzip" if magic[:2] == GZIP_MAGIC else
                             "zstd" if is_zstd(magic) else "plain")
        fh = decompressing(raw)
        read = getattr(fh, "read1", fh.read)
        try:
            while found.size <= limit:
                try:
                    chunk = read(READ_CHUNK)
                except Exception as e:
                    if not is_stream_damage(e):
                        raise
                    found.whole = False
                    break
                if not chunk:
                    break
                _find(found, tail + chunk, len(tail), newlines)
                newlines += chunk.count(b"\n")
                found.size += len(chunk)
                tail = (tail + chunk)[-keep:]
            else:
                found.whole = False
        finally:
            fh.close()
    while found.lines and found.lines[-1] > newlines:   # cut off: no line break ends it
        found.lines.pop()
        found.offsets.pop()
    return found


def _find(found: KeyframeLines, buf: bytes, t: int, newlines: int) -> None:
    """The keyframes whose line starts in ``buf``: the last ``t`` bytes before a
    chunk (their line breaks among the ``newlines`` before it), then the chunk."""
    at = buf.find(KEYFRAME_START)
    counted, seen = t, newlines
    while at >= 0:
        if at >= t:   # the line break is the chunk's
            seen += buf.count(b"\n", counted, at + 1)
            counted = at + 1
        # else: it is the last one before the chunk, counted in ``newlines``
        found.lines.append(seen + 1)
        found.offsets.append(found.size + at - t + 1)
        at = buf.find(KEYFRAME_START, at + 1)
