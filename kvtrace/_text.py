"""Text from a trace, shown to a person: its control characters as escapes.

A request id or a field name comes from the trace, which may come from anyone:
printed as it is, it could move the cursor, clear the screen or retitle the
terminal. ``str.translate`` with these tables shows each C0 and C1 control
character as ``\\xNN`` instead.
"""

from __future__ import annotations

CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}
# The same, keeping the line breaks and tabs of a multi-line rendering (a table).
CONTROL_ESCAPES_BUT_LAYOUT = {c: e for c, e in CONTROL_ESCAPES.items() if chr(c) not in "\n\t"}
