"""The trace format: event types, streaming reader, writer. Imports nothing else from kvtrace."""

from .events import SCHEMA_VERSION, SchemaError, decode, to_json  # noqa: F401
from .io import TraceError, TraceReader, TraceWriter  # noqa: F401
