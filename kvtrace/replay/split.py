"""Split replay: one trace with keyframes replayed in pieces at once, and the
pieces' findings merged into exactly the report a serial replay gives.

A keyframe holds the replay's whole state before its step (keyframes.py).
``plan_split`` finds the keyframes' lines in one pass over the decompressed
text (trace/scan.py) and cuts the trace at some of them into pieces of about
equal size. ``replay_piece`` replays one piece: from the trace's start, or
from its keyframe, reached by passing over the lines before it undecoded
(``TraceReader.skip_to``), up to the line of the next piece's keyframe.
``check_content`` runs the shadow-KV content check over the whole trace, as
replay's content worker does: the check needs the cache's whole history.
``merge`` puts their results together in trace order, as one replay finds them:

* the divergences in order, the content check's placed where a serial replay
  places them (``Replayer._place``): each step's after the divergences found
  up to that step, which each piece counts from its own start;
* a preemption-loop report taken back (liveness.py, ``take_back``) when its
  request got through in a later piece: that piece holds a copy of the report,
  restored from its keyframe, which is matched to the report by its fields;
* the counts (events, steps, steps in the trace, what the KV audit checked),
  the stop at an engine assertion (the pieces after it only count), the end
  record, and the cut of a cut trace (the last piece's).

Each piece also checks that the state its replay reaches at its end is the
one the next piece's keyframe holds, so that every piece starts where a
serial replay stands. Where one does not (keyframes made by another kvtrace,
or edited), or a piece meets unusable input, the split gives up and the trace
is replayed serially (``Unsplittable``): a piece checks records knowing of
those before it only what its keyframe says, so only a serial replay names
the first bad record as a serial replay does.

``replay_piece``, ``check_content`` and ``merge`` take and return plain,
picklable data: the pieces can run in any process (here, a process pool).
"""

from __future__ import annotations

import bisect
import contextlib
import multiprocessing
import signal
import traceback
from array import array
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from kvtrace.findings import Divergence, Stop
from kvtrace.results import ReplayResult
from kvtrace.trace import TraceError, TraceReader
from kvtrace.trace.io import not_regular
from kvtrace.trace import events as ev
from kvtrace.trace.scan import keyframe_lines
from kvtrace.workers import WorkerError

from .data_path import DataPath
from .data_path import summary as data_path_summary
from .keyframes import KeyframeError, restore, take
from .many import stop_pool
from .plan import check_supported, choose_profile, plan
from .replayer import Replayer

# Pieces per process: one, cut to cost the same; two beside the content check,
# which takes one process for much of the run while the others share the pieces.
PIECES_PER_JOB = {False: 1, True: 2}
# What skipping a byte of text costs a piece, as a share of what replaying it
# costs, by the file's compression (bench/split.py's trace: skipping 297 MB of
# text took 0.15 s from zstd, 0.45 s from gzip; replaying it 10 s).
SKIP_COST = {"zstd": 0.015, "gzip": 0.045, "plain": 0.01}
_DATA_PATH = f"{DataPath.__module__}:{DataPath.__qualname__}"


class Unsplittable(Exception):
    """Only a serial replay of the trace can give its report: a piece met
    unusable input, or a keyframe that is not the replay's state there.
    ``note``: what to tell the user (None: the serial replay says it)."""

    def __init__(self, why: str, note: str | None = None):
        super().__init__(why)
        self.note = note


class SplitError(WorkerError):
    """A piece or the content check failed (a bug, a killed process)."""


@dataclass(frozen=True)
class Piece:
    """One piece of a trace: ``path`` from the keyframe at line ``start``
    (None: the trace's start) up to the line ``end`` (the next piece's
    keyframe; None: the trace's end), under the profile ``profile`` (None:
    the trace's release's)."""

    path: str
    start: int | None
    end: int | None
    profile: str | None = None


@dataclass
class PieceResult:
    """What a piece found; divergences and counts from its start."""

    start: int | None
    error: tuple[str, str] | None = None   # ("input" | "keyframe" | "internal", message)
    replayed: bool = True   # False: its keyframe says the replay stopped before it
    events: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    taken_back: list[int] = field(default_factory=list)         # in divergences
    taken_back_earlier: list[bytes] = field(default_factory=list)   # keys (report_key)
    # Per step the content check checks (a serial replay's Replayer._place): its
    # line, and the divergences found before it in this piece.
    tag_lines: array = field(default_factory=lambda: array("q"))
    tag_before: array = field(default_factory=lambda: array("q"))
    steps: int = 0
    steps_in_trace: int = 0
    stopped: str | None = None
    stop: Stop | None = None
    audit: Counter = field(default_factory=Counter)
    end: ev.End | None = None
    truncation: str | None = None
    matches_next: bool | None = None   # its last state is the next keyframe's (None: not compared)


@dataclass(frozen=True)
class ContentJob:
    """The shadow-KV content check of the whole trace ``path`` on ``device``."""

    path: str
    device: str
    session_keeps_sampled: bool = False


@dataclass
class Split:
    """A replay planned in pieces: what the merged report says of the trace."""

    path: str
    header: ev.Header
    profile: str
    profile_note: str | None
    pieces: list[Piece]
    content: ContentJob | None       # None: no content check
    content_unchecked: str | None    # why a content check asked for does not run

    def result(self) -> ReplayResult:
        """The report's frame, before the pieces' findings."""
        return ReplayResult(path=self.path, header=self.header, profile=self.profile,
                            content_unchecked=self.content_unchecked,
                            profile_note=self.profile_note)


# -- the plan ---------------------------------------------------------------------


def plan_split(path: str, jobs: int, device: str | None, profile: str | None = None
               ) -> Split | None:
    """How to replay the trace ``path`` in pieces on ``jobs`` processes, with the
    content check on ``device`` (None: off); None where it replays serially: a
    trace that is not a regular file, has no keyframe to cut at, or is
    refused (the serial replay says why)."""
    if jobs < 2 or not_regular(path):
        return None
    try:
        with TraceReader(path) as reader:
            header = reader.header
            chosen, note = choose_profile(header, profile)
            check_supported(header, path, chosen)
            how = plan(reader, path, device, 0)
    except TraceError:
        return None
    found = keyframe_lines(path)
    cuts = _cuts(found.lines, found.offsets, found.size, jobs * PIECES_PER_JOB[bool(how.device)],
                 SKIP_COST[found.compression])
    if not cuts:
        return None
    bounds = [None, *cuts, None]
    pieces = [Piece(str(path), a, b, profile) for a, b in zip(bounds, bounds[1:])]
    content = (ContentJob(str(path), how.device, chosen.session_keeps_sampled_outputs)
               if how.device else None)
    return Split(str(path), header, chosen.name, note, pieces, content, how.unchecked)


def _cuts(lines: list[int], offsets: list[int], size: int, n: int, skip: float) -> list[int]:
    """The lines of at most ``n - 1`` keyframes that cut ``size`` bytes of text
    into ``n`` pieces of about equal cost (``offsets``: where each starts). A
    piece's cost: its bytes, and ``skip`` for each byte before it; so the
    piece after the i-th cut x_i ends at x_i + c - skip x_i, which puts x_i
    at size (1 - r^i) / (1 - r^n), r = 1 - skip."""
    cuts: list[int] = []
    r = 1 - skip
    for i in range(1, n):
        target = size * (1 - r ** i) / (1 - r ** n)
        j = bisect.bisect_left(offsets, target)
        if j and (j == len(offsets) or target - offsets[j - 1] < offsets[j] - target):
            j -= 1
        if j < len(lines) and (not cuts or lines[j] > cuts[-1]):
            cuts.append(lines[j])
    return cuts


# -- a piece ----------------------------------------------------------------------


def replay_piece(piece: Piece) -> PieceResult:
    """Replay one piece. Errors come back in the result, as data."""
    try:
        return _PieceRun(piece).run()
    except TraceError as e:
        return PieceResult(piece.start, error=("input", str(e)))
    except KeyframeError as e:
        return PieceResult(piece.start, error=("keyframe", str(e)))
    except Exception as e:
        return PieceResult(piece.start, error=("internal", _internal(e)))


def _internal(e: Exception) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:]
    at = f" ({where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())}{at}"


class _Tags:
    """Stands in for the content check in a piece's Replayer: notes each step
    a serial replay queues for the check, with the divergences before it."""

    device, assumed_loads, slots_checked, states_checked = None, False, 0, 0

    def __init__(self, out: PieceResult):
        self.lines, self.before = out.tag_lines, out.tag_before

    def step(self, rec: ev.Step, line: int, before: int) -> list:
        self.lines.append(line)
        self.before.append(before)
        return []

    def arrival(self, a: ev.Arrival) -> None:
        pass

    def abort(self, reqs: list[str]) -> None:
        pass

    def output(self, rec: ev.Output) -> None:
        pass

    def flush(self) -> list:
        return []

    def close(self) -> None:
        pass


class _PieceRun:
    def __init__(self, piece: Piece):
        self.piece = piece
        self.out = PieceResult(piece.start)
        self.rp: Replayer | None = None
        self.restored_back: set[int] = set()   # reports the keyframe says were taken back

    def run(self) -> PieceResult:
        piece = self.piece
        reader = TraceReader(piece.path)
        try:
            header = reader.header
            profile = choose_profile(header, piece.profile)[0]
            events = iter(reader)
            if piece.start is None:
                self.rp = Replayer(header, piece.path, None, None, profile=profile)
            else:
                reader.skip_to(piece.start)
                self._restore(next(events, None), reader.last_line, header, profile)
            if self.rp is not None:
                self.rp.content = _Tags(self.out)
            self._read(events, reader)
        finally:
            reader.close()
        return self._result(reader.truncation if piece.end is None else None)

    def _restore(self, kf, line: int, header: ev.Header, profile) -> None:
        if type(kf) is not ev.Keyframe or line != self.piece.start:
            raise KeyframeError(f"line {self.piece.start} holds no keyframe")
        self.out.events += 1
        if "root" not in kf.state and "stopped" in kf.state:
            self.out.replayed = False   # made after the replay stopped: this piece reads on
            return
        self.rp = restore(kf, header, self.piece.path, profile)
        self.restored_back = {id(d) for d in self.rp.taken_back()}

    def _read(self, events, reader: TraceReader) -> None:
        """Feed the records up to the next piece's keyframe, and compare it."""
        end, out = self.piece.end, self.out
        feed = self.rp.feed if self.rp is not None else None
        n, top, last = 0, 0, None
        for e in events:
            line = reader.last_line
            if line == end:
                last = e
                break
            n += 1
            if feed is not None:
                feed(e, line)
            elif type(e) is ev.Step and e.step >= top:   # counted past a stop too
                top = e.step + 1
            if type(e) is ev.End:
                out.end = e
        out.events += n
        out.steps_in_trace = top
        if end is not None:
            self._compare(last)

    def _compare(self, kf) -> None:
        """Whether the next keyframe holds the state this replay reached."""
        if type(kf) is not ev.Keyframe:
            raise KeyframeError(f"line {self.piece.end} holds no keyframe")
        rp = self.rp
        if rp is not None and not rp.stopped:
            self.out.matches_next = "root" in kf.state and _same_state(take(rp), kf.state)

    def _result(self, truncation: str | None) -> PieceResult:
        out, rp = self.out, self.rp
        out.truncation = truncation
        if rp is None:
            return out
        if self.piece.end is None:   # the trace's end: what replay checks there only
            rp.put_into(ReplayResult(path=self.piece.path, header=rp.header), truncation)
        own = {id(d): i for i, d in enumerate(rp.divergences)}
        for d in rp.taken_back():
            if id(d) in own:
                out.taken_back.append(own[id(d)])
            elif id(d) not in self.restored_back:   # a copy of an earlier piece's report
                out.taken_back_earlier.append(report_key(d))
        out.divergences = rp.divergences
        out.steps, out.steps_in_trace = rp.steps, max(rp.steps_in_trace, rp.steps)
        out.stopped, out.stop = rp.stopped, rp.stop
        out.audit = rp.data_path.checked
        return out


def _same_state(state: dict, kept: dict) -> bool:
    """Whether two keyframe states are the same, but the KV audit's counts
    (a piece counts its own from its start)."""
    return _comparable(state) == _comparable(kept)


def _comparable(state: dict) -> object:
    """``state`` as JSON data, each set's members in one order (a set's order
    follows its process's string hashes), without the KV audit's counts."""
    data = _sets_sorted(msgspec.json.decode(msgspec.json.encode(state)))
    for obj in data.get("objects", ()):
        if isinstance(obj, dict) and obj.get("o") == _DATA_PATH:
            obj.get("f", {}).pop("checked", None)
    return data


def _sets_sorted(x):
    """Snapshot data (snapshot.py) with each set's members sorted."""
    if type(x) is list:
        return [_sets_sorted(v) if type(v) in _NESTED else v for v in x]
    if "o" in x and "f" in x:   # an object: its fields by name
        return {**x, "f": {k: _sets_sorted(v) if type(v) in _NESTED else v
                           for k, v in x["f"].items()}}
    if len(x) == 1 and ("s" in x or "fs" in x):   # a set, a frozenset
        (tag, members), = x.items()
        return {tag: sorted((_sets_sorted(m) if type(m) in _NESTED else m for m in members),
                            key=msgspec.json.encode)}
    return {k: _sets_sorted(v) if type(v) in _NESTED else v for k, v in x.items()}


_NESTED = (dict, list)


def report_key(d: Divergence) -> bytes:
    """A report, by its fields but the line (a keyframe's copy of a report
    may come from a trace with other lines)."""
    return msgspec.json.encode([d.step, d.req, d.field, d.recorded, d.expected, d.rule,
                                d.kind, d.seq])


# -- the content check --------------------------------------------------------------


def check_content(job: ContentJob):
    """The content check of the whole trace (kv_content/worker.py's
    ``WholeCheck``), or the message of an error."""
    from .kv_content.worker import check_whole

    try:
        return check_whole(job.path, job.device, job.session_keeps_sampled)
    except Exception as e:
        return _internal(e)


# -- the merge ----------------------------------------------------------------------


def merge(split: Split, pieces: list[PieceResult], content=None) -> ReplayResult:
    """The report of a serial replay of ``split``'s trace, from its pieces'
    results (in trace order) and the content check's (``check_content``; None
    when ``split.content`` is). Raises Unsplittable where only a serial
    replay can say, SplitError for a piece or check that failed."""
    # The pieces replayed: up to the one that stopped (an engine assertion).
    upto = next((i for i, p in enumerate(pieces) if p.stopped), len(pieces) - 1)
    for i, p in enumerate(pieces):
        verdict(split, i, p, i > upto)
    result = split.result()
    divs: list[Divergence] = []
    back: list[Divergence] = []
    lines, before, audit = array("q"), array("q"), Counter()
    for p in pieces[:upto + 1]:
        back += [_made(divs, key, p) for key in p.taken_back_earlier]
        back += [p.divergences[i] for i in p.taken_back]
        lines.extend(p.tag_lines)
        before.extend(b + len(divs) for b in p.tag_before)
        divs += p.divergences
        audit.update(p.audit)
    if split.content is not None:
        divs = _with_content(result, divs, lines, before, content)
    gone = {id(d) for d in back}
    result.divergences = [d for d in divs if id(d) not in gone]
    last, stopped = pieces[-1], pieces[upto]
    result.events = sum(p.events for p in pieces)
    result.end, result.truncation = last.end, last.truncation
    result.steps, result.stopped, result.stopped_at = stopped.steps, stopped.stopped, stopped.stop
    result.steps_in_trace = max(max(p.steps_in_trace for p in pieces), result.steps)
    result.audit = data_path_summary(audit, split.header)
    return result


def verdict(split: Split, i: int, p: PieceResult, after_stop: bool = False) -> None:
    """Raise what piece ``i``'s result says is wrong, if anything.
    ``after_stop``: a piece before it stopped (its replay does not count;
    unusable input in it still does)."""
    where = f"{split.path}: piece {i + 1} of {len(split.pieces)} (from line {p.start or 1})"
    if p.error is not None:
        kind, message = p.error
        if kind == "internal":
            raise SplitError(f"{where}: {message}")
        raise Unsplittable(message, None if kind == "input" else
                           f"{split.path}: {message}: replayed serially")
    if after_stop:
        return
    if not p.replayed:
        raise Unsplittable(f"{where}: its keyframe says the replay had stopped before it",
                           f"{split.path}: the keyframe at line {p.start} says the replay had "
                           "stopped before it, and it had not: replayed serially")
    if p.matches_next is False:
        end = split.pieces[i].end
        raise Unsplittable(f"{where}: the keyframe at line {end} differs",
                           f"{split.path}: the keyframe at line {end} does not hold the state "
                           "this kvtrace's replay reaches there (made by another kvtrace, or "
                           "edited?): replayed serially")


def _made(divs: list[Divergence], key: bytes, p: PieceResult) -> Divergence:
    """The report of an earlier piece that ``key`` names (a later piece took it back)."""
    for d in divs:
        if d.field == "progress" and report_key(d) == key:
            return d
    raise SplitError(f"the piece from line {p.start} took back a report no piece before it made")


def _with_content(result: ReplayResult, divs: list[Divergence], lines: array, before: array,
                  checked) -> list[Divergence]:
    """``divs`` with the content check's divergences placed as a serial replay
    places them (Replayer._place); its counts and device into ``result``."""
    if isinstance(checked, str):
        raise SplitError(f"{result.path}: the content check failed: {checked}")
    n = len(lines)
    if checked.device is None or len(checked.lines) < n or checked.lines[:n] != lines:
        end = checked.end or {"line": 0, "error": "no report"}
        raise SplitError(f"{result.path}: the content check stopped at line {end['line']} of "
                         f"the trace: {end['error'] or 'it found the end of the file there'}")
    out, at = [], 0
    for i in sorted(k for k in checked.found if k < n):
        out += divs[at:before[i]]
        out += checked.found[i]
        at = before[i]
    out += divs[at:]
    result.device = checked.device
    if n:
        result.slots_checked, result.states_checked = checked.slots[n - 1], checked.states[n - 1]
        result.assumed_loads = bool(checked.assumed[n - 1])
    return out


# -- running it ---------------------------------------------------------------------


def replay_split(split: Split, jobs: int, progress: Callable[[int], None] | None = None
                 ) -> ReplayResult:
    """Replay ``split`` on a pool of ``jobs`` processes, the content check
    first, then the pieces in order; ``progress`` is told how many pieces are
    done. Raises as ``merge`` does, as soon as a piece's result says so."""
    results: list[PieceResult | None] = [None] * len(split.pieces)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(max_workers=jobs, initializer=_child,
                                                       mp_context=_context(split)))
        stack.push(lambda *exc: stop_pool(pool) if exc[0] is not None else None)
        job = pool.submit(check_content, split.content) if split.content is not None else None
        futures = {pool.submit(replay_piece, p): i for i, p in enumerate(split.pieces)}
        for done, f in enumerate(as_completed(futures), 1):
            i = futures[f]
            results[i] = _outcome(split, f, f"piece {i + 1} (from line {split.pieces[i].start or 1})")
            if results[i].error is not None:   # no need to wait for the others
                verdict(split, i, results[i])
            if progress is not None:
                progress(done)
        checked = _outcome(split, job, "the content check") if job is not None else None
    return merge(split, results, checked)


def _context(split: Split):
    """How the pool's processes start: forked from this one, unless the content
    check runs on torch (this process may have asked CUDA about its devices,
    and a process forked after that cannot use CUDA): then forked from a
    server process that imported this module and nothing of torch."""
    if split.content is None or split.content.device == "numpy":
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _outcome(split: Split, future, what: str):
    try:
        return future.result()
    except BrokenProcessPool:
        raise SplitError(f"{split.path}: a process of the split replay ended before {what} "
                         "did (killed?)") from None


def _child() -> None:
    """A pool process: no progress line of its own (a forked child inherits the
    parent's), and Ctrl-C and SIGTERM left to the parent, which stops it."""
    from kvtrace.trace import reader

    reader.read_watchers.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
