"""kvtrace: record, replay and diff KV-cache scheduler decisions of LLM inference engines."""

__version__ = "0.1.0"
