"""Text shown to a person. A trace's own text with its control characters as
escapes, and file names that are not UTF-8, as escapes too (``path_text``);
counts of things in words (``count``, ``plural``, ``number``): thousands
separated, the noun and its verb agreeing with the number. A step, line,
block or token id is a name, not a count, and is printed as it is.

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


def number(n: int) -> str:
    """A count, thousands separated: "4,538"."""
    return f"{n:,}"


def plural(n: int, one: str, many: str | None = None) -> str:
    """The word for ``n`` things: ``one`` for 1, else ``many`` (``one`` + "s"
    by default): plural(2, "request"), plural(1, "diverges", "diverge")."""
    return one if n == 1 else many if many is not None else one + "s"


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` things, thousands separated: "1 request", "4,538 divergences"."""
    return f"{n:,} {plural(n, one, many)}"
