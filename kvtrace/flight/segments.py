"""A recording as a directory of segments on a bounded disk.

``SegmentWriter`` has a trace writer's calls. It writes ``segment-000001.jsonl.gz``,
``segment-000002.jsonl.gz``... in a directory: each a whole trace file (the
header, then records), and each but the first starts with a keyframe, so that
it replays alone. A segment ends, with an ``end`` record of status
``continued``, at the first step record after it holds ``segment_bytes`` past
its keyframe; the next one starts with that step's keyframe. Before a segment starts, the
oldest segments not pinned are deleted until the finished ones and a whole new
one (its keyframe, its size, and twice the most one step has written, since a
segment ends only at a step) fit in ``cap_bytes``: the directory never holds
more.

Sizes count the trace's text before compression, which bounds what a
compressed segment takes on disk. Each segment is written by the writer
``open_file`` makes (``kvtrace record``'s: a writer process, so that a kill
loses no completed step; it counts the text it writes, ``bytes_written``),
and ``pins.json`` names the pinned segments.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import zlib
from pathlib import Path
from typing import Callable

import orjson

from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceWriter

from .writer import KeyframingWriter

logger = logging.getLogger("kvtrace.record")

NAME = re.compile(r"segment-(\d{6,})\.jsonl(\.gz|\.zst)?$")
PINS = "pins.json"
PID = "recorder.pid"   # the recording process, for 'kvtrace dump DIR'
DUMP_SIGNAL = signal.SIGUSR2


def segment_files(folder: str | os.PathLike) -> list[Path]:
    """The segments of ``folder``, oldest first."""
    found = []
    for p in Path(folder).iterdir():
        m = NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


class SegmentWriter:
    """A trace writer's calls, the trace cut into segments in ``folder``."""

    def __init__(self, folder: str | os.PathLike, header: ev.Header, segment_bytes: int,
                 cap_bytes: int, every: int | None = None,
                 open_file: Callable = TraceWriter, suffix: str = ".jsonl.gz",
                 on_pin: Callable[[str], None] = logger.warning):
        if cap_bytes < 2 * segment_bytes:
            raise ValueError(f"a ring of {cap_bytes:,} bytes holds less than two segments of "
                             f"{segment_bytes:,}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if segment_files(self.folder):
            raise ValueError(f"{self.folder} holds segments already: record into a new folder")
        self.header = header
        self.segment_bytes, self.cap_bytes = segment_bytes, cap_bytes
        self.open_file, self.suffix, self.on_pin = open_file, suffix, on_pin
        # Keyframes before every ``every``-th step (if given) and at each
        # segment's start: the keyframer sees every record.
        self.frames = KeyframingWriter(None, header, every or (1 << 62))
        self._seq = 0
        self.number = 0
        self.current = None
        self.current_path: Path | None = None
        self.step_bytes = 0                         # the most one step has written
        self._at_step = 0                           # self.bytes at the last step record
        self.kf_bytes = 0                           # the current segment's keyframe
        self.sizes: dict[Path, int] = {}            # finished segments -> their size on disk
        self.pinned: dict[str, str] = {}            # segment name -> why
        self.pin_next: str | None = None            # pin the next segment too, for this reason
        self.deleted = 0
        self.tripped = False                        # the replay found a divergence
        self.asked: str | None = None               # a pin asked from outside (a signal)
        self.too_small = False                      # said: a segment does not fit the ring
        self.pins_failed = False                    # said: pins.json cannot be written
        self.kf_disk = 0                            # the current keyframe, on disk
        self._old_handler = None
        self._open(None)

    # -- a trace writer's calls --------------------------------------------------

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def write(self, e) -> None:
        step = type(e) is ev.Step
        if self.asked is not None and step:
            why, self.asked = self.asked, None
            self.pin(why)
        if step:
            self.step_bytes = max(self.step_bytes, self.bytes - self._at_step)
        due = step and self.bytes - self.kf_bytes >= self.segment_bytes
        kf = self.frames.keyframe_for(e, force=due)
        found = self.frames.found()
        if found and not self.tripped:   # the run's first divergence: its segments kept
            self.tripped = True
            d = found[0]
            self.pin(f"replay found a divergence at step {d.step}: request {d.req}, "
                     f"{d.field} ({d.rule.split(':')[0]})")
        if due:   # with its keyframe; without one only when none can be made
            self._rotate(kf, e.seq)
        elif kf is not None:
            self._put(kf)
        if step:
            self._at_step = self.bytes
        self._put(e)

    def end_step(self) -> None:
        self.current.end_step()

    def flush(self) -> None:
        self.current.flush()

    def close(self, status: str = "complete", error: str | None = None,
              dropped_events: int = 0) -> None:
        self.finish(ev.End(self.next_seq(), status, error, dropped_events))

    def finish(self, end: ev.End | None) -> None:
        if self._old_handler is not None:
            signal.signal(DUMP_SIGNAL, self._old_handler)
            self._old_handler = None
            (self.folder / PID).unlink(missing_ok=True)
        if self.current is not None:
            self.current.finish(end)
            self.current = None

    def listen(self) -> bool:
        """Pin the segments at hand when this process gets SIGUSR2 ('kvtrace
        dump DIR' sends it, naming the process in ``recorder.pid``). Only from
        the main thread, where Python runs signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return False

        def asked(signum, frame):   # pinned at the next step record, not in the handler
            self.asked = f"{signal.Signals(signum).name} (kvtrace dump)"

        self._old_handler = signal.signal(DUMP_SIGNAL, asked)
        (self.folder / PID).write_text(f"{os.getpid()}\n")
        return True

    def __enter__(self) -> "SegmentWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.pin(f"the engine raised {type(exc).__name__}: {exc}")
            self.close(status="interrupted", error=f"{type(exc).__name__}: {exc}")

    # -- pins --------------------------------------------------------------------

    def pin(self, why: str) -> list[str]:
        """Keep the segment under way, the one before it and the next one,
        whatever the cap; says so (``on_pin``); returns the names pinned now."""
        names = [self.current_path.name]
        if self.number > 1:
            before = self.folder / self._name(self.number - 1)
            if before.exists():
                names.insert(0, before.name)
        for n in names:
            self.pinned.setdefault(n, why)
        self.pin_next = why
        self._save_pins()
        self.on_pin(f"pinned {', '.join(names)} and the next segment in {self.folder}: {why}")
        return names

    # -- segments ----------------------------------------------------------------

    def _name(self, number: int) -> str:
        return f"segment-{number:06d}{self.suffix}"

    @property
    def bytes(self) -> int:
        """The current segment's text so far, before compression (its writer
        counts what it writes: ``bytes_written``)."""
        return self.current.bytes_written

    def _put(self, e) -> None:
        self.current.write(e)

    def _open(self, kf: ev.Keyframe | None) -> None:
        self._at_step = 0
        line = ev.encode(kf) + b"\n" if kf is not None else b""
        self.kf_bytes = len(line)
        # On disk the keyframe takes about what zlib's fastest level makes of
        # it (the segment's gzip is at least as good), and a block's framing.
        self.kf_disk = len(zlib.compress(line, 1)) + 1024 if line else 0
        self.number += 1
        self.current_path = self.folder / self._name(self.number)
        self._make_room()
        self.current = self.open_file(self.current_path, self.header)
        if self.pin_next is not None:
            self.pinned.setdefault(self.current_path.name, self.pin_next)
            self.pin_next = None
            self._save_pins()
        if kf is not None:
            self._put(kf)

    def _rotate(self, kf: ev.Keyframe | None, seq: int) -> None:
        self.current.finish(ev.End(seq, "continued"))
        done = self.current_path
        self.sizes[done] = done.stat().st_size
        self._open(kf)

    @property
    def _room(self) -> int:
        """What a new segment may take on disk: its keyframe, its size, and
        the step that ends it past that (twice the most one step has written
        so far)."""
        return self.kf_disk + self.segment_bytes + 2 * self.step_bytes

    def _make_room(self) -> None:
        """Delete the oldest segments not pinned until the finished ones and
        a whole new segment fit in the cap."""
        for path in list(self.sizes):
            if sum(self.sizes.values()) + self._room <= self.cap_bytes:
                return
            if path.name in self.pinned:
                continue
            path.unlink(missing_ok=True)
            del self.sizes[path]
            self.deleted += 1
        if not self.sizes and self._room > self.cap_bytes and not self.too_small:
            self.too_small = True
            self.on_pin(f"the ring in {self.folder} ({self.cap_bytes:,} bytes) cannot hold a "
                        f"segment with its keyframe ({self._room:,}): it may pass its size; "
                        "raise --ring")
        if self.sizes and sum(self.sizes.values()) + self._room > self.cap_bytes:
            # Pinned segments and the next one do not fit: the oldest pin goes (said).
            oldest = next(iter(self.sizes))
            self.on_pin(f"the pinned segment {oldest.name} is deleted: with the next segment "
                        f"({self._room:,} bytes with its keyframe) the pins do not fit in the "
                        f"{self.cap_bytes:,}-byte ring; raise --ring to keep more")
            self.pinned.pop(oldest.name, None)
            oldest.unlink(missing_ok=True)
            del self.sizes[oldest]
            self.deleted += 1
            self._save_pins()
            self._make_room()

    def _save_pins(self) -> None:
        """pins.json, whole or not at all; a failure is said once and never
        stops the recording (the pins still hold in this process)."""
        tmp = self.folder / f".{PINS}.tmp"
        try:
            tmp.write_bytes(orjson.dumps(self.pinned, option=orjson.OPT_INDENT_2))
            os.replace(tmp, self.folder / PINS)
        except OSError as e:
            if not self.pins_failed:
                self.pins_failed = True
                self.on_pin(f"cannot write {self.folder / PINS}: {e.strerror or e}; the pins "
                            "hold while this recorder runs")
