"""``kvtrace export --format parquet|arrow``: a trace's tables (tables.py) as a
directory with one file per table.

The directory is built under a temporary name beside ``out`` and renamed into
place when every file is written: a failed export leaves nothing behind, and
never writes into a directory that holds files already. Each file carries the
trace's name, engine and header, and for a cut trace where it was cut, in its
key-value metadata (``kvtrace.*``).
"""

from __future__ import annotations


import contextlib
import errno
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from .._text import path_text
from ..findings import Divergence
from ..trace import events as ev
from ..trace.io import TraceReader

PYARROW_INSTALL = "pip install 'kvtrace[export]'"
MIN_PYARROW = 14
SUFFIX = {"parquet": ".parquet", "arrow": ".arrow"}


class PyarrowUnavailable(Exception):
    """pyarrow, which the table formats need, is missing or too old: exit 2."""

    exit_code = 2


def require_pyarrow(fmt: str, option: str | None = None) -> None:
    """Import pyarrow, or say in one line why ``--format fmt`` (or ``option``)
    cannot run."""
    option = option or f"--format {fmt}"
    try:
        import pyarrow
    except ImportError:
        raise PyarrowUnavailable(f"{option} needs pyarrow, which is not installed: "
                                 f"{PYARROW_INSTALL}") from None
    major = pyarrow.__version__.split(".")[0]
    if major.isdigit() and int(major) < MIN_PYARROW:
        raise PyarrowUnavailable(f"{option} needs pyarrow {MIN_PYARROW} or newer, not "
                                 f"{pyarrow.__version__}: {PYARROW_INSTALL}")


class OutputExists(Exception):
    """``-o`` names something that is not an empty directory: exit 2."""

    exit_code = 2


def check_out_dir(out: Path) -> None:
    """The output directory must not exist, or be empty."""
    if out.is_dir() and not out.is_symlink():
        with os.scandir(out) as it:
            if next(it, None) is None:
                return
        raise OutputExists(f"{out}: the directory exists and is not empty; name a new "
                           "directory (or remove it)")
    if os.path.lexists(out):
        raise OutputExists(f"{out}: exists and is not an empty directory; name a new directory")


@dataclass
class Written:
    """What ``write_tables`` wrote: rows per table and, for a cut trace, why."""

    rows: dict[str, int] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    truncation: str | None = None


def write_tables(trace: str | os.PathLike, out: str | os.PathLike,
                 divergences: list[Divergence] | None = None, fmt: str = "parquet",
                 progress: Callable[[int], None] | None = None,
                 checked: dict | None = None) -> Written:
    """Write ``trace``'s tables into the new directory ``out``, one file per
    table (``steps.parquet`` ...; ``.arrow``: Arrow IPC files for
    ``fmt="arrow"``). ``divergences`` fill the ``divergences`` table; None
    leaves it out. ``checked``: what the replay that found them checked
    (``steps_checked``, ``steps_in_trace``, ``stopped_at``), as metadata. Raises ``TraceError`` for unusable input, ``OutputExists``
    when ``out`` is anything but a missing or empty directory."""
    from .tables import build_tables

    out = Path(out)
    check_out_dir(out)
    reader = TraceReader(trace)
    last = [1]   # the line of the last record read: the header's, before any
    with reader:
        tables = build_tables(_records(reader, last), divergences, progress)
    meta = _metadata(reader, last[0])
    for key, value in (checked or {}).items():
        meta[f"kvtrace.{key}"] = orjson.dumps(value, default=str).decode()
    done = Written(truncation=reader.truncation)
    with _new_dir(out) as tmp:
        for name, table in tables.items():
            table = table.replace_schema_metadata({**meta, "kvtrace.table": name})
            path = Path(tmp) / (name + SUFFIX[fmt])
            try:
                _write(table, path, fmt)
            except OSError as e:   # pyarrow's own carry no file name
                raise OSError(e.errno or errno.EIO, e.strerror or str(e), str(out)) from None
            done.rows[name] = table.num_rows
            done.files.append(out / path.name)
    return done


def write_fleet_divergences(out: str | os.PathLike, answers: list) -> int:
    """Write one Parquet file ``out``: every divergence of several traces
    replayed together (kvtrace.report.tables.fleet_divergences), each trace's in
    the order its replay found them. ``answers`` are (path, result or None,
    None or why not), as a replay of many gives them; the file's metadata holds
    ``kvtrace.traces``: each trace's path, what its replay checked, and the
    error of an unusable one, as JSON. Written whole or not at all; returns
    the rows written."""
    import pyarrow.parquet as pq

    from ..writing import writing
    from .tables import fleet_divergences

    table = fleet_divergences((path_text(p), r.divergences) for p, r, _ in answers
                              if r is not None)
    traces = [_checked(p, r, err) for p, r, err in answers]
    table = table.replace_schema_metadata({
        "kvtrace.table": "divergences",
        "kvtrace.traces": orjson.dumps(traces, default=str).decode()})
    with writing(out) as w, w.open("wb") as f:
        pq.write_table(table, f, compression="zstd")
    return table.num_rows


def _checked(path, result, error) -> dict:
    """What a trace's replay checked, or why it could not (``error``)."""
    if result is None:
        return {"trace": path_text(path), "error": str(error)}
    stop = result.stopped_at
    return {"trace": path_text(path), "steps_checked": result.steps_checked,
            "steps_in_trace": result.steps_in_trace,
            "stopped_at": None if stop is None else stop.to_json(), "error": None}


def _records(reader: TraceReader, last: list[int]):
    for e in reader:
        last[0] = reader.last_line
        yield last[0], e


def _metadata(reader: TraceReader, last_line: int) -> dict[str, str]:
    h = reader.header
    meta = {"kvtrace.trace": path_text(reader.path), "kvtrace.engine": h.engine,
            "kvtrace.engine_version": h.engine_version,
            "kvtrace.header": orjson.dumps(ev.to_json(h), default=str).decode(),
            "kvtrace.last_line": str(last_line)}
    if reader.truncation:
        meta["kvtrace.truncation"] = reader.truncation
    if reader.end is not None:
        meta["kvtrace.end"] = orjson.dumps(ev.to_json(reader.end), default=str).decode()
    return meta


def _write(table, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path, compression="zstd")
    else:
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)


@contextlib.contextmanager
def _new_dir(out: Path):
    """A temporary directory beside ``out``, renamed to ``out`` when the block
    ends well and removed when it does not. Errors name ``out``."""
    while True:
        tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.mkdir(tmp, 0o777)   # the umask applies, as to a directory made by hand
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(out)) from None
    try:
        yield tmp
        try:
            os.rename(tmp, out)   # over an empty directory too
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(out)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
