"""kvtrace: record, replay and diff KV-cache scheduler decisions of LLM inference engines."""

__version__ = "0.1.0"

# The compiled path or the pure one (compiled.py), chosen before anything loads.
from . import compiled as _compiled  # noqa: E402

_compiled.install()
