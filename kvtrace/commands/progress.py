"""A rich progress line on stderr for long runs, and a no-op elsewhere.

The line goes to standard error, the terminal it was asked for on, never to
standard output, which may be a file or a pipe that reads the report."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from ._common import show_progress


@contextlib.contextmanager
def progress(what: str, unit: str) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``: call it with the running count of ``unit``."""
    if not show_progress():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    # A file name is text: neither markup nor a format field.
    label = escape(what).replace("{", "{{").replace("}", "}}")
    with Progress(SpinnerColumn(), TextColumn(f"{label} [bold]{{task.completed:,}}[/] {unit}"),
                  TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(what, total=None)
        yield lambda n: bar.update(task, completed=n)
