"""Reading and writing trace files: JSON Lines, plain, gzip or zstd.

``TraceReader`` (reader.py) streams a trace's events, checked; ``TraceWriter``
(writer.py) writes one; files.py opens them and holds the reader's limits.
This module is the one place the rest of kvtrace imports them from.
"""

from .files import (ENV_MAX_BYTES, ENV_MAX_LINE_BYTES, GZIP_MAGIC, MAX_LINE_BYTES, MAX_TOTAL_BYTES,
                    ZSTD_MAGIC, SharedEnd, SharedFile, TraceError, not_regular, open_binary_read)
from .reader import TraceReader
from .writer import (JSON_LINE, TraceBusy, TraceWriter, interrupted_by, open_trace_file,
                     open_trace_stream)

__all__ = ["ENV_MAX_BYTES", "ENV_MAX_LINE_BYTES", "GZIP_MAGIC", "JSON_LINE", "MAX_LINE_BYTES",
           "MAX_TOTAL_BYTES", "ZSTD_MAGIC", "SharedEnd", "SharedFile", "TraceError", "TraceReader",
           "TraceBusy", "TraceWriter", "interrupted_by", "not_regular", "open_binary_read",
           "open_trace_file", "open_trace_stream"]
