"""A rich progress line on stderr for long runs, and a no-op elsewhere.

The line goes to standard error, the terminal it was asked for on, never to
standard output, which may be a file or a pipe that reads the report. It shows
a percentage and the time left when the end is known: from the bytes of the
trace files read so far (``TraceReader``'s ``read_watchers``), or from a count
with a known total. Otherwise it shows the count and its rate. Until the first
news it says ``starting``, with the time ticking, so that a slow import (torch)
never looks like a hang.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Callable, Iterator, Sequence

from kvtrace._text import count

from ._common import show_progress


@contextlib.contextmanager
def progress(what: str, unit: str, files: Sequence = (), total: int | None = None,
             console=None) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``: call it with the running count of ``unit``.

    ``files``: the trace files the run reads, a file once per time it is read
    through (None entries are skipped); the percentage is the bytes read of
    them all. ``total``: the count of ``unit`` at the end, when known instead.
    ``console``: where to draw (default: standard error, when it is a terminal).
    """
    if console is None and not show_progress():
        yield lambda n: None
        return
    from rich.console import Console

    files = [f for f in files if f is not None]
    sizes = _sizes(files)
    known = total if total is not None else (sum(sizes.values()) if files and sizes else None)
    byte_based = total is None and known is not None
    bar = _bar(what, unit, known is not None, console or Console(stderr=True))
    task = bar.add_task(what, total=known or None, count=None, news=False)

    def advance(n: int) -> None:
        if byte_based:
            bar.update(task, count=n, news=True)
        else:
            bar.update(task, completed=n, count=n, news=True)

    watch = _byte_watch(bar, task, sizes, known) if byte_based else None
    if watch is not None:
        from kvtrace.trace import reader

        reader.read_watchers.append(watch)
    try:
        with bar:
            yield advance
    finally:
        if watch is not None:
            reader.read_watchers.remove(watch)


def _sizes(files: list) -> dict:
    """file identity -> its size times the number of times it is listed; empty
    when one is not a regular file (standard input, a pipe: no end known)."""
    out: dict = {}
    for f in files:
        if str(f) == "-":   # standard input
            return {}
        try:
            st = os.stat(f)
        except OSError:
            return {}
        if not stat.S_ISREG(st.st_mode):
            return {}
        key = (st.st_dev, st.st_ino)
        out[key] = out.get(key, 0) + st.st_size
    return out


def _byte_watch(bar, task, sizes: dict, total: int):
    """A reader watcher that sets the task's completed bytes: the sum of where
    each reader of the listed files has got to, never past the total."""
    at: dict = {}   # reader -> bytes read
    ids: dict = {}  # reader -> file identity, None when not a listed file

    def watch(reader) -> None:
        if reader not in ids:
            try:
                st = os.stat(reader.path)
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = None
            ids[reader] = key if key in sizes else None
        if ids[reader] is None:
            return
        at[reader] = reader.position
        bar.update(task, completed=min(total, sum(at.values())), news=True)

    return watch


def _bar(what: str, unit: str, known: bool, console):
    from rich.markup import escape
    from rich.table import Column
    from rich.progress import (BarColumn, Progress, ProgressColumn, SpinnerColumn, TaskProgressColumn,
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class Count(ProgressColumn):
        """``starting`` before any news; then the count (and, with no end
        known, its rate)."""

        def render(self, task) -> Text:
            if not task.fields.get("news"):
                return Text("starting", style="dim")
            n = task.fields.get("count")
            if n is None:
                return Text("")
            text = count(n, unit[:-1], unit) if unit.endswith("s") else f"{n:,} {unit}"
            if not known:
                elapsed = task.elapsed or 0
                if elapsed > 0.5:
                    text += f" {n / elapsed:,.0f}/s"
            return Text(text)

    def fixed():
        return Column(no_wrap=True)

    # A file name is text: neither markup nor a format field. It takes the
    # width the figures leave, cut short with an ellipsis on a narrow terminal.
    label = escape(what).replace("{", "{{").replace("}", "}}")
    columns = [SpinnerColumn(table_column=fixed()),
               TextColumn(label, table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))]
    if known:
        columns += [BarColumn(bar_width=12, table_column=fixed()),
                    TaskProgressColumn(table_column=fixed())]
    columns += [Count(table_column=fixed()), TimeElapsedColumn(table_column=fixed())]
    if known:
        columns += [TextColumn("left", table_column=fixed()), TimeRemainingColumn(table_column=fixed())]
    return Progress(*columns, transient=True, console=console, expand=True)
