"""A one-way byte ring in shared memory, from the engine's process to the trace
writer process.

The engine's thread copies each encoded event into the ring and moves the
write position; nothing is sent and nothing waits in the engine's memory. The
pages belong to a memory file that both processes map, so an event is safe
the moment ``offer`` returns: when the engine dies by SIGKILL, ``os._exit`` or a
crash in native code, the writer process still reads it.

Layout: 64 bytes of head, then ``size`` bytes of data. The head holds two
unsigned 64-bit counters, bytes written and bytes read since the start; the
data between them is unread. A third word is the writer process's: the
``errno`` of a write to the trace that failed, 0 until one does. One process writes the first, the other the
second, each as one aligned 8-byte word (a memoryview of format "Q"), stored
after the data it covers. That order holds on x86-64, whose stores are seen in
the order they are made; Python issues no memory barrier, so on a CPU that
reorders stores (Arm) the writer process could read a chunk before its bytes
land, and a line that does not parse ends the trace with recorder-error.
``offer`` writes all of a chunk or none of it, so the writer never sees half an
event. The writer reads whole lines; each chunk offered ends with a newline.
"""

from __future__ import annotations

import mmap
import os
import tempfile

HEAD = 64
_MADV_POPULATE_WRITE = 23   # Linux's value, for Pythons that do not name it
DEFAULT_SIZE = 16 << 20   # bytes: about 10 s of a busy engine's events


def memory_file(size: int) -> int:
    """A file descriptor of ``HEAD + size`` zero bytes that lives in memory only
    (a memfd; an unlinked file in /dev/shm or the temporary directory where
    there is none)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvtrace-ring")
    else:   # pragma: no cover - systems without memfd
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="kvtrace-ring-", dir=shm)
        os.unlink(name)
    try:
        os.ftruncate(fd, HEAD + size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Ring:
    """The ring mapped from ``fd`` (its data ``size`` bytes long)."""

    def __init__(self, fd: int, size: int, populate: bool = False):
        self.size = size
        self._mm = mmap.mmap(fd, HEAD + size)
        if populate:   # the creating side, before anything is written
            self._populate()
        self._pos = memoryview(self._mm)[:24].cast("Q")   # written, read, errno: 8-byte words
        self._data = memoryview(self._mm)[HEAD:]

    def _populate(self) -> None:
        """Take every page of the ring now, rather than a page fault in the
        engine's thread at the first write of each (Linux 5.14's
        MADV_POPULATE_WRITE; else by writing zeros, which only the side that
        creates the ring may do, before its first offer)."""
        try:
            self._mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
            return
        except (OSError, ValueError, AttributeError):
            pass
        zeros = bytes(1 << 20)
        for at in range(HEAD, len(self._mm), len(zeros)):
            end = min(at + len(zeros), len(self._mm))
            self._mm[at:end] = zeros[:end - at]

    @classmethod
    def of_file(cls, fd: int) -> "Ring":
        """The ring in the memory file ``fd`` (the writer process's side)."""
        return cls(fd, os.fstat(fd).st_size - HEAD)

    def offer(self, chunk: bytes, keep: int = 0) -> bool:
        """Write ``chunk`` whole if it fits with ``keep`` bytes still free after
        it; otherwise write nothing and say so. (The writer side: the engine.)"""
        n = len(chunk)
        pos, size = self._pos, self.size
        written = pos[0]
        if n + keep > size - (written - pos[1]):
            return False
        at = written % size
        if at + n <= size:
            self._data[at:at + n] = chunk
        else:
            first = size - at
            self._data[at:] = chunk[:first]
            self._data[:n - first] = chunk[first:]
        pos[0] = written + n
        return True

    def take(self) -> bytes:
        """Every byte written and not read yet. (The reader side: the writer
        process.)"""
        written, read = self._pos[0], self._pos[1]
        n = written - read
        if not n:
            return b""
        at = read % self.size
        if at + n <= self.size:
            chunk = bytes(self._data[at:at + n])
        else:
            chunk = bytes(self._data[at:]) + bytes(self._data[:at + n - self.size])
        self._pos[1] = written
        return chunk

    @property
    def error(self) -> int:
        """The errno of the trace writer's failed write, or 0."""
        return self._pos[2]

    def set_error(self, errno_: int) -> None:
        """(The reader side.) Say that writing the trace failed, once."""
        if not self._pos[2]:
            self._pos[2] = errno_ or 5   # EIO when the error has no number

    def close(self) -> None:
        self._data.release()
        self._pos.release()
        try:
            self._mm.close()
        except BufferError:   # pragma: no cover - a view still held somewhere
            pass
