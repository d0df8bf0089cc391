"""A segment directory replayed as one trace.

The segments are read oldest first. The first one left starts the replay, from
its keyframe (or from the start, for the run's first segment); each next one
goes on where the one before stopped, past its keyframe. Where segments are
missing (the oldest rotated out between pinned ones), replay starts again at
the next segment's keyframe and the gap is said. KV contents are not checked
(their check needs the cache's whole history).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace import bridge
from kvtrace.reference.profiles import PROFILES
from kvtrace.replay.keyframes import NO_CONTENT, KeyframeError, restore
from kvtrace.replay.plan import check_supported
from kvtrace.replay.replayer import PROGRESS_EVERY, Replayer
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace import events as ev

from .segments import segment_files

NO_SEGMENTS = "holds no segment (segment-NNNNNN.jsonl.gz files of 'kvtrace record --ring')"


def replay_folder(folder: str | os.PathLike, progress=None,
                  profile: str | None = None) -> ReplayResult:
    """Replay the segments of ``folder`` as one trace. Raises TraceError for
    a folder with no segment, or segments this kvtrace cannot read."""
    segs = segment_files(folder)
    if not segs:
        raise TraceError(folder, None, NO_SEGMENTS)
    run = _Run(str(folder), progress, profile)
    for seg in segs:
        run.segment(seg)
    return run.result()


class _Run:
    def __init__(self, folder: str, progress, profile: str | None):
        self.folder, self.progress, self.profile = folder, progress, profile
        self.rp: Replayer | None = None
        self.res: ReplayResult | None = None
        self.found: list = []       # divergences of the replays before a gap
        self.gaps: list[tuple[int, int]] = []
        self.truncation: str | None = None

    def segment(self, path: Path) -> None:
        with TraceReader(path) as reader:
            events = iter(reader)
            first = next(events, None)
            if first is None:
                return
            if self.rp is None:
                self._start(path, reader.header, first, reader.last_line)
            elif type(first) is ev.Keyframe and first.step != self.rp.steps:
                self._gap(path, reader.header, first)
            elif type(first) is not ev.Keyframe:
                raise TraceError(path, reader.last_line, "a segment after the first that does "
                                                         "not start with a keyframe")
            if type(first) is not ev.Keyframe:
                self._feed(first, reader.last_line)
            for e in events:
                self._feed(e, reader.last_line)
            self.truncation = reader.truncation

    def _start(self, path: Path, header: ev.Header, first, line) -> None:
        chosen, note = (bridge.header_profile(header) if self.profile is None
                        else (PROFILES[self.profile], None))
        check_supported(header, path, chosen)
        self.chosen = chosen
        self.res = ReplayResult(path=self.folder, header=header, profile=chosen.name,
                                content_unchecked=NO_CONTENT, profile_note=note)
        if type(first) is ev.Keyframe:
            self.rp = self._restore(path, header, first)
            self.res.from_keyframe = first.step
        else:
            self.rp = Replayer(header, str(path), None, None, profile=chosen)

    def _gap(self, path: Path, header: ev.Header, kf: ev.Keyframe) -> None:
        self.rp.finish()
        self.found += self.rp.divergences
        self.gaps.append((self.rp.steps, kf.step))
        self.rp = self._restore(path, header, kf)

    def _restore(self, path: Path, header: ev.Header, kf: ev.Keyframe) -> Replayer:
        try:
            return restore(kf, header, str(path), self.chosen)
        except KeyframeError as e:
            raise TraceError(path, 2, str(e)) from None

    def _feed(self, e, line) -> None:
        if type(e) is ev.End and e.status == "continued":
            return
        self.res.events += 1
        self.rp.feed(e, line)
        if type(e) is ev.End:
            self.res.end = e
        elif self.progress is not None and not self.res.events % PROGRESS_EVERY:
            self.progress(self.rp.steps)

    def result(self) -> ReplayResult:
        self.rp.finish()
        self.rp.put_into(self.res, self.truncation)
        self.res.divergences = self.found + self.res.divergences
        self.res.gaps = self.gaps
        return self.res
