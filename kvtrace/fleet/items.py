"""One item of a replay of many, and the one function that replays any item:
a trace file, or a segment directory of ``kvtrace record --ring`` (replayed as
one trace). A pool process or a Ray task runs ``replay_item``; its answer,
(path as given, result or None, None or why not), is pickled back.

Another kind of item (a piece of a long trace cut at a keyframe, say) is a
new branch here; every runner of items takes it as it is."""

from __future__ import annotations

import os
from typing import NamedTuple

from kvtrace.flight.replay import replay_folder
from kvtrace.replay.many import Answer, quietly, replay_quietly


class Item(NamedTuple):
    """What to replay: ``path`` as given (a trace, or a segment directory), the
    shadow-KV check's ``device`` (None: no check; a directory is never
    checked) and the ``profile`` to follow (None: the trace's own)."""

    path: str
    device: str | None = None
    profile: str | None = None


def replay_item(item: tuple[str, str | None, str | None]) -> Answer:
    """Replay one item; unusable input and internal errors come back as
    messages (kvtrace.replay.many.quietly), never raised."""
    path, _, profile = item
    if os.path.isdir(path):
        return quietly(path, lambda: replay_folder(path, profile=profile))
    return replay_quietly(item)
