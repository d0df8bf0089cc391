"""Keyframes written as a trace is recorded.

``KeyframingWriter`` has a trace writer's calls and passes every record on;
before every N-th step it writes a keyframe, made by replaying the records it
has passed (``kvtrace.replay.keyframes.Keyframer``). A keyframe that cannot be
made (the replay meets records it cannot take) ends the keyframes, never the
recording: the failure is logged once and every record still goes to the file.
"""

from __future__ import annotations

import logging

from kvtrace.replay.keyframes import Keyframer
from kvtrace.trace import events as ev

logger = logging.getLogger("kvtrace.record")


class KeyframingWriter:
    """A trace writer's calls (``next_seq``, ``write``, ``end_step``, ``flush``,
    ``close``, ``finish``), each record passed to ``inner``, with a keyframe
    before every ``every``-th step."""

    def __init__(self, inner, header: ev.Header, every: int):
        self.inner = inner
        self.keyframer: Keyframer | None = Keyframer(header, every)
        self.failed: str | None = None   # why keyframes stopped

    def keyframe_for(self, e, force: bool = False) -> ev.Keyframe | None:
        """Show ``e`` to the keyframer; the keyframe to write before it, if
        one is due (``force``: one before a step record whatever its number)."""
        if self.keyframer is None:
            return None
        try:
            if type(e) is dict:   # the vLLM recorder's writer writes most records as dicts
                e = ev.decode_line(ev.encode(e))
            return self.keyframer.feed(e, force=force)
        except Exception as err:   # the recording goes on without keyframes
            self.failed = f"{type(err).__name__}: {err}"
            self.keyframer = None
            logger.warning("kvtrace: keyframes stopped at record %s: %s; the trace is "
                           "written whole without more of them", getattr(e, "seq", "?"),
                           self.failed)
            return None

    def found(self) -> list:
        """The divergences the replay found at the last record shown."""
        return self.keyframer.found if self.keyframer is not None else []

    def next_seq(self) -> int:
        return self.inner.next_seq()

    def write(self, e) -> None:
        kf = self.keyframe_for(e)
        if kf is not None:
            self.inner.write(kf)
        self.inner.write(e)

    def end_step(self) -> None:
        self.inner.end_step()

    def flush(self) -> None:
        self.inner.flush()

    def close(self, *args, **kwargs) -> None:
        self.inner.close(*args, **kwargs)

    def finish(self, end) -> None:
        self.inner.finish(end)

    def __enter__(self) -> "KeyframingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.inner.__exit__(exc_type, exc, tb)
