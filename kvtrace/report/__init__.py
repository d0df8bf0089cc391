"""Reporters: terminal tables and JSON of replay and diff results, and pictures of a
trace (HTML, Perfetto, terminal views), which read it only through TraceReader."""
