"""A segment directory replayed as one trace.

The segments are read oldest first. The first one left starts the replay, from
its keyframe (or from the start, for the run's first segment); each next one
goes on where the one before stopped, past its keyframe. Where segments are
missing (the oldest rotated out between pinned ones), replay starts again at
the next segment's keyframe and the gap is said. A segment whose keyframe
holds no state (made after the recorder's replay stopped) only goes on from
the one before. KV contents are not checked (their check needs the cache's
whole history).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace.findings import Stop
from kvtrace.replay.keyframes import KeyframeError, feed_counted, restore
from kvtrace.replay.plan import check_supported, choose_profile
from kvtrace.replay.replayer import Replayer
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace import events as ev

from .segments import NAME, segment_files

NO_FOLDER_CONTENT = ("a segment directory's replay does not check KV contents (that check "
                     "needs the cache's whole history)")
NO_SEGMENTS = "holds no segment (segment-NNNNNN.jsonl.gz files of 'kvtrace record --ring')"


def replay_folder(folder: str | os.PathLike, progress=None,
                  profile: str | None = None) -> ReplayResult:
    """Replay the segments of ``folder`` as one trace. Raises TraceError for
    a folder with no segment, no segment a replay can start from, segments
    of two recordings, or segments out of order."""
    segs = segment_files(folder)
    if not segs:
        raise TraceError(folder, None, NO_SEGMENTS)
    numbers = [int(NAME.match(p.name).group(1)) for p in segs]
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    if twice:
        raise TraceError(folder, None, f"holds segment {twice[0]} twice (two files of one "
                                       "number)")
    run = _Run(str(folder), progress, profile)
    for seg in segs:
        run.segment(seg, newest=seg is segs[-1])
    if run.rp is None:
        raise TraceError(folder, None, "holds no segment a replay can start from (the first "
                                       "one, or one that starts with a keyframe)")
    return run.result()


class _Run:
    def __init__(self, folder: str, progress, profile: str | None):
        self.folder, self.progress, self.profile = folder, progress, profile
        self.rp: Replayer | None = None
        self.res: ReplayResult | None = None
        self.header: ev.Header | None = None
        self.found: list = []       # divergences of the replays before a gap
        self.gaps: list[tuple[int, int]] = []
        self.truncation: str | None = None
        self.last_number: int | None = None   # the last segment read
        self.last_end: str | None = None      # the end status of the last one read

    def segment(self, path: Path, newest: bool = False) -> None:
        number = int(NAME.match(path.name).group(1))
        follows = self.last_number is not None and number == self.last_number + 1
        try:
            opened = TraceReader(path)
        except TraceError as e:
            if not (newest and self.rp is not None):
                raise
            # The newest segment has no whole header (empty: a full disk, or
            # the recorder stopped as it made it): the recording is cut there.
            self._cut(path, f"no header ({e.problem})")
            return
        with opened as reader:
            if self.header is not None and reader.header != self.header:
                raise TraceError(path, 1, "a segment of another recording: its header is "
                                          "not the first segment's")
            events = iter(reader)
            first = next(events, None)
            if first is None:   # a header alone: the recorder stopped as it began it
                self._cut(path, reader.truncation or "it holds no record")
                return
            keyframe = first if type(first) is ev.Keyframe else None
            if self.rp is None:
                if keyframe is None and number != 1:   # nothing to start from
                    return
                self.header = reader.header
                self._start(path, reader.header, first)
            elif keyframe is not None and keyframe.step < self.rp.steps_in_trace:
                raise TraceError(path, reader.last_line,
                                 f"starts at step {keyframe.step}, before step "
                                 f"{self.rp.steps_in_trace}, where the segment before it "
                                 "ended: segments out of order")
            elif self.rp.stopped:
                pass   # nothing more is checked; the steps are counted
            elif keyframe is not None and not (follows and keyframe.step == self.rp.steps_in_trace):
                self._gap(path, reader.header, keyframe)
            elif keyframe is None and not follows:
                return   # after a gap, a segment without a keyframe cannot start a replay
            self.last_number = number
            self.last_end = None
            if keyframe is None:
                self._feed(first, reader.last_line)
            for e in events:
                self._feed(e, reader.last_line)
            if reader.truncation is not None:
                self._cut(path, reader.truncation)
            elif self.last_end is None or self.last_end == "continued":
                self.truncation = None   # whole so far; the next segment goes on

    def _cut(self, path: Path, why: str) -> None:
        self.truncation = f"{path.name}: {why}"

    def _start(self, path: Path, header: ev.Header, first) -> None:
        chosen, note = choose_profile(header, self.profile)
        check_supported(header, path, chosen)
        self.chosen = chosen
        self.res = ReplayResult(path=self.folder, header=header, profile=chosen.name,
                                content_unchecked=NO_FOLDER_CONTENT, profile_note=note)
        if type(first) is ev.Keyframe:
            self.rp = self._restore(path, header, first)
            self.res.from_keyframe = first.step
        else:
            self.rp = Replayer(header, str(path), None, None, profile=chosen)

    def _gap(self, path: Path, header: ev.Header, kf: ev.Keyframe) -> None:
        if kf.step > self.rp.steps:   # (segments renumbered by hand may miss none)
            self.gaps.append((self.rp.steps, kf.step))
        if "root" not in kf.state and "stopped" in kf.state:
            # Made after the recorder's replay stopped (the segments around
            # the stop rotated out): no replay starts here, nor later.
            self.rp.stopped = str(kf.state["stopped"])
            self.rp.stop = Stop(kf.step, None, f"the recorder's replay had stopped before "
                                               f"{path.name} ({self.rp.stopped}): no replay "
                                               "starts there, nor in the segments after it")
            self.rp.steps = kf.step   # the steps missing are said as a gap
            return
        self.rp.finish()
        self.found += self.rp.divergences
        self.rp = self._restore(path, header, kf)

    def _restore(self, path: Path, header: ev.Header, kf: ev.Keyframe) -> Replayer:
        try:
            return restore(kf, header, str(path), self.chosen)
        except KeyframeError as e:
            raise TraceError(path, 2, str(e)) from None

    def _feed(self, e, line) -> None:
        if type(e) is ev.End:
            self.last_end = e.status
            if e.status == "continued":
                return
        feed_counted(self.rp, self.res, e, line, self.progress)

    def result(self) -> ReplayResult:
        if self.truncation is None and self.last_end in (None, "continued"):
            # The last segment ends without the run's end record: the
            # recorder was killed between two segments, or as one began.
            self.truncation = (f"the recording stops after segment {self.last_number} "
                               "without its end (the recorder was stopped)")
        self.rp.finish()
        self.rp.put_into(self.res, self.truncation)
        self.res.divergences = self.found + self.res.divergences
        self.res.gaps = self.gaps
        return self.res
