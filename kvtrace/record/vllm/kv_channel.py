"""How a worker's ``kv_audit`` records reach the engine core's trace.

The engine core's audit opens a ``Channel``: a directory of its own
(``channel.path``, named in every step's plan). A worker in the engine
core's process (one device, the uniproc executor) hands its records
straight to the trace's sink. A worker in a process of its own (tensor
parallelism: one per rank) appends each record, one JSON line written at
once, to ``<path>/rank<R>.jsonl``; the engine core reads what has come
(``collect``) before it records each step's output, and once more before
the trace's end. A worker returns its step's output only after its
``clear_connector_metadata``, so a step's records are in before its
output is recorded.

The directory is on the engine core's machine: a worker on another
machine (multi-node tensor parallelism) cannot reach it, and says so in
its log once; its shard is not audited.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import msgspec

from kvtrace.trace.events import SchemaError, decode_line

logger = logging.getLogger("kvtrace.record")

# Channels opened in this process: path -> (pid, the sink's put).
_LOCAL: dict[str, tuple[int, Callable[[Any], None]]] = {}
_FILES: dict[tuple[str, int | None], int] = {}   # a worker's open files
_UNREACHABLE: set[str] = set()


class Channel:
    """The engine core's end: where its workers' records arrive."""

    def __init__(self, put: Callable[[Any], None]) -> None:
        self.path = tempfile.mkdtemp(prefix="kvtrace-kv-audit-")
        self.put = put
        self._files: dict[str, Any] = {}      # name -> the file, open, read up to its end
        self._partial: dict[str, bytes] = {}  # name -> a line not yet whole
        _LOCAL[self.path] = (os.getpid(), put)

    def collect(self) -> int:
        """Put every whole record the workers have written since the last
        call into the trace; returns how many."""
        n = 0
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return 0
        for name in names:
            file = os.path.join(self.path, name)
            try:
                f = self._files.get(name)
                if f is None:
                    f = self._files[name] = open(file, "rb")
                got = f.read()
            except OSError:
                continue
            if not got:
                continue
            lines = (self._partial.get(name, b"") + got).split(b"\n")
            self._partial[name] = lines.pop()
            for line in lines:
                try:
                    self.put(decode_line(line))
                    n += 1
                except (SchemaError, msgspec.DecodeError) as e:
                    logger.warning("kvtrace: a worker's KV audit record in %s is unreadable "
                                   "(%s); left out", file, e)
        return n

    def close(self) -> None:
        """Read what is left, and remove the directory."""
        try:
            self.collect()
        finally:
            _LOCAL.pop(self.path, None)
            for f in self._files.values():
                f.close()
            shutil.rmtree(self.path, ignore_errors=True)


def deliver(path: str, rank: int | None, event: Any) -> None:
    """A worker's record for the channel at ``path`` ("": none opened)."""
    if not path:
        return
    local = _LOCAL.get(path)
    if local is not None and local[0] == os.getpid():
        local[1](event)
        return
    fd = _FILES.get((path, rank))
    if fd is None:
        name = f"rank{rank if rank is not None else 0}.jsonl"
        try:
            fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            if path not in _UNREACHABLE:
                _UNREACHABLE.add(path)
                logger.warning("kvtrace: the engine core's KV audit directory %s cannot be "
                               "reached from this worker (%s); its shard is not audited", path, e)
            return
        _FILES[(path, rank)] = fd
    line = msgspec.json.encode(event) + b"\n"
    while line:   # one write, but for a signal or a full disk in between
        line = line[os.write(fd, line):]
