"""The data-parallel ranks of one recorded run, found from rank 0's trace.

vLLM's plugin writes rank 0's trace at ``KVTRACE_OUT``'s path and rank k's
beside it, named with ``.dp<k>.pid<pid>`` before the ending. Each rank writes
its own header first, before its first step: its rank
(``meta.data_parallel_rank``), the data-parallel size its engine runs with
(``features.data_parallel_size``: the run's for a model whose ranks run in
lockstep, 1 for a dense model's independent ranks) and the address its run's
ranks share (``meta.data_parallel_master``). The files are therefore the
run's manifest: no rank writes one for the others, so a rank that dies, rank 0
included, takes nothing of the others' with it, and a rank that never
started is known by the gap it leaves.

``find_run(path)`` reads the headers only. A file named like a rank of the
run but recorded by another run to the same path (another master address, or
an older file of a rank that has a newer one) is listed apart, not taken.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .files import split_trace_name
from .io import TraceError, TraceReader


@dataclass
class Run:
    """A data-parallel run: each rank's trace, the ranks its files lack."""

    path: str                              # rank 0's trace
    size: int | None                       # the size the headers name; None: not recorded
    lockstep: bool                         # ranks in lockstep (headers' size above 1)
    ranks: dict[int, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)   # (path, why not taken)


@dataclass(frozen=True)
class _Head:
    rank: int | None
    size: int
    master: str | None


def _head(path: str | os.PathLike) -> _Head | None:
    """A trace's rank, size and master address; None when its header is unusable."""
    try:
        with TraceReader(path, validate=False) as r:
            h = r.header
    except TraceError:
        return None
    meta = h.meta if isinstance(h.meta, dict) else {}
    rank = meta.get("data_parallel_rank")
    master = meta.get("data_parallel_master")
    return _Head(rank if type(rank) is int else None, h.features.data_parallel_size or 1,
                 master if isinstance(master, str) else None)


def rank_files(path: str | os.PathLike) -> dict[int, list[str]]:
    """The files beside ``path`` named as its run's other ranks' traces
    (``stem.dp<k>[.pid<pid>][.<n>]ending``), by rank, newest first."""
    p = Path(path)
    stem, ext = split_trace_name(p.name)
    pattern = re.compile(re.escape(stem) + r"\.dp(\d+)(?:\.pid\d+)?(?:\.\d+)?" + re.escape(ext))
    found: dict[int, list[tuple[float, str]]] = {}
    try:
        entries = list(os.scandir(p.parent))
    except OSError:
        return {}
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and int(m.group(1)) > 0 and entry.is_file():
            found.setdefault(int(m.group(1)), []).append((entry.stat().st_mtime, entry.path))
    return {k: [q for _, q in sorted(v, reverse=True)] for k, v in sorted(found.items())}


def find_run(path: str | os.PathLike) -> Run | None:
    """The run whose rank 0 recorded ``path``, or None: ``path`` is no rank
    0's trace of several ranks (its header names another rank, or neither
    names a size above 1 nor has ``.dp<k>`` files beside it)."""
    head = _head(path)
    if head is None or (head.rank or 0) != 0:
        return None
    candidates = rank_files(path)
    if head.size <= 1 and not candidates:
        return None
    run = Run(str(path), head.size if head.size > 1 else None, head.size > 1, {0: str(path)})
    for rank, files in candidates.items():
        _take(run, rank, files, head.master)
    top = run.size or max(run.ranks) + 1
    run.missing = [k for k in range(top) if k not in run.ranks]
    return run


def _take(run: Run, rank: int, files: list[str], master: str | None) -> None:
    """Take the newest of ``files`` (rank ``rank``'s) that belongs to the run."""
    for f in files:
        h = _head(f)
        if h is not None and h.rank != rank:
            run.others.append((f, f"its header names rank {h.rank}, not {rank}"))
        elif h is not None and None not in (master, h.master) and h.master != master:
            run.others.append((f, f"of another run (its ranks met at {h.master}, rank 0's at "
                                  f"{master})"))
        elif rank in run.ranks:
            run.others.append((f, f"an older trace of rank {rank} (newer: "
                                  f"{os.path.basename(run.ranks[rank])})"))
        else:
            run.ranks[rank] = f   # an unusable file is taken: its replay says why
