"""Text from a trace, shown to a person: its control characters as escapes;
and file names that are not UTF-8, as escapes too (``path_text``).

A request id or a field name comes from the trace, which may come from anyone:
printed as it is, it could move the cursor, clear the screen or retitle the
terminal. ``str.translate`` with these tables shows each C0 and C1 control
character as ``\\xNN`` instead.
"""

from __future__ import annotations

import os

CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}
# The same, keeping the line breaks and tabs of a multi-line rendering (a table).
CONTROL_ESCAPES_BUT_LAYOUT = {c: e for c, e in CONTROL_ESCAPES.items() if chr(c) not in "\n\t"}


def path_text(path: str | os.PathLike) -> str:
    """A file name as text that JSON and HTML can hold: a Linux file name may
    be any bytes, and those that are not UTF-8 are shown as ``\\xNN`` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
