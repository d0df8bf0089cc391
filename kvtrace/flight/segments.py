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
loses no completed step; in a vLLM engine's writer process, a plain
``TraceWriter`` there; each counts the text it writes, ``bytes_written``),
and ``pins.json`` names the pinned segments.

Triggers pin the segment under way, the one before it and the next one:
the replay's first divergence, the first invariant a record breaks
(``watch``), a record that breaks the trace's schema, a ``step_failed``
record, an end ``interrupted``, a recording that stops without its end (the
engine's process died), and SIGUSR2 (``kvtrace dump DIR``, or a metrics
error in vLLM's front end, whose reason waits in a file: ``record.folder``).
Each trigger kind pins once a recording.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import zlib
from pathlib import Path
from typing import Callable

import orjson

from kvtrace.record.folder import (DUMP_SIGNAL, DUMPED, NAME, PID, PINS, open_folder,
                                   pid_line, segment_files, take_reasons)
from kvtrace.trace import events as ev
from kvtrace.trace.io import TraceWriter, interrupted_by

from .watch import Watch, broken_at, rule_id
from .writer import KeyframingWriter

logger = logging.getLogger("kvtrace.record")

__all__ = ["DUMP_SIGNAL", "NAME", "PID", "PINS", "SegmentWriter", "flight_writer", "segment_files"]


HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # what stops a recording


@contextlib.contextmanager
def _interrupt_held():
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP held back while the block runs,
    then handled as they would have been (``kvtrace``'s handlers raise); a
    second one is not held. Only in the main thread, where Python runs
    signal handlers, and for handlers written in Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in HELD}
    before = {sig: h for sig, h in before.items() if callable(h)}
    came: list[tuple[int, object]] = []

    def hold(signum, frame):
        if came:
            before[signum](signum, frame)
        came.append((signum, frame))

    for sig in before:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
    if came:
        signum, frame = came[0]
        before[signum](signum, frame)


class SegmentWriter:
    """A trace writer's calls, the trace cut into segments in ``folder``."""

    def __init__(self, folder: str | os.PathLike, header: ev.Header, segment_bytes: int,
                 cap_bytes: int, every: int | None = None,
                 open_file: Callable = TraceWriter, suffix: str = ".jsonl.gz",
                 on_pin: Callable[[str], None] = logger.warning, fd: int | None = None):
        """``fd``: the directory, claimed already (``record.folder.open_folder``,
        in a vLLM engine's process); without it the directory is claimed here,
        the same way, and let go when the recording ends."""
        if cap_bytes < 2 * segment_bytes:
            raise ValueError(f"a ring of {cap_bytes:,} bytes holds less than two segments of "
                             f"{segment_bytes:,}")
        self.folder = Path(folder)
        # ValueError when another recorder holds it or it holds segments already.
        self._claim = open_folder(self.folder) if fd is None else None
        self.header = header
        self.segment_bytes, self.cap_bytes = segment_bytes, cap_bytes
        self.open_file, self.suffix, self.on_pin = open_file, suffix, on_pin
        # Keyframes before every ``every``-th step (if given) and at each
        # segment's start: the keyframer sees every record.
        self.frames = KeyframingWriter(None, header, every or (1 << 62))
        self.watch: Watch | None = Watch(header)   # the invariants a record breaks
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
        self.tripped: set[str] = set()              # the trigger kinds that have pinned
        self.failed_in: Path | None = None          # the segment a step_failed record pinned
        self.asked: str | None = None               # a pin asked from outside (a signal)
        self.too_small = False                      # said: a segment does not fit the ring
        self.pins_failed = False                    # said: pins.json cannot be written
        self.kf_disk = 0                            # the current keyframe, on disk
        self._old_handler = None
        self._listening = False
        try:
            self._open(None)
        except BaseException:
            self._let_go()
            raise

    # -- a trace writer's calls --------------------------------------------------

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def write(self, e) -> None:
        """Write the record ``e``: an event, or a dict of a record's fields
        (as the vLLM recorder's writer process has them), which is written as
        it is."""
        if self.asked is not None:
            self.heed()
        if type(e) is dict:
            kind, seq = e.get("kind"), e.get("seq")
            rec = self._read(e)
        else:
            kind, seq, rec = type(e).kind, getattr(e, "seq", None), e
        step = kind == "step"
        if step:
            self.step_bytes = max(self.step_bytes, self.bytes - self._at_step)
        due = step and self.bytes - self.kf_bytes >= self.segment_bytes
        # A dict that fits no record is shown as it is: the keyframer stops there.
        kf = self.frames.keyframe_for(e if rec is None else rec, force=due)
        found = self.frames.found()
        if found:
            d = found[0]
            self._trigger("replay", f"replay found a divergence at step {d.step}: request "
                                    f"{d.req}, {d.field} ({rule_id(d.rule)})")
        if self.watch is not None and rec is not None:
            self._check(rec)
        if kind == "step_failed":
            self._failed_step(e if rec is None else rec)
        # A Ctrl-C in a rotation waits until the new segment holds this
        # record: the recording's end then goes to a segment under way.
        with (_interrupt_held() if due else contextlib.nullcontext()):
            if due:   # with its keyframe; without one only when none can be made
                self._rotate(kf, seq)
            elif kf is not None:
                self._put(kf)
            if step:
                self._at_step = self.bytes
            self._put(e)

    def end_step(self) -> None:
        self.current.end_step()

    def flush(self) -> None:
        if self.asked is not None:
            self.heed()
        self.current.flush()

    def close(self, status: str = "complete", error: str | None = None,
              dropped_events: int = 0) -> None:
        self.finish(ev.End(self.next_seq(), status, error, dropped_events))

    def finish(self, end: ev.End | None) -> None:
        """End the recording with ``end``; None: it stops without its end
        record (the engine's process ended without shutting down)."""
        try:
            reasons = []
            if self._listening:
                # A dump from now on finds no recorder, or one that ignores it:
                # its default action would end this process.
                signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
                (self.folder / PID).unlink(missing_ok=True)
                # A pin asked before that whose signal is not yet handled (an
                # engine failing right after its metrics did) is heeded now.
                reasons = take_reasons(self.folder)
            if self.current is not None:
                if self.asked is not None or reasons:
                    self.asked = None
                    self.pin("; ".join(reasons) if reasons else DUMPED, last=True)
                if end is None:
                    self._trigger("cut", "the recording stops without its end: the engine's "
                                         "process ended without shutting down", last=True)
                elif end.status == "interrupted" and self.failed_in != self.current_path:
                    self._trigger("interrupted", "the recording ends interrupted: "
                                                 f"{end.error or 'the engine failed'}", last=True)
                self.current.finish(end)
                self.current = None
        finally:
            if self._listening:
                self._listening = False
                signal.signal(DUMP_SIGNAL, signal.SIG_DFL if self._old_handler is None
                              else self._old_handler)
                self._old_handler = None
            self._let_go()

    def _let_go(self) -> None:
        """Let go of the directory, if it was claimed here."""
        if self._claim is not None:
            os.close(self._claim)
            self._claim = None

    def listen(self) -> bool:
        """Pin the segments at hand when this process gets SIGUSR2 ('kvtrace
        dump DIR' sends it, naming the process in ``recorder.pid``). Only from
        the main thread, where Python runs signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return False

        def asked(signum, frame):   # pinned at the next record, not in the handler
            self.asked = DUMPED

        self._old_handler = signal.signal(DUMP_SIGNAL, asked)
        self._listening = True
        tmp = self.folder / f".{PID}.tmp"   # whole or not at all: 'kvtrace dump' may read it now
        tmp.write_text(pid_line(os.getpid()))
        os.replace(tmp, self.folder / PID)
        return True

    def heed(self) -> None:
        """Pin what a signal asked for, for the reasons waiting in the folder
        (a dump when none does)."""
        self.asked = None
        reasons = take_reasons(self.folder)
        self.pin("; ".join(reasons) if reasons else DUMPED)

    def __enter__(self) -> "SegmentWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.close(status="interrupted", error=interrupted_by(exc))

    # -- triggers ----------------------------------------------------------------

    def _read(self, d: dict):
        """A dict of a record's fields as its event; None (a trigger) when it
        breaks the trace's schema: a reader would refuse the file there."""
        try:
            return ev.decode_line(ev.encode(d))
        except Exception as err:
            self._trigger("schema", f"record {d.get('seq')} ({d.get('kind')}"
                                    f"{', step ' + str(d['step']) if 'step' in d else ''}) breaks "
                                    f"the trace's schema: {err}")
            return None

    def _check(self, rec) -> None:
        """The invariants ``rec`` breaks; the first one pins. A watch that
        fails stops (said), never the recording."""
        try:
            broken = self.watch.feed(rec)
        except Exception as err:
            self.watch = None
            logger.warning("kvtrace: the invariant checks stopped at record %s: %s: %s",
                           getattr(rec, "seq", "?"), type(err).__name__, err)
            return
        if broken:
            self._trigger("invariant", f"an invariant broke at {broken_at(broken[0])}")

    def _failed_step(self, rec) -> None:
        if type(rec) is dict:
            step, error = rec.get("step"), rec.get("error")
        else:
            step, error = rec.step, rec.error
        if "step_failed" not in self.tripped:
            self.failed_in = self.current_path
        self._trigger("step_failed", f"the engine's schedule() raised at step {step}: {error}")

    def _trigger(self, kind: str, why: str, last: bool = False) -> None:
        """Pin for ``why``, the first time a trigger of ``kind`` fires."""
        if kind in self.tripped:
            return
        self.tripped.add(kind)
        self.pin(why, last=last)

    # -- pins --------------------------------------------------------------------

    def pin(self, why: str, last: bool = False) -> list[str]:
        """Keep the segment under way, the one before it and the next one
        (none when ``last``: the recording ends), whatever the cap; says so
        (``on_pin``); returns the names pinned now."""
        names = [self.current_path.name]
        if self.number > 1:
            before = self.folder / self._name(self.number - 1)
            if before.exists():
                names.insert(0, before.name)
        for n in names:
            self.pinned.setdefault(n, why)
        if not last and self.pin_next is None:   # the first reason, as for the others
            self.pin_next = why
        self._save_pins()
        self.on_pin(f"pinned {', '.join(names)}{'' if last else ' and the next segment'} in "
                    f"{self.folder}: {why}")
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
            try:
                tmp.unlink(missing_ok=True)   # a full disk leaves it cut short
            except OSError:
                pass
            if not self.pins_failed:
                self.pins_failed = True
                self.on_pin(f"cannot write {self.folder / PINS}: {e.strerror or e}; the pins "
                            "hold while this recorder runs")


def flight_writer(path: str | os.PathLike, header: ev.Header, every: int | None,
                  ring: int | None = None, segment: int | None = None,
                  on_pin: Callable[[str], None] = logger.warning, fd: int | None = None):
    """The flight recorder's writer of a trace at ``path``: with ``ring``
    (bytes), a ``SegmentWriter`` of segments of ``segment`` bytes (an eighth
    of the ring by default) that answers ``kvtrace dump``; else a
    ``KeyframingWriter`` with a keyframe before every ``every``-th step.
    ``fd``: the file or directory, opened already."""
    if ring is not None:
        w = SegmentWriter(path, header, segment or ring // 8, ring, every, on_pin=on_pin, fd=fd)
        w.listen()   # kvtrace dump PATH
        return w
    return KeyframingWriter(TraceWriter(path, header, fd=fd), header, every)
