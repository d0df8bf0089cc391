"""The flight recorder: a recording left on, on a bounded disk.

``KeyframingWriter`` puts a keyframe before every N-th step of a trace as it is
written; ``SegmentWriter`` writes a directory of segments, each starting with
a keyframe and replayable alone, deleting the oldest so that the directory
never holds more than its cap, and pinning the segments around a trigger
(segments.py; ``Watch``, watch.py, checks each record's invariants for
one); ``replay_folder`` replays a segment directory as one trace.
"""

from .segments import SegmentWriter, flight_writer, segment_files
from .writer import KeyframingWriter

__all__ = ["KeyframingWriter", "SegmentWriter", "flight_writer", "segment_files"]
